// Command fuseanchor serves fsbench's go-fuse floor: the least a go-fuse server without
// passthrough does, mounted with the settings mtcfs mounts with, so that what mtcfs adds on top
// of FUSE and go-fuse can be told apart from what they cost on this machine.
//
//	fuseanchor MOUNTPOINT DIR    go-fuse's loopback of DIR, passthrough off
//	fuseanchor -mem MOUNTPOINT   an in-memory tree that stores no file bytes
//
// The loopback mode (fsbench's sequential workloads) serves go-fuse's own loopback filesystem
// (fs.LoopbackNode and fs.LoopbackFile, unchanged) with passthrough turned off: every read and
// write goes through the server, as on mtcfs without passthrough (--passthrough off, or a
// non-root agent), and each WRITE is a pwrite into DIR's file, as mtcfs's is into its spool.
// go-fuse's loopback example (fsbench's FUSE anchor) cannot serve these rows: it registers every
// file for passthrough when it runs as root, and it asks for 128 KiB requests.
//
// The memory mode (create, stat and small-file workloads) keeps directories and files as go-fuse
// inodes and stores no file bytes: a write only moves the file's size, a read returns zeros up
// to it. A create, a lookup, a getattr, a write or a read is answered without a system call
// behind it, so these rows show FUSE's round trips and go-fuse's request loop alone. (go-fuse's
// fs.MemRegularFile, which keeps the bytes in a Go slice, wrote 10,000 × 64 KiB files at half
// the rate of mtcfs: the copy into the heap and its garbage collection, not a floor.)
//
// Both modes share mtcfs's mount settings (fs/mount.go): requests of up to 1 MiB (MaxWrite,
// MaxReadAhead), default_permissions, extended attributes off (with them on, the kernel asks
// for security.capability before every write), the kernel page cache kept across opens
// (FOPEN_KEEP_CACHE) and not dropped on a new mtime (ExplicitDataCacheControl), 5 s entry,
// attribute and negative-entry timeouts. Neither has mtcfs's spool budget, hashing, commit tracking or replication. It runs
// until SIGINT or SIGTERM, then unmounts; it must run as root (direct mount).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
)

// node is go-fuse's loopback node; its files are returned without their passthrough descriptor.
type node struct{ *fs.LoopbackNode }

// WrapChild makes every node under the root a node as well.
func (n *node) WrapChild(ctx context.Context, ops fs.InodeEmbedder) fs.InodeEmbedder {
	return &node{ops.(*fs.LoopbackNode)}
}

// noPassthrough hides go-fuse's FilePassthroughFder, so go-fuse registers no backing file and
// the kernel sends reads and writes to this server.
type noPassthrough struct{ *fs.LoopbackFile }

func (noPassthrough) PassthroughFd() (int, bool) { return -1, false }

func wrap(fh fs.FileHandle) fs.FileHandle {
	if lf, ok := fh.(*fs.LoopbackFile); ok {
		return noPassthrough{lf}
	}
	return fh
}

func (n *node) Open(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	fh, fl, errno := n.LoopbackNode.Open(ctx, flags)
	return wrap(fh), fl | fuse.FOPEN_KEEP_CACHE, errno
}

func (n *node) Create(ctx context.Context, name string, flags, mode uint32, out *fuse.EntryOut) (*fs.Inode, fs.FileHandle, uint32, syscall.Errno) {
	ch, fh, fl, errno := n.LoopbackNode.Create(ctx, name, flags, mode, out)
	return ch, wrap(fh), fl | fuse.FOPEN_KEEP_CACHE, errno
}

func main() {
	mem := flag.Bool("mem", false, "serve an in-memory tree instead of a loopback of DIR")
	flag.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: fuseanchor MOUNTPOINT DIR | fuseanchor -mem MOUNTPOINT")
	}
	flag.Parse()
	var root fs.InodeEmbedder
	switch {
	case *mem && flag.NArg() == 1:
		root = &memDir{mode: 0o755}
	case !*mem && flag.NArg() == 2:
		var err error
		if root, err = loopback(flag.Arg(1)); err != nil {
			fmt.Fprintln(os.Stderr, "fuseanchor:", err)
			os.Exit(1)
		}
	default:
		flag.Usage()
		os.Exit(2)
	}
	if err := serve(flag.Arg(0), root, flag.Arg(flag.NArg()-1)); err != nil {
		fmt.Fprintln(os.Stderr, "fuseanchor:", err)
		os.Exit(1)
	}
}

// loopback returns go-fuse's loopback root of dir, its nodes wrapped to hide passthrough.
func loopback(dir string) (fs.InodeEmbedder, error) {
	root, err := fs.NewLoopbackRoot(dir)
	if err != nil {
		return nil, err
	}
	lb, ok := root.(*fs.LoopbackNode)
	if !ok {
		return nil, fmt.Errorf("go-fuse's loopback root is a %T, not a *fs.LoopbackNode", root)
	}
	top := &node{lb}
	lb.RootData.RootNode = top
	return top, nil
}

// memDir is a directory of the in-memory tree; go-fuse's inode tree holds its children, and
// lists and looks them up itself.
type memDir struct {
	fs.Inode
	mode uint32 // permission bits
}

var (
	_ fs.NodeMkdirer   = (*memDir)(nil)
	_ fs.NodeCreater   = (*memDir)(nil)
	_ fs.NodeUnlinker  = (*memDir)(nil)
	_ fs.NodeRmdirer   = (*memDir)(nil)
	_ fs.NodeGetattrer = (*memDir)(nil)
)

func (d *memDir) Getattr(ctx context.Context, fh fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Mode = syscall.S_IFDIR | d.mode
	out.Nlink = 2
	return 0
}

func (d *memDir) Mkdir(ctx context.Context, name string, mode uint32, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	out.Mode = syscall.S_IFDIR | mode&0o7777
	out.Nlink = 2
	return d.NewInode(ctx, &memDir{mode: mode & 0o7777}, fs.StableAttr{Mode: syscall.S_IFDIR}), 0
}

func (d *memDir) Create(ctx context.Context, name string, flags, mode uint32, out *fuse.EntryOut) (*fs.Inode, fs.FileHandle, uint32, syscall.Errno) {
	f := &nullFile{mode: syscall.S_IFREG | mode&0o7777}
	f.attr(&out.Attr)
	return d.NewInode(ctx, f, fs.StableAttr{Mode: syscall.S_IFREG}), nil, fuse.FOPEN_KEEP_CACHE, 0
}

// nullFile is a file of the in-memory tree: a size and a mode, no bytes.
type nullFile struct {
	fs.Inode
	mu   sync.Mutex
	mode uint32
	size uint64 // GUARDED_BY(mu)
}

var (
	_ fs.NodeOpener    = (*nullFile)(nil)
	_ fs.NodeGetattrer = (*nullFile)(nil)
	_ fs.NodeSetattrer = (*nullFile)(nil)
	_ fs.NodeWriter    = (*nullFile)(nil)
	_ fs.NodeReader    = (*nullFile)(nil)
	_ fs.NodeFlusher   = (*nullFile)(nil)
)

// zeros is what reads return.
var zeros = make([]byte, 1<<20)

func (f *nullFile) attr(a *fuse.Attr) {
	f.mu.Lock()
	defer f.mu.Unlock()
	a.Mode, a.Size, a.Nlink = f.mode, f.size, 1
}

func (f *nullFile) Open(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	return nil, fuse.FOPEN_KEEP_CACHE, 0
}

func (f *nullFile) Getattr(ctx context.Context, fh fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	f.attr(&out.Attr)
	return 0
}

func (f *nullFile) Setattr(ctx context.Context, fh fs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	if sz, ok := in.GetSize(); ok {
		f.mu.Lock()
		f.size = sz
		f.mu.Unlock()
	}
	f.attr(&out.Attr)
	return 0
}

func (f *nullFile) Write(ctx context.Context, fh fs.FileHandle, data []byte, off int64) (uint32, syscall.Errno) {
	f.mu.Lock()
	f.size = max(f.size, uint64(off)+uint64(len(data)))
	f.mu.Unlock()
	return uint32(len(data)), 0
}

func (f *nullFile) Read(ctx context.Context, fh fs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	f.mu.Lock()
	size := int64(f.size)
	f.mu.Unlock()
	n := max(0, min(int64(len(dest)), size-off, int64(len(zeros))))
	return fuse.ReadResultData(zeros[:n]), 0
}

func (f *nullFile) Flush(ctx context.Context, fh fs.FileHandle) syscall.Errno { return 0 }

// Unlink and Rmdir only agree: go-fuse then drops the child from the tree.
func (d *memDir) Unlink(ctx context.Context, name string) syscall.Errno { return 0 }
func (d *memDir) Rmdir(ctx context.Context, name string) syscall.Errno  { return 0 }

// serve mounts root at mountpoint with mtcfs's mount settings and serves until a signal.
func serve(mountpoint string, root fs.InodeEmbedder, name string) error {
	timeout := 5 * time.Second
	server, err := fs.Mount(mountpoint, root, &fs.Options{
		EntryTimeout:    &timeout,
		AttrTimeout:     &timeout,
		NegativeTimeout: &timeout,
		NullPermissions: true,
		MountOptions: fuse.MountOptions{
			FsName:                   name,
			Name:                     "fuseanchor",
			DirectMount:              true,
			AllowOther:               true,
			MaxWrite:                 1 << 20,
			MaxReadAhead:             1 << 20,
			Options:                  []string{"default_permissions"},
			DisableXAttrs:            true,
			ExplicitDataCacheControl: true,
		},
	})
	if err != nil {
		return fmt.Errorf("mount %s: %w", mountpoint, err)
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	go func() {
		<-sig
		if server.Unmount() != nil { // busy: detach, as mtcfs does
			unix.Unmount(mountpoint, unix.MNT_DETACH)
		}
	}()
	server.Wait()
	return nil
}
