package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

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

// TestStaleAgentNamedByStaticPeersTakesNoReplica: rank 1's machine was replaced, and rank 0's
// --peers still names the old machine's address, where an agent runs that serves no job (the
// old agent, back with its spool). It refuses rank 0's replica before any byte moves, so rank
// 0's step is not counted replicated on a node outside the job, and rank 0's log says why. It
// took the replica, status said "replicated on every node", and the step was lost with rank
// 0's RAM (a black-box run).
func TestStaleAgentNamedByStaticPeersTakesNoReplica(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	secret := filepath.Join(t.TempDir(), "secret")
	require.NoError(t, os.WriteFile(secret, []byte("static-peers-test-secret-0123456789\n"), 0o600))
	addrs := freeAddrs(t, "127.0.0.24", "127.0.0.25", "127.0.0.26") // rank 0, the stale agent, rank 1
	stale := newRepNode(t)
	stale.args = []string{"--listen", addrs[1], "--peers", "0=" + addrs[0] + ",1=" + addrs[1], "--peer-secret-file", secret}
	staleAgent := stale.start(t)
	c := &cluster{}
	for r, peers := range []string{"0=" + addrs[0] + ",1=" + addrs[1], "0=" + addrs[0] + ",1=" + addrs[2]} {
		node := newRepNode(t)
		node.args = []string{"--listen", addrs[2*r], "--peers", peers, "--peer-secret-file", secret}
		c.nodes = append(c.nodes, node)
		c.agents = append(c.agents, node.start(t))
	}
	c.all(t, func(r int) error {
		o := c.client(t, r)
		o.PeerRanks = []int{1 - r}
		if _, _, err := o.Start(ctx); err != nil {
			return err
		}
		return o.Save(ctx, 10)
	})
	// Rank 1's replica reaches rank 0; rank 0's goes to the stale agent, which refuses it.
	repWait(t, 20*time.Second, "rank 1's replica on rank 0", func() bool { return pathExists(rankMetaPath(c.nodes[0].dir, "trio", 10, 1)) })
	repWait(t, 20*time.Second, "the refusal in rank 0's log", func() bool { return strings.Contains(c.agents[0].log(), "serves no job") })
	assert.Contains(t, staleAgent.log(), "peer transfer refused")
	entries, err := os.ReadDir(stale.dir)
	require.NoError(t, err)
	for _, e := range entries {
		assert.NotContains(t, e.Name(), ".meta", "the stale agent holds a replica")
	}
	assert.False(t, pathExists(rankMetaPath(c.nodes[1].dir, "trio", 10, 0)), "rank 0's replica cannot be on rank 1: rank 0 does not know its address")
	out, code := runMtcfs(t, "status", c.nodes[0].dir, "--json")
	require.Equal(t, 0, code, out)
	assert.NotContains(t, out, `"latest_replicated_step": 10`, "rank 0's step 10 counted replicated")
}

// TestStaleAgentOfAnEarlierStartTakesNoReplica: as above, but the old machine's agent still
// runs and served the job before (its job's processes are gone): it still has an incarnation
// of the job, of an earlier start. The push carries the restore generation of rank 0's start,
// and the old agent, which took part in an earlier restore only, refuses it (a review: the
// check of "no incarnation" alone let it take the replica).
func TestStaleAgentOfAnEarlierStartTakesNoReplica(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	secret := filepath.Join(t.TempDir(), "secret")
	require.NoError(t, os.WriteFile(secret, []byte("static-peers-test-secret-0123456789\n"), 0o600))
	addrs := freeAddrs(t, "127.0.0.27", "127.0.0.28", "127.0.0.29") // rank 0, rank 1's old machine, its new one
	c := &cluster{}
	for r, peers := range []string{"0=" + addrs[0] + ",1=" + addrs[1], "0=" + addrs[0] + ",1=" + addrs[1]} {
		node := newRepNode(t)
		node.args = []string{"--listen", addrs[r], "--peers", peers, "--peer-secret-file", secret}
		c.nodes = append(c.nodes, node)
		c.agents = append(c.agents, node.start(t))
	}
	start := func(want int64, save int64) {
		c.all(t, func(r int) error {
			o := c.client(t, r)
			o.PeerRanks = []int{1 - r}
			if want > 0 {
				if err := restoresStep(ctx, o, want); err != nil {
					return err
				}
			} else if _, _, err := o.Start(ctx); err != nil {
				return err
			}
			return o.Save(ctx, save)
		})
	}
	start(0, 1)
	for r := range 2 {
		repWait(t, 20*time.Second, "step 1's replicas", func() bool { return pathExists(rankMetaPath(c.nodes[1-r].dir, "trio", 1, r)) })
	}
	// Rank 1's machine is replaced: a new agent at a new address; the old one keeps running,
	// and rank 0's --peers still names it.
	old, oldAgent := c.nodes[1], c.agents[1]
	fresh := newRepNode(t)
	fresh.args = []string{"--listen", addrs[2], "--peers", "0=" + addrs[0] + ",1=" + addrs[2], "--peer-secret-file", secret}
	c.nodes[1], c.agents[1] = fresh, fresh.start(t)
	start(1, 2) // rank 1 restores its step 1 from rank 0's replica
	repWait(t, 20*time.Second, "the refusal in rank 0's log", func() bool {
		return strings.Contains(c.agents[0].log(), "took part in restore")
	})
	assert.Contains(t, oldAgent.log(), "peer transfer refused")
	assert.False(t, pathExists(rankMetaPath(old.dir, "trio", 2, 0)), "the old agent holds rank 0's step 2")
	out, code := runMtcfs(t, "status", c.nodes[0].dir, "--json")
	require.Equal(t, 0, code, out)
	assert.NotContains(t, out, `"latest_replicated_step": 2`, "rank 0's step 2 counted replicated")
}
