package replication

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/tiers"
)

const testJob = "llama"

// --- fakes -------------------------------------------------------------------------------

// fakeClock is a Clock that moves only when told to. Timers fire, each in its own goroutine,
// when Advance passes their deadline.
type fakeClock struct {
	mu     sync.Mutex
	now    time.Time    // GUARDED_BY(mu)
	timers []*fakeTimer // GUARDED_BY(mu); not yet fired nor stopped
	ran    atomic.Int64 // timer functions that have returned
}

type fakeTimer struct {
	at time.Time
	f  func()
}

func newFakeClock() *fakeClock {
	return &fakeClock{now: time.Date(2030, 1, 2, 3, 0, 0, 0, time.UTC)}
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) AfterFunc(d time.Duration, f func()) func() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := &fakeTimer{at: c.now.Add(d), f: f}
	c.timers = append(c.timers, t)
	return func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		for i, x := range c.timers {
			if x == t {
				c.timers = append(c.timers[:i], c.timers[i+1:]...)
				return true
			}
		}
		return false
	}
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	var due []*fakeTimer
	kept := c.timers[:0]
	for _, t := range c.timers {
		if !t.at.After(c.now) {
			due = append(due, t)
		} else {
			kept = append(kept, t)
		}
	}
	c.timers = kept
	c.mu.Unlock()
	for _, t := range due {
		go func() {
			t.f()
			c.ran.Add(1)
		}()
	}
}

func (c *fakeClock) pending() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.timers)
}

// fakeStore is a tiers.BackupStore holding only what the coordinator reads: backup names,
// their complete steps, and restore.version.
type fakeStore struct {
	mu       sync.Mutex
	backups  map[string][]tiers.BackupStep // GUARDED_BY(mu); complete steps, highest first
	pin      string                        // GUARDED_BY(mu)
	hasPin   bool                          // GUARDED_BY(mu)
	clearErr error                         // GUARDED_BY(mu)
	clears   int                           // GUARDED_BY(mu); successful deletions of the pin
	pinReads int                           // GUARDED_BY(mu); one per PlanRestore
	// pinDown and listDown make restore.version, and the listings, unreadable: their reads hang
	// until their context ends (a location that does not answer).
	pinDown, listDown bool     // GUARDED_BY(mu)
	lists             int      // GUARDED_BY(mu); calls of Backups
	deleted           []string // GUARDED_BY(mu); backups DeleteIncomplete removed
	// cutShort maps a backup (listed in backups, with no complete step) to the step whose
	// upload was cut short in it: Resumable says yes for that step and its data.
	cutShort     map[string]int64    // GUARDED_BY(mu)
	cutShortData map[string][]string // GUARDED_BY(mu); the data of cutShort's step it may hold
	// resumeGate, when set, holds Resumable until it is closed (a slow listing).
	resumeGate chan struct{}
}

// hang returns ctx's error once it ends, when down; nil at once otherwise.
func hang(ctx context.Context, down bool) error {
	if !down {
		return nil
	}
	<-ctx.Done()
	return ctx.Err()
}

var _ tiers.BackupStore = (*fakeStore)(nil)

func (s *fakeStore) Backups(ctx context.Context, job string) ([]string, error) {
	s.mu.Lock()
	down := s.listDown
	s.lists++
	s.mu.Unlock()
	if err := hang(ctx, down); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var names []string
	for n := range s.backups {
		names = append(names, n)
	}
	sort.Sort(sort.Reverse(sort.StringSlice(names)))
	return names, nil
}

func (s *fakeStore) CompleteSteps(ctx context.Context, job, backup string, shape tiers.Shape) ([]tiers.BackupStep, []tiers.DamagedStep, error) {
	s.mu.Lock()
	down := s.listDown
	s.mu.Unlock()
	if err := hang(ctx, down); err != nil {
		return nil, nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	steps, ok := s.backups[backup]
	if !ok {
		return nil, nil, fmt.Errorf("backup %s: %w", backup, tiers.ErrNoBackup)
	}
	return steps, nil, nil
}

func (s *fakeStore) Upload(ctx context.Context, req tiers.Upload) error {
	return errors.New("fakeStore: Upload is not used by the coordinator")
}

func (s *fakeStore) Download(ctx context.Context, job, backup, hash, dest string, progress func(done, total int64)) error {
	return errors.New("fakeStore: Download is not used by the coordinator")
}

func (s *fakeStore) MarkDamaged(ctx context.Context, job, backup, hash, why string) error {
	return errors.New("fakeStore: MarkDamaged is not used by the coordinator")
}

func (s *fakeStore) RestoreVersion(ctx context.Context, job string) (string, bool, error) {
	s.mu.Lock()
	s.pinReads++
	down := s.pinDown
	s.mu.Unlock()
	if err := hang(ctx, down); err != nil {
		return "", false, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pin, s.hasPin, nil
}

func (s *fakeStore) ClearRestoreVersion(ctx context.Context, job string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.clearErr != nil {
		return s.clearErr
	}
	if s.hasPin {
		s.clears++
	}
	s.hasPin = false
	return nil
}

func (s *fakeStore) String() string { return "fake://backups" }

func (s *fakeStore) CleanLeftovers(ctx context.Context, job string) (int, error) { return 0, nil }

func (s *fakeStore) DeleteIncomplete(ctx context.Context, job, backup string) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.backups[backup]) > 0 {
		return 0, errors.New("it holds a complete step")
	}
	s.deleted = append(s.deleted, backup)
	return 1, nil
}

func (s *fakeStore) deletedBackups() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.deleted)
}

func (s *fakeStore) Resumable(ctx context.Context, job, backup string, step int64, data []string, shape tiers.Shape) (bool, string, error) {
	if s.resumeGate != nil {
		select {
		case <-s.resumeGate:
		case <-ctx.Done():
			return false, "", ctx.Err()
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	cut, ok := s.cutShort[backup]
	if !ok || cut != step {
		return false, "not an upload of that step", nil
	}
	for _, h := range s.cutShortData[backup] {
		if !slices.Contains(data, h) {
			return false, "it holds other data", nil
		}
	}
	return true, "", nil
}

func (s *fakeStore) counts() (pinReads, clears int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pinReads, s.clears
}

// --- helpers -------------------------------------------------------------------------------

// hashOf is a well-formed directory data hash derived from seed.
func hashOf(seed string) string {
	sum := sha256.Sum256([]byte(seed))
	return "D" + hex.EncodeToString(sum[:])
}

// dataOf is the hash of rank's own data (worker 0) at step.
func dataOf(rank int, step int64) string { return hashOf(fmt.Sprintf("n%d-s%d", rank, step)) }

func metaOf(step int64, rank, worker int) string {
	return layout.MarkerName{Job: testJob, Step: step, Node: rank, Worker: worker, Kind: layout.MarkerMeta}.String()
}

func testConfig(nodes int) *tiers.Config {
	return &tiers.Config{JobName: testJob, Framework: tiers.FrameworkOrbax, Nodes: nodes, WorkersPerNode: 1, BackupIntervalSteps: 1}
}

// own is rank's inventory holding its own .meta and data of each step (worker 0).
func own(rank int, steps ...int64) tiers.Inventory {
	inv := tiers.Inventory{Rank: rank, Metas: map[string]string{}}
	for _, s := range steps {
		inv.Metas[metaOf(s, rank, 0)] = dataOf(rank, s)
		inv.Data = append(inv.Data, dataOf(rank, s))
	}
	return inv
}

// holding adds to inv another rank's .meta of step (a replica); withData adds its data too.
func holding(inv tiers.Inventory, rank int, step int64, withData bool) tiers.Inventory {
	inv.Metas[metaOf(step, rank, 0)] = dataOf(rank, step)
	if withData {
		inv.Data = append(inv.Data, dataOf(rank, step))
	}
	return inv
}

// dropData removes rank's own data of step from inv, keeping the .meta.
func dropData(inv tiers.Inventory, step int64) tiers.Inventory {
	var kept []string
	for _, h := range inv.Data {
		if h != dataOf(inv.Rank, step) {
			kept = append(kept, h)
		}
	}
	inv.Data = kept
	return inv
}

func newCoordinator(t *testing.T, cfg *tiers.Config, opts Options) *JobCoordinator {
	t.Helper()
	c, err := NewJobCoordinator(cfg, opts)
	require.NoError(t, err)
	t.Cleanup(c.Close)
	return c
}

type planResult struct {
	plan tiers.RestorePlan
	err  error
}

// negotiateAll negotiates every inventory concurrently and returns the results by rank.
func negotiateAll(t *testing.T, c *JobCoordinator, invs []tiers.Inventory) []planResult {
	t.Helper()
	out := make([]planResult, len(invs))
	var wg sync.WaitGroup
	for i, inv := range invs {
		wg.Go(func() {
			out[i].plan, out[i].err = c.Negotiate(t.Context(), inv.Rank, inv)
		})
	}
	wg.Wait()
	return out
}

type syncResult struct {
	dec tiers.SyncDecision
	err error
}

// syncAll syncs step from every rank concurrently.
func syncAll(t *testing.T, c *JobCoordinator, nodes int, step int64) []syncResult {
	t.Helper()
	out := make([]syncResult, nodes)
	var wg sync.WaitGroup
	for r := range nodes {
		wg.Go(func() {
			out[r].dec, out[r].err = c.Sync(t.Context(), r, tiers.SyncReport{Step: step})
		})
	}
	wg.Wait()
	return out
}

// async runs f in a goroutine and returns a channel with its error.
func async(f func() error) <-chan error {
	ch := make(chan error, 1)
	go func() { ch <- f() }()
	return ch
}

// stillWaiting fails the test if ch yields within a short while.
func stillWaiting(t *testing.T, ch <-chan error, what string) {
	t.Helper()
	select {
	case err := <-ch:
		t.Fatalf("%s returned (err %v) before every node arrived", what, err)
	case <-time.After(30 * time.Millisecond):
	}
}

// arrived waits until c's state satisfies cond: a call made in another goroutine has been
// counted. Tests use it where the order of arrivals matters.
func arrived(t *testing.T, c *JobCoordinator, what string, cond func(c *JobCoordinator) bool) {
	t.Helper()
	require.Eventually(t, func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		return cond(c)
	}, 10*time.Second, time.Millisecond, "waiting for %s", what)
}

// syncedTo is an arrived condition: rank reported step.
func syncedTo(rank int, step int64) func(c *JobCoordinator) bool {
	return func(c *JobCoordinator) bool { return c.synced[rank] == step }
}

// holdsMeta is an arrived condition: rank's recorded inventory has the .meta name.
func holdsMeta(rank int, name string) func(c *JobCoordinator) bool {
	return func(c *JobCoordinator) bool { _, ok := c.invs[rank].Metas[name]; return ok }
}

// result waits for ch.
func result(t *testing.T, ch <-chan error, what string) error {
	t.Helper()
	select {
	case err := <-ch:
		return err
	case <-time.After(10 * time.Second):
		t.Fatalf("%s did not return", what)
		return nil
	}
}

// --- negotiation -----------------------------------------------------------------------------

func TestCoordinatorNegotiate(t *testing.T) {
	t.Parallel()
	const b1, b2 = "2030-01-01_00-01", "2030-01-01_00-02"
	backupData := map[tiers.Slot]string{{Rank: 0}: hashOf("b0"), {Rank: 1}: hashOf("b1"), {Rank: 2}: hashOf("b2")}
	tests := []struct {
		name  string
		nodes int
		dp    int // assume-data-parallelism
		invs  []tiers.Inventory
		store *fakeStore // nil: no backup tier
		// want is the job-wide outcome; data[r] is what rank r restores and holders[r] who
		// holds it in RAM (ignored when the plan is not Found or comes from a backup).
		want    tiers.RestorePlan
		data    []string
		holders [][]int
	}{
		{
			name: "highest step complete on every node", nodes: 3,
			invs: []tiers.Inventory{own(0, 10, 20), own(1, 10, 20), own(2, 10, 20)},
			want: tiers.RestorePlan{Step: 20, Found: true},
			data: []string{dataOf(0, 20), dataOf(1, 20), dataOf(2, 20)}, holders: [][]int{{0}, {1}, {2}},
		},
		{
			name: "a step one node lacks is not complete", nodes: 4,
			invs: []tiers.Inventory{own(0, 10, 20), own(1, 10, 20), own(2, 10), own(3, 10, 20)},
			want: tiers.RestorePlan{Step: 10, Found: true},
			data: []string{dataOf(0, 10), dataOf(1, 10), dataOf(2, 10), dataOf(3, 10)}, holders: [][]int{{0}, {1}, {2}, {3}},
		},
		{
			name: "a lost node's step held by its peer", nodes: 3,
			invs: []tiers.Inventory{holding(own(0, 10, 20), 1, 20, true), {Rank: 1}, own(2, 10, 20)},
			want: tiers.RestorePlan{Step: 20, Found: true},
			data: []string{dataOf(0, 20), dataOf(1, 20), dataOf(2, 20)}, holders: [][]int{{0}, {0}, {2}},
		},
		{
			name: "a .meta whose data no node holds does not count", nodes: 3,
			invs: []tiers.Inventory{own(0, 10, 20), own(1, 10, 20), dropData(own(2, 10, 20), 20)},
			want: tiers.RestorePlan{Step: 10, Found: true},
			data: []string{dataOf(0, 10), dataOf(1, 10), dataOf(2, 10)}, holders: [][]int{{0}, {1}, {2}},
		},
		{
			name: "nothing in RAM: the newest complete backup", nodes: 3,
			invs:  []tiers.Inventory{{Rank: 0}, {Rank: 1}, {Rank: 2}},
			store: &fakeStore{backups: map[string][]tiers.BackupStep{b1: {{Step: 7, Data: backupData}}, b2: nil}},
			want:  tiers.RestorePlan{Step: 7, Found: true, Backup: b1},
			data:  []string{hashOf("b0"), hashOf("b1"), hashOf("b2")},
		},
		{
			name: "restore.version wins over RAM", nodes: 3,
			invs:  []tiers.Inventory{own(0, 20), own(1, 20), own(2, 20)},
			store: &fakeStore{backups: map[string][]tiers.BackupStep{b1: {{Step: 7, Data: backupData}}}, pin: b1, hasPin: true},
			want:  tiers.RestorePlan{Step: 7, Found: true, Backup: b1, Pinned: b1},
			data:  []string{hashOf("b0"), hashOf("b1"), hashOf("b2")},
		},
		{
			name: "nothing anywhere", nodes: 3,
			invs: []tiers.Inventory{own(0, 10), {Rank: 1}, own(2, 10)},
			want: tiers.RestorePlan{},
		},
		{
			// P = 2: columns {0, 2} and {1, 3}. Node 3 was replaced and holds nothing.
			name: "data-parallel: a lost node's .meta inferred from its column-mate", nodes: 4, dp: 2,
			invs: []tiers.Inventory{own(0, 10, 20), own(1, 10, 20), own(2, 10, 20), {Rank: 3}},
			want: tiers.RestorePlan{Step: 20, Found: true},
			data: []string{dataOf(0, 20), dataOf(1, 20), dataOf(2, 20), dataOf(1, 20)}, holders: [][]int{{0}, {1}, {2}, {1}},
		},
		{
			// Node 3's .meta survived at its column-mate, but the data it names is gone.
			name: "data-parallel: a .meta naming lost data is replaced from the column", nodes: 4, dp: 2,
			invs: []tiers.Inventory{own(0, 20), holding(own(1, 20), 3, 20, false), own(2, 20), {Rank: 3}},
			want: tiers.RestorePlan{Step: 20, Found: true},
			data: []string{dataOf(0, 20), dataOf(1, 20), dataOf(2, 20), dataOf(1, 20)}, holders: [][]int{{0}, {1}, {2}, {1}},
		},
		{
			name: "data-parallel: a whole column missing a step", nodes: 4, dp: 2,
			invs: []tiers.Inventory{own(0, 10, 20), own(1, 10), own(2, 10, 20), own(3, 10)},
			want: tiers.RestorePlan{Step: 10, Found: true},
			data: []string{dataOf(0, 10), dataOf(1, 10), dataOf(2, 10), dataOf(3, 10)}, holders: [][]int{{0}, {1}, {2}, {3}},
		},
		{
			// Step 20 was saved by a job with two workers per node (rank 0 holds worker 1's
			// .meta): the plan passes it over, so the inference serves step 10, not step 20.
			name: "data-parallel: a step of another shape is not the one inferred", nodes: 4, dp: 2,
			invs: func() []tiers.Inventory {
				inv0 := own(0, 10, 20)
				inv0.Metas[metaOf(20, 0, 1)] = dataOf(0, 20)
				return []tiers.Inventory{inv0, own(1, 10, 20), own(2, 10), {Rank: 3}}
			}(),
			want: tiers.RestorePlan{Step: 10, Found: true},
			data: []string{dataOf(0, 10), dataOf(1, 10), dataOf(2, 10), dataOf(1, 10)}, holders: [][]int{{0}, {1}, {2}, {1}},
		},
		{
			// The job's peer-ranks pair ranks 0 and 1, 2 and 3 (Orbax, process indices mapped
			// to other node ranks): rank 0 holds rank 1's .meta. Rank 1's RAM is lost: its
			// column-mate by rank (3) holds another partition's data, which a black-box run of
			// the upstream code restored on rank 1. The columns come from the replicas held:
			// rank 1 restores rank 0's data.
			name: "data-parallel: peer-ranks that are not mtcfs's columns: columns from the replicas", nodes: 4, dp: 2,
			invs: []tiers.Inventory{holding(own(0, 10, 20), 1, 20, false), {Rank: 1}, holding(own(2, 10, 20), 3, 20, false), holding(own(3, 10, 20), 2, 20, false)},
			want: tiers.RestorePlan{Step: 20, Found: true},
			data: []string{dataOf(0, 20), dataOf(0, 20), dataOf(2, 20), dataOf(3, 20)}, holders: [][]int{{0}, {0}, {2}, {3}},
		},
		{
			// The job mapped its processes to ranks differently at each start: step 10's
			// replicas pair 0-1 and 2-3, step 20's 0-3 and 1-2. Step 20's columns are step
			// 20's replicas': rank 1 restores rank 2's data (all steps together made one
			// column of four, and nothing was inferred).
			name: "data-parallel: the columns of each step are its own replicas'", nodes: 4, dp: 2,
			invs: []tiers.Inventory{
				holding(holding(own(0, 10, 20), 1, 10, false), 3, 20, false),
				{Rank: 1},
				holding(holding(own(2, 10, 20), 3, 10, false), 1, 20, false),
				holding(holding(own(3, 10, 20), 2, 10, false), 0, 20, false),
			},
			want: tiers.RestorePlan{Step: 20, Found: true},
			data: []string{dataOf(0, 20), dataOf(2, 20), dataOf(2, 20), dataOf(3, 20)}, holders: [][]int{{0}, {2}, {2}, {3}},
		},
		{
			// As above, but no replica pairs ranks 2 and 3: the columns are not whole, and
			// nothing is inferred (rank 3, rank 1's column-mate by rank, holds another
			// partition's data).
			name: "data-parallel: peer-ranks that are not mtcfs's columns, replicas that do not make whole columns: nothing inferred", nodes: 4, dp: 2,
			invs: []tiers.Inventory{holding(own(0, 10, 20), 1, 20, false), {Rank: 1}, own(2, 10, 20), own(3, 10, 20)},
			want: tiers.RestorePlan{},
		},
		{
			name: "no inference without data-parallel mode", nodes: 4,
			invs: []tiers.Inventory{own(0, 10, 20), own(1, 10, 20), own(2, 10, 20), {Rank: 3}},
			want: tiers.RestorePlan{},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg := testConfig(tt.nodes)
			cfg.AssumeDataParallelism = tt.dp
			opts := Options{Clock: newFakeClock()}
			if tt.store != nil {
				opts.Store = tt.store
			}
			c := newCoordinator(t, cfg, opts)
			results := negotiateAll(t, c, tt.invs)
			for r, res := range results {
				require.NoError(t, res.err, "rank %d", r)
				p := res.plan
				assert.Equal(t, tt.want.Found, p.Found, "rank %d: found", r)
				assert.Equal(t, tt.want.Step, p.Step, "rank %d: step", r)
				assert.Equal(t, tt.want.Backup, p.Backup, "rank %d: backup", r)
				assert.Equal(t, tt.want.Pinned, p.Pinned, "rank %d: pinned", r)
				if !tt.want.Found {
					assert.Empty(t, p.Data, "rank %d: nothing to restore", r)
					continue
				}
				slot := tiers.Slot{Rank: r}
				assert.Equal(t, map[tiers.Slot]string{slot: tt.data[r]}, p.Data, "rank %d: its part of the plan only", r)
				if tt.holders != nil {
					assert.Equal(t, map[string][]int{tt.data[r]: tt.holders[r]}, p.Holders, "rank %d: holders of its data", r)
				}
			}
			if tt.store != nil {
				reads, _ := tt.store.counts()
				assert.Equal(t, 1, reads, "the plan is computed once for all nodes")
			}
		})
	}
}

// inferFromColumns must not change the inventories it was given: they belong to the callers.
func TestCoordinatorInferenceLeavesInventoriesAlone(t *testing.T) {
	t.Parallel()
	cfg := testConfig(4)
	cfg.AssumeDataParallelism = 2
	invs := []tiers.Inventory{own(0, 20), holding(own(1, 20), 3, 20, false), own(2, 20), {Rank: 3, Metas: map[string]string{}}}
	out, inferred := inferFromColumns(cfg, invs)
	assert.Equal(t, []tiers.Slot{{Rank: 3}}, inferred)
	assert.Empty(t, invs[3].Metas, "the caller's inventory gained nothing")
	assert.Equal(t, dataOf(1, 20), out[3].Metas[metaOf(20, 3, 0)], "rank 3 restores its column-mate's data")
}

// TestCoordinatorDataParallelRanksMovedAndNodesLost: a data-parallel job (6 nodes, D = 3: columns
// {0,2,4} and {1,3,5}, each node's peer the next rank of its column) restarts with ranks 0 and 1
// swapped between machines (Kubernetes reschedules pods in any order) and the machines of ranks
// 3 and 5 lost. The machine now rank 0 holds the .meta files it held as rank 1 (its own and rank
// 5's); compared with its current rank, they looked like a job whose peer-ranks are not mtcfs's
// columns, nothing was inferred, and the step was dropped (a black-box run: 8 ranks started from
// scratch). The .meta files a node holds of a step are column-mates, whatever its rank now: rank
// 3 takes its column's data. A job whose peers are outside mtcfs's columns is still told apart.
func TestCoordinatorDataParallelRanksMovedAndNodesLost(t *testing.T) {
	t.Parallel()
	const step = 20
	col := []string{dataOf(0, step), dataOf(1, step)} // the data of each column (equal replicas)
	holds := func(rank int, metas ...int) tiers.Inventory {
		inv := tiers.Inventory{Rank: rank, Metas: map[string]string{}}
		for _, m := range metas {
			inv.Metas[metaOf(step, m, 0)] = col[m%2]
		}
		if len(metas) > 0 {
			inv.Data = []string{col[metas[0]%2]}
		}
		return inv
	}
	cfg := testConfig(6)
	cfg.AssumeDataParallelism = 3
	invs := []tiers.Inventory{
		holds(0, 1, 5), // the machine of rank 1 before
		holds(1, 0, 4), // the machine of rank 0 before
		holds(2, 2, 0),
		holds(3), // lost
		holds(4, 4, 2),
		holds(5), // lost
	}
	if _, _, _, contradicted := columnsContradicted(cfg, invs, 2); contradicted {
		t.Error("moved ranks taken for peer-ranks outside mtcfs's columns")
	}
	c := newCoordinator(t, cfg, Options{Clock: newFakeClock()})
	for r, res := range negotiateAll(t, c, invs) {
		require.NoError(t, res.err, "rank %d", r)
		require.True(t, res.plan.Found, "rank %d: %q", r, res.plan.Errors)
		assert.Equal(t, int64(step), res.plan.Step, "rank %d", r)
		assert.Equal(t, col[r%2], res.plan.Data[tiers.Slot{Rank: r}], "rank %d restores its column's data", r)
		assert.Contains(t, strings.Join(res.plan.Errors, "\n"), "step 20: rank 3 worker 0 restore(s) the data of a data-parallel column-mate", "rank %d is told", r)
	}

	// Peers outside the columns (rank r's peer r^1), no rank moved: still seen.
	cfg = testConfig(4)
	cfg.AssumeDataParallelism = 2
	invs = []tiers.Inventory{holding(own(0, step), 1, step, false), holding(own(1, step), 0, step, false), holding(own(2, step), 3, step, false), holding(own(3, step), 2, step, false)}
	_, _, _, contradicted := columnsContradicted(cfg, invs, 2)
	assert.True(t, contradicted, "peer-ranks outside mtcfs's columns")
	cols, ok := peerColumns(cfg, invs, 2, step)
	assert.True(t, ok)
	assert.Equal(t, []int{0, 0, 2, 2}, cols, "the job's columns, from the .meta files held")
}

// TestCoordinatorDataParallelLoneReplicaOfAnotherColumn: a lone replica a node holds of a step
// it did not save as its current rank still tells that the job's columns are not mtcfs's. Here
// (6 nodes, D = 2) mtcfs's columns are {0,3},{1,4},{2,5} and the job's {0,3},{1,5},{2,4} (rank
// 0's own peers agree with mtcfs); rank 4's save was cut short after it received rank 2's .meta,
// and no other push ran. Taken as no evidence (a review of the moved-ranks change), rank 4 was
// restored with rank 1's data, another column's.
func TestCoordinatorDataParallelLoneReplicaOfAnotherColumn(t *testing.T) {
	t.Parallel()
	const step = 20
	data := map[int]string{0: dataOf(0, step), 3: dataOf(0, step), 1: dataOf(1, step), 5: dataOf(1, step), 2: dataOf(2, step), 4: dataOf(2, step)}
	ownOnly := func(rank int) tiers.Inventory {
		return tiers.Inventory{Rank: rank, Metas: map[string]string{metaOf(step, rank, 0): data[rank]}, Data: []string{data[rank]}}
	}
	cfg := testConfig(6)
	cfg.AssumeDataParallelism = 2
	invs := []tiers.Inventory{ownOnly(0), ownOnly(1), ownOnly(2), ownOnly(3),
		{Rank: 4, Metas: map[string]string{metaOf(step, 2, 0): data[2]}}, ownOnly(5)}
	if _, _, _, contradicted := columnsContradicted(cfg, invs, 3); !contradicted {
		t.Error("a lone replica of another column is no evidence")
	}
	c := newCoordinator(t, cfg, Options{Clock: newFakeClock()})
	for r, res := range negotiateAll(t, c, invs) {
		require.NoError(t, res.err, "rank %d", r)
		if got, ok := res.plan.Data[tiers.Slot{Rank: 4}]; res.plan.Found && ok {
			assert.Equal(t, data[4], got, "rank %d: rank 4 restores its own column's data, or nothing", r)
		}
		assert.False(t, res.plan.Found, "rank %d: step 20 has no data for rank 4", r)
		assert.Contains(t, strings.Join(res.plan.Errors, "\n"), "step 20: the .meta files the nodes hold of it do not make whole data-parallel columns", "rank %d is told why no column-mate stood in", r)
	}
}

// TestCoordinatorDataParallelJobShrunkOntoItsReplicas: a job of 4 nodes in 2 partitions (D = 2)
// restarted on 2 nodes (with D = 1, or without data-parallel mode) on the machines that held
// old ranks 2 and 3 restores their data: old rank 2 is a column-mate of old rank 0. It started
// from scratch there, while on the machines of old ranks 0 and 1 it restored (a black-box run).
// Spools that did not record a data-parallel shape vouch for nothing past the job's nodes.
func TestCoordinatorDataParallelJobShrunkOntoItsReplicas(t *testing.T) {
	t.Parallel()
	saved := tiers.Shape{Nodes: 4, Workers: 1, DataParallelism: 2}
	onOld := func(rank, oldRank int, shape tiers.Shape) tiers.Inventory {
		inv := tiers.Inventory{Rank: rank, Metas: map[string]string{}, Shape: shape}
		for _, s := range []int64{10, 20} {
			inv.Metas[metaOf(s, oldRank, 0)] = dataOf(oldRank, s)
			inv.Data = append(inv.Data, dataOf(oldRank, s))
		}
		return inv
	}
	for _, d := range []int{0, 1} {
		cfg := testConfig(2)
		cfg.AssumeDataParallelism = d
		for _, olds := range [][2]int{{2, 3}, {3, 2}, {0, 3}} {
			c := newCoordinator(t, cfg, Options{Clock: newFakeClock()})
			for r, res := range negotiateAll(t, c, []tiers.Inventory{onOld(0, olds[0], saved), onOld(1, olds[1], saved)}) {
				require.NoError(t, res.err, "D %d, old ranks %v, rank %d", d, olds, r)
				assert.True(t, res.plan.Found, "D %d, old ranks %v, rank %d: %q", d, olds, r, res.plan.Errors)
				assert.Equal(t, int64(20), res.plan.Step, "D %d, old ranks %v, rank %d", d, olds, r)
				// New rank k takes the data of column k: an old rank ≡ k (mod 2).
				want := dataOf(olds[r], 20)
				if olds[r]%2 != r {
					want = dataOf(olds[1-r], 20)
				}
				assert.Equal(t, want, res.plan.Data[tiers.Slot{Rank: r}], "D %d, old ranks %v, rank %d", d, olds, r)
			}
		}
		// Without a record of the data-parallel shape, ranks 2 and 3 are not column-mates.
		for _, shape := range []tiers.Shape{{}, {Nodes: 4, Workers: 1}} {
			c := newCoordinator(t, cfg, Options{Clock: newFakeClock()})
			for r, res := range negotiateAll(t, c, []tiers.Inventory{onOld(0, 2, shape), onOld(1, 3, shape)}) {
				require.NoError(t, res.err)
				assert.False(t, res.plan.Found, "D %d, recorded %v, rank %d: nothing vouches for ranks 2 and 3", d, shape, r)
			}
		}
	}
}

func TestCoordinatorNegotiateReReport(t *testing.T) {
	t.Parallel()
	store := &fakeStore{}
	c := newCoordinator(t, testConfig(3), Options{Store: store, Clock: newFakeClock()})
	first := async(func() error {
		_, err := c.Negotiate(t.Context(), 1, own(1, 10)) // before the agent restarted
		return err
	})
	arrived(t, c, "rank 1's first inventory", holdsMeta(1, metaOf(10, 1, 0)))
	stillWaiting(t, first, "rank 1's first negotiation")
	// The restarted agent found step 20 in its spool: its new inventory replaces the old.
	second := async(func() error {
		p, err := c.Negotiate(t.Context(), 1, own(1, 10, 20))
		assert.Equal(t, int64(20), p.Step, "the replacing inventory was used")
		return err
	})
	arrived(t, c, "rank 1's second inventory", holdsMeta(1, metaOf(20, 1, 0)))
	stillWaiting(t, second, "rank 1's second negotiation")
	for r, res := range negotiateAll(t, c, []tiers.Inventory{own(0, 10, 20), own(2, 10, 20)}) {
		require.NoError(t, res.err)
		assert.Equal(t, int64(20), res.plan.Step, "the replacing inventory was used (caller %d)", r)
	}
	require.NoError(t, result(t, second, "rank 1's second negotiation"))
	require.NoError(t, result(t, first, "rank 1's first negotiation"), "the first call gets the plan too")
	// After the plan exists, a report (another restart) gets the same plan.
	p, err := c.Negotiate(t.Context(), 1, own(1, 10))
	require.NoError(t, err)
	assert.Equal(t, int64(20), p.Step)
	reads, _ := store.counts()
	assert.Equal(t, 1, reads, "PlanRestore ran exactly once")
}

func TestCoordinatorNegotiateRejectsBadCalls(t *testing.T) {
	t.Parallel()
	c := newCoordinator(t, testConfig(2), Options{})
	_, err := c.Negotiate(t.Context(), 2, tiers.Inventory{Rank: 2})
	assert.ErrorContains(t, err, "rank 2 is not in the job's 2 nodes")
	_, err = c.Negotiate(t.Context(), 0, tiers.Inventory{Rank: 1})
	assert.ErrorContains(t, err, "inventory of rank 1 reported for rank 0")
	_, err = NewJobCoordinator(&tiers.Config{Nodes: 0, WorkersPerNode: 1}, Options{})
	assert.Error(t, err)
}

func TestCoordinatorCancellation(t *testing.T) {
	t.Parallel()
	c := newCoordinator(t, testConfig(2), Options{Clock: newFakeClock()})

	ctx, cancel := context.WithCancel(t.Context())
	neg := async(func() error { _, err := c.Negotiate(ctx, 0, own(0, 10)); return err })
	res := async(func() error { return c.Restored(ctx, 0) })
	syn := async(func() error { _, err := c.Sync(ctx, 0, tiers.SyncReport{Step: 11}); return err })
	stillWaiting(t, neg, "Negotiate")
	cancel()
	err := result(t, neg, "Negotiate")
	assert.ErrorIs(t, err, context.Canceled)
	assert.ErrorContains(t, err, "1 of 2 reported")
	assert.ErrorIs(t, result(t, res, "Restored"), context.Canceled)
	assert.ErrorIs(t, result(t, syn, "Sync"), context.Canceled)

	// A cancelled Negotiate is withdrawn (its agent gave that incarnation up): rank 1 waits
	// until rank 0 negotiates again. The cancelled Restored and Sync stay counted: rank 1
	// alone completes those barriers, and rank 0's retry gets the same outcome.
	neg1 := async(func() error {
		p, err := c.Negotiate(t.Context(), 1, own(1, 10))
		if err == nil && p.Step != 10 {
			err = fmt.Errorf("rank 1 plans step %d", p.Step)
		}
		return err
	})
	stillWaiting(t, neg1, "rank 1's Negotiate without rank 0's")
	p, err := c.Negotiate(t.Context(), 0, own(0, 10))
	require.NoError(t, err)
	assert.Equal(t, int64(10), p.Step)
	require.NoError(t, result(t, neg1, "rank 1's Negotiate"))
	require.NoError(t, c.Restored(t.Context(), 1))
	require.NoError(t, c.Restored(t.Context(), 0))
	_, err = c.Sync(t.Context(), 1, tiers.SyncReport{Step: 11})
	require.NoError(t, err)
	_, err = c.Sync(t.Context(), 0, tiers.SyncReport{Step: 11})
	require.NoError(t, err, "a retried report joins its finished round")

	// Close releases waiting callers and refuses new ones.
	c2 := newCoordinator(t, testConfig(2), Options{})
	neg = async(func() error { _, err := c2.Negotiate(t.Context(), 0, own(0, 10)); return err })
	stillWaiting(t, neg, "Negotiate")
	c2.Close()
	assert.ErrorIs(t, result(t, neg, "Negotiate"), ErrClosed)
	assert.ErrorIs(t, c2.Restored(t.Context(), 0), ErrClosed)
}

func TestCoordinatorRestoredBarrier(t *testing.T) {
	t.Parallel()
	c := newCoordinator(t, testConfig(3), Options{})
	var waiting []<-chan error
	for _, r := range []int{0, 1, 1} { // rank 1 twice: counted once
		waiting = append(waiting, async(func() error { return c.Restored(t.Context(), r) }))
	}
	for _, ch := range waiting {
		stillWaiting(t, ch, "Restored")
	}
	require.NoError(t, c.Restored(t.Context(), 2), "the last node releases everyone")
	for _, ch := range waiting {
		assert.NoError(t, result(t, ch, "Restored"))
	}
	assert.NoError(t, c.Restored(t.Context(), 0), "once open, the barrier stays open")
}

// A rank whose restore failed never reaches the barrier: once it says so, the others' Restored
// calls fail with its reason, waiting or later, instead of waiting until their jobs give up
// (found by black-box runs: the other ranks waited their 300 s).
func TestCoordinatorRestoreFailedReleasesTheBarrier(t *testing.T) {
	t.Parallel()
	c := newCoordinator(t, testConfig(3), Options{})
	waiting := async(func() error { return c.Restored(t.Context(), 0) })
	stillWaiting(t, waiting, "Restored")
	require.NoError(t, c.RestoreFailed(1, "restore of step 10 failed: no source holds it"))
	err := result(t, waiting, "Restored")
	assert.ErrorIs(t, err, ErrRestoreFailed)
	assert.ErrorContains(t, err, "rank 1: restore of step 10 failed: no source holds it")
	assert.ErrorIs(t, c.Restored(t.Context(), 2), ErrRestoreFailed, "a later call fails too")
	require.NoError(t, c.RestoreFailed(2, "another reason"))
	assert.ErrorContains(t, c.Restored(t.Context(), 0), "rank 1:", "the first failure is the one told")
	assert.Error(t, c.RestoreFailed(3, "x"), "a rank out of range")

	// Once every rank restored, a late failure changes nothing.
	c2 := newCoordinator(t, testConfig(1), Options{})
	require.NoError(t, c2.Restored(t.Context(), 0))
	require.NoError(t, c2.RestoreFailed(0, "late"))
	assert.NoError(t, c2.Restored(t.Context(), 0))
}

// --- sync ------------------------------------------------------------------------------------

func TestCoordinatorRestoreVersionIsOneShot(t *testing.T) {
	t.Parallel()
	const pin = "2030-01-01_00-01"
	data := map[tiers.Slot]string{{Rank: 0}: hashOf("b0"), {Rank: 1}: hashOf("b1")}
	tests := []struct {
		name      string
		backups   map[string][]tiers.BackupStep
		clearErr  bool
		steps     []int64
		wantAfter []int // pins deleted after each step's sync
	}{
		{
			name:    "restored from the pin: deleted after the first new step",
			backups: map[string][]tiers.BackupStep{pin: {{Step: 7, Data: data}}},
			steps:   []int64{7, 8, 9}, wantAfter: []int{0, 1, 1},
		},
		{
			name:  "pin names a missing backup: deleted after the first sync",
			steps: []int64{1, 2}, wantAfter: []int{1, 1},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			store := &fakeStore{backups: tt.backups, pin: pin, hasPin: true}
			c := newCoordinator(t, testConfig(2), Options{Store: store, Clock: newFakeClock()})
			negotiateAll(t, c, []tiers.Inventory{own(0), own(1)})
			for i, step := range tt.steps {
				for r, res := range syncAll(t, c, 2, step) {
					require.NoError(t, res.err, "step %d rank %d", step, r)
				}
				_, clears := store.counts()
				assert.Equal(t, tt.wantAfter[i], clears, "restore.version deletions after step %d", step)
			}
		})
	}

	t.Run("a failed deletion is retried at the next step", func(t *testing.T) {
		t.Parallel()
		store := &fakeStore{pin: pin, hasPin: true, clearErr: errors.New("permission denied")}
		c := newCoordinator(t, testConfig(2), Options{Store: store, Clock: newFakeClock()})
		negotiateAll(t, c, []tiers.Inventory{own(0), own(1)})
		for r, res := range syncAll(t, c, 2, 1) {
			assert.ErrorContains(t, res.err, "delete restore.version: permission denied", "rank %d", r)
		}
		store.mu.Lock()
		store.clearErr = nil
		store.mu.Unlock()
		for r, res := range syncAll(t, c, 2, 2) {
			require.NoError(t, res.err, "rank %d", r)
		}
		_, clears := store.counts()
		assert.Equal(t, 1, clears)
	})
}

// TestCoordinatorBackupLocationDown: a backup location that does not answer neither holds a
// restore from RAM past the plan's limits, nor gets its pin deleted (it was not applied). Before,
// the plan waited for restore.version, then for the listing of the backups, as long as the
// location's retries took (8 attempts of up to 60 s).
func TestCoordinatorBackupLocationDown(t *testing.T) {
	t.Parallel()
	limits := tiers.PlanLimits{PinRead: 50 * time.Millisecond, Store: time.Minute}
	for _, tc := range []struct {
		name             string
		pinDown          bool
		wantLine, wantNo string
	}{
		{name: "restore.version unread", pinDown: true, wantLine: "restore.version in fake://backups could not be read (no answer within 50ms"},
		{name: "only the listings hang", wantNo: "could not be read"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			store := &fakeStore{pin: "2030-01-01_00-01", hasPin: !tc.pinDown, pinDown: tc.pinDown, listDown: true,
				backups: map[string][]tiers.BackupStep{"2030-01-01_00-01": {{Step: 3, Data: map[tiers.Slot]string{{Rank: 0}: dataOf(0, 3), {Rank: 1}: dataOf(1, 3)}}}}}
			if !tc.pinDown {
				store.hasPin = false // read at once: no pin; the listings after the plan hang
			}
			c := newCoordinator(t, testConfig(2), Options{Store: store, Clock: newFakeClock(), PlanLimits: limits})
			for r, res := range negotiateAll(t, c, []tiers.Inventory{own(0, 4, 5), own(1, 4, 5)}) {
				require.NoError(t, res.err, "rank %d", r)
				assert.True(t, res.plan.Found, "rank %d", r)
				assert.EqualValues(t, 5, res.plan.Step, "rank %d restores step 5 from RAM", r)
				assert.Empty(t, res.plan.Pinned, "rank %d", r)
				lines := strings.Join(res.plan.Errors, "\n")
				if tc.wantLine != "" {
					assert.Contains(t, lines, tc.wantLine, "rank %d", r)
				} else {
					assert.NotContains(t, lines, tc.wantNo, "rank %d", r)
				}
			}
			store.mu.Lock()
			if tc.pinDown {
				assert.Zero(t, store.lists, "with restore.version unread, the backups are not listed either")
			} else {
				assert.Equal(t, 1, store.lists, "the backups are listed after the plan")
			}
			store.pinDown, store.listDown, store.hasPin = false, false, true // the location is back, with a pin
			store.mu.Unlock()
			for r, res := range syncAll(t, c, 2, 6) {
				require.NoError(t, res.err, "rank %d", r)
			}
			_, clears := store.counts()
			assert.Zero(t, clears, "a pin not applied is not deleted")
		})
	}
}

func TestCoordinatorSyncLaggard(t *testing.T) {
	t.Parallel()
	clock := newFakeClock()
	c := newCoordinator(t, testConfig(3), Options{Clock: clock, LagTimeout: time.Minute})
	var waiting []<-chan error
	for _, r := range []int{0, 1} {
		waiting = append(waiting, async(func() error { _, err := c.Sync(t.Context(), r, tiers.SyncReport{Step: 5}); return err }))
	}
	arrived(t, c, "ranks 0 and 1 at step 5", func(c *JobCoordinator) bool { return c.synced[0] == 5 && c.synced[1] == 5 })
	assert.Equal(t, 1, clock.pending(), "the lag timer starts at the first report")
	clock.Advance(59 * time.Second)
	for _, ch := range waiting {
		stillWaiting(t, ch, "Sync before the lag timeout")
	}
	clock.Advance(time.Second)
	for _, ch := range waiting {
		err := result(t, ch, "Sync")
		assert.ErrorIs(t, err, ErrSyncTimeout)
		assert.ErrorContains(t, err, "ranks [2] (1 of 3 nodes) did not report it within 1m0s")
	}
	// The laggard, arriving late, learns the same; the next step syncs normally.
	_, err := c.Sync(t.Context(), 2, tiers.SyncReport{Step: 5})
	assert.ErrorIs(t, err, ErrSyncTimeout)
	for r, res := range syncAll(t, c, 3, 6) {
		assert.NoError(t, res.err, "rank %d", r)
	}
	assert.Zero(t, clock.pending(), "a finished round's timer is stopped")
}

func TestCoordinatorSyncNodeAhead(t *testing.T) {
	t.Parallel()
	c := newCoordinator(t, testConfig(3), Options{Clock: newFakeClock()})
	var waiting []<-chan error
	for _, r := range []int{0, 1} {
		waiting = append(waiting, async(func() error { _, err := c.Sync(t.Context(), r, tiers.SyncReport{Step: 5}); return err }))
	}
	arrived(t, c, "ranks 0 and 1 at step 5", func(c *JobCoordinator) bool { return c.synced[0] == 5 && c.synced[1] == 5 })
	for _, ch := range waiting {
		stillWaiting(t, ch, "Sync")
	}
	// Rank 2 never committed step 5 and reports 6: 5 cannot complete any more.
	six := async(func() error { _, err := c.Sync(t.Context(), 2, tiers.SyncReport{Step: 6}); return err })
	for _, ch := range waiting {
		err := result(t, ch, "Sync of the skipped step")
		assert.ErrorIs(t, err, ErrStepSkipped)
		assert.ErrorContains(t, err, "rank 2 reported step 6 next")
	}
	stillWaiting(t, six, "Sync of step 6")
	waiting = []<-chan error{six}
	for _, r := range []int{0, 1} {
		waiting = append(waiting, async(func() error { _, err := c.Sync(t.Context(), r, tiers.SyncReport{Step: 6}); return err }))
	}
	for _, ch := range waiting {
		assert.NoError(t, result(t, ch, "Sync of step 6"), "step 6 is the step every node reached")
	}

	// A step first reported after another rank already went past it fails at once.
	eight := async(func() error { _, err := c.Sync(t.Context(), 2, tiers.SyncReport{Step: 8}); return err })
	arrived(t, c, "rank 2 at step 8", syncedTo(2, 8))
	stillWaiting(t, eight, "Sync of step 8")
	_, err := c.Sync(t.Context(), 0, tiers.SyncReport{Step: 7})
	assert.ErrorIs(t, err, ErrStepSkipped)
	assert.ErrorContains(t, err, "rank 2 reported step 8 instead")
}

func TestCoordinatorSyncRetriesAndStaleReports(t *testing.T) {
	t.Parallel()
	c := newCoordinator(t, testConfig(3), Options{Clock: newFakeClock()})
	var waiting []<-chan error
	for _, r := range []int{0, 0, 1} { // rank 0's request retried: one report
		waiting = append(waiting, async(func() error { _, err := c.Sync(t.Context(), r, tiers.SyncReport{Step: 5}); return err }))
	}
	for _, ch := range waiting {
		stillWaiting(t, ch, "Sync")
	}
	_, err := c.Sync(t.Context(), 2, tiers.SyncReport{Step: 5})
	require.NoError(t, err)
	for _, ch := range waiting {
		assert.NoError(t, result(t, ch, "Sync"))
	}
	_, err = c.Sync(t.Context(), 1, tiers.SyncReport{Step: 5})
	assert.NoError(t, err, "a retry after the round finished gets its outcome")

	for r, res := range syncAll(t, c, 3, 6) {
		require.NoError(t, res.err, "rank %d", r)
	}
	_, err = c.Sync(t.Context(), 1, tiers.SyncReport{Step: 4})
	assert.ErrorContains(t, err, "sync of step 4 from rank 1, which already reported step 6")
	_, err = c.Sync(t.Context(), 1, tiers.SyncReport{Step: -1})
	assert.Error(t, err)
}

// --- incarnations and the local client ------------------------------------------------------

// agentInc is one agent's incarnation: its own random id, and its rank in the config.
func agentInc(id string, rank, nodes int) tiers.Incarnation {
	cfg := testConfig(nodes)
	cfg.NodeRank = rank
	return tiers.Incarnation{ID: id, Config: cfg}
}

// current is job's coordinator of the current incarnation.
func current(job *Job) *JobCoordinator {
	job.mu.Lock()
	defer job.mu.Unlock()
	return job.cur
}

func TestCoordinatorLocalClientIncarnations(t *testing.T) {
	t.Parallel()
	const nodes = 2
	clock := newFakeClock()
	job := NewJob(Options{Clock: clock, Store: &fakeStore{backups: map[string][]tiers.BackupStep{}}})
	client := LocalClient{Job: job}

	// First incarnation. Node 1's agent restarts while the others have not reported yet: its
	// new inventory replaces the old one.
	before := agentInc("a1", 1, nodes)
	first := async(func() error { _, err := client.Negotiate(t.Context(), before, own(1, 10)); return err })
	require.Eventually(t, func() bool { return current(job) != nil }, 10*time.Second, time.Millisecond)
	arrived(t, current(job), "rank 1's first inventory", holdsMeta(1, metaOf(10, 1, 0)))
	stillWaiting(t, first, "negotiation")
	incs := []tiers.Incarnation{agentInc("a0", 0, nodes), agentInc("a1-restarted", 1, nodes)}
	second := async(func() error {
		p, err := client.Negotiate(t.Context(), incs[1], own(1, 10, 20))
		assert.Equal(t, int64(20), p.Step)
		return err
	})
	arrived(t, current(job), "rank 1's second inventory", holdsMeta(1, metaOf(20, 1, 0)))
	stillWaiting(t, second, "negotiation")
	p, err := client.Negotiate(t.Context(), incs[0], own(0, 10, 20))
	require.NoError(t, err)
	assert.Equal(t, int64(20), p.Step, "rank 1's replacing inventory was used")
	require.NoError(t, result(t, first, "the replaced negotiation"))
	require.NoError(t, result(t, second, "the replacing negotiation"))
	var wg sync.WaitGroup
	for _, inc := range incs {
		wg.Go(func() {
			assert.NoError(t, client.Restored(t.Context(), inc))
			_, err := client.Sync(t.Context(), inc, tiers.SyncReport{Step: 21})
			assert.NoError(t, err)
			o, err := client.Backups(expired(t), inc, tiers.BackupReport{})
			assert.NoError(t, err)
			assert.Equal(t, tiers.BackupOrder{Backup: "2030-01-02_03-00", Step: 21}, o)
		})
	}
	wg.Wait()
	_, err = client.Sync(t.Context(), agentInc("stranger", 0, nodes), tiers.SyncReport{Step: 22})
	assert.ErrorIs(t, err, ErrOtherIncarnation, "an id that never negotiated")

	// Node 0 waits on step 22 when the job restarts: a new id after the plan was made starts the
	// next incarnation.
	stale := async(func() error { _, err := client.Sync(t.Context(), incs[0], tiers.SyncReport{Step: 22}); return err })
	arrived(t, current(job), "rank 0 at step 22", syncedTo(0, 22))
	stillWaiting(t, stale, "Sync")
	next := []tiers.Incarnation{agentInc("b0", 0, nodes), agentInc("b1", 1, nodes)}
	plans := async(func() error { _, err := client.Negotiate(t.Context(), next[1], own(1, 21)); return err })
	assert.ErrorIs(t, result(t, stale, "Sync of the old incarnation"), ErrClosed)
	_, err = client.Sync(t.Context(), incs[1], tiers.SyncReport{Step: 22})
	assert.ErrorIs(t, err, ErrOtherIncarnation, "a straggler of the previous incarnation")
	_, err = client.Negotiate(t.Context(), next[0], own(0, 21))
	require.NoError(t, err)
	require.NoError(t, result(t, plans, "negotiation"))
	// Still 03:00: the previous incarnation took that minute's backup.
	for r, inc := range next {
		wg.Go(func() {
			_, err := client.Sync(t.Context(), inc, tiers.SyncReport{Step: 22})
			assert.NoError(t, err, "rank %d", r)
			o, err := client.Backups(expired(t), inc, tiers.BackupReport{})
			assert.NoError(t, err)
			assert.Empty(t, o.Backup, "rank %d: the minute's name is taken", r)
		})
	}
	wg.Wait()

	_, err = client.Negotiate(t.Context(), tiers.Incarnation{ID: "x"}, tiers.Inventory{})
	assert.ErrorContains(t, err, "no config")
}

// A step counts as replicated only when every rank reports its replicas acknowledged; one rank
// whose push failed makes the decision say so for every rank.
func TestCoordinatorSyncReplicated(t *testing.T) {
	t.Parallel()
	const nodes = 3
	c := newCoordinator(t, testConfig(nodes), Options{})
	negotiateAll(t, c, []tiers.Inventory{own(0), own(1), own(2)})
	sync := func(step int64, notReplicated ...int) []syncResult {
		out := make([]syncResult, nodes)
		var wg sync.WaitGroup
		for r := range nodes {
			wg.Go(func() {
				rep := tiers.SyncReport{Step: step, Replicated: !slices.Contains(notReplicated, r)}
				out[r].dec, out[r].err = c.Sync(t.Context(), r, rep)
			})
		}
		wg.Wait()
		return out
	}
	for _, tc := range []struct {
		step int64
		bad  []int
	}{{10, nil}, {11, []int{1}}, {12, []int{0, 2}}, {13, nil}} {
		for r, res := range sync(tc.step, tc.bad...) {
			require.NoError(t, res.err)
			assert.Equal(t, len(tc.bad) == 0, res.dec.Replicated, "step %d rank %d (not replicated on %v)", tc.step, r, tc.bad)
		}
	}
	c.mu.Lock()
	assert.Equal(t, int64(13), c.replicated)
	c.mu.Unlock()

	// Step 14's pushes fail on ranks 0 and 2, which try again later and report it replicated:
	// the step is replicated once both did, and each gets the decision as it stands. A report
	// from a rank that was not missing, or of an older step, changes nothing.
	for _, res := range sync(14, 0, 2) {
		require.NoError(t, res.err)
		require.False(t, res.dec.Replicated)
	}
	late := func(rank int, step int64) bool {
		dec, err := c.Sync(t.Context(), rank, tiers.SyncReport{Step: step, Replicated: true})
		require.NoError(t, err)
		return dec.Replicated
	}
	assert.False(t, late(1, 14), "rank 1 was not missing; ranks 0 and 2 are")
	assert.False(t, late(2, 14), "rank 0 is still missing")
	assert.False(t, late(2, 14), "a resent report: rank 0 is still missing")
	assert.True(t, late(0, 14), "no rank is missing any more")
	assert.True(t, late(0, 14), "a resent report whose first reply was lost gets the decision as it stands")
	assert.True(t, late(1, 14), "so does any rank repeating its report")
	_, err := c.Sync(t.Context(), 1, tiers.SyncReport{Step: 14, Replicated: false})
	require.NoError(t, err, "a resent report not replicated joins the round")
	c.mu.Lock()
	assert.Equal(t, int64(14), c.replicated)
	c.mu.Unlock()
	_, err = c.Sync(t.Context(), 0, tiers.SyncReport{Step: 12, Replicated: true})
	require.Error(t, err, "step 12's round is gone once step 14 completed")

	// A round that failed (a rank never reported it in time) does not become replicated.
	f := newCoordinator(t, testConfig(nodes), Options{LagTimeout: 50 * time.Millisecond})
	negotiateAll(t, f, []tiers.Inventory{own(0), own(1), own(2)})
	failed := make(chan error, 2)
	for r := range 2 { // rank 2 does not report step 15
		go func() {
			_, err := f.Sync(t.Context(), r, tiers.SyncReport{Step: 15, Replicated: r != 0})
			failed <- err
		}()
	}
	for range 2 {
		require.ErrorIs(t, <-failed, ErrSyncTimeout)
	}
	_, err = f.Sync(t.Context(), 0, tiers.SyncReport{Step: 15, Replicated: true})
	require.ErrorIs(t, err, ErrSyncTimeout, "a late report of a failed round gets its failure")
	f.mu.Lock()
	assert.Equal(t, int64(-1), f.replicated)
	f.mu.Unlock()
	c.mu.Lock()
	assert.Equal(t, int64(14), c.replicated)
	c.mu.Unlock()
}

// A start cut short (rank 1 never came, the job was killed) leaves ranks 0 and 2 waiting with
// their inventories; the job's next start reaches this coordinator with rank 1 first, a moment
// before ranks 0 and 2 give the old incarnation up. The coordinator, which waited long, does not
// plan at once: within planGrace the old calls go away (withdrawn) and the plan waits for their
// next start. Before, rank 1 got a plan of the dead start within milliseconds, and the job's next
// incarnation waited for it for ever (found by a black-box run).
func TestLateCompletionWaitsForARestart(t *testing.T) {
	t.Parallel()
	clock := newFakeClock()
	c := newCoordinator(t, testConfig(3), Options{Clock: clock})
	ctx0, cancel0 := context.WithCancel(t.Context())
	ctx2, cancel2 := context.WithCancel(t.Context())
	old0 := async(func() error { _, err := c.Negotiate(ctx0, 0, own(0, 10)); return err })
	old2 := async(func() error { _, err := c.Negotiate(ctx2, 2, own(2, 10)); return err })
	require.Eventually(t, func() bool { w, _ := c.waitingFor(); return strings.HasPrefix(w, "2 of 3") }, 5*time.Second, time.Millisecond)
	clock.Advance(5 * time.Second)
	plan1 := make(chan tiers.RestorePlan, 1)
	new1 := async(func() error {
		p, err := c.Negotiate(t.Context(), 1, own(1, 10, 20))
		plan1 <- p
		return err
	})
	stillWaiting(t, new1, "rank 1's Negotiate within the grace")
	cancel0()
	cancel2()
	require.ErrorIs(t, result(t, old0, "the cut-short rank 0"), context.Canceled)
	require.ErrorIs(t, result(t, old2, "the cut-short rank 2"), context.Canceled)
	clock.Advance(planGrace)
	stillWaiting(t, new1, "rank 1's Negotiate once the cut-short ranks went")
	// The next start of ranks 0 and 2: the coordinator is still old, so the plan waits the grace
	// again, then is made of the new inventories only.
	new0 := async(func() error { _, err := c.Negotiate(t.Context(), 0, own(0, 10, 20)); return err })
	new2 := async(func() error { _, err := c.Negotiate(t.Context(), 2, own(2, 10, 20)); return err })
	require.Eventually(t, func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.nReported == 3
	}, 5*time.Second, time.Millisecond)
	stillWaiting(t, new1, "rank 1's Negotiate within the second grace")
	clock.Advance(planGrace)
	for _, ch := range []<-chan error{new0, new1, new2} {
		require.NoError(t, result(t, ch, "Negotiate of the next start"))
	}
	assert.Equal(t, int64(20), (<-plan1).Step, "the plan is of the new inventories")
}

// TestLateNegotiateOfAGivenUpIncarnation: a Negotiate of an incarnation an agent gave up (held
// by a stalled link, or retried as the job restarted) that reaches the coordinator after the
// agent's newer one neither replaces it nor joins: the newer one names the ids it supersedes.
// Before, it replaced the newer id while the plan was gathered; the newer one got the plan and
// its Restored failed as "not negotiated", and the other ranks waited for it until their jobs
// gave up (found by a black-box run of a stalled link to rank 0). Arriving first, the late call
// is replaced by the newer one while the plan is gathered, as before. (Once the plan is made
// with the late call's inventory, the newer one is a restart of the job, told to look for rank
// 0 again: that incarnation's restore waits for it until the job restarts.)
func TestLateNegotiateOfAGivenUpIncarnation(t *testing.T) {
	t.Parallel()
	const nodes = 3
	for _, tc := range []struct {
		name       string
		lateFirst  bool // the late call arrives before the agent's newer one
		lateResult error
	}{
		{"late after the newer one", false, ErrOtherIncarnation},
		{"late before the newer one", true, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			job := NewJob(Options{Clock: newFakeClock()})
			client := LocalClient{Job: job}
			negotiate := func(inc tiers.Incarnation) <-chan error {
				return async(func() error {
					c, err := job.RemoteCoordinator(inc.Config.NodeRank, inc, true)
					if err == nil {
						_, err = c.Negotiate(t.Context(), inc.Config.NodeRank, own(inc.Config.NodeRank, 10))
					}
					return err
				})
			}
			incs := []tiers.Incarnation{agentInc("b0", 0, nodes), agentInc("b1", 1, nodes), agentInc("b2", 2, nodes)}
			late := agentInc("a1", 1, nodes)
			incs[1].Superseded = []string{"x1", late.ID}
			calls := make([]<-chan error, nodes)
			calls[0] = async(func() error { _, err := client.Negotiate(t.Context(), incs[0], own(0, 10)); return err })
			require.Eventually(t, func() bool { return job.idOf(0) == "b0" }, 10*time.Second, time.Millisecond)
			var lateCall <-chan error
			if tc.lateFirst {
				lateCall = negotiate(late)
				require.Eventually(t, func() bool { return job.idOf(1) == late.ID }, 10*time.Second, time.Millisecond)
			}
			calls[1] = negotiate(incs[1])
			require.Eventually(t, func() bool { return job.idOf(1) == "b1" }, 10*time.Second, time.Millisecond)
			if !tc.lateFirst {
				lateCall = negotiate(late)
				require.ErrorIs(t, result(t, lateCall, "the late Negotiate"), tc.lateResult)
			}
			calls[2] = negotiate(incs[2])
			for r, ch := range calls {
				require.NoError(t, result(t, ch, fmt.Sprint("Negotiate of rank ", r)))
			}
			if tc.lateFirst {
				require.NoError(t, result(t, lateCall, "the replaced late Negotiate"))
			}
			var wg sync.WaitGroup
			for _, inc := range incs {
				wg.Go(func() { assert.NoError(t, client.Restored(t.Context(), inc), "rank %d", inc.Config.NodeRank) })
			}
			wg.Wait()
			assert.ErrorIs(t, client.Restored(t.Context(), late), ErrOtherIncarnation)
		})
	}
}

// TestLateNegotiateCompletingThePlan: a late Negotiate of an incarnation its agent gave up that
// arrives last of all ranks, so that the plan starts with it, ends that plan when the agent's
// newer incarnation negotiates: the ranks waiting at the barrier are told at once (their jobs
// restart), and the next negotiation completes. Before, the newer one was told to look for
// rank 0 on every retry, and the other ranks waited at the barrier until their jobs gave up
// (a review).
func TestLateNegotiateCompletingThePlan(t *testing.T) {
	t.Parallel()
	const nodes = 3
	job := NewJob(Options{Clock: newFakeClock()})
	client := LocalClient{Job: job}
	negotiate := func(inc tiers.Incarnation) <-chan error {
		return async(func() error {
			c, err := job.RemoteCoordinator(inc.Config.NodeRank, inc, true)
			if err == nil {
				_, err = c.Negotiate(t.Context(), inc.Config.NodeRank, own(inc.Config.NodeRank, 10))
			}
			return err
		})
	}
	incs := []tiers.Incarnation{agentInc("b0", 0, nodes), agentInc("b1", 1, nodes), agentInc("b2", 2, nodes)}
	late := agentInc("a1", 1, nodes)
	incs[1].Superseded = []string{late.ID}
	calls := make([]<-chan error, nodes)
	calls[0] = async(func() error { _, err := client.Negotiate(t.Context(), incs[0], own(0, 10)); return err })
	require.Eventually(t, func() bool { return job.idOf(0) == "b0" }, 10*time.Second, time.Millisecond)
	calls[2] = negotiate(incs[2])
	require.Eventually(t, func() bool { return job.idOf(2) == "b2" }, 10*time.Second, time.Millisecond)
	require.NoError(t, result(t, negotiate(late), "the late Negotiate, which completes the set"))
	for _, r := range []int{0, 2} {
		require.NoError(t, result(t, calls[r], fmt.Sprint("Negotiate of rank ", r)))
	}
	barrier := make([]<-chan error, nodes)
	for _, r := range []int{0, 2} {
		barrier[r] = async(func() error { return client.Restored(t.Context(), incs[r]) })
	}
	c, err := job.RemoteCoordinator(1, incs[1], true)
	require.ErrorIs(t, err, errNotRankZero, "the newer incarnation: the plan is over, rank 0 starts the next (got %v)", c)
	for _, r := range []int{0, 2} { // waiting at the barrier (closed), or arriving after (not negotiated)
		err := result(t, barrier[r], fmt.Sprint("Restored of rank ", r))
		require.True(t, errors.Is(err, ErrClosed) || errors.Is(err, ErrOtherIncarnation), "rank %d told at once: %v", r, err)
	}
	// The job restarts on every rank: the agents negotiate again.
	incs = []tiers.Incarnation{agentInc("c0", 0, nodes), agentInc("c1", 1, nodes), agentInc("c2", 2, nodes)}
	calls[0] = async(func() error { _, err := client.Negotiate(t.Context(), incs[0], own(0, 10)); return err })
	require.Eventually(t, func() bool { return job.idOf(0) == "c0" }, 10*time.Second, time.Millisecond)
	calls[1], calls[2] = negotiate(incs[1]), negotiate(incs[2])
	for r, ch := range calls {
		require.NoError(t, result(t, ch, fmt.Sprint("Negotiate of rank ", r)))
	}
	var wg sync.WaitGroup
	for _, inc := range incs {
		wg.Go(func() { assert.NoError(t, client.Restored(t.Context(), inc), "rank %d", inc.Config.NodeRank) })
	}
	wg.Wait()
	assert.ErrorIs(t, client.Restored(t.Context(), late), ErrOtherIncarnation)
}

// TestPlainRestartRetiresTheOldIds: on a plain restart of the job (the old incarnation passed its
// barrier), a rank other than 0 that negotiates first is sent to look for rank 0 and ends
// nothing, and rank 0's new incarnation retires every id of the old one: a late call of one
// is refused. (A review: ending the old incarnation on the first rank's call skipped the
// retiring, and a late call joined the next plan.)
func TestPlainRestartRetiresTheOldIds(t *testing.T) {
	t.Parallel()
	const nodes = 2
	job := NewJob(Options{Clock: newFakeClock()})
	client := LocalClient{Job: job}
	old := []tiers.Incarnation{agentInc("a0", 0, nodes), agentInc("a1", 1, nodes)}
	calls := make([]<-chan error, nodes)
	for r, inc := range old {
		calls[r] = async(func() error { _, err := client.Negotiate(t.Context(), inc, own(r, 10)); return err })
	}
	for r, ch := range calls {
		require.NoError(t, result(t, ch, fmt.Sprint("Negotiate of rank ", r)))
	}
	for _, inc := range old {
		calls[inc.Config.NodeRank] = async(func() error { return client.Restored(t.Context(), inc) })
	}
	for r, ch := range calls {
		require.NoError(t, result(t, ch, fmt.Sprint("Restored of rank ", r)))
	}

	b1 := agentInc("b1", 1, nodes)
	b1.Superseded = []string{"a1"}
	_, err := job.RemoteCoordinator(1, b1, true)
	require.ErrorIs(t, err, errNotRankZero, "rank 1 first: rank 0 starts the next incarnation")
	require.Equal(t, "a0", job.idOf(0), "the old incarnation goes on until rank 0 restarts")
	b0 := agentInc("b0", 0, nodes)
	b0.Superseded = []string{"a0"}
	first := async(func() error { _, err := client.Negotiate(t.Context(), b0, own(0, 10)); return err })
	require.Eventually(t, func() bool { return job.idOf(0) == "b0" }, 10*time.Second, time.Millisecond)
	_, err = job.RemoteCoordinator(1, old[1], true)
	require.ErrorIs(t, err, ErrOtherIncarnation, "a late Negotiate of the old rank 1 is refused")
	second := async(func() error {
		c, err := job.RemoteCoordinator(1, b1, true)
		if err == nil {
			_, err = c.Negotiate(t.Context(), 1, own(1, 10))
		}
		return err
	})
	require.NoError(t, result(t, first, "Negotiate of b0"))
	require.NoError(t, result(t, second, "Negotiate of b1"))
}

// idOf is the agent incarnation id the current incarnation coordinates for rank.
func (j *Job) idOf(rank int) string {
	j.mu.Lock()
	defer j.mu.Unlock()
	if rank < len(j.ids) {
		return j.ids[rank]
	}
	return ""
}
