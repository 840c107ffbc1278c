package tiers

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/mtcfs/mtcfs/layout"
)

// inventory lists what this node holds in RAM for the restore negotiation.
func (r *Replicator) inventory(rank int) Inventory {
	inv := Inventory{Rank: rank, Metas: map[string]string{}}
	r.mu.Lock()
	for k, v := range r.metas {
		inv.Metas[k] = v
	}
	r.mu.Unlock()
	ents, _ := os.ReadDir(r.spoolDir("sealed"))
	for _, e := range ents {
		inv.Data = append(inv.Data, strings.TrimSuffix(e.Name(), ".data"))
	}
	return inv
}

// restoreIncarnation runs SPEC §5 for this node: negotiate, publish replicator.prerestore,
// bring in the data (own RAM, then a peer's, then the backup), wait for every node, then create
// the markers.
func (r *Replicator) restoreIncarnation(inc *incarnation) {
	cfg := inc.Config
	ctx := inc.ctx
	fail := func(msg string) {
		if ctx.Err() != nil {
			return // superseded by a new replicator.yaml or the agent stopping: not the job's failure
		}
		r.metrics.error(errKindRestore)
		r.failLine(cfg, msg)
		r.setPhase(inc, "failed")
	}
	superseded := func() bool { return ctx.Err() != nil || r.current() != inc }
	// Steps the job committed before it restarted count: wait until they are sealed, so that
	// the inventory holds them (SPEC §2: a committed step is never dropped).
	if err := r.waitSealed(ctx); err != nil {
		return
	}
	plan, err := r.cfg.Coordinator.Negotiate(ctx, inc.Incarnation, r.inventory(cfg.NodeRank))
	if err != nil {
		fail(fmt.Sprintf("restore negotiation failed: %v", err))
		return
	}
	if superseded() {
		return
	}
	if r.cfg.Store != nil {
		r.wg.Add(1)
		go r.backupLoop(inc)
	}
	for _, line := range plan.Errors {
		r.errLine(cfg, line)
	}
	r.dropAbandonedSteps(cfg, plan)
	pre := "{}\n"
	if plan.Found {
		pre = fmt.Sprintf("{restore-step: %d}\n", plan.Step)
		if plan.Backup != "" {
			pre = fmt.Sprintf("{restore-step: %d, restore-backup: %s}\n", plan.Step, plan.Backup)
		}
	}
	if err := r.ns.WriteFile(layout.PrerestoreName, []byte(pre)); err != nil {
		fail(fmt.Sprintf("write %s: %v", layout.PrerestoreName, err))
		return
	}
	r.log.Info("restore plan", "found", plan.Found, "step", plan.Step, "backup", plan.Backup, "pinned", plan.Pinned)

	if plan.Found {
		for w := 0; w < cfg.WorkersPerNode; w++ {
			slot := Slot{cfg.NodeRank, w}
			hash, ok := plan.Data[slot]
			if !ok {
				fail(fmt.Sprintf("restore plan for step %d has no data for %s", plan.Step, slot))
				return
			}
			if err := r.restoreSlot(ctx, inc, plan, w, hash); err != nil {
				fail(fmt.Sprintf("restore of step %d failed: %v", plan.Step, err))
				return
			}
		}
	}
	if err := r.cfg.Coordinator.Restored(ctx, inc.Incarnation); err != nil {
		fail(fmt.Sprintf("waiting for the other nodes to restore failed: %v", err))
		return
	}
	if superseded() {
		return
	}
	if plan.Found {
		// The restored step is protected again without waiting for a new save (SPEC §10): it is
		// pushed to this node's peers (only the .meta to a peer that held the data at the
		// restore) and synced, so that "latest replicated on every node" covers it. Queued
		// before the markers appear, it is synced before any step the job saves next.
		for w := 0; w < cfg.WorkersPerNode; w++ {
			hash := plan.Data[Slot{cfg.NodeRank, w}]
			r.syncQ.push(sealedStep{
				commit:   commit{inc: inc, step: plan.Step, worker: w, at: r.cfg.Now()},
				dataName: hash + ".data",
				meta:     layout.MarkerName{Job: cfg.JobName, Step: plan.Step, Node: cfg.NodeRank, Worker: w, Kind: layout.MarkerMeta}.String(),
				restored: true,
				holders:  plan.Holders[hash],
			})
		}
	}
	// The state is "running" before the job can see a marker, so status never lags behind it.
	r.mu.Lock()
	inc.restored, inc.phase = plan.Step, "running"
	if plan.Found && plan.Step > r.lastCommitted && r.inc == inc {
		r.lastCommitted = plan.Step
	}
	r.mu.Unlock()
	for w := 0; w < cfg.WorkersPerNode; w++ {
		var err error
		if plan.Found {
			name := layout.MarkerName{Job: cfg.JobName, Step: plan.Step, Node: cfg.NodeRank, Worker: w, Kind: layout.MarkerRestore}.String()
			err = r.ns.Symlink(plan.Data[Slot{cfg.NodeRank, w}]+".data", name)
		} else {
			name := layout.MarkerName{Job: cfg.JobName, Step: 0, Node: cfg.NodeRank, Worker: w, Kind: layout.MarkerRestore}.String()
			err = r.ns.WriteFile(name, nil)
		}
		if err != nil {
			fail(fmt.Sprintf("create restore marker: %v", err))
			return
		}
	}
	r.log.Info("restore markers published", "step", plan.Step, "found", plan.Found)
}

// dropAbandonedSteps forgets this job's steps newer than the one the job restores (all of them on
// a fresh start): the job continues from the restored step and will save those step numbers
// again, and a .meta of the old timeline must never combine with ones of the new into a step
// that looks complete but mixes two saves. Every node drops them (all restore the same plan),
// its own .meta files and the replicas it holds.
func (r *Replicator) dropAbandonedSteps(cfg *Config, plan RestorePlan) {
	var drop []string
	r.mu.Lock()
	for name := range r.metas {
		m, ok := layout.ParseMarkerName(name)
		if ok && m.Job == cfg.JobName && (!plan.Found || m.Step > plan.Step) {
			drop = append(drop, name)
			delete(r.metas, name)
		}
	}
	r.mu.Unlock()
	if len(drop) == 0 {
		return
	}
	sort.Strings(drop)
	for _, name := range drop {
		os.Remove(r.spoolDir("meta", name))
		r.ns.Remove(name)
	}
	r.log.Info("dropped the steps of an abandoned timeline: the job continues from the restored step", "restored", plan.Step, "found", plan.Found, "metas", drop)
	r.retain(cfg) // frees their data
}

// waitSealed returns once no commit waits for sealing.
func (r *Replicator) waitSealed(ctx context.Context) error {
	for {
		r.mu.Lock()
		n, changed := len(r.pending), r.pendingChanged
		r.mu.Unlock()
		if n == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-changed:
		}
	}
}

func (r *Replicator) setPhase(inc *incarnation, phase string) {
	r.mu.Lock()
	inc.phase = phase
	r.mu.Unlock()
}

// restoreSlot brings in worker w's data and publishes its .meta. The data is held (retention
// skips it) from before the first look at the spool until its .meta names it, and every look
// at the spool happens under publishMu, so a retention already running finishes first.
func (r *Replicator) restoreSlot(ctx context.Context, inc *incarnation, plan RestorePlan, w int, hash string) error {
	cfg := inc.Config
	slotStart := r.cfg.Now()
	dataName := hash + ".data"
	defer r.hold(dataName)()
	meta := layout.MarkerName{Job: cfg.JobName, Step: plan.Step, Node: cfg.NodeRank, Worker: w, Kind: layout.MarkerMeta}.String()
	sealed := r.spoolDir("sealed", dataName)
	publish := func(incoming string) error {
		r.publishMu.Lock()
		defer r.publishMu.Unlock()
		if incoming != "" {
			if _, err := os.Lstat(sealed); err == nil {
				os.RemoveAll(incoming) // another slot brought the same data meanwhile
			} else if err := os.Rename(incoming, sealed); err != nil {
				return err
			}
			r.markVerified(dataName) // checked on arrival
		} else if _, err := os.Lstat(sealed); err != nil {
			return errNotInRAM
		}
		if !r.hasName(dataName) {
			if err := r.ns.Import(sealed, dataName); err != nil {
				return err
			}
		}
		return r.writeMeta(meta, hash)
	}
	// First this node's own RAM. Data this agent sealed or verified is immutable to the job and
	// trusted; anything else is hashed first, and a copy that fails is reported and replaced
	// from the next source, never used and never silently dropped.
	if _, err := os.Lstat(sealed); err == nil && !r.isVerified(dataName) {
		if err := r.verifyInRAM(ctx, plan.Step, dataName); err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			r.metrics.error(errKindVerify)
			r.errLine(cfg, fmt.Sprintf("step %d: the copy of %s in this node's RAM fails its check (%v); restoring it from a peer or a backup instead", plan.Step, dataName, err))
			r.dropData(dataName)
		}
	}
	err := publish("")
	if !errors.Is(err, errNotInRAM) {
		if err == nil {
			r.metrics.restored("ram", r.cfg.Now().Sub(slotStart).Seconds())
		}
		return err
	}
	// Then from a peer that holds it, in RAM.
	for _, holder := range plan.Holders[hash] {
		if holder == cfg.NodeRank || r.cfg.Peers == nil {
			continue
		}
		dir := r.spoolDir("incoming", randomID())
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return err
		}
		start := r.cfg.Now()
		p := &Progress{Kind: "restore", Step: plan.Step, Source: fmt.Sprintf("peer %d", holder), Started: start}
		r.setRestoreProgress(p)
		err := r.cfg.Peers.Fetch(ctx, inc.Incarnation, holder, dataName, dir, p.update)
		r.setRestoreProgress(nil)
		if err == nil {
			err = publish(filepath.Join(dir, dataName))
		}
		os.RemoveAll(dir)
		if err == nil {
			took := r.cfg.Now().Sub(start)
			r.log.Info("restored from a peer", "data", dataName, "peer", holder, "took", took.String())
			r.metrics.restored("peer", took.Seconds())
			r.metrics.moved("peer", "in", p.Done())
			return nil
		}
		r.log.Warn("fetch from a peer failed", "data", dataName, "peer", holder, "err", err)
	}
	// Last, a backup: the plan's, or (when the plan found the step in RAM) the newest backup
	// holding exactly this data for this slot.
	backup := plan.Backup
	if backup == "" && r.cfg.Store != nil {
		backup = r.findBackupOf(ctx, cfg, plan.Step, Slot{cfg.NodeRank, w}, hash)
	}
	if backup == "" || r.cfg.Store == nil {
		return fmt.Errorf("%s is not in this node's RAM nor a peer's, and no complete backup holds it", dataName)
	}
	incoming, err := r.download(ctx, cfg, plan.Step, backup, hash)
	if incoming != "" {
		defer os.RemoveAll(filepath.Dir(incoming))
	}
	if err != nil {
		return err
	}
	return publish(incoming)
}

// verifyInRAM hashes data held in this node's spool before a restore uses it, showing the
// progress as a restore from "RAM (verifying)".
func (r *Replicator) verifyInRAM(ctx context.Context, step int64, dataName string) error {
	p := &Progress{Kind: "restore", Step: step, Source: "RAM (verifying)", Started: r.cfg.Now()}
	r.setRestoreProgress(p)
	defer r.setRestoreProgress(nil)
	h, dir, _ := layout.ParseDataName(dataName)
	if err := layout.VerifyData(ctx, r.spoolDir("sealed", dataName), h, dir); err != nil {
		return err
	}
	r.markVerified(dataName)
	return nil
}

// dropData removes data from the spool and the namespace (it failed its check).
func (r *Replicator) dropData(dataName string) {
	r.publishMu.Lock()
	defer r.publishMu.Unlock()
	os.RemoveAll(r.spoolDir("sealed", dataName))
	r.ns.Remove(dataName)
	r.mu.Lock()
	delete(r.verified, dataName)
	r.mu.Unlock()
}

// findBackupOf returns the newest backup of the job with a complete step holding hash for slot
// ("" if none, or the store cannot say).
func (r *Replicator) findBackupOf(ctx context.Context, cfg *Config, step int64, slot Slot, hash string) string {
	names, err := r.cfg.Store.Backups(ctx, cfg.JobName)
	if err != nil {
		r.log.Warn("list backups", "err", err)
		return ""
	}
	for _, name := range names {
		steps, err := r.cfg.Store.CompleteSteps(ctx, cfg.JobName, name, cfg.Nodes, cfg.WorkersPerNode)
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

var errNotInRAM = errors.New("not in RAM")

// setRestoreProgress shows p (nil: none) as the running restore in mtcfs status.
func (r *Replicator) setRestoreProgress(p *Progress) {
	r.mu.Lock()
	r.restore = p
	r.mu.Unlock()
}

// download fetches hash's data from a backup into a new directory under spool/incoming and
// verifies it against its hash; progress shows in mtcfs status.
func (r *Replicator) download(ctx context.Context, cfg *Config, step int64, backup, hash string) (string, error) {
	dataName := hash + ".data"
	p := &Progress{Kind: "restore", Step: step, Source: "backup " + backup, Started: r.cfg.Now()}
	r.setRestoreProgress(p)
	defer r.setRestoreProgress(nil)
	incoming := r.spoolDir("incoming", randomID(), dataName)
	if err := os.MkdirAll(filepath.Dir(incoming), 0o700); err != nil {
		return "", err
	}
	r.log.Info("downloading from backup", "backup", backup, "data", dataName)
	if err := r.cfg.Store.Download(ctx, cfg.JobName, backup, hash, incoming, p.update); err != nil {
		return incoming, fmt.Errorf("download %s from backup %s: %w", dataName, backup, err)
	}
	h, dir, _ := layout.ParseDataName(dataName)
	if err := layout.VerifyData(ctx, incoming, h, dir); err != nil {
		return incoming, err
	}
	r.log.Info("restored from backup", "data", dataName, "bytes", p.Done())
	r.metrics.restored("backup", r.cfg.Now().Sub(p.Started).Seconds())
	r.metrics.moved("backup", "in", p.Done())
	return incoming, nil
}
