package tiers

import (
	"fmt"
	"os"
	"time"
)

// IdleClock is the CPU idle source of yield_test.go, for the package's external tests (a
// ReplicatorConfig.CPUIdle whose CPUs idle at a settable rate).
type IdleClock = idleClock

// NewIdleClock returns an IdleClock with cpus idle CPUs.
func NewIdleClock(cpus float64) *IdleClock { return &idleClock{cpus: cpus, known: true} }

func (c *idleClock) Read() (time.Duration, bool) { return c.read() }
func (c *idleClock) Set(cpus float64)            { c.set(cpus) }

// SetNextSaveGap sets how long after the job's newest open for writing the sealer still counts
// a next save as going on (savingGap by default).
func (r *Replicator) SetNextSaveGap(d time.Duration) { r.node.yield.nextSaveGap.Store(int64(d)) }

// SetReadGap sets how long after the job's newest open for reading the early hasher still
// counts the job as reading (savingGap by default).
func (r *Replicator) SetReadGap(d time.Duration) { r.node.yield.readGap.Store(int64(d)) }

// SetWaitNotices sets when a restore waiting for the other nodes logs it (after logAfter, then
// every logEvery) and tells the job (after lineAfter).
func (r *Replicator) SetWaitNotices(logAfter, logEvery, lineAfter time.Duration) {
	r.node.waits.logAfter.Store(int64(logAfter))
	r.node.waits.logEvery.Store(int64(logEvery))
	r.node.waits.lineAfter.Store(int64(lineAfter))
}

// SetRePushWaits sets the waits before the later tries of a failed push (rePushFirst, then
// doubling up to rePushMax by default).
func (r *Replicator) SetRePushWaits(first, most time.Duration) {
	r.syncer.rePushFirst.Store(int64(first))
	r.syncer.rePushMax.Store(int64(most))
}

// RoundUpBudget is roundUpBudget, for spool_test.go.
func RoundUpBudget(n int64) int64 { return roundUpBudget(n) }

// MoveData is moveData, for the package's external tests.
func MoveData(src, sealed string) (bool, error) { return moveData(src, sealed) }

// BackupsStopping reports whether Close began stopping the backup runner (no new backup
// starts), for tests that act once it has.
func (r *Replicator) BackupsStopping() bool { return r.backups.isStopping() }

// WithdrawLines is jobLines.withdraw, for replicator_test.go.
func (r *Replicator) WithdrawLines(file, ours string) bool { return r.lines.withdraw(file, ours) }

// SetSealRetryFor sets how long after its commit a commit whose record or hash failed on a
// shortage is tried again (sealRetryFor by default).
func (r *Replicator) SetSealRetryFor(d time.Duration) { r.sealer.retryFor.Store(int64(d)) }

// SetHashFault makes f fail the hashing of commit records, of the sealer and of adoption alike;
// only before Start.
func (r *Replicator) SetHashFault(f func(step int64) error) { r.node.hashFault = f }

// SetAfterSealDone makes f run at the end of each commit's done (the sealer went past it);
// only before Start.
func (r *Replicator) SetAfterSealDone(f func(name string)) { r.recorder.afterDone = f }

// SetRecordRemoveFault makes f fail the removals of commit records a failed try made (nil: it
// lets them run); only before Start.
func (r *Replicator) SetRecordRemoveFault(f func(dir string) error) {
	r.recorder.removeAll = func(dir string) error {
		if err := f(dir); err != nil {
			return err
		}
		return os.RemoveAll(dir)
	}
}

// SetShape records (in ShapeFile) the shape of the job whose steps the spool holds from now
// on, keeping its timeline, for the tests of the shape record; the agent records it with the
// restore (SetShapeRestored). A record that cannot be written (a full spool) is removed: the
// shape is then unknown, never a stale one.
func (s *Spool) SetShape(shape Shape) error {
	s.ownerMu.Lock()
	defer s.ownerMu.Unlock()
	if s.shape == shape && s.shapeJob == s.owner.Job {
		return nil
	}
	tl := s.timeline
	if s.shapeJob != s.owner.Job {
		tl = Timeline{} // another job's
	}
	if err := s.writeShapeLocked(shape, tl); err != nil {
		return fmt.Errorf("record the job's shape: %w", err)
	}
	return nil
}

// HoldFDReserve takes the descriptor reserve's turn, as a write running on the released reserve
// does, until the returned function is called.
func (r *Replicator) HoldFDReserve() (release func()) {
	r.node.fds.use.Lock()
	return r.node.fds.use.Unlock
}

// SetFetchRetryWithin sets how quickly a failed peer fetch that moved nothing must fail to be
// tried again (peerFetchRetryWithin by default).
func (r *Replicator) SetFetchRetryWithin(d time.Duration) {
	r.handshake.restorer.fetchRetryWithin.Store(int64(d))
}

// TransferDetail is transferDetail, for the package's external tests.
var TransferDetail = transferDetail

// SetSyncerPopHook makes f run as the syncer takes each sealed step (restored: queued by a
// restore), before it pushes or syncs it; only before Start.
func (r *Replicator) SetSyncerPopHook(f func(step int64, restored bool)) { r.syncer.popHook = f }

// SetAfterPublish makes f run once each commit's data has its name in the namespace, before the
// commit stops counting as pending; only before Start.
func (r *Replicator) SetAfterPublish(f func(step int64)) { r.sealer.afterPublish = f }

// ReportLine reports msg to the job of the current incarnation (fatal: in replicator.failed),
// or, with job set, as a line of that job (rank 0 of 1).
func (r *Replicator) ReportLine(job, msg string, fatal bool) {
	cfg := r.incs.get().Config
	if job != "" {
		cfg = &Config{JobName: job, NodeRank: 0, Nodes: 1}
	}
	if fatal {
		r.lines.failLine(cfg, msg)
		return
	}
	r.lines.errLine(cfg, msg)
}

// SyncedCommitted is the newest step this node took to its sync with the coordinator (what
// status said was committed before it counted the steps sealed here), -1: none.
func (r *Replicator) SyncedCommitted() int64 {
	committed, _, _ := r.incs.latest()
	return committed
}

// SetSyncLineAfter sets how long a sync waits before the job is told (syncLineAfter).
func (r *Replicator) SetSyncLineAfter(d time.Duration) { r.syncer.lineAfter.Store(int64(d)) }

// SetSupersededAfter sets how long a current incarnation the coordinator does not serve waits
// before it is marked superseded (supersededAfter).
func (r *Replicator) SetSupersededAfter(d time.Duration) { r.node.supersededWait.Store(int64(d)) }
