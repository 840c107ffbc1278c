package tiers

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/mtcfs/mtcfs/layout"
)

// restorer runs the restore of each incarnation (SPEC §5), on a goroutine the handshake starts
// (run), which ends when the restore is done or the incarnation ends. Once the job's restore
// plan is known it starts the incarnation's backup loop; once the markers are about to appear it
// queues the restored step to the syncer, which pushes it to the peers again.
type restorer struct {
	*node
	coord     Coordinator
	store     BackupStore   // nil: no backup tier
	peers     PeerTransport // nil: no peers
	incs      *incarnations
	lines     *jobLines
	retention *retention
	recorder  *commitRecorder   // restores wait until what was committed before is sealed
	backups   *backupRunner     // started once the incarnation negotiated
	synced    *fifo[sealedStep] // the syncer's queue: the restored step is protected again
	// keptSpools lists the machine's spools (ReplicatorConfig.KeptSpools); nil: none.
	keptSpools func() ([]SpoolInfo, error)
	sealer     *sealer // its latest sealed step goes down with the steps a restore drops
	// fetchRetryWithin replaces peerFetchRetryWithin when set (tests).
	fetchRetryWithin atomic.Int64
}

// run runs SPEC §5 for this node: negotiate, publish replicator.prerestore,
// bring in the data (own RAM, then a peer's, then the backup), wait for every node, then create
// the markers.
func (r *restorer) run(inc *incarnation) {
	cfg := inc.Config
	ctx := inc.ctx
	fail := func(msg string) {
		if ctx.Err() != nil {
			return // superseded by a new replicator.yaml or the agent stopping: not the job's failure
		}
		r.metrics.error(errKindRestore)
		r.lines.failLine(cfg, msg)
		inc.setPhase("failed")
	}
	superseded := func() bool { return ctx.Err() != nil || !r.incs.isCurrent(inc) }
	// failPlanned fails a restore that has its plan: the other ranks, which wait for this one
	// at the barrier, are told too (where the coordinator can), instead of waiting until their
	// jobs give up after 300 s (found by black-box runs).
	failPlanned := func(msg string) {
		fail(msg)
		if ctx.Err() != nil {
			return
		}
		rep, ok := r.coord.(RestoreFailureReporter)
		if !ok {
			return
		}
		// Bounded by the agent's life, not the incarnation's: the job restarts at the line
		// written above, and its next yaml ends the incarnation while the call may still be
		// retrying (found by a review). On its own goroutine: a rank 0 that cannot be reached
		// is tried for minutes.
		r.tasks.Add(1)
		go func() {
			defer r.tasks.Done()
			tctx, cancel := context.WithTimeout(r.ctx, restoreFailedTimeout)
			defer cancel()
			if err := rep.RestoreFailed(tctx, inc.Incarnation, msg); err != nil {
				r.log.Warn("could not tell the other nodes that this node's restore failed: their jobs wait for their restore until they give up", "err", err)
			}
		}()
	}
	// Steps the job committed before it restarted count: wait until they are sealed, so that
	// the inventory holds them (SPEC §2: a committed step is never dropped).
	if err := r.recorder.waitSealed(ctx); err != nil {
		return
	}
	var plan RestorePlan
	err := r.waitNoticed(inc, "the restore negotiation", negotiationHint, func() (err error) {
		inv := r.retention.inventory(cfg.NodeRank)
		inv.Timeline = r.spool.Timeline(cfg.JobName)
		plan, err = r.coord.Negotiate(ctx, inc.Incarnation, inv)
		return err
	})
	if err != nil {
		fail(fmt.Sprintf("restore negotiation failed: %v", err))
		return
	}
	if superseded() {
		return
	}
	r.backups.start(inc)
	// Data is named by its content: another job's may be this plan's too, which peers fetch
	// from here until the restore is over (found by a review).
	for hash := range plan.Holders {
		defer r.retention.hold(hash + ".data")()
	}
	// The restore's lines go to replicator.errors in one write, before the prerestore: the
	// job reads the file and unlinks it, and a line appended between the two is lost (a
	// clean-clone CI run lost plan lines; a review, the others).
	var lines []string
	if f, ok := r.spool.TakeFreed(cfg.JobName); ok && len(f.Steps) > 0 && (!plan.Found || plan.Step < slices.Max(f.Steps)) {
		// The job's steps were freed here for another job (a job-name mistyped on every rank,
		// or a one-node job): the job restored an older step, or nothing, without a word.
		lines = append(lines, fmt.Sprintf("this node's RAM held step(s) %s of this job; they were freed at %s when job %s, another job-name, restored on this mount: only what a peer or a backup holds is restored", JoinSteps(f.Steps), f.At.Format(time.RFC3339), f.By))
	}
	// It lists the machine's spools (every process's command line): off the restore's path,
	// but waited for a moment, so that a job that reads replicator.errors only at its restore
	// (NeMo, pytorch) sees the line (reviews).
	orphans := make(chan []string, 1)
	r.tasks.Add(1) // Close waits for it
	go func() {
		defer r.tasks.Done()
		orphans <- r.orphanedStepLines(inc, plan)
	}()
	if l := r.freeOtherJobs(inc); l != "" {
		lines = append(lines, l)
	}
	lines = append(lines, plan.Errors...)
	if plan.Found && plan.Step == 0 && cfg.Framework == FrameworkPyTorchDistributed {
		// NeMo commits global step g as step g-1 and takes no restore of step 0: a job whose
		// only save was global step 1 started from scratch without a word (found by a
		// black-box run). The job cannot be made to take it; it is told with the plan's lines,
		// before the prerestore. NeMo reads replicator.errors once, as the yaml goes, before
		// any restore line is written: it reads them at its next start (takeUnread), where the
		// handshake removed them unread (a black-box run).
		msg := "step 0 (NeMo's global step 1) is restored, but NeMo takes no restore of step 0: the job starts from scratch"
		r.log.Warn(msg, "job", cfg.JobName)
		lines = append(lines, msg)
	}
	// None of the drops takes a step the job committed in this incarnation: it went on saving
	// while the restore waited, and those steps are of no timeline or shape it left (a review:
	// the other drops took what dropAbandonedSteps said it kept).
	r.dropStaleTimeline(inc, plan)
	kept := r.dropAbandonedSteps(inc, plan)
	r.dropOtherShapeSteps(inc, plan)
	if kept != "" {
		lines = append(lines, kept)
	}
	// What the spool holds from now on is of this shape: the steps above the plan's are gone,
	// those of another shape too, and the plan never picks one this shape cannot restore.
	// Recorded after the drops, so that a crash in between leaves the old shape on steps of the
	// old shape; a record that cannot be written is removed (unknown, never stale).
	step := int64(-1)
	if plan.Found {
		step = plan.Step
	}
	if superseded() {
		return // the spool may serve another job by now: its shape and timeline are not this one's
	}
	if err := r.withRoom(func() error {
		return r.spool.SetShapeRestored(cfg.JobName, inc.ID, cfg.Shape(), plan.Generation, step)
	}); err != nil { // a full budget removed it (a review)
		r.log.Error("record the job's shape and restore in the spool", "err", err)
	}
	select {
	case l := <-orphans:
		lines = append(lines, l...)
	case <-time.After(orphanWait):
		r.tasks.Add(1)
		go func() { // late: on their own
			defer r.tasks.Done()
			for _, l := range <-orphans {
				r.lines.incLine(inc, l)
			}
		}()
	}
	if r.incs.isCurrent(inc) {
		r.lines.errLines(cfg, lines)
	} else if len(lines) > 0 {
		r.log.Error("errors of an earlier incarnation", "incarnation", inc.ID, "messages", lines)
	}
	pre := "{}\n"
	if plan.Found {
		pre = fmt.Sprintf("{restore-step: %d}\n", plan.Step)
		if plan.Backup != "" {
			pre = fmt.Sprintf("{restore-step: %d, restore-backup: %s}\n", plan.Step, plan.Backup)
		}
	}
	if err := r.writeFile(layout.PrerestoreName, []byte(pre)); err != nil {
		failPlanned(fmt.Sprintf("write %s: %v", layout.PrerestoreName, err))
		return
	}
	r.log.Info("restore plan", "found", plan.Found, "step", plan.Step, "backup", plan.Backup, "pinned", plan.Pinned)

	// restored is the data each worker of this node restores: the plan's, or the job's own
	// commit of the step in this incarnation (restoreSlot).
	restored := map[int]string{}
	if plan.Found {
		for w := 0; w < cfg.WorkersPerNode; w++ {
			slot := Slot{cfg.NodeRank, w}
			hash, ok := plan.Data[slot]
			if !ok {
				failPlanned(fmt.Sprintf("restore plan for step %d has no data for %s", plan.Step, slot))
				return
			}
			var err error
			if restored[w], err = r.restoreSlot(ctx, inc, plan, w, hash); err != nil {
				msg := fmt.Sprintf("restore of step %d failed: %v", plan.Step, err)
				switch {
				case !errors.Is(err, syscall.ENOSPC) && !errors.Is(err, ErrNoSpace):
				case r.spool.KernelEnforced() || errors.Is(err, ErrNoSpace):
					total, used := r.spool.Usage()
					msg += fmt.Sprintf(" (the checkpoint does not fit in this node's RAM budget: --memory %s, %s in use; sparse files and hard links come back full size from peers and backups): restart the agent with a larger --memory",
						FormatSize(total), FormatSize(used))
				default: // the budget is counted by the agent: the file system under the spool is full
					msg += fmt.Sprintf(" (the file system of the spool %s is full, whatever --memory allows: a container's /dev/shm is 64 MiB by default; give the agent a --spool on a larger one)", r.spool.Dir())
				}
				failPlanned(msg)
				return
			}
		}
	}
	if err := r.waitNoticed(inc, "the restore", barrierHint, func() error { return r.coord.Restored(ctx, inc.Incarnation) }); err != nil {
		// Rank 0 is told too: one this node gave up on (not reached for 90 s: frozen, a stalled
		// VM) learns it when it answers again, and fails its own job at once rather than leave
		// it to wait out its 300 s at a barrier this node never reaches (a black-box run). One
		// that told this node of another's failure already knows: the call changes nothing.
		failPlanned(fmt.Sprintf("waiting for the other nodes to restore failed: %v", err))
		return
	}
	if superseded() {
		return
	}
	if plan.Found {
		inc.setRestoredSyncDue(true) // the incarnation's syncs wait for the restored step's
	}
	// The state is "running" before the job can see a marker, so status never lags behind it.
	// Where the sealer publishes: a commit of the restored step sealed during the wait for the
	// other nodes is what this node restores (restoreSlot), and one sealed after this is a
	// commit after the restore (a review: the marker named the older data, which was freed).
	r.retention.publish(func() error {
		for w := 0; plan.Found && w < cfg.WorkersPerNode; w++ {
			meta := layout.MarkerName{Job: cfg.JobName, Step: plan.Step, Node: cfg.NodeRank, Worker: w, Kind: layout.MarkerMeta}.String()
			if h, again := r.committedAgain(inc, meta, restored[w]); again {
				r.log.Warn("the job committed the step it restores again while the restore waited: this node restores that commit",
					"step", plan.Step, "worker", w, "planned", restored[w]+".data", "restored", h+".data")
				restored[w] = h
			}
		}
		var data []string
		for w := 0; plan.Found && w < cfg.WorkersPerNode; w++ {
			data = append(data, restored[w])
		}
		inc.restoreDone(plan.Step, plan.Found, data)
		return nil
	})
	committedAgain := false
	for w := 0; plan.Found && w < cfg.WorkersPerNode; w++ {
		committedAgain = committedAgain || restored[w] != plan.Data[Slot{cfg.NodeRank, w}]
	}
	if plan.Found {
		// The restored step is protected again without waiting for a new save (SPEC §10): it is
		// pushed to this node's peers (only the .meta to a peer that held the data at the
		// restore) and synced, so that "latest replicated on every node" covers it. Queued
		// before the markers appear, it is synced before any step the job saves next, and
		// before those it committed while the restore ran, whenever the syncer takes them.
		for w := 0; w < cfg.WorkersPerNode; w++ {
			hash := restored[w]
			var holders []int
			if hash == plan.Data[Slot{cfg.NodeRank, w}] {
				holders = plan.Holders[hash]
			}
			r.synced.push(sealedStep{
				commit:   commit{inc: inc, step: plan.Step, worker: w, at: r.now()},
				dataName: hash + ".data",
				meta:     layout.MarkerName{Job: cfg.JobName, Step: plan.Step, Node: cfg.NodeRank, Worker: w, Kind: layout.MarkerMeta}.String(),
				restored: true,
				holders:  holders,
			})
		}
	}
	switch {
	case committedAgain:
		// A newer commit of the step is backed up as any step saved again is.
	case plan.Found && plan.Backup != "":
		r.backups.restoredFrom(cfg.JobName, plan.Backup, plan.Step)
	case plan.Found && plan.BackedUpIn != "":
		r.backups.restoredFrom(cfg.JobName, plan.BackedUpIn, plan.Step)
	case plan.Found && plan.LastBackup != "" && plan.LastBackupStep < plan.Step:
		r.backups.restoredFrom(cfg.JobName, plan.LastBackup, plan.LastBackupStep)
	}
	if plan.Found {
		// A budget that holds the restored step but not a next save as large (an agent restarted
		// with a smaller --memory) failed the save with ENOSPC, the job told nothing (a
		// black-box run): the restored step stays until a newer one is complete. Before the
		// markers, so that a job reads it while it waits for them.
		r.retention.warnTightAfterRestore(r.lines, inc, plan.Step)
	}
	r.synced.push(sealedStep{commit: commit{inc: inc}, restoreDone: true}) // after the restored step's: its sync goes first
	for w := 0; w < cfg.WorkersPerNode; w++ {
		var err error
		if plan.Found {
			name := layout.MarkerName{Job: cfg.JobName, Step: plan.Step, Node: cfg.NodeRank, Worker: w, Kind: layout.MarkerRestore}.String()
			err = r.ns.Symlink(restored[w]+".data", name)
		} else {
			name := layout.MarkerName{Job: cfg.JobName, Step: 0, Node: cfg.NodeRank, Worker: w, Kind: layout.MarkerRestore}.String()
			err = r.writeFile(name, nil)
		}
		if err != nil {
			fail(fmt.Sprintf("create restore marker: %v", err))
			return
		}
	}
	r.log.Info("restore markers published", "step", plan.Step, "found", plan.Found)
	// Recorded after the markers: an agent killed in between tells a job that already took
	// its marker to restart (at its next save check), never leaves one waiting in silence.
	if err := r.withRoom(func() error { return r.spool.MarkRestored(inc.ID) }); err != nil && !errors.Is(err, errNoOwnerRecord) {
		r.log.Warn("record the restore in the spool's owner record", "err", err)
	}
}

// otherJobRecent is how recent another job's step freed at a job's start must be for the job to
// be told that the two jobs may share the mount.
const otherJobRecent = 10 * time.Minute

// freeOtherJobs frees what this node's RAM holds of other jobs (a mount path reused by another
// job): it is never restored for this one and must not take this job's budget (SPEC §10).
// It runs once every node negotiated the job, not at the handshake: one rank started with a
// mistyped job-name freed the real job's steps there before the coordinator refused it, and
// the job, its yaml fixed, restored an older step (found by a black-box run).
// A step being backed up is freed once its backup ends (freeAfterBackups): one freed while it
// uploaded was not in RAM, nor yet in the backup, when its job came back a moment later (its
// name mistyped once), which started from scratch (found by a black-box run).
func (r *restorer) freeOtherJobs(inc *incarnation) (line string) {
	cfg := inc.Config
	var later []jobStep
	var newest struct { // the newest of the other jobs' steps freed, by its .meta's time
		job  string
		step int64
		at   time.Time
	}
	names := r.retention.dropMetas(func(m layout.MarkerName, _ string) bool {
		if m.Job == cfg.JobName {
			return false
		}
		if k := (jobStep{m.Job, m.Step}); r.retention.backingUp[k] > 0 { // called with mu held
			if !slices.Contains(later, k) {
				later = append(later, k)
			}
			return false
		}
		if fi, err := os.Stat(r.retention.spoolDir("meta", m.String())); err == nil && fi.ModTime().After(newest.at) {
			newest.job, newest.step, newest.at = m.Job, m.Step, fi.ModTime()
		}
		return true
	})
	if len(names) == 0 && len(later) == 0 {
		return ""
	}
	var parts []string
	if len(names) > 0 {
		r.retention.retain(cfg) // frees the data no kept .meta names
		parts = append(parts, fmt.Sprintf("this node's RAM held checkpoints of other jobs (%s); they were freed: this mount now serves job %s", strings.Join(names, ", "), cfg.JobName))
		if ago := time.Since(newest.at); !newest.at.IsZero() && ago < otherJobRecent {
			// Two jobs on one mount (two trainer pods of different jobs on one Kubernetes node
			// agent) share one directory: the other job's next save is taken as this job's, and
			// this job's restart restores it (a black-box run). Nothing in the files tells the
			// two apart; this is the moment the agent can see it.
			msg := fmt.Sprintf("job %s's step %d came into this node's RAM %s ago (saved here, received from a peer, or restored): if that job still runs on this node, both jobs use this one directory, and each would restore the other's saves; a mount serves one job at a time (give each job its own agent and directory, deploy/README.md)",
				newest.job, newest.step, ago.Round(time.Second))
			parts = append(parts, msg)
			r.log.Warn("another job saved in this mount a moment ago: two jobs may share it", "other_job", newest.job, "step", newest.step, "ago", ago.Round(time.Second).String(), "job", cfg.JobName)
		}
		parts = append(parts, r.unbackedLines(r.recordFreed(cfg.JobName, names))...)
		r.log.Warn("freed checkpoints of other jobs", "metas", names, "job", cfg.JobName)
	}
	if len(later) > 0 {
		slices.SortFunc(later, func(a, b jobStep) int { return cmp.Or(strings.Compare(a.job, b.job), cmp.Compare(a.step, b.step)) })
		var what []string
		for _, k := range later {
			what = append(what, fmt.Sprintf("step %d of job %s", k.step, k.job))
		}
		parts = append(parts, fmt.Sprintf("this node's RAM holds %s, being backed up: freed once the backup ends (this mount now serves job %s)", strings.Join(what, ", "), cfg.JobName))
		r.log.Info("checkpoints of other jobs being backed up are freed once their backups end", "steps", what, "job", cfg.JobName)
		r.tasks.Go(func() { r.freeAfterBackups(later) })
	}
	return strings.Join(parts, "; ")
}

// recordFreed records in the spool's owner record the steps of other jobs that the .meta files
// names held, freed for job (the job, back under its name, is told), and returns them by job.
func (r *restorer) recordFreed(job string, names []string) (byJob map[string][]int64) {
	byJob = map[string][]int64{}
	for _, name := range names {
		if m, ok := layout.ParseMarkerName(name); ok && !slices.Contains(byJob[m.Job], m.Step) {
			byJob[m.Job] = append(byJob[m.Job], m.Step)
		}
	}
	for other, steps := range byJob {
		slices.Sort(steps)
		if err := r.spool.RecordFreed(other, steps, job); err != nil && !errors.Is(err, errNoOwnerRecord) {
			r.log.Warn("record the freed steps in the spool's owner record", "job", other, "err", err)
		}
	}
	return byJob
}

// unbackedLines says, for the job that freed them, which of the freed steps (by job) this node
// saw in no complete backup: the line said "freed" alike whether or not a backup held them (a
// black-box run).
func (r *restorer) unbackedLines(byJob map[string][]int64) (lines []string) {
	for _, other := range slices.Sorted(maps.Keys(byJob)) {
		_, _, backedUp := r.backups.status(other)
		if unbacked := slices.DeleteFunc(slices.Clone(byJob[other]), func(st int64) bool { return st <= backedUp }); len(unbacked) > 0 {
			lines = append(lines, fmt.Sprintf("step(s) %s of job %s were in no backup this node completed (mtcfs backups list --job %s shows whether one holds them): unless another node or a backup holds them, they are lost", JoinSteps(unbacked), other, other))
		}
	}
	return lines
}

// freeAfterBackups frees the steps of other jobs that freeOtherJobs kept while they were backed
// up, once no backup holds them, unless the mount serves their job again by then.
func (r *restorer) freeAfterBackups(steps []jobStep) {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for slices.ContainsFunc(steps, func(k jobStep) bool { return r.retention.isBackingUp(k.job, k.step) }) {
		select {
		case <-r.ctx.Done():
			return
		case <-tick.C:
		}
	}
	_, last := r.incs.both()
	if last == nil {
		return
	}
	cfg := last.Config
	names := r.retention.dropMetas(func(m layout.MarkerName, _ string) bool {
		return m.Job != cfg.JobName && slices.Contains(steps, jobStep{m.Job, m.Step})
	})
	if len(names) == 0 {
		return // their job is back, or they went another way
	}
	r.retention.retain(cfg)
	// No unbackedLines: these were backed up, or tried, and the runner remembers one job's last
	// backup only (a review: a false "lost" when the new job's backup ended meanwhile).
	r.recordFreed(cfg.JobName, names)
	r.log.Info("freed checkpoints of other jobs once their backups ended", "metas", names, "job", cfg.JobName)
}

// JoinSteps writes steps (or ranks) as "2, 3, 5".
func JoinSteps[T ~int | ~int64](steps []T) string {
	s := make([]string, len(steps))
	for i, st := range steps {
		s[i] = strconv.FormatInt(int64(st), 10)
	}
	return strings.Join(s, ", ")
}

// dropStaleTimeline forgets this job's steps above the one plan.StaleAbove gives this node: its
// agent missed restores of the job, and they are of a timeline the job left (CutStaleTimelines).
func (r *restorer) dropStaleTimeline(inc *incarnation, plan RestorePlan) {
	cfg := inc.Config
	bound, ok := plan.StaleAbove[cfg.NodeRank]
	if !ok {
		return
	}
	r.recorder.dropKept(cfg.JobName, inc.ID, func(step int64) bool { return step > bound })
	drop := r.retention.dropMetas(func(m layout.MarkerName, _ string) bool {
		return m.Job == cfg.JobName && m.Step > bound && !inc.isSealedHere(m.String())
	})
	if len(drop) == 0 {
		return
	}
	r.log.Warn("dropped the steps of a timeline the job left while this node's agent was away", "above", bound, "metas", drop)
	r.retention.retain(cfg) // frees their data
}

// dropAbandonedSteps forgets this job's steps newer than the one the job restores (all of them on
// a fresh start): the job continues from the restored step and will save those step numbers
// again, and a .meta of the old timeline must never combine with ones of the new into a step
// that looks complete but mixes two saves. Every node drops them (all restore the same plan),
// its own .meta files and the replicas it holds. Steps the job committed in this incarnation
// (it went on saving while the restore waited) are no other timeline: they stay, and the line
// it returns for the job says so.
func (r *restorer) dropAbandonedSteps(inc *incarnation, plan RestorePlan) string {
	cfg := inc.Config
	if steps := r.recorder.dropKept(cfg.JobName, inc.ID, func(step int64) bool { return !plan.Found || step > plan.Step }); len(steps) > 0 {
		r.log.Warn("dropped the commit records kept for the agent's next start: the job continues from an older step", "restored", plan.Step, "found", plan.Found, "steps", steps)
	}
	var kept []int64
	drop := r.retention.dropMetas(func(m layout.MarkerName, _ string) bool {
		above := m.Job == cfg.JobName && (!plan.Found || m.Step > plan.Step)
		if above && inc.isSealedHere(m.String()) {
			if !slices.Contains(kept, m.Step) {
				kept = append(kept, m.Step)
			}
			return false
		}
		return above
	})
	line := ""
	if len(kept) > 0 {
		slices.Sort(kept)
		restored := "nothing"
		if plan.Found {
			restored = fmt.Sprintf("step %d", plan.Step)
		}
		line = fmt.Sprintf("step(s) %s were committed before this restore ended (the job saved without waiting for its .restore markers): the restore takes %s, and they are kept, not dropped", JoinSteps(kept), restored)
		r.log.Warn("kept steps the job committed while its restore waited", "restored", plan.Step, "found", plan.Found, "steps", kept)
	}
	if len(drop) == 0 {
		return line
	}
	r.log.Info("dropped the steps of an abandoned timeline: the job continues from the restored step", "restored", plan.Step, "found", plan.Found, "metas", drop)
	r.retention.retain(cfg) // frees their data
	// Status and the stop's warning named a dropped step as the newest, "in RAM only, not in a
	// backup yet", where the newest was the restored one, backed up (a black-box run).
	newest := int64(-1)
	if plan.Found {
		newest = plan.Step
	}
	if len(kept) > 0 {
		newest = max(newest, kept[len(kept)-1])
	}
	r.sealer.dropAbove(cfg.JobName, newest)
	return line
}

// dropOtherShapeSteps forgets the steps of the job this node holds when the spool's recorded
// shape is one this job's shape cannot restore, or there is none: recording the job's shape
// next would vouch for them.
//   - Another shape: no .meta of this node's can be the plan's (the plan passed over every step
//     this node holds), so only the .meta entries of the plan's step that name the plan's data
//     for their slot stay (this node's own, and replicas of other nodes' it holds).
//   - No record (a spool of an agent before records, or one whose record could not be
//     written): when the plan restores a step from RAM, this node's .meta entries of that step
//     stay, replicas included (another node may fetch its data from here: the plan tells each
//     node its own part only); the steps below it go. Otherwise as for another shape.
//
// Steps below the one restored are no loss; those above are dropped anyway
// (dropAbandonedSteps).
func (r *restorer) dropOtherShapeSteps(inc *incarnation, plan RestorePlan) {
	cfg := inc.Config
	saved := r.spool.SavedShape()
	if saved.Nodes > 0 && cfg.Shape().Restores(saved, true) {
		return
	}
	if steps := r.recorder.dropKept(cfg.JobName, inc.ID, func(int64) bool { return true }); len(steps) > 0 {
		r.log.Warn("dropped the commit records kept for the agent's next start: the job's shape changed", "steps", steps)
	}
	fromRAM := saved.Nodes == 0 && plan.Found && plan.Backup == ""
	drop := r.retention.dropMetas(func(m layout.MarkerName, hash string) bool {
		switch {
		case m.Job != cfg.JobName || inc.isSealedHere(m.String()): // of this shape: the job's own commit
			return false
		case fromRAM:
			return m.Step != plan.Step || m.Node >= cfg.Nodes || m.Worker >= cfg.WorkersPerNode
		default:
			return !(plan.Found && m.Step == plan.Step && plan.Data[Slot{m.Node, m.Worker}] == hash)
		}
	})
	if len(drop) == 0 {
		return
	}
	recorded := "none"
	if saved.Nodes > 0 {
		recorded = saved.String()
	}
	r.log.Info("dropped steps of another or an unrecorded shape", "recorded", recorded, "shape", cfg.Shape().String(), "metas", drop)
	r.retention.retain(cfg) // frees their data
}

// restoreSlot brings in worker w's data and publishes its .meta. The data is held (retention
// skips it) from before the first look at the spool until its .meta names it, and every look
// at the spool happens under publishMu, so a retention already running finishes first.
// restoreSlot restores worker w's data of the plan's step, hash, and returns the hash restored:
// hash, or the data of the job's own commit of this step in this incarnation, sealed here while
// the restore waited. That commit is the step now (a newer commit replaces the step, README):
// the plan's older data written over its .meta had it freed, and the job's next restart restored
// the older bytes on this node beside the newer ones on the others, without a word (found by a
// black-box run).
func (r *restorer) restoreSlot(ctx context.Context, inc *incarnation, plan RestorePlan, w int, hash string) (string, error) {
	for {
		err := r.restoreSlotData(ctx, inc, plan, w, hash)
		var again *savedAgainError
		if !errors.As(err, &again) {
			return hash, err
		}
		// Again, each time the job committed the step anew meanwhile (a review: a second
		// commit during the retry failed the restore).
		r.log.Warn("the job committed the step it restores again while the restore waited: this node restores that commit",
			"step", plan.Step, "worker", w, "planned", hash+".data", "restored", again.hash+".data")
		hash = again.hash
	}
}

// committedAgain returns the data meta names now, when the job committed that slot's step in
// this incarnation as other data than hash (sealed here while the restore ran).
func (r *restorer) committedAgain(inc *incarnation, meta, hash string) (string, bool) {
	h, ok := r.retention.metaHash(meta)
	return h, ok && h != hash && inc.isSealedHere(meta)
}

// savedAgainError: the job committed the slot's step in this incarnation, sealed as hash.
type savedAgainError struct{ hash string }

func (e *savedAgainError) Error() string { return "the step was committed again, as " + e.hash }

func (r *restorer) restoreSlotData(ctx context.Context, inc *incarnation, plan RestorePlan, w int, hash string) error {
	cfg := inc.Config
	slotStart := r.now()
	dataName := hash + ".data"
	defer r.retention.hold(dataName)()
	meta := layout.MarkerName{Job: cfg.JobName, Step: plan.Step, Node: cfg.NodeRank, Worker: w, Kind: layout.MarkerMeta}.String()
	sealed := r.spoolDir("sealed", dataName)
	savedAgain := func() error {
		if h, again := r.committedAgain(inc, meta, hash); again {
			return &savedAgainError{hash: h}
		}
		return nil
	}
	if err := savedAgain(); err != nil {
		return err
	}
	publish := func(incoming string) error {
		return r.retention.publish(func() error {
			// Checked where the sealer writes its .meta: one sealed meanwhile is not written over.
			if err := savedAgain(); err != nil {
				return err
			}
			return r.publishSlot(incoming, dataName, meta, inc, plan.Step)
		})
	}
	// First this node's own RAM. Data this agent sealed or verified is immutable to the job and
	// trusted; anything else is hashed first, and a copy that fails is reported and replaced
	// from the next source, never used and never silently dropped.
	if _, err := os.Lstat(sealed); err == nil && !r.retention.isVerified(dataName) {
		if err := r.verifyInRAM(ctx, inc, plan.Step, dataName); err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			r.metrics.error(errKindVerify)
			r.lines.errLine(cfg, fmt.Sprintf("step %d: the copy of %s in this node's RAM fails its check (%v); restoring it from a peer or a backup instead", plan.Step, dataName, err))
			r.retention.dropData(dataName)
		}
	}
	err := publish("")
	if !errors.Is(err, errNotInRAM) {
		if err == nil {
			r.metrics.restored("ram", r.now().Sub(slotStart).Seconds())
		}
		return err
	}
	// Then from a peer that holds it, in RAM. A fetch cut short quickly, or later by the link (a
	// connection reset), is tried again: one reset failed the whole job's restore, which the
	// next start made in seconds from the same peer (found by black-box runs: also a reset 14 s
	// into a fetch, on a link that was fine a second later).
	var noSpace, fetchErr error // the last fetch that failed (for lack of room here): what the job is told
	failedFrom := -1
	backup, backupLooked := plan.Backup, false // where the data is, past the peers (looked up once)
	findBackup := func() string {
		if !backupLooked && backup == "" && r.store != nil {
			backup = r.findBackupOf(ctx, cfg, plan.Step, Slot{cfg.NodeRank, w}, hash)
		}
		backupLooked = true
		return backup
	}
	holders := plan.Holders[hash]
	for i, holder := range holders {
		if holder == cfg.NodeRank || r.peers == nil {
			continue
		}
		first := time.Now()
		for try := 1; ; try++ {
			wall := time.Now()
			moved, err := r.fetchFrom(ctx, inc, plan.Step, holder, dataName, publish)
			if try > peerFetchTries {
				inc.setWaiting("") // the wait for a holder that did not answer is over
			}
			if err == nil || errors.As(err, new(*savedAgainError)) {
				return err
			}
			r.log.Warn("fetch from a peer failed", "data", dataName, "peer", holder, "try", try, "moved", moved, "err", err)
			fetchErr, failedFrom = err, holder
			if errors.Is(err, syscall.ENOSPC) || errors.Is(err, ErrNoSpace) {
				noSpace = err
				break
			}
			within := peerFetchRetryWithin
			if d := r.fetchRetryWithin.Load(); d > 0 {
				within = time.Duration(d)
			}
			if (time.Since(wall) > within && !NoAnswer(err)) || ctx.Err() != nil {
				break
			}
			wait := peerFetchRetryAfter
			if try >= peerFetchTries {
				// A holder that does not answer (stopped, a frozen VM) while it is the last one
				// and no backup holds the data is waited for, up to peerFetchNoAnswerFor: three
				// tries in 36 s failed a job's restore (all its ranks) for a peer paused 47 s,
				// whose data was whole (black-box h61).
				if !NoAnswer(err) || i < len(holders)-1 || time.Since(first) > peerFetchNoAnswerFor || findBackup() != "" {
					break
				}
				wait = min(peerFetchRetryAfter<<(try-peerFetchTries+1), 15*time.Second)
				r.log.Warn("the peer holding the data does not answer, and no backup holds it: trying it again", "data", dataName, "peer", holder, "in", wait.String(),
					"until", peerFetchNoAnswerFor.String()+" after the first try")
				// Said in status and, once, to the job: between the tries status showed
				// nothing, and the job heard nothing until the give-up (black-box h63).
				what := fmt.Sprintf("restoring step %d: rank %d, the only node holding this node's data (no backup holds it), does not answer (stopped? a frozen VM?); tried again until %s after the first try, %v so far",
					plan.Step, holder, peerFetchNoAnswerFor, time.Since(first).Round(time.Second))
				inc.setWaiting(what)
				if inc.transferTold.CompareAndSwap(false, true) {
					r.lines.errLine(cfg, what)
				}
			}
			select {
			case <-ctx.Done():
			case <-time.After(wait):
			}
		}
	}
	// Last, a backup: the plan's, or (when the plan found the step in RAM) the newest backup
	// holding exactly this data for this slot.
	backup = findBackup()
	if backup == "" || r.store == nil {
		if noSpace != nil {
			// A peer holds it, and it did not fit here (found by a black-box run: the job was
			// told the data was nowhere).
			return fmt.Errorf("%s: a peer holds it, but the fetch failed: %w; and no complete backup holds it", dataName, noSpace)
		}
		if fetchErr != nil {
			// So did one that failed otherwise (a black-box run: a reset link was told as data
			// that was nowhere).
			return fmt.Errorf("%s: rank %d holds it, but the fetch failed: %w; and no complete backup holds it (a restart of the job tries again)", dataName, failedFrom, fetchErr)
		}
		return fmt.Errorf("%s is not in this node's RAM nor a peer's, and no complete backup holds it", dataName)
	}
	incoming, err := r.download(ctx, inc, plan.Step, backup, hash)
	if incoming != "" {
		defer os.RemoveAll(filepath.Dir(incoming))
	}
	if err != nil {
		return err
	}
	return publish(incoming)
}

// Peer fetches that fail within peerFetchRetryWithin, or later for want of an answer (a reset
// connection: NoAnswer), are tried peerFetchTries times in all, peerFetchRetryAfter apart. A
// later failure of another kind is not tried again, and the backup is tried next: a stall (a
// peer that stopped moving data, for the stall timeout), data that fails its check (the
// holder's copy is bad: each try would move all of it again), or a failure here.
//
// NoAnswer reports whether err says a peer's agent did not answer (its transport failed), as the
// peer transport marks such errors (a NoAnswer() bool method).
func NoAnswer(err error) bool {
	var e interface{ NoAnswer() bool }
	return errors.As(err, &e) && e.NoAnswer()
}

const (
	peerFetchTries       = 3
	peerFetchRetryWithin = 10 * time.Second
	peerFetchRetryAfter  = time.Second
	// peerFetchNoAnswerFor bounds how long after its first try a holder that does not answer is
	// tried again when it is the last holder and no backup holds the data (the job waits 300 s
	// for its markers).
	peerFetchNoAnswerFor = 2 * time.Minute
)

// fetchFrom fetches dataName from holder's RAM and publishes it. It returns the bytes that
// arrived, also when it fails.
func (r *restorer) fetchFrom(ctx context.Context, inc *incarnation, step int64, holder int, dataName string, publish func(string) error) (int64, error) {
	dir := r.spoolDir("incoming", randomID())
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return 0, err
	}
	defer os.RemoveAll(dir)
	start := r.now()
	p := &Progress{Kind: "restore", Step: step, Source: fmt.Sprintf("peer %d", holder), Started: start}
	inc.setRestoreProgress(p)
	err := r.noticedTransfer(inc, p, func() error { return r.peers.Fetch(ctx, inc.Incarnation, holder, dataName, dir, p.update) })
	inc.setRestoreProgress(nil)
	if err == nil {
		err = publish(filepath.Join(dir, dataName))
	}
	if err != nil {
		return p.Done(), err
	}
	took := r.now().Sub(start)
	r.log.Info("restored from a peer", "data", dataName, "peer", holder, "took", took.String())
	r.metrics.restored("peer", took.Seconds())
	r.metrics.moved("peer", "in", p.Done())
	return p.Done(), nil
}

// publishSlot publishes a slot's data and its .meta, inside retention.publish: the data that
// arrived at incoming ("": none, the spool must hold it) moves into spool/sealed, gets its name
// in the namespace (given to user, the job's, when it is known and the data was saved by
// another), and its .meta is written.
func (r *restorer) publishSlot(incoming, dataName, meta string, inc *incarnation, step int64) error {
	user := inc.user
	sealed := r.spoolDir("sealed", dataName)
	if incoming != "" {
		// Or, if another slot brought the same data meanwhile, drop what came in.
		if _, err := moveData(incoming, sealed); err != nil {
			return err
		}
		r.retention.markVerified(dataName) // checked on arrival
	} else if _, err := os.Lstat(sealed); err != nil {
		return errNotInRAM
	}
	if !r.hasName(dataName) {
		if err := r.ns.Import(sealed, dataName); err != nil {
			return err
		}
	}
	if top, _, err := r.ns.Owner(dataName); err == nil && user >= 0 && int64(top) != user {
		// Not the job's user's yet (the usual restore, by the user who saved it, reads nothing).
		saved, _ := layout.ReadAttrs(sealed) // nil: the owners the namespace holds
		n, err := r.ns.Reown(dataName, saved, uint32(user))
		if err != nil {
			return err
		}
		if n > 0 {
			r.log.Info("restored data given to the job's user", "data", dataName, "uid", user, "entries", n)
		}
	} else if err == nil && inc.stranger >= 0 && int64(top) != inc.stranger {
		r.log.Warn("restored data not given to the job's user: that user does not own the mount root", "data", dataName, "owner", top, "job_uid", inc.stranger)
		r.lines.incLine(inc, fmt.Sprintf("step %d is restored as it was saved, by uid %d: the job's user, uid %d (the owner of its replicator.yaml), does not own the mount root, so the checkpoint is not given to it, and what uid %d kept private stays so (EACCES); to give a job's checkpoints to the user it now runs as, give that user the mount root (mtcfs mount --uid)",
			step, top, inc.stranger, top))
	}
	return r.retention.writeMeta(meta, strings.TrimSuffix(dataName, ".data"))
}

// verifyInRAM hashes data held in this node's spool before a restore uses it, showing the
// progress as a restore from "RAM (verifying)".
func (r *restorer) verifyInRAM(ctx context.Context, inc *incarnation, step int64, dataName string) error {
	p := &Progress{Kind: "restore", Step: step, Source: "RAM (verifying)", Started: r.now()}
	inc.setRestoreProgress(p)
	defer inc.setRestoreProgress(nil)
	h, dir, _ := layout.ParseDataName(dataName)
	if err := layout.VerifyData(ctx, r.spoolDir("sealed", dataName), h, dir); err != nil {
		return err
	}
	r.retention.markVerified(dataName)
	return nil
}

// findBackupOf returns the newest backup of the job with a complete step holding hash for slot
// ("" if none, or the store cannot say).
func (r *restorer) findBackupOf(ctx context.Context, cfg *Config, step int64, slot Slot, hash string) string {
	names, err := r.store.Backups(ctx, cfg.JobName)
	if err != nil {
		r.log.Warn("list backups", "err", err)
		return ""
	}
	for _, name := range names {
		steps, _, err := r.store.CompleteSteps(ctx, cfg.JobName, name, cfg.Shape())
		if err != nil {
			continue
		}
		for _, s := range steps {
			if s.Step == step && s.Data[slot] == hash {
				return name
			}
		}
	}
	return ""
}

// orphanWait bounds how long a restore waits for orphanedStepLines before its prerestore.
const orphanWait = 500 * time.Millisecond

// orphanedStepLines are the lines that tell the job about steps of its own that a kept spool holds where no agent
// serves it, its mount directory gone, when they are newer than what plan restores: the job's
// mount directory was moved or renamed while no agent ran, and this agent started with a new,
// empty spool, restoring an older step or nothing without a word; the orphan is freed once
// unused for ReapGrace (found by a black-box run). Only this user's spools count.
func (r *restorer) orphanedStepLines(inc *incarnation, plan RestorePlan) (lines []string) {
	if r.keptSpools == nil {
		return nil
	}
	cfg := inc.Config
	spools, err := r.keptSpools()
	if err != nil {
		r.log.Warn("cannot look for kept spools of this job", "err", err)
		return nil
	}
	mountPath := r.spool.Owner().MountPath
	for _, s := range spools {
		here := mountPath != "" && s.MountPath == mountPath // a spool of this mount, not in use
		if s.Dir == r.spool.Dir() || s.InUse || !(s.Orphaned() || here) || s.UID != os.Geteuid() {
			continue
		}
		var steps []int64 // of this job and rank (its .meta names say), newer than the plan's
		for _, name := range s.Metas {
			if m, ok := layout.ParseMarkerName(name); ok && m.Job == cfg.JobName && m.Node == cfg.NodeRank && (!plan.Found || m.Step > plan.Step) && !slices.Contains(steps, m.Step) {
				steps = append(steps, m.Step)
			}
		}
		if len(steps) == 0 {
			continue
		}
		slices.Sort(steps)
		if here {
			what := fmt.Sprintf("spool %s holds step(s) %s of this job, newer than what this restore finds: it records this mount directory, but this agent runs with the spool %s (another --spool than the agent before?)", s.Dir, JoinSteps(steps), r.spool.Dir())
			if cfg.Nodes > 1 {
				lines = append(lines, what+". It is this node's part only: the other nodes drop theirs of steps newer than this restore")
				continue
			}
			lines = append(lines, fmt.Sprintf("%s. To restore from it, stop this agent and start it again with --spool %s; mtcfs spool free %s frees it", what, s.Dir, s.Dir))
			continue
		}
		due := lastUsed(s).Add(ReapGrace).UTC().Format(time.RFC3339)
		what := fmt.Sprintf("spool %s holds step(s) %s of this job, newer than what this restore finds, but no agent serves it: its mount directory %s is gone (moved or renamed while no agent ran?)", s.Dir, JoinSteps(steps), s.MountPath)
		if cfg.Nodes > 1 {
			// The other nodes drop their parts of steps newer than this restore's now: this
			// node's part alone restores nothing (a review).
			lines = append(lines, fmt.Sprintf("%s. It is this node's part only: the other nodes drop theirs of steps newer than this restore; an agent starting after %s frees it", what, due))
			continue
		}
		lines = append(lines, fmt.Sprintf("%s. To restore from it, stop this agent and start it again with --spool %s, or move the directory back to %s and start the agent there; an agent starting after %s frees it",
			what, s.Dir, s.MountPath, due))
	}
	return lines
}

var errNotInRAM = errors.New("not in RAM")

// fetchBackup downloads hash's data from backup into incoming and checks it against its hash;
// data that does not match is an error wrapping ErrCorruptBackup.
func (r *restorer) fetchBackup(ctx context.Context, cfg *Config, backup, hash, incoming string, p *Progress) error {
	dataName := hash + ".data"
	if err := r.store.Download(ctx, cfg.JobName, backup, hash, incoming, p.update); err != nil {
		return fmt.Errorf("download %s from backup %s: %w", dataName, backup, err)
	}
	h, dir, _ := layout.ParseDataName(dataName)
	err := layout.VerifyData(ctx, incoming, h, dir)
	if mm := (*layout.HashMismatchError)(nil); errors.As(err, &mm) {
		return fmt.Errorf("%w: %s from backup %s: %w", ErrCorruptBackup, dataName, backup, err)
	}
	return err
}

// download fetches hash's data from a backup into a new directory under spool/incoming and
// verifies it against its hash; progress shows in mtcfs status. Data that fails its check is
// downloaded once more (a fault on the way, not in the backup, passes then); failing again,
// it is marked damaged in the backup, so that the job's next start passes over it (with a
// line in replicator.errors) instead of failing on it again; a location that refuses the mark
// leaves the agent's memory of it (RememberDamage).
func (r *restorer) download(ctx context.Context, inc *incarnation, step int64, backup, hash string) (string, error) {
	cfg := inc.Config
	dataName := hash + ".data"
	p := &Progress{Kind: "restore", Step: step, Source: "backup " + backup, Started: r.now()}
	inc.setRestoreProgress(p)
	defer inc.setRestoreProgress(nil)
	var incoming string
	var err error
	for attempt := 1; attempt <= 2; attempt++ {
		if incoming != "" {
			os.RemoveAll(filepath.Dir(incoming))
		}
		incoming = r.spoolDir("incoming", randomID(), dataName)
		if err := os.MkdirAll(filepath.Dir(incoming), 0o700); err != nil {
			return "", err
		}
		r.log.Info("downloading from backup", "backup", backup, "data", dataName, "attempt", attempt)
		err = r.noticedTransfer(inc, p, func() error { return r.fetchBackup(ctx, cfg, backup, hash, incoming, p) })
		if !errors.Is(err, ErrCorruptBackup) || ctx.Err() != nil {
			break
		}
		r.log.Warn("data downloaded from a backup failed its check", "backup", backup, "data", dataName, "attempt", attempt, "err", err)
	}
	if errors.Is(err, ErrCorruptBackup) && ctx.Err() == nil {
		why := fmt.Sprintf("rank %d, %s: %v", cfg.NodeRank, r.now().UTC().Format(time.RFC3339), err)
		if merr := r.store.MarkDamaged(ctx, cfg.JobName, backup, hash, why); merr != nil {
			r.log.Error("could not mark the backup's data damaged: this agent remembers it, and passes over it at the job's next start while the agent runs", "backup", backup, "data", dataName, "err", merr)
			err = fmt.Errorf("%w; it failed twice, and the backup location refused the record of its damage (%v): this node's agent passes over it at the job's next start until the agent restarts (make the location writable so that every agent does)", err, merr)
		} else {
			r.log.Warn("marked the backup's data damaged", "backup", backup, "data", dataName)
			err = fmt.Errorf("%w; it failed twice, and is now marked damaged in the backup (%s.data.damaged): the job's next start passes over it", err, hash)
		}
	}
	if err != nil {
		return incoming, err
	}
	r.log.Info("restored from backup", "data", dataName, "bytes", p.Done())
	if _, err := os.Lstat(layout.AttrsFile(incoming)); errors.Is(err, os.ErrNotExist) {
		// The backup's <hash>.data.attrs object is gone, too large or unreadable (or the data was
		// backed up by an agent that kept none): nothing else would tell.
		r.log.Warn("the backup keeps no owners and modes for this data: its entries get the agent's (root, files 0644, directories 0755), or the job's user if it runs as another", "backup", backup, "data", dataName, "object", dataName+".attrs")
	}
	r.metrics.restored("backup", r.now().Sub(p.Started).Seconds())
	r.metrics.moved("backup", "in", p.Done())
	return incoming, nil
}
