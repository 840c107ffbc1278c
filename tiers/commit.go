package tiers

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mtcfs/mtcfs/layout"
)

// A commit is recorded in the spool before the job's commit signal returns (SPEC §10): the
// rename of a step directory, or the close of a pytorch .save, waits until the committed tree is
// frozen in the namespace and hard-linked into spool/commits/<id>/data, and commit.json says
// what it is. From then on the step survives a crash of the agent: the sealer turns the record
// into sealed data and a .meta in the background, and an agent that finds records left by its
// predecessor (adoptRecords) seals them before anything else.
//
// Layout of one record, spool/commits/<seq>-<rand>/ (seq orders records by commit time):
//
//	data          the committed tree (or file), hard links to the job's bytes
//	data.attrs    the owners and modes of its entries (layout.Attrs), moved with it
//	commit.json   commitRecord; written last, atomically: a record without it is incomplete
//	sealed-as     the data name, written once hashed and before data is moved to spool/sealed

const (
	commitsDir       = "commits"
	commitDataName   = "data"
	commitRecordName = "commit.json"
	commitSealedAs   = "sealed-as"
)

// commit is a step that the job finished for one worker; name is its top-level name.
type commit struct {
	inc    *incarnation
	step   int64
	worker int
	name   string
	group  string // the name the step was saved under before the rename that committed it
	at     time.Time
	wall   time.Time // at, by the machine's clock (at may be a test's): retries are bounded by it
	dir    string    // the record in spool/commits
	sealed SealInfo  // what Seal did
	// attrsErr says why the owners and modes were not kept (nil: kept); the sealer tells the job.
	attrsErr error
	// atClose: committed by closing a .save; a duplicate of that descriptor, or a mapping of
	// the file, could still write, so the sealed data is not trusted without a hash check.
	atClose bool
	// duringRestore: committed while the incarnation's restore ran (the job did not wait for its
	// markers); a commit after it ends the restored step's use (incarnation.inUse).
	duringRestore bool
	// syncData names the node's data of the step, by worker, for its sync (SyncReport.Data).
	syncData string
}

// commitRecord is commit.json: enough to name the step's .meta after a crash.
type commitRecord struct {
	Job         string    `json:"job"`
	Incarnation string    `json:"incarnation"`
	Rank        int       `json:"rank"`
	Worker      int       `json:"worker"`
	Step        int64     `json:"step"`
	Name        string    `json:"name"`
	At          time.Time `json:"at"`
}

func (rec commitRecord) meta() string {
	return layout.MarkerName{Job: rec.Job, Step: rec.Step, Node: rec.Rank, Worker: rec.Worker, Kind: layout.MarkerMeta}.String()
}

var commitSeq atomic.Uint64

// commitRecorder records the job's commits (SPEC §3) in the spool, on the job's own request,
// and queues them for the sealer. It remembers which top-level names wait for sealing: those
// are neither recorded twice nor cleaned from the namespace, and a restore waits for them.
type commitRecorder struct {
	*node
	incs  *incarnations
	out   *fifo[pendingCommit] // to the sealer
	lines *jobLines            // a misnamed .save is reported to the job
	mu    sync.Mutex
	// misnamed holds the names of the misnamed .save files reported in the incarnation
	// misnamedInc, so that each is reported once per incarnation however often it is closed;
	// a new incarnation starts it afresh (it held one entry per step of a misnamed job, forever).
	misnamed    map[string]bool // GUARDED_BY(mu)
	misnamedInc string          // GUARDED_BY(mu)
	// madeDirs holds the step directories made (mkdir) in misnamedInc and told of at the first
	// file the job writes in them (noteWrittenIn): one made empty and then replaced by a rename
	// onto it commits, and was told as no commit first (a black-box run).
	madeDirs map[string]bool // GUARDED_BY(mu)
	pending  map[string]int  // GUARDED_BY(mu); top-level names recorded and not sealed yet: how many commits of each
	// sealed is closed (and replaced) whenever a name leaves pending.
	sealed chan struct{} // GUARDED_BY(mu)
	// unanswered counts the commits made while no job was answered (no incarnation), for the
	// log: 1, then every 100th. countedUnanswered holds the names counted (forgotten past 1024):
	// a .save is reported at its flush and again at its close, and is one commit.
	unanswered        int             // GUARDED_BY(mu)
	countedUnanswered map[string]bool // GUARDED_BY(mu)
	// kept holds the records a seal could not hash for a shortage, by directory (keep).
	kept map[string]keptRecord // GUARDED_BY(mu)
	// triesLeft are records of failed tries that could not be removed yet (dropTry).
	triesLeft []string // GUARDED_BY(mu)
	// removeAll is os.RemoveAll, or a test's.
	removeAll func(string) error
	// afterDone, when set (tests), runs at the end of done: whatever the sealer does after done
	// comes too late for a restore that waited for the commit.
	afterDone func(name string)
}

func newCommitRecorder(n *node, incs *incarnations, out *fifo[pendingCommit], lines *jobLines) *commitRecorder {
	return &commitRecorder{node: n, incs: incs, out: out, lines: lines, pending: map[string]int{}, sealed: make(chan struct{}), removeAll: os.RemoveAll}
}

// whyNotOurs says why a .save the job wrote is not a commit of this node ("" when it is one):
// another job's name, another node's rank, or a worker outside workers-per-node. Such a file
// stays a plain file; its step is never checkpointed.
func whyNotOurs(cfg *Config, m layout.MarkerName) string {
	switch {
	case m.Job != cfg.JobName:
		return fmt.Sprintf("job %q is not this job (job-name %q)", m.Job, cfg.JobName)
	case m.Node != cfg.NodeRank:
		return fmt.Sprintf("node %d is not this node (node-rank %d)", m.Node, cfg.NodeRank)
	case m.Worker >= cfg.WorkersPerNode:
		return fmt.Sprintf("worker %d is outside workers-per-node %d", m.Worker, cfg.WorkersPerNode)
	}
	return ""
}

// noteMisnamed tells the job, once per incarnation and name, that the .save ev names is not a
// commit of this node (whyNotOurs), or that a directory renamed to digits is no step name (a
// leading zero, past int64, or negative). It runs on the control loop, never on a FUSE request: it
// writes replicator.errors.
func (cr *commitRecorder) noteMisnamed(ev event) {
	inc := cr.incs.get()
	if inc == nil || strings.Contains(ev.path, "/") {
		return
	}
	cfg := inc.Config
	var why string
	switch {
	case cfg.Framework != FrameworkPyTorch && ev.kind == evCreated && ev.typ == layout.EntryDir:
		if _, ok := layout.ParseStepDir(ev.path); !ok {
			return
		}
		// A copy (mv across file systems, cp -r) makes the directory: its bytes looked saved,
		// Orbax listed the step, and the job's next start removed it as the stale directory
		// it is (SPEC §2), without a word (found by a black-box run).
		why = "a directory made under a step's name (mkdir, or a copy such as cp -r or mv from another file system) is not a commit: only a directory renamed onto the step's name commits it (make it as " +
			ev.path + layout.OrbaxTmpSuffix + ", then rename it to " + ev.path + "); the job's next start removes it"
		if !ev.filled {
			cr.mu.Lock()
			cr.forInc(inc)
			cr.madeDirs[ev.path] = true
			cr.mu.Unlock()
			return
		}
	case cfg.Framework == FrameworkPyTorch && ev.kind == evCreated && ev.typ == layout.EntryDir && ownSave(cfg, ev.path):
		// A .save directory made in place (mkdir, then filled) looked saved, and the job's next
		// start restored the step before without a word (found by a black-box run).
		why = "a directory made under a .save name (mkdir, or a copy such as cp -r) is not a commit: a .save directory commits when it is renamed into place (make it under another name, then rename it to " +
			ev.path + "); the job's next start removes it"
		if !ev.filled { // told once a file is written in it: one made empty may be renamed onto
			cr.mu.Lock()
			cr.forInc(inc)
			cr.madeDirs[ev.path] = true
			cr.mu.Unlock()
			return
		}
	case cfg.Framework != FrameworkPyTorch && ev.kind == evRenamed && ev.typ == layout.EntryFile:
		// Orbax lists steps following symlinks, and a file under a step's name looked saved
		// (black-box h59). A symlink renamed there is the restore marker Orbax takes (SPEC §9).
		if _, ok := layout.ParseStepDir(ev.path); !ok {
			return
		}
		why = "a step is a directory renamed onto its step's name; a file renamed there is not a commit, and the job's next start removes it"
	case cfg.Framework != FrameworkPyTorch:
		if ev.kind != evRenamed || ev.typ != layout.EntryDir {
			return
		}
		digits, negative := strings.CutPrefix(ev.path, "-")
		if digits == "" || strings.Trim(digits, "0123456789") != "" {
			return
		}
		if _, ok := layout.ParseStepDir(ev.path); ok {
			return
		}
		why = fmt.Sprintf("a step directory is named by its step in decimal, without leading zeros, at most %d", int64(math.MaxInt64))
		if negative {
			// NeMo commits global step g as g-1: its save at global step 0 is renamed to -1, and
			// was dropped at the next start without a word (found by a black-box run).
			why = "a step is not negative"
			if cfg.Framework == FrameworkPyTorchDistributed {
				why += " (NeMo's save at global step 0 is renamed to -1; NeMo restores its saves from global step 2 on)"
			}
		}
	default:
		m, ok := layout.ParseMarkerName(ev.path)
		if !ok || m.Kind != layout.MarkerSave {
			return
		}
		if why = whyNotOurs(cfg, m); why == "" {
			return
		}
		why += fmt.Sprintf("; this node commits %s-s<step>-n%d-w<worker below %d>.save", cfg.JobName, cfg.NodeRank, cfg.WorkersPerNode)
	}
	// A .save committed at its flush under the incarnation before (a new replicator.yaml that
	// changed the job's shape came before its close was handled) waits for sealing or was
	// sealed, which takes its name away; a misnamed one stays a plain file under its name.
	cr.mu.Lock()
	cr.forInc(inc)
	pending, seen := cr.pending[ev.path] > 0, cr.misnamed[ev.path]
	cr.mu.Unlock()
	if pending || seen || !cr.hasName(ev.path) {
		return
	}
	cr.mu.Lock()
	seen = cr.misnamed[ev.path]
	cr.misnamed[ev.path] = true
	cr.mu.Unlock()
	if seen {
		return
	}
	cr.lines.incLine(inc, fmt.Sprintf("%s is not committed (its step is not checkpointed): %s", ev.path, why))
}

// ownSave reports whether name is a .save this node commits for cfg.
func ownSave(cfg *Config, name string) bool {
	m, ok := layout.ParseMarkerName(name)
	return ok && m.Kind == layout.MarkerSave && whyNotOurs(cfg, m) == ""
}

// forInc starts misnamed and madeDirs afresh for a new incarnation inc.
func (cr *commitRecorder) forInc(inc *incarnation) { // REQUIRES(mu)
	if cr.misnamedInc != inc.ID {
		cr.misnamed, cr.madeDirs, cr.misnamedInc = map[string]bool{}, map[string]bool{}, inc.ID
	}
}

// noteWrittenIn is told of each file the job closed below the top-level name dir: a step
// directory it made gets the line of noteMisnamed now, a copy being written into it.
func (cr *commitRecorder) noteWrittenIn(dir string) {
	if _, ok := layout.ParseStepDir(dir); !ok && !strings.HasSuffix(dir, ".save") {
		return // most closes (under S.orbax-checkpoint-tmp): no lock on the control loop for them
	}
	inc := cr.incs.get()
	if inc == nil {
		return
	}
	cr.mu.Lock()
	cr.forInc(inc)
	made := cr.madeDirs[dir]
	delete(cr.madeDirs, dir)
	cr.mu.Unlock()
	if made {
		cr.noteMisnamed(event{kind: evCreated, typ: layout.EntryDir, path: dir, filled: true})
	}
}

// commitOf recognises the commit signals of SPEC §3 for inc: a directory renamed to a bare
// decimal (Orbax, NeMo), or for framework pytorch a .save of this node closed after writing,
// renamed in or linked in.
func (cr *commitRecorder) commitOf(inc *incarnation, ev event) (commit, bool) {
	cfg := inc.Config
	c := commit{inc: inc, name: ev.path, at: cr.now(), wall: time.Now(), duringRestore: inc.restoring()}
	switch {
	case strings.Contains(ev.path, "/"):
		return c, false
	case cfg.Framework != FrameworkPyTorch && ev.kind == evRenamed && ev.typ == layout.EntryDir:
		step, ok := layout.ParseStepDir(ev.path)
		if !ok {
			return c, false
		}
		c.step, c.group = step, ev.old
	case cfg.Framework == FrameworkPyTorch && (ev.kind == evClosed || ev.kind == evRenamed ||
		(ev.kind == evCreated && ev.typ == layout.EntryFile)):
		m, ok := layout.ParseMarkerName(ev.path)
		if !ok || m.Kind != layout.MarkerSave {
			return c, false
		}
		if whyNotOurs(cfg, m) != "" {
			return c, false // noteMisnamed tells the job
		}
		c.step, c.worker = m.Step, m.Worker
	default:
		return c, false
	}
	return c, true
}

// record records the commit ev signals, if it is one, before returning: it may run on the FUSE
// request of the commit itself. Failures are reported by the sealer, off this goroutine.
func (cr *commitRecorder) record(ev event) {
	mark := cr.yield.openMark() // the save this commit ends; its sealer yields to a next one
	inc := cr.incs.get()
	if inc == nil {
		cr.noteUnanswered(ev)
		return
	}
	c, ok := cr.commitOf(inc, ev)
	if !ok {
		return
	}
	c.atClose = ev.kind == evClosed
	cr.mu.Lock()
	if cr.pending[c.name] > 0 && ev.kind == evClosed && !ev.fresh {
		// A close after the flush or rename of the same .save. Only a close: a rename (or a
		// link) onto the name is a commit of its own, also while the last one of that name
		// is pending (its tree sealed away, its .meta not yet published). An Orbax step
		// renamed to S again a few ms after the first commit of S was passed over as one, and
		// the first save restored in every tier (a black-box run: 7 of 24 tries).
		cr.mu.Unlock()
		return
	}
	cr.pending[c.name]++
	cr.mu.Unlock()
	inc.earlyCommitted(c.group)
	err := cr.writeCommitRecord(&c, true)
	if errors.Is(err, os.ErrNotExist) && ev.kind == evClosed {
		// The release of a .save that was already committed (and sealed) at its flush.
		cr.done(c.name)
		return
	}
	if err == nil {
		cr.log.Info("step committed", "step", c.step, "worker", c.worker, "name", c.name)
		cr.metrics.committed()
	} else {
		cr.log.Warn("step committed, its commit record not written yet", "step", c.step, "worker", c.worker, "name", c.name, "err", err)
	}
	cr.out.push(pendingCommit{commit: c, err: err, openMark: mark})
}

// noteUnanswered logs a step committed while the agent answered no job since it started: an
// agent upgraded under a running job whose predecessor recorded no incarnation (an earlier
// version) took the job's saves for 11 minutes without a word, and the job's restart lost them
// (found by a black-box run of a rolling upgrade).
func (cr *commitRecorder) noteUnanswered(ev event) {
	step := ""
	switch {
	case strings.Contains(ev.path, "/"):
		return
	case ev.kind == evRenamed && ev.typ == layout.EntryDir:
		if s, ok := layout.ParseStepDir(ev.path); ok {
			step = strconv.FormatInt(s, 10)
		}
	case ev.kind == evClosed || ev.kind == evRenamed:
		if m, ok := layout.ParseMarkerName(ev.path); ok && m.Kind == layout.MarkerSave {
			step = strconv.FormatInt(m.Step, 10)
		}
	}
	if step == "" {
		return
	}
	cr.mu.Lock()
	if cr.countedUnanswered[ev.path] {
		cr.mu.Unlock()
		return
	}
	if cr.countedUnanswered == nil || len(cr.countedUnanswered) >= 1024 {
		cr.countedUnanswered = map[string]bool{}
	}
	cr.countedUnanswered[ev.path] = true
	cr.unanswered++
	n := cr.unanswered
	cr.mu.Unlock()
	if n == 1 || n%100 == 0 {
		cr.log.Warn("a step was committed while this agent answers no job (no replicator.yaml since it started): it is not checkpointed; the job must restart to be checkpointed again",
			"name", ev.path, "step", step, "unanswered_commits", n)
	}
}

// writeCommitRecord freezes and links the committed tree into a new record and writes its
// commit.json.
//
// inRequest: it runs on the FUSE request of the job's rename (or flush), which must not wait
// for the descriptor reserve (fdReserve.tryRetry) nor remove the records of failed tries: a
// failed record is left to the sealer's tries, which remove it (dropTry).
func (cr *commitRecorder) writeCommitRecord(c *commit, inRequest bool) error {
	retry := cr.fds.retry
	if inRequest {
		retry = cr.fds.tryRetry
	}
	c.attrsErr = nil // a try before may have failed where this one does not
	cr.spool.FillHeadroom()
	root := cr.spoolDir(commitsDir)
	if err := os.MkdirAll(root, 0o700); err != nil {
		return err
	}
	c.dir = filepath.Join(root, fmt.Sprintf("%020d-%s", uint64(c.at.UnixNano())+commitSeq.Add(1), randomID()))
	if err := os.Mkdir(c.dir, 0o700); err != nil {
		return err
	}
	dst := filepath.Join(c.dir, commitDataName)
	err := retry(func() (err error) {
		os.RemoveAll(dst) // what a try cut short by the descriptors left
		c.sealed, err = cr.ns.Seal(c.name, dst)
		return err
	})
	if err == nil {
		// Before commit.json: part of the record. Too large, or no room left for them (a spool at
		// its budget), the step is sealed without them (it restores with the agent's owners
		// and modes) rather than not at all.
		if err := cr.withRoomWith(func() error { return layout.WriteAttrs(dst, c.sealed.Attrs) }, retry); err != nil {
			cr.log.Warn("the step's owners and modes are not kept", "step", c.step, "worker", c.worker, "err", err)
			c.attrsErr = err
		}
	}
	if err != nil {
		cr.failedTry(c.dir, inRequest)
		return err
	}
	cfg := c.inc.Config
	rec := commitRecord{Job: cfg.JobName, Incarnation: c.inc.ID, Rank: cfg.NodeRank, Worker: c.worker, Step: c.step, Name: c.name, At: c.at.UTC()}
	data, _ := json.Marshal(rec)
	if err := cr.withRoomWith(func() error { return layout.WriteFileAtomic(filepath.Join(c.dir, commitRecordName), data) }, retry); err != nil {
		cr.failedTry(c.dir, inRequest)
		return err
	}
	return nil
}

// failedTry removes the record dir of a failed try (dropTry), or, on the job's request, leaves it
// to the sealer's next dropTry: every failed record reaches the sealer, which tries it again,
// and removes what failed tries left before each try and after the commit is done (the
// removal opens directories, which a shortage of descriptors also lacks, and waits for the
// descriptor reserve).
func (cr *commitRecorder) failedTry(dir string, inRequest bool) {
	cr.mu.Lock()
	cr.triesLeft = append(cr.triesLeft, dir)
	cr.mu.Unlock()
	if !inRequest {
		cr.dropTry()
	}
}

// dropTry removes the record dirs failed tries left (failedTry); the sealer calls it before each
// try and after each commit. The descriptors a try lacked are lacking for os.RemoveAll too,
// which opens the directories it empties: it runs with the reserve, and a record it still cannot
// remove is removed by the next dropTry. Each try left one before, holding links to the step's
// bytes until the agent's restart (a black-box run: 30 records after the give-up).
func (cr *commitRecorder) dropTry() {
	cr.mu.Lock()
	dirs := cr.triesLeft
	cr.triesLeft = nil
	cr.mu.Unlock()
	var left []string
	var err error
	for _, d := range dirs {
		if e := cr.fds.retry(func() error { return cr.removeAll(d) }); e != nil {
			left, err = append(left, d), e
		}
	}
	if len(left) > 0 {
		cr.log.Warn("the records of failed tries could not be removed yet: a later try removes them", "records", len(left), "err", err)
		cr.mu.Lock()
		cr.triesLeft = append(cr.triesLeft, left...)
		cr.mu.Unlock()
	}
}

// done forgets that name waits for sealing and wakes waitSealed.
func (cr *commitRecorder) done(name string) {
	cr.mu.Lock()
	if cr.pending[name]--; cr.pending[name] <= 0 {
		delete(cr.pending, name)
	}
	close(cr.sealed)
	cr.sealed = make(chan struct{})
	cr.mu.Unlock()
	if cr.afterDone != nil {
		cr.afterDone(name)
	}
}

// waitSealed returns once no commit waits for sealing, or ctx ends.
func (cr *commitRecorder) waitSealed(ctx context.Context) error {
	for {
		cr.mu.Lock()
		n, changed := len(cr.pending), cr.sealed
		cr.mu.Unlock()
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

// pendingNames returns the top-level names waiting for sealing.
func (cr *commitRecorder) pendingNames() map[string]bool {
	cr.mu.Lock()
	defer cr.mu.Unlock()
	names := make(map[string]bool, len(cr.pending))
	for name := range cr.pending {
		names[name] = true
	}
	return names
}

// adoptRecords seals the commits a previous agent recorded but did not seal (it was killed or
// stopped first): each becomes sealed data with its .meta in the spool, in commit order, before
// adoption publishes what the spool holds. A record without commit.json was not complete when
// the job's rename could have returned, and is dropped. It runs at Start, before any other
// stage; a record it cannot seal goes to report, for the next handshake.
//
// Of the records of one slot's step (one kept by an agent that could not hash it, and one of
// the job's commit of the step again since), only the newest is sealed; and a .meta sealed since
// a record was made wins over it, by the .meta's time before adoption wrote any (a review:
// sealed in name order, the older record's new .meta made the newer record look older).
func (cr *commitRecorder) adoptRecords(report func(string)) error {
	root := cr.spoolDir(commitsDir)
	ents, err := os.ReadDir(root)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	sort.Slice(ents, func(i, j int) bool { return ents[i].Name() < ents[j].Name() })
	type found struct {
		dir string
		rec commitRecord
	}
	var recs []found
	newest := map[string]time.Time{}   // .meta name → its newest record's commit time
	metaTime := map[string]time.Time{} // .meta name → the time of the .meta sealed before
	for _, e := range ents {
		dir := filepath.Join(root, e.Name())
		rec, ok, err := readRecord(dir)
		if err != nil {
			cr.log.Error("a commit recorded by the previous agent could not be sealed", "record", dir, "err", err)
			cr.metrics.error(errKindSeal)
			if retryableSeal(err) {
				report(fmt.Sprintf("a step committed before the agent restarted could not be read: %v; its record is kept in the spool for the agent's next start", err))
				continue
			}
			report(fmt.Sprintf("a step committed before the agent restarted could not be sealed: %v", err))
		}
		if !ok {
			if err := dropRecord(dir); err != nil {
				return err
			}
			continue
		}
		m := rec.meta()
		recs = append(recs, found{dir, rec})
		if t, seen := newest[m]; !seen || rec.At.After(t) {
			newest[m] = rec.At
		}
		if fi, err := os.Stat(cr.spoolDir("meta", m)); err == nil {
			metaTime[m] = fi.ModTime()
		}
	}
	for _, f := range recs {
		rec, m := f.rec, f.rec.meta()
		var err error
		switch {
		case rec.At.Before(newest[m]):
			cr.log.Warn("a commit record older than another of the same step is dropped", "step", rec.Step, "worker", rec.Worker, "job", rec.Job, "committed", rec.At)
		case metaTime[m].After(rec.At):
			// A newer commit of the same step, sealed since this record was left (by an agent
			// that could not seal it, which went on serving): that one wins, as a newer commit
			// does (found by a review: the old record replaced it at the next start).
			cr.log.Warn("a commit record older than the sealed step of the same name is dropped", "step", rec.Step, "worker", rec.Worker, "job", rec.Job, "committed", rec.At)
		default:
			err = cr.sealRecord(f.dir, rec)
		}
		if err != nil {
			cr.log.Error("a commit recorded by the previous agent could not be sealed", "record", f.dir, "err", err)
			cr.metrics.error(errKindSeal)
			if retryableSeal(err) && errors.As(err, new(hashError)) {
				// A shortage that may pass, before the data moved: the record stays for the
				// next start rather than lose the step (the job's rename returned). Once the
				// data moved, adoption would free it as unnamed (a review): it is dropped.
				cr.keep(f.dir, rec.Job, rec.Incarnation, rec.Step)
				report(fmt.Sprintf("a step committed before the agent restarted could not be sealed: %v; its record is kept in the spool for the agent's next start, "+
					"but a restore of the job before that continues from an older step and drops it", err))
				continue
			}
			report(fmt.Sprintf("a step committed before the agent restarted could not be sealed: %v", err))
		}
		if err := dropRecord(f.dir); err != nil {
			return err
		}
	}
	return nil
}

// readRecord reads the commit.json of the record at dir; ok is false when it has none (it was
// not complete: the commit never returned) or it is bad (err says why).
func readRecord(dir string) (rec commitRecord, ok bool, err error) {
	raw, err := os.ReadFile(filepath.Join(dir, commitRecordName))
	if errors.Is(err, os.ErrNotExist) {
		return rec, false, nil
	}
	if err != nil {
		return rec, false, err
	}
	if err := json.Unmarshal(raw, &rec); err != nil || layout.ValidateJobName(rec.Job) != nil {
		return rec, false, fmt.Errorf("%s: bad record %q", commitRecordName, raw)
	}
	return rec, true, nil
}

// sealRecord seals the record at dir of rec into spool/sealed, with its .meta in spool/meta, in
// the headroom if need be: a step that filled the budget to the last page was lost to a kill -9
// before its seal, its record's notes finding no room (found by a black-box run).
func (cr *commitRecorder) sealRecord(dir string, rec commitRecord) error {
	if data := filepath.Join(dir, commitDataName); isRegular(data) {
		// A .save: its bytes may still be written through a descriptor the job kept after the
		// close that committed it (a dup, a forked child, a mapping). With passthrough those
		// writes go on after the agent that linked the bytes died, into the record: a step
		// adopted after a kill -9 changed under its hash (a test like a user's). A copy of its
		// own is sealed instead; without room for it, the record as it is.
		if err := cr.withRoom(func() error { return copyOver(data) }); err != nil {
			cr.log.Warn("a .save committed before the restart is sealed without a copy of its own: a descriptor the job kept after its close could still change it", "step", rec.Step, "worker", rec.Worker, "err", err)
		}
	}
	var dataName string
	err := cr.withRoom(func() (err error) {
		dataName, err = cr.hashCommit(context.Background(), dir, rec.Step) // before anything runs: nothing to yield to
		if err != nil {
			err = hashError{err}
		}
		return err
	})
	if err == nil {
		_, err = moveRecord(dir, cr.spoolDir("sealed", dataName))
	}
	// Adoption verifies it again like every .meta it finds; nothing to mark here.
	if err != nil {
		return fmt.Errorf("step %d of job %s: %w", rec.Step, rec.Job, err)
	}
	if err := cr.withRoom(func() error {
		return layout.WriteFileAtomic(cr.spoolDir("meta", rec.meta()), []byte(strings.TrimSuffix(dataName, ".data")))
	}); err != nil {
		return err
	}
	cr.log.Info("sealed a step committed before the restart", "step", rec.Step, "worker", rec.Worker, "job", rec.Job, "data", dataName)
	return nil
}

// keep notes the record at dir, of step of job, committed by incarnation inc, that a seal could
// not hash for a shortage: it stays in the spool for the agent's next start, unless the job's
// restore abandons its step first (dropKept).
func (cr *commitRecorder) keep(dir, job, inc string, step int64) {
	cr.mu.Lock()
	defer cr.mu.Unlock()
	if cr.kept == nil {
		cr.kept = map[string]keptRecord{}
	}
	cr.kept[dir] = keptRecord{job, inc, step}
}

type keptRecord struct {
	job, inc string
	step     int64
}

// dropKept drops the kept records of incarnations of job other than restoring whose step abandon
// says the job's restore abandons, and returns their steps: their step is of the timeline the
// job left (as dropAbandonedSteps drops .meta entries), and their bytes took RAM no retention
// could free (a review). The restoring incarnation's own commits (the job saved while its
// restore waited) are of no timeline it left: they stay.
func (cr *commitRecorder) dropKept(job, restoring string, abandon func(step int64) bool) (steps []int64) {
	cr.mu.Lock()
	var dirs []string
	for dir, k := range cr.kept {
		if k.job == job && k.inc != restoring && abandon(k.step) {
			dirs, steps = append(dirs, dir), append(steps, k.step)
			delete(cr.kept, dir)
		}
	}
	cr.mu.Unlock()
	for _, dir := range dirs {
		if err := dropRecord(dir); err != nil {
			cr.log.Error("drop a kept commit record", "record", dir, "err", err)
		}
	}
	return steps
}

// dropRecord removes a commit record that has served: commit.json first, so that a record cut
// short by a crash is an incomplete one (ignored), never one that lost its data.
func dropRecord(dir string) error {
	if err := os.Remove(filepath.Join(dir, commitRecordName)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return os.RemoveAll(dir)
}

// hashRecord returns the data name of the record at dir: the one noted in sealed-as once the
// data was hashed (the data may since have moved into spool/sealed, or be half removed as a
// duplicate: it is never hashed again), else the hash of its data, noted in sealed-as first.
func hashRecord(ctx context.Context, dir string, digests *layout.DigestCache) (string, error) {
	data := filepath.Join(dir, commitDataName)
	if raw, err := os.ReadFile(filepath.Join(dir, commitSealedAs)); err == nil {
		if name := string(raw); layout.IsDataName(name) {
			return name, nil
		}
		return "", fmt.Errorf("%s: bad data name %q", commitSealedAs, raw)
	} else if !errors.Is(err, os.ErrNotExist) {
		return "", err
	}
	if _, err := os.Lstat(data); errors.Is(err, os.ErrNotExist) {
		return "", errors.New("the record holds neither data nor a sealed name")
	}
	hash, isDir, err := layout.HashDataCached(ctx, data, digests)
	if err != nil {
		return "", err
	}
	name := layout.DataName(hash, isDir)
	return name, layout.WriteFileAtomic(filepath.Join(dir, commitSealedAs), []byte(name))
}

// moveRecord moves the data of the record at dir to sealed (its place in spool/sealed); dup
// says the same content was there already (the record's copy is dropped). Callers run it
// inside retention.publish, unless nothing else runs yet (adoption).
func moveRecord(dir, sealed string) (dup bool, err error) {
	data := filepath.Join(dir, commitDataName)
	if _, err := os.Lstat(data); errors.Is(err, os.ErrNotExist) {
		_, err := os.Lstat(sealed) // moved before a crash
		return false, err
	}
	return moveData(data, sealed)
}

// moveData moves the data at src, with the owners and modes kept beside it
// (layout.RenameWithAttrs: adoption removes the orphans a crash may leave), to sealed, its place
// in spool/sealed; dup says the same content was there already (src is dropped; its attrs are
// taken only if sealed has none).
func moveData(src, sealed string) (dup bool, err error) {
	if _, err := os.Lstat(sealed); err == nil {
		if _, err := os.Lstat(layout.AttrsFile(sealed)); errors.Is(err, os.ErrNotExist) {
			os.Rename(layout.AttrsFile(src), layout.AttrsFile(sealed))
		}
		os.Remove(layout.AttrsFile(src))
		return true, os.RemoveAll(src)
	}
	return false, layout.RenameWithAttrs(src, sealed)
}

// isRegular reports whether p is a regular file (not following a symlink).
func isRegular(p string) bool {
	fi, err := os.Lstat(p)
	return err == nil && fi.Mode().IsRegular()
}
