package replication

// Backup orders (SPEC §6, §10). The coordinator decides backups on its own clock, not only when
// a step is synced: the newest step every node synced that is not in a complete backup yet is
// ordered at most one interval after the clock started (the first sync, then each order), so a
// job that saves once still gets its backup. Nodes learn orders through Backups, a call each
// node keeps waiting, and report the outcome in their next call. A node that failed re-runs the
// same order (same name: its uploads are create-if-absent, so it completes what it started)
// after a backoff, unless a newer step is waiting by then, which gets a new order (in the next
// UTC minute when the failed order's minute is the current one: backup names are unique per
// minute; the failed step is not given again meanwhile). An order is
// complete when every node reported its part done; only then does the next one start, so at
// most one backup of the job runs at a time.
//
// Data-parallel mode (SPEC §6): only the last partition, ranks ≥ nodes − P, uploads data. The
// other ranks get the order once their column's last-partition rank reported its part done,
// with the data hashes it reported, and upload only their .meta files naming that data: every
// .meta in the backup names a .data beside it, and the column's data travels once. A rank whose
// column-mate reported no hashes (an agent of an earlier version) uploads its own data.

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/tiers"
)

// backupRetryMax caps the wait before a failed order is given again.
const backupRetryMax = time.Minute

// backupState is the backup part of a JobCoordinator; every field is GUARDED_BY its mu.
type backupState struct {
	every time.Duration // backup-interval-minutes, 0: none
	steps int           // backup-interval-steps, 0: none

	latest   int64 // the highest step every rank synced, -1: none
	backedUp int64 // the highest step known to be in a complete backup, -1: none
	// clockFrom starts the interval clock: the first sync, then each order. The zero time
	// makes the next backup due at once (a restored step that no backup holds yet).
	clockFrom time.Time
	started   bool // the clock runs
	synced    int  // syncs since the last order

	// resume names the newest backup when it is an upload of the restored step cut short (a
	// crash, a stop past the drain time; resumeStep): the step's first order completes it under
	// its name rather than leaving it incomplete beside a new one (SPEC §10). "": none.
	// resumePending holds that order until the store said whether it is (resumeDecided).
	resume        string
	resumeStep    int64
	resumePending bool

	order     *backupOrder  // the backup being taken, nil when none
	changed   chan struct{} // closed and replaced whenever order changes: wakes waiting calls
	stopTimer func() bool

	// lastName is the backup this incarnation completed last (of step backedUp; "": none), and
	// auditAt when the store is next asked whether it still holds that step (auditing: asking
	// now). Nothing else was due then. A backup that vanished from the location (deleted, a
	// bucket emptied, the disk of a file:// location unmounted) was never noticed: status said
	// backed up, no step was backed up again, and a restore after RAM loss went back (found by
	// black-box runs).
	lastName string
	auditAt  time.Time
	auditing bool

	// asked records the ranks that called Backups in this incarnation; tell is a line for rank
	// 0's job (BackupOrder.Tell), told once (told).
	asked        []bool
	tell         string
	told         bool
	stopAskCheck func() bool // stops the timer of checkAskers
}

// backupAskGrace is how long after an order every rank must have asked for backup orders once:
// one that has not takes no part in the job's backups (an agent of an earlier version did not,
// found by a black-box run: every backup stayed incomplete, and no job was told).
const backupAskGrace = 5 * time.Minute

// backupAuditMin bounds how often the newest backup is checked (every backup interval, and
// every backupAuditSteps in backup-interval-steps mode).
const (
	backupAuditMin   = time.Minute
	backupAuditSteps = 10 * time.Minute
)

// backupOrder is one backup of the job: every node uploads its part of step to name.
type backupOrder struct {
	name     string
	step     int64
	done     []bool // by rank
	ndone    int
	hashes   [][]string // by rank: the data its .meta files name, as reported with done (nil: not said)
	retryAt  time.Time  // non-zero: a node failed; the order is given again then
	attempts int
	// superseded names the earlier orders this one replaced when a node failed them (see
	// dropSuperseded).
	superseded []string
	// stale: the step was saved again while this order ran; its backup may hold the earlier
	// save, so it does not count as the step's backup.
	stale bool
}

func (b *backupState) init(every time.Duration, steps int) {
	b.every, b.steps = every, steps
	b.latest, b.backedUp = -1, -1
	b.changed = make(chan struct{})
}

// wake tells every waiting Backups call that the order changed. Called with mu held.
func (b *backupState) wake() {
	close(b.changed)
	b.changed = make(chan struct{})
}

// backupsAfterPlan sets up the schedule once the plan is known: the highest step already in a
// complete backup, and whether the restored step still needs one (then it is due as soon as it
// is synced). With unfinished (the newest backup has no complete step) it returns true when the
// caller must find out whether that backup is an upload of the restored step cut short and tell
// resumeDecided; the step's first order waits for that. Called with mu held.
//
// The backup that holds the step counted as backed up (plan.Backup, or newestName when it holds
// the restored step) is audited from then on, as one this incarnation completed: before, a
// backup of an earlier incarnation was never checked until the job saved a newer step (a
// review), and a restart after RAM loss is what that check is for.
func (c *JobCoordinator) backupsAfterPlan(plan tiers.RestorePlan, newest tiers.BackupStep, newestName string, unfinished bool) (resume bool) {
	b := &c.backups
	// The job's history goes on from the restored step. A backup of a later step holds
	// another history: the one a pinned restore of an older backup went back from, or that a
	// fresh start leaves. Counted as backed up, the job's next saves of those step numbers
	// were never backed up, and a restore after RAM loss brought back the abandoned step, in
	// silence (found by a black-box run).
	// A step restored from RAM counts as backed up only if the newest backup holds that very
	// step: the same number and data (a review: the same number re-saved after going back is
	// another step).
	switch {
	case !plan.Found:
		b.backedUp = -1
	case plan.Backup != "":
		b.backedUp, b.lastName = plan.Step, plan.Backup
	case newest.Step == plan.Step && maps.Equal(newest.Data, plan.Data):
		b.backedUp, b.lastName = plan.Step, newestName
	default:
		b.backedUp = min(newest.Step, plan.Step-1)
	}
	if b.lastName != "" {
		b.auditAt = c.clock.Now().Add(c.auditEvery())
	}
	if plan.Found && plan.Step > b.backedUp {
		b.started, b.clockFrom, b.synced = true, time.Time{}, b.steps
		if unfinished && plan.Backup == "" {
			b.resumePending, b.resumeStep = true, plan.Step
			return true
		}
	}
	return false
}

// resumeDecided records whether the newest backup is to be completed (name) or not (""), and
// gives the order it held. Called with mu held.
func (c *JobCoordinator) resumeDecided(name string) {
	b := &c.backups
	b.resumePending, b.resume = false, name
	c.considerBackup(c.clock.Now())
}

// newestBackedUp returns the highest complete step of the job's newest backup that has one
// (Step -1: none, or the store cannot say) and that backup's name, looking at a few of the
// newest of names (the job's backups, newest first) only, and whether the newest of names has
// no complete step (an upload cut short, perhaps).
func (c *JobCoordinator) newestBackedUp(ctx context.Context, names []string) (step tiers.BackupStep, name string, unfinished bool) {
	const look = 5
	for i, name := range names {
		if i == look {
			break
		}
		steps, _, err := c.store.CompleteSteps(ctx, c.cfg.JobName, name, c.cfg.Shape())
		if err == nil && len(steps) > 0 {
			return steps[0], name, unfinished
		}
		if i == 0 {
			unfinished = err == nil
		}
	}
	return tiers.BackupStep{Step: -1}, "", unfinished
}

// resumable returns backup when it is an upload of the plan's step cut short, which completing
// it leaves nothing else in (tiers.BackupStore.Resumable), else "". backedUp is the highest step
// in a complete backup.
func (c *JobCoordinator) resumable(ctx context.Context, plan tiers.RestorePlan, backup string, backedUp int64) string {
	if !plan.Found || plan.Backup != "" || plan.Step <= backedUp {
		return ""
	}
	data := slices.Compact(slices.Sorted(maps.Values(plan.Data))) // one per hash, in O(n log n)
	ok, why, err := c.store.Resumable(ctx, c.cfg.JobName, backup, plan.Step, data, c.cfg.Shape())
	switch {
	case err != nil:
		c.log.Warn("could not tell whether the newest backup is an upload cut short", "backup", backup, "err", err)
	case !ok:
		c.log.Info("the newest backup is incomplete and stays as it is", "backup", backup, "step", plan.Step, "why", why)
	default:
		return backup
	}
	return ""
}

// backupSynced records that every rank synced step and orders a backup if one is due. Called
// with mu held.
func (c *JobCoordinator) backupSynced(step int64) {
	b := &c.backups
	now := c.clock.Now()
	if !b.started {
		b.started, b.clockFrom = true, now
	}
	b.latest = max(b.latest, step)
	b.synced++
	c.considerBackup(now)
}

// considerBackup orders a backup when one is due, gives a failed order again when its backoff
// passed, and otherwise arms the timer for the next moment something may become due. Called
// with mu held.
func (c *JobCoordinator) considerBackup(now time.Time) {
	b := &c.backups
	if c.store == nil || c.ctx.Err() != nil {
		return
	}
	if o := b.order; o != nil {
		switch {
		case o.retryAt.IsZero():
		case now.Before(o.retryAt):
			c.armBackupTimer(now, o.retryAt)
		case b.latest > o.step:
			// A newer step waits: order it rather than the failed one again, which the node that
			// failed may no longer hold (retention frees an older step once a newer one is
			// complete); in the next minute when this one has its backup name.
			if name, ok := c.freeMinute(now); ok {
				c.log.Info("backup superseded by a newer step", "backup", o.name, "step", o.step, "newer", b.latest)
				c.orderBackup(now, name)
				b.order.superseded = append(o.superseded, o.name)
			}
		default:
			o.retryAt = time.Time{}
			c.log.Info("backup ordered again", "backup", o.name, "step", o.step, "attempt", o.attempts+1)
			b.wake()
		}
		return
	}
	if b.latest < 0 || b.latest <= b.backedUp {
		c.auditBackup(now)
		return
	}
	if _, ok := c.resaves[b.latest]; ok {
		return // being saved again: backed up once every rank did (or after the lag timeout)
	}
	due := (b.steps > 0 && b.synced >= b.steps) || (b.every > 0 && !now.Before(b.clockFrom.Add(b.every)))
	if !due {
		if b.every > 0 {
			c.armBackupTimer(now, b.clockFrom.Add(b.every))
		}
		return
	}
	if b.resumePending {
		return // resumeDecided considers it again
	}
	if b.resume != "" {
		name, step := b.resume, b.resumeStep
		b.resume = ""
		if b.latest == step {
			c.log.Info("backup resumed: completing the upload of the step cut short", "backup", name, "step", step)
			c.orderBackup(now, name)
			return
		}
	}
	if name, ok := c.freeMinute(now); ok {
		c.orderBackup(now, name)
	}
}

// auditEvery is how often the newest backup is checked.
func (c *JobCoordinator) auditEvery() time.Duration {
	if c.backups.every > 0 {
		return max(c.backups.every, backupAuditMin)
	}
	return backupAuditSteps
}

// auditBackup checks, when it is time, that the store still holds the step of the backup this
// incarnation completed last, with nothing else due; the step is backed up again at once if not.
// Called with mu held.
func (c *JobCoordinator) auditBackup(now time.Time) {
	b := &c.backups
	if b.lastName == "" || b.auditing || b.order != nil {
		return
	}
	if now.Before(b.auditAt) {
		c.armBackupTimer(now, b.auditAt)
		return
	}
	b.auditing = true
	name, step := b.lastName, b.backedUp
	go func() { // owned by c: ends with c.ctx
		steps, damaged, err := c.store.CompleteSteps(c.ctx, c.cfg.JobName, name, c.cfg.Shape())
		held := err != nil && !errors.Is(err, tiers.ErrNoBackup) // the store cannot say: nothing is done
		for _, s := range steps {
			held = held || s.Step == step
		}
		c.mu.Lock()
		defer c.mu.Unlock()
		b.auditing = false
		now := c.clock.Now()
		b.auditAt = now.Add(c.auditEvery())
		if held && err != nil {
			c.log.Debug("could not check that the newest backup is still there", "backup", name, "err", err)
		}
		if !held && b.lastName == name && b.backedUp == step {
			why := "is gone from the backup location (deleted, a bucket emptied, a file:// disk unmounted?)"
			for _, d := range damaged {
				if d.Step == step {
					why = "is damaged (" + strings.Join(d.Problems, "; ") + ")"
				}
			}
			c.log.Warn("the newest backup "+why+": its step is backed up again", "backup", name, "step", step)
			b.lastName, b.backedUp, b.clockFrom, b.synced = "", -1, time.Time{}, b.steps
		}
		c.considerBackup(now)
	}()
}

// freeMinute returns the backup name of now's UTC minute, or, when that minute has a backup
// already (names are unique), arms the timer for the next minute and returns false. Called
// with mu held.
func (c *JobCoordinator) freeMinute(now time.Time) (string, bool) {
	name := layout.BackupName(now)
	if name <= c.floor {
		c.armBackupTimer(now, now.UTC().Truncate(time.Minute).Add(time.Minute))
		return "", false
	}
	return name, true
}

// orderBackup makes a new order for the latest step. Called with mu held.
func (c *JobCoordinator) orderBackup(now time.Time, name string) {
	b := &c.backups
	b.order = &backupOrder{name: name, step: b.latest, done: make([]bool, c.cfg.Nodes), hashes: make([][]string, c.cfg.Nodes)}
	c.floor = max(c.floor, name) // a resumed backup is older than the floor
	b.clockFrom, b.synced = now, 0
	b.wake()
	c.log.Info("backup ordered", "backup", name, "step", b.latest)
	if b.stopAskCheck == nil && !b.told {
		b.stopAskCheck = c.clock.AfterFunc(backupAskGrace, c.checkAskers)
	}
}

// checkAskers runs backupAskGrace after the incarnation's first order: the ranks that never
// asked for an order are told of to rank 0's job.
func (c *JobCoordinator) checkAskers() {
	c.mu.Lock()
	defer c.mu.Unlock()
	b := &c.backups
	if c.ctx.Err() != nil || b.told {
		return
	}
	var silent []string
	for r := range c.cfg.Nodes {
		if r >= len(b.asked) || !b.asked[r] {
			silent = append(silent, strconv.Itoa(r))
		}
	}
	if len(silent) == 0 {
		return
	}
	what := "every backup lacks its part" // no order out now (one was given, and none completed)
	if o := b.order; o != nil {
		what = fmt.Sprintf("backup %s of step %d stays incomplete", o.name, o.step)
	}
	b.tell = fmt.Sprintf("the agent of rank %s never asked for backup orders in the %v since the first one: it takes no part in the job's backups (an agent of an earlier mtcfs version, one without a backup location, or one stuck), and %s; run the same mtcfs version on every node of a job (README: to upgrade, stop the job, roll the agents, start the job)",
		strings.Join(silent, ", "), backupAskGrace, what)
	c.log.Error(b.tell)
	b.wake()
}

// armBackupTimer makes considerBackup run at at (replacing an earlier timer). Called with mu held.
func (c *JobCoordinator) armBackupTimer(now, at time.Time) {
	b := &c.backups
	if b.stopTimer != nil {
		b.stopTimer()
	}
	b.stopTimer = c.clock.AfterFunc(max(at.Sub(now), 0), func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		c.considerBackup(c.clock.Now())
	})
}

// Backups records rank's report on its last order and waits until there is an order rank has
// not done, or ctx ends (the zero order, no error), or the incarnation ends (ErrClosed).
func (c *JobCoordinator) Backups(ctx context.Context, rank int, rep tiers.BackupReport) (tiers.BackupOrder, error) {
	if err := c.checkRank(rank); err != nil {
		return tiers.BackupOrder{}, err
	}
	c.mu.Lock()
	c.backupReport(rank, rep)
	if b := &c.backups; rank < c.cfg.Nodes {
		if b.asked == nil {
			b.asked = make([]bool, c.cfg.Nodes)
		}
		b.asked[rank] = true
	}
	for {
		b := &c.backups
		if b.tell != "" && !b.told && rank == 0 {
			b.told = true
			tell := b.tell
			c.mu.Unlock()
			return tiers.BackupOrder{Tell: tell}, nil
		}
		if o := b.order; o != nil && !o.done[rank] && o.retryAt.IsZero() {
			up, names := c.columnUploader(rank)
			if !names || o.done[up] {
				order := tiers.BackupOrder{Backup: o.name, Step: o.step}
				if names {
					order.Data = slices.Clone(o.hashes[up])
				}
				c.mu.Unlock()
				return order, nil
			}
		}
		changed := b.changed
		c.mu.Unlock()
		select {
		case <-changed:
		case <-ctx.Done():
			return tiers.BackupOrder{}, nil
		case <-c.ctx.Done():
			return tiers.BackupOrder{}, ErrClosed
		}
		c.mu.Lock()
	}
}

// backupReport applies a node's report to the current order. Called with mu held.
func (c *JobCoordinator) backupReport(rank int, rep tiers.BackupReport) {
	b := &c.backups
	o := b.order
	if o == nil {
		return
	}
	now := c.clock.Now()
	switch {
	case rep.Done == o.name && !o.done[rank]:
		o.done[rank] = true
		if c.validHashes(rep.Hashes) {
			o.hashes[rank] = slices.Clone(rep.Hashes)
		}
		if o.ndone++; o.ndone < c.cfg.Nodes {
			if _, names := c.columnUploader(rank); !names && c.cfg.AssumeDataParallelism > 0 {
				b.wake() // the column-mates waiting for this rank's data get their order
			}
			return
		}
		if !o.stale {
			b.backedUp = max(b.backedUp, o.step)
		}
		b.order = nil
		b.wake()
		if o.step == b.backedUp {
			b.lastName, b.auditAt = o.name, now.Add(c.auditEvery())
		}
		if o.stale {
			c.log.Info("backup complete, of the step's earlier save: the step was saved again since", "backup", o.name, "step", o.step)
		} else {
			c.log.Info("backup complete", "backup", o.name, "step", o.step)
		}
		if len(o.superseded) > 0 {
			go c.dropSuperseded(o.superseded)
		}
		c.considerBackup(now)
	case rep.Failed == o.name && o.retryAt.IsZero():
		o.attempts++
		o.retryAt = now.Add(min(time.Second<<min(o.attempts-1, 6), backupRetryMax))
		c.log.Warn("backup failed on a node; it is ordered again", "backup", o.name, "step", o.step, "rank", rank,
			"err", rep.Err, "retry_in", o.retryAt.Sub(now).String())
		c.armBackupTimer(now, o.retryAt)
	}
}

// dropSuperseded removes the backups of orders that a node failed and a newer step's order
// replaced (names), once that newer backup is complete. Such an order stays incomplete for
// good: the node that failed it may have freed its step meanwhile (after a partition heals,
// the rejoining node's next step replicated before it took the order; found by a black-box
// run), and `backups verify` flagged it until a user deleted it by hand. Every node has
// reported on the newer order, so none still uploads into the older ones; a backup holding a
// complete or damaged step is refused (mtcfs never deletes checkpoints).
func (c *JobCoordinator) dropSuperseded(names []string) {
	for _, name := range names {
		n, err := c.store.DeleteIncomplete(c.ctx, c.cfg.JobName, name)
		if err != nil {
			c.log.Warn("could not remove the incomplete backup a newer one superseded (mtcfs backups delete removes it)", "backup", name, "err", err)
			continue
		}
		c.log.Info("removed the incomplete backup a newer one superseded", "backup", name, "objects", n)
	}
}

// columnUploader returns, in data-parallel mode, the rank of the last partition in rank's column
// (ranks ≥ nodes − P upload the data, SPEC §6) and true when rank is outside that partition:
// rank then names that rank's data in a backup. Otherwise it returns rank and false.
func (c *JobCoordinator) columnUploader(rank int) (int, bool) {
	d, nodes := c.cfg.AssumeDataParallelism, c.cfg.Nodes
	if d <= 1 || nodes%d != 0 {
		return rank, false
	}
	part := nodes / d
	if rank >= nodes-part {
		return rank, false
	}
	return nodes - part + rank%part, true
}

// validHashes reports whether hashes names one data hash per worker of the job, each 64
// lower-case hex digits (D-prefixed for a directory): what a column-mate may name.
func (c *JobCoordinator) validHashes(hashes []string) bool {
	if len(hashes) != c.cfg.WorkersPerNode {
		return false
	}
	for _, h := range hashes {
		if !layout.IsDataName(h + ".data") {
			return false
		}
	}
	return true
}
