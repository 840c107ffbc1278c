package tiers

import "fmt"

// startBackup uploads this node's data of step to the named backup in the background. The
// coordinator never asks for a backup while one runs; the check here keeps that true if it did.
func (r *Replicator) startBackup(inc *incarnation, step int64, name string) {
	cfg := inc.Config
	p := &Progress{Kind: "backup", Step: step, Backup: name, Started: r.cfg.Now()}
	r.mu.Lock()
	if r.backup != nil {
		r.mu.Unlock()
		return
	}
	r.backup = p
	r.mu.Unlock()
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		err := r.runBackup(inc, p)
		r.mu.Lock()
		r.backup = nil
		if err == nil {
			r.lastBackup = name
		}
		r.mu.Unlock()
		if err != nil {
			r.log.Error("backup failed", "backup", name, "step", step, "err", err)
			r.incLine(inc, fmt.Sprintf("backup %s of step %d failed: %v", name, step, err))
		} else {
			r.log.Info("backup complete", "backup", name, "step", step, "bytes", p.Done(), "took", r.cfg.Now().Sub(p.Started).String())
		}
		r.retain(cfg)
	}()
}

func (r *Replicator) runBackup(inc *incarnation, p *Progress) error {
	cfg := inc.Config
	r.log.Info("backup started", "backup", p.Backup, "step", p.Step, "store", r.cfg.Store.String())
	var base int64
	for w := 0; w < cfg.WorkersPerNode; w++ {
		hash, ok := r.metaHash(cfg, p.Step, cfg.NodeRank, w)
		if !ok {
			return fmt.Errorf("step %d worker %d has no .meta", p.Step, w)
		}
		err := r.cfg.Store.Upload(r.ctx, Upload{
			Job: cfg.JobName, Backup: p.Backup, Step: p.Step, Slot: Slot{cfg.NodeRank, w}, Hash: hash,
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
