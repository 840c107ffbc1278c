package fs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sync/errgroup"
	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/tiers"
)

// namespace implements tiers.Namespace on the root directory of a mount. Changes go through
// the go-fuse inode tree and are followed by cache invalidations, so the job sees them at once.
type namespace struct {
	m    *mtfs
	root *dirNode

	// stale maps a top-level name to the names the agent renamed it from while the kernel's
	// entries only expired (see changed): the kernel may still hold the tree below under an
	// old name until a lookup reaches it. Remove makes the kernel drop those too, so that a
	// removed step's dentries, inodes and go-fuse nodes do not stay until memory pressure.
	staleMu sync.Mutex
	stale   map[string][]string // GUARDED_BY(staleMu)
}

var _ tiers.Namespace = (*namespace)(nil)

// attrOf returns the owner and permission bits of a node (every node type embeds meta).
func attrOf(in *gofs.Inode) layout.Attr {
	return in.Operations().(interface{ attr() layout.Attr }).attr()
}

// hasXattrs reports whether in has extended attributes.
func hasXattrs(in *gofs.Inode) bool {
	return in.Operations().(interface{ hasXattrs() bool }).hasXattrs()
}

func entryType(in *gofs.Inode) layout.EntryType {
	switch in.Operations().(type) {
	case *dirNode:
		return layout.EntryDir
	case *symlinkNode:
		return layout.EntrySymlink
	case *specialNode:
		return specialType(in.StableAttr().Mode)
	}
	return layout.EntryFile
}

// specialType is the entry type of a special node's stat type bits.
func specialType(mode uint32) layout.EntryType {
	switch mode & syscall.S_IFMT {
	case syscall.S_IFIFO:
		return layout.EntryFIFO
	case syscall.S_IFSOCK:
		return layout.EntrySocket
	case syscall.S_IFCHR:
		return layout.EntryCharDev
	case syscall.S_IFBLK:
		return layout.EntryBlockDev
	}
	return 0
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
	return fn.readAll(name, limit)
}

// readAll reads the bytes of f, known as name, up to limit (EFBIG past it).
func (fn *fileNode) readAll(name string, limit int64) ([]byte, error) {
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

// install puts ch at name, replacing a file or symlink there, and tells the kernel; sealed
// makes the name the agent's alone to remove or rename (see isSealedTop).
func (ns *namespace) install(name string, ch *gofs.Inode, sealed bool) error {
	old := ns.root.GetChild(name)
	if old != nil && old.IsDir() {
		return fmt.Errorf("replace %s: %w", name, syscall.EISDIR)
	}
	if sealed {
		ns.m.sealedTop.Store(name, struct{}{})
	} else {
		ns.m.sealedTop.Delete(name)
	}
	ns.root.AddChild(name, ch, true)
	// The kernel forgets its entry for name before the old node lets go of its bytes: a reader
	// racing the replacement opens the old content or the new, never nothing.
	ns.changed(name)
	if old != nil {
		if fn, ok := old.Operations().(*fileNode); ok {
			fn.replacedByAgent()
		} else {
			dropped(old)
		}
	}
	return nil
}

func (ns *namespace) WriteFile(name string, data []byte) error {
	if isReportName(name) {
		return ns.replaceReport(name, data, 0, false) // one path for the agent's report files
	}
	fn, ch, err := ns.newAgentFile(name, data)
	if err != nil {
		return err
	}
	if err := ns.install(name, ch, fn.isFrozen()); err != nil {
		fn.dropLink()
		return err
	}
	return nil
}

// newAgentFile makes a file of the agent's holding data, for the top-level name, not yet in the
// tree.
func (ns *namespace) newAgentFile(name string, data []byte) (*fileNode, *gofs.Inode, error) {
	p, fd, err := ns.m.spool.NewFile()
	if err != nil {
		return nil, nil, err
	}
	n, err := unix.Write(fd, data)
	unix.Close(fd)
	if err == nil && n < len(data) {
		// A full tmpfs writes what fits and says nothing: a line cut short, and the caller's
		// headroom never used (a review).
		err = unix.ENOSPC
	}
	if err != nil {
		os.Remove(p)
		return nil, nil, fmt.Errorf("write %s: %w", name, err)
	}
	fn := &fileNode{fs: ns.m, backing: p, nlink: 1, limit: tiers.WriteLimit(name)}
	fn.init(context.Background(), 0o644)
	ns.m.agentOwned(&fn.meta)
	fn.changedControl() // a yaml taken in from under the mount: the job's later writes count as changes
	// The agent's own files (a .meta, a line in replicator.failed) are counted even past an
	// agent-accounted budget, as the tmpfs headroom lets them be written as root: the job's
	// writes fail instead. Refused, a kept spool that held more than the budget failed the
	// agent's start (found by a black-box run).
	fn.chargeImported(int64(len(data)))
	// A .meta names the committed data it describes; like that data, it is the agent's to
	// change: the job's unlink, rename, write or truncate fails with EROFS (the agent publishes
	// it again at its next start, from the spool: it must not seem to go away meanwhile).
	if mk, ok := layout.ParseMarkerName(name); ok && mk.Kind == layout.MarkerMeta {
		fn.freeze()
	}
	ch := ns.root.NewPersistentInode(context.Background(), fn, gofs.StableAttr{Mode: syscall.S_IFREG, Ino: ns.m.newIno()})
	return fn, ch, nil
}

func (ns *namespace) Symlink(target, name string) error {
	l := newSymlink(context.Background(), target)
	ns.m.agentOwned(&l.meta)
	ch := ns.root.NewPersistentInode(context.Background(), l,
		gofs.StableAttr{Mode: syscall.S_IFLNK, Ino: ns.m.newIno()})
	return ns.install(name, ch, false)
}

func (ns *namespace) Rename(oldName, newName string) error {
	// The same checks as a rename(2) through the mount, except that the agent may move
	// committed checkpoints; no event (the agent made this change).
	src, dst, errno := ns.root.checkRename(oldName, ns.root, newName, 0)
	if errno != 0 {
		return fmt.Errorf("rename %s to %s: %w", oldName, newName, errno)
	}
	if src == dst {
		return nil
	}
	ns.root.applyRename(context.Background(), oldName, ns.root, newName, src, dst, 0, false)
	ns.root.MvChild(oldName, ns.root.EmbeddedInode(), newName, true)
	if _, sealed := ns.m.sealedTop.LoadAndDelete(oldName); sealed {
		ns.m.sealedTop.Store(newName, struct{}{})
	} else {
		ns.m.sealedTop.Delete(newName)
	}
	if e := ns.m.notifier.Load(); e != nil && e.expireOnly {
		ns.staleMu.Lock()
		if ns.stale == nil {
			ns.stale = map[string][]string{}
		}
		// A replaced entry's old names stay listed: invalidating them later is harmless.
		ns.stale[newName] = append(append(ns.stale[newName], ns.stale[oldName]...), oldName)
		delete(ns.stale, oldName)
		ns.staleMu.Unlock()
	}
	ns.changed(oldName, newName)
	return nil
}

// FreedButOpen counts the files whose last name went at least minAge ago (a step the agent
// freed, or a file the job deleted) that the job still holds open or mapped, and the bytes they
// keep in the spool until they are closed.
func (ns *namespace) FreedButOpen(minAge time.Duration) (files int, bytes int64) {
	return ns.m.freedButOpen(minAge, func(name string) bool { return ns.root.GetChild(name) != nil })
}

func (ns *namespace) Remove(name string) error {
	ns.staleMu.Lock()
	stale := ns.stale[name]
	delete(ns.stale, name)
	ns.staleMu.Unlock()
	ns.m.sealedTop.Delete(name) // also when the name is gone already: a stale entry would lock it
	ch := ns.root.GetChild(name)
	if ch == nil {
		return nil
	}
	if ch.IsDir() {
		ns.root.subdirs.Add(-1)
	}
	if _, live := ns.root.RmChild(name); live {
		if e := ns.m.notifier.Load(); e == nil || notifyFailed(e.invalidate(fuse.FUSE_ROOT_ID, name)) {
			ns.root.NotifyDelete(name, ch)
		}
	}
	for _, old := range stale {
		// A full invalidation: the kernel drops the entry and everything below it. Not for
		// a name a new entry has taken since: the kernel looked that name up to create it,
		// which dropped the stale tree already, and would now drop the new one's.
		if ns.root.GetChild(old) == nil {
			if e := ns.m.notifier.Load(); e == nil || notifyFailed(e.invalidate(fuse.FUSE_ROOT_ID, old)) {
				ns.root.NotifyEntry(old)
			}
		}
	}
	dropTree(ch)
	if layout.IsDataName(name) {
		ns.m.noteFreed(name)
	}
	ns.changed()
	return nil
}

// changed updates the root's times and makes the kernel drop what it cached about the root's
// attributes (its nlink and mtime moved) and look the given names up again; where the kernel
// can, the names' entries only expire (see kernelNotifier), so that renaming a step of 100,000
// files does not wait for the kernel to drop its cache of all of them.
func (ns *namespace) changed(names ...string) {
	ns.root.touch(true)
	for _, n := range names {
		e := ns.m.notifier.Load()
		var err error
		switch {
		case e == nil:
			err = errors.ErrUnsupported
		case e.expireOnly:
			err = e.expire(fuse.FUSE_ROOT_ID, n)
		default:
			err = e.invalidate(fuse.FUSE_ROOT_ID, n)
		}
		if notifyFailed(err) {
			ns.root.NotifyEntry(n)
		}
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

func (ns *namespace) Seal(name, dst string) (tiers.SealInfo, error) {
	var info tiers.SealInfo
	ch := ns.root.GetChild(name)
	if ch == nil {
		return info, fmt.Errorf("seal %s: %w", name, os.ErrNotExist)
	}
	children := freeze(ch)
	ns.m.sealedTop.Store(name, struct{}{})
	if ns.m.xattrs && hasXattrs(ch) {
		info.Xattrs++
	}
	if fn, ok := ch.Operations().(*fileNode); ok {
		info.Attrs = layout.NewAttrsBuilder(fn.attr(), false).Attrs()
		copied, err := fn.exportTo(dst, func(src string) error { return os.Link(src, dst) }, func() (*os.File, error) {
			return os.OpenFile(dst, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
		})
		if err != nil {
			return info, fmt.Errorf("seal %s: %w", name, err)
		}
		if copied {
			info.Copied, info.CopiedExample = 1, name
		} else {
			info.OpenAfterCommit = fn.openAfterCommit // its close's descriptor may live on
		}
		return info, nil
	}
	if err := os.Mkdir(dst, 0o700); err != nil {
		return info, fmt.Errorf("seal %s: %w", name, err)
	}
	d, err := layout.OpenDir(dst)
	if err != nil {
		return info, fmt.Errorf("seal %s: %w", name, err)
	}
	// The spool's files are linked relative to its files directory, and each directory of the
	// copy is opened once with its entries made relative to it, so that a file costs one linkat
	// without a path to resolve: this runs before the job's rename returns. The walk makes the
	// directories, symlinks and special files, and hands each directory's files, in parts of up
	// to sealPart, to sealWorkers goroutines: consecutive directories are linked on different
	// threads, which do not then wait for each other's lock on the same directory.
	files, err := layout.OpenDir(ns.m.spool.FilesDir())
	if err != nil {
		d.Close()
		return info, fmt.Errorf("seal %s: %w", name, err)
	}
	defer files.Close()
	filesPrefix := files.Path() + "/"
	var copied atomic.Int64
	var copiedExample atomic.Pointer[string]
	linkFile := func(n *fileNode, d *layout.Dir, cn, dir string) error {
		c, err := n.exportTo(cn, func(src string) error {
			if base, ok := strings.CutPrefix(src, filesPrefix); ok && !strings.Contains(base, "/") {
				return d.LinkFrom(files, base, cn)
			}
			return d.Link(src, cn)
		}, func() (*os.File, error) {
			return d.Open(cn, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
		})
		if c && copied.Add(1) == 1 {
			p := name + "/" + cn
			if dir != "" {
				p = name + "/" + dir + "/" + cn
			}
			copiedExample.Store(&p)
		}
		if errors.Is(err, errUnlinked) {
			return nil // the job's unlink came first: the file is not part of the commit
		}
		return err
	}
	g, gctx := errgroup.WithContext(context.Background())
	g.SetLimit(sealWorkers)
	// A sealDir is a directory of the copy, closed when the walk and every part linked into it
	// are done with it: the open directories are the walk's path and the parts in hand.
	type sealDir struct {
		d    *layout.Dir
		refs atomic.Int32
	}
	release := func(sd *sealDir) {
		if sd.refs.Add(-1) == 0 {
			sd.d.Close()
		}
	}
	type fileAt struct {
		n    *fileNode
		name string
		dir  string // its directory's path from the step's top ("": the top)
	}
	// The owners and modes go to info.Attrs (the walk runs on this goroutine only): the
	// sealed copy's own are the agent's, private to the spool.
	attrs := layout.NewAttrsBuilder(attrOf(ch), true)
	var walk func(in *gofs.Inode, sd *sealDir, rel string) error
	walk = func(in *gofs.Inode, sd *sealDir, rel string) error {
		var fileList []fileAt
		for cn, c := range children[in] {
			if gctx.Err() != nil {
				return nil // a part failed: g.Wait reports it
			}
			path := func() string {
				if rel == "" {
					return cn
				}
				return rel + "/" + cn
			}
			attrs.Add(entryType(c), attrOf(c), path)
			if ns.m.xattrs && hasXattrs(c) {
				info.Xattrs++
			}
			var err error
			switch n := c.Operations().(type) {
			case *dirNode:
				var sub *layout.Dir
				if err = sd.d.Mkdir(cn, 0o700); err == nil {
					if sub, err = sd.d.OpenDir(cn); err == nil {
						subDir := &sealDir{d: sub}
						subDir.refs.Store(1)
						err = walk(c, subDir, path())
						release(subDir)
					}
				}
			case *symlinkNode:
				err = sd.d.Symlink(n.target, cn)
			case *specialNode:
				err = sd.d.Create(layout.TreeEntry{Path: cn, Type: specialType(c.StableAttr().Mode), Rdev: uint64(n.rdev)}, 0o600)
			case *fileNode:
				fileList = append(fileList, fileAt{n, cn, rel})
			}
			if err != nil {
				return err
			}
		}
		parts := (len(fileList) + sealPart - 1) / sealPart
		for p := range parts {
			part := fileList[p*len(fileList)/parts : (p+1)*len(fileList)/parts]
			sd.refs.Add(1)
			g.Go(func() error {
				defer release(sd)
				if gctx.Err() != nil {
					return nil // another part failed: the record is dropped
				}
				for _, f := range part {
					if err := linkFile(f.n, sd.d, f.name, f.dir); err != nil {
						return err
					}
				}
				return nil
			})
		}
		return nil
	}
	top := &sealDir{d: d}
	top.refs.Store(1)
	err = walk(ch, top, "")
	release(top)
	if gerr := g.Wait(); err == nil {
		err = gerr
	}
	info.Copied = int(copied.Load())
	if p := copiedExample.Load(); p != nil {
		info.CopiedExample = *p
	}
	info.Attrs = attrs.Attrs()
	if err != nil {
		os.RemoveAll(dst)
		return info, fmt.Errorf("seal %s: %w", name, err)
	}
	return info, nil
}

// Seal links files on sealWorkers goroutines, a directory's files in parts of at most sealPart.
var (
	sealWorkers = min(4, max(2, runtime.GOMAXPROCS(0)))
	sealPart    = 1024
)

// freeze marks every node of the tree at in as part of a committed checkpoint, and returns the
// entries of each directory as it marked them: Seal copies those, so that every node in the
// copy was marked before the copy has it (an entry a racing create adds after the mark stays
// out of the checkpoint), and the tree's entries are gathered once.
func freeze(in *gofs.Inode) map[*gofs.Inode]map[string]*gofs.Inode {
	children := map[*gofs.Inode]map[string]*gofs.Inode{}
	var mark func(in *gofs.Inode)
	mark = func(in *gofs.Inode) {
		if m, ok := in.Operations().(interface{ freeze() }); ok {
			m.freeze()
		}
		if !in.IsDir() {
			return
		}
		ch := in.Children()
		children[in] = ch
		for _, c := range ch {
			mark(c)
		}
	}
	mark(in)
	return children
}

func (m *meta) freeze() { m.frozen.Store(true) }

func (ns *namespace) HoldSpoolFile(ctx context.Context, path string) (string, context.Context, func(), error) {
	in := ns.root.EmbeddedInode()
	for _, part := range strings.Split(path, "/") {
		if in = in.GetChild(part); in == nil {
			return "", nil, nil, fmt.Errorf("%s: %w", path, os.ErrNotExist)
		}
	}
	fn, ok := in.Operations().(*fileNode)
	if !ok {
		return "", nil, nil, fmt.Errorf("%s is not a regular file", path)
	}
	p, hctx, end, err := fn.hold(ctx)
	if err != nil {
		return "", nil, nil, fmt.Errorf("%s: %w", path, err)
	}
	return p, hctx, end, nil
}

// OwnAgentFiles makes uid:gid the owner of the entries the agent makes at the top from now on
// (tiers.AgentFilesOwner).
func (ns *namespace) OwnAgentFiles(uid, gid uint32) {
	ns.m.agentOwner.Store(uint64(uid)<<32 | uint64(gid))
}

var _ tiers.AgentFilesOwner = (*namespace)(nil)

// RootOwner returns the owner of the mount root (tiers.RootOwned).
func (ns *namespace) RootOwner() uint32 {
	ns.root.mu.Lock()
	defer ns.root.mu.Unlock()
	return ns.root.uid
}

var _ tiers.RootOwned = (*namespace)(nil)

func (ns *namespace) Owner(name string) (uid, gid uint32, err error) {
	ch := ns.root.GetChild(name)
	if ch == nil {
		return 0, 0, fmt.Errorf("%s: %w", name, os.ErrNotExist)
	}
	a := attrOf(ch)
	return a.UID, a.GID, nil
}

func (ns *namespace) Reown(name string, saved *layout.Attrs, uid uint32) (int, error) {
	top := ns.root.GetChild(name)
	if top == nil {
		return 0, fmt.Errorf("%s: %w", name, os.ErrNotExist)
	}
	from := attrOf(top).UID
	if from == uid {
		// The top is uid's: as saved, or given to uid by the last Reown, which set every entry
		// as it would now. A job restoring what its own user saved walks nothing.
		return 0, nil
	}
	if saved != nil {
		from = saved.UID
	}
	// The kernel may hold a node's attributes (a job's earlier use of the step, within the cache
	// timeout): each node changed is invalidated, attributes only, which takes no lock a job's
	// request could hold.
	changed := 0
	var walk func(in *gofs.Inode, rel string)
	walk = func(in *gofs.Inode, rel string) {
		m, ok := in.Operations().(interface {
			attr() layout.Attr
			setUID(uid uint32) bool
		})
		if !ok {
			return
		}
		want := m.attr().UID
		if saved != nil {
			want = saved.Of(rel, entryType(in)).UID
		}
		if want == from {
			want = uid
		}
		if m.setUID(want) {
			changed++
			in.NotifyContent(-1, 0)
		}
		if in.IsDir() {
			for cn, c := range in.Children() {
				if rel != "" {
					cn = rel + "/" + cn
				}
				walk(c, cn)
			}
		}
	}
	walk(top, "")
	return changed, nil
}

func (ns *namespace) Import(src, name string) error { return ns.ImportVerified(src, name, nil) }

func (ns *namespace) ImportVerified(src, name string, verify func([]layout.TreeEntry) error) error {
	if ns.root.GetChild(name) != nil {
		return fmt.Errorf("import %s: %w", name, tiers.ErrNameTaken)
	}
	fi, err := os.Lstat(src)
	if err != nil {
		return err
	}
	var entries []layout.TreeEntry
	if fi.IsDir() {
		// One listing for both: the tree is built from what verify hashes. A listing that
		// verify hashes needs no stat of each file: the hash's own stat gives the sizes.
		list := layout.ListTree
		if verify != nil {
			list = layout.ListTreeUnsized
		}
		if entries, err = list(src); err != nil {
			return err
		}
	}
	// The tree is built (a node per file) while verify reads the same files, and stays
	// invisible until verify has passed. verify fills in the entries' digests and sizes;
	// building the tree reads their other fields (importTree), and the sizes once verify is done.
	verified := make(chan error, 1)
	if verify == nil {
		verified <- nil
	} else {
		go func() { verified <- verify(entries) }()
	}
	ctx := context.Background()
	// The owners and modes the job saved the tree with; without them (data of an earlier agent
	// or of the reference system, or a record that does not parse) the agent's defaults.
	attrs, err := layout.ReadAttrs(src)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		ns.m.log.Warn("the owners and modes kept for this data cannot be read; it gets the agent's", "data", name, "err", err)
	}
	type fileAt struct {
		n     *fileNode
		entry int // in entries; -1: src itself
	}
	// Sized once (a restart imports steps of 100,000 files; appending grew both some twenty times).
	created := make([]*gofs.Inode, 0, len(entries)+1)
	files := make([]fileAt, 0, len(entries)+1)
	newFile := func(link func() (backing string, borrowed bool, err error), entry int) (*gofs.Inode, error) {
		bp, borrowed, err := link()
		if err != nil {
			return nil, err
		}
		fn := &fileNode{fs: ns.m, backing: bp, borrowed: borrowed, nlink: 1}
		fn.init(ctx, 0o644)
		if attrs != nil {
			p := ""
			if entry >= 0 {
				p = entries[entry].Path
			}
			fn.setAttr(attrs.Of(p, layout.EntryFile), false)
		}
		fn.freeze()
		files = append(files, fileAt{fn, entry})
		in := ns.root.NewPersistentInode(ctx, fn, gofs.StableAttr{Mode: syscall.S_IFREG, Ino: ns.m.newIno()})
		created = append(created, in)
		return in, nil
	}
	top, err := ns.importTree(ctx, src, fi, entries, attrs, newFile)
	verr := <-verified
	if err == nil && verr == nil {
		for _, f := range files {
			if f.entry >= 0 && entries[f.entry].Size < 0 {
				err = fmt.Errorf("%s: verified without its size", entries[f.entry].Path) // a verify that did not hash the listing
				break
			}
			size := fi.Size()
			if f.entry >= 0 {
				size = entries[f.entry].Size
			}
			f.n.chargeImported(size)
		}
		if err == nil && !ns.root.AddChild(name, top, false) {
			err = tiers.ErrNameTaken
		}
	}
	if err != nil || verr != nil {
		for _, in := range created {
			dropped(in)
		}
		if verr != nil {
			return verr
		}
		return fmt.Errorf("import %s as %s: %w", src, name, err)
	}
	if top.IsDir() {
		ns.root.subdirs.Add(1)
	}
	ns.m.sealedTop.Store(name, struct{}{})
	ns.changed(name)
	return nil
}

// borrowPathMax bounds the backing paths importTree borrows: each open and stat of the node
// passes its backing path to the kernel in one call (PATH_MAX, 4096 bytes with the NUL).
const borrowPathMax = unix.PathMax

// importTree builds frozen nodes for the spool tree (or file) at src, whose Lstat is fi and, for
// a directory, whose listing is entries; newFile makes a file node whose backing file link
// gives, for entries[entry] (-1: src itself). It reads no entry's Size: verify may be filling
// them in meanwhile. Directories, symlinks and special files take their owners and modes from
// attrs (nil: the agent's); newFile gives files theirs.
//
// A file's node borrows the sealed record's own name for it as its backing file (the record is
// immutable, and the namespace drops the step before the record goes, see package tiers'
// retention) instead of a hard link in the spool's files directory: a restart adopting a step of
// 100,000 files spent half a CPU-second on those links (issue 12). Only a path too long to
// open in one call (a tree deep enough to pass PATH_MAX once prefixed with the spool) gets a
// link of its own, made relative to its directory.
func (ns *namespace) importTree(ctx context.Context, src string, fi os.FileInfo, entries []layout.TreeEntry, attrs *layout.Attrs, newFile func(link func() (string, bool, error), entry int) (*gofs.Inode, error)) (*gofs.Inode, error) {
	if fi.Mode().IsRegular() {
		return newFile(func() (string, bool, error) { return src, true, nil }, -1)
	}
	if !fi.IsDir() {
		return nil, fmt.Errorf("%s: unsupported file type %v", src, fi.Mode().Type())
	}
	d, err := layout.OpenDir(src)
	if err != nil {
		return nil, err
	}
	defer d.Close()
	newDir := func(p string) (*gofs.Inode, *dirNode) {
		dn := &dirNode{fs: ns.m}
		dn.init(ctx, 0o755)
		if attrs != nil {
			dn.setAttr(attrs.Of(p, layout.EntryDir), false)
		}
		dn.freeze()
		return ns.root.NewPersistentInode(ctx, dn, gofs.StableAttr{Mode: syscall.S_IFDIR, Ino: ns.m.newIno()}), dn
	}
	// A path too long to borrow gets a backing name in the spool's files directory, linked
	// relative to that directory and to the file's own directory (opened once for the files that
	// follow it).
	var files *layout.Dir
	var w *layout.Walker
	defer func() {
		if w != nil {
			w.Close()
			files.Close()
		}
	}()
	linkLong := func(rel string) (string, bool, error) {
		if w == nil {
			f, err := layout.OpenDir(ns.m.spool.FilesDir())
			if err != nil {
				return "", false, err
			}
			files, w = f, d.Walker()
		}
		p, err := ns.m.spool.LinkFileWith(func(name string) error { return w.LinkTo(rel, files, name) })
		return p, false, err
	}
	prefix := src + "/"
	top, _ := newDir("")
	dirs := map[string]*gofs.Inode{"": top}
	for i := range entries { // a directory is listed before what it holds
		// Through a pointer, reading only the fields verify does not write (a copy of the
		// entry would read its Digest while verify fills it in).
		e := &entries[i]
		var in *gofs.Inode
		switch e.Type {
		case layout.EntryDir:
			in, _ = newDir(e.Path)
			dirs[e.Path] = in
		case layout.EntrySymlink:
			l := newSymlink(ctx, e.Target)
			if attrs != nil {
				l.setAttr(attrs.Of(e.Path, layout.EntrySymlink), true)
			}
			l.freeze()
			in = ns.root.NewPersistentInode(ctx, l, gofs.StableAttr{Mode: syscall.S_IFLNK, Ino: ns.m.newIno()})
		case layout.EntryFile:
			rel := e.Path
			in, err = newFile(func() (string, bool, error) {
				if len(prefix)+len(rel) < borrowPathMax {
					return prefix + rel, true, nil
				}
				return linkLong(rel)
			}, i)
			if err != nil {
				return nil, err
			}
		default: // FIFO, socket, device
			sn := newSpecialNode(ctx, e.Type.Mode()|0o644, uint32(e.Rdev))
			if attrs != nil {
				sn.setAttr(attrs.Of(e.Path, e.Type), false)
			}
			sn.freeze()
			in = ns.root.NewPersistentInode(ctx, sn, gofs.StableAttr{Mode: e.Type.Mode(), Ino: ns.m.newIno()})
		}
		parentPath, base := path.Split(e.Path)
		parent := dirs[strings.TrimSuffix(parentPath, "/")]
		if parent == nil {
			return nil, fmt.Errorf("%s: listed before its directory", e.Path)
		}
		parent.AddChild(base, in, false)
		if in.IsDir() {
			parent.Operations().(*dirNode).subdirs.Add(1)
		}
	}
	return top, nil
}

// AnswerMisplaced answers a replicator.yaml written into a directory of the mount (dir, "a" or
// "a/b") instead of its root (tiers.MisplacedYAML): it removes dir/yamlName, if it is still
// the file closed, and writes failed (a line) as dir/failedName, so that a client waiting there
// for its yaml to go reads why.
func (ns *namespace) AnswerMisplaced(dir, yamlName, failedName string, failed []byte) error {
	d := ns.root.EmbeddedInode()
	for _, part := range strings.Split(dir, "/") {
		ch := d.GetChild(part)
		if ch == nil || !ch.IsDir() {
			return fmt.Errorf("%s: %w", dir, os.ErrNotExist)
		}
		d = ch
	}
	dn, ok := d.Operations().(*dirNode)
	if !ok {
		return fmt.Errorf("%s: %w", dir, os.ErrNotExist)
	}
	if y := d.GetChild(yamlName); y != nil && !y.IsDir() && d.RmChildIf(yamlName, y) {
		ns.entryGone(d, yamlName, y)
		dropped(y)
	}
	fn, ch, err := ns.newAgentFile(failedName, failed)
	if err != nil {
		return err
	}
	if old := d.GetChild(failedName); old != nil {
		if old.IsDir() || !d.RmChildIf(failedName, old) {
			fn.dropLink()
			return fmt.Errorf("%s/%s: %w", dir, failedName, os.ErrExist)
		}
		dropped(old)
	}
	d.AddChild(failedName, ch, true)
	dn.touch(true)
	ns.entryGone(d, failedName, nil) // the kernel's negative entry, if any
	return nil
}

// entryGone has the kernel drop its entry for name in parent, which the agent removed (gone) or
// replaced (gone nil): through the notification helper when it can, else go-fuse's notify. The
// kernel's node id of parent, not its inode number: go-fuse allocates node ids apart from inode
// numbers (bridge.go, without ExternalNodeID), and the first AnswerMisplaced sent the inode
// number.
func (ns *namespace) entryGone(parent *gofs.Inode, name string, gone *gofs.Inode) {
	if e := ns.m.notifier.Load(); e != nil && !notifyFailed(e.invalidate(parent.NodeID(), name)) {
		return
	}
	if gone != nil {
		parent.NotifyDelete(name, gone)
	} else {
		parent.NotifyEntry(name)
	}
}

var _ tiers.MisplacedYAML = (*namespace)(nil)
