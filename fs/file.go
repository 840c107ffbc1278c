package fs

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"github.com/mtcfs/mtcfs/tiers"
	"golang.org/x/sys/unix"
)

// fileNode is a regular file. Its bytes, size and data times live in a spool file; the node
// keeps the rest (mode, owner, links) in memory.
type fileNode struct {
	gofs.Inode
	meta // meta.mu also guards the fields below
	fs   *mtfs

	backing   string // spool file; "" once removed. GUARDED_BY(mu)
	nlink     int    // names in the tree. GUARDED_BY(mu)
	opens     int    // open handles. GUARDED_BY(mu)
	releasing int    // handles whose RELEASE request is still running (space.go). GUARDED_BY(mu)
	writers   int    // open handles that may write. GUARDED_BY(mu)
	// flushedOpen counts the passthrough handles whose writer's close committed the file
	// (Flush) and that the kernel has not released: a duplicate of the descriptor, a forked
	// child or a shared mapping still holds them, and with passthrough their writes go straight
	// into the spool file, whose bytes Seal linked into the checkpoint. GUARDED_BY(mu)
	flushedOpen int
	// committing: a close is reporting this file's commit (Flush), which freezes it if the
	// agent takes it. GUARDED_BY(mu)
	committing bool
	lingering  bool // keeps the bytes after the last name went (replacedByAgent). GUARDED_BY(mu)
	// kernelHeld: the job removed the last name (unlink, or a rename over it) and the kernel
	// may still hold the node: an open(2) that resolved the name just before sends its OPEN
	// now. The bytes stay until the kernel forgets the node (OnForget), so that such an open
	// gets the old content, as on tmpfs, not ENOENT (black-box h53: 1 open in 5 failed in a
	// loop racing a rename over the file). Only for files up to keepMaxFile, and while the
	// bytes so kept stay within half the free room (roomToKeep): see space.go. Never longer
	// than kernelHeldMax (heldTimer). GUARDED_BY(mu)
	kernelHeld bool
	heldTimer  *time.Timer // ends kernelHeld after kernelHeldMax. GUARDED_BY(mu)
	heldBytes  int64       // the spool file's blocks when kernelHeld began. GUARDED_BY(mu)
	accounted  int64       // bytes charged to an agent-accounted spool budget. GUARDED_BY(mu)
	// holds are the agent's own reads of the spool file (HoldSpoolFile), which keep its bytes
	// on tmpfs after its last name goes, like a handle. GUARDED_BY(mu)
	holds map[*spoolHold]struct{}
	// borrowed: backing is a file of a sealed record in the spool (a step imported at a restart
	// or from a peer), which owns that name: the node never removes it, and gets a spool file
	// name of its own before it gets a second name (addLink). GUARDED_BY(mu)
	borrowed bool
	// limit is the largest size a control file may reach (0: none); such files never use
	// passthrough, so that every write passes the check.
	limit int64
	// ctlChanges counts the changes to a control file's bytes (limit > 0): its creation, writes,
	// truncations. The handshake removes only the version of replicator.yaml it read
	// (namespace.RemoveControl): one the job wrote again in place meanwhile is answered next.
	ctlChanges atomic.Uint64
	// toldTooLarge: a write past limit was reported (tooLarge), once per file.
	toldTooLarge atomic.Bool
	// dataMu orders the agent's writes of the file's bytes (WRITE, fallocate, copy_file_range
	// into it) with a copy of them into a checkpoint: a write holds it shared from its frozen
	// check to the end of its change, exportTo exclusively. A write the job was told had
	// succeeded was otherwise torn in the checkpoint when it ran during the copy (found by a
	// black-box run).
	dataMu sync.RWMutex
	// report: a version of a report file the agent wrote (reports.go); set before the node is
	// published, never changed.
	report *reportState
	// reportVer is the node's version among report files (reportVersion; 0: not asked yet).
	reportVer atomic.Uint64
}

var (
	_ = (gofs.NodeGetattrer)((*fileNode)(nil))
	_ = (gofs.NodeSetattrer)((*fileNode)(nil))
	_ = (gofs.NodeOpener)((*fileNode)(nil))
	_ = (gofs.NodeCopyFileRanger)((*fileNode)(nil))
	_ = (gofs.NodeGetxattrer)((*fileNode)(nil))
	_ = (gofs.NodeSetxattrer)((*fileNode)(nil))
	_ = (gofs.NodeRemovexattrer)((*fileNode)(nil))
	_ = (gofs.NodeListxattrer)((*fileNode)(nil))
	_ = (gofs.NodeOnForgetter)((*fileNode)(nil))
)

// newFile makes a node with a new, empty spool file and returns the file's open descriptor,
// which the caller owns: a create uses it for its handle instead of opening the file again.
func (m *mtfs) newFile(ctx context.Context, mode uint32) (*fileNode, int, error) {
	p, fd, err := m.spool.NewFile()
	if err != nil {
		return nil, -1, err
	}
	f := &fileNode{fs: m, backing: p, nlink: 1}
	f.init(ctx, mode)
	return f, fd, nil
}

func (f *fileNode) Getattr(ctx context.Context, fh gofs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	f.mu.Lock()
	defer f.mu.Unlock()
	var st unix.Stat_t
	var err error
	if h, ok := fh.(*fileHandle); ok {
		err = unix.Fstat(h.fd, &st)
	} else if f.backing != "" {
		err = unix.Stat(f.backing, &st)
	}
	if err != nil {
		return f.fs.toErrno("getattr", err)
	}
	f.fill(&out.Attr)
	out.Size = uint64(st.Size)
	out.Blocks = uint64(st.Blocks)
	out.Blksize = 4096
	out.Nlink = uint32(f.nlink)
	// Data times come from the spool file; ctime also moves on chmod, link and unlink here.
	atime, mtime := time.Unix(st.Atim.Unix()), time.Unix(st.Mtim.Unix())
	ctime := time.Unix(st.Ctim.Unix())
	if f.ctime.After(ctime) {
		ctime = f.ctime
	}
	out.SetTimes(&atime, &mtime, &ctime)
	return 0
}

func (f *fileNode) Setattr(ctx context.Context, fh gofs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	if errno := retryNoSpace(f.fs, func() syscall.Errno { return f.setattr(fh, in) }); errno != 0 {
		return errno
	}
	return f.Getattr(ctx, fh, out)
}

func (f *fileNode) setattr(fh gofs.FileHandle, in *fuse.SetAttrIn) syscall.Errno {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.isFrozen() { // under mu, for the reason open gives: a truncate must not reach a linked file
		return syscall.EROFS
	}
	if hook := frozenChecked.Load(); hook != nil {
		(*hook)(f)
	}
	if f.backing == "" {
		return syscall.ENOENT
	}
	if size, ok := in.GetSize(); ok {
		if f.limit > 0 && int64(size) > f.limit {
			f.tooLarge()
			return syscall.EFBIG
		}
		if err := f.chargeTo(int64(size), true); err != nil {
			return f.fs.toErrno("truncate", err)
		}
		var err error
		if h, ok := fh.(*fileHandle); ok {
			err = unix.Ftruncate(h.fd, int64(size))
		} else {
			err = unix.Truncate(f.backing, int64(size))
		}
		if err != nil {
			return f.fs.toErrno("truncate", err)
		}
		if size == 0 {
			f.fs.rewritten(f) // the lost pages are gone with the rest (writeback.go)
		}
		f.changedControl()
	}
	atime, aok := in.GetATime()
	mtime, mok := in.GetMTime()
	if aok || mok {
		ts := []unix.Timespec{{Nsec: unix.UTIME_OMIT}, {Nsec: unix.UTIME_OMIT}}
		if aok {
			ts[0] = unix.NsecToTimespec(atime.UnixNano())
		}
		if mok {
			ts[1] = unix.NsecToTimespec(mtime.UnixNano())
		}
		if err := unix.UtimesNanoAt(unix.AT_FDCWD, f.backing, ts, 0); err != nil {
			return f.fs.toErrno("utimens", err)
		}
	}
	f.meta.setattr(in)
	return 0
}

// chargeTo makes the agent-accounted budget cover a file of size bytes. With exact, the charge
// also shrinks (truncate); otherwise it only grows (writes). Caller holds mu.
func (f *fileNode) chargeTo(size int64, exact bool) error {
	if f.fs.spool.KernelEnforced() || size == f.accounted || (!exact && size < f.accounted) {
		return nil
	}
	if err := f.fs.spool.Reserve(size - f.accounted); err != nil {
		return err
	}
	f.accounted = size
	return nil
}

// chargeImported is chargeTo for a file whose bytes are in the spool already (an imported
// step's, before any open): an agent-accounted budget counts them even past the budget
// (tiers.Spool.Charge), so that new writes fail instead.
func (f *fileNode) chargeImported(size int64) {
	if f.fs.spool.KernelEnforced() {
		return
	}
	f.fs.spool.Charge(size - f.accounted)
	f.accounted = size
}

func (f *fileNode) Open(ctx context.Context, flags uint32) (gofs.FileHandle, uint32, syscall.Errno) {
	if f.report != nil {
		f.report.opened.Store(true)
	}
	if flags&syscall.O_ACCMODE != syscall.O_RDONLY {
		f.fs.awaitReleases(nil) // space.go
		if f.limit > 0 {
			// A writer of a control file counts as a change before the handshake's removal of
			// the version it read can check, or finds the node removed (ESTALE): between that
			// check and the removal, the job's rewrite of its yaml went into the removed file
			// (a test run under -race, 1 in ~5).
			f.fs.controlMu.RLock()
			defer f.fs.controlMu.RUnlock()
		}
	}
	return f.open(ctx, flags)
}

func (f *fileNode) open(ctx context.Context, flags uint32) (gofs.FileHandle, uint32, syscall.Errno) {
	f.mu.Lock()
	defer f.mu.Unlock()
	// Checked under mu, as the writer is counted: Seal marks a file frozen before exportTo takes
	// mu to link it, so an open that takes mu after the link sees the mark, and one that took it
	// before is a writer that exportTo copies around. Checked before taking mu, a writer could
	// be counted after the link and write into the checkpoint through passthrough.
	if f.isFrozen() && (flags&syscall.O_ACCMODE != syscall.O_RDONLY || flags&syscall.O_TRUNC != 0) {
		return nil, 0, syscall.EROFS
	}
	if hook := frozenChecked.Load(); hook != nil {
		(*hook)(f)
	}
	if f.backing == "" && f.limit > 0 {
		// A control file the agent removed (an answered replicator.yaml) since the kernel
		// looked the name up: ESTALE has the kernel walk the path again, revalidating it, once,
		// and an open(O_CREAT) of the job's next yaml creates it. With ENOENT a job writing its
		// yaml again at once got "No such file or directory" (a test run). Only for control
		// files: for a file another process renames over in a tight loop the walk again can
		// meet a removed node again, and the program saw "Stale file handle" (black-box h62).
		return nil, 0, syscall.ESTALE
	}
	if f.backing == "" {
		return nil, 0, syscall.ENOENT
	}
	// Always read-write: go-fuse registers the first handle's fd as the passthrough backing file
	// of the inode and reuses it for later opens, which may want to write.
	fd, err := unix.Open(f.backing, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, 0, f.fs.toErrno("open", err)
	}
	name, parent := f.Parent()
	return f.openFd(ctx, fd, flags, closeCommitName(parent != nil && parent.IsRoot(), name))
}

// closeCommitName is name when a file opened under it, at the top level when atRoot, may commit
// a step when closed (tiers.CommitsOnClose), else "".
func closeCommitName(atRoot bool, name string) string {
	if atRoot && tiers.CommitsOnClose(name) {
		return name
	}
	return ""
}

// openFd makes a handle of fd, an open descriptor of the spool file; commitName, when not "",
// is the top-level name it was opened under, whose close may commit a step (closeCommitName).
// Caller holds mu.
func (f *fileNode) openFd(ctx context.Context, fd int, flags uint32, commitName string) (gofs.FileHandle, uint32, syscall.Errno) {
	if flags&syscall.O_TRUNC != 0 && flags&syscall.O_ACCMODE != syscall.O_RDONLY {
		if err := unix.Ftruncate(fd, 0); err != nil {
			unix.Close(fd)
			return nil, 0, f.fs.toErrno("open", err)
		}
		f.chargeTo(0, true)
		f.fs.rewritten(f)
		f.changedControl()
	}
	f.opens++
	h := &fileHandle{node: f, fd: fd, writable: flags&syscall.O_ACCMODE != syscall.O_RDONLY,
		direct: f.fs.passthrough.Load() && f.limit == 0}
	// Nobody but the kernel changes a file's bytes, so its page cache stays valid across opens.
	// (go-fuse drops the flag when it sets up passthrough.)
	fflags := uint32(fuse.FOPEN_KEEP_CACHE)
	if h.writable {
		// A writer of a control file is a change to come: the handshake removes only the
		// version it read, and a yaml opened for writing right after that read (its O_TRUNC
		// comes as a SETATTR after the OPEN) was removed with the job's rewrite to follow into
		// the removed file (a test run).
		f.changedControl()
		f.addWriter()
		h.commitsOnClose = f.fs.events != nil && commitName != ""
		if h.commitsOnClose {
			h.opener, h.name = callerProcess(ctx), commitName
		}
	}
	if f.fs.events != nil {
		f.fs.events.Opened(h.writable)
	}
	if !h.commitsOnClose {
		// close(2) then costs no round trip to the agent; the release that follows is
		// asynchronous and reports the close (Closed).
		fflags |= fuse.FOPEN_NOFLUSH
	}
	return h, fflags, 0
}

// errUnlinked is exportTo's error for a file the job unlinked: an unlink that passed its check
// before the commit froze the directory can still be on its way when Seal reaches the file.
var errUnlinked = fmt.Errorf("unlinked by the job: %w", os.ErrNotExist)

// frozenChecked, when set (tests), runs in open and setattr after their frozen check, with mu
// held.
var frozenChecked atomic.Pointer[func(*fileNode)]

// exportTo gives the file's bytes a name in a sealed tree (rel, for messages): link makes a hard
// link to the spool file (no byte copied). A file still open for writing is copied instead
// (create makes the new file), so that writes through those descriptors — which the kernel may
// send straight to the spool file (passthrough) — cannot change the checkpoint; copied says so.
//
// A writer whose close(2) returned before the commit may still have its RELEASE under way (see
// space.go): exportTo waits for it as awaitReleases does, so that a just-closed file is linked,
// not copied.
func (f *fileNode) exportTo(rel string, link func(src string) error, create func() (*os.File, error)) (copied bool, err error) {
	f.dataMu.Lock() // before mu: writes take it first (see dataMu)
	defer f.dataMu.Unlock()
	if errno := f.fs.lostPages(f); errno != 0 {
		return false, fmt.Errorf("%s: %w", rel, &LostPagesError{Errno: errno})
	}
	f.mu.Lock()
	if f.writers != 0 { // the common case takes the lock once
		f.mu.Unlock()
		f.fs.settle(func() bool {
			f.mu.Lock()
			defer f.mu.Unlock()
			return f.writers == 0
		})
		f.mu.Lock()
	}
	defer f.mu.Unlock()
	if f.backing == "" || f.nlink == 0 {
		return false, fmt.Errorf("%s: %w", rel, errUnlinked)
	}
	if f.writers == 0 {
		return false, link(f.backing)
	}
	src, err := os.Open(f.backing)
	if err != nil {
		return false, err
	}
	defer src.Close()
	dst, err := create()
	if err != nil {
		return false, err
	}
	_, err = io.Copy(dst, src) // copy_file_range on tmpfs: no byte enters the Go heap
	if cerr := dst.Close(); err == nil {
		err = cerr
	}
	return true, err
}

// openAfterCommit reports whether, after waiting up to wait for it to end, a passthrough handle
// whose writer's close committed the file is still open (flushedOpen): its writes may change
// the bytes linked into the checkpoint. The RELEASE of a close comes just after its FLUSH, so
// a file closed the usual way (torch.save) does not wait.
func (f *fileNode) openAfterCommit(wait time.Duration) bool {
	deadline := time.Now().Add(wait)
	for {
		f.mu.Lock()
		n := f.flushedOpen
		f.mu.Unlock()
		if n == 0 {
			return false
		}
		if !time.Now().Before(deadline) {
			return true
		}
		time.Sleep(time.Millisecond)
	}
}

// closedPath is the path a close of h is reported under: for a .save, the top-level name it was
// opened under while that name still is the file's, else the file's path. A .save given a second
// name while open (a hard link in a scratch directory) was reported under that name, the newest,
// and its close committed nothing, without a word (found by a black-box run).
func (h *fileHandle) closedPath() string {
	f := h.node
	if h.name != "" && f.Root().GetChild(h.name) == f.EmbeddedInode() {
		return h.name
	}
	return f.Path(nil)
}

func (f *fileNode) addLink() syscall.Errno {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.nlink == 0 || f.backing == "" {
		return syscall.ENOENT
	}
	if f.borrowed {
		// The new name may outlive the sealed record (a later step reusing an unchanged
		// shard, kept after the record's step is dropped): the bytes get a spool file name
		// of their own first.
		p, err := f.fs.spool.LinkFile(f.backing)
		if err != nil {
			return f.fs.toErrno("link", err)
		}
		f.backing, f.borrowed = p, false
	}
	f.nlink++
	f.ctime = time.Now()
	return 0
}

// dropLink removes one name; it reports whether that was the last one while handles remain
// (the file is doomed: its bytes go when the handles are released, see space.go).
// replacedByAgent drops the name the agent just gave to another node (namespace.install): the
// bytes stay a moment, for a reader that resolved the name just before the kernel forgot it and
// opens the old node now — it reads the old content, as with rename(2) over a file, not ENOENT.
func (f *fileNode) replacedByAgent() {
	f.mu.Lock()
	f.lingering = true
	f.mu.Unlock()
	f.dropLink()
	time.AfterFunc(replacedLinger, func() {
		f.mu.Lock()
		f.lingering = false
		f.maybeFree()
		f.mu.Unlock()
	})
}

// replacedLinger is how long replacedByAgent keeps the old bytes (small control and .meta files).
const replacedLinger = time.Second

func (f *fileNode) dropLink() (doomed bool) {
	doomed, _ = f.dropLinkBy(false)
	return doomed
}

// dropLinkBy is dropLink; byJob says the job's own unlink or rename removed the name, the
// kernel's view of it changing with ours: when it was the last, the bytes stay until the kernel
// forgets the node (kernelHeld), and forget says so — the caller must then call
// f.ForgetPersistent once the tree no longer holds the name, without mu.
func (f *fileNode) dropLinkBy(byJob bool) (doomed, forget bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.nlink > 0 {
		f.nlink--
	}
	f.ctime = time.Now()
	doomed = f.nlink == 0 && (f.opens > 0 || f.releasing > 0 || len(f.holds) > 0)
	if byJob && f.nlink == 0 && f.backing != "" && !f.kernelHeld {
		var st unix.Stat_t
		if unix.Stat(f.backing, &st) == nil && f.fs.roomToKeep(st.Blocks*512) {
			forget = true
			f.kernelHeld, f.heldBytes = true, st.Blocks*512
			f.fs.nheld.Add(1)
			f.fs.heldBytes.Add(f.heldBytes)
			f.heldTimer = time.AfterFunc(kernelHeldMax, f.letGo)
		}
	}
	if forget { // its blocks were just read: doom would read them again
		f.fs.doomWith(f, f.heldBytes)
	} else if doomed {
		f.fs.doom(f)
	}
	if f.nlink == 0 {
		f.cancelHolds()
	}
	f.maybeFree()
	return doomed, forget
}

// spoolHold is one read of a file's spool file by the agent (the early hashing and push of a
// closed file): ended by its holder, or cancelled when the file's last name goes.
type spoolHold struct {
	cancel    context.CancelFunc
	cancelled bool // by cancelHolds, and counted in mtfs.releasing until it ends. GUARDED_BY(fileNode.mu)
}

// cancelHolds cancels f's holds: the file lost its last name, so what they read is of no use,
// and its bytes are freed once they end. A cancelled hold counts as a RELEASE under way until
// it ends, so that the requests waiting for the space wait for it too (space.go). Caller holds
// f.mu.
func (f *fileNode) cancelHolds() {
	for h := range f.holds {
		if !h.cancelled {
			h.cancelled = true
			f.fs.releasing.Add(1)
			h.cancel()
		}
	}
}

// hold starts a hold of f's spool file: its path and a context that ends when the file loses
// its last name (or parent ends); end must be called once the reads are done.
func (f *fileNode) hold(parent context.Context) (string, context.Context, func(), error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.backing == "" || f.nlink == 0 {
		return "", nil, nil, os.ErrNotExist
	}
	ctx, cancel := context.WithCancel(parent)
	h := &spoolHold{cancel: cancel}
	if f.holds == nil {
		f.holds = map[*spoolHold]struct{}{}
	}
	f.holds[h] = struct{}{}
	return f.backing, ctx, func() { f.endHold(h) }, nil
}

// endHold ends hold h (once; later calls do nothing), and frees a doomed file it was the last
// user of.
func (f *fileNode) endHold(h *spoolHold) {
	f.mu.Lock()
	if _, ok := f.holds[h]; !ok {
		f.mu.Unlock()
		return
	}
	delete(f.holds, h)
	if len(f.holds) == 0 {
		f.holds = nil // a map per file hashed, kept for the file's life, was 190 B each (a review)
	}
	h.cancel()
	if h.cancelled {
		f.fs.releasing.Add(-1)
	}
	gone := f.unused()
	f.mu.Unlock()
	if gone {
		f.fs.undoom(f)
	}
}

// unused reports whether nothing keeps f's bytes any more: no name, handle, release under way,
// hold of the agent, or the kernel's reference after the job removed it. Caller holds mu.
func (f *fileNode) unused() bool {
	return f.nlink == 0 && f.opens == 0 && f.releasing == 0 && len(f.holds) == 0 && !f.kernelHeld
}

// heldBy reports whether f's bytes wait for the kernel's FORGET (kernelHeld) and whether a
// handle, release or hold keeps them too.
func (f *fileNode) heldBy() (kernel, handles bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.kernelHeld, f.opens > 0 || f.releasing > 0 || len(f.holds) > 0
}

// kernelHeldMax bounds how long a file the job removed waits for the kernel's FORGET. An open
// racing the removal takes milliseconds; but the kernel also keeps a node for as long as any
// entry of it stays in its cache, and the agent leaves stale entries on purpose when it
// replaces a name (they expire; namespace.install): a file the job had linked under such a
// name, then removed, waited until someone looked that name up again (a review). A variable for
// tests.
var kernelHeldMax = 5 * time.Second

// OnForget runs when go-fuse forgets the node: the kernel holds no reference, and the node is in
// no directory and was let go (ForgetPersistent, after dropLinkBy). Only the nodes the job
// removed are ever let go; the tree keeps the others.
//
// go-fuse runs FORGETs on the goroutine that reads requests, without starting another: removing
// the spool file there (80 ms for 300 MiB on tmpfs) stopped the mount's reading meanwhile, so the
// bytes go on a goroutine of their own, counted as a RELEASE running so that the waits for room
// wait for it (space.go).
func (f *fileNode) OnForget() {
	f.fs.releasing.Add(1)
	go func() {
		defer f.fs.releasing.Add(-1)
		f.letGo()
	}()
}

// letGo ends kernelHeld (OnForget, or kernelHeldMax later): the bytes go now unless a handle
// remains. nheld counts the file until they went (awaitForgets).
func (f *fileNode) letGo() {
	f.mu.Lock()
	if !f.kernelHeld {
		f.mu.Unlock()
		return
	}
	f.kernelHeld = false
	if f.heldTimer != nil {
		f.heldTimer.Stop()
		f.heldTimer = nil
	}
	f.maybeFree()
	gone := f.unused()
	held := f.heldBytes
	f.heldBytes = 0
	f.mu.Unlock()
	f.fs.heldBytes.Add(-held)
	f.fs.nheld.Add(-1)
	if gone {
		f.fs.undoom(f)
	}
}

// maybeFree removes the spool file once no name and no open handle refers to it. Caller holds mu.
func (f *fileNode) maybeFree() {
	if f.nlink > 0 || f.opens > 0 || f.backing == "" || f.lingering || f.kernelHeld {
		return
	}
	f.fs.spool.Reserve(-f.accounted)
	if !f.borrowed {
		os.Remove(f.backing)
	}
	f.accounted, f.backing = 0, ""
}

// released runs when the RELEASE request of one of f's handles is done (see space.go).
func (f *fileNode) released() {
	f.mu.Lock()
	f.releasing--
	gone := f.unused()
	f.mu.Unlock()
	if gone {
		f.fs.undoom(f)
	}
}

func (f *fileNode) CopyFileRange(ctx context.Context, fhIn gofs.FileHandle, offIn uint64, out *gofs.Inode, fhOut gofs.FileHandle, offOut uint64, length uint64, flags uint64) (uint32, syscall.Errno) {
	hin, ok1 := fhIn.(*fileHandle)
	hout, ok2 := fhOut.(*fileHandle)
	if !ok1 || !ok2 || flags != 0 {
		return 0, syscall.EINVAL
	}
	hout.node.dataMu.RLock()
	defer hout.node.dataMu.RUnlock()
	var n int
	errno := retryNoSpace(f.fs, func() syscall.Errno {
		if errno := hout.charge(int64(offOut + length)); errno != 0 {
			return errno
		}
		oi, oo := int64(offIn), int64(offOut)
		var err error
		n, err = unix.CopyFileRange(hin.fd, &oi, hout.fd, &oo, int(length), 0)
		return f.fs.toErrno("copy_file_range", err)
	})
	if errno != 0 {
		return 0, errno
	}
	return uint32(n), 0
}

// tooLarge reports a refused write past limit to the listener.
func (f *fileNode) tooLarge() {
	// Once per file: each further write of the same oversized yaml (O_APPEND in pieces) made
	// one more identical FATAL line (black-box h60).
	if f.fs.events != nil && f.toldTooLarge.CompareAndSwap(false, true) {
		path := f.Path(nil)
		f.fs.events.TooLarge(path)
	}
}

// fileHandle is one open of a fileNode: an fd on the spool file.
type fileHandle struct {
	node     *fileNode
	fd       int
	writable bool
	// commitsOnClose: the kernel sends FLUSH at each close(2) of this handle's descriptors, and
	// the first one reports the commit (Events.Flushed) before close returns.
	commitsOnClose bool
	// name is the top-level name a handle that commitsOnClose was opened under.
	name    string
	flushed bool // GUARDED_BY(node.mu); no longer counted in node.writers
	// direct: the kernel may read and write the spool file itself (passthrough). Decided at
	// the open: go-fuse asks PassthroughFd only of an inode's first open, and later opens
	// share its backing file (a review: a handle opened after a reader's never counted).
	direct bool
	// opener is the process (thread group) that opened the handle, 0 if unknown: the writer,
	// for a .save (torch.save opens, writes and closes in one process).
	opener int
	// abandoned: the opener was killed by a signal with the handle open (killedBy) before it
	// closed it: no close commits (a forked child holding the descriptor may outlive it).
	// GUARDED_BY(node.mu)
	abandoned bool
	signal    int // GUARDED_BY(node.mu); the signal that killed the opener, when abandoned
	// noRoom: a close of this .save found the budget used up (noRoomLeft) and did not commit it;
	// its release does not either, whatever room there is by then (a review).
	noRoom bool // GUARDED_BY(node.mu)
}

var (
	_ = (gofs.FilePassthroughFder)((*fileHandle)(nil))
	_ = (gofs.FileReader)((*fileHandle)(nil))
	_ = (gofs.FileWriter)((*fileHandle)(nil))
	_ = (gofs.FileFsyncer)((*fileHandle)(nil))
	_ = (gofs.FileFlusher)((*fileHandle)(nil))
	_ = (gofs.FileReleaser)((*fileHandle)(nil))
	_ = (gofs.FileAllocater)((*fileHandle)(nil))
	_ = (gofs.FileLseeker)((*fileHandle)(nil))
)

// PassthroughFd lets the kernel do reads, writes and mmap on the spool file directly.
func (h *fileHandle) PassthroughFd() (int, bool) {
	return h.fd, h.node.fs.passthrough.Load() && h.node.limit == 0
}

func (h *fileHandle) Read(ctx context.Context, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	// Spliced from the spool file to the kernel: the bytes never enter the Go heap.
	return fuse.ReadResultFd(uintptr(h.fd), off, len(dest)), 0
}

// changedControl notes a change to the bytes of a control file (ctlChanges).
func (f *fileNode) changedControl() {
	if f.limit > 0 {
		f.ctlChanges.Add(1)
	}
}

// isControl reports whether f is a control file (replicator.yaml) by its name now: the size
// limit stays with a node renamed away, the exemptions from the budget must not (a job renaming
// replicator.yaml.tmp to other names would overdraw it at will; found by a review).
func (f *fileNode) isControl() bool {
	if f.limit == 0 {
		return false
	}
	name, parent := f.Parent()
	return parent != nil && parent.IsRoot() && tiers.WriteLimit(name) > 0
}

// charge checks a write, copy or allocation that makes the file end at end: a committed file
// is immutable (EROFS), then the size limit of control files (EFBIG, reported as TooLarge),
// then the agent-side budget.
func (h *fileHandle) charge(end int64) syscall.Errno {
	if h.node.isFrozen() {
		return syscall.EROFS
	}
	if l := h.node.limit; l > 0 && end > l {
		h.node.tooLarge()
		return syscall.EFBIG
	}
	if h.node.fs.spool.KernelEnforced() {
		return 0
	}
	control := h.node.isControl() // before mu: it takes go-fuse's lock of the tree
	h.node.mu.Lock()
	defer h.node.mu.Unlock()
	if control && end > h.node.accounted {
		// A control file (replicator.yaml, at most its limit) is written even past the budget:
		// a job that used it up (a save cut short, a kept spool larger than the budget) must
		// still be able to restart, which restores from RAM (found by a black-box run).
		h.node.chargeImported(end)
		return 0
	}
	return h.node.fs.toErrno("write", h.node.chargeTo(end, false))
}

func (h *fileHandle) Write(ctx context.Context, data []byte, off int64) (uint32, syscall.Errno) {
	h.node.dataMu.RLock()
	defer h.node.dataMu.RUnlock()
	var n int
	errno := retryNoSpace(h.node.fs, func() syscall.Errno {
		if errno := h.charge(off + int64(len(data))); errno != 0 {
			return errno
		}
		if hook := writeHook.Load(); hook != nil {
			(*hook)(h.node.Path(nil))
		}
		var err error
		n, err = unix.Pwrite(h.fd, data, off)
		// A control file takes one chunk of the headroom kept for the agent's records when the
		// job filled the spool's tmpfs (see charge): a yaml fits in one.
		if n <= 0 && errors.Is(err, unix.ENOSPC) && h.node.isControl() && h.node.fs.spool.UseHeadroom(err) {
			n, err = unix.Pwrite(h.fd, data, off)
		}
		if err != nil && n <= 0 {
			return h.node.fs.toErrno("write", err)
		}
		h.node.changedControl()
		return 0
	})
	switch {
	case errno != 0:
		h.node.fs.refusedWrite(ctx, h.node, errno)
		return 0, errno
	case n < len(data):
		h.node.fs.refusedWrite(ctx, h.node, syscall.ENOSPC) // the spool's tmpfs took a part only
	}
	return uint32(n), 0
}

// retryNoSpace runs op once more if it failed with ENOSPC and a deleted file's bytes were freed
// since it started, waiting for the releases that are pending (space.go).
func retryNoSpace(m *mtfs, op func() syscall.Errno) syscall.Errno {
	gen := m.freedGen.Load()
	errno := op()
	if errno == syscall.ENOSPC {
		m.awaitReleasesFor(nil, releaseGraceFailed)
		if m.freedGen.Load() != gen {
			errno = op()
		}
	}
	return errno
}

func (h *fileHandle) Fsync(ctx context.Context, flags uint32) syscall.Errno {
	return h.node.fs.toErrno("fsync", unix.Fsync(h.fd))
}

// Flush is only sent for handles that may commit a step when closed (every other open carries
// FOPEN_NOFLUSH, so that close(2) costs no round trip to the agent). It reports the close to
// the listener, which records the commit before close(2) returns. From then on the handle no
// longer counts as a writer: the file is linked, not copied, into the checkpoint. Writes through
// a duplicate of the descriptor after that are the job's bug: without passthrough they fail;
// with it, the sealer copies the file if the handle outlives the close (flushedOpen).
// A close of a file committed already (frozen), or while another close reports it (committing),
// is no commit of its own and is not reported.
func (h *fileHandle) Flush(ctx context.Context) syscall.Errno {
	if !h.commitsOnClose {
		return 0
	}
	f := h.node
	caller := callerProcess(ctx)
	if h.opener != 0 && caller != 0 && caller != h.opener {
		// Another process holding the descriptor closed it (a forked child, killed or not,
		// a child closing what it inherited before its exec): not the writer's close. The
		// writer's close commits; a child's commit came while the writer still wrote, and a
		// killed child's refused a whole file (found by a black-box run). Should the writer's
		// close never come through here, the last release commits (Closed).
		return 0
	}
	sig := killedBy(ctx)
	if sig != 0 && (h.opener == 0 || caller != h.opener) {
		sig = 0 // not known to be the writer's death: a close like any other
	}
	short := ""
	if sig == 0 {
		short = cutShort(h.fd)
	}
	if sig == 0 && short == "" && !isZip(h.fd) && f.fs.noRoomLeft() {
		f.mu.Lock()
		h.noRoom = true
		f.mu.Unlock()
	}
	if sig == 0 && (short != "" || h.isNoRoom()) {
		// A zip (torch.save writes one) without its end: its writer has not finished it, or
		// never will (killed, seen from another pid namespace where the checks above see
		// nothing). Not a commit now; a later close may find it whole, the last release
		// abandons it (found by a review: the deployments' pods see no pids). So for any .save
		// closed with the budget used up: a write to it most likely failed with ENOSPC, and a
		// raw one cut short so was committed, and replaced the step before it (found by a
		// black-box run; a zip's end tells, other formats do not).
		return 0
	}
	f.mu.Lock()
	first := !h.flushed && !h.abandoned
	// A file committed already (by another handle's close, or a link: it is frozen) is no
	// commit of this close; claimed under mu, so that two handles closed at once do not both
	// commit it (a review: two records of one file).
	fresh := first && sig == 0 && !f.isFrozen() && !f.committing
	if fresh {
		f.committing = true
	}
	if first {
		if sig != 0 {
			h.abandoned, h.signal = true, sig
		} else {
			h.flushed = true
			if h.direct {
				f.flushedOpen++
			}
		}
		f.dropWriter()
	}
	f.mu.Unlock()
	if fresh {
		f.fs.events.Flushed(h.closedPath())
		f.mu.Lock()
		f.committing = false // frozen now if it was taken; a later close may commit it if not
		f.mu.Unlock()
	}
	return 0
}

// isNoRoom reports h.noRoom.
func (h *fileHandle) isNoRoom() bool {
	h.node.mu.Lock()
	defer h.node.mu.Unlock()
	return h.noRoom
}

// isZip reports whether the file open at fd begins as a zip archive (torch.save writes one):
// whether it is whole, its end tells (tornZip), not the room left.
func isZip(fd int) bool {
	var head [4]byte
	n, err := unix.Pread(fd, head[:], 0)
	return err == nil && n == len(head) && string(head[:]) == "PK\x03\x04"
}

// noRoomLeft reports whether the budget is used up to its last page: a write to a raw .save
// closed then most likely failed with ENOSPC (with passthrough the agent does not see the write).
func (m *mtfs) noRoomLeft() bool {
	total, used := m.spool.Usage()
	return total-used < 4096
}

// cutShort says why the .save open at fd cannot be a whole one ("": it may be): empty (a writer
// killed between its open and its first write, or whose forked child closed the descriptor
// first; found by a black-box run), or a zip without its end (tornZip).
func cutShort(fd int) string {
	var st unix.Stat_t
	switch {
	case unix.Fstat(fd, &st) == nil && st.Size == 0:
		return "empty: its writer did not write it"
	case tornZip(fd):
		return "a zip archive without its end (torch.save writes one): its writer did not finish it"
	}
	return ""
}

// tornZip reports whether the file open at fd begins as a zip archive and lacks the record a
// zip writer writes last, at its end (end of central directory): an archive its writer did not
// finish. Other files say nothing (false).
func tornZip(fd int) bool {
	var head [4]byte
	if n, err := unix.Pread(fd, head[:], 0); err != nil || n < len(head) || string(head[:]) != "PK\x03\x04" {
		return false
	}
	var st unix.Stat_t
	if unix.Fstat(fd, &st) != nil {
		return false
	}
	const eocd = 22 // the record without its comment, which is at most 65535 bytes
	tail := make([]byte, min(st.Size, eocd+0xffff))
	if n, err := unix.Pread(fd, tail, st.Size-int64(len(tail))); err != nil || n != len(tail) {
		return false
	}
	for i := len(tail) - eocd; i >= 0; i-- {
		if string(tail[i:i+4]) == "PK\x05\x06" && i+eocd+int(binary.LittleEndian.Uint16(tail[i+20:])) == len(tail) {
			return false
		}
	}
	return true
}

// callerProcess returns the process (thread group id) of the caller of the request on ctx, 0 if
// it cannot be told.
func callerProcess(ctx context.Context) int {
	c, ok := ctx.(*fuse.Context)
	if !ok || c.Caller.Pid == 0 {
		return 0
	}
	return tgid(int(c.Caller.Pid))
}

// tgid returns the thread group of thread tid (0: unknown).
func tgid(tid int) int {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(tid) + "/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "Tgid:"); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	return 0
}

// pfExiting is the kernel's PF_EXITING task flag: the task is in exit.
const pfExiting = 0x4

// killedBy returns the signal that is killing the process whose request ctx is (the kernel
// closes its files as it exits), 0 if none or if that cannot be told (no caller, a caller in
// another pid namespace, /proc unreadable).
func killedBy(ctx context.Context) int {
	c, ok := ctx.(*fuse.Context)
	if !ok || c.Caller.Pid == 0 {
		return 0
	}
	b, err := os.ReadFile("/proc/" + strconv.FormatUint(uint64(c.Caller.Pid), 10) + "/stat")
	if err != nil {
		return 0
	}
	// After the command's closing parenthesis: the state is field 3, flags field 9,
	// exit_code field 52 (proc(5)); exit_code is set before the files are closed.
	fields := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
	if len(fields) < 50 {
		return 0
	}
	flags, err1 := strconv.ParseUint(fields[6], 10, 64)
	code, err2 := strconv.Atoi(fields[49])
	if err1 != nil || err2 != nil || flags&pfExiting == 0 {
		return 0
	}
	return code & 0x7f
}

func (h *fileHandle) Release(ctx context.Context) syscall.Errno {
	f := h.node
	f.mu.Lock()
	why := ""
	switch {
	case h.abandoned:
		name := unix.SignalName(unix.Signal(h.signal))
		if name == "" {
			name = fmt.Sprintf("signal %d", h.signal) // a real-time one
		}
		why = fmt.Sprintf("closed by the process that wrote it while a signal (%s) killed it", name)
	case h.commitsOnClose && !h.flushed:
		why = cutShort(h.fd)
		if why == "" && (h.noRoom || (!isZip(h.fd) && f.fs.noRoomLeft())) {
			why = "closed with no room left for it"
		}
	}
	f.mu.Unlock()
	err := unix.Close(h.fd)
	f.mu.Lock()
	f.opens--
	f.releasing++
	if h.writable && !h.flushed && !h.abandoned {
		f.dropWriter()
	}
	if h.flushed && h.direct {
		f.flushedOpen--
	}
	f.maybeFree()
	f.mu.Unlock()
	f.fs.afterRelease(ctx, f.released)
	if h.writable && f.fs.events != nil {
		if why != "" {
			// torch.save that met ENOSPC aborts its process: the line named only the signal
			// (found by a black-box run). Looked at only then: a statfs per release cost every
			// small file's close.
			if total, used := f.fs.spool.Usage(); total-used < 1<<20 {
				why += fmt.Sprintf("; this node's RAM budget is full (--memory %s): a write may have failed with ENOSPC first", tiers.FormatSize(total))
			}
		}
		if why != "" {
			f.fs.events.Abandoned(h.closedPath(), why)
		} else {
			f.fs.events.Closed(h.closedPath())
		}
	}
	return h.node.fs.toErrno("release", err)
}

func (h *fileHandle) Allocate(ctx context.Context, off uint64, size uint64, mode uint32) syscall.Errno {
	h.node.dataMu.RLock()
	defer h.node.dataMu.RUnlock()
	if h.node.isFrozen() {
		return syscall.EROFS
	}
	return retryNoSpace(h.node.fs, func() syscall.Errno {
		if mode&unix.FALLOC_FL_KEEP_SIZE == 0 {
			if errno := h.charge(int64(off + size)); errno != 0 {
				return errno
			}
		}
		h.node.changedControl()
		return h.node.fs.toErrno("fallocate", unix.Fallocate(h.fd, mode, int64(off), int64(size)))
	})
}

func (h *fileHandle) Lseek(ctx context.Context, off uint64, whence uint32) (uint64, syscall.Errno) {
	n, err := unix.Seek(h.fd, int64(off), int(whence))
	if err != nil {
		return 0, h.node.fs.toErrno("lseek", err)
	}
	return uint64(n), 0
}
