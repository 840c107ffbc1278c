package fs

import (
	"context"
	"fmt"
	"maps"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// Pages a job dirtied through a shared writable mapping (mmap MAP_SHARED) live in the kernel's
// page cache of the FUSE inode until the kernel writes them back: at msync, at munmap and close,
// or whenever its writeback runs. On the fallback data path (no passthrough) the agent's spool
// file does not have them before that, although a read(2) through the mount already returns
// them. A job that renamed its step to commit it while such a mapping was still open got a
// checkpoint without those bytes, and the kernel's later write-back failed on the sealed file
// (EROFS at msync, nothing at munmap): silent loss, found by a black-box run. (Through
// passthrough the mapping is of the spool file itself.)
//
// So a rename first has the kernel write back the dirty pages of every file below the renamed
// entry that still has a handle that may write (a mapping keeps its handle open): an
// invalidation of the file's pages, which the kernel answers by writing each dirty page to the
// agent (WRITE requests that other readers serve) before it drops it. Files without such a
// handle, the usual case at a commit, cost nothing.
//
// The notification is written by a helper process of its own (kernelNotifier's pages channel,
// notifier.go), not by the agent's thread: the write(2) returns only once the kernel has written
// every dirty page back, with WRITE requests the agent's readers answer, and a kill -9 that
// landed meanwhile left that thread waiting for replies no thread would send any more, and the
// mount hung until the next mtcfs mount took it over (found by a review). It is not the helper
// of the entry notifications either: the helper takes one notification at a time, and an entry
// invalidation of the root waits for the root's lock, which the job's rename holds in the kernel
// while it waits for this very request: the rename, the helper and this handler would wait on
// each other for ever (found by a review). An invalidation of a file's pages takes no directory
// lock.
//
// A page the agent refuses to store (ENOSPC: the spool is full), at the rename or at any time
// before it (the kernel also writes dirty pages back on its own, and at munmap), is dropped by
// the kernel: no system call of the job reports it for sure, and the checkpoint would lack it
// without a word. Such a file is remembered, and a rename that would commit it fails with the
// WRITE's errno: the job's save fails, and the step is not committed.

// addWriter counts a handle of f that may write. Caller holds f.mu.
func (f *fileNode) addWriter() {
	f.writers++
	if f.writers == 1 {
		m := f.fs
		m.writersMu.Lock()
		if m.writing == nil {
			m.writing = map[*fileNode]struct{}{}
		}
		m.writing[f] = struct{}{}
		m.writersMu.Unlock()
	}
}

// dropWriter uncounts a handle of f that may write. Caller holds f.mu.
func (f *fileNode) dropWriter() {
	f.writers--
	if f.writers == 0 {
		m := f.fs
		m.writersMu.Lock()
		delete(m.writing, f)
		m.writersMu.Unlock()
	}
}

// refusedWrite notes a WRITE to f that the agent failed (or stored in part) with errno; if it
// wrote back pages of the kernel's page cache (eventFS.Write), f is lossy.
func (m *mtfs) refusedWrite(ctx context.Context, f *fileNode, errno syscall.Errno) {
	c, ok := ctx.(*fuse.Context)
	if !ok || c.Cancel == nil {
		return
	}
	if _, page := m.pageWrites.Load(c.Cancel); !page {
		return // the job's write(2) returns the error
	}
	m.writersMu.Lock()
	if m.lossy == nil {
		m.lossy = map[*fileNode]syscall.Errno{}
	}
	_, known := m.lossy[f]
	m.lossy[f] = errno
	m.writersMu.Unlock()
	if !known {
		m.log.Warn("the kernel wrote back pages the job wrote through a mapping, and the agent could not store them: they are lost, and a rename that would commit the file fails", "path", f.Path(nil), "err", errno)
	}
}

// LostPagesError is why a checkpoint cannot take a file: pages the job wrote through a mapping
// were refused (Errno) when the kernel wrote them back, and the kernel dropped them.
type LostPagesError struct{ Errno syscall.Errno }

func (e *LostPagesError) Error() string {
	return fmt.Sprintf("bytes the job wrote through a shared mapping could not be stored when the kernel wrote them back (%v); they are lost", e.Errno)
}

func (e *LostPagesError) Unwrap() error { return e.Errno }

// rewritten forgets that f lost pages: the job truncated it to nothing (a rewrite starts so),
// and what it writes from then on is checked anew. Caller holds f.mu.
func (m *mtfs) rewritten(f *fileNode) {
	m.writersMu.Lock()
	delete(m.lossy, f)
	m.writersMu.Unlock()
}

// lostPages returns the errno of a refused write-back of f's pages (0: none).
func (m *mtfs) lostPages(f *fileNode) syscall.Errno {
	m.writersMu.Lock()
	defer m.writersMu.Unlock()
	return m.lossy[f]
}

// writeBackUnder has the kernel write back what the job wrote through mappings of the files
// at or below in that still have handles that may write (see above). It returns the errno of a
// page write-back the agent refused for a file at or below in, now or before (0: none).
func (m *mtfs) writeBackUnder(in *gofs.Inode) syscall.Errno {
	m.writersMu.Lock()
	if len(m.writing) == 0 && len(m.lossy) == 0 {
		m.writersMu.Unlock()
		return 0
	}
	var files []*fileNode
	for f := range m.writing {
		files = append(files, f)
	}
	m.writersMu.Unlock()
	for _, f := range files {
		if !below(&f.Inode, in) {
			continue
		}
		var errno syscall.Errno
		if e := m.notifier.Load(); e != nil {
			errno = gofs.ToErrno(e.writeBackPages(f.NodeID()))
		} else {
			errno = f.NotifyContent(0, 0)
		}
		// ENOENT: the kernel holds no inode for it, so no page either.
		if errno != 0 && errno != unix.ENOENT && errno != syscall.ENOSYS {
			m.log.Warn("have the kernel write back what the job wrote through a mapping before a rename", "path", f.Path(nil), "err", errno)
		}
	}
	m.writersMu.Lock()
	lossy := maps.Clone(m.lossy)
	m.writersMu.Unlock()
	var failed syscall.Errno
	for f, errno := range lossy {
		if _, parent := f.Parent(); parent == nil {
			m.writersMu.Lock()
			delete(m.lossy, f) // removed from the tree: nothing to commit
			m.writersMu.Unlock()
			continue
		}
		if failed == 0 && below(&f.Inode, in) {
			m.log.Warn("a rename would commit a file that lacks pages the job wrote through a mapping; it fails", "path", f.Path(nil), "err", errno)
			failed = errno
		}
	}
	return failed
}

// roomForCopies returns ENOSPC when the files at or below in that are still open for writing,
// which a commit copies into the checkpoint instead of linking them (exportTo), do not fit in
// the free space of a kernel-enforced spool: the commit's rename then fails, instead of
// returning and leaving a step that cannot be sealed and that holds its bytes until the next
// replicator.yaml (found by a black-box run). Releases under way are waited for first, as
// exportTo does, so that files just closed are not counted. (An agent-accounted budget lets
// the copies past it.)
func (m *mtfs) roomForCopies(in *gofs.Inode) syscall.Errno {
	if !m.spool.KernelEnforced() {
		return 0
	}
	open := func() (files []*fileNode) {
		m.writersMu.Lock()
		defer m.writersMu.Unlock()
		for f := range m.writing {
			files = append(files, f)
		}
		return files
	}
	var files []*fileNode
	for _, f := range open() {
		if below(&f.Inode, in) {
			files = append(files, f)
		}
	}
	if len(files) == 0 {
		return 0
	}
	m.settle(func() bool {
		for _, f := range files {
			f.mu.Lock()
			w := f.writers
			f.mu.Unlock()
			if w != 0 {
				return false
			}
		}
		return true
	})
	var need int64
	for _, f := range files {
		f.mu.Lock()
		if f.writers != 0 && f.backing != "" {
			var st unix.Stat_t
			if unix.Stat(f.backing, &st) == nil {
				need += (st.Size + 4095) &^ 4095
			}
		}
		f.mu.Unlock()
	}
	var fs unix.Statfs_t
	if need == 0 || unix.Statfs(m.spool.Dir(), &fs) != nil {
		return 0
	}
	if free := int64(fs.Bavail) * int64(fs.Bsize); need > free {
		m.log.Warn("a commit's rename fails: files of the step still open for writing are copied into the checkpoint, and the copies do not fit in the spool (close them before the rename, or give --memory more)",
			"path", in.Path(nil), "copies", need, "free", free)
		return syscall.ENOSPC
	}
	return 0
}

// below reports whether in is top or lies below it (by its first name).
func below(in, top *gofs.Inode) bool {
	for n := in; n != nil; {
		if n == top {
			return true
		}
		_, n = n.Parent()
	}
	return false
}
