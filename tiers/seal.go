package tiers

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/mtcfs/mtcfs/layout"
)

// sealer seals recorded commits in order (SPEC §3) and hands each sealed step to the syncer.
// Its goroutine (run) uses no cancellable context: a committed step is sealed even when the
// incarnation that committed it is over or the agent is stopping (what it cannot finish stays
// recorded in the spool for the next agent). It ends once its queue is closed and drained.
type sealer struct {
	*node
	in        *fifo[pendingCommit] // from the recorder
	out       *fifo[sealedStep]    // to the syncer
	recorder  *commitRecorder      // told when a name is sealed
	retention *retention           // publishes the data and its .meta
	incs      *incarnations
	lines     *jobLines
	// beforeSeal is ReplicatorConfig.BeforeSeal (nil: none).
	beforeSeal func(step int64)
	// afterPublish, when set (tests, before Start), runs once a commit's data has its name in
	// the namespace, before the commit stops counting as pending.
	afterPublish func(step int64)
	// backups hears of each step sealed (backupRunner.sealed).
	backups *backupRunner
	// retryFor is how long after its commit a commit is tried again: sealRetryFor, or a test's.
	retryFor atomic.Int64

	mu sync.Mutex
	// lastSealed is the highest step this agent sealed for the incarnation current at the time
	// (-1: none), of job lastSealedJob; a new incarnation of that job does not reset it, another
	// job does.
	lastSealed    int64  // GUARDED_BY(mu)
	lastSealedJob string // GUARDED_BY(mu)
	// trying is the committed step whose record or hash is being tried again (nil: none), for
	// mtcfs status: before, a step in its tries showed nowhere until the give-up (a black-box
	// run).
	trying *SealTryView // GUARDED_BY(mu)
}

// pendingCommit is a recorded commit waiting for the sealer (err: the record failed; openMark:
// the job's newest open for writing when it was recorded, see yielder.waitForNextSave).
type pendingCommit struct {
	commit
	err      error
	openMark int64
}

// sealedStep is a sealed commit waiting for replication and sync, or a restored step to protect
// again (restored: holders are the ranks that held its data in RAM at the restore, which need
// only its .meta).
type sealedStep struct {
	commit
	dataName, meta string
	restored       bool
	holders        []int
	// rePush, when not 0, makes this no step but the tick of a later try of the syncer's
	// pending pushes (syncer.arm).
	rePush uint64
	// restoreDone makes this no step but the news that a restore is done: the syncs that
	// waited for it go (syncer.afterRestore).
	restoreDone bool
}

func (s *sealer) run() {
	defer s.out.close()
	for {
		pc, ok := s.in.pop()
		if !ok {
			return
		}
		c := pc.commit
		err := pc.err
		var dataName, meta string
		if err == nil && s.beforeSeal != nil {
			s.beforeSeal(c.step)
		}
		if err == nil {
			dataName, meta, err = s.seal(&c, pc.openMark)
		}
		if err != nil && (pc.err != nil || errors.As(err, new(hashError))) && retryableSeal(err) {
			dataName, meta, err = s.retry(&c, pc, err)
		}
		kept := err != nil && !errors.Is(err, errRecordedForNext) && errors.As(err, new(hashError)) && retryableSeal(err)
		if kept {
			// Recorded, not hashed, for a shortage: the record stays in the spool (a review).
			// Another error is not expected to pass: the next start drops the record if it
			// fails again. A restore of the job drops it if it abandons its step: known kept
			// before done wakes a restore waiting for the commit (a review: it ran first).
			s.recorder.keep(c.dir, c.inc.Config.JobName, c.inc.ID, c.step)
		}
		s.recorder.done(c.name)
		s.recorder.dropTry() // what failed tries of this commit left
		if errors.Is(err, errRecordedForNext) {
			s.log.Warn("the agent stops before a committed step could be sealed: it is recorded in the spool, and the next agent seals it", "step", c.step, "worker", c.worker)
			continue
		}
		if err != nil {
			s.log.Error("seal failed", "step", c.step, "worker", c.worker, "err", err)
			s.metrics.error(errKindSeal)
			// What it means, and what to do when it is a shortage (a re-run held the agent's
			// descriptors for longer than the tries last: the line said only the error).
			hint := ""
			switch {
			case errors.Is(err, syscall.EROFS):
				hint = " (the spool " + s.spool.Dir() + " is read-only: remount it read-write)"
			case retryableSeal(err):
				hint = " (raise the agent's --memory or descriptor limit, or hold fewer files open)"
			}
			// To the job's incarnation now: one that restarted during the tries restored the
			// step before it and was not told why (a black-box run).
			inc := c.inc
			if cur := s.incs.get(); cur != nil && cur.Config.JobName == inc.Config.JobName {
				inc = cur
			}
			what := "the step is not checkpointed: a restart restores the one before it"
			switch {
			case kept && inc != c.inc:
				what = "the step is not checkpointed: the job's restart restores the one before it" // and drops the record
			case kept:
				what = "its record stays in the spool, and the agent's next start seals it: restart the agent before the job (a job restart on this agent restores the step before it, and drops this one)"
			}
			s.lines.incLine(inc, fmt.Sprintf("sealing step %d (worker %d) failed: %v; %s%s", c.step, c.worker, err, what, hint))
			continue
		}
		s.out.push(sealedStep{commit: c, dataName: dataName, meta: meta})
		s.retention.warnIfFilling(s.lines, c.inc, false)
	}
}

// sealRetries are the waits between the tries of a commit whose record or hashing failed on a
// passing shortage (sealRetryable): some 2 minutes in all. Meanwhile the step stays pending, so
// a restore waits for it.
var sealRetries = func() []time.Duration {
	var d []time.Duration
	for wait, total := 100*time.Millisecond, time.Duration(0); total < sealRetryFor; wait = min(2*wait, 5*time.Second) {
		d = append(d, wait)
		total += wait
	}
	return d
}()

// sealRetryFor is how long after its commit a commit is tried again (see sealRetries).
const sealRetryFor = 2 * time.Minute

// retryableSeal reports whether a commit's record or hash failed on a shortage that passes: open
// files (the job held the agent's descriptors), memory, or the spool's room; or on a spool
// made read-only for a while (`mount -o remount,ro`). A committed step whose record could not be
// written on such an error was dropped, the job's rename having returned: a job restart on the
// same agent, or the agent's, restored the step before (found by a black-box run with a low
// open-file limit; and by one that remounted the spool read-only for a second: both steps the
// job had just committed were lost, its restart told nothing).
func retryableSeal(err error) bool {
	for _, e := range []error{syscall.EMFILE, syscall.ENFILE, syscall.ENOMEM, syscall.ENOSPC, syscall.EAGAIN, syscall.EINTR, syscall.EROFS} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// retry tries again to record (when its record failed: the tree is still frozen under its name in
// the namespace) and seal the commit c, after the waits of sealRetries, until it succeeds, fails
// otherwise, or the agent stops.
func (s *sealer) retry(c *commit, pc pendingCommit, err error) (dataName, meta string, _ error) {
	recorded := pc.err == nil
	// From the commit's time, not this try's: commits that queue behind one that cannot be
	// recorded share its wait, and a restore waiting for them all waits some 2 minutes at most
	// (a review: one after another they added up past the job's 300 s).
	deadline := c.wall.Add(time.Duration(s.retryFor.Load()))
	view := SealTryView{job: c.inc.Config.JobName, Step: c.step, Worker: c.worker, Committed: c.wall, Until: deadline}
	show := func(tries int, err error, recorded bool) {
		v := view
		v.Tries, v.Err, v.Recorded = tries, err.Error(), recorded
		s.mu.Lock()
		s.trying = &v
		s.mu.Unlock()
	}
	defer func() {
		s.mu.Lock()
		s.trying = nil
		s.mu.Unlock()
	}()
	for i, wait := range sealRetries {
		show(i+1, err, recorded)
		if i == 0 || i%10 == 0 {
			s.log.Warn("sealing a committed step failed; trying again", "step", c.step, "worker", c.worker, "err", err, "tries", i+1)
		}
		stopping := false
		select {
		case <-s.ctx.Done():
			stopping = true // one last try: the job's rename returned, and nothing else records it
		case <-time.After(min(wait, max(time.Until(deadline), 0))):
		}
		if !recorded {
			s.recorder.dropTry() // the records of the tries before, if they could not be removed then
			if err = s.recorder.writeCommitRecord(c, false); err != nil {
				if !retryableSeal(err) || stopping || !time.Now().Before(deadline) {
					return "", "", err
				}
				continue
			}
			recorded = true
			s.log.Info("step committed", "step", c.step, "worker", c.worker, "name", c.name, "tries", i+2)
			s.metrics.committed()
		}
		if stopping && recorded {
			// Recorded: the next agent adopts and seals it (hashing waits for nothing now).
			return "", "", errRecordedForNext
		}
		if dataName, meta, err = s.seal(c, pc.openMark); err == nil || !errors.As(err, new(hashError)) || !retryableSeal(err) || stopping {
			return dataName, meta, err
		}
		if !time.Now().Before(deadline) {
			break
		}
	}
	return "", "", err
}

// errRecordedForNext ends the tries of a commit recorded in the spool when the agent stops: the
// next agent seals it (no line for the job, whose step is not lost).
var errRecordedForNext = errors.New("recorded; the next agent seals it")

// hashError is seal's error from hashing the record, before anything of it moved.
type hashError struct{ err error }

func (e hashError) Error() string { return e.err.Error() }
func (e hashError) Unwrap() error { return e.err }

// seal turns a recorded commit into <hash>.data and writes its .meta (SPEC §3). No byte is
// copied: the record's tree is hashed where it is and renamed into spool/sealed, and the
// namespace entry renamed — or, when Seal had to copy files the job still had open for writing,
// replaced by the sealed copy (the job's descriptors keep their detached files).
func (s *sealer) seal(c *commit, openMark int64) (dataName, meta string, err error) {
	cfg := c.inc.Config
	if err := s.copyIfStillOpen(c); err != nil {
		return "", "", hashError{err}
	}
	// The files the early hasher left are hashed here; a next save the job started on a busy
	// node goes first (yield.go). No cancellable context: a committed step is sealed even while
	// the agent stops (its stop ends the waits).
	ctx := layout.WithPacer(context.Background(), func() { s.yield.waitForNextSave(s.ctx, openMark, s.hurry) })
	err = s.withRoom(func() (err error) { dataName, err = s.hashCommit(ctx, c.dir, c.step); return err })
	if err != nil {
		return "", "", hashError{err} // nothing moved yet: it can be tried again
	}
	meta = layout.MarkerName{Job: cfg.JobName, Step: c.step, Node: cfg.NodeRank, Worker: c.worker, Kind: layout.MarkerMeta}.String()
	// Before the .meta is out: a restore of the incarnation dropping the steps above its own
	// must not find it unnoted (a clean-clone CI run: it was noted after).
	c.inc.noteSealedHere(meta)
	err = s.retention.publish(func() error { return s.publish(*c, dataName, meta) })
	if err != nil {
		return "", "", err
	}
	if s.afterPublish != nil {
		s.afterPublish(c.step)
	}
	if !c.duringRestore {
		c.inc.savedAfterRestore(c.step)
	}
	s.tellSealed(*c)
	if s.backups != nil {
		s.backups.sealed(cfg.JobName, c.step, c.worker, strings.TrimSuffix(dataName, ".data"))
	}
	took := s.now().Sub(c.at)
	s.log.Info("step sealed", "step", c.step, "worker", c.worker, "data", dataName, "took", took.String())
	s.metrics.sealed(took.Seconds())
	if s.incs.isCurrent(c.inc) {
		s.mu.Lock()
		if s.lastSealedJob != cfg.JobName {
			s.lastSealed, s.lastSealedJob = -1, cfg.JobName
		}
		s.lastSealed = max(s.lastSealed, c.step)
		s.mu.Unlock()
	}
	return dataName, meta, nil
}

// stillOpenWait is how long after the close that committed a .save the sealer waits for that
// close's RELEASE, before it copies the file (copyIfStillOpen). The RELEASE follows the close at
// once; a loaded machine may take some milliseconds to answer it.
const stillOpenWait = 2 * time.Second

// copyIfStillOpen makes the record's data of c a copy of its own when the descriptor whose close
// committed it is still open after stillOpenWait (SealInfo.OpenAfterCommit): with passthrough,
// writes through a duplicate of it, a forked child or a shared mapping went straight into the
// bytes linked into the record, after (or while) they were hashed. The step's push was then
// refused for ever, its backup listed complete with bytes that fail their name, and a restore
// from it failed: the step was lost in every tier (a black-box run). The copy holds the bytes
// as it read them (a write during the copy may be in it in part): every tier holds that copy,
// hashed after it was made; the namespace entry is then rebuilt from it (Copied).
func (s *sealer) copyIfStillOpen(c *commit) error {
	open := c.sealed.OpenAfterCommit
	if open == nil || !open(max(time.Until(c.wall.Add(stillOpenWait)), 0)) {
		c.sealed.OpenAfterCommit = nil
		return nil
	}
	p := filepath.Join(c.dir, commitDataName)
	if err := s.withRoom(func() error { return copyOver(p) }); err != nil {
		return fmt.Errorf("copy of %s, still open after the close that committed it: %w", c.name, err)
	}
	c.sealed.OpenAfterCommit = nil // decided: a later try hashes the copy
	c.sealed.Copied, c.sealed.CopiedExample, c.sealed.StillOpen = 1, c.name, true
	return nil
}

// copyOver replaces the file at p by a copy of its bytes (copy_file_range on tmpfs: no byte
// enters the Go heap).
func copyOver(p string) error {
	src, err := os.Open(p)
	if err != nil {
		return err
	}
	defer src.Close()
	tmp := p + ".copy"
	os.Remove(tmp) // a try before cut short
	dst, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	_, err = io.Copy(dst, src)
	if cerr := dst.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, p)
	}
	if err != nil {
		os.Remove(tmp)
	}
	return err
}

// hurry reports whether a seal must not yield to the job's next save: another commit waits behind
// it, or the RAM budget is half used. A job saving back to back kept the sealer yielding, its
// committed steps piled up unsealed (retention frees a step only once a newer one is sealed),
// and its next save failed with ENOSPC at a budget of 4 to 12 steps (found by a black-box run).
func (s *sealer) hurry() bool {
	if s.in.has(func(pendingCommit) bool { return true }) {
		return true
	}
	total, used := s.spool.Usage()
	return total > 0 && used*2 >= total
}

// publish moves the record's data into spool/sealed, gives it its name in the namespace and
// writes its .meta; it runs inside retention.publish.
func (s *sealer) publish(c commit, dataName, meta string) error {
	sealed := s.spoolDir("sealed", dataName)
	dup, err := moveRecord(c.dir, sealed)
	if err != nil {
		return err
	}
	if dup && s.retention.earlierOwnStep(c.inc.Config, c.worker, c.step, strings.TrimSuffix(dataName, ".data")) {
		// Only an earlier step of this slot says so: another rank's replica of the same step
		// (identical parts, data parallelism) said it at every save (a black-box run).
		s.lines.incLine(c.inc, fmt.Sprintf("step %d has exactly the content of an earlier checkpoint (%s): training is not making progress", c.step, dataName))
	} else if !dup && !c.atClose {
		s.retention.markVerified(dataName) // hashed just now, and frozen since the commit
	}
	switch {
	case s.hasName(dataName):
		s.ns.Remove(c.name)
	case c.sealed.Copied > 0:
		s.ns.Remove(c.name)
		if err := s.ns.Import(sealed, dataName); err != nil {
			return err
		}
	default:
		if err := s.ns.Rename(c.name, dataName); err != nil {
			// The job (or a new handshake) removed the name meanwhile: the sealed copy is the truth.
			if err := s.ns.Import(sealed, dataName); err != nil && !errors.Is(err, ErrNameTaken) {
				return err
			}
		}
	}
	if err := s.retention.writeMeta(meta, strings.TrimSuffix(dataName, ".data")); err != nil {
		return err
	}
	dropRecord(c.dir) // the .meta is in the spool: the record has served
	return nil
}

// tellSealed tells the job what the sealed step c lacks of what it saved, once it is sealed.
func (s *sealer) tellSealed(c commit) {
	if c.sealed.StillOpen {
		s.log.Warn("a .save was still open after the close that committed it: it was copied as it was then", "step", c.step, "worker", c.worker, "name", c.name)
		s.lines.incLine(c.inc, fmt.Sprintf("step %d: %s was still open when it was sealed, %s or more after the close that committed it (a duplicate of its descriptor, a forked child, or a shared mapping): the checkpoint holds its bytes as they were copied then, not what is written through it afterwards; close (and unmap) every descriptor of a .save before the close that commits it",
			c.step, c.name, stillOpenWait))
	} else if n := c.sealed.Copied; n > 0 {
		// With passthrough the writer never gets an error afterwards: the step looked whole,
		// and restored without what it wrote after the rename, without a word (found by a
		// black-box run).
		s.log.Warn("a step was committed with files still open for writing: they were copied as they were at the commit", "step", c.step, "files", n, "e.g.", c.sealed.CopiedExample)
		s.lines.incLine(c.inc, fmt.Sprintf("step %d was committed with %d file(s) still open for writing (%s): the checkpoint holds their bytes as they were at the commit, not what is written through those descriptors afterwards; close every file of a step before the rename (or close) that commits it",
			c.step, n, c.sealed.CopiedExample))
	}
	if c.attrsErr != nil {
		// In the log only, they were restored as the agent's without a word (found by a
		// black-box run: 32,763 files of a step that filled the budget).
		s.lines.incLine(c.inc, fmt.Sprintf("step %d (worker %d): its owners and modes are not kept (%v): restored, its entries get the agent's (root, files 0644, directories 0755), or the job's user if it runs as another",
			c.step, c.worker, c.attrsErr))
	}
	if n := c.sealed.Xattrs; n > 0 {
		// They were served (--xattrs) but dropped from every tier without a word (found by a
		// black-box run).
		have := fmt.Sprintf("%d entries have", n)
		if n == 1 {
			have = "1 entry has"
		}
		s.lines.incLine(c.inc, fmt.Sprintf("step %d: %s extended attributes, which checkpoints do not keep: restored after an agent restart, from a peer or from a backup, the step has none", c.step, have))
	}
}

// tryingView is the step of job whose seal is being tried again, if any.
func (s *sealer) tryingView(job string) *SealTryView {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.trying == nil || s.trying.job != job {
		return nil
	}
	v := *s.trying
	return &v
}

// dropAbove lowers job's latest sealed step to newest when a restore dropped the steps above it.
func (s *sealer) dropAbove(job string, newest int64) {
	s.mu.Lock()
	if s.lastSealedJob == job && s.lastSealed > newest {
		s.lastSealed = newest
	}
	s.mu.Unlock()
}

// latest returns lastSealed if it is job's, else -1.
func (s *sealer) latest(job string) int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	if job != s.lastSealedJob {
		return -1
	}
	return s.lastSealed
}
