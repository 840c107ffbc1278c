package replication

// The job coordinator (SPEC §4–6) as a transport-agnostic state machine. The rank-0 agent owns
// one JobCoordinator per incarnation of the job; every node's calls reach it either in-process
// (LocalClient) or through the peer service, which calls the same three methods per request.
//
// Cost: every call does O(1) work under the lock, apart from two O(nodes) passes that run once
// per incarnation (computing the plan) or once per failed sync (naming the missing ranks). The
// plan each node receives holds only that node's slots, so handing it out is O(workers) per
// node, not O(nodes).

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/tiers"
)

// DefaultLagTimeout bounds how long the nodes that reported a step wait for the others to report
// it too. Nodes commit a step within seconds of each other; a node that is minutes late is stuck
// or gone, and the others' sealers must not wait for it forever.
const DefaultLagTimeout = 10 * time.Minute

var (
	// ErrClosed is returned to callers of a coordinator whose incarnation is over.
	ErrClosed = tiers.ErrIncarnationOver
	// ErrSyncTimeout fails a step's sync when some rank did not report it within the lag
	// timeout.
	ErrSyncTimeout = errors.New("not every node reported the step in time")
	// ErrStepSkipped fails a step's sync when some rank reported a later step instead: steps are
	// reported in increasing order, so that rank will never report this one.
	ErrStepSkipped = errors.New("a node skipped the step")
	// ErrOtherIncarnation is returned to a call from an incarnation the job coordinator does not
	// coordinate (an older one, or one that has not negotiated).
	ErrOtherIncarnation = tiers.ErrOtherIncarnation
	// ErrRestoreFailed fails the Restored calls of a restore in which some rank's restore
	// failed (RestoreFailed): that rank will never reach the barrier.
	ErrRestoreFailed = errors.New("the restore of another node failed")
)

// Clock is the time source of a JobCoordinator, injected so that tests control backup schedules
// and lag timeouts.
type Clock interface {
	Now() time.Time
	// AfterFunc calls f in its own goroutine once d has passed; stop prevents that if it has not
	// happened yet.
	AfterFunc(d time.Duration, f func()) (stop func() bool)
}

// SystemClock is the wall clock.
type SystemClock struct{}

func (SystemClock) Now() time.Time { return time.Now() }

func (SystemClock) AfterFunc(d time.Duration, f func()) func() bool { return time.AfterFunc(d, f).Stop }

// Options configure a JobCoordinator. The zero value is usable: no backups, the system clock.
type Options struct {
	// Store is the backup tier: restore.version, existing backups, and whether backups are
	// taken at all (nil: never).
	Store tiers.BackupStore
	// Clock is the time source; nil means SystemClock.
	Clock Clock
	// LagTimeout is how long a step's sync waits for the last rank; 0 means DefaultLagTimeout.
	LagTimeout time.Duration
	// LastBackup is the newest backup name decided before (by an earlier incarnation's
	// coordinator): this one never decides a name ≤ it, so names stay unique (SPEC §6).
	LastBackup string
	// PlanLimits bound the restore plan's use of Store (zero fields: the defaults). The
	// coordinator's own listing of the backups after a plan gets PlanLimits.PinRead.
	PlanLimits tiers.PlanLimits
	// Log receives one line per negotiation and per failed sync; nil discards them.
	Log *slog.Logger
}

// JobCoordinator makes the job-wide decisions of one incarnation (SPEC §4–6):
//
//   - Negotiate gathers every rank's inventory and computes one restore plan (SPEC §5) once
//     every rank has reported. A rank reporting again before that (a restarted agent) replaces
//     its inventory; after that it gets the plan already computed.
//   - Restored is the barrier before .restore markers: it returns once every rank called it.
//   - Sync is a per-step barrier: it returns once every rank reported step S, with the decision
//     for S (whether a backup is due, and its name), computed once and given to all.
//
// Sync when ranks disagree on the step. Each rank reports its steps in increasing order (its
// sealer syncs one step after the other).
//   - A lagging rank is waited for: the ranks that reported S wait until the last one does, for
//     at most the lag timeout counted from the first report of S. Then the sync of S fails for
//     everyone with ErrSyncTimeout naming the missing ranks, and a rank reporting S later gets
//     the same error at once. No backup is taken for S; the next step is a fresh round.
//   - A rank ahead — reporting S' while S is still waiting for it — has skipped S (it cannot
//     report S any more): the sync of S fails at once with ErrStepSkipped, and S' is the next
//     step every rank can reach, so S' is the one that is synced.
//   - A rank repeating its last report (a retried request) joins the same round; a report older
//     than its last gets that older round's outcome, or an error if there is none.
//   - A rank that reported its last step not replicated may report it again, replicated, once a
//     later push succeeded (the syncer tries again while the step is its newest): it is no
//     longer missing, and once no rank is, the step is replicated. A rank repeating a report of
//     its last step replicated gets the decision as it stands then; the others keep the one they
//     got, and free older steps only after their next.
//
// Each failed sync reaches the job as a line in replicator.errors (the replicator logs it);
// training goes on and the next step syncs normally.
//
// Data-parallel mode (assume-data-parallelism D > 0, P = nodes/D): ranks r and r' with
// r ≡ r' (mod P) form a column whose data is interchangeable by declaration (SPEC §4). When the
// inventories hold no usable .meta for a slot (r, w) at step S — none at all, or one naming data
// no live node holds, as after losing node r — but a column-mate's slot (r', w) at S has one, the
// coordinator infers r's .meta from it: r restores its column-mate's data. The inference runs
// on a copy of the inventories before tiers.PlanRestore sees them (it adds the inferred .meta to
// rank r's inventory), so the plan logic itself stays the same for both modes. Only the highest
// step every column can serve is inferred, since it is the one the plan picks; a step complete
// without inference needs none.
//
// A data-parallel job restarted on fewer nodes with as many partitions (4 nodes of D = 2 → 2
// nodes, with or without D) may run on the machines that held the other replicas: the .meta of
// old rank r ≥ nodes is a source for its column r mod P, when the spool that holds it recorded a
// data-parallel shape this job restores. Before, such a job started from scratch on ranks 2 and 3
// while ranks 0 and 1 restored the same step (found by a black-box run).
type JobCoordinator struct {
	cfg        *tiers.Config // the job-wide fields; NodeRank and peers are not used
	store      tiers.BackupStore
	clock      Clock
	lagTimeout time.Duration
	planLimits tiers.PlanLimits
	log        *slog.Logger

	// ctx ends with Close. Store calls and the plan computation run on it, never on a caller's
	// context, so that one node giving up does not cancel work every node waits for.
	ctx    context.Context
	cancel context.CancelFunc

	// planned is closed once plan and planErr are set; they never change afterwards, so they are
	// read without mu after <-planned.
	planned chan struct{}
	plan    tiers.RestorePlan
	planErr error

	// allRestored is closed once every rank called Restored.
	allRestored chan struct{}
	// restoreFailed is closed once a rank said its restore failed (RestoreFailed), with
	// failedRestore saying which and why (GUARDED_BY(mu)).
	restoreFailed chan struct{}
	failedRestore string

	// LOCK ORDERING: Job.mu, then mu; nothing is locked while holding mu. The one store call
	// made while holding it is the deletion of restore.version, at most once per incarnation,
	// so that decisions are made in step order.
	mu        sync.Mutex
	invs      []tiers.Inventory // GUARDED_BY(mu); by rank
	reported  []bool            // GUARDED_BY(mu); by rank: inventory received
	nReported int               // GUARDED_BY(mu)
	planning  bool              // GUARDED_BY(mu); the plan is being (or was) computed: invs are frozen
	// waiting counts, by rank, the Negotiate calls waiting with the rank's inventory: when the
	// last one goes away before the plan (the rank's agent gave that incarnation up: the job
	// restarted there), the inventory is withdrawn.
	waiting []int // GUARDED_BY(mu)
	// created is when the coordinator started; a plan completed long after (a start cut short,
	// then joined by a rank of the job's next start) waits planGrace first (see Negotiate).
	created    time.Time
	graceTimer func() bool // GUARDED_BY(mu); the pending planGrace, nil when none
	graceGen   int         // GUARDED_BY(mu); counts graces armed and cancelled: a late callback of an old one does nothing
	restored   []bool      // GUARDED_BY(mu); by rank
	nRestored  int         // GUARDED_BY(mu)

	synced []int64  // GUARDED_BY(mu); by rank: the highest step reported, -1 for none
	data   []string // GUARDED_BY(mu); by rank: the data it reported with synced ("": not said)
	// resaves are the steps being saved again (see noteResave), by step.
	resaves map[int64]*resaveRound // GUARDED_BY(mu)
	ahead   int                    // GUARDED_BY(mu); a rank with the highest synced step
	rounds  map[int64]*syncRound   // GUARDED_BY(mu); the pending steps and the latest finished ones
	pinned  string                 // GUARDED_BY(mu); restore.version in force until its one-shot deletion
	backups backupState            // GUARDED_BY(mu); see backups.go
	floor   string                 // GUARDED_BY(mu); the newest backup name known to exist or decided
	// replicated is the highest step every rank reported replicated, -1 for none.
	replicated int64 // GUARDED_BY(mu)
}

// syncRound is the sync of one step. Its fields are guarded by the coordinator's mu, except
// that dec and err are read without it once done is closed (they are set before, never after).
type syncRound struct {
	step    int64
	arrived int         // ranks that reported the step
	missing []int       // ranks that reported the step not replicated
	stop    func() bool // stops the lag timer; nil when the round finished on creation
	done    chan struct{}
	dec     tiers.SyncDecision
	err     error
}

// NewJobCoordinator creates the coordinator of one incarnation of the job cfg describes. Close it
// when the incarnation ends.
func NewJobCoordinator(cfg *tiers.Config, opts Options) (*JobCoordinator, error) {
	if cfg == nil || cfg.Nodes < 1 || cfg.WorkersPerNode < 1 {
		return nil, fmt.Errorf("job coordinator: need a config with nodes ≥ 1 and workers-per-node ≥ 1, got %+v", cfg)
	}
	c := &JobCoordinator{
		cfg:           cfg,
		store:         opts.Store,
		clock:         opts.Clock,
		lagTimeout:    opts.LagTimeout,
		planLimits:    opts.PlanLimits.WithDefaults(),
		log:           opts.Log,
		planned:       make(chan struct{}),
		allRestored:   make(chan struct{}),
		restoreFailed: make(chan struct{}),
		invs:          make([]tiers.Inventory, cfg.Nodes),
		reported:      make([]bool, cfg.Nodes),
		waiting:       make([]int, cfg.Nodes),
		restored:      make([]bool, cfg.Nodes),
		synced:        make([]int64, cfg.Nodes),
		data:          make([]string, cfg.Nodes),
		rounds:        map[int64]*syncRound{},
		resaves:       map[int64]*resaveRound{},
		floor:         opts.LastBackup,
		replicated:    -1,
	}
	if c.clock == nil {
		c.clock = SystemClock{}
	}
	c.created = c.clock.Now()
	if c.lagTimeout <= 0 {
		c.lagTimeout = DefaultLagTimeout
	}
	if c.log == nil {
		c.log = slog.New(slog.DiscardHandler)
	}
	for r := range c.synced {
		c.synced[r] = -1
	}
	c.backups.init(cfg.BackupInterval())
	c.ctx, c.cancel = context.WithCancel(context.Background())
	return c, nil
}

// Close ends the incarnation: every waiting caller returns ErrClosed, and so does every later
// call. It is safe to call more than once.
func (c *JobCoordinator) Close() {
	c.cancel()
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, r := range c.rounds {
		if r.stop != nil {
			r.stop()
		}
	}
	if c.backups.stopTimer != nil {
		c.backups.stopTimer()
	}
	if c.backups.stopAskCheck != nil {
		c.backups.stopAskCheck()
	}
}

func (c *JobCoordinator) checkRank(rank int) error {
	if rank < 0 || rank >= c.cfg.Nodes {
		return fmt.Errorf("rank %d is not in the job's %d nodes", rank, c.cfg.Nodes)
	}
	return c.closedErr()
}

func (c *JobCoordinator) closedErr() error {
	if c.ctx.Err() != nil {
		return ErrClosed
	}
	return nil
}

// Negotiate records rank's inventory, waits until every rank reported one, and returns the
// restore plan (SPEC §5). The plan is computed once, from all inventories, and every rank gets
// its part of it: the job-wide fields, and Data and Holders for that rank's own slots (see
// PlanForRank). If ctx ends before the plan, the inventory is withdrawn once no other call of
// the rank waits with it (its agent gave that incarnation up; a retry reports it again).
func (c *JobCoordinator) Negotiate(ctx context.Context, rank int, inv tiers.Inventory) (tiers.RestorePlan, error) {
	if err := c.checkRank(rank); err != nil {
		return tiers.RestorePlan{}, err
	}
	if inv.Rank != rank {
		return tiers.RestorePlan{}, fmt.Errorf("inventory of rank %d reported for rank %d", inv.Rank, rank)
	}
	c.mu.Lock()
	if !c.planning {
		if !c.reported[rank] {
			c.reported[rank] = true
			c.nReported++
		}
		c.invs[rank] = inv
		c.waiting[rank]++
		if c.nReported == c.cfg.Nodes {
			c.allReported()
		}
	}
	c.mu.Unlock()
	select {
	case <-c.planned:
		if c.planErr != nil {
			return tiers.RestorePlan{}, c.planErr
		}
		return PlanForRank(c.plan, rank, c.cfg.WorkersPerNode), nil
	case <-ctx.Done():
		c.mu.Lock()
		n := c.nReported
		if !c.planning {
			c.withdraw(rank)
		}
		c.mu.Unlock()
		return tiers.RestorePlan{}, fmt.Errorf("waiting for every node's inventory (%d of %d reported): %w", n, c.cfg.Nodes, ctx.Err())
	case <-c.ctx.Done():
		return tiers.RestorePlan{}, ErrClosed
	}
}

// planGrace is how long a coordinator that completes planStaleAfter or more after it started
// waits before it plans. Its early ranks may be of a start cut short (a pod that never came up,
// the job killed) and the rank that completed it of the job's next start, read a moment before
// the others: their agents give the earlier incarnation up within the grace (withdraw), or
// rank 0's starts the next one (the waiting ranks negotiate again there). Before, such a plan
// gave the early rank markers within milliseconds, and the job's next incarnation waited for it
// for ever (found by a black-box run).
const (
	planGrace      = 3 * time.Second
	planStaleAfter = 3 * time.Second
)

// allReported starts the plan once every rank reported: at once, or after planGrace for a
// coordinator that waited long. Called with mu held, with every rank reported.
func (c *JobCoordinator) allReported() {
	start := func() {
		c.planning = true
		go c.computePlan() // owned by c: ends with c.ctx, publishes through planned
	}
	if c.clock.Now().Sub(c.created) < planStaleAfter {
		start()
		return
	}
	if c.graceTimer != nil {
		return
	}
	c.log.Info("every node reported to a coordinator that waited long: the plan waits a moment for a restart of the job",
		"waited", c.clock.Now().Sub(c.created).Round(time.Second).String(), "grace", planGrace.String())
	c.graceGen++
	gen := c.graceGen
	c.graceTimer = c.clock.AfterFunc(planGrace, func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		if gen != c.graceGen {
			return // cancelled by a withdraw (a later grace may be pending)
		}
		c.graceTimer = nil
		if !c.planning && c.nReported == c.cfg.Nodes && c.ctx.Err() == nil {
			start()
		}
	})
}

// withdraw takes back rank's inventory when its last waiting Negotiate went away before the
// plan. Called with mu held, before planning.
func (c *JobCoordinator) withdraw(rank int) {
	if c.waiting[rank]--; c.waiting[rank] > 0 || !c.reported[rank] {
		return
	}
	c.reported[rank] = false
	c.nReported--
	c.invs[rank] = tiers.Inventory{}
	if c.graceTimer != nil {
		c.graceTimer()
		c.graceTimer = nil
		c.graceGen++
	}
}

// computePlan runs tiers.PlanRestore once, on the frozen inventories, and publishes the result.
func (c *JobCoordinator) computePlan() {
	start := c.clock.Now()
	// What nodes that missed restores hold above them goes first: inferred from, it would
	// stand for their column-mates too.
	invs, gen, stale, staleLines := tiers.CutStaleTimelines(c.cfg, c.invs) // c.invs is frozen: planning is set
	if part := c.cfg.Nodes / max(c.cfg.AssumeDataParallelism, 1); c.cfg.AssumeDataParallelism > 1 {
		if holder, q, step, ok := columnsContradicted(c.cfg, invs, part); ok {
			cols, ok := peerColumns(c.cfg, invs, part, step)
			c.log.Warn("the job's peer-ranks are not mtcfs's data-parallel columns (ranks equal mod nodes/D): columns are taken from the .meta replicas each node holds, of its peers",
				"holder", holder, "replica_of_rank", q, "step", step, "partitions", part, "columns", cols, "complete", ok)
			if !ok {
				c.log.Warn("the nodes' .meta replicas do not make whole columns: no node's data is taken for another's in this restore")
			}
		}
	}
	before := invs
	invs, inferred := inferFromColumns(c.cfg, invs)
	plan, err := tiers.PlanRestore(c.ctx, c.cfg, invs, c.store, c.planLimits)
	if err != nil {
		err = fmt.Errorf("restore plan: %w", err)
	}
	if line := inferredLine(c.cfg, plan, before, invs, inferred); line != "" {
		plan.Errors = append(plan.Errors, line)
	}
	if line := unknownColumnsLine(c.cfg, plan, before); line != "" {
		plan.Errors = append(plan.Errors, line)
	}
	plan.Generation, plan.StaleAbove, plan.Errors = gen, stale, append(staleLines, plan.Errors...)
	// Backup names stay unique across incarnations within one minute: start from the newest
	// name the store already has. The listing is bounded like the plan's read of
	// restore.version, and skipped when that failed: the markers wait for it. Not known, the
	// restored step counts as not backed up (a backup of it is taken again) and the names as
	// free from this incarnation's floor on (an upload into an existing backup of the same
	// minute adds to it; the location was not answering).
	var newest, newestName string
	newestStep := tiers.BackupStep{Step: -1} // the newest backup's highest complete step (in newestName)
	unfinished := false                      // the newest backup has no complete step: perhaps an upload cut short
	if c.store != nil && err == nil && !plan.BackupsUnread {
		lctx, cancel := context.WithTimeout(c.ctx, c.planLimits.PinRead)
		names, lerr := c.store.Backups(lctx, c.cfg.JobName)
		if lerr != nil {
			c.log.Warn("list backups", "err", lerr)
		} else if len(names) > 0 {
			newest = names[0]
			newestStep, newestName, unfinished = c.newestBackedUp(lctx, names)
		}
		cancel()
	}
	c.mu.Lock()
	c.plan, c.planErr = plan, err
	c.pinned = plan.Pinned
	c.floor = max(c.floor, newest)
	resume := c.backupsAfterPlan(plan, newestStep, newestName, unfinished)
	backedUp := c.backups.backedUp // not newestStep's number: the same number saved again is another step
	if plan.Found && plan.Backup == "" && backedUp == plan.Step {
		// Restored from RAM, and the newest backup holds that very step: the nodes' status
		// says so (a black-box run: after an agent restart, status and /metrics said nothing
		// was backed up until the next backup, which the step did not need).
		c.plan.BackedUpIn = c.backups.lastName
	} else if plan.Found && plan.Backup == "" && newestName != "" && newestStep.Step >= 0 && newestStep.Step < plan.Step {
		c.plan.LastBackup, c.plan.LastBackupStep = newestName, newestStep.Step
	}
	c.mu.Unlock()
	close(c.planned)
	if err != nil {
		c.log.Error("restore negotiation failed", "nodes", c.cfg.Nodes, "err", err)
		return
	}
	c.log.Info("restore plan", "nodes", c.cfg.Nodes, "found", plan.Found, "step", plan.Step, "backup", plan.Backup,
		"pinned", plan.Pinned, "inferred_metas", len(inferred), "took", c.clock.Now().Sub(start).String())
	if resume {
		// After the plan is out (the markers do not wait for it), before the restored step's
		// first order (which waits for it).
		lctx, cancel := context.WithTimeout(c.ctx, c.planLimits.PinRead)
		name := c.resumable(lctx, plan, newest, backedUp)
		cancel()
		c.mu.Lock()
		c.resumeDecided(name)
		c.mu.Unlock()
	}
}

// unknownColumnsLine tells the job, when a step above the one restored was passed over in a
// data-parallel job whose columns the .meta files the nodes hold do not make whole, that no
// column-mate's data stood in for a lost rank's ("" otherwise). The plan's line said only "no
// live node holds the data of rank 6" while column-mates held it (a black-box run).
func unknownColumnsLine(cfg *tiers.Config, plan tiers.RestorePlan, invs []tiers.Inventory) string {
	part := cfg.Nodes / max(cfg.AssumeDataParallelism, 1)
	if cfg.AssumeDataParallelism <= 1 || cfg.Nodes%cfg.AssumeDataParallelism != 0 {
		return ""
	}
	if _, _, _, contradicted := columnsContradicted(cfg, invs, part); !contradicted && len(cfg.PeersOutsideColumn()) == 0 {
		return ""
	}
	var steps []int64
	for _, inv := range invs {
		for step := range heldRanks(cfg, inv) {
			if (!plan.Found || step > plan.Step) && !slices.Contains(steps, step) {
				steps = append(steps, step)
			}
		}
	}
	slices.Sort(steps)
	for _, step := range slices.Backward(steps) {
		if _, ok := peerColumns(cfg, invs, part, step); !ok {
			return fmt.Sprintf("step %d: the .meta files the nodes hold of it do not make whole data-parallel columns (a node holds it under two ranks, having restored it as another rank than it saved it as; or the job's peer-ranks are not mtcfs's columns and a rank lost its RAM with all its peers), so no column-mate's data stands for a rank whose own no live node holds", step)
		}
	}
	return ""
}

// inferredLine tells the job which slots of the step restored from RAM take a data-parallel
// column-mate's data, their own being in no live node's RAM ("" when none): a job whose
// declared replicas do not save identical data (a model-parallel job that sets
// assume-data-parallelism) got another rank's shards without a word (a black-box run).
func inferredLine(cfg *tiers.Config, plan tiers.RestorePlan, before, after []tiers.Inventory, inferred []tiers.Slot) string {
	if !plan.Found || plan.Backup != "" {
		return ""
	}
	var who []string
	for _, sl := range inferred {
		name := layout.MarkerName{Job: cfg.JobName, Step: plan.Step, Node: sl.Rank, Worker: sl.Worker, Kind: layout.MarkerMeta}.String()
		_, was := before[sl.Rank].Metas[name]
		if _, is := after[sl.Rank].Metas[name]; is && !was {
			who = append(who, fmt.Sprintf("rank %d worker %d", sl.Rank, sl.Worker))
		}
	}
	if len(who) == 0 {
		return ""
	}
	return fmt.Sprintf("step %d: %s restore(s) the data of a data-parallel column-mate (assume-data-parallelism: %d), their own being in no live node's RAM: right only if the job's data-parallel replicas save identical data",
		plan.Step, strings.Join(who, ", "), cfg.AssumeDataParallelism)
}

// PlanForRank returns rank's part of a job-wide plan: the job-wide fields, and Data and
// Holders for rank's slots only — all a node needs to restore, in O(workers) space. The result
// shares nothing mutable with plan.
func PlanForRank(plan tiers.RestorePlan, rank, workers int) tiers.RestorePlan {
	out := plan
	out.StaleAbove = nil
	if b, ok := plan.StaleAbove[rank]; ok {
		out.StaleAbove = map[int]int64{rank: b}
	}
	out.Data = make(map[tiers.Slot]string, workers)
	out.Holders = map[string][]int{}
	out.Errors = slices.Clone(plan.Errors)
	for w := 0; w < workers; w++ {
		slot := tiers.Slot{Rank: rank, Worker: w}
		h, ok := plan.Data[slot]
		if !ok {
			continue
		}
		out.Data[slot] = h
		if hs, ok := plan.Holders[h]; ok {
			out.Holders[h] = slices.Clone(hs)
		}
	}
	return out
}

// columnsContradicted reports a node (holder) that holds .meta files of ranks q and r of one
// step in different columns (the ranks equal mod part): in data-parallel mode nodes exchange
// .meta files with their peers only, so the job's peer-ranks are not mtcfs's columns (Orbax
// computes them from process indices, which may differ from node ranks). The columns then come
// from the .meta files the nodes hold (peerColumns), or nothing is inferred: a node's data must
// not stand for a rank the job does not hold for equivalent (a black-box run of the upstream
// code restored a rank with another column's data).
//
// The evidence is the .meta files a node holds of one step, not the node's current rank: a
// node holds its own and its peers' of the rank it had when the step was saved, and a job that
// restarts may give it another rank (Kubernetes reschedules pods in any order). Compared with
// its current rank, the replicas of a node whose rank moved to another column looked like such
// a contradiction, nothing was inferred, and a step that a lost node's column-mates held was
// dropped for an older one (a black-box run).
func columnsContradicted(cfg *tiers.Config, invs []tiers.Inventory, part int) (holder, q int, step int64, ok bool) {
	if part >= cfg.Nodes {
		return 0, 0, 0, false // one node per column: nothing is inferred across ranks
	}
	for _, inv := range invs {
		for step, ranks := range heldRanks(cfg, inv) {
			for _, r := range ranks {
				if r%part != ranks[0]%part {
					return inv.Rank, r, step, true
				}
			}
			// A lone replica: the node's rank when the step was saved is not known, but this
			// node did not save the step as its current rank (a save cut short, a node moved):
			// taken as if it had, as before. A moved node's lone replica may so stop an
			// inference that was right, but a lone replica of another column must not let one
			// through that is wrong (a review: a rank restored with another column's data).
			if len(ranks) == 1 && ranks[0] != inv.Rank && ranks[0]%part != inv.Rank%part && inv.Rank >= 0 && inv.Rank < cfg.Nodes {
				return inv.Rank, ranks[0], step, true
			}
		}
	}
	return 0, 0, 0, false
}

// heldRanks lists, per step, the ranks (in order, each once) of the job's .meta files in shape
// that inv holds.
func heldRanks(cfg *tiers.Config, inv tiers.Inventory) map[int64][]int {
	out := map[int64][]int{}
	for name := range inv.Metas {
		if m, inShape, valid := tiers.JobMeta(cfg, name); valid && inShape && !slices.Contains(out[m.Step], m.Node) {
			out[m.Step] = append(out[m.Step], m.Node)
		}
	}
	for _, ranks := range out {
		slices.Sort(ranks)
	}
	return out
}

// peerColumns returns the job's own columns at step, by rank (each the lowest rank of its
// column), when its peer-ranks are not mtcfs's (columnsContradicted): a node holds the .meta
// files of the rank it had at step and of that rank's peers, so the ranks of the .meta files of
// step a node holds are column-mates (see columnsContradicted for why its current rank is not).
// Only step's .meta files count: the job may map its processes to ranks differently at each
// start (a review). ok is false (cols nil) unless that evidence makes exactly part columns of
// nodes/part ranks each (a rank whose RAM and whose peers' RAM were all lost is in none): then
// nothing of step is inferred.
func peerColumns(cfg *tiers.Config, invs []tiers.Inventory, part int, step int64) (cols []int, ok bool) {
	parent := make([]int, cfg.Nodes)
	for r := range parent {
		parent[r] = r
	}
	var find func(int) int
	find = func(r int) int {
		for parent[r] != r {
			parent[r] = parent[parent[r]]
			r = parent[r]
		}
		return r
	}
	union := func(x, y int) {
		if a, b := find(x), find(y); a != b {
			parent[max(a, b)] = min(a, b) // the lowest rank roots its column
		}
	}
	for _, inv := range invs {
		ranks := heldRanks(cfg, inv)[step]
		for _, r := range ranks {
			union(ranks[0], r)
		}
		if len(ranks) == 1 && inv.Rank >= 0 && inv.Rank < cfg.Nodes {
			union(inv.Rank, ranks[0]) // a lone replica, as in columnsContradicted
		}
	}
	size := map[int]int{}
	cols = make([]int, cfg.Nodes)
	for r := range cols {
		cols[r] = find(r)
		size[cols[r]]++
	}
	if len(size) != part {
		return nil, false
	}
	for _, n := range size {
		if n != cfg.Nodes/part {
			return nil, false
		}
	}
	return cols, true
}

// inferFromColumns implements the data-parallel inference described at JobCoordinator. It
// returns invs itself when nothing is inferred, else a copy in which the inferred .meta entries
// were added to the inventories of the ranks they are about (only those inventories' maps are
// copied). invs[r] is rank r's inventory. The cost is O(total .meta entries + nodes·workers).
func inferFromColumns(cfg *tiers.Config, invs []tiers.Inventory) ([]tiers.Inventory, []tiers.Slot) {
	d := cfg.AssumeDataParallelism
	if d > 0 && cfg.Nodes%d != 0 {
		return invs, nil
	}
	part := cfg.Nodes // P: the column of rank r is r mod P
	if d > 0 {
		part = cfg.Nodes / d
	}
	colOf := func(step int64, rank int) int { return rank % part }
	// Rank 0's own peer-ranks, or a replica a node holds, may say that the job's columns are
	// not mtcfs's: they are then those the replicas of each step make (-1: none known).
	_, _, _, byPeers := columnsContradicted(cfg, invs, part)
	if byPeers || len(cfg.PeersOutsideColumn()) > 0 {
		perStep := map[int64][]int{}
		colOf = func(step int64, rank int) int {
			cols, ok := perStep[step]
			if !ok {
				cols, _ = peerColumns(cfg, invs, part, step)
				perStep[step] = cols
			}
			if rank >= len(cols) {
				return -1 // not whole columns, or a rank past the job's nodes
			}
			return cols[rank]
		}
	}
	held := map[string]bool{}
	for _, inv := range invs {
		for _, h := range inv.Data {
			held[h] = true
		}
	}
	type columnSlot struct{ column, worker int }
	type source struct {
		rank int
		hash string
	}
	usable := map[int64]map[tiers.Slot]bool{}    // per step: slots with a .meta naming held data
	columns := map[int64]map[columnSlot]source{} // per step: the lowest rank's usable .meta per column slot
	for _, inv := range invs {
		// A spool that recorded a data-parallel shape this job restores (as many partitions,
		// workers alike) vouches for its .meta entries past this job's nodes: column-mates.
		shrunk := inv.Shape.Nodes > 0 && inv.Shape.DataParallelism > 0 && cfg.Shape().Restores(inv.Shape, true)
		for name, hash := range inv.Metas {
			m, inShape, ok := tiers.JobMeta(cfg, name)
			if !ok || !held[hash] || m.Worker >= cfg.WorkersPerNode || (!inShape && !shrunk) || colOf(m.Step, m.Node) < 0 {
				continue
			}
			if usable[m.Step] == nil {
				usable[m.Step], columns[m.Step] = map[tiers.Slot]bool{}, map[columnSlot]source{}
			}
			if inShape {
				usable[m.Step][tiers.Slot{Rank: m.Node, Worker: m.Worker}] = true
			}
			cs := columnSlot{colOf(m.Step, m.Node), m.Worker}
			// The lowest rank (then the smallest hash) wins, so the plan does not depend on
			// map order.
			if cur, ok := columns[m.Step][cs]; !ok || m.Node < cur.rank || (m.Node == cur.rank && hash < cur.hash) {
				columns[m.Step][cs] = source{m.Node, hash}
			}
		}
	}
	// The highest step every column slot can serve is the one the plan will restore, unless it
	// was saved in a shape this job cannot restore (the plan passes over those).
	others := tiers.OtherShapeSteps(cfg, invs)
	best, found := int64(0), false
	for step, cols := range columns {
		if _, other := others[step]; other {
			continue
		}
		if len(cols) == part*cfg.WorkersPerNode && (!found || step > best) {
			best, found = step, true
		}
	}
	if !found || len(usable[best]) == cfg.Nodes*cfg.WorkersPerNode {
		return invs, nil
	}
	out := slices.Clone(invs)
	var inferred []tiers.Slot
	for r := 0; r < cfg.Nodes; r++ {
		copied := false
		for w := 0; w < cfg.WorkersPerNode; w++ {
			slot := tiers.Slot{Rank: r, Worker: w}
			if usable[best][slot] {
				continue
			}
			if !copied {
				metas := make(map[string]string, len(out[r].Metas)+cfg.WorkersPerNode)
				for k, v := range out[r].Metas {
					metas[k] = v
				}
				out[r].Metas, copied = metas, true
			}
			src := columns[best][columnSlot{colOf(best, r), w}]
			name := layout.MarkerName{Job: cfg.JobName, Step: best, Node: r, Worker: w, Kind: layout.MarkerMeta}.String()
			out[r].Metas[name] = src.hash
			inferred = append(inferred, slot)
		}
	}
	return out, inferred
}

// Restored records that rank holds what the plan needs and returns once every rank did: the
// barrier before .restore markers appear (SPEC §5). Calling it again is harmless.
func (c *JobCoordinator) Restored(ctx context.Context, rank int) error {
	if err := c.checkRank(rank); err != nil {
		return err
	}
	c.mu.Lock()
	if !c.restored[rank] {
		c.restored[rank] = true
		c.nRestored++
		if c.nRestored == c.cfg.Nodes {
			close(c.allRestored)
		}
	}
	c.mu.Unlock()
	select {
	case <-c.allRestored:
		return nil
	case <-c.restoreFailed:
		c.mu.Lock()
		why := c.failedRestore
		c.mu.Unlock()
		return fmt.Errorf("%w: %s", ErrRestoreFailed, why)
	case <-ctx.Done():
		c.mu.Lock()
		n := c.nRestored
		c.mu.Unlock()
		return fmt.Errorf("waiting for every node to restore (%d of %d done): %w", n, c.cfg.Nodes, ctx.Err())
	case <-c.ctx.Done():
		return ErrClosed
	}
}

// RestoreFailed records that rank's restore failed (its job was told why): the waiting and later
// Restored calls fail with ErrRestoreFailed and the reason, since rank will never reach the
// barrier. The first failure is the one told; one after every rank restored changes nothing.
func (c *JobCoordinator) RestoreFailed(rank int, reason string) error {
	if err := c.checkRank(rank); err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	select {
	case <-c.allRestored:
		return nil
	case <-c.restoreFailed:
		return nil
	default:
	}
	c.failedRestore = fmt.Sprintf("rank %d: %s", rank, reason)
	close(c.restoreFailed)
	c.log.Error("a node's restore failed: the others are told", "rank", rank, "reason", reason)
	return nil
}

// Sync reports that rank committed (and replicated) step rep.Step, waits until every rank
// reported it, and returns the job's decision for it (see JobCoordinator for ranks that lag,
// run ahead or retry). If ctx ends first the report stays counted.
func (c *JobCoordinator) Sync(ctx context.Context, rank int, rep tiers.SyncReport) (tiers.SyncDecision, error) {
	if err := c.checkRank(rank); err != nil {
		return tiers.SyncDecision{}, err
	}
	if rep.Step < 0 {
		return tiers.SyncDecision{}, fmt.Errorf("sync of step %d: steps are ≥ 0", rep.Step)
	}
	c.mu.Lock()
	r, err := c.arrive(rank, rep)
	c.mu.Unlock()
	if err != nil {
		return tiers.SyncDecision{}, err
	}
	select {
	case <-r.done:
		return r.dec, r.err
	case <-ctx.Done():
		return tiers.SyncDecision{}, fmt.Errorf("waiting for every node to sync step %d: %w", rep.Step, ctx.Err())
	case <-c.ctx.Done():
		return tiers.SyncDecision{}, ErrClosed
	}
}

// resaveRound gathers the ranks that saved a step again, after every rank had synced it.
type resaveRound struct {
	ranks map[int]bool
	stop  func() bool
}

// noteResave records that rank saved step again. A backup of the step running now may hold
// either save of each rank: it does not count as the step's backup. The step is backed up again
// once every rank saved it again, or lagTimeout after the first did (the others keep their
// first save): ordered at the first report, a backup could take one rank's new save beside
// another's old one (found by a review). Called with mu held.
func (c *JobCoordinator) noteResave(step int64, rank int) {
	if o := c.backups.order; o != nil && o.step == step {
		o.stale = true
	}
	rr := c.resaves[step]
	if rr == nil {
		rr = &resaveRound{ranks: map[int]bool{}}
		c.resaves[step] = rr
		rr.stop = c.clock.AfterFunc(c.lagTimeout, func() {
			c.mu.Lock()
			defer c.mu.Unlock()
			if c.ctx.Err() == nil {
				c.resaved(step, rr)
			}
		})
	}
	rr.ranks[rank] = true
	if len(rr.ranks) == c.cfg.Nodes {
		rr.stop()
		c.resaved(step, rr)
	}
}

// resaved ends rr, step's round of saves again, and has the step backed up again. Called with
// mu held.
func (c *JobCoordinator) resaved(step int64, rr *resaveRound) {
	if c.resaves[step] != rr {
		return // ended already
	}
	delete(c.resaves, step)
	// A backup of the step holds the earlier save (one running meanwhile is stale, noteResave).
	if b := &c.backups; b.backedUp == step {
		b.backedUp = step - 1
		c.log.Info("step saved again after its backup: it is backed up again", "step", step, "backup", b.lastName)
	}
	c.backupSynced(step)
}

// arrive counts rank's report and returns the round to wait for.
func (c *JobCoordinator) arrive(rank int, rep tiers.SyncReport) (*syncRound, error) {
	last := c.synced[rank]
	if rep.Step == last && rep.Data != "" && c.data[rank] != "" && rep.Data != c.data[rank] {
		// The step saved again by this rank, with other data. It was taken for a retry of the
		// first save's sync: a step saved again once it was backed up was never backed up
		// again (a black-box run restored the first save). The other ranks' reports of the
		// step stand (they need not save it again).
		c.data[rank] = rep.Data
		c.log.Info("step saved again", "step", rep.Step, "rank", rank)
		if r := c.rounds[rep.Step]; r != nil && r.err == nil {
			if !rep.Replicated && !slices.Contains(r.missing, rank) {
				r.missing = append(r.missing, rank)
			}
			if !r.finished() {
				return r, nil // this rank is counted already; no backup of the step yet
			}
			c.noteResave(rep.Step, rank)
			if rep.Replicated {
				return c.replicatedLater(r, rank), nil
			}
			done := make(chan struct{})
			close(done)
			return &syncRound{step: r.step, done: done}, nil
		}
	}
	if rep.Step <= last {
		r := c.rounds[rep.Step]
		if r == nil || (rep.Step < last && !r.finished()) {
			return nil, fmt.Errorf("sync of step %d from rank %d, which already reported step %d", rep.Step, rank, last)
		}
		if rep.Step == last && rep.Replicated && r.finished() && r.err == nil {
			return c.replicatedLater(r, rank), nil
		}
		return r, nil // a retry: the outcome of the same round
	}
	aheadRank, aheadStep := c.ahead, c.synced[c.ahead]
	c.synced[rank], c.data[rank] = rep.Step, rep.Data
	if rep.Step > aheadStep {
		c.ahead = rank
	}
	// rank will never report the steps between its last one and this one.
	for _, r := range c.rounds {
		if r.step > last && r.step < rep.Step && !r.finished() {
			c.finish(r, tiers.SyncDecision{}, fmt.Errorf("sync of step %d: %w: rank %d reported step %d next", r.step, ErrStepSkipped, rank, rep.Step))
		}
	}
	r := c.rounds[rep.Step]
	if r == nil {
		r = &syncRound{step: rep.Step, done: make(chan struct{})}
		c.rounds[rep.Step] = r
		if aheadStep > rep.Step {
			// No round existed although a rank is past this step: that rank skipped it.
			c.finish(r, tiers.SyncDecision{}, fmt.Errorf("sync of step %d: %w: rank %d reported step %d instead", rep.Step, ErrStepSkipped, aheadRank, aheadStep))
		} else {
			r.stop = c.clock.AfterFunc(c.lagTimeout, func() { c.expire(r) })
		}
	}
	return c.count(r, rank, rep), nil
}

// count counts rank's report in r and completes r when every rank reported. Called with
// c.mu held.
func (c *JobCoordinator) count(r *syncRound, rank int, rep tiers.SyncReport) *syncRound {
	if r.finished() {
		return r
	}
	r.arrived++
	if !rep.Replicated {
		r.missing = append(r.missing, rank)
	}
	if r.arrived == c.cfg.Nodes {
		c.complete(r)
	}
	return r
}

func (r *syncRound) finished() bool {
	select {
	case <-r.done:
		return true
	default:
		return false
	}
}

// finish publishes a round's outcome. Called with c.mu held.
func (c *JobCoordinator) finish(r *syncRound, dec tiers.SyncDecision, err error) {
	if r.stop != nil {
		r.stop()
	}
	r.dec, r.err = dec, err
	close(r.done)
	if err != nil {
		c.log.Warn("sync failed", "step", r.step, "err", err)
	}
}

// complete decides a step every rank reported. Called with c.mu held.
func (c *JobCoordinator) complete(r *syncRound) {
	// restore.version is a one-shot override: gone after the first sync of a new checkpoint.
	if c.pinned != "" && c.store != nil && (!c.plan.Found || r.step != c.plan.Step) {
		if err := c.store.ClearRestoreVersion(c.ctx, c.cfg.JobName); err != nil {
			// The pin stays: the next step's sync tries again.
			c.finish(r, tiers.SyncDecision{}, fmt.Errorf("sync of step %d: delete restore.version: %w", r.step, err))
			return
		}
		c.pinned = ""
	}
	dec := tiers.SyncDecision{Replicated: len(r.missing) == 0}
	if dec.Replicated {
		c.replicated = max(c.replicated, r.step)
	} else {
		c.log.Warn("step not replicated", "step", r.step, "ranks", r.missing)
	}
	c.finish(r, dec, nil)
	c.backupSynced(r.step)
	// Every rank reported r.step, so every earlier round is finished and no rank can ask for
	// it again (all are past it).
	for step := range c.rounds {
		if step < r.step {
			delete(c.rounds, step)
		}
	}
}

// replicatedLater records that rank holds r.step replicated (it may have reported it not
// replicated, and replicated it since; or this is a resent request) and returns a finished
// round with the decision as it now stands (r's own dec is read without the lock, so it does
// not change). Called with c.mu held.
func (c *JobCoordinator) replicatedLater(r *syncRound, rank int) *syncRound {
	was := len(r.missing)
	r.missing = slices.DeleteFunc(r.missing, func(m int) bool { return m == rank })
	dec := tiers.SyncDecision{Replicated: len(r.missing) == 0}
	if dec.Replicated && was > 0 {
		c.replicated = max(c.replicated, r.step)
		c.log.Info("step replicated after all", "step", r.step, "last", rank)
	}
	done := make(chan struct{})
	close(done)
	return &syncRound{step: r.step, done: done, dec: dec}
}

// expire fails a round still waiting when its lag timeout passes.
func (c *JobCoordinator) expire(r *syncRound) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if r.finished() || c.ctx.Err() != nil {
		return
	}
	missing, n := someRanks(len(c.synced), func(rank int) bool { return c.synced[rank] < r.step })
	c.finish(r, tiers.SyncDecision{}, fmt.Errorf("sync of step %d: %w: ranks [%s] (%d of %d nodes) did not report it within %v",
		r.step, ErrSyncTimeout, rankList(missing, n), n, c.cfg.Nodes, c.lagTimeout))
}

// lastBackup is the newest backup name this coordinator knows of.
func (c *JobCoordinator) lastBackup() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.floor
}

// shownRanks is how many ranks a message names before "and N more".
const shownRanks = 8

// someRanks returns the first shownRanks ranks below n for which pick holds, and how many do.
func someRanks(n int, pick func(rank int) bool) (shown []int, total int) {
	for r := range n {
		if pick(r) {
			if total++; len(shown) < shownRanks {
				shown = append(shown, r)
			}
		}
	}
	return shown, total
}

// rankList renders someRanks' result for a message: "1, 2, 3", or "1, …, 8 and 4 more".
func rankList(shown []int, total int) string {
	names := make([]string, len(shown))
	for i, r := range shown {
		names[i] = strconv.Itoa(r)
	}
	list := strings.Join(names, ", ")
	if total > len(shown) {
		list += fmt.Sprintf(" and %d more", total-len(shown))
	}
	return list
}

// waitingFor says what a call that returns once every rank got as far (Negotiate, Restored)
// waits for: the ranks not heard from yet ("" once there are none), or the plan being made
// (then nodes is false).
func (c *JobCoordinator) waitingFor() (what string, nodes bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	ranks := func(done []bool) string { return rankList(someRanks(len(done), func(r int) bool { return !done[r] })) }
	switch {
	case !c.planning && c.nReported == c.cfg.Nodes:
		return fmt.Sprintf("every node sent its inventory to the coordinator (rank 0), which waits %v before it plans: it waited long for the last one, and an earlier start cut short may still be leaving", planGrace), true
	case !c.planning:
		return fmt.Sprintf("%d of %d nodes sent their inventory to the coordinator (rank 0); not yet rank %s",
			c.nReported, c.cfg.Nodes, ranks(c.reported)), true
	case c.nRestored < c.cfg.Nodes:
		select {
		case <-c.planned:
		default:
			return "the coordinator (rank 0) is reading the backup location to plan the restore", false
		}
		return fmt.Sprintf("%d of %d nodes restored; not yet rank %s", c.nRestored, c.cfg.Nodes, ranks(c.restored)), true
	}
	return "", false
}

// syncWaitingFor names the ranks that have not reported step yet ("": none).
func (c *JobCoordinator) syncWaitingFor(step int64) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	shown, total := someRanks(len(c.synced), func(r int) bool { return c.synced[r] < step })
	if total == 0 {
		return ""
	}
	return fmt.Sprintf("%d of %d nodes reported it to the coordinator (rank 0); not yet rank %s (a rank whose job has not saved the step yet, or whose agent is stopped or gone)",
		c.cfg.Nodes-total, c.cfg.Nodes, rankList(shown, total))
}

// negotiationStarted reports whether the inventories are frozen.
// barrierOpen reports whether the restore barrier was neither passed (every rank restored) nor
// failed.
func (c *JobCoordinator) barrierOpen() bool {
	select {
	case <-c.allRestored:
		return false
	case <-c.restoreFailed:
		return false
	default:
		return true
	}
}

func (c *JobCoordinator) negotiationStarted() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.planning
}

// Job routes the calls of a job's agents to the JobCoordinator of the job's current
// incarnation, creating one when the job restarts. It is what the rank-0 agent serves, in
// process (LocalClient) or behind the peer service.
//
// Each agent names its own incarnation with a random id, so ids differ between nodes; Job ties
// them together per rank. A Negotiate from a rank with a new id joins the current coordinator
// while it is still gathering inventories (the agent restarted: its new inventory replaces the
// old), and otherwise starts the next incarnation, closing the current coordinator so that its
// waiting callers return ErrClosed. Calls carrying an id of an earlier incarnation, and
// Restored or Sync with an id the current coordinator has not seen negotiate, fail with
// ErrOtherIncarnation.
//
// Only rank 0 starts an incarnation: a Negotiate from another agent (RemoteCoordinator) that
// would start one is told to try again (UNAVAILABLE, the caller looks up rank 0 again), and so
// is every call from another agent once this agent's own newest incarnation of the job is not
// rank 0 (Resign). A job restarted with rank 0 on another machine, whose former rank-0 agent
// still runs, then has one coordinator: before, the ranks that looked up rank 0 before the new
// one registered negotiated with the former, which started an incarnation of its own.
type Job struct {
	opts Options

	mu      sync.Mutex      // LOCK ORDERING: before JobCoordinator.mu
	cur     *JobCoordinator // GUARDED_BY(mu); nil before the first negotiation
	ids     []string        // GUARDED_BY(mu); by rank: the agent incarnation id cur coordinates
	retired map[string]bool // GUARDED_BY(mu); the ids of earlier incarnations (a few per restart)
	// retiredOrder holds retired's ids, the oldest first: only the newest maxRetired are kept
	// (a review: the set grew by a few ids at every restart of a long job).
	retiredOrder []string // GUARDED_BY(mu)
	// resigned is set when this agent's newest incarnation of the job is not rank 0 (Resign),
	// until it negotiates as rank 0 again: calls from other agents are sent to look again.
	resigned bool // GUARDED_BY(mu)
	// lastBackup is, by job name, the newest backup name an earlier coordinator decided
	// (Options.LastBackup for the next one of that job). Names are unique per job: another
	// job's held a job's first backup to the next minute (found by a black-box run).
	lastBackup map[string]string // GUARDED_BY(mu)
	// refusals are, by rank, the last call of the current incarnation's job refused for another
	// job shape (a rank whose replicator.yaml differs): WaitingFor names it, where rank 0's wait
	// said only "not yet rank R" (found by a black-box run).
	refusals map[int]refusal // GUARDED_BY(mu)
}

// refusal is a call refused for its job shape.
type refusal struct {
	why string
	at  time.Time
}

// refusalShown is how long after a refused call WaitingFor names it: the rank's agent retries
// every few seconds while the shapes differ.
const refusalShown = 30 * time.Second

// refused records that a call of rank was refused for its job shape (why). The record goes with
// the next incarnation.
func (j *Job) refused(rank int, why string, at time.Time) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.refusals == nil {
		j.refusals = map[int]refusal{}
	}
	j.refusals[rank] = refusal{why: why, at: at}
}

// refusalNote names the ranks refused for their job shape in the last refusalShown.
func (j *Job) refusalNote(now time.Time) string {
	j.mu.Lock()
	defer j.mu.Unlock()
	var notes []string
	for _, rank := range slices.Sorted(maps.Keys(j.refusals)) {
		if r := j.refusals[rank]; now.Sub(r.at) < refusalShown {
			notes = append(notes, fmt.Sprintf("rank %d's agent is refused: %s", rank, r.why))
		}
	}
	return strings.Join(notes, "; ")
}

// errNotRankZero is the UNAVAILABLE answer to a call from another agent that this agent cannot
// coordinate: its own newest incarnation of the job is not rank 0, or the call would start an
// incarnation that rank 0 did not start here. The caller looks up rank 0 again and retries.
var errNotRankZero = errors.New("this agent is not rank 0 of the job's newest incarnation (yet)")

// notRankZero is errNotRankZero as the UNAVAILABLE status a caller retries on.
func notRankZero(format string, args ...any) error {
	return &codedError{code: codes.Unavailable, err: fmt.Errorf(format+": %w", append(args, errNotRankZero)...)}
}

// Resign tells the job that this agent's newest incarnation of it is not rank 0: its coordinator
// ends (waiting callers get ErrClosed; a Negotiate from another agent is retried) and calls from
// other agents are told to look up rank 0 again, until this agent negotiates as rank 0 again.
func (j *Job) Resign() {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.resigned = true
	if j.cur != nil {
		j.keepLastBackup()
		j.cur.Close()
		j.cur, j.ids = nil, nil
	}
}

// keepLastBackup records the current coordinator's newest backup name for its job. Called with
// mu held.
func (j *Job) keepLastBackup() {
	if j.lastBackup == nil {
		j.lastBackup = map[string]string{}
	}
	j.lastBackup[j.cur.cfg.JobName] = j.cur.lastBackup()
}

// NewJob returns a Job whose coordinators use opts. Its LastBackup is carried from one
// incarnation's coordinator to the next of the same job.
func NewJob(opts Options) *Job { return &Job{opts: opts} }

// isResigned reports whether Resign holds (see Job).
func (j *Job) isResigned() bool {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.resigned
}

// Coordinator returns the coordinator for a call from rank in the agent incarnation inc, made in
// this process (LocalClient); negotiate is true for Negotiate, the only call that may start an
// incarnation.
func (j *Job) Coordinator(rank int, inc tiers.Incarnation, negotiate bool) (*JobCoordinator, error) {
	return j.coordinator(rank, inc, negotiate, false)
}

// RemoteCoordinator is Coordinator for a call from another agent (CoordinatorService): only a
// rank-0 caller may start an incarnation, and none is served while this agent resigned.
func (j *Job) RemoteCoordinator(rank int, inc tiers.Incarnation, negotiate bool) (*JobCoordinator, error) {
	return j.coordinator(rank, inc, negotiate, true)
}

func (j *Job) coordinator(rank int, inc tiers.Incarnation, negotiate, remote bool) (*JobCoordinator, error) {
	cfg := inc.Config
	if cfg == nil {
		return nil, fmt.Errorf("incarnation %s has no config", inc.ID)
	}
	if rank < 0 || rank >= cfg.Nodes {
		return nil, fmt.Errorf("rank %d is not in the job's %d nodes", rank, cfg.Nodes)
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	switch {
	case remote && j.resigned:
		return nil, notRankZero("rank %d", rank)
	case !remote && negotiate && rank == 0:
		j.resigned = false
	}
	if j.retired[inc.ID] {
		return nil, fmt.Errorf("incarnation %s of rank %d: %w (superseded by a newer one)", inc.ID, rank, ErrOtherIncarnation)
	}
	if negotiate {
		// The agent gave these up for inc: a call of theirs arriving late (held by a stalled
		// link, or retried as the job restarted) replaced inc's id while the plan was gathered,
		// and inc's Restored then failed as not negotiated (found by a black-box run).
		for _, id := range inc.Superseded {
			if id != inc.ID {
				j.retire(id)
			}
		}
	}
	if j.cur != nil && sameJob(j.cur.cfg, cfg) {
		switch known := j.ids[rank]; {
		case known == inc.ID:
			return j.cur, nil
		case !negotiate:
			return nil, fmt.Errorf("incarnation %s of rank %d: %w (not negotiated)", inc.ID, rank, ErrOtherIncarnation)
		case known == "" || !j.cur.negotiationStarted():
			j.ids[rank] = inc.ID
			return j.cur, nil
		case rank != 0 && slices.Contains(inc.Superseded, known) && j.cur.barrierOpen():
			// The plan counts on an incarnation inc gave up: it never reaches the barrier. A
			// late call of it (held by a stalled link) may have reached the coordinator before
			// inc's and completed the set; before, inc was told to look for rank 0 until the
			// job gave up, and the other ranks waited for it at the barrier (a review). The
			// incarnation ends: its callers get ErrClosed (a Negotiate negotiates again, a
			// restore waiting at the barrier fails at once, and the job restarts), and rank 0
			// starts the next one. The other ids are not retired: they are current ones, of
			// the ranks that negotiated this plan. Rank 0, and an incarnation whose barrier was
			// passed (a plain restart of the job), take the way below: a new incarnation that
			// retires every id of this one (a review: this branch skipped that, and a late call
			// of an old incarnation then joined the next plan).
			j.keepLastBackup()
			j.cur.Close()
			j.cur, j.ids = nil, nil
		}
	} else if !negotiate {
		return nil, fmt.Errorf("incarnation %s of rank %d: %w (not negotiated)", inc.ID, rank, ErrOtherIncarnation)
	}
	// The job restarted (or started, or changed shape): a new incarnation, which rank 0 starts.
	if remote && rank != 0 {
		return nil, notRankZero("negotiation of rank %d, incarnation %s", rank, inc.ID)
	}
	if j.cur != nil {
		for _, id := range j.ids {
			if id != "" {
				j.retire(id)
			}
		}
		j.keepLastBackup()
		j.cur.Close()
	}
	opts := j.opts
	opts.LastBackup = max(opts.LastBackup, j.lastBackup[cfg.JobName])
	next, err := NewJobCoordinator(cfg, opts)
	if err != nil {
		return nil, err
	}
	j.refusals = nil
	j.cur, j.ids = next, make([]string, cfg.Nodes)
	j.ids[rank] = inc.ID
	return next, nil
}

// maxRetired is how many retired incarnation ids a Job remembers: a late call is of one of the
// last few restarts, never of thousands ago.
const maxRetired = 4096

// retire refuses id's calls from now on. Called with mu held.
func (j *Job) retire(id string) {
	if j.retired[id] {
		return
	}
	if j.retired == nil {
		j.retired = map[string]bool{}
	}
	j.retired[id] = true
	j.retiredOrder = append(j.retiredOrder, id)
	if n := len(j.retiredOrder) - maxRetired; n > 0 {
		for _, old := range j.retiredOrder[:n] {
			delete(j.retired, old)
		}
		j.retiredOrder = slices.Delete(j.retiredOrder, 0, n)
	}
}

// sameJob reports whether two agents' configs describe the same job layout.
func sameJob(a, b *tiers.Config) bool {
	return a.JobName == b.JobName && a.Nodes == b.Nodes && a.WorkersPerNode == b.WorkersPerNode &&
		a.AssumeDataParallelism == b.AssumeDataParallelism
}

// LocalClient is the tiers.Coordinator of an agent whose coordinator runs in the same process:
// the rank comes from each call's incarnation config. It lets the replicator, tests and
// simulations drive many ranks of one Job without a network.
type LocalClient struct{ Job *Job }

var _ tiers.Coordinator = LocalClient{}

func (l LocalClient) Negotiate(ctx context.Context, inc tiers.Incarnation, inv tiers.Inventory) (tiers.RestorePlan, error) {
	c, rank, err := l.coordinator(inc, true)
	if err != nil {
		return tiers.RestorePlan{}, err
	}
	return c.Negotiate(ctx, rank, inv)
}

func (l LocalClient) Restored(ctx context.Context, inc tiers.Incarnation) error {
	c, rank, err := l.coordinator(inc, false)
	if err != nil {
		return err
	}
	return c.Restored(ctx, rank)
}

var _ tiers.RestoreFailureReporter = LocalClient{}

func (l LocalClient) RestoreFailed(ctx context.Context, inc tiers.Incarnation, reason string) error {
	c, rank, err := l.coordinator(inc, false)
	if err != nil {
		return err
	}
	return c.RestoreFailed(rank, reason)
}

func (l LocalClient) Sync(ctx context.Context, inc tiers.Incarnation, rep tiers.SyncReport) (tiers.SyncDecision, error) {
	c, rank, err := l.coordinator(inc, false)
	if err != nil {
		return tiers.SyncDecision{}, err
	}
	return c.Sync(ctx, rank, rep)
}

func (l LocalClient) Backups(ctx context.Context, inc tiers.Incarnation, rep tiers.BackupReport) (tiers.BackupOrder, error) {
	c, rank, err := l.coordinator(inc, false)
	if err != nil {
		return tiers.BackupOrder{}, err
	}
	return c.Backups(ctx, rank, rep)
}

var _ tiers.WaitDescriber = LocalClient{}

// WaitingFor says which ranks inc's pending Negotiate or Restored waits for.
func (l LocalClient) WaitingFor(inc tiers.Incarnation) (string, bool) {
	if c, _, err := l.coordinator(inc, false); err == nil {
		what, nodes := c.waitingFor()
		if note := l.Job.refusalNote(time.Now()); note != "" && what != "" {
			what += "; " + note
		}
		return what, nodes
	}
	return "", false
}

// SyncWaitingFor names the ranks inc's pending sync of step waits for.
func (l LocalClient) SyncWaitingFor(inc tiers.Incarnation, step int64) string {
	if c, _, err := l.coordinator(inc, false); err == nil {
		return c.syncWaitingFor(step)
	}
	return ""
}

var _ tiers.SyncWaitDescriber = LocalClient{}

func (l LocalClient) coordinator(inc tiers.Incarnation, negotiate bool) (*JobCoordinator, int, error) {
	if inc.Config == nil {
		return nil, 0, fmt.Errorf("incarnation %s has no config", inc.ID)
	}
	c, err := l.Job.Coordinator(inc.Config.NodeRank, inc, negotiate)
	return c, inc.Config.NodeRank, err
}
