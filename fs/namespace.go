package fs

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/tiers"
)

// namespace implements tiers.Namespace on the root directory of a mount. Changes go through
// the go-fuse inode tree and are followed by cache invalidations, so the job sees them at once.
type namespace struct {
	m    *mtfs
	root *dirNode
}

var _ tiers.Namespace = (*namespace)(nil)

func entryType(in *gofs.Inode) layout.EntryType {
	switch in.Operations().(type) {
	case *dirNode:
		return layout.EntryDir
	case *symlinkNode:
		return layout.EntrySymlink
	}
	return layout.EntryFile
}

func (ns *namespace) List() ([]tiers.DirEntry, error) {
	var out []tiers.DirEntry
	for name, ch := range ns.root.Children() {
		out = append(out, tiers.DirEntry{Name: name, Type: entryType(ch)})
	}
	return out, nil
}

func (ns *namespace) ReadFile(name string, limit int64) ([]byte, error) {
	fn, ok := ns.child(name).(*fileNode)
	if !ok {
		return nil, fmt.Errorf("read %s: %w", name, os.ErrNotExist)
	}
	fn.mu.Lock()
	p := fn.backing
	fn.mu.Unlock()
	f, err := os.Open(p)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", name, err)
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", name, err)
	}
	if int64(len(data)) > limit {
		return nil, fmt.Errorf("read %s: larger than %d bytes: %w", name, limit, syscall.EFBIG)
	}
	return data, nil
}

func (ns *namespace) child(name string) gofs.InodeEmbedder {
	if ch := ns.root.GetChild(name); ch != nil {
		return ch.Operations()
	}
	return nil
}

// install puts ch at name, replacing a file or symlink there, and tells the kernel.
func (ns *namespace) install(name string, ch *gofs.Inode) error {
	old := ns.root.GetChild(name)
	if old != nil && old.IsDir() {
		return fmt.Errorf("replace %s: %w", name, syscall.EISDIR)
	}
	ns.root.AddChild(name, ch, true)
	if old != nil {
		dropped(old)
	}
	ns.changed(name)
	return nil
}

func (ns *namespace) WriteFile(name string, data []byte) error {
	p, fd, err := ns.m.spool.NewFile()
	if err != nil {
		return err
	}
	_, err = unix.Write(fd, data)
	unix.Close(fd)
	if err != nil {
		os.Remove(p)
		return fmt.Errorf("write %s: %w", name, err)
	}
	fn := &fileNode{fs: ns.m, backing: p, nlink: 1}
	fn.init(context.Background(), 0o644)
	if err := fn.chargeTo(int64(len(data)), true); err != nil {
		os.Remove(p)
		return err
	}
	ch := ns.root.NewPersistentInode(context.Background(), fn, gofs.StableAttr{Mode: syscall.S_IFREG, Ino: ns.m.newIno()})
	if err := ns.install(name, ch); err != nil {
		fn.dropLink()
		return err
	}
	return nil
}

func (ns *namespace) Symlink(target, name string) error {
	ch := ns.root.NewPersistentInode(context.Background(), newSymlink(context.Background(), target),
		gofs.StableAttr{Mode: syscall.S_IFLNK, Ino: ns.m.newIno()})
	return ns.install(name, ch)
}

func (ns *namespace) Rename(oldName, newName string) error {
	// The same checks as a rename(2) through the mount; no event (the agent made this change).
	if errno := ns.root.Rename(context.Background(), oldName, ns.root, newName, 0); errno != 0 {
		return fmt.Errorf("rename %s to %s: %w", oldName, newName, errno)
	}
	ns.root.MvChild(oldName, ns.root.EmbeddedInode(), newName, true)
	ns.changed(oldName, newName)
	return nil
}

func (ns *namespace) Remove(name string) error {
	ch := ns.root.GetChild(name)
	if ch == nil {
		return nil
	}
	if ch.IsDir() {
		ns.root.subdirs.Add(-1)
	}
	if _, live := ns.root.RmChild(name); live {
		ns.root.NotifyDelete(name, ch)
	}
	dropTree(ch)
	ns.changed()
	return nil
}

// changed updates the root's times and makes the kernel drop what it cached about the root's
// attributes (its nlink and mtime moved) and about the given names.
func (ns *namespace) changed(names ...string) {
	ns.root.touch(true)
	for _, n := range names {
		ns.root.NotifyEntry(n)
	}
	ns.root.NotifyContent(-1, 0) // attributes only
}

// dropTree releases the names of every file below in (in was just unlinked from its parent).
func dropTree(in *gofs.Inode) {
	if !in.IsDir() {
		dropped(in)
		return
	}
	for name, ch := range in.Children() {
		in.RmChild(name)
		dropTree(ch)
	}
}

func (ns *namespace) Export(name, dst string) ([]layout.TreeEntry, error) {
	ch := ns.root.GetChild(name)
	if ch == nil {
		return nil, fmt.Errorf("export %s: %w", name, os.ErrNotExist)
	}
	var out []layout.TreeEntry
	var walk func(in *gofs.Inode, rel, abs string) error
	walk = func(in *gofs.Inode, rel, abs string) error {
		switch n := in.Operations().(type) {
		case *dirNode:
			if err := os.Mkdir(abs, 0o700); err != nil {
				return err
			}
			if rel != "" {
				out = append(out, layout.TreeEntry{Path: rel, Type: layout.EntryDir})
			}
			for cn, c := range in.Children() {
				if err := walk(c, filepath.Join(rel, cn), filepath.Join(abs, cn)); err != nil {
					return err
				}
			}
		case *symlinkNode:
			if err := os.Symlink(n.target, abs); err != nil {
				return err
			}
			out = append(out, layout.TreeEntry{Path: rel, Type: layout.EntrySymlink, Target: n.target})
		case *fileNode:
			n.mu.Lock()
			p := n.backing
			n.mu.Unlock()
			var st unix.Stat_t
			if err := unix.Stat(p, &st); err != nil {
				return err
			}
			if err := os.Link(p, abs); err != nil {
				return err
			}
			out = append(out, layout.TreeEntry{Path: rel, Type: layout.EntryFile, Size: st.Size})
		}
		return nil
	}
	if err := walk(ch, "", dst); err != nil {
		os.RemoveAll(dst)
		return nil, fmt.Errorf("export %s: %w", name, err)
	}
	return out, nil
}

func (ns *namespace) SpoolFile(path string) (string, error) {
	in := ns.root.EmbeddedInode()
	for _, part := range strings.Split(path, "/") {
		if in = in.GetChild(part); in == nil {
			return "", fmt.Errorf("%s: %w", path, os.ErrNotExist)
		}
	}
	fn, ok := in.Operations().(*fileNode)
	if !ok {
		return "", fmt.Errorf("%s is not a regular file", path)
	}
	fn.mu.Lock()
	defer fn.mu.Unlock()
	if fn.backing == "" {
		return "", fmt.Errorf("%s: %w", path, os.ErrNotExist)
	}
	return fn.backing, nil
}

func (ns *namespace) Import(src, name string) error {
	if ns.root.GetChild(name) != nil {
		return fmt.Errorf("import %s: %w", name, os.ErrExist)
	}
	var created []*gofs.Inode
	var build func(p string) (*gofs.Inode, error)
	build = func(p string) (*gofs.Inode, error) {
		fi, err := os.Lstat(p)
		if err != nil {
			return nil, err
		}
		ctx := context.Background()
		mode := uint32(fi.Mode().Perm())
		switch {
		case fi.IsDir():
			d := &dirNode{fs: ns.m}
			d.init(ctx, mode|0o755)
			in := ns.root.NewPersistentInode(ctx, d, gofs.StableAttr{Mode: syscall.S_IFDIR, Ino: ns.m.newIno()})
			ents, err := os.ReadDir(p)
			if err != nil {
				return nil, err
			}
			for _, e := range ents {
				c, err := build(filepath.Join(p, e.Name()))
				if err != nil {
					return nil, err
				}
				in.AddChild(e.Name(), c, false)
				if c.IsDir() {
					d.subdirs.Add(1)
				}
			}
			return in, nil
		case fi.Mode()&os.ModeSymlink != 0:
			target, err := os.Readlink(p)
			if err != nil {
				return nil, err
			}
			return ns.root.NewPersistentInode(ctx, newSymlink(ctx, target), gofs.StableAttr{Mode: syscall.S_IFLNK, Ino: ns.m.newIno()}), nil
		case fi.Mode().IsRegular():
			bp, err := ns.m.spool.LinkFile(p)
			if err != nil {
				return nil, err
			}
			fn := &fileNode{fs: ns.m, backing: bp, nlink: 1}
			fn.init(ctx, mode|0o644)
			fn.chargeTo(fi.Size(), true)
			in := ns.root.NewPersistentInode(ctx, fn, gofs.StableAttr{Mode: syscall.S_IFREG, Ino: ns.m.newIno()})
			created = append(created, in)
			return in, nil
		}
		return nil, fmt.Errorf("%s: unsupported file type %v", p, fi.Mode().Type())
	}
	top, err := build(src)
	if err == nil && !ns.root.AddChild(name, top, false) {
		err = os.ErrExist
	}
	if err != nil {
		for _, in := range created {
			dropped(in)
		}
		return fmt.Errorf("import %s as %s: %w", src, name, err)
	}
	if top.IsDir() {
		ns.root.subdirs.Add(1)
	}
	ns.changed(name)
	return nil
}
