package replication

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mtcfs/mtcfs/tiers"
)

// TestCoordinatorSaysWhomItWaitsFor: while Negotiate and Restored wait for every rank, rank 0's
// client names the ranks not heard from (what the restore shows in status, the log and
// replicator.errors when a node's agent never comes).
func TestCoordinatorSaysWhomItWaitsFor(t *testing.T) {
	t.Parallel()
	job := NewJob(Options{Store: &fakeStore{}, Clock: newFakeClock()})
	client := LocalClient{Job: job}
	waiting := func(inc tiers.Incarnation) string {
		what, nodes := client.WaitingFor(inc)
		assert.Equal(t, what != "", nodes, "a wait for ranks is a wait for nodes: %q", what)
		return what
	}
	incOf := func(rank int) tiers.Incarnation {
		cfg := *testConfig(3)
		cfg.NodeRank = rank
		return tiers.Incarnation{ID: fmt.Sprintf("inc-%d", rank), Config: &cfg}
	}
	assert.Empty(t, waiting(incOf(0)), "no negotiation yet")

	ctx := t.Context()
	negotiate := func(rank int) <-chan error {
		return async(func() error { _, err := client.Negotiate(ctx, incOf(rank), own(rank, 10)); return err })
	}
	n0 := negotiate(0)
	// The coordinator exists (the wait is said) a moment before it counted rank 0's inventory: a
	// make test run looked in between.
	require.Eventually(t, func() bool {
		return waiting(incOf(0)) == "1 of 3 nodes sent their inventory to the coordinator (rank 0); not yet rank 1, 2"
	}, 10*time.Second, time.Millisecond, waiting(incOf(0)))
	n2 := negotiate(2)
	require.Eventually(t, func() bool {
		return waiting(incOf(0)) == "2 of 3 nodes sent their inventory to the coordinator (rank 0); not yet rank 1"
	}, 10*time.Second, time.Millisecond, waiting(incOf(0)))
	stillWaiting(t, n0, "rank 0's negotiation")
	require.NoError(t, result(t, negotiate(1), "rank 1's negotiation"))
	require.NoError(t, result(t, n0, "rank 0's negotiation"))
	require.NoError(t, result(t, n2, "rank 2's negotiation"))

	assert.Equal(t, "0 of 3 nodes restored; not yet rank 0, 1, 2", waiting(incOf(0)))
	r1 := async(func() error { return client.Restored(ctx, incOf(1)) })
	require.Eventually(t, func() bool {
		return waiting(incOf(0)) == "1 of 3 nodes restored; not yet rank 0, 2"
	}, 10*time.Second, time.Millisecond, waiting(incOf(0)))
	stillWaiting(t, r1, "rank 1's restore barrier")
	r0 := async(func() error { return client.Restored(ctx, incOf(0)) })
	require.NoError(t, client.Restored(ctx, incOf(2)))
	require.NoError(t, result(t, r0, "rank 0's restore barrier"))
	require.NoError(t, result(t, r1, "rank 1's restore barrier"))
	assert.Empty(t, waiting(incOf(0)), "nothing left to wait for")
	assert.Empty(t, waiting(tiers.Incarnation{ID: "other", Config: incOf(0).Config}), "not this coordinator's incarnation")
}

// TestRemoteCoordinatorSaysWhyItWaits: a rank whose coordinator cannot be found says why while
// it retries, and says it waits for rank 0 once rank 0 answers.
func TestRemoteCoordinatorSaysWhyItWaits(t *testing.T) {
	t.Parallel()
	job := NewJob(Options{})
	addr := startCoordinatorService(t, job)
	var registered atomic.Bool
	r, err := NewRemoteCoordinator(RemoteCoordinatorConfig{
		Target: func(context.Context) (string, string, error) {
			if !registered.Load() {
				return "", "", errors.New("rank 0 of job j has not registered in file:///b")
			}
			return addr, "", nil
		},
		Secret: coordSecret, Instance: "rank1", RetryMin: 5 * time.Millisecond, RetryMax: 20 * time.Millisecond, Logger: quietLogger(),
	})
	require.NoError(t, err)
	t.Cleanup(func() { r.Close() })

	const nodes = 3
	inc1 := agentInc("a1", 1, nodes)
	waiting := func() string {
		what, forNodes := r.WaitingFor(inc1)
		assert.True(t, forNodes, "rank 1 waits for rank 0: %q", what)
		return what
	}
	n1 := async(func() error { _, err := r.Negotiate(t.Context(), inc1, own(1)); return err })
	require.Eventually(t, func() bool {
		return strings.Contains(waiting(), "has not answered yet") && strings.Contains(waiting(), "has not registered")
	}, 10*time.Second, time.Millisecond, waiting())
	registered.Store(true)
	n0 := async(func() error {
		_, err := LocalClient{Job: job}.Negotiate(t.Context(), agentInc("a0", 0, nodes), own(0))
		return err
	})
	require.Eventually(t, func() bool {
		return strings.HasPrefix(waiting(), "the coordinator (rank 0), which answers once every node got as far")
	}, 10*time.Second, time.Millisecond, waiting())
	stillWaiting(t, n1, "rank 1's negotiation")
	_, err = LocalClient{Job: job}.Negotiate(t.Context(), agentInc("a2", 2, nodes), own(2))
	require.NoError(t, err)
	require.NoError(t, result(t, n1, "rank 1's negotiation"))
	require.NoError(t, result(t, n0, "rank 0's negotiation"))
}

// TestTwoNodesClaimingOneRank: two agents get a replicator.yaml with node-rank 0 (a wrong rank
// in one node's environment). Both wait for ranks that never come; the other ranks talk to the
// one registered last. Before, nothing named the duplicate; now the agent registered first
// says, in what it waits for (mtcfs status, the log, replicator.errors), that another agent
// took its rank.
func TestTwoNodesClaimingOneRank(t *testing.T) {
	t.Parallel()
	objects := dirObjects(t, t.TempDir())
	a := startTestAgent(t, objects, t.TempDir())
	b := startTestAgent(t, objects, t.TempDir())
	incOf := func(id string) tiers.Incarnation {
		cfg := *testConfig(2)
		cfg.JobName = "dup"
		return tiers.Incarnation{ID: id, Config: &cfg}
	}
	incA, incB := incOf("inc-a"), incOf("inc-b")
	for _, n := range []*Node{a.node, b.node} {
		n.mu.Lock()
		n.claimEvery = 50 * time.Millisecond
		n.mu.Unlock()
	}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	negotiating := func(n *Node, inc tiers.Incarnation) <-chan error {
		ch := async(func() error {
			_, err := n.Negotiate(ctx, inc, tiers.Inventory{Rank: 0, Metas: map[string]string{}})
			return err
		})
		// Registered, and waiting at the coordinator (before, it reads the job's secret and
		// registers, and says so).
		require.Eventually(t, func() bool { what, _ := n.WaitingFor(inc); return strings.Contains(what, "not yet rank") }, 10*time.Second, time.Millisecond)
		return ch
	}
	doneA := negotiating(a.node, incA)
	doneB := negotiating(b.node, incB) // registers after a
	require.Eventually(t, func() bool {
		what, _ := a.node.WaitingFor(incA)
		return strings.Contains(what, "two nodes claim rank 0")
	}, 30*time.Second, 10*time.Millisecond)
	what, _ := a.node.WaitingFor(incA)
	assert.Contains(t, what, "not yet rank 1; another agent (at "+b.node.addr+") registered as rank 0 of job dup after this one")
	assert.Contains(t, what, "(check node-rank in each node's replicator.yaml)")
	// b is the registered one: it waits for rank 1 only (once its own check has run).
	require.Eventually(t, func() bool {
		b.node.mu.Lock()
		defer b.node.mu.Unlock()
		c := b.node.claims["dup"]
		return c != nil && !c.checked.IsZero()
	}, 30*time.Second, 10*time.Millisecond)
	what, _ = b.node.WaitingFor(incB)
	assert.NotContains(t, what, "claim rank 0", "the agent registered last is the one the others find")

	// b stops, and removes its registration: a is now registered nowhere, and says so.
	b.stop()
	require.Eventually(t, func() bool {
		what, _ := a.node.WaitingFor(incA)
		return strings.Contains(what, "this node's registration as rank 0 of job dup (dup/agents/0.json in ")
	}, 30*time.Second, 10*time.Millisecond)
	what, _ = a.node.WaitingFor(incA)
	assert.Contains(t, what, "the other ranks cannot find this node until the job restarts")
	cancel()
	<-doneA
	<-doneB
}
