package replication

// A job of many in-process nodes (goroutines, no FUSE, no network) driving one Job through
// LocalClient: every node negotiates with a realistic inventory, passes the restore barrier
// and syncs a run of steps. It checks that everyone gets one consistent plan and one decision
// per step, and measures what the coordinator costs as the job grows.

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mtcfs/mtcfs/tiers"
)

// simJob is the input of one simulated run: each node's incarnation and inventory.
type simJob struct {
	incs []tiers.Incarnation
	invs []tiers.Inventory
}

// newSimJob builds n nodes that each hold their own .meta and data of the last two steps
// (90 and 100), as after a restart of a job that checkpointed every 10 steps and kept two.
func newSimJob(n int) simJob {
	j := simJob{incs: make([]tiers.Incarnation, n), invs: make([]tiers.Inventory, n)}
	for r := range n {
		cfg := testConfig(n)
		cfg.NodeRank, cfg.BackupIntervalSteps = r, 5
		j.incs[r] = tiers.Incarnation{ID: fmt.Sprintf("agent-%d", r), Config: cfg}
		j.invs[r] = own(r, 90, 100)
	}
	return j
}

// simResult is what one run observed.
type simResult struct {
	first time.Duration // negotiation, restore barrier and the first sync, all nodes
	total time.Duration // the whole run
	plans []tiers.RestorePlan
	decs  [][]tiers.SyncDecision // by rank, by sync
	errs  []error                // by rank: the first error
	order tiers.BackupOrder      // rank 0's backup order after the run
}

// run plays the job once against a fresh Job: every node negotiates, passes the barrier and
// syncs steps 101, 102, …, syncs of them. first is measured up to the moment every node has
// its decision for step 101.
func (j simJob) run(syncs int) simResult {
	n := len(j.incs)
	client := LocalClient{Job: NewJob(Options{Store: &fakeStore{backups: map[string][]tiers.BackupStep{}}})}
	res := simResult{plans: make([]tiers.RestorePlan, n), decs: make([][]tiers.SyncDecision, n), errs: make([]error, n)}
	for r := range res.decs {
		res.decs[r] = make([]tiers.SyncDecision, syncs)
	}
	node := func(r, from, to int) {
		ctx := context.Background() // simulated nodes run until the run is over
		inc := j.incs[r]
		var err error
		if from == 0 {
			if res.plans[r], err = client.Negotiate(ctx, inc, j.invs[r]); err == nil {
				err = client.Restored(ctx, inc)
			}
		}
		for i := from; i < to && err == nil; i++ {
			res.decs[r][i], err = client.Sync(ctx, inc, tiers.SyncReport{Step: 101 + int64(i)})
		}
		if err != nil && res.errs[r] == nil {
			res.errs[r] = err
		}
	}
	phase := func(from, to int) time.Duration {
		start := time.Now()
		var wg sync.WaitGroup
		for r := range n {
			wg.Go(func() { node(r, from, to) })
		}
		wg.Wait()
		return time.Since(start)
	}
	res.first = phase(0, 1)
	res.total = res.first + phase(1, syncs)
	expired, cancel := context.WithCancel(context.Background())
	cancel()
	res.order, _ = client.Backups(expired, j.incs[0], tiers.BackupReport{})
	return res
}

// check asserts that every node got the same plan (its own slot of step 100) and, per step,
// the same decision as rank 0.
func (r simResult) check(t *testing.T) {
	t.Helper()
	for rank, err := range r.errs {
		require.NoError(t, err, "rank %d", rank)
	}
	for rank, p := range r.plans {
		require.True(t, p.Found && p.Step == 100, "rank %d: plan %+v, want step 100", rank, p)
		require.Equal(t, dataOf(rank, 100), p.Data[tiers.Slot{Rank: rank}], "rank %d restores its own data", rank)
	}
	for i, d := range r.decs[0] {
		for rank := range r.decs {
			require.Equal(t, d, r.decs[rank][i], "rank %d, sync %d: every node gets rank 0's decision", rank, i)
		}
	}
	if len(r.decs[0]) >= 5 {
		assert.NotEmpty(t, r.order.Backup, "backup-interval-steps 5 over %d syncs orders a backup", len(r.decs[0]))
	}
}

func TestSimCoordinator1024(t *testing.T) {
	t.Parallel()
	const nodes, syncs = 1024, 20
	res := newSimJob(nodes).run(syncs)
	res.check(t)
	t.Logf("%d nodes: negotiation + barrier + first sync %v (%v per node); %d syncs in all %v",
		nodes, res.first, res.first/nodes, syncs, res.total)
}

// TestSimCoordinatorScaling checks that the coordinator's cost grows linearly with the number of
// nodes: the time per node of negotiation + barrier + one sync at 1024 nodes must stay within
// 3× of that at 128. This is a complexity check with generous slack — an O(nodes²) step would
// show as an 8× growth per node — not a performance assertion: absolute times are only logged.
// Each size is timed several times and the fastest run counts, and the whole measurement is
// repeated before failing, so that a busy machine does not fail it.
func TestSimCoordinatorScaling(t *testing.T) {
	if testing.Short() {
		t.Skip("timing-based complexity check; skipped with -short")
	}
	sizes := []int{128, 256, 512, 1024}
	const reps, attempts, slack = 5, 3, 3.0
	jobs := map[int]simJob{}
	for _, n := range sizes {
		jobs[n] = newSimJob(n)
	}
	var ratio float64
	for attempt := 1; attempt <= attempts; attempt++ {
		perNode := map[int]time.Duration{}
		for _, n := range sizes {
			best := time.Duration(1<<63 - 1)
			for range reps {
				res := jobs[n].run(1)
				res.check(t)
				best = min(best, res.first)
			}
			perNode[n] = best / time.Duration(n)
			t.Logf("attempt %d: %4d nodes: %v (%v per node)", attempt, n, best, perNode[n])
		}
		ratio = float64(perNode[1024]) / float64(perNode[128])
		if ratio <= slack {
			t.Logf("time per node grows %.2f× from 128 to 1024 nodes (limit %.0f×)", ratio, slack)
			return
		}
	}
	t.Errorf("time per node of negotiation + one sync grew %.2f× from 128 to 1024 nodes in each of %d attempts, want ≤ %.0f× (linear cost)", ratio, attempts, slack)
}

// BenchmarkNegotiateSync1024 times one incarnation of a 1024-node job: every node negotiates,
// passes the restore barrier and syncs one step. Record with
// go test -run '^$' -bench NegotiateSync1024 -benchtime 20x ./replication/
func BenchmarkNegotiateSync1024(b *testing.B) {
	const nodes = 1024
	job := newSimJob(nodes)
	b.ResetTimer()
	for b.Loop() {
		res := job.run(1)
		for rank, err := range res.errs {
			if err != nil {
				b.Fatalf("rank %d: %v", rank, err)
			}
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/nodes, "ns/node")
}
