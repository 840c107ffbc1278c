// Command fuseanchor is fsbench's FUSE anchor for mtcfs's fallback data path: go-fuse's own
// loopback filesystem (fs.LoopbackNode and fs.LoopbackFile, unchanged) with passthrough turned
// off, mounted with the data-path settings mtcfs uses, so that every read and write goes
// through the server as on mtcfs without passthrough (--passthrough off, or a non-root agent).
//
//	fuseanchor MOUNTPOINT DIR
//
// It serves DIR at MOUNTPOINT until SIGINT or SIGTERM, then unmounts. It must run as root
// (direct mount). What it shares with mtcfs: requests of up to 1 MiB (MaxWrite, MaxReadAhead),
// default_permissions, the kernel page cache kept across opens (FOPEN_KEEP_CACHE) and not
// dropped on a new mtime (ExplicitDataCacheControl), 5 s entry and attribute timeouts. What it
// does not have: mtcfs's spool budget, hashing, commit tracking and replication. Each WRITE is
// a pwrite into DIR's file, as mtcfs's is into its spool file.
//
// go-fuse's loopback example (fsbench's other anchor) cannot serve this row: it registers every
// file for passthrough when it runs as root, and it asks for 128 KiB requests.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

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
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: fuseanchor MOUNTPOINT DIR")
		os.Exit(2)
	}
	if err := run(os.Args[1], os.Args[2]); err != nil {
		fmt.Fprintln(os.Stderr, "fuseanchor:", err)
		os.Exit(1)
	}
}

func run(mountpoint, dir string) error {
	root, err := fs.NewLoopbackRoot(dir)
	if err != nil {
		return err
	}
	lb, ok := root.(*fs.LoopbackNode)
	if !ok {
		return fmt.Errorf("go-fuse's loopback root is a %T, not a *fs.LoopbackNode", root)
	}
	top := &node{lb}
	lb.RootData.RootNode = top
	timeout := 5 * time.Second
	server, err := fs.Mount(mountpoint, top, &fs.Options{
		EntryTimeout:    &timeout,
		AttrTimeout:     &timeout,
		NullPermissions: true,
		MountOptions: fuse.MountOptions{
			FsName:                   dir,
			Name:                     "fuseanchor",
			DirectMount:              true,
			AllowOther:               true,
			MaxWrite:                 1 << 20,
			MaxReadAhead:             1 << 20,
			Options:                  []string{"default_permissions"},
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
		server.Unmount()
	}()
	server.Wait()
	return nil
}
