package tiers

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Pushes that failed are tried again while their step is this node's newest of the current
// incarnation (a job that saves once an hour, or a restored step, would otherwise stay on one
// node until the next save): first after rePushFirst, then after twice as long each time, up to
// rePushMax.
const (
	rePushFirst = 30 * time.Second
	rePushMax   = 5 * time.Minute
)

// syncer replicates sealed steps to the peers and syncs each step with the coordinator once
// every worker of this node sealed and replicated it, in order; then retention frees what it no
// longer needs. A step counts as replicated only if every worker's replication did. Its
// goroutine (run) ends once its queue is closed and drained; the pushes of a step run each on
// its own goroutine, which the syncer waits for, and end with their incarnation. The pushes of
// a step that failed are tried again later (rePush) until the next step of the incarnation
// comes; a later try that is running when it comes is cancelled.
type syncer struct {
	*node
	in        *fifo[sealedStep]               // from the sealer, and restored steps from the restorer
	popHook   func(step int64, restored bool) // tests: runs as each step is taken (before Start)
	lineAfter atomic.Int64                    // tests: syncLineAfter instead (0: syncLineAfter)
	coord     Coordinator
	incs      *incarnations
	retention *retention
	lines     *jobLines
	pushers   *pushers // one per peer; only this goroutine uses them

	// The waits before the next try of a failed push (rePushFirst, rePushMax by default;
	// settable for tests).
	rePushFirst, rePushMax atomic.Int64
	// Only the run goroutine uses these.
	progress map[syncKey]*syncProgress // the steps whose workers' reports are gathered
	pending  *rePush                   // the step to push again, if any
	timer    *time.Timer               // queues pending's next try: a tick (sealedStep.rePush = gen)
	gen      uint64                    // the tick of pending's next try
	// afterRestore are the syncs of steps the job committed while its restore ran (it saved
	// without waiting for its markers), in order: the coordinator refuses an incarnation's
	// sync before its negotiation ends ("not negotiated", which the job was told, and the step
	// was never synced nor backed up until a next save; a review). They are synced once the
	// restore is done (sealedStep.restoreDone), before any later step.
	afterRestore []waitingSync

	viewMu  sync.Mutex
	view    *RePushView // GUARDED_BY(viewMu); pending, for status
	syncing *syncing    // GUARDED_BY(viewMu); the sync under way, for status
}

// syncing is a sync with the coordinator under way.
type syncing struct {
	inc   *incarnation
	step  int64
	since time.Time
}

// waitingSync is a sync that waits for its incarnation's restore to end. again are the sealed
// steps (one per worker) of a step the job committed while the restore ran: its pushes then
// reached peers whose own restore drops what is above the step restored, so it is pushed again
// once the restore is done (every node's drops come before the restore barrier).
type waitingSync struct {
	c          commit
	replicated bool
	again      []sealedStep
}

// rePush is a step whose pushes to some peers failed: by worker, its sealed step and the peers
// that did not acknowledge it.
type rePush struct {
	c      commit
	failed map[int]workerPushes // by worker
	wait   time.Duration        // before the next try
	tries  int                  // made so far, the first one included
	// synced: the coordinator decided the step (not replicated); it is told again once every
	// push succeeded. A step whose sync failed (a rank did not report it in time) is still
	// pushed: a restore plans from what the peers hold, decided or not.
	synced bool
}

// workerPushes is one worker's sealed step and the peers its pushes failed to (none: all
// acknowledged).
type workerPushes struct {
	s     sealedStep
	peers []int
}

// syncKey is a step of an incarnation whose workers' sealed parts the syncer gathers.
type syncKey struct {
	inc      *incarnation
	step     int64
	restored bool // a restored step's parts never mix with a save of the same step's
}

// syncProgress is what the workers of a step reported so far.
type syncProgress struct {
	pushes map[int]workerPushes // by worker that reported; peers nil when its pushes succeeded
	synced bool                 // every worker reported: each later report syncs it again
	skip   bool                 // not pushed: superseded when its first worker reported
	first  time.Time            // when its first worker reported
}

// syncLineAfter is how long a step's sync may wait before the job is told (once per
// incarnation; syncer.lineAfter, when set, in tests).
const syncLineAfter = time.Minute

// workersLagAfter is how long a step may wait for the rest of its node's workers, while one of
// them has committed a newer step, before the job is told (once per incarnation).
const workersLagAfter = time.Minute

// tellMissingWorkers tells the job, once per incarnation, of a step of s's incarnation that
// some workers of this node committed workersLagAfter or more ago and others never did, while
// a worker has committed a newer step (s): a job whose workers-per-node was higher than its
// workers saved for nothing, and heard of it only at its restart, which started from scratch
// (black-box h59: three steps of worker 0 with workers-per-node: 2).
func (sy *syncer) tellMissingWorkers(s sealedStep) {
	if s.restored || s.inc.Config.WorkersPerNode < 2 || s.inc.workersTold.Load() {
		return
	}
	var k syncKey
	var p *syncProgress
	for key, pr := range sy.progress { // the oldest such step
		if key.inc == s.inc && !key.restored && key.step < s.step && !pr.synced && sy.now().Sub(pr.first) >= workersLagAfter && (p == nil || key.step < k.step) {
			k, p = key, pr
		}
	}
	if p != nil {
		var have, missing []int
		for w := range s.inc.Config.WorkersPerNode {
			if _, ok := p.pushes[w]; ok {
				have = append(have, w)
			} else {
				missing = append(missing, w)
			}
		}
		if !s.inc.workersTold.CompareAndSwap(false, true) {
			return
		}
		msg := fmt.Sprintf("step %d: worker(s) %s of this node committed it %s ago, worker(s) %s never did (workers-per-node: %d), and step %d was committed since: a step is synced, replicated, backed up and restorable only once every worker of every node committed it; is workers-per-node right?",
			k.step, JoinAtMost(have, maxRanksNamed), sy.now().Sub(p.first).Round(time.Second), JoinAtMost(missing, maxRanksNamed), s.inc.Config.WorkersPerNode, s.step)
		sy.log.Warn(msg)
		sy.lines.incLine(s.inc, msg)
	}
}

// notePushed records that worker's pushes of s, tried again, now fail to peers only (none:
// all acknowledged), so that a later sync of the step kept in progress (a worker saving it
// again) does not report the failures of the first try (a review: the step read as not
// replicated, and was pushed again, until that extra push succeeded).
func (sy *syncer) notePushed(s sealedStep, worker int, peers []int) {
	pr := sy.progress[syncKey{s.inc, s.step, s.restored}]
	if pr == nil {
		return
	}
	if wp, ok := pr.pushes[worker]; ok && wp.s.dataName == s.dataName {
		wp.peers = peers
		pr.pushes[worker] = wp
	}
}

func (sy *syncer) run() {
	sy.progress = map[syncKey]*syncProgress{}
	defer sy.stopRePush()
	for {
		s, ok := sy.in.pop()
		if !ok {
			return
		}
		if s.rePush != 0 {
			if sy.pending != nil && sy.gen == s.rePush {
				sy.tryAgain()
			}
			continue // a tick of a try that is no longer pending
		}
		if s.restoreDone {
			if s.inc != nil {
				// Queued after the restored step's parts: they were all taken, and their sync
				// waits with those of the steps committed meanwhile; all go now, in order.
				s.inc.setRestoredSyncDue(false)
			}
			sy.syncAfterRestore(nil)
			continue
		}
		if sy.popHook != nil {
			sy.popHook(s.step, s.restored)
		}
		// Any step of the current incarnation (the next one, or the same step saved again)
		// supersedes the later tries; a step of an earlier incarnation sealed late does not.
		// (A step the job saved while its restore ran never has later tries here: it is pushed
		// again after the restore, behind the restored step.)
		// A restored step is older than any step of its incarnation that has later tries.
		if sy.pending != nil && !s.restored && (sy.incs.isCurrent(s.inc) || !sy.incs.isCurrent(sy.pending.c.inc)) {
			sy.stopRePush()
		}
		k := syncKey{s.inc, s.step, s.restored}
		p := sy.progress[k]
		if p == nil {
			for old := range sy.progress {
				if old.inc != s.inc && !sy.incs.isCurrent(old.inc) {
					delete(sy.progress, old) // an earlier incarnation's, never to be completed
				}
			}
			// Whether the step is pushed is decided once, at its first worker's report, for
			// all its workers: decided per worker, with pushes slower than the saves, worker 0
			// of each step was the newest and pushed, worker 1 found its next step queued and
			// was not, and no step was ever replicated (a review).
			p = &syncProgress{pushes: map[int]workerPushes{}, skip: sy.superseded(s), first: sy.now()}
			sy.progress[k] = p
			sy.tellMissingWorkers(s)
		}
		var failedPeers []int
		if p.skip {
			failedPeers = sy.skipPush(s)
		} else if failedPeers = sy.replicate(s); len(failedPeers) > 0 {
			sy.retention.warnIfFilling(sy.lines, s.inc, true)
		}
		p.pushes[s.worker] = workerPushes{s: s, peers: failedPeers}
		if len(p.pushes) < s.inc.Config.WorkersPerNode {
			continue
		}
		// A step every worker reported stays, the newest such of the incarnation only: a
		// worker that saves it again syncs it again at once, beside the other workers' latest
		// data, which is what this node holds. (Taken off at the sync, a worker's second save
		// made before another worker's first replaced its first, and another worker's second
		// save then waited for a report that had come: the step was never synced with the data
		// the node held, and its backup named data the node had replaced.)
		if s.restored {
			delete(sy.progress, k)
		} else {
			for old, op := range sy.progress {
				if old != k && op.synced && old.inc == s.inc {
					delete(sy.progress, old)
				}
			}
			p.synced = true
		}
		c := s.commit
		var data []string
		for _, w := range slices.Sorted(maps.Keys(p.pushes)) {
			data = append(data, p.pushes[w].s.dataName)
		}
		c.syncData = strings.Join(data, ",")
		if !s.restored && sy.incs.isCurrent(s.inc) && s.inc.restoring() {
			// Committed while the restore runs: pushed again, and synced, once it is done.
			var again []sealedStep
			for _, w := range slices.Sorted(maps.Keys(p.pushes)) {
				again = append(again, p.pushes[w].s)
			}
			sy.afterRestore = append(sy.afterRestore, waitingSync{c: c, again: again})
			continue
		}
		failed := maps.Clone(p.pushes)
		maps.DeleteFunc(failed, func(_ int, f workerPushes) bool { return len(f.peers) == 0 })
		synced := sy.sync(c, len(failed) == 0)
		// A step not pushed for a newer one is not tried again: the newer step's push is.
		if len(failed) > 0 && !p.skip && sy.incs.isCurrent(s.inc) {
			sy.pushLater(c, failed, synced)
		}
	}
}

// superseded reports whether s, a step the job saved, need not be pushed: a newer step of the
// incarnation (of any worker) is queued behind it already, and only the newest step replicated
// matters to a restore. A link slower than the job's saves pushed every step in turn: the steps
// waiting for their push were kept in RAM (each is newer than the latest replicated one) until
// the RAM was full, the job's saves failed with ENOSPC, and the peers, just as full, refused
// every push, also once the link was fast again (a black-box run). A step being restored, or
// saved while its incarnation restores (pushed again once the restore is done), is pushed.
func (sy *syncer) superseded(s sealedStep) bool {
	if s.restored || len(s.inc.Config.Peers()) == 0 || sy.pushers.transport == nil || !sy.incs.isCurrent(s.inc) || s.inc.restoring() {
		return false
	}
	return sy.in.has(func(q sealedStep) bool {
		return q.rePush == 0 && !q.restoreDone && !q.restored && q.inc == s.inc && q.step > s.step
	})
}

// skipPush passes over the pushes of s, superseded: the files of it pushed early (before its
// commit) are dropped on the peers, and the pushes of them still queued are not made. It
// returns the peers s is not replicated to: all of them.
func (sy *syncer) skipPush(s sealedStep) []int {
	peers := s.inc.Config.Peers()
	sy.log.Info("step not pushed: a newer step of this node is queued for its push already", "step", s.step, "worker", s.worker)
	if s.group == "" {
		return peers
	}
	g := s.inc.takeEarlyGroup(s.group)
	if g == nil {
		return peers
	}
	g.superseded.Store(true)
	g.pending.Wait() // the push of one file at most: the queued ones are not made
	if et, ok := sy.pushers.early.transportFor(s.inc.Config); ok {
		for _, peer := range g.peers() {
			sy.pushers.early.dropOn(et, s.inc, peer, s.group)
		}
	}
	return peers
}

// pushLater makes c, whose pushes failed to the peers of failed, the step whose pushes are tried
// again (synced: the coordinator decided it), unless its incarnation ended.
func (sy *syncer) pushLater(c commit, failed map[int]workerPushes, synced bool) {
	if c.inc.ctx.Err() != nil {
		return
	}
	sy.stopRePush()
	sy.pending = &rePush{c: c, failed: failed, wait: time.Duration(sy.rePushFirst.Load()), tries: 1, synced: synced}
	sy.arm()
}

// arm queues a tick for the pending step after its wait, and shows it in the status.
func (sy *syncer) arm() {
	p := sy.pending
	sy.gen++
	tick := sealedStep{rePush: sy.gen}
	sy.timer = time.AfterFunc(p.wait, func() { sy.in.push(tick) })
	sy.setView(p, time.Now().Add(p.wait))
}

func (sy *syncer) stopRePush() {
	if sy.timer != nil {
		sy.timer.Stop()
	}
	sy.pending, sy.timer = nil, nil
	sy.setView(nil, time.Time{})
}

// setView shows p in the status: its next try at next, or running now (next zero).
func (sy *syncer) setView(p *rePush, next time.Time) {
	var v *RePushView
	if p != nil {
		v = &RePushView{inc: p.c.inc, Step: p.c.step, To: p.peers(), Failed: p.tries, Next: next, Trying: next.IsZero()}
		if v.Trying {
			v.Failed--
		}
	}
	sy.viewMu.Lock()
	sy.view = v
	sy.viewMu.Unlock()
}

// syncingView returns job's sync under way when it has waited SyncWaitShown or longer (a
// black-box run: during a partition from rank 0, a step committed meanwhile waited minutes
// behind the sync of the one before, with no push tried, and the status said nothing of it).
func (sy *syncer) syncingView(job string) *SyncingView {
	sy.viewMu.Lock()
	defer sy.viewMu.Unlock()
	s := sy.syncing
	if s == nil || s.inc.Config.JobName != job || sy.now().Sub(s.since) < SyncWaitShown {
		return nil
	}
	v := &SyncingView{Step: s.step, Since: s.since}
	if d, ok := sy.coord.(SyncWaitDescriber); ok {
		v.WaitingFor = d.SyncWaitingFor(s.inc.Incarnation, s.step)
	}
	return v
}

// status returns the later tries of job's pushes, if any are pending in the current incarnation.
func (sy *syncer) status(job string) *RePushView {
	sy.viewMu.Lock()
	defer sy.viewMu.Unlock()
	if sy.view == nil || sy.view.inc.Config.JobName != job || !sy.incs.isCurrent(sy.view.inc) {
		return nil
	}
	v := *sy.view
	return &v
}

// peers lists the peers some push of p failed to, in order.
func (p *rePush) peers() []int {
	var peers []int
	for _, f := range p.failed {
		peers = append(peers, f.peers...)
	}
	slices.Sort(peers)
	return slices.Compact(peers)
}

// newerStepPoll is how often a later try checks whether a newer step is queued.
const newerStepPoll = 100 * time.Millisecond

// tryAgain pushes the pending step again to the peers that had failed, once each; once none is
// left it syncs the step again, replicated, and otherwise arms the next try. A step of the
// current incarnation queued meanwhile cancels the try: that step is pushed next.
func (sy *syncer) tryAgain() {
	p := sy.pending
	inc := p.c.inc
	if !sy.incs.isCurrent(inc) || inc.ctx.Err() != nil {
		sy.stopRePush()
		return
	}
	p.tries++
	sy.setView(p, time.Time{})
	ctx, cancel := context.WithCancel(inc.ctx)
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		t := time.NewTicker(newerStepPoll)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				if sy.in.has(func(s sealedStep) bool { return s.rePush == 0 && sy.incs.isCurrent(s.inc) }) {
					cancel()
				}
			}
		}
	}()
	for w, f := range p.failed {
		f.peers = sy.replicateTo(ctx, f.s, f.peers, true)
		sy.notePushed(f.s, w, f.peers)
		if len(f.peers) == 0 {
			delete(p.failed, w)
		} else {
			p.failed[w] = f
		}
	}
	superseded := ctx.Err() != nil
	cancel()
	<-watched
	switch {
	case inc.ctx.Err() != nil:
		sy.stopRePush()
	case len(p.failed) == 0:
		sy.log.Info("step replicated on a later try", "step", p.c.step, "tries", p.tries)
		sy.stopRePush()
		if p.synced {
			sy.sync(p.c, true)
		}
		for i, w := range sy.afterRestore { // its sync waits for the restore: replicated now
			if w.c.inc == p.c.inc && w.c.step == p.c.step {
				sy.afterRestore[i].replicated = true
			}
		}
	case superseded:
		// The step queued will stop this one when popped; armed again in case it does not.
		p.tries--
		sy.arm()
	default:
		p.wait = min(2*p.wait, time.Duration(sy.rePushMax.Load()))
		sy.log.Warn("step still not replicated; trying again later", "step", p.c.step, "to", p.peers(),
			"tries", p.tries, "next", p.wait.String())
		sy.arm()
	}
}

// replicate pushes a sealed step to the step's peers (SPEC §4), to all of them at once, and
// returns the peers that did not acknowledge a verified replica (none when there are no
// peers): only those count.
func (sy *syncer) replicate(s sealedStep) []int {
	peers := s.inc.Config.Peers()
	if len(peers) == 0 {
		return nil
	}
	return sy.replicateTo(s.inc.ctx, s, peers, false)
}

// replicateTo pushes s to peers at once and returns those that failed. again: a later try of a
// step synced not replicated (no early pushes, one attempt, and no line to the job: it was told).
func (sy *syncer) replicateTo(ctx context.Context, s sealedStep, peers []int, again bool) []int {
	if sy.pushers.transport == nil {
		return peers
	}
	var early *earlyGroup
	if !again {
		early = sy.pushers.early.take(s.commit)
		defer sy.pushers.early.dropAbandoned(s.inc)
	}
	dataBytes := sync.OnceValue(func() int64 { return treeBytes(sy.spoolDir("sealed", s.dataName)) })
	acked := make([]bool, len(peers))
	var pushes sync.WaitGroup
	for i, rank := range peers {
		p := sy.pushers.to(rank)
		pushes.Go(func() { acked[i] = p.push(ctx, s, early, dataBytes, again) })
	}
	pushes.Wait()
	var failed []int
	for i, ok := range acked {
		if !ok {
			failed = append(failed, peers[i])
		}
	}
	return failed
}

// syncAfterRestore syncs the steps whose sync waited for their incarnation's restore, once it
// is done; those of an incarnation that ended go.
//
// They go in step order: the restored step's sync (queued by the restore) comes after those of
// the steps the job saved meanwhile, and the coordinator refuses a step below one already
// reported.
// It returns what the sync of c (one of them, if not nil) returned.
func (sy *syncer) syncAfterRestore(c *commit) (synced bool) {
	waiting := sy.afterRestore
	sy.afterRestore = nil
	slices.SortStableFunc(waiting, func(a, b waitingSync) int { return cmp.Compare(a.c.step, b.c.step) })
	for i, w := range waiting {
		switch {
		case !sy.incs.isCurrent(w.c.inc):
			// The job restarted: its next incarnation's restore finds the step.
		case w.c.inc.syncWaits():
			// Not done yet (a tick of an earlier incarnation's end), or its restored step's
			// sync is not reached yet.
			sy.afterRestore = waiting[i:]
			return synced
		case w.again != nil:
			failed := map[int]workerPushes{}
			for _, s := range w.again {
				if peers := sy.replicate(s); len(peers) > 0 {
					failed[s.worker] = workerPushes{s: s, peers: peers}
				}
			}
			if len(failed) > 0 {
				sy.retention.warnIfFilling(sy.lines, w.c.inc, true)
			}
			ok := sy.syncNow(w.c, len(failed) == 0)
			if len(failed) > 0 {
				sy.pushLater(w.c, failed, ok)
			}
		default:
			ok := sy.syncNow(w.c, w.replicated)
			if c != nil && w.c.inc == c.inc && w.c.step == c.step && w.c.worker == c.worker {
				synced = ok
			}
			if p := sy.pending; p != nil && p.c.inc == w.c.inc && p.c.step == w.c.step {
				// Its pushes are tried again: the coordinator decided it now, and is told
				// again once they succeed (a review: the deferred sync had said no).
				p.synced = p.synced || ok
			}
		}
	}
	return synced
}

// sync reports a step every worker of this node sealed and replicated (replicated: all
// succeeded) to the coordinator, and frees what retention no longer needs. (Backups are
// ordered by the coordinator on its own clock, see backupRunner.) It returns whether the
// coordinator decided the step.
func (sy *syncer) sync(c commit, replicated bool) bool {
	if !sy.incs.isCurrent(c.inc) {
		return false // an older incarnation's step: sealed and kept, but not synced
	}
	if c.inc.syncWaits() || len(sy.afterRestore) > 0 {
		// Waits for the restore, or for the restored step's sync (a step committed while the
		// restore ran, taken by the syncer after it was done but before the restored step),
		// or goes in order with those that waited.
		sy.afterRestore = append(sy.afterRestore, waitingSync{c: c, replicated: replicated})
		if c.inc.syncWaits() {
			return false
		}
		return sy.syncAfterRestore(&c)
	}
	return sy.syncNow(c, replicated)
}

// syncNow is sync once nothing waits.
func (sy *syncer) syncNow(c commit, replicated bool) bool {
	c.inc.mu.Lock()
	newer := c.inc.committed // the newest step this node reported (or restored) in the incarnation
	c.inc.mu.Unlock()
	if newer > c.step {
		// The job saved a step below one it already committed or was restored (a new run of
		// the same job-name counting from 1 again, after it was handed the old run's step 3).
		// The coordinator takes each rank's steps in increasing order and refuses it: the step
		// stays in this node's RAM, never replicated nor backed up, and a restart restores the
		// newer step. A line said only "sync of step 1 failed: … already reported step 3";
		// then, for a while, nothing (a black-box run: the new run's work was lost with the
		// RAM, silently).
		sy.log.Warn("a step below one already committed in this run is not synced", "step", c.step, "newer", newer)
		if c.inc.belowTold.CompareAndSwap(false, true) {
			sy.lines.incLine(c.inc, fmt.Sprintf("step %d was saved after step %d in this run (restored or committed): steps are kept in increasing order, so step %d (and any later one below step %d) stays in this node's RAM only, is not replicated nor backed up, and a restart restores step %d; a job that counts its steps from the start again needs another job-name (or the old steps removed from RAM and backups)",
				c.step, newer, c.step, newer, newer))
		}
		return false
	}
	c.inc.noteCommitted(c.step)
	sy.viewMu.Lock()
	cur := &syncing{inc: c.inc, step: c.step, since: sy.now()}
	sy.syncing = cur
	sy.viewMu.Unlock()
	// A sync that waits long is told to the job once per incarnation, with the ranks it waits
	// for: one stuck on a lost rank said nothing anywhere (black-box h58).
	after := time.Duration(sy.lineAfter.Load())
	if after == 0 {
		after = syncLineAfter
	}
	tell := time.AfterFunc(after, func() {
		sy.viewMu.Lock()
		still := sy.syncing == cur
		sy.viewMu.Unlock()
		if !still || c.inc.ctx.Err() != nil || !c.inc.syncWaitTold.CompareAndSwap(false, true) {
			return
		}
		what := "every node's report of it"
		if d, ok := sy.coord.(SyncWaitDescriber); ok {
			if w := d.SyncWaitingFor(c.inc.Incarnation, c.step); w != "" {
				what = w
			}
		}
		msg := fmt.Sprintf("step %d's sync with the coordinator (rank 0) has waited %s: %s; until it is synced, this step and the ones saved after it are not replicated nor backed up", c.step, after, what)
		sy.log.Warn(msg)
		sy.lines.incLine(c.inc, msg)
	})
	dec, err := sy.coord.Sync(c.inc.ctx, c.inc.Incarnation, SyncReport{Step: c.step, Replicated: replicated, Data: c.syncData})
	tell.Stop()
	sy.viewMu.Lock()
	sy.syncing = nil
	sy.viewMu.Unlock()
	if err != nil && c.inc.ctx.Err() != nil {
		// The incarnation ended (the job restarted, or the agent stops): nothing went wrong
		// that the job or an operator should hear of (before, every restart logged an ERROR).
		sy.log.Info("sync abandoned: the incarnation ended", "step", c.step, "incarnation", c.inc.ID)
		return false
	}
	if err != nil && (errors.Is(err, ErrOtherIncarnation) || errors.Is(err, ErrIncarnationOver) || errors.Is(err, ErrJobShape)) {
		// Not this step's failure: the job restarted (everywhere, or without this node). The
		// line "sync of step N failed: … the incarnation is over" reached the restarted job
		// as unread news (black-box h61).
		sy.log.Info("sync refused: the coordinator serves another incarnation of the job", "step", c.step, "incarnation", c.inc.ID, "err", err)
		if !errors.Is(err, ErrIncarnationOver) {
			// Another shape: the job restarted with another replicator.yaml without this node
			// (black-box h61: each save's line blamed the shape).
			sy.outdated(c.inc, err, sy.incs, sy.lines)
		}
		return false
	}
	if err != nil {
		sy.metrics.error(errKindSync)
		sy.lines.incLine(c.inc, fmt.Sprintf("sync of step %d failed: %v", c.step, err))
		return false
	}
	c.inc.noteEverywhere(c.step)
	if dec.Replicated && sy.incs.isCurrent(c.inc) {
		c.inc.noteReplicated(c.step)
	}
	sy.retention.retain(c.inc.Config)
	sy.retention.warnIfHeldOpen(sy.lines, c.inc)
	return true
}
