package tiers

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/mtcfs/mtcfs/layout"
)

// sealer seals recorded commits in order. It uses no cancellable context: a committed step is
// sealed even when the incarnation that committed it is over or the agent is stopping (what it
// cannot finish stays recorded in the spool for the next agent). Sealed steps go to the
// syncer, so that a slow peer delays the replication of later steps but not their sealing.
func (r *Replicator) sealer() {
	defer r.wg.Done()
	defer r.syncQ.close()
	for {
		pc, ok := r.sealQ.pop()
		if !ok {
			return
		}
		c := pc.commit
		err := pc.err
		var dataName, meta string
		if err == nil {
			dataName, meta, err = r.seal(c)
		}
		r.donePending(c.name)
		if err != nil {
			r.log.Error("seal failed", "step", c.step, "worker", c.worker, "err", err)
			r.metrics.error(errKindSeal)
			r.incLine(c.inc, fmt.Sprintf("sealing step %d (worker %d) failed: %v", c.step, c.worker, err))
			continue
		}
		r.syncQ.push(sealedStep{commit: c, dataName: dataName, meta: meta})
	}
}

// sealedStep is a sealed commit waiting for replication and sync, or a restored step to protect
// again (restored: holders are the ranks that held its data in RAM at the restore, which need
// only its .meta).
type sealedStep struct {
	commit
	dataName, meta string
	restored       bool
	holders        []int
}

// syncer replicates sealed steps and syncs each step with the coordinator once every worker of
// this node sealed and replicated it, in order. A step counts as replicated only if every
// worker's replication did.
func (r *Replicator) syncer() {
	defer r.wg.Done()
	type stepKey struct {
		inc  *incarnation
		step int64
	}
	type progress struct {
		workers map[int]bool
		failed  bool
	}
	steps := map[stepKey]*progress{}
	for {
		s, ok := r.syncQ.pop()
		if !ok {
			return
		}
		ok = r.replicate(s)
		k := stepKey{s.inc, s.step}
		p := steps[k]
		if p == nil {
			for old := range steps {
				if old.inc != s.inc {
					delete(steps, old) // an earlier incarnation's, never to be completed
				}
			}
			p = &progress{workers: map[int]bool{}}
			steps[k] = p
		}
		p.workers[s.worker] = true
		p.failed = p.failed || !ok
		if len(p.workers) < s.inc.Config.WorkersPerNode {
			continue
		}
		delete(steps, k)
		r.afterSeal(s.commit, !p.failed)
	}
}

// seal turns a recorded commit into <hash>.data and writes its .meta (SPEC §3). No byte is
// copied: the record's tree is hashed where it is and renamed into spool/sealed, and the
// namespace entry renamed — or, when Seal had to copy files the job still had open for writing,
// replaced by the sealed copy (the job's descriptors keep their detached files).
func (r *Replicator) seal(c commit) (dataName, meta string, err error) {
	cfg := c.inc.Config
	dataName, err = r.hashRecord(c.dir)
	if err != nil {
		return "", "", err
	}
	content := strings.TrimSuffix(dataName, ".data")
	r.publishMu.Lock()
	defer r.publishMu.Unlock()
	dup, err := r.moveRecord(c.dir, dataName)
	if err != nil {
		return "", "", err
	}
	if dup {
		r.incLine(c.inc, fmt.Sprintf("step %d has exactly the content of an earlier checkpoint (%s): training is not making progress", c.step, dataName))
	} else if !c.atClose {
		r.markVerified(dataName) // hashed just now, and frozen since the commit
	}
	sealed := r.spoolDir("sealed", dataName)
	switch {
	case r.hasName(dataName):
		r.ns.Remove(c.name)
	case c.sealed.Copied > 0:
		r.ns.Remove(c.name)
		if err := r.ns.Import(sealed, dataName); err != nil {
			return "", "", err
		}
	default:
		if err := r.ns.Rename(c.name, dataName); err != nil {
			// The job (or a new handshake) removed the name meanwhile: the sealed copy is the truth.
			if err := r.ns.Import(sealed, dataName); err != nil && !errors.Is(err, os.ErrExist) {
				return "", "", err
			}
		}
	}
	meta = layout.MarkerName{Job: cfg.JobName, Step: c.step, Node: cfg.NodeRank, Worker: c.worker, Kind: layout.MarkerMeta}.String()
	if err := r.writeMeta(meta, content); err != nil {
		return "", "", err
	}
	dropRecord(c.dir) // the .meta is in the spool: the record has served
	took := r.cfg.Now().Sub(c.at)
	r.log.Info("step sealed", "step", c.step, "worker", c.worker, "data", dataName, "took", took.String())
	r.metrics.sealed(took.Seconds())
	r.mu.Lock()
	if r.inc == c.inc {
		r.lastSealed = max(r.lastSealed, c.step)
	}
	r.mu.Unlock()
	return dataName, meta, nil
}

// writeMeta records a .meta in the spool (so a restarted agent finds it) and in the namespace.
func (r *Replicator) writeMeta(name, content string) error {
	dir := r.spoolDir("meta")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	if err := writeFileAtomic(filepath.Join(dir, name), []byte(content)); err != nil {
		return err
	}
	if err := r.ns.WriteFile(name, []byte(content)); err != nil {
		return err
	}
	r.mu.Lock()
	r.metas[name] = content
	r.mu.Unlock()
	return nil
}

func (r *Replicator) hasName(name string) bool {
	ents, _ := r.ns.List()
	for _, e := range ents {
		if e.Name == name {
			return true
		}
	}
	return false
}

// afterSeal syncs a step every worker of this node sealed and replicated (replicated: all
// succeeded) and frees what retention no longer needs. (Backups are ordered by the coordinator
// on its own clock, see backupLoop.)
func (r *Replicator) afterSeal(c commit, replicated bool) {
	cfg := c.inc.Config
	r.mu.Lock()
	current := r.inc == c.inc
	if current && c.step > r.lastCommitted {
		r.lastCommitted = c.step
	}
	r.mu.Unlock()
	if !current {
		return // an older incarnation's step: sealed and kept, but not synced
	}
	dec, err := r.cfg.Coordinator.Sync(c.inc.ctx, c.inc.Incarnation, SyncReport{Step: c.step, Replicated: replicated})
	if err != nil {
		r.metrics.error(errKindSync)
		r.incLine(c.inc, fmt.Sprintf("sync of step %d failed: %v", c.step, err))
		return
	}
	if dec.Replicated {
		r.mu.Lock()
		if r.inc == c.inc && c.step > r.lastReplicated {
			r.lastReplicated = c.step
		}
		r.mu.Unlock()
	}
	r.retain(cfg)
}

func (r *Replicator) metaHash(cfg *Config, step int64, rank, worker int) (string, bool) {
	name := layout.MarkerName{Job: cfg.JobName, Step: step, Node: rank, Worker: worker, Kind: layout.MarkerMeta}.String()
	r.mu.Lock()
	defer r.mu.Unlock()
	h, ok := r.metas[name]
	return h, ok
}

// retain frees this job's steps that are neither the latest complete one, newer than it
// (still being saved), nor being backed up (SPEC §7 local retention).
func (r *Replicator) retain(cfg *Config) {
	r.publishMu.Lock()
	defer r.publishMu.Unlock()
	r.mu.Lock()
	keepFrom := r.lastCommitted
	// A newer step that did not replicate must not cost the one reported replicated: it is the
	// step that survives the loss of a node (SPEC §7). Before the incarnation replicated any, the
	// step every node restored plays that part.
	floor := r.lastReplicated
	if floor < 0 && r.inc != nil {
		floor = r.inc.restored
	}
	if floor > 0 && floor < keepFrom {
		keepFrom = floor
	}
	var backingUp int64 = -1
	if r.backup != nil {
		backingUp = r.backup.Step
	}
	var drop []string
	keepHash := map[string]bool{}
	for name, hash := range r.metas {
		m, ok := layout.ParseMarkerName(name)
		if ok && m.Job == cfg.JobName && m.Step < keepFrom && m.Step != backingUp {
			drop = append(drop, name)
		} else {
			keepHash[hash] = true
		}
	}
	for _, name := range drop {
		delete(r.metas, name)
	}
	r.mu.Unlock()
	for _, name := range drop {
		os.Remove(r.spoolDir("meta", name))
		r.ns.Remove(name)
	}
	// Data that no kept .meta names goes too.
	ents, _ := os.ReadDir(r.spoolDir("sealed"))
	for _, e := range ents {
		hash := strings.TrimSuffix(e.Name(), ".data")
		if keepHash[hash] || r.isPendingData(e.Name()) {
			continue
		}
		os.RemoveAll(r.spoolDir("sealed", e.Name()))
		r.ns.Remove(e.Name())
		r.mu.Lock()
		delete(r.verified, e.Name())
		r.mu.Unlock()
		r.log.Info("freed", "data", e.Name())
	}
}

// isPendingData is true for data being sealed or restored: it has no .meta yet.
func (r *Replicator) isPendingData(name string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.inFlight[name] > 0
}

// hold protects data from retention until the returned release is called.
func (r *Replicator) hold(dataName string) (release func()) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.holdLocked(dataName)
}

// holdLocked is hold with mu held.
func (r *Replicator) holdLocked(dataName string) (release func()) {
	r.inFlight[dataName]++
	return func() {
		r.mu.Lock()
		if r.inFlight[dataName]--; r.inFlight[dataName] <= 0 {
			delete(r.inFlight, dataName)
		}
		r.mu.Unlock()
	}
}

// prehasher hashes files the job closed after writing into r.digests. A step whose files were
// hashed this way seals in the time it takes to combine their digests.
func (r *Replicator) prehasher() {
	defer r.wg.Done()
	defer close(r.earlyQ)
	for path := range r.prehash {
		p, err := r.ns.SpoolFile(path)
		if err != nil {
			continue // gone or renamed meanwhile: the sealer hashes it if it matters
		}
		if err := r.digests.HashFileCached(r.ctx, p); err != nil {
			if r.ctx.Err() == nil {
				r.log.Debug("early hash failed", "path", path, "err", err)
			}
			continue
		}
		r.queueEarly(path, p)
	}
}
