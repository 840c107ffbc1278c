package tiers

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"sync"
	"syscall"
	"time"
)

// DefaultDrainTimeout is how long Close lets a running backup finish (SPEC §10).
const DefaultDrainTimeout = 30 * time.Second

// backupPoll bounds one Backups call; the node calls again at once, so it only limits how long
// a call may hang on a coordinator that went away without closing the connection.
const backupPoll = time.Minute

// errStopping refuses a backup order that arrives while the agent stops.
var errStopping = errors.New("the agent is stopping")

// errIncarnationEnded drops an order whose incarnation ended while it waited for the upload
// running on the node: its coordinator is gone, nobody would hear of it.
var errIncarnationEnded = errors.New("its incarnation ended while it waited")

// backupRunner takes the coordinator's backup orders (SPEC §6, §10): one loop per incarnation
// that negotiated (start), at most one backup running at a time. A backup outlives its
// incarnation: a job restart does not cut it short, and an order of the next incarnation waits
// until it ended (slot), then, if it was the same backup and it completed, reports it done
// without uploading again. Before, each restart of a job during a long upload started another
// full upload of the same step beside it. Uploads run on the agent's context: Close (stop) lets
// the running one finish for the drain time, then cancels it.
type backupRunner struct {
	*node
	store     BackupStore // nil: no backup tier
	coord     Coordinator
	retention *retention // keeps the step being backed up
	lines     *jobLines
	drain     time.Duration

	mu       sync.Mutex
	running  *Progress // GUARDED_BY(mu); the running backup
	last     string    // GUARDED_BY(mu); the last backup this node completed its part of
	lastStep int64     // GUARDED_BY(mu); highest step whose part this node backed up (-1: none)
	lastJob  string    // GUARDED_BY(mu); the job of last and lastStep
	stopping bool      // GUARDED_BY(mu); Close began: no new backup starts
	// lastNamed is what the .meta files of last (of step lastNamedStep) name, by worker (nil:
	// not known).
	lastNamed     []string // GUARDED_BY(mu)
	lastNamedStep int64    // GUARDED_BY(mu)
	// toldFailed is the incarnation and backup whose failure the job was last told of, toldFull
	// whether that line (or a later one) said the location is full.
	toldFailed string // GUARDED_BY(mu)
	toldFull   bool   // GUARDED_BY(mu)
	// active counts running backups, for stop to drain; no Add once stopping is set.
	active sync.WaitGroup
	// slot holds one token while an upload runs: one at a time on the node.
	slot chan struct{}
}

func newBackupRunner(n *node, store BackupStore, coord Coordinator, rt *retention, lines *jobLines, drain time.Duration) *backupRunner {
	if drain == 0 {
		drain = DefaultDrainTimeout
	}
	return &backupRunner{node: n, store: store, coord: coord, retention: rt, lines: lines, drain: max(drain, 0), lastStep: -1,
		slot: make(chan struct{}, 1)}
}

// start runs inc's backup loop, on a node with a backup tier, until inc ends or the agent
// stops.
func (b *backupRunner) start(inc *incarnation) {
	if b.store != nil {
		b.tasks.Go(func() { b.loop(inc) })
	}
}

// loop waits for the backup orders of the coordinator (which decides them on its own clock,
// SPEC §10), takes them one at a time and reports each outcome in its next call.
func (b *backupRunner) loop(inc *incarnation) {
	var rep BackupReport
	wait := time.Second
	told := false // that rank 0's agent does not give backup orders
	for inc.ctx.Err() == nil && !b.isStopping() {
		ctx, cancel := context.WithTimeout(inc.ctx, backupPoll)
		order, err := b.coord.Backups(ctx, inc.Incarnation, rep)
		cancel()
		if err != nil {
			if inc.ctx.Err() != nil {
				return
			}
			if errors.Is(err, errors.ErrUnsupported) {
				// Rank 0's agent takes no part in this node's backups: every backup misses this
				// node's part, and a restore after RAM loss would start from scratch. The job is
				// told once; the agent asks again every 30 s meanwhile.
				wait = 30 * time.Second
				if !told {
					told = true
					msg := "backups of this node's part are not taken: " + err.Error() + "; run the same mtcfs version on every node of a job (README: to upgrade, stop the job, roll the agents, start the job)"
					b.log.Error(msg)
					b.lines.incLine(inc, msg)
				}
			}
			if errors.Is(err, ErrOtherIncarnation) || errors.Is(err, ErrIncarnationOver) || errors.Is(err, ErrJobShape) {
				// The coordinator serves another incarnation: asked again every 30 s, quietly
				// (it was logged every 16 s for as long as the agent ran: black-box h58).
				wait = 30 * time.Second
				if !errors.Is(err, ErrIncarnationOver) {
					b.outdated(inc, err, b.lines.incs, b.lines)
				}
			} else {
				b.log.Warn("asking the coordinator for backup orders failed", "err", err, "retry_in", wait.String())
			}
			select {
			case <-time.After(wait):
			case <-inc.ctx.Done():
				return
			}
			wait = min(2*wait, 30*time.Second)
			continue // the report is sent again
		}
		wait, rep = time.Second, BackupReport{}
		if order.Tell != "" {
			b.lines.incLine(inc, order.Tell)
		}
		if order.Backup == "" {
			continue
		}
		if named, err := b.take(inc, order); err != nil {
			rep = BackupReport{Failed: order.Backup, Err: err.Error()}
		} else {
			rep = BackupReport{Done: order.Backup, Hashes: named}
		}
	}
}

func (b *backupRunner) isStopping() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.stopping
}

// take uploads this node's part of an order: every worker's data of the step, each followed by
// its .meta, or only the .meta files naming o.Data (see upload). It returns the data the .meta
// files name, by worker. Progress shows in mtcfs status, and retention keeps the step meanwhile.
func (b *backupRunner) take(inc *incarnation, o BackupOrder) (named []string, err error) {
	cfg := inc.Config
	p := &Progress{Kind: "backup", Step: o.Step, Backup: o.Backup, Started: b.now()}
	b.mu.Lock()
	if b.stopping {
		b.mu.Unlock()
		return nil, errStopping
	}
	b.active.Add(1)
	b.mu.Unlock()
	defer b.active.Done()
	unkeep := b.retention.keepStep(cfg.JobName, o.Step)
	defer func() {
		unkeep()
		b.retention.retain(cfg)
	}()
	// One upload at a time: an earlier incarnation's may still run. An order whose incarnation
	// ends meanwhile is dropped (its coordinator is gone: nobody would hear of it).
	select {
	case b.slot <- struct{}{}:
	default:
		b.log.Info("backup waits for the upload running on this node", "backup", o.Backup, "step", o.Step)
		select {
		case b.slot <- struct{}{}:
		case <-b.ctx.Done():
			return nil, fmt.Errorf("backup %s of step %d: %w", o.Backup, o.Step, errStopping)
		case <-inc.ctx.Done():
			return nil, fmt.Errorf("backup %s of step %d: %w", o.Backup, o.Step, errIncarnationEnded)
		}
	}
	defer func() { <-b.slot }()
	b.mu.Lock()
	switch {
	case b.lastJob == cfg.JobName && b.last == o.Backup && b.lastNamedStep == o.Step && b.lastNamed != nil:
		named = b.lastNamed
		b.mu.Unlock()
		b.log.Info("backup complete: this node's part was uploaded by the upload it waited for", "backup", o.Backup, "step", o.Step)
		return named, nil
	case b.stopping: // Close began while this order waited
		b.mu.Unlock()
		return nil, errStopping
	case inc.ctx.Err() != nil:
		b.mu.Unlock()
		return nil, fmt.Errorf("backup %s of step %d: %w", o.Backup, o.Step, errIncarnationEnded)
	}
	b.running = p
	b.mu.Unlock()
	defer func() {
		b.mu.Lock()
		b.running = nil
		b.mu.Unlock()
	}()
	// What an earlier upload of this job left when it was cut short (a crash, a stop) goes first.
	if n, err := b.store.CleanLeftovers(b.ctx, cfg.JobName); err != nil {
		b.log.Warn("removing leftovers of earlier backups", "err", err)
	} else if n > 0 {
		b.log.Info("removed leftovers of backups cut short", "objects", n)
	}
	if named, err = b.upload(cfg, p, o.Data); err == nil {
		took := b.now().Sub(p.Started)
		b.log.Info("backup complete", "backup", o.Backup, "step", o.Step, "bytes", p.Done(), "took", took.String())
		b.metrics.backedUp(took.Seconds(), p.Done())
		b.mu.Lock()
		b.completedLocked(cfg.JobName, o.Backup, o.Step, named)
		b.mu.Unlock()
		return named, nil
	}
	if b.ctx.Err() != nil {
		err = fmt.Errorf("cut short by the agent's stop (drain time over): %w", err)
		b.log.Warn("backup left incomplete", "backup", o.Backup, "step", o.Step, "err", err)
		return nil, err
	}
	b.log.Error("backup failed", "backup", o.Backup, "step", o.Step, "err", err)
	b.metrics.error(errKindBackup)
	// The job is told once per backup: the order is given again with a backoff of 1 s doubling
	// to a minute, and a location that keeps failing wrote a line per retry (found by a
	// black-box run); the log has every attempt.
	// A location found full after another failure of the same backup (a transient one first)
	// is told too: the first line did not say what to do (a review).
	key, full := inc.ID+"/"+o.Backup, locationFull(err) != ""
	b.mu.Lock()
	told := b.toldFailed == key && (b.toldFull || !full)
	if !told && b.lines.incs.isCurrent(inc) { // a line goes to the current incarnation's job only
		b.toldFull = full || (b.toldFailed == key && b.toldFull)
		b.toldFailed = key
	}
	b.mu.Unlock()
	if !told {
		b.lines.incLine(inc, fmt.Sprintf("backup %s of step %d failed (it is retried, and told here once): %s%s%v", o.Backup, o.Step, locationFull(err), otherWriter(cfg, err), err))
	}
	return nil, err
}

// locationFull says what to do when err is a backup location out of space or quota (a file://
// disk): the bare error ended a long line and read as one more transient failure.
// otherWriter explains a name of the backup that holds other bytes (a create-if-absent write
// refused): another agent writes this job's backups under the same names. Two one-node jobs of
// one job-name on one location did, each retrying for ever, and after a reboot one restored the
// other's step, told only "precondition failed" (found by a black-box run).
func otherWriter(cfg *Config, err error) string {
	if !errors.Is(err, fs.ErrExist) {
		return ""
	}
	return fmt.Sprintf("another agent wrote other bytes under this backup's names: two jobs, or two nodes, with job-name %s and node-rank %d use this backup location? (give each job its own job-name: they restore each other's checkpoints): ", cfg.JobName, cfg.NodeRank)
}

func locationFull(err error) string {
	if errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT) {
		return "the backup location is full (free space there, or point --backup at a larger one; the retries go on until it fits): "
	}
	return ""
}

// upload uploads the data of p.Step for every worker of this node to p.Backup and returns the
// hashes its .meta files name, by worker. The data is held for the whole upload (retention, or a
// restore dropping the step, cannot free it under it).
//
// With column (data-parallel mode, a node outside the last partition, SPEC §6) it uploads only
// the .meta files, naming the data by worker that the column's last-partition node uploaded: a
// column's data travels once. Should that fail (the data is not in the backup), the node uploads
// its own data after all: the backup stays complete and self-consistent.
func (b *backupRunner) upload(cfg *Config, p *Progress, column []string) ([]string, error) {
	b.log.Info("backup started", "backup", p.Backup, "step", p.Step, "store", b.store.String())
	// Naming the column's data needs nothing of this node's: its own copy of the step may be
	// freed by now (the job saved a newer step while the column's uploader uploaded).
	named := 0
	if outside := cfg.PeersOutsideColumn(); len(column) > 0 && len(outside) > 0 {
		// The job's own column-mates are not mtcfs's: the column's data may be another
		// partition's, so this node's .meta must name its own.
		b.log.Warn("this node's peer-ranks are not in its data-parallel column: it uploads its own data rather than naming the column's",
			"backup", p.Backup, "step", p.Step, "peers_outside_column", outside)
		column = nil
	}
	if len(column) > 0 {
		if len(column) == cfg.WorkersPerNode {
			var err error
			named, err = b.nameColumn(cfg, p, column)
			switch {
			case err == nil:
				return column, nil
			case !errors.Is(err, ErrDataNotInBackup):
				return nil, err // the same order is given again
			}
			b.log.Warn("the column's data is not in the backup: uploading this node's own", "backup", p.Backup, "step", p.Step,
				"named", named, "err", err)
		} else {
			b.log.Warn("the column's data names another number of workers: uploading this node's own",
				"backup", p.Backup, "step", p.Step, "workers", cfg.WorkersPerNode, "named", len(column))
		}
	}
	hashes, release, err := b.retention.holdStep(cfg, p.Step)
	if err != nil {
		return nil, err
	}
	defer release()
	// The workers whose .meta already names the column's data keep it.
	copy(hashes, column[:named])
	var base int64
	for w, hash := range hashes {
		if w < named {
			continue
		}
		err := b.store.Upload(b.ctx, Upload{
			Job: cfg.JobName, Backup: p.Backup, Step: p.Step, Slot: Slot{cfg.NodeRank, w}, Hash: hash,
			Shape:  cfg.Shape(),
			Source: b.spoolDir("sealed", hash+".data"),
			Progress: func(done, total int64) {
				p.update(base+done, base+total)
			},
		})
		if err != nil {
			return nil, err
		}
		base = p.Done()
	}
	return hashes, nil
}

// nameColumn uploads this node's .meta files of p.Step, naming data (by worker) already in the
// backup, and returns how many it uploaded (worker 0 up).
func (b *backupRunner) nameColumn(cfg *Config, p *Progress, data []string) (int, error) {
	p.update(0, 0)
	for w, hash := range data {
		err := b.store.Upload(b.ctx, Upload{
			Job: cfg.JobName, Backup: p.Backup, Step: p.Step, Slot: Slot{cfg.NodeRank, w}, Hash: hash,
			Shape: cfg.Shape(),
		})
		if err != nil {
			return w, err
		}
	}
	b.log.Info("backup: named the column's data", "backup", p.Backup, "step", p.Step, "data", data)
	return len(data), nil
}

// sealed notes a step this node sealed: the step its last backup holds, sealed again naming
// other data, is in no backup yet, and status says so (it said the step was backed up, while
// rank 0 backs it up again: a black-box run).
func (b *backupRunner) sealed(job string, step int64, worker int, hash string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.lastJob != job || b.lastStep != step || b.lastNamedStep != step || worker >= len(b.lastNamed) || b.lastNamed[worker] == hash {
		return
	}
	b.lastStep = step - 1
}

// stop lets no new backup start and waits until the running one (if any) finished, at most the
// drain time. Close calls it, then cancels the agent's context, which cuts an upload short.
func (b *backupRunner) stop() {
	b.mu.Lock()
	b.stopping = true
	var backup string
	step := int64(-1)
	if b.running != nil {
		backup, step = b.running.Backup, b.running.Step
	}
	b.mu.Unlock()
	if backup != "" {
		b.log.Info("stopping: letting the running backup finish", "backup", backup, "step", step, "drain_timeout", b.drain.String())
	}
	// Also when none runs yet: an order between its start and its upload is waited for (it
	// sees stopping once it has the slot and returns).
	done := make(chan struct{})
	go func() { b.active.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(b.drain):
		b.mu.Lock()
		if b.running != nil { // begun during the wait
			backup, step = b.running.Backup, b.running.Step
		}
		b.mu.Unlock()
		if backup == "" {
			// An order between its start and its upload (waiting for the upload slot, or for
			// the step's data): no backup of it was begun (it said backup="" step=-1, found by
			// a black-box run).
			b.log.Warn("a backup order had not begun its upload within the drain time: dropped, the next agent orders it again",
				"drain_timeout", b.drain.String())
			break
		}
		b.log.Warn("the running backup did not finish within the drain time: cut short, it stays incomplete and the next agent retries it",
			"backup", backup, "step", step, "drain_timeout", b.drain.String())
	}
}

// restoredFrom records that job restored step from backup, a complete one: status and
// /metrics show it as the last backup and the step backed up, as if this node had uploaded it.
// Before, a node that restored from a backup said backed_up -1 until the next backup.
func (b *backupRunner) restoredFrom(job, backup string, step int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.lastJob != job || step > b.lastStep {
		b.completedLocked(job, backup, step, nil)
	}
}

// completedLocked records that job's backup holds step, this node's .meta files naming named
// (nil: not known), for status and the same-backup shortcut of take. Called with mu held.
func (b *backupRunner) completedLocked(job, backup string, step int64, named []string) {
	if b.lastJob != job {
		b.lastStep, b.lastJob = -1, job
	}
	b.last, b.lastStep, b.lastNamed, b.lastNamedStep = backup, max(b.lastStep, step), named, step
}

// status returns the running backup (nil: none), the last one completed and the highest step
// backed up (-1: none), of job.
func (b *backupRunner) status(job string) (running *Progress, last string, lastStep int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if job != b.lastJob {
		return b.running, "", -1
	}
	return b.running, b.last, b.lastStep
}
