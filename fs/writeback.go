package fs

import (
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
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
// The agent writes that notification itself (go-fuse's InodeNotify), not through the helper of
// the entry notifications (notifier.go): the helper takes one notification at a time, and an
// entry invalidation of the root waits for the root's lock, which the job's rename holds in the
// kernel while it waits for this very request: the rename, the helper and this handler would
// wait on each other for ever (found by a review). An invalidation of a file's pages takes no
// directory lock. The price: a kill -9 that lands while the kernel writes the pages back leaves
// the agent's thread waiting for WRITE replies nobody sends, as the entry notifications did
// before the helper; the next mtcfs mount detaches such a mount.

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

// writeBackUnder has the kernel write back what the job wrote through mappings of the files
// at or below in that still have handles that may write (see above).
func (m *mtfs) writeBackUnder(in *gofs.Inode) {
	m.writersMu.Lock()
	if len(m.writing) == 0 {
		m.writersMu.Unlock()
		return
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
		// ENOENT: the kernel holds no inode for it, so no page either.
		if errno := f.NotifyContent(0, 0); errno != 0 && errno != unix.ENOENT && errno != syscall.ENOSYS {
			m.log.Warn("have the kernel write back what the job wrote through a mapping before a rename", "path", f.Path(nil), "err", errno)
		}
	}
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
