package tiers

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/mtcfs/mtcfs/layout"
)

// DefaultDrainTimeout is how long Close lets a running backup finish (SPEC §10).
const DefaultDrainTimeout = 30 * time.Second

// backupPoll bounds one Backups call; the node calls again at once, so it only limits how long
// a call may hang on a coordinator that went away without closing the connection.
const backupPoll = time.Minute

// errStopping refuses a backup order that arrives while the agent stops.
var errStopping = errors.New("the agent is stopping")

// backupLoop runs for the life of inc on a node with a backup tier: it waits for the backup
// orders of the coordinator (which decides them on its own clock, SPEC §10), takes them one at a
// time and reports each outcome in its next call. A backup outlives its incarnation: a job
// restart does not cut it short.
func (r *Replicator) backupLoop(inc *incarnation) {
	defer r.wg.Done()
	var rep BackupReport
	wait := time.Second
	for inc.ctx.Err() == nil && !r.isStopping() {
		ctx, cancel := context.WithTimeout(inc.ctx, backupPoll)
		order, err := r.cfg.Coordinator.Backups(ctx, inc.Incarnation, rep)
		cancel()
		if err != nil {
			if inc.ctx.Err() != nil {
				return
			}
			r.log.Warn("asking the coordinator for backup orders failed", "err", err, "retry_in", wait.String())
			select {
			case <-time.After(wait):
			case <-inc.ctx.Done():
				return
			}
			wait = min(2*wait, 30*time.Second)
			continue // the report is sent again
		}
		wait, rep = time.Second, BackupReport{}
		if order.Backup == "" {
			continue
		}
		if err := r.takeBackup(inc, order); err != nil {
			rep = BackupReport{Failed: order.Backup, Err: err.Error()}
		} else {
			rep = BackupReport{Done: order.Backup}
		}
	}
}

func (r *Replicator) isStopping() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.stopping
}

// takeBackup uploads this node's part of an order: every worker's data of the step, each
// followed by its .meta. Progress shows in mtcfs status, and retention keeps the step meanwhile.
func (r *Replicator) takeBackup(inc *incarnation, o BackupOrder) (err error) {
	cfg := inc.Config
	p := &Progress{Kind: "backup", Step: o.Step, Backup: o.Backup, Started: r.cfg.Now()}
	r.mu.Lock()
	if r.stopping {
		r.mu.Unlock()
		return errStopping
	}
	r.backup = p
	r.backups.Add(1)
	r.mu.Unlock()
	defer func() {
		r.mu.Lock()
		r.backup = nil
		if err == nil {
			r.lastBackup = o.Backup
		}
		r.mu.Unlock()
		r.backups.Done()
		r.retain(cfg)
	}()
	// What an earlier upload of this job left when it was cut short (a crash, a stop) goes first.
	if n, err := r.cfg.Store.CleanLeftovers(r.ctx, cfg.JobName); err != nil {
		r.log.Warn("removing leftovers of earlier backups", "err", err)
	} else if n > 0 {
		r.log.Info("removed leftovers of backups cut short", "objects", n)
	}
	if err = r.runBackup(cfg, p); err == nil {
		took := r.cfg.Now().Sub(p.Started)
		r.log.Info("backup complete", "backup", o.Backup, "step", o.Step, "bytes", p.Done(), "took", took.String())
		r.metrics.backedUp(took.Seconds(), p.Done())
		r.mu.Lock()
		r.lastBackedUp = max(r.lastBackedUp, o.Step)
		r.mu.Unlock()
		return nil
	}
	if r.ctx.Err() != nil {
		err = fmt.Errorf("cut short by the agent's stop (drain time over): %w", err)
		r.log.Warn("backup left incomplete", "backup", o.Backup, "step", o.Step, "err", err)
		return err
	}
	r.log.Error("backup failed", "backup", o.Backup, "step", o.Step, "err", err)
	r.metrics.error(errKindBackup)
	r.incLine(inc, fmt.Sprintf("backup %s of step %d failed (it is retried): %v", o.Backup, o.Step, err))
	return err
}

// runBackup uploads the data of p.Step for every worker of this node to p.Backup. The data is
// held for the whole upload (retention, or a restore dropping the step, cannot free it under it).
func (r *Replicator) runBackup(cfg *Config, p *Progress) error {
	r.log.Info("backup started", "backup", p.Backup, "step", p.Step, "store", r.cfg.Store.String())
	hashes := make([]string, cfg.WorkersPerNode)
	r.mu.Lock()
	for w := range hashes {
		name := layout.MarkerName{Job: cfg.JobName, Step: p.Step, Node: cfg.NodeRank, Worker: w, Kind: layout.MarkerMeta}.String()
		h, ok := r.metas[name]
		if !ok {
			r.mu.Unlock()
			return fmt.Errorf("step %d worker %d is no longer in this node's RAM", p.Step, w)
		}
		hashes[w] = h
	}
	for _, h := range hashes {
		defer r.holdLocked(h + ".data")()
	}
	r.mu.Unlock()
	var base int64
	for w, hash := range hashes {
		err := r.cfg.Store.Upload(r.ctx, Upload{
			Job: cfg.JobName, Backup: p.Backup, Step: p.Step, Slot: Slot{cfg.NodeRank, w}, Hash: hash,
			Nodes: cfg.Nodes, Workers: cfg.WorkersPerNode,
			Source: r.spoolDir("sealed", hash+".data"),
			Progress: func(done, total int64) {
				p.update(base+done, base+total)
			},
		})
		if err != nil {
			return err
		}
		base = p.Done()
	}
	return nil
}

// drainBackups waits until the running backup (if any) finished, at most d, and says whether
// it did.
func (r *Replicator) drainBackups(d time.Duration) bool {
	done := make(chan struct{})
	go func() { r.backups.Wait(); close(done) }()
	select {
	case <-done:
		return true
	case <-time.After(d):
		return false
	}
}
