package tiers

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// incarnation is one start of the job (one valid replicator.yaml) and the state that lives and
// dies with it. Its ctx ends when the next replicator.yaml arrives or the agent stops: its
// restore, its backup loop, its pushes and its early pushes end with it. Sealing the steps it
// committed does not: a committed step is never dropped (SPEC §2).
type incarnation struct {
	Incarnation
	ctx    context.Context
	cancel context.CancelFunc

	mu       sync.Mutex
	phase    string // GUARDED_BY(mu); "restoring", "running", "failed"
	restored int64  // GUARDED_BY(mu); step restored (0: none)
	// inUse is the step the restore published markers for, which the job may still read, until
	// a step it commits after the restore is sealed (-1: none). Retention keeps it: a step the
	// job committed while its restore waited, synced once the restore was done, freed the
	// restored step's data under the job that then read it (a black-box run: ENOENT).
	inUse int64 // GUARDED_BY(mu)
	// inUseData are the hashes of the data this node restored for inUse (its markers name
	// them): kept while the step is in use, also once a commit of the same step replaced its
	// .meta (a black-box run: another process of the job saved the restored step again at once,
	// and the marker the job read through named freed data).
	inUseData []string // GUARDED_BY(mu)
	// committed is the highest step every worker of this node sealed (or the restored step).
	committed int64 // GUARDED_BY(mu)
	// replicated is the highest step the coordinator reported replicated on every node (-1:
	// none yet).
	replicated int64 // GUARDED_BY(mu)
	// everywhere is the highest step whose sync the coordinator answered: every node of the
	// job committed it (-1: none yet).
	everywhere int64     // GUARDED_BY(mu)
	restore    *Progress // GUARDED_BY(mu); the restore transfer running, for status
	waiting    string    // GUARDED_BY(mu); what the restore waits for, for status ("": nothing)
	// early holds, by top-level name, the files pushed to peers before their step committed.
	early map[string]*earlyGroup // GUARDED_BY(mu)
	// transferTold is set once the job was told of a long restore transfer (one line per
	// restore, not per worker or attempt).
	transferTold atomic.Bool
	// fillTold is set once the job was told that unreplicated steps fill this node's RAM.
	fillTold atomic.Bool
	// heldOpenTold is set once the job was told that freed checkpoints it holds open or mapped
	// keep their RAM (retention.warnIfHeldOpen).
	heldOpenTold atomic.Bool
	// belowTold is set once the job was told that a step it saved below one already restored
	// or committed is not synced (once per incarnation: a run counting from 1 under a restored
	// step 1000 saves many).
	belowTold atomic.Bool
	// workersTold is set once the job was told of a step some workers of this node never
	// committed (syncer.tellMissingWorkers).
	workersTold atomic.Bool
	// outdatedSeen is set at the coordinator's first ErrOtherIncarnation answer (noteOutdated).
	outdatedSeen atomic.Bool
	// syncWaitTold is set once the job was told of a sync that waited long (syncer.syncNow).
	syncWaitTold atomic.Bool
	// user is the job's user, the owner of the replicator.yaml it wrote (-1: unknown, or
	// root): a step restored for it is given to it (Namespace.Reown). Set before the restore
	// starts.
	user int64
	// stranger is the job's user when it does not own the mount root (-1: none): a step saved
	// by another user is not given to it (RootOwned), and the job is told.
	stranger int64
	// sealedHere are the .meta names of the steps the job committed in this incarnation and
	// this node sealed: the incarnation's restore never drops them as of a timeline the job
	// left (a job that went on saving while its restore waited had them dropped when a held
	// negotiation completed, and its next start restored an older step, or nothing; found by a
	// black-box run).
	sealedHere map[string]bool // GUARDED_BY(mu); noted while the restore runs only
	// restoredSyncDue is set once the restored step is queued for its sync, until the syncer
	// takes the restore's done tick, queued after it: the syncs of the incarnation wait until
	// then and go in step order (a step sealed during the restore but taken by the syncer just
	// after it went first, and the coordinator, which takes steps in order, then refused the
	// restored one).
	restoredSyncDue bool // GUARDED_BY(mu)
}

// setRestoredSyncDue records whether the restored step's sync is queued and its restore's done
// tick not yet taken.
func (inc *incarnation) setRestoredSyncDue(due bool) {
	inc.mu.Lock()
	inc.restoredSyncDue = due
	inc.mu.Unlock()
}

// syncWaits reports whether a sync of the incarnation must wait: its restore runs, or the
// restored step's sync is queued and not yet reached.
func (inc *incarnation) syncWaits() bool {
	inc.mu.Lock()
	defer inc.mu.Unlock()
	return inc.phase == "restoring" || inc.restoredSyncDue
}

// noteSealedHere records that the job's commit of this incarnation was sealed as meta, while
// the restore runs: only it asks (the set went on growing with every save after it).
func (inc *incarnation) noteSealedHere(meta string) {
	inc.mu.Lock()
	if inc.phase != "restoring" {
		inc.mu.Unlock()
		return
	}
	if inc.sealedHere == nil {
		inc.sealedHere = map[string]bool{}
	}
	inc.sealedHere[meta] = true
	inc.mu.Unlock()
}

// isSealedHere reports whether meta is of a step the job committed in this incarnation.
func (inc *incarnation) isSealedHere(meta string) bool {
	inc.mu.Lock()
	defer inc.mu.Unlock()
	return inc.sealedHere[meta]
}

func newIncarnation(parent context.Context, cfg *Config) *incarnation {
	inc := &incarnation{Incarnation: Incarnation{ID: randomID(), Config: cfg}, phase: "restoring", committed: -1, replicated: -1, everywhere: -1,
		early: map[string]*earlyGroup{}, user: -1, stranger: -1, inUse: -1}
	inc.ctx, inc.cancel = context.WithCancel(parent)
	return inc
}

// noteOutdated is told that the job's coordinator answered a call of inc, this node's current
// incarnation, with ErrOtherIncarnation (err). If inc is still current after after (the job's
// restart reaches every node within seconds: rank 0's coordinator answers a node whose yaml has
// not come yet so, and the node was told it was left behind during a restart of the whole job,
// black-box h61), it is marked superseded: status says so, and tell tells the job and the log,
// once. An agent cut off (stopped, partitioned) while the job restarted without it went on
// saying "running" (black-box h58).
func (inc *incarnation) noteOutdated(err error, after time.Duration, current func() bool, tell func(line string)) {
	if !inc.outdatedSeen.CompareAndSwap(false, true) {
		return
	}
	time.AfterFunc(after, func() {
		if inc.ctx.Err() != nil || !current() {
			return
		}
		inc.mu.Lock()
		mark := inc.phase != PhaseSuperseded && inc.phase != "failed"
		if mark {
			inc.phase = PhaseSuperseded
		}
		inc.mu.Unlock()
		if mark {
			tell(supersededLine(err))
		}
	})
}

// isSuperseded reports whether inc was marked superseded (noteOutdated).
func (inc *incarnation) isSuperseded() bool {
	inc.mu.Lock()
	defer inc.mu.Unlock()
	return inc.phase == PhaseSuperseded
}

// supersededAfter is how long a current incarnation the coordinator does not serve waits before
// it is marked superseded (noteOutdated).
const supersededAfter = 30 * time.Second

// PhaseSuperseded is the phase of an incarnation the job's coordinator no longer serves.
const PhaseSuperseded = "superseded"

// supersededLine is what the job and the log are told of an outdated incarnation.
func supersededLine(err error) string {
	return fmt.Sprintf("the job's coordinator (rank 0) does not serve this node's incarnation of the job (%v): the job restarted without this node (its agent stopped or cut off meanwhile), or rank 0's agent restarted; this node's saves are not synced, replicated nor backed up until the job restarts here", err)
}

func (inc *incarnation) setPhase(phase string) {
	inc.mu.Lock()
	inc.phase = phase
	inc.mu.Unlock()
}

// setRestoreProgress shows p (nil: none) as the running restore in mtcfs status.
func (inc *incarnation) setRestoreProgress(p *Progress) {
	inc.mu.Lock()
	inc.restore = p
	inc.mu.Unlock()
}

// setWaiting shows what the restore waits for in mtcfs status ("": nothing).
func (inc *incarnation) setWaiting(what string) {
	inc.mu.Lock()
	inc.waiting = what
	inc.mu.Unlock()
}

// savedAfterRestore records that step, which the job committed after its restore was done, is
// sealed: a step above the restored one ends the restored step's use (the job went on from it);
// the restored step saved again does not (the job may still read what it restored).
func (inc *incarnation) savedAfterRestore(step int64) {
	inc.mu.Lock()
	if step > inc.inUse {
		inc.inUse, inc.inUseData = -1, nil
	}
	inc.mu.Unlock()
}

// inUse returns the restored step the job may still read (-1: none) and the data its markers
// name here, of the current incarnation or else the one before.
func (s *incarnations) inUse() (step int64, data []string) {
	cur, last := s.both()
	for _, inc := range []*incarnation{cur, last} {
		if inc == nil {
			continue
		}
		inc.mu.Lock()
		step, data = inc.inUse, inc.inUseData
		inc.mu.Unlock()
		if step >= 0 {
			return step, data
		}
	}
	return -1, nil
}

// restoring reports whether the incarnation's restore still runs (not done, not failed).
func (inc *incarnation) restoring() bool {
	inc.mu.Lock()
	defer inc.mu.Unlock()
	return inc.phase == "restoring"
}

// restoreFailed reports whether the incarnation's restore failed.
func (inc *incarnation) restoreFailed() bool {
	inc.mu.Lock()
	defer inc.mu.Unlock()
	return inc.phase == "failed"
}

// restoreDone records the outcome of the restore: the job runs from step (0: from scratch;
// found: a step was restored, whose markers come next).
func (inc *incarnation) restoreDone(step int64, found bool, data []string) {
	inc.mu.Lock()
	inc.restored, inc.phase = step, "running"
	if found {
		inc.inUse, inc.inUseData = step, data
	}
	inc.sealedHere = nil // the restore's drops are done
	// A start from scratch (step 0, not found) committed nothing: committed stays -1.
	if found {
		inc.committed = max(inc.committed, step)
	}
	inc.mu.Unlock()
}

// noteCommitted and noteReplicated raise the incarnation's latest steps.
func (inc *incarnation) noteCommitted(step int64) {
	inc.mu.Lock()
	inc.committed = max(inc.committed, step)
	inc.mu.Unlock()
}

// noteEverywhere records that every node of the job committed step.
func (inc *incarnation) noteEverywhere(step int64) {
	inc.mu.Lock()
	inc.everywhere = max(inc.everywhere, step)
	inc.mu.Unlock()
}

func (inc *incarnation) noteReplicated(step int64) {
	inc.mu.Lock()
	inc.replicated = max(inc.replicated, step)
	inc.mu.Unlock()
	inc.fillTold.Store(false) // replication caught up: a later outage is told again
}

// incarnations knows the job's current incarnation.
type incarnations struct {
	mu sync.Mutex
	// current is the running incarnation; nil before the first valid replicator.yaml, and from
	// the moment a new one arrives until it is valid and set up.
	current *incarnation // GUARDED_BY(mu)
	// last is the newest valid incarnation, current or not: status shows its latest steps, and
	// retention keeps them.
	last *incarnation // GUARDED_BY(mu)
	// startupErrors say what the agent found broken in the spool a previous agent left (a
	// recorded commit it could not seal, data failing its hash): reported to the job at the next
	// handshake, never dropped silently.
	startupErrors []string // GUARDED_BY(mu)
	// given are the ids of the agent's incarnations, the newest last (MaxSuperseded; the first
	// may be the previous agent's on this spool): each new one names those before it as
	// superseded (Incarnation.Superseded).
	given []string // GUARDED_BY(mu)
}

// MaxSuperseded is how many earlier incarnation ids an agent names with a new one.
const MaxSuperseded = 8

// supersede records id as the agent's newest incarnation and returns the ids before it.
func (s *incarnations) supersede(id string) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	before := slices.Clone(s.given)
	s.given = append(s.given, id)
	if len(s.given) > MaxSuperseded {
		s.given = slices.Delete(s.given, 0, len(s.given)-MaxSuperseded)
	}
	return before
}

func (s *incarnations) get() *incarnation {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.current
}

func (s *incarnations) isCurrent(inc *incarnation) bool { return s.get() == inc }

// end ends the current incarnation, if any: its uncommitted work is abandoned.
func (s *incarnations) end() {
	s.mu.Lock()
	if s.current != nil {
		s.current.cancel()
	}
	s.current = nil
	s.mu.Unlock()
}

// begin makes inc the current incarnation.
func (s *incarnations) begin(inc *incarnation) {
	s.mu.Lock()
	s.current, s.last = inc, inc
	s.mu.Unlock()
}

// both returns the current and the newest valid incarnation.
func (s *incarnations) both() (current, last *incarnation) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.current, s.last
}

// startupError records a problem found in the spool at start, for the next handshake.
func (s *incarnations) startupError(msg string) {
	s.mu.Lock()
	s.startupErrors = append(s.startupErrors, msg)
	s.mu.Unlock()
}

// takeStartupErrors returns the startup errors not reported yet.
func (s *incarnations) takeStartupErrors() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	msgs := s.startupErrors
	s.startupErrors = nil
	return msgs
}

// everywhere returns the newest valid incarnation's highest step every node committed (-1:
// none, or no valid incarnation).
func (s *incarnations) everywhere() int64 {
	_, last := s.both()
	if last == nil {
		return -1
	}
	last.mu.Lock()
	defer last.mu.Unlock()
	return last.everywhere
}

// latest returns the newest valid incarnation's latest committed and replicated steps, and the
// step it restored (0 before any valid incarnation). Between incarnations (the job stopped,
// a yaml refused) that is still the last one's: what its restore found stays until a step
// replicates (retention).
func (s *incarnations) latest() (committed, replicated, restored int64) {
	_, last := s.both()
	if last == nil {
		return -1, -1, 0
	}
	last.mu.Lock()
	committed, replicated, restored = last.committed, last.replicated, last.restored
	last.mu.Unlock()
	return committed, replicated, restored
}
