package main

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestStaticPeersLackingARank: an agent started with --peers that lacks a rank of the job the
// yaml describes refuses the job in replicator.failed, naming the missing ranks, instead of
// waiting for a rank it cannot reach (the job's restore then timed out after 300 s, and its
// pushes to that rank failed). A one-node job needs no peers.
func TestStaticPeersLackingARank(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	n := newRepNode(t)
	a := n.start(t, "--peers", "0=127.0.0.1:1,2=127.0.0.1:3")

	o := orbaxClient(t, n.dir, "sp", 30)
	o.Nodes, o.PeerRanks = 4, []int{1}
	_, _, err := o.Start(ctx)
	require.Error(t, err, "a job the --peers map cannot serve must fail\n%s", a.log())
	assert.Contains(t, err.Error(), "nodes: 4, but this node's agent was started with --peers lacking rank 1, 3: every rank of the job must be listed")

	o = orbaxClient(t, n.dir, "sp", 30) // one node: no peers to find
	_, found, err := o.Start(ctx)
	require.NoError(t, err, a.log())
	assert.False(t, found)
	stopAgent(t, a)
}
