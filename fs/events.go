package fs

import (
	"context"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// eventFS wraps go-fuse's raw bridge so that events are delivered after go-fuse has applied a
// change to its inode tree: our node methods run before the bridge moves or removes the child,
// so they only park the event, keyed by the request's cancel channel (unique per request), and
// the wrapper emits it once the whole operation returned OK.
type eventFS struct {
	fuse.RawFileSystem
	m *mtfs
}

func (e *eventFS) Rename(cancel <-chan struct{}, in *fuse.RenameIn, oldName, newName string) fuse.Status {
	return e.emit(cancel, e.RawFileSystem.Rename(cancel, in, oldName, newName))
}

// Mkdir, Symlink, Mknod and Link at the root report the new name (dirNode.created) once go-fuse
// has added it to the tree.
func (e *eventFS) Mkdir(cancel <-chan struct{}, in *fuse.MkdirIn, name string, out *fuse.EntryOut) fuse.Status {
	return e.emit(cancel, e.RawFileSystem.Mkdir(cancel, in, name, out))
}

func (e *eventFS) Symlink(cancel <-chan struct{}, h *fuse.InHeader, target, name string, out *fuse.EntryOut) fuse.Status {
	return e.emit(cancel, e.RawFileSystem.Symlink(cancel, h, target, name, out))
}

func (e *eventFS) Mknod(cancel <-chan struct{}, in *fuse.MknodIn, name string, out *fuse.EntryOut) fuse.Status {
	return e.emit(cancel, e.RawFileSystem.Mknod(cancel, in, name, out))
}

func (e *eventFS) Link(cancel <-chan struct{}, in *fuse.LinkIn, name string, out *fuse.EntryOut) fuse.Status {
	return e.emit(cancel, e.RawFileSystem.Link(cancel, in, name, out))
}

// emit sends what the request parked, if its operation succeeded, and returns its status.
func (e *eventFS) emit(cancel <-chan struct{}, st fuse.Status) fuse.Status {
	e.m.emitParked(cancel, st)
	return st
}

// Release frees a file's bytes through the node's handle; what the handle parked (see
// mtfs.afterRelease) runs once go-fuse has also unregistered the passthrough backing file.
func (e *eventFS) Release(cancel <-chan struct{}, in *fuse.ReleaseIn) {
	if hook := releaseHook.Load(); hook != nil {
		(*hook)()
	}
	e.m.release(cancel, func() { e.RawFileSystem.Release(cancel, in) })
}

// Write and Writev note the requests that write back pages of the kernel's page cache (pages a
// job dirtied through a mapping), by their cancel channel, for fileHandle.Write: a refused one
// loses bytes no system call of the job reports (writeback.go).
func (e *eventFS) Write(cancel <-chan struct{}, in *fuse.WriteIn, data []byte) (uint32, fuse.Status) {
	if in.WriteFlags&fuse.WRITE_CACHE != 0 && cancel != nil {
		e.m.pageWrites.Store(cancel, struct{}{})
		defer e.m.pageWrites.Delete(cancel)
	}
	return e.RawFileSystem.Write(cancel, in, data)
}

func (e *eventFS) Writev(cancel <-chan struct{}, in *fuse.WriteIn, data [][]byte) (uint32, fuse.Status) {
	if in.WriteFlags&fuse.WRITE_CACHE != 0 && cancel != nil {
		e.m.pageWrites.Store(cancel, struct{}{})
		defer e.m.pageWrites.Delete(cancel)
	}
	return e.RawFileSystem.Writev(cancel, in, data)
}

// park stores ev for the request running on ctx; it is called by node methods. Without a
// request (a call that did not come through the kernel) ev runs at once.
func (m *mtfs) park(ctx context.Context, ev func()) {
	if m.events == nil {
		return
	}
	if c, ok := ctx.(*fuse.Context); ok && c.Cancel != nil {
		m.parked.Store(c.Cancel, ev)
		return
	}
	ev()
}

func (m *mtfs) emitParked(cancel <-chan struct{}, st fuse.Status) {
	if m.events == nil || cancel == nil {
		return
	}
	if ev, ok := m.parked.LoadAndDelete(cancel); ok && st == fuse.OK {
		ev.(func())()
	}
}
