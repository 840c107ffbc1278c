package tiers

import (
	"fmt"
	"slices"
	"sync"
)

// syncer replicates sealed steps to the peers and syncs each step with the coordinator once
// every worker of this node sealed and replicated it, in order; then retention frees what it no
// longer needs. A step counts as replicated only if every worker's replication did. Its
// goroutine (run) ends once its queue is closed and drained; the pushes of a step run each on
// its own goroutine, which the syncer waits for, and end with their incarnation.
type syncer struct {
	*node
	in        *fifo[sealedStep] // from the sealer, and restored steps from the restorer
	coord     Coordinator
	incs      *incarnations
	retention *retention
	lines     *jobLines
	pushers   *pushers // one per peer; only this goroutine uses them
}

func (sy *syncer) run() {
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
		s, ok := sy.in.pop()
		if !ok {
			return
		}
		ok = sy.replicate(s)
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
		sy.sync(s.commit, !p.failed)
	}
}

// replicate pushes a sealed step to the step's peers (SPEC §4), to all of them at once, and
// reports whether every peer acknowledged a verified replica (true when there are no peers):
// only those count.
func (sy *syncer) replicate(s sealedStep) bool {
	peers := s.inc.Config.Peers()
	if len(peers) == 0 {
		return true
	}
	if sy.pushers.transport == nil {
		return false
	}
	early := sy.pushers.early.take(s.commit)
	defer sy.pushers.early.dropAbandoned(s.inc)
	dataBytes := sync.OnceValue(func() int64 { return treeBytes(sy.spoolDir("sealed", s.dataName)) })
	acked := make([]bool, len(peers))
	var pushes sync.WaitGroup
	for i, rank := range peers {
		p := sy.pushers.to(rank)
		pushes.Go(func() { acked[i] = p.push(s, early, dataBytes) })
	}
	pushes.Wait()
	return !slices.Contains(acked, false)
}

// sync reports a step every worker of this node sealed and replicated (replicated: all
// succeeded) to the coordinator, and frees what retention no longer needs. (Backups are
// ordered by the coordinator on its own clock, see backupRunner.)
func (sy *syncer) sync(c commit, replicated bool) {
	if !sy.incs.isCurrent(c.inc) {
		return // an older incarnation's step: sealed and kept, but not synced
	}
	c.inc.noteCommitted(c.step)
	dec, err := sy.coord.Sync(c.inc.ctx, c.inc.Incarnation, SyncReport{Step: c.step, Replicated: replicated})
	if err != nil {
		sy.metrics.error(errKindSync)
		sy.lines.incLine(c.inc, fmt.Sprintf("sync of step %d failed: %v", c.step, err))
		return
	}
	if dec.Replicated && sy.incs.isCurrent(c.inc) {
		c.inc.noteReplicated(c.step)
	}
	sy.retention.retain(c.inc.Config)
}
