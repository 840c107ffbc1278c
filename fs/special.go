package fs

import (
	"context"
	"os"
	"sync/atomic"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
)

// links counts the names of a node that has no spool file (symlinks, special files).
type links struct{ nlink atomic.Int32 }

func (l *links) count() uint32 { return uint32(max(0, l.nlink.Load())) }

func (l *symlinkNode) addLink()  { l.nlink.Add(1); l.touch(false) }
func (l *symlinkNode) dropLink() { l.nlink.Add(-1); l.touch(false) }

// specialNode is a FIFO, a unix socket or a device node. The kernel serves opens of such files
// itself (a FIFO's pipe, a socket's connection and a device's driver never reach the agent);
// the node only keeps the attributes, as tmpfs does.
type specialNode struct {
	gofs.Inode
	meta
	links
	rdev uint32
}

var (
	_ = (gofs.NodeGetattrer)((*specialNode)(nil))
	_ = (gofs.NodeSetattrer)((*specialNode)(nil))
	_ = (gofs.NodeGetxattrer)((*specialNode)(nil))
	_ = (gofs.NodeSetxattrer)((*specialNode)(nil))
	_ = (gofs.NodeRemovexattrer)((*specialNode)(nil))
	_ = (gofs.NodeListxattrer)((*specialNode)(nil))
)

func newSpecialNode(ctx context.Context, mode, rdev uint32) *specialNode {
	n := &specialNode{rdev: rdev}
	n.init(ctx, mode)
	n.nlink.Store(1)
	return n
}

func (n *specialNode) addLink()  { n.nlink.Add(1); n.touch(false) }
func (n *specialNode) dropLink() { n.nlink.Add(-1); n.touch(false) }

func (n *specialNode) Getattr(ctx context.Context, fh gofs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	n.mu.Lock()
	n.fill(&out.Attr)
	n.mu.Unlock()
	out.Nlink = n.count()
	out.Rdev = n.rdev
	out.Blksize = 4096
	return 0
}

func (n *specialNode) Setattr(ctx context.Context, fh gofs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	if n.isFrozen() {
		return syscall.EROFS
	}
	n.mu.Lock()
	n.setattr(in)
	n.mu.Unlock()
	return n.Getattr(ctx, fh, out)
}

// newSpecial adds a special node for Mknod.
func (d *dirNode) newSpecial(ctx context.Context, name string, mode, rdev uint32, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	n := newSpecialNode(ctx, mode, rdev)
	d.inherit(&n.meta, false)
	ch := d.NewPersistentInode(ctx, n, gofs.StableAttr{Mode: mode & syscall.S_IFMT, Ino: d.fs.newIno()})
	d.touch(true)
	d.created(ctx, name, specialType(mode))
	return ch, d.fillEntry(ctx, ch, out)
}

// canMknodDevices reports whether this process may create device nodes in its spool: a device
// node in a checkpoint must be recreated there when the step is sealed.
func canMknodDevices() bool { return os.Geteuid() == 0 }
