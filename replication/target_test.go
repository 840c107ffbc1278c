package replication

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/mtcfs/mtcfs/tiers"
)

// A push meant for another agent instance (a stale registration whose address another agent
// now holds) is refused with UNAVAILABLE before anything is written; one meant for this agent,
// or naming none, is taken.
func TestReceiverRefusesCallsMeantForAnotherInstance(t *testing.T) {
	rnd := rand.New(rand.NewPCG(21, 22))
	src, name := makeTree(t, rnd, peerChunk)
	p := startPeer(t, func(c *ReceiverConfig) { c.Instance = "agent-A" })
	conn := dial(t, p.addr)
	s := testSender(2)

	err := s.Push(WithTarget(t.Context(), "agent-B"), conn, pushReq(name, src))
	require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
	require.ErrorContains(t, err, "stale registration")
	require.Empty(t, p.acceptedCalls())

	require.NoError(t, s.Push(WithTarget(t.Context(), "agent-A"), conn, pushReq(name, src)))
	src2, name2 := makeTree(t, rnd, peerChunk+1)
	require.NoError(t, s.Push(t.Context(), conn, pushReq(name2, src2)), "a call naming no target (static peers) is taken")
	require.Len(t, p.acceptedCalls(), 2)
}

// A remote coordinator whose registry lookup names another instance than the agent now at the
// address is refused, looks again, and reaches the right one.
func TestRemoteCoordinatorLooksAgainAfterAStaleTarget(t *testing.T) {
	job := NewJob(Options{})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	svc, err := NewCoordinatorService(CoordinatorServiceConfig{Job: job, Secrets: StaticSecret(testJob, coordSecret),
		Instance: "rank0-new", Logger: quietLogger()})
	require.NoError(t, err)
	srv := grpc.NewServer(ServerOptions()...)
	svc.Register(srv)
	go srv.Serve(ln)
	t.Cleanup(srv.Stop)

	var lookups atomic.Int32
	r, err := NewRemoteCoordinator(RemoteCoordinatorConfig{
		Target: func(context.Context) (string, string, error) {
			if lookups.Add(1) == 1 {
				return ln.Addr().String(), "rank0-old", nil // the killed agent's registration
			}
			return ln.Addr().String(), "rank0-new", nil
		},
		Secret: coordSecret, Instance: "rank1", RetryMin: 5 * time.Millisecond, RetryMax: 50 * time.Millisecond, Logger: quietLogger(),
	})
	require.NoError(t, err)
	t.Cleanup(func() { r.Close() })

	// One node: rank 1 of a two-node job negotiates while rank 0 joins in process.
	const nodes = 2
	done := make(chan error, 1)
	go func() {
		_, err := LocalClient{Job: job}.Negotiate(t.Context(), agentInc("a0", 0, nodes), own(0))
		done <- err
	}()
	_, err = r.Negotiate(t.Context(), agentInc("a1", 1, nodes), own(1))
	require.NoError(t, err)
	require.NoError(t, <-done)
	require.GreaterOrEqual(t, lookups.Load(), int32(2), "the refused call must look the address up again")
}

// TestWaitingForAStaleRankZero: a coordinator call refused as meant for another instance (rank
// 0's agent restarted at the address registered) is told as such while it waits, with what ends
// the wait; before, it read as any not-yet-answered call, beside "the restore goes on once they
// report" (a black-box run).
func TestWaitingForAStaleRankZero(t *testing.T) {
	r := &RemoteCoordinator{}
	r.setFailing(fmt.Errorf("coordinator Negotiate at 127.0.0.1:1: %w", checkTarget(
		metadata.NewIncomingContext(t.Context(), metadata.Pairs(targetKey, "old")), "new")))
	what, nodes := r.WaitingFor(tiers.Incarnation{})
	assert.True(t, nodes)
	assert.Contains(t, what, "rank 0's agent restarted")
	assert.Contains(t, what, "restart the job")
	r.setFailing(errors.New("connection refused"))
	what, _ = r.WaitingFor(tiers.Incarnation{})
	assert.Equal(t, "the coordinator (rank 0) has not answered yet: connection refused", what)
}
