package tiers_test

// Fakes for driving the replicator without FUSE: dirNamespace plays package fs over a plain
// directory, and harness plays the training job, which changes the namespace directory itself
// and then reports the change through the replicator's Events, as package fs would. The backup
// tier is the real one (testStore, store_test.go).

import (
	"context"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/mtcfs/mtcfs/internal/syncbuf"
	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/replication"
	"github.com/mtcfs/mtcfs/tiers"
)

// --- dirNamespace ---------------------------------------------------------------------------

// dirNamespace is a tiers.Namespace over a plain directory. Atomic writes go through a scratch
// directory beside it, so that half-written files never show up in List. The directory, the
// scratch directory and the spool must be on one file system: Export and Import hard-link.
//
// Every call is appended to an operation log ("write replicator.errors", …) so that tests can
// check the order in which the replicator published files, and a hook may block or observe a
// call before it happens (used to open race windows deterministically).
type dirNamespace struct {
	dir     string
	scratch string
	seq     atomic.Int64

	mu   sync.Mutex
	ops  []string              // GUARDED_BY(mu)
	hook func(op, name string) // GUARDED_BY(mu); called before the operation, without mu
	// spoolFiles, when set, makes HoldSpoolFile answer as the mount does, with a path that stays
	// valid when the job renames the file (a hard link in scratch), and then call it with the
	// name asked for, without mu.
	spoolFiles func(name string) // GUARDED_BY(mu)
	// cancelHold, when set, makes the nth HoldSpoolFile of name (from 1) answer with a context
	// already cancelled, as the mount does for a file the job deleted during the read.
	cancelHold func(name string, nth int) bool // GUARDED_BY(mu)
	holdsOf    map[string]int                  // GUARDED_BY(mu); HoldSpoolFile calls by name
	openHolds  atomic.Int64                    // holds not ended yet
	// failImport, when set, may fail an Import of name before it does anything.
	failImport func(name string) error
	// failSeal, when set, may fail a Seal of name before it does anything.
	failSeal func(name string) error
	// failWrite, when set, may fail a WriteFile of name before it does anything; failRead a
	// ReadFile.
	failWrite, failRead func(name string) error
	// sealAttrs, when set, gives the Attrs a Seal of name returns (nil: the top's owner).
	sealAttrs func(name string) *layout.Attrs
}

var _ tiers.Namespace = (*dirNamespace)(nil)

func newDirNamespace(dir string) (*dirNamespace, error) {
	ns := &dirNamespace{dir: dir, scratch: dir + ".scratch"}
	for _, d := range []string{ns.dir, ns.scratch} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, err
		}
	}
	return ns, nil
}

func (ns *dirNamespace) path(name string) string { return filepath.Join(ns.dir, name) }

// record logs an operation and runs the hook.
func (ns *dirNamespace) record(op, name string) {
	ns.mu.Lock()
	ns.ops = append(ns.ops, op+" "+name)
	hook := ns.hook
	ns.mu.Unlock()
	if hook != nil {
		hook(op, name)
	}
}

func (ns *dirNamespace) setHook(h func(op, name string)) {
	ns.mu.Lock()
	ns.hook = h
	ns.mu.Unlock()
}

// opLog returns a copy of the operation log.
func (ns *dirNamespace) opLog() []string {
	ns.mu.Lock()
	defer ns.mu.Unlock()
	return slices.Clone(ns.ops)
}

func (ns *dirNamespace) tmpName() string {
	return filepath.Join(ns.scratch, fmt.Sprintf("t%d", ns.seq.Add(1)))
}

func (ns *dirNamespace) List() ([]tiers.DirEntry, error) {
	ns.record("list", "")
	des, err := os.ReadDir(ns.dir)
	if err != nil {
		return nil, err
	}
	out := make([]tiers.DirEntry, 0, len(des))
	for _, de := range des {
		typ := layout.EntryFile
		switch {
		case de.IsDir():
			typ = layout.EntryDir
		case de.Type()&fs.ModeSymlink != 0:
			typ = layout.EntrySymlink
		}
		out = append(out, tiers.DirEntry{Name: de.Name(), Type: typ})
	}
	return out, nil
}

func (ns *dirNamespace) ReadFile(name string, limit int64) ([]byte, error) {
	ns.record("read", name)
	if ns.failRead != nil {
		if err := ns.failRead(name); err != nil {
			return nil, err
		}
	}
	f, err := os.Open(ns.path(name))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err == nil && int64(len(data)) > limit { // as package fs
		return nil, fmt.Errorf("read %s: larger than %d bytes: %w", name, limit, syscall.EFBIG)
	}
	return data, err
}

func (ns *dirNamespace) WriteFile(name string, data []byte) error {
	ns.record("write", name)
	if ns.failWrite != nil {
		if err := ns.failWrite(name); err != nil {
			return err
		}
	}
	tmp := ns.tmpName()
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return err
	}
	if err := os.Rename(tmp, ns.path(name)); err != nil {
		os.Remove(tmp)
		return err
	}
	return nil
}

func (ns *dirNamespace) Symlink(target, name string) error {
	ns.record("symlink", name)
	tmp := ns.tmpName()
	if err := os.Symlink(target, tmp); err != nil {
		return err
	}
	if fi, err := os.Lstat(ns.path(name)); err == nil && fi.IsDir() {
		os.RemoveAll(ns.path(name))
	}
	if err := os.Rename(tmp, ns.path(name)); err != nil {
		os.Remove(tmp)
		return err
	}
	return nil
}

func (ns *dirNamespace) Rename(oldName, newName string) error {
	ns.record("rename", oldName+" "+newName)
	return os.Rename(ns.path(oldName), ns.path(newName))
}

func (ns *dirNamespace) Remove(name string) error {
	ns.record("remove", name)
	return os.RemoveAll(ns.path(name))
}

// Seal links the tree and gives the owner and mode of its top as its Attrs (the fake keeps no
// more), so that every sealed step carries attrs through the replicator as the real one does.
func (ns *dirNamespace) Seal(name, dst string) (tiers.SealInfo, error) {
	ns.record("seal", name)
	if ns.failSeal != nil {
		if err := ns.failSeal(name); err != nil {
			return tiers.SealInfo{}, err
		}
	}
	fi, err := os.Lstat(ns.path(name))
	if err != nil {
		return tiers.SealInfo{}, err
	}
	st := fi.Sys().(*syscall.Stat_t)
	attrs := layout.NewAttrsBuilder(layout.Attr{Mode: st.Mode & 0o7777, UID: st.Uid, GID: st.Gid}, fi.IsDir()).Attrs()
	if ns.sealAttrs != nil {
		if a := ns.sealAttrs(name); a != nil {
			attrs = a
		}
	}
	_, err = linkTree(ns.path(name), dst)
	return tiers.SealInfo{Attrs: attrs}, err
}

func (ns *dirNamespace) HoldSpoolFile(ctx context.Context, path string) (string, context.Context, func(), error) {
	ns.record("spoolfile", path)
	p := ns.path(path)
	if _, err := os.Lstat(p); err != nil {
		return "", nil, nil, err
	}
	ns.mu.Lock()
	after := ns.spoolFiles
	if ns.holdsOf == nil {
		ns.holdsOf = map[string]int{}
	}
	ns.holdsOf[path]++
	cancelled := ns.cancelHold != nil && ns.cancelHold(path, ns.holdsOf[path])
	ns.mu.Unlock()
	if after != nil {
		stable := ns.tmpName()
		if err := os.Link(p, stable); err != nil {
			return "", nil, nil, err
		}
		after(path)
		p = stable
	}
	held, cancel := context.WithCancel(ctx)
	if cancelled {
		cancel()
	}
	ns.openHolds.Add(1)
	var once sync.Once
	return p, held, func() { once.Do(func() { cancel(); ns.openHolds.Add(-1) }) }, nil
}

// Owner is the owner of the file or directory at name.
func (ns *dirNamespace) Owner(name string) (uint32, uint32, error) {
	ns.record("owner", name)
	fi, err := os.Lstat(ns.path(name))
	if err != nil {
		return 0, 0, err
	}
	st := fi.Sys().(*syscall.Stat_t)
	return st.Uid, st.Gid, nil
}

// Reown records the call ("reown <name> <uid>", attrs or not) and changes nothing: the
// fake's entries are the test's.
func (ns *dirNamespace) Reown(name string, saved *layout.Attrs, uid uint32) (int, error) {
	ns.record("reown", fmt.Sprintf("%s %d attrs=%v", name, uid, saved != nil))
	return 0, nil
}

// ImportVerified verifies first: the fake has no tree to build meanwhile.
func (ns *dirNamespace) ImportVerified(src, name string, verify func([]layout.TreeEntry) error) error {
	if err := verify(nil); err != nil {
		return err
	}
	return ns.Import(src, name)
}

func (ns *dirNamespace) Import(src, name string) error {
	ns.record("import", name)
	if ns.failImport != nil {
		if err := ns.failImport(name); err != nil {
			return err
		}
	}
	if _, err := os.Lstat(ns.path(name)); err == nil {
		return fmt.Errorf("import %s: %w", name, tiers.ErrNameTaken)
	}
	tmp := ns.tmpName()
	if _, err := linkTree(src, tmp); err != nil {
		os.RemoveAll(tmp)
		return err
	}
	if err := os.Rename(tmp, ns.path(name)); err != nil {
		os.RemoveAll(tmp)
		return err
	}
	return nil
}

// linkTree hard-links the file or directory tree src to dst (which must not exist) and lists
// what it linked, paths relative to src (a single file is listed under its own base name).
func linkTree(src, dst string) ([]layout.TreeEntry, error) {
	fi, err := os.Lstat(src)
	if err != nil {
		return nil, err
	}
	if fi.Mode().IsRegular() {
		if err := os.Link(src, dst); err != nil {
			return nil, err
		}
		return []layout.TreeEntry{{Path: filepath.Base(dst), Type: layout.EntryFile, Size: fi.Size()}}, nil
	}
	if !fi.IsDir() {
		return nil, fmt.Errorf("link %s: a %v is neither a file nor a directory", src, fi.Mode().Type())
	}
	var out []layout.TreeEntry
	err = filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		target := filepath.Join(dst, rel)
		slash := filepath.ToSlash(rel)
		switch {
		case d.IsDir():
			if err := os.Mkdir(target, 0o755); err != nil {
				return err
			}
			if rel != "." {
				out = append(out, layout.TreeEntry{Path: slash, Type: layout.EntryDir})
			}
		case d.Type()&fs.ModeSymlink != 0:
			link, err := os.Readlink(p)
			if err != nil {
				return err
			}
			if err := os.Symlink(link, target); err != nil {
				return err
			}
			out = append(out, layout.TreeEntry{Path: slash, Type: layout.EntrySymlink, Target: link})
		case d.Type().IsRegular():
			info, err := d.Info()
			if err != nil {
				return err
			}
			if err := os.Link(p, target); err != nil {
				return err
			}
			out = append(out, layout.TreeEntry{Path: slash, Type: layout.EntryFile, Size: info.Size()})
		default:
			return fmt.Errorf("link %s: cannot link a %v", p, d.Type())
		}
		return nil
	})
	return out, err
}

// copyTree copies the file or directory tree src to dst (which must not exist).
func copyTree(src, dst string) error {
	return filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		target := filepath.Join(dst, rel)
		switch {
		case d.IsDir():
			return os.Mkdir(target, 0o755)
		case d.Type()&fs.ModeSymlink != 0:
			link, err := os.Readlink(p)
			if err != nil {
				return err
			}
			return os.Symlink(link, target)
		default:
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			return os.WriteFile(target, b, 0o644)
		}
	})
}

// --- fakeClock and recordingCoordinator -----------------------------------------------------

// fakeClock is a settable clock shared by the replicator and the coordinator (a
// replication.Clock): timers fire, each in its own goroutine, when Set passes their deadline.
type fakeClock struct {
	mu     sync.Mutex
	now    time.Time    // GUARDED_BY(mu)
	timers []*fakeTimer // GUARDED_BY(mu)
}

type fakeTimer struct {
	at time.Time
	f  func()
}

func newFakeClock(t time.Time) *fakeClock { return &fakeClock{now: t} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Set(t time.Time) {
	c.mu.Lock()
	c.now = t
	var due []*fakeTimer
	kept := c.timers[:0]
	for _, x := range c.timers {
		if x.at.After(t) {
			kept = append(kept, x)
		} else {
			due = append(due, x)
		}
	}
	c.timers = kept
	c.mu.Unlock()
	for _, x := range due {
		go x.f()
	}
}

func (c *fakeClock) AfterFunc(d time.Duration, f func()) func() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	x := &fakeTimer{at: c.now.Add(d), f: f}
	c.timers = append(c.timers, x)
	return func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		for i, y := range c.timers {
			if y == x {
				c.timers = slices.Delete(c.timers, i, i+1)
				return true
			}
		}
		return false
	}
}

// recordingCoordinator wraps the job's coordinator (one node: the agent's own) and records every
// Sync and its decision.
type recordingCoordinator struct {
	tiers.Coordinator

	// order, when set, may change each backup order before the node gets it.
	order func(*tiers.BackupOrder)
	// backupsErr, when set, fails every Backups call with it (a coordinator that does not give
	// orders: an agent of an earlier version answers Unimplemented).
	backupsErr error
	// tell, when set, is given once as a BackupOrder.Tell, with no order. GUARDED_BY(mu)
	tell string

	mu        sync.Mutex
	incs      []tiers.Incarnation  // GUARDED_BY(mu); every Negotiate's
	syncs     []tiers.SyncReport   // GUARDED_BY(mu)
	decisions []tiers.SyncDecision // GUARDED_BY(mu)
	reports   []tiers.BackupReport // GUARDED_BY(mu); every non-empty backup report
	failTells []time.Duration      // GUARDED_BY(mu); each RestoreFailed call's time left to its deadline
}

// RestoreFailed records the time the node gives the call, and passes it on.
func (c *recordingCoordinator) RestoreFailed(ctx context.Context, inc tiers.Incarnation, reason string) error {
	left := time.Duration(-1)
	if d, ok := ctx.Deadline(); ok {
		left = time.Until(d)
	}
	c.mu.Lock()
	c.failTells = append(c.failTells, left)
	c.mu.Unlock()
	if rep, ok := c.Coordinator.(tiers.RestoreFailureReporter); ok {
		return rep.RestoreFailed(ctx, inc, reason)
	}
	return nil
}

func (c *recordingCoordinator) restoreFailedCalls() []time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.failTells)
}

func (c *recordingCoordinator) Negotiate(ctx context.Context, inc tiers.Incarnation, inv tiers.Inventory) (tiers.RestorePlan, error) {
	c.mu.Lock()
	c.incs = append(c.incs, inc)
	c.mu.Unlock()
	return c.Coordinator.Negotiate(ctx, inc, inv)
}

func (c *recordingCoordinator) negotiated() []tiers.Incarnation {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.incs)
}

func (c *recordingCoordinator) Backups(ctx context.Context, inc tiers.Incarnation, rep tiers.BackupReport) (tiers.BackupOrder, error) {
	if rep.Done != "" || rep.Failed != "" {
		c.mu.Lock()
		c.reports = append(c.reports, rep)
		c.mu.Unlock()
	}
	if c.backupsErr != nil {
		return tiers.BackupOrder{}, c.backupsErr
	}
	c.mu.Lock()
	tell := c.tell
	c.tell = ""
	c.mu.Unlock()
	if tell != "" {
		return tiers.BackupOrder{Tell: tell}, nil
	}
	o, err := c.Coordinator.Backups(ctx, inc, rep)
	if o.Backup != "" && c.order != nil {
		c.order(&o)
	}
	return o, err
}

func (c *recordingCoordinator) backupReports() []tiers.BackupReport {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.reports)
}

func (c *recordingCoordinator) Sync(ctx context.Context, inc tiers.Incarnation, rep tiers.SyncReport) (tiers.SyncDecision, error) {
	dec, err := c.Coordinator.Sync(ctx, inc, rep)
	c.mu.Lock()
	c.syncs = append(c.syncs, rep)
	c.decisions = append(c.decisions, dec)
	c.mu.Unlock()
	return dec, err
}

func (c *recordingCoordinator) syncLog() ([]tiers.SyncReport, []tiers.SyncDecision) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.syncs), slices.Clone(c.decisions)
}

// --- harness: the job's side ----------------------------------------------------------------

// harnessConfig sets up one agent.
type harnessConfig struct {
	root    string            // holds spool and namespaces; a new t.TempDir() when ""
	store   *testStore        // nil: no backup tier
	clock   *fakeClock        // nil: a fixed clock at baseTime
	env     map[string]string // for $VAR expansion
	jaxInit *tiers.JaxInit
	drain   time.Duration // the replicator's DrainTimeout; 0: the default
	// beforeSeal is the replicator's BeforeSeal hook (nil: none).
	beforeSeal func(step int64)
	// coord replaces the agent's own coordinator (multi-node tests); peers is the transport.
	coord tiers.Coordinator
	peers tiers.PeerTransport
	// sealErr, when set, may fail the namespace's seals (dirNamespace.failSeal).
	sealErr func(name string) error
	// importErr, when set, may fail the namespace's imports (dirNamespace.failImport).
	importErr func(name string) error
	// writeErr and readErr, when set, may fail the namespace's writes and reads
	// (dirNamespace.failWrite, failRead).
	writeErr, readErr func(name string) error
	// hashFault, when set, may fail the hashing of commit records (Replicator.SetHashFault).
	hashFault func(step int64) error
	// afterSealDone, when set, runs at the end of each commit's done (SetAfterSealDone).
	afterSealDone func(name string)
	// mountPath, when set, is the spool's MountPath: it keeps an owner record (and a lock,
	// released by the harness's close).
	mountPath string
	// recordRemoveErr, when set, may fail the removals of records failed tries made.
	recordRemoveErr func(dir string) error
	// sealRetryFor, when not 0, bounds the tries of a seal that failed on a shortage.
	sealRetryFor time.Duration
	// keptSpools is the replicator's KeptSpools (nil: none).
	keptSpools func() ([]tiers.SpoolInfo, error)
	// sealAttrs, when set, gives the namespace's seals their Attrs (dirNamespace.sealAttrs).
	sealAttrs func(name string) *layout.Attrs
	// cpuIdle is the replicator's CPUIdle (nil: /proc/stat).
	cpuIdle func() (time.Duration, bool)
	// backupOrder, when set, may change each backup order the agent's own coordinator gives.
	backupOrder func(*tiers.BackupOrder)
	// backupsErr, when set, fails every backup order call of the agent's own coordinator.
	backupsErr error
	// backupTell, when set, is a line the agent's own coordinator gives once (BackupOrder.Tell).
	backupTell string
	// syncerPop, when set, runs as the syncer takes each sealed step (SetSyncerPopHook).
	syncerPop func(step int64, restored bool)
	// afterPublish, when set, runs once a commit's data has its name (SetAfterPublish).
	afterPublish func(step int64)
}

// baseTime is where fake clocks start: a whole UTC minute.
var baseTime = time.Date(2030, 1, 2, 3, 0, 0, 0, time.UTC)

// harness is one running replicator over a dirNamespace, and the job that uses it.
type harness struct {
	t     *testing.T
	cfg   harnessConfig
	ns    *dirNamespace
	spool *tiers.Spool
	coord *recordingCoordinator
	r     *tiers.Replicator
	logs  *syncbuf.Buffer // what the replicator logged (also written to the test's output)

	closeOnce sync.Once
}

var nsCount atomic.Int64

// newHarness starts a replicator. The spool lives at <root>/spool, so a second harness on the
// same root is the same agent restarted; each harness gets a fresh, empty namespace.
func newHarness(t *testing.T, cfg harnessConfig) *harness {
	t.Helper()
	if cfg.root == "" {
		cfg.root = t.TempDir()
	}
	if cfg.clock == nil {
		cfg.clock = newFakeClock(baseTime)
	}
	ns, err := newDirNamespace(filepath.Join(cfg.root, fmt.Sprintf("ns%d", nsCount.Add(1))))
	if err != nil {
		t.Fatal(err)
	}
	ns.failImport = cfg.importErr
	ns.failSeal = cfg.sealErr
	ns.failWrite, ns.failRead = cfg.writeErr, cfg.readErr
	ns.sealAttrs = cfg.sealAttrs
	spool, err := tiers.OpenSpool(tiers.SpoolConfig{Dir: filepath.Join(cfg.root, "spool"), Budget: 64 << 20, MountPath: cfg.mountPath})
	if err != nil {
		t.Fatalf("OpenSpool: %v", err)
	}
	h := &harness{t: t, cfg: cfg, ns: ns, spool: spool, logs: &syncbuf.Buffer{}}
	opts := replication.Options{Clock: cfg.clock}
	rcfg := tiers.ReplicatorConfig{
		Spool:        spool,
		Getenv:       func(k string) string { return cfg.env[k] },
		Now:          cfg.clock.Now,
		Logger:       slog.New(slog.NewTextHandler(io.MultiWriter(t.Output(), h.logs), &slog.HandlerOptions{Level: slog.LevelDebug})),
		JaxInit:      cfg.jaxInit,
		DrainTimeout: cfg.drain,
		BeforeSeal:   cfg.beforeSeal,
		CPUIdle:      cfg.cpuIdle,
		KeptSpools:   cfg.keptSpools,
	}
	if cfg.store != nil {
		opts.Store, rcfg.Store = cfg.store, cfg.store // no typed nil in the interfaces
	}
	h.coord = &recordingCoordinator{Coordinator: replication.LocalClient{Job: replication.NewJob(opts)}, order: cfg.backupOrder, backupsErr: cfg.backupsErr, tell: cfg.backupTell}
	rcfg.Coordinator = h.coord
	if cfg.coord != nil {
		rcfg.Coordinator = cfg.coord
	}
	rcfg.Peers = cfg.peers
	h.r = tiers.NewReplicator(rcfg)
	if cfg.hashFault != nil {
		h.r.SetHashFault(cfg.hashFault)
	}
	if cfg.afterSealDone != nil {
		h.r.SetAfterSealDone(cfg.afterSealDone)
	}
	if cfg.recordRemoveErr != nil {
		h.r.SetRecordRemoveFault(cfg.recordRemoveErr)
	}
	if cfg.sealRetryFor != 0 {
		h.r.SetSealRetryFor(cfg.sealRetryFor)
	}
	if cfg.syncerPop != nil {
		h.r.SetSyncerPopHook(cfg.syncerPop)
	}
	if cfg.afterPublish != nil {
		h.r.SetAfterPublish(cfg.afterPublish)
	}
	if err := h.r.Start(context.Background(), ns); err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(h.close)
	return h
}

// close stops the agent (idempotent); its spool stays for a restart.
func (h *harness) close() {
	h.closeOnce.Do(func() {
		h.r.Close()
		if h.cfg.mountPath != "" {
			h.spool.Detach()
		}
	})
}

// restart stops the agent and starts a new one on the same spool with an empty namespace.
func (h *harness) restart() *harness {
	h.t.Helper()
	h.close()
	return newHarness(h.t, h.cfg)
}

func (h *harness) path(name string) string { return filepath.Join(h.ns.dir, name) }

// writeFile creates a file (and its parent directories) in the namespace and reports the open
// for writing and the close, as package fs does.
func (h *harness) writeFile(name, content string) {
	h.t.Helper()
	h.r.Opened(true)
	p := h.path(name)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		h.t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		h.t.Fatal(err)
	}
	h.r.Closed(name)
}

// holdOpen reports an open for writing of name, as a job that writes it for a while; release
// writes content and reports the close.
func (h *harness) holdOpen(name, content string) (release func()) {
	h.t.Helper()
	h.r.Opened(true)
	return func() {
		h.writeFile(name, content)
		h.r.Closed(name)
	}
}

// rename renames in the namespace and reports it with the type of what was renamed.
func (h *harness) rename(oldName, newName string) {
	h.t.Helper()
	fi, err := os.Lstat(h.path(oldName))
	if err != nil {
		h.t.Fatal(err)
	}
	typ := layout.EntryFile
	switch {
	case fi.IsDir():
		typ = layout.EntryDir
	case fi.Mode()&fs.ModeSymlink != 0:
		typ = layout.EntrySymlink
	}
	if err := os.Rename(h.path(oldName), h.path(newName)); err != nil {
		h.t.Fatal(err)
	}
	h.r.Renamed(oldName, newName, typ)
}

// yamlOrbax writes replicator.yaml as Orbax does: a .tmp file renamed into place.
func (h *harness) yamlOrbax(doc string) {
	h.t.Helper()
	h.writeFile(layout.ReplicatorYAMLTmpName, doc)
	h.rename(layout.ReplicatorYAMLTmpName, layout.ReplicatorYAMLName)
}

// yamlNemo writes replicator.yaml directly, as NeMo does.
func (h *harness) yamlNemo(doc string) {
	h.t.Helper()
	h.writeFile(layout.ReplicatorYAMLName, doc)
}

// checkpointFiles is a small Orbax-like tree; tag makes its content unique.
func checkpointFiles(tag string) map[string]string {
	return map[string]string{
		"_CHECKPOINT_METADATA":                     `{"step": "` + tag + `"}`,
		"commit_success.txt":                       "ok",
		"state/array_0":                            strings.Repeat("weights "+tag+" ", 300),
		"state/commit_success.txt":                 "ok",
		"process_metadata/process_0.json":          `{"tag": "` + tag + `"}`,
		"process_metadata/commit_success.txt":      "ok",
		"state/ocdbt.process_0/d/0123456789abcdef": "chunk " + tag,
	}
}

// makeTree writes files below the namespace directory dir, reporting each close.
func (h *harness) makeTree(dir string, files map[string]string) {
	h.t.Helper()
	if err := os.MkdirAll(h.path(dir), 0o755); err != nil {
		h.t.Fatal(err)
	}
	for rel, content := range files {
		h.writeFile(dir+"/"+rel, content)
	}
}

// orbaxSave saves step as Orbax does and returns the tree hash of what it committed.
func (h *harness) orbaxSave(step int64, files map[string]string) string {
	h.t.Helper()
	tmp := fmt.Sprintf("%d%s", step, layout.OrbaxTmpSuffix)
	h.makeTree(tmp, files)
	hash, err := layout.HashDir(context.Background(), h.path(tmp))
	if err != nil {
		h.t.Fatal(err)
	}
	h.rename(tmp, fmt.Sprint(step))
	return "D" + hash
}

// nemoSave saves as NeMo does for global step gs, committing step gs-1.
func (h *harness) nemoSave(gs int64, files map[string]string) string {
	h.t.Helper()
	dir := fmt.Sprintf("step=%d", gs)
	h.writeFile(dir+"-unfinished", "")
	h.makeTree(dir, files)
	hash, err := layout.HashDir(context.Background(), h.path(dir))
	if err != nil {
		h.t.Fatal(err)
	}
	if err := os.Remove(h.path(dir + "-unfinished")); err != nil {
		h.t.Fatal(err)
	}
	h.rename(dir, fmt.Sprint(gs-1))
	return "D" + hash
}

// names lists the namespace, sorted.
func (h *harness) names() []string {
	h.t.Helper()
	des, err := os.ReadDir(h.ns.dir)
	if err != nil {
		h.t.Fatal(err)
	}
	var out []string
	for _, de := range des {
		out = append(out, de.Name())
	}
	return out
}

func (h *harness) exists(name string) bool {
	_, err := os.Lstat(h.path(name))
	return err == nil
}

// read returns a namespace file's content, "" if it does not exist.
func (h *harness) read(name string) string {
	b, _ := os.ReadFile(h.path(name))
	return string(b)
}

// lines returns the non-empty lines of a namespace file.
func (h *harness) lines(name string) []string {
	var out []string
	for _, l := range strings.Split(h.read(name), "\n") {
		if l != "" {
			out = append(out, l)
		}
	}
	return out
}

const waitTimeout = 10 * time.Second

// eventually polls cond until it returns "" (success) or the deadline passes; then it fails
// with cond's last explanation and the namespace listing.
func (h *harness) eventually(what string, cond func() string) {
	h.t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for {
		why := cond()
		if why == "" {
			return
		}
		if time.Now().After(deadline) {
			h.t.Fatalf("timed out after %v waiting for %s: %s\nnamespace: %q\nreplicator.errors: %q\nreplicator.failed: %q",
				waitTimeout, what, why, h.names(), h.read(layout.ReplicatorErrorsName), h.read(layout.ReplicatorFailedName))
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func (h *harness) waitExists(name string) {
	h.t.Helper()
	h.eventually(name+" to appear", func() string {
		if h.exists(name) {
			return ""
		}
		return name + " is missing"
	})
}

func (h *harness) waitGone(name string) {
	h.t.Helper()
	h.eventually(name+" to disappear", func() string {
		if !h.exists(name) {
			return ""
		}
		return name + " still exists"
	})
}

// markers returns the .restore names in the namespace.
func (h *harness) markers() []string {
	var out []string
	for _, n := range h.names() {
		if strings.HasSuffix(n, ".restore") {
			out = append(out, n)
		}
	}
	return out
}

// waitMarkers waits until the namespace holds exactly the given .restore names.
func (h *harness) waitMarkers(want ...string) {
	h.t.Helper()
	sort.Strings(want)
	h.eventually(fmt.Sprintf("restore markers %q", want), func() string {
		if got := h.markers(); !slices.Equal(got, want) {
			return fmt.Sprintf("markers are %q", got)
		}
		return ""
	})
}

func marker(job string, step int64, node, worker int, kind string) string {
	return layout.MarkerName{Job: job, Step: step, Node: node, Worker: worker, Kind: kind}.String()
}

// waitMeta waits for a .meta and returns its content.
func (h *harness) waitMeta(job string, step int64, worker int) string {
	h.t.Helper()
	name := marker(job, step, 0, worker, layout.MarkerMeta)
	h.waitExists(name)
	return h.read(name)
}

// waitSealed waits until a committed step is sealed: its .meta exists and the committed
// name is gone.
func (h *harness) waitSealed(job string, step int64, committedName string) string {
	h.t.Helper()
	meta := h.waitMeta(job, step, 0)
	h.waitGone(committedName)
	return meta
}

// waitIdle waits until no backup is running.
func (h *harness) waitIdle() {
	h.t.Helper()
	h.eventually("the backup to finish", func() string {
		if b := h.r.Status().Backup; b != nil {
			return fmt.Sprintf("backup %s of step %d still running", b.Backup, b.Step)
		}
		return ""
	})
}

// start answers a fresh-start handshake for a one-worker job and waits for its s0 marker.
func (h *harness) start(doc, job string) {
	h.t.Helper()
	h.yamlOrbax(doc)
	h.waitGone(layout.ReplicatorYAMLName)
	h.waitMarkers(marker(job, 0, 0, 0, layout.MarkerRestore))
}

// spoolGlob matches names inside the spool's subdirectories.
func (h *harness) spoolGlob(pattern string) []string {
	m, _ := filepath.Glob(filepath.Join(h.cfg.root, "spool", "*", pattern))
	return m
}

// spoolEntries returns the spool's paths matching pattern, relative to the spool ("commits/*":
// the commit records). spoolGlob("commits/*") matched nothing, always: assertions of no record
// left could not fail.
func (h *harness) spoolEntries(pattern string) []string {
	m, _ := filepath.Glob(filepath.Join(h.cfg.root, "spool", pattern))
	return m
}

// checkTree reports how the checkpoint at p (followed if it is a symlink, like a .restore
// marker) differs from files, relative path → content ("" when it holds exactly those files).
func checkTree(p string, files map[string]string) string {
	root, err := filepath.EvalSymlinks(p)
	if err != nil {
		return err.Error()
	}
	got := map[string]string{}
	err = filepath.WalkDir(root, func(q string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		if !d.Type().IsRegular() {
			return fmt.Errorf("%s is a %v", q, d.Type())
		}
		rel, _ := filepath.Rel(root, q)
		b, err := os.ReadFile(q)
		got[filepath.ToSlash(rel)] = string(b)
		return err
	})
	if err != nil {
		return err.Error()
	}
	for rel, want := range files {
		g, ok := got[rel]
		switch {
		case !ok:
			return fmt.Sprintf("%s is missing from %s", rel, p)
		case g != want:
			return fmt.Sprintf("%s in %s holds %d bytes %.40q…, want %d bytes %.40q…", rel, p, len(g), g, len(want), want)
		}
	}
	for rel := range got {
		if _, ok := files[rel]; !ok {
			return fmt.Sprintf("%s in %s is unexpected", rel, p)
		}
	}
	return ""
}
