package replication

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/mtcfs/mtcfs/replication/peerpb"
	"github.com/mtcfs/mtcfs/tiers"
)

var coordSecret = []byte("the coordinator's shared secret")

func quietLogger() *slog.Logger {
	if testing.Verbose() {
		return slog.Default()
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// startCoordinatorService serves job's coordinator service on a loopback port and returns its
// address.
func startCoordinatorService(t *testing.T, job *Job) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	return serveCoordinator(t, job, ln)
}

func serveCoordinator(t *testing.T, job *Job, ln net.Listener) string {
	t.Helper()
	svc, err := NewCoordinatorService(CoordinatorServiceConfig{Job: job, Secrets: StaticSecret(testJob, coordSecret), Logger: quietLogger()})
	require.NoError(t, err)
	srv := grpc.NewServer(ServerOptions()...)
	svc.Register(srv)
	go srv.Serve(ln)
	t.Cleanup(srv.Stop)
	return ln.Addr().String()
}

func newRemote(t *testing.T, addr func(context.Context) (string, error), secret []byte) *RemoteCoordinator {
	t.Helper()
	r, err := NewRemoteCoordinator(RemoteCoordinatorConfig{
		Addr: addr, Secret: secret, Instance: "instance-" + t.Name(),
		RetryMin: 5 * time.Millisecond, RetryMax: 50 * time.Millisecond, Logger: quietLogger(),
	})
	require.NoError(t, err)
	t.Cleanup(func() { r.Close() })
	return r
}

func fixedAddr(addr string) func(context.Context) (string, error) {
	return func(context.Context) (string, error) { return addr, nil }
}

// coordinatorJob is three ranks over loopback gRPC: rank 0 calls the Job in process, ranks 1
// and 2 through RemoteCoordinators.
type coordinatorJob struct {
	job     *Job
	clock   *fakeClock
	clients []tiers.Coordinator // by rank
	incs    []tiers.Incarnation // by rank
}

func newCoordinatorJob(t *testing.T, nodes int, opts Options) coordinatorJob {
	t.Helper()
	j := coordinatorJob{job: NewJob(opts)}
	addr := startCoordinatorService(t, j.job)
	for r := 0; r < nodes; r++ {
		j.incs = append(j.incs, agentInc("agent-"+string(rune('a'+r)), r, nodes))
		if r == 0 {
			j.clients = append(j.clients, LocalClient{Job: j.job})
		} else {
			j.clients = append(j.clients, newRemote(t, fixedAddr(addr), coordSecret))
		}
	}
	return j
}

func TestCoordinatorServiceThreeRanks(t *testing.T) {
	t.Parallel()
	const nodes = 3
	clock := newFakeClock()
	j := newCoordinatorJob(t, nodes, Options{Clock: clock, Store: &fakeStore{backups: map[string][]tiers.BackupStep{}}})
	for r := range j.incs {
		j.incs[r].Config.BackupIntervalSteps = 2
	}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()

	// Negotiation: rank 2 holds only step 10, so 10 is the highest step complete everywhere.
	// Ranks 1 and 2 start first and retry until rank 0 started the incarnation.
	invs := []tiers.Inventory{own(0, 10, 20), own(1, 10, 20), own(2, 10)}
	plans := make([]tiers.RestorePlan, nodes)
	var wg sync.WaitGroup
	for r := nodes - 1; r >= 0; r-- {
		wg.Go(func() {
			var err error
			plans[r], err = j.clients[r].Negotiate(ctx, j.incs[r], invs[r])
			assert.NoError(t, err, "rank %d", r)
		})
		if r > 0 {
			time.Sleep(20 * time.Millisecond)
		}
	}
	wg.Wait()
	require.False(t, t.Failed())
	for r, p := range plans {
		assert.True(t, p.Found, "rank %d", r)
		assert.Equal(t, int64(10), p.Step, "rank %d", r)
		assert.Equal(t, plans[0].Backup, p.Backup, "rank %d", r)
		assert.Equal(t, plans[0].Errors, p.Errors, "rank %d", r)
		assert.Equal(t, plans[0].Pinned, p.Pinned, "rank %d", r)
		assert.Equal(t, map[tiers.Slot]string{{Rank: r, Worker: 0}: dataOf(r, 10)}, p.Data, "rank %d", r)
		assert.Equal(t, map[string][]int{dataOf(r, 10): {r}}, p.Holders, "rank %d", r)
	}

	// The Restored barrier holds until every rank arrived.
	var restored []<-chan error
	for r := 1; r < nodes; r++ {
		restored = append(restored, async(func() error { return j.clients[r].Restored(ctx, j.incs[r]) }))
	}
	for _, ch := range restored {
		stillWaiting(t, ch, "Restored before rank 0")
	}
	require.NoError(t, j.clients[0].Restored(ctx, j.incs[0]))
	for _, ch := range restored {
		require.NoError(t, result(t, ch, "Restored"))
	}

	// Syncs: the same decision for every rank; a backup every 2 steps, ordered through Backups
	// and complete once every rank reported its part done. The restored step is in no backup,
	// so the first synced step is backed up at once.
	var done string // the last order, reported done by every rank with its next call
	for i, want := range []string{"2030-01-02_03-01", "", "2030-01-02_03-03", ""} {
		clock.Advance(time.Minute)
		step := int64(11 + i)
		decs := make([]tiers.SyncDecision, nodes)
		orders := make([]tiers.BackupOrder, nodes)
		for r := range nodes {
			wg.Go(func() {
				var err error
				// Step 12 is not replicated on rank 2: the decision carries that to every rank.
				decs[r], err = j.clients[r].Sync(ctx, j.incs[r], tiers.SyncReport{Step: step, Replicated: step != 12 || r != 2})
				assert.NoError(t, err, "step %d rank %d", step, r)
				// With an order due, the call returns it at once: wait long enough for a loaded
				// machine. Without one, it waits until its deadline: keep that short.
				wait := 200 * time.Millisecond
				if want != "" {
					wait = 20 * time.Second
				}
				short, cancel := context.WithTimeout(ctx, wait)
				defer cancel()
				orders[r], err = j.clients[r].Backups(short, j.incs[r], tiers.BackupReport{Done: done})
				assert.NoError(t, err, "step %d rank %d", step, r)
			})
		}
		wg.Wait()
		for r, d := range decs {
			assert.Equal(t, step != 12, d.Replicated, "step %d rank %d: replicated", step, r)
			assert.Equal(t, want, orders[r].Backup, "step %d rank %d: backup order", step, r)
			if want != "" {
				assert.Equal(t, step, orders[r].Step, "rank %d", r)
			}
		}
		if want != "" {
			done = want
		}
	}

	// A repeated report (a retried request) gets the same decision.
	dec, err := j.clients[1].Sync(ctx, j.incs[1], tiers.SyncReport{Step: 14})
	require.NoError(t, err)
	assert.True(t, dec.Replicated)

	// A call of an incarnation that never negotiated is refused, and matches the coordinator's
	// error.
	stranger := agentInc("stranger", 1, nodes)
	stranger.Config.BackupIntervalSteps = 2
	_, err = j.clients[1].Sync(ctx, stranger, tiers.SyncReport{Step: 15})
	require.Error(t, err)
	assert.Equal(t, codes.FailedPrecondition, status.Code(err), "%v", err)
	assert.ErrorIs(t, err, ErrOtherIncarnation)
}

// A rank's failed restore, said through the service, fails the other ranks' Restored calls
// through it, with the reason and an error that matches ErrRestoreFailed.
func TestCoordinatorServiceRestoreFailed(t *testing.T) {
	t.Parallel()
	const nodes = 3
	j := newCoordinatorJob(t, nodes, Options{Clock: newFakeClock()})
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	for r := range nodes {
		wg.Go(func() {
			_, err := j.clients[r].Negotiate(ctx, j.incs[r], own(r, 10))
			assert.NoError(t, err, "rank %d", r)
		})
	}
	wg.Wait()
	require.False(t, t.Failed())
	waiting := async(func() error { return j.clients[1].Restored(ctx, j.incs[1]) })
	stillWaiting(t, waiting, "Restored")
	require.NoError(t, j.clients[2].(tiers.RestoreFailureReporter).RestoreFailed(ctx, j.incs[2], "restore of step 10 failed: gone"))
	err := result(t, waiting, "Restored")
	require.Error(t, err)
	assert.ErrorIs(t, err, ErrRestoreFailed)
	assert.Equal(t, codes.Aborted, status.Code(err), "not retried: %v", err)
	assert.ErrorContains(t, err, "rank 2: restore of step 10 failed: gone")
	assert.ErrorIs(t, j.clients[0].Restored(ctx, j.incs[0]), ErrRestoreFailed)
}

func TestCoordinatorServiceRefusesWrongSecret(t *testing.T) {
	t.Parallel()
	job := NewJob(Options{})
	addr := startCoordinatorService(t, job)
	inc0 := agentInc("a0", 0, 2)
	go LocalClient{Job: job}.Negotiate(t.Context(), inc0, own(0, 1))
	require.Eventually(t, func() bool { return current(job) != nil }, 10*time.Second, time.Millisecond)

	calls := atomic.Int32{}
	r := newRemote(t, func(context.Context) (string, error) { calls.Add(1); return addr, nil }, []byte("not the secret"))
	_, err := r.Negotiate(t.Context(), agentInc("a1", 1, 2), own(1, 1))
	require.Error(t, err)
	assert.Equal(t, codes.Unauthenticated, status.Code(err), "%v", err)
	assert.Equal(t, int32(1), calls.Load(), "an unauthenticated call is not retried")
	assert.Error(t, r.Restored(t.Context(), agentInc("a1", 1, 2)))
	c := current(job)
	c.mu.Lock()
	assert.Equal(t, 1, c.nReported, "the refused inventory was not recorded")
	c.mu.Unlock()
}

func TestCoordinatorServiceRefusesOtherJobShape(t *testing.T) {
	t.Parallel()
	const nodes = 2
	job := NewJob(Options{})
	addr := startCoordinatorService(t, job)
	inc0 := agentInc("a0", 0, nodes)
	first := async(func() error { _, err := LocalClient{Job: job}.Negotiate(t.Context(), inc0, own(0, 1)); return err })
	require.Eventually(t, func() bool { return current(job) != nil }, 10*time.Second, time.Millisecond)
	cur := current(job)
	r := newRemote(t, fixedAddr(addr), coordSecret)
	r.cfg.ShapeGrace = -1 // refused at once (TestCoordinatorJobRestartedInAnotherShape waits)

	for name, change := range map[string]func(*tiers.Config){
		"nodes":           func(c *tiers.Config) { c.Nodes = 3 },
		"workers":         func(c *tiers.Config) { c.WorkersPerNode = 2 },
		"data parallel":   func(c *tiers.Config) { c.AssumeDataParallelism = 2 },
		"backup interval": func(c *tiers.Config) { c.BackupIntervalSteps, c.BackupIntervalMinutes = 0, 5 },
		"framework":       func(c *tiers.Config) { c.Framework = tiers.FrameworkPyTorch },
	} {
		inc := agentInc("a1-"+name, 1, nodes)
		change(inc.Config)
		_, err := r.Negotiate(t.Context(), inc, own(1, 1))
		require.Error(t, err, name)
		assert.Equal(t, codes.FailedPrecondition, status.Code(err), "%s: %v", name, err)
		assert.ErrorIs(t, err, ErrJobShape, name)
	}
	assert.Same(t, cur, current(job), "a refused call does not start an incarnation")
	stillWaiting(t, first, "rank 0's negotiation")
	// Rank 0's wait names the refused rank and why, not only "not yet rank 1".
	what, _ := LocalClient{Job: job}.WaitingFor(inc0)
	assert.Contains(t, what, "not yet rank 1")
	assert.Contains(t, what, "rank 1's agent is refused: rank 1: job shape differs from the coordinator's incarnation")

	// The right shape joins the incarnation.
	_, err := r.Negotiate(t.Context(), agentInc("a1", 1, nodes), own(1, 1))
	require.NoError(t, err)
	require.NoError(t, result(t, first, "rank 0's negotiation"))
}

// TestCoordinatorJobRestartedInAnotherShape: the job restarts with another shape (here 3 nodes
// → 2) and rank 1's agent reads its new replicator.yaml before rank 0's. Its Negotiate is
// refused for its shape while rank 0 still serves the old incarnation; before, rank 1 failed
// the restore at once (replicator.failed: FATAL), and the restarted job with it. Now it retries
// for the shape grace and joins once rank 0 takes the new shape; past the grace the refusal
// stands (a rank of another shape than rank 0's is misconfigured).
func TestCoordinatorJobRestartedInAnotherShape(t *testing.T) {
	t.Parallel()
	job := NewJob(Options{})
	addr := startCoordinatorService(t, job)
	old := async(func() error {
		_, err := LocalClient{Job: job}.Negotiate(t.Context(), agentInc("a0-old", 0, 3), own(0, 1))
		return err
	})
	require.Eventually(t, func() bool { return current(job) != nil }, 10*time.Second, time.Millisecond)

	r := newRemote(t, fixedAddr(addr), coordSecret)
	inc1 := agentInc("a1-new", 1, 2)
	joined := async(func() error { _, err := r.Negotiate(t.Context(), inc1, own(1, 1)); return err })
	// Refused for its shape, and retrying: what WaitingFor tells.
	require.Eventually(t, func() bool {
		what, _ := r.WaitingFor(inc1)
		return strings.Contains(what, "job shape differs")
	}, 10*time.Second, time.Millisecond)
	stillWaiting(t, joined, "rank 1's negotiation in the new shape")

	// Rank 0's agent reads its yaml: the new incarnation, of the new shape.
	first := async(func() error {
		_, err := LocalClient{Job: job}.Negotiate(t.Context(), agentInc("a0-new", 0, 2), own(0, 1))
		return err
	})
	require.NoError(t, result(t, joined, "rank 1's negotiation"))
	require.NoError(t, result(t, first, "rank 0's negotiation"))
	assert.ErrorIs(t, result(t, old, "the old incarnation's negotiation"), ErrClosed)

	// A rank whose shape rank 0 never takes is refused once the grace is over.
	r2 := newRemote(t, fixedAddr(addr), coordSecret)
	r2.cfg.ShapeGrace = 50 * time.Millisecond
	inc := agentInc("a1-wrong", 1, 2)
	inc.Config.WorkersPerNode = 2
	_, err := r2.Negotiate(t.Context(), inc, own(1, 1))
	assert.Equal(t, codes.FailedPrecondition, status.Code(err), "%v", err)
	assert.ErrorIs(t, err, ErrJobShape)
}

func TestCoordinatorServiceRefusesCallerOfAnotherRank(t *testing.T) {
	t.Parallel()
	job := NewJob(Options{})
	addr := startCoordinatorService(t, job)
	conn := dial(t, addr)
	inc := agentInc("a1", 1, 2)
	caller, err := callerToPB(inc)
	require.NoError(t, err)
	caller.Rank = 0 // speaks for rank 0 with rank 1's credentials
	creds := grpc.PerRPCCredentials(Credentials(Identity{Job: testJob, Incarnation: "a1", Rank: 1, Instance: "i"}, coordSecret))
	_, err = peerpb.NewCoordinatorClient(conn).Sync(t.Context(), &peerpb.SyncRequest{Caller: caller, Step: 1}, creds)
	assert.Equal(t, codes.PermissionDenied, status.Code(err), "%v", err)
}

// TestRestoredGivesUpOnAGoneCoordinator: a rank waiting for the others to restore gives up once
// rank 0's coordinator, which planned the restore, has not been reached for RestoredGiveUp, with
// the reason; a coordinator that holds the call is waited for however long. Before, every rank
// waited until its job gave up (330 s) when rank 0's agent died mid-restore (a black-box run).
func TestRestoredGivesUpOnAGoneCoordinator(t *testing.T) {
	t.Parallel()
	gone := newRemote(t, fixedAddr("127.0.0.1:1"), coordSecret) // port 1: never served here
	gone.cfg.RestoredGiveUp = 300 * time.Millisecond
	start := time.Now()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	err := gone.Restored(ctx, agentInc("a1", 1, 2))
	require.Error(t, err)
	assert.Contains(t, err.Error(), "rank 0's coordinator, which planned this restore, was not reached for")
	assert.Contains(t, err.Error(), "restart the job")
	assert.Less(t, time.Since(start), 20*time.Second, "given up, not waited for the context")

	// A coordinator that holds the call: waited for past the give-up time.
	const nodes = 2
	job := NewJob(Options{})
	addr := startCoordinatorService(t, job)
	r := newRemote(t, fixedAddr(addr), coordSecret)
	r.cfg.RestoredGiveUp = 300 * time.Millisecond
	inc1 := agentInc("a1", 1, nodes)
	p0 := async(func() error {
		_, err := LocalClient{Job: job}.Negotiate(t.Context(), agentInc("a0", 0, nodes), own(0, 5))
		return err
	})
	_, err = r.Negotiate(t.Context(), inc1, own(1, 5))
	require.NoError(t, err)
	require.NoError(t, result(t, p0, "rank 0's negotiation"))
	held := async(func() error { return r.Restored(t.Context(), inc1) })
	time.Sleep(time.Second)
	stillWaiting(t, held, "rank 1 waiting for rank 0's restore")
	require.NoError(t, LocalClient{Job: job}.Restored(t.Context(), agentInc("a0", 0, nodes)))
	require.NoError(t, result(t, held, "rank 1's Restored"))

	// A held call cut, then held again and cut again, past the give-up time in all: each hold
	// (the coordinator's header) starts the count again, so the rank goes on waiting.
	job2 := NewJob(Options{})
	p := newFaultProxy(t, startCoordinatorService(t, job2))
	r2 := newRemote(t, fixedAddr(p.Addr()), coordSecret)
	r2.cfg.RestoredGiveUp = time.Second // a reconnection through the proxy takes milliseconds
	p0 = async(func() error {
		_, err := LocalClient{Job: job2}.Negotiate(t.Context(), agentInc("b0", 0, nodes), own(0, 5))
		return err
	})
	inc1 = agentInc("b1", 1, nodes)
	_, err = r2.Negotiate(t.Context(), inc1, own(1, 5))
	require.NoError(t, err)
	require.NoError(t, result(t, p0, "rank 0's negotiation"))
	held = async(func() error { return r2.Restored(t.Context(), inc1) })
	for range 3 {
		time.Sleep(1500 * time.Millisecond) // longer than the give-up time
		stillWaiting(t, held, "rank 1 held by rank 0, its link cut")
		p.ResetAll()
	}
	time.Sleep(500 * time.Millisecond)
	stillWaiting(t, held, "rank 1 held by rank 0 after the cuts")
	require.NoError(t, LocalClient{Job: job2}.Restored(t.Context(), agentInc("b0", 0, nodes)))
	require.NoError(t, result(t, held, "rank 1's Restored after the cuts"))
}

func TestRemoteCoordinatorRetriesUntilServerUp(t *testing.T) {
	t.Parallel()
	const nodes = 2
	// Discovery first names a port nobody listens on, then the server once it is up. Port 1
	// (tcpmux, never served here) rather than a port found free: the parallel tests of this
	// package start coordinators on 127.0.0.1:0, and one could take a freed port.
	deadAddr := "127.0.0.1:1"
	var addr atomic.Value
	addr.Store(deadAddr)
	lookups := atomic.Int32{}
	r := newRemote(t, func(context.Context) (string, error) {
		lookups.Add(1)
		return addr.Load().(string), nil
	}, coordSecret)

	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	var plan tiers.RestorePlan
	remote := async(func() (err error) {
		plan, err = r.Negotiate(ctx, agentInc("a1", 1, nodes), own(1, 5))
		return err
	})
	require.Eventually(t, func() bool { return lookups.Load() >= 3 }, 10*time.Second, time.Millisecond)
	stillWaiting(t, remote, "negotiation while rank 0 is down")

	job := NewJob(Options{})
	addr.Store(startCoordinatorService(t, job))
	p0, err := LocalClient{Job: job}.Negotiate(ctx, agentInc("a0", 0, nodes), own(0, 5))
	require.NoError(t, err)
	require.NoError(t, result(t, remote, "rank 1's negotiation"))
	assert.Equal(t, int64(5), p0.Step)
	assert.Equal(t, int64(5), plan.Step)
	assert.True(t, plan.Found)

	// A sync that waits for rank 0 ends with its context.
	short, cancelShort := context.WithTimeout(t.Context(), 100*time.Millisecond)
	defer cancelShort()
	_, err = r.Sync(short, agentInc("a1", 1, nodes), tiers.SyncReport{Step: 6})
	require.Error(t, err)
	assert.ErrorIs(t, err, context.DeadlineExceeded)

	// A context that ends while rank 0 is unreachable ends the retries with the last error
	// (2 s: at least one refused dial must finish first, also on a loaded machine).
	unreachable := newRemote(t, fixedAddr(deadAddr), coordSecret)
	short, cancelShort = context.WithTimeout(t.Context(), 2*time.Second)
	defer cancelShort()
	_, err = unreachable.Sync(short, agentInc("a1", 1, nodes), tiers.SyncReport{Step: 6})
	require.Error(t, err)
	assert.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
}

func TestCoordinatorPlanConversion(t *testing.T) {
	t.Parallel()
	plan := tiers.RestorePlan{
		Step: 42, Found: true, Backup: "2030-01-02_03-04", Pinned: "2030-01-01_00-00", BackedUpIn: "2030-01-02_03-05",
		LastBackup: "2030-01-02_03-03", LastBackupStep: 41,
		Data:       map[tiers.Slot]string{{Rank: 3, Worker: 0}: hashOf("a"), {Rank: 3, Worker: 1}: hashOf("b")},
		Holders:    map[string][]int{hashOf("a"): {1, 3}, hashOf("b"): {}},
		Errors:     []string{"one", "two"},
		Generation: 5, StaleAbove: map[int]int64{2: 3, 3: -1},
	}
	assert.Equal(t, plan, planFromPB(planToPB(plan)))
	// An error naming a path that is not UTF-8 (a damaged backup's file "caf\xe9") still goes
	// on the wire: protobuf refuses such a string, and the plan failed to marshal.
	plan.Errors = []string{"backup 2030: caf\xe9 is missing"}
	_, err := proto.Marshal(planToPB(plan))
	require.NoError(t, err)
	assert.Equal(t, []string{"backup 2030: caf\uFFFD is missing"}, planFromPB(planToPB(plan)).Errors)
	empty := planFromPB(planToPB(tiers.RestorePlan{}))
	assert.Equal(t, tiers.RestorePlan{Data: map[tiers.Slot]string{}, Holders: map[string][]int{}}, empty)

	inv := own(2, 7, 8)
	assert.Equal(t, inv, inventoryFromPB(2, inventoryToPB(inv)))
	inv.Shape = tiers.Shape{Nodes: 4, Workers: 2, DataParallelism: 2}
	assert.Equal(t, inv, inventoryFromPB(2, inventoryToPB(inv)), "the saved shape travels")
	inv.Timeline = tiers.Timeline{Generation: 4, Restores: map[int64]int64{4: 8, 3: -1}, Floor: 6}
	assert.Equal(t, inv, inventoryFromPB(2, inventoryToPB(inv)), "the timeline travels")
	inv.Timeline = tiers.Timeline{Floor: 6}
	assert.Equal(t, inv, inventoryFromPB(2, inventoryToPB(inv)), "the floor travels without a timeline")
	bad := inventoryToPB(inv)
	bad.SavedShape.WorkersPerNode = 0
	assert.Equal(t, tiers.Shape{}, inventoryFromPB(2, bad).Shape, "a shape no job has is unknown")
	assert.Equal(t, tiers.Inventory{Rank: 1, Metas: map[string]string{}}, inventoryFromPB(1, nil))

	inc := agentInc("x", 1, 4)
	inc.Config.AssumeDataParallelism, inc.Config.BackupIntervalMinutes, inc.Config.BackupIntervalSteps = 2, 7.5, 0
	caller, err := callerToPB(inc)
	require.NoError(t, err)
	got := configFromPB(caller.GetShape(), int(caller.GetRank()))
	assert.Equal(t, inc.Config, got)
}

// Only rank 0 starts an incarnation, and an agent that is another rank now coordinates nobody
// (Job.Resign): a job restarted with rank 0 on another machine, whose former rank-0 agent
// still ran, had the ranks that looked up rank 0 too early start an incarnation of their own on
// the former agent, and waited there for ever (found by a black-box run).
func TestOnlyRankZeroStartsAnIncarnation(t *testing.T) {
	t.Parallel()
	const nodes = 3
	j := newCoordinatorJob(t, nodes, Options{})
	ctx := t.Context()
	negotiate := func(r int, inc tiers.Incarnation) <-chan error {
		return async(func() error {
			_, err := j.clients[r].Negotiate(ctx, inc, tiers.Inventory{Rank: r})
			return err
		})
	}
	// Incarnation A, negotiated by every rank.
	var waits []<-chan error
	for r := range nodes {
		waits = append(waits, negotiate(r, agentInc(fmt.Sprint("a", r), r, nodes)))
	}
	for _, ch := range waits {
		require.NoError(t, result(t, ch, "Negotiate of A"))
	}
	a := current(j.job)
	refused := func(r int) {
		t.Helper()
		rc := j.clients[r].(*RemoteCoordinator)
		require.Eventually(t, func() bool {
			what, _ := rc.WaitingFor(tiers.Incarnation{})
			return strings.Contains(what, errNotRankZero.Error())
		}, 10*time.Second, time.Millisecond, "rank %d was not told to look again", r)
	}

	// The job restarts; rank 1 reaches this agent before rank 0 did: it is told to look again
	// (and retries), and no incarnation starts.
	b1 := negotiate(1, agentInc("b1", 1, nodes))
	refused(1)
	stillWaiting(t, b1, "rank 1's Negotiate of B before rank 0's")
	require.Same(t, a, current(j.job), "rank 1 started an incarnation")
	b0 := negotiate(0, agentInc("b0", 0, nodes))
	b2 := negotiate(2, agentInc("b2", 2, nodes))
	for _, ch := range []<-chan error{b0, b1, b2} {
		require.NoError(t, result(t, ch, "Negotiate of B"))
	}

	// The job restarts again: this agent's rank 0 and rank 1 negotiated C, waiting for rank 2,
	// when this agent's own incarnation D turns out to be another rank (Resign): its
	// coordinator ends. Rank 0's incarnation C is over; rank 1 keeps looking for rank 0 (it
	// returned ErrClosed before) and is told to look again while this agent is not rank 0.
	c0 := negotiate(0, agentInc("c0", 0, nodes))
	require.Eventually(t, func() bool {
		c := current(j.job)
		if c == nil || c == a {
			return false
		}
		what, _ := c.waitingFor()
		return strings.HasPrefix(what, "1 of 3 nodes sent their inventory")
	}, 10*time.Second, time.Millisecond, "rank 0 started C")
	c1 := negotiate(1, agentInc("c1", 1, nodes))
	require.Eventually(t, func() bool {
		what, _ := current(j.job).waitingFor()
		return strings.HasPrefix(what, "2 of 3 nodes sent their inventory")
	}, 10*time.Second, time.Millisecond, "ranks 0 and 1 wait in C")
	j.job.Resign()
	require.ErrorIs(t, result(t, c0, "rank 0's Negotiate of C"), ErrClosed)
	refused(1)
	stillWaiting(t, c1, "rank 1's Negotiate of C once its coordinator ended")
	require.Nil(t, current(j.job))
	// A newcomer is told to look again too.
	c2ctx, cancel := context.WithCancel(ctx)
	c2 := async(func() error {
		_, err := j.clients[2].Negotiate(c2ctx, agentInc("c2", 2, nodes), tiers.Inventory{Rank: 2})
		return err
	})
	refused(2)
	cancel()
	require.Error(t, result(t, c2, "rank 2's Negotiate of C"))
	// This agent is rank 0 again: rank 1's C joins its incarnation.
	e0 := negotiate(0, agentInc("e0", 0, nodes))
	e2 := negotiate(2, agentInc("e2", 2, nodes))
	for _, ch := range []<-chan error{e0, c1, e2} {
		require.NoError(t, result(t, ch, "Negotiate once rank 0 is back"))
	}
}

// TestCoordinatorServiceRefusesASupersededCaller: the ids an agent's Negotiate names as
// superseded travel with it, and a late call of one of them is refused (not retried).
func TestCoordinatorServiceRefusesASupersededCaller(t *testing.T) {
	t.Parallel()
	const nodes = 3
	j := newCoordinatorJob(t, nodes, Options{Clock: newFakeClock()})
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	late := agentInc("given-up", 1, nodes)
	j.incs[1].Superseded = []string{late.ID}
	calls := make([]<-chan error, nodes)
	for _, r := range []int{0, 1} {
		calls[r] = async(func() error { _, err := j.clients[r].Negotiate(ctx, j.incs[r], own(r, 10)); return err })
	}
	require.Eventually(t, func() bool { return j.job.idOf(1) == j.incs[1].ID }, 10*time.Second, time.Millisecond)
	_, err := j.clients[1].Negotiate(ctx, late, own(1, 10))
	require.ErrorIs(t, err, ErrOtherIncarnation)
	assert.ErrorContains(t, err, "superseded by a newer one")
	calls[2] = async(func() error { _, err := j.clients[2].Negotiate(ctx, j.incs[2], own(2, 10)); return err })
	for r, ch := range calls {
		require.NoError(t, result(t, ch, fmt.Sprint("Negotiate of rank ", r)))
	}
	var wg sync.WaitGroup
	for r := range nodes {
		wg.Go(func() { assert.NoError(t, j.clients[r].Restored(ctx, j.incs[r]), "rank %d", r) })
	}
	wg.Wait()

	// More ids than this version sends (a later one's): the newest are taken, not refused.
	long := agentInc("long", 2, nodes)
	for i := range tiers.MaxSuperseded + 1 {
		long.Superseded = append(long.Superseded, fmt.Sprint("old-", i))
	}
	short, cancelShort := context.WithTimeout(ctx, time.Second)
	defer cancelShort()
	_, err = j.clients[2].Negotiate(short, long, own(2, 10))
	require.Error(t, err, "rank 0 has not restarted: no plan for it")
	assert.NotContains(t, err.Error(), "superseded incarnations")
	j.job.mu.Lock()
	defer j.job.mu.Unlock()
	assert.False(t, j.job.retired["old-0"], "the oldest beyond the bound is left")
	assert.True(t, j.job.retired[fmt.Sprint("old-", tiers.MaxSuperseded)], "the newest is retired")
}

// TestRetiredIdsAreBounded: a Job remembers the newest maxRetired retired incarnation ids.
func TestRetiredIdsAreBounded(t *testing.T) {
	t.Parallel()
	j := NewJob(Options{})
	j.mu.Lock()
	defer j.mu.Unlock()
	for i := range maxRetired + 10 {
		j.retire(fmt.Sprint(i))
		j.retire(fmt.Sprint(i)) // twice: counted once
	}
	assert.Len(t, j.retired, maxRetired)
	assert.Len(t, j.retiredOrder, maxRetired)
	assert.False(t, j.retired["9"])
	assert.True(t, j.retired["10"])
	assert.True(t, j.retired[fmt.Sprint(maxRetired+9)])
}

// TestRemoteCoordinatorOfAnEarlierVersion: a rank-0 agent from before a call (backup orders,
// the report of a failed restore) answers Unimplemented; the remote coordinator says so with
// errors.ErrUnsupported, which the node tells its job (a black-box run mixed versions: backup
// orders failed as Unimplemented, logged as a retry, and the job was told nothing).
func TestRemoteCoordinatorOfAnEarlierVersion(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := grpc.NewServer(ServerOptions()...)
	peerpb.RegisterCoordinatorServer(srv, peerpb.UnimplementedCoordinatorServer{}) // knows no call
	go srv.Serve(ln)
	t.Cleanup(srv.Stop)
	r := newRemote(t, fixedAddr(ln.Addr().String()), coordSecret)
	inc := agentInc("a1", 1, 2)
	_, err = r.Backups(t.Context(), inc, tiers.BackupReport{})
	require.ErrorIs(t, err, errors.ErrUnsupported)
	require.ErrorContains(t, err, "rank 0's agent is of an earlier version")
	require.ErrorIs(t, r.RestoreFailed(t.Context(), inc, "gone"), errors.ErrUnsupported)
}
