package layout

import (
	"errors"
	"fmt"
	"os"
	"path"
	"runtime"
	"slices"
	"strings"

	"golang.org/x/sync/errgroup"
	"golang.org/x/sys/unix"
)

// Dir is a directory tree on a local filesystem (a spool tree, a replica being received, a
// download), walked and changed relative to its root's descriptor. Two reasons: a checkpoint may
// hold paths longer than PATH_MAX once prefixed with where the tree lives (the job may create
// them relative to a deep working directory), and no symbolic link inside the tree is ever
// followed, so a tree received from elsewhere cannot make us read or write outside it.
//
// Paths given to its methods are relative, slash-separated and clean ("a/b"); "" is the root.
type Dir struct {
	fd   int
	path string
}

// OpenDir opens the directory at p (following p itself if it is a symlink).
func OpenDir(p string) (*Dir, error) {
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: p, Err: err}
	}
	return &Dir{fd: fd, path: p}, nil
}

// Close releases the root descriptor.
func (d *Dir) Close() error { return unix.Close(d.fd) }

// Path is where the tree lives, for messages.
func (d *Dir) Path() string { return d.path }

func (d *Dir) errPath(rel string) string {
	if rel == "" {
		return d.path
	}
	return d.path + "/" + rel
}

// openAt opens rel below the root without following any symlink, whatever rel's length.
func (d *Dir) openAt(rel string, flags int, mode uint32) (int, error) {
	flags |= unix.O_CLOEXEC
	if rel == "" {
		return unix.Openat(d.fd, ".", flags, mode)
	}
	if len(rel) < unix.PathMax {
		fd, err := unix.Openat2(d.fd, rel, &unix.OpenHow{Flags: uint64(flags), Mode: uint64(mode),
			Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS})
		if !errors.Is(err, unix.ENOSYS) && !errors.Is(err, unix.ENAMETOOLONG) {
			return fd, err
		}
	}
	parent, base, err := d.openParent(rel)
	if err != nil {
		return -1, err
	}
	defer d.closeParent(parent)
	return unix.Openat(parent, base, flags|unix.O_NOFOLLOW, mode)
}

// openParent opens the directory holding rel, component by component (no symlink followed), and
// returns it with rel's last element. The root itself is returned as is: see closeParent.
func (d *Dir) openParent(rel string) (int, string, error) {
	dir, base := path.Split(rel)
	dir = strings.TrimSuffix(dir, "/")
	if dir == "" {
		return d.fd, base, nil
	}
	if len(dir) < unix.PathMax {
		fd, err := unix.Openat2(d.fd, dir, &unix.OpenHow{Flags: unix.O_RDONLY | unix.O_DIRECTORY | unix.O_CLOEXEC,
			Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS})
		if err == nil {
			return fd, base, nil
		}
		if !errors.Is(err, unix.ENOSYS) && !errors.Is(err, unix.ENAMETOOLONG) {
			return -1, "", err
		}
	}
	cur := d.fd
	for _, part := range strings.Split(dir, "/") {
		fd, err := unix.Openat(cur, part, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if cur != d.fd {
			unix.Close(cur)
		}
		if err != nil {
			return -1, "", err
		}
		cur = fd
	}
	return cur, base, nil
}

func (d *Dir) closeParent(fd int) {
	if fd != d.fd {
		unix.Close(fd)
	}
}

// Open opens the file at rel (flags as for open(2); O_CLOEXEC and, for the last element,
// O_NOFOLLOW semantics are implied).
func (d *Dir) Open(rel string, flags int, perm uint32) (*os.File, error) {
	fd, err := d.openAt(rel, flags, perm)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: d.errPath(rel), Err: err}
	}
	return os.NewFile(uintptr(fd), d.errPath(rel)), nil
}

// openRaw opens the file at rel for reading as a bare descriptor (hashFile's), non-blocking so
// that a FIFO where a file was listed cannot block the open.
func (d *Dir) openRaw(rel string) (int, error) {
	fd, err := d.openAt(rel, unix.O_RDONLY|unix.O_NONBLOCK, 0)
	if err != nil {
		return -1, &os.PathError{Op: "open", Path: d.errPath(rel), Err: err}
	}
	return fd, nil
}

// OpenDir opens the directory at rel as a Dir of its own.
func (d *Dir) OpenDir(rel string) (*Dir, error) {
	fd, err := d.openAt(rel, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: d.errPath(rel), Err: err}
	}
	return &Dir{fd: fd, path: d.errPath(rel)}, nil
}

// at runs op on the directory holding rel and rel's last element.
func (d *Dir) at(op, rel string, f func(dirfd int, name string) error) error {
	if rel == "" {
		return &os.PathError{Op: op, Path: d.path, Err: unix.EEXIST}
	}
	parent, base, err := d.openParent(rel)
	if err == nil {
		err = f(parent, base)
		d.closeParent(parent)
	}
	if err != nil {
		return &os.PathError{Op: op, Path: d.errPath(rel), Err: err}
	}
	return nil
}

// Lstat returns the attributes of rel itself (a symlink is not followed).
func (d *Dir) Lstat(rel string) (unix.Stat_t, error) {
	var st unix.Stat_t
	if rel == "" {
		err := unix.Fstat(d.fd, &st)
		if err != nil {
			return st, &os.PathError{Op: "lstat", Path: d.path, Err: err}
		}
		return st, nil
	}
	err := d.at("lstat", rel, func(dirfd int, name string) error {
		return unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW)
	})
	return st, err
}

// Mkdir creates the directory rel; its parent must exist.
func (d *Dir) Mkdir(rel string, perm uint32) error {
	return d.at("mkdir", rel, func(dirfd int, name string) error { return unix.Mkdirat(dirfd, name, perm) })
}

// MkdirAll creates rel and every missing parent.
func (d *Dir) MkdirAll(rel string, perm uint32) error {
	if rel == "" {
		return nil
	}
	err := d.Mkdir(rel, perm)
	if err == nil || errors.Is(err, unix.EEXIST) {
		if err != nil {
			if st, serr := d.Lstat(rel); serr != nil || st.Mode&unix.S_IFMT != unix.S_IFDIR {
				return err
			}
		}
		return nil
	}
	if !errors.Is(err, unix.ENOENT) {
		return err
	}
	if parent := path.Dir(rel); parent != "." {
		if err := d.MkdirAll(parent, perm); err != nil {
			return err
		}
	}
	return d.Mkdir(rel, perm)
}

// Symlink creates rel as a symlink to target.
func (d *Dir) Symlink(target, rel string) error {
	return d.at("symlink", rel, func(dirfd int, name string) error { return unix.Symlinkat(target, dirfd, name) })
}

// Readlink returns the target of the symlink rel.
func (d *Dir) Readlink(rel string) (string, error) {
	var target string
	err := d.at("readlink", rel, func(dirfd int, name string) error {
		var err error
		target, err = readlinkat(dirfd, name)
		return err
	})
	return target, err
}

// Mknod creates rel as a FIFO, socket or device node (mode holds the type bits).
func (d *Dir) Mknod(rel string, mode uint32, dev uint64) error {
	return d.at("mknod", rel, func(dirfd int, name string) error { return unix.Mknodat(dirfd, name, mode, int(dev)) })
}

// Link gives the file at the absolute path src the name rel (a hard link).
func (d *Dir) Link(src, rel string) error {
	return d.at("link", rel, func(dirfd int, name string) error { return unix.Linkat(unix.AT_FDCWD, src, dirfd, name, 0) })
}

// LinkFrom gives the file srcName of the directory src the name rel in the tree (a hard link).
// srcName is one path element: the kernel resolves no path on either side when rel is one too,
// which is what makes a tree of many files cheap to link (one linkat each).
func (d *Dir) LinkFrom(src *Dir, srcName, rel string) error {
	if strings.Contains(srcName, "/") || srcName == "" {
		return &os.PathError{Op: "link", Path: src.errPath(srcName), Err: unix.EINVAL}
	}
	return d.at("link", rel, func(dirfd int, name string) error { return unix.Linkat(src.fd, srcName, dirfd, name, 0) })
}

// A Walker links the files of a tree listed in order (List: a directory's entries follow it)
// into another directory, opening the directory holding each file once for the files that
// follow it in the same directory, instead of resolving every path from the root. It is for one
// goroutine; Close releases it.
type Walker struct {
	d      *Dir
	parent string // the directory open as fd ("" : none)
	fd     int
}

// Walker returns a Walker over d.
func (d *Dir) Walker() *Walker { return &Walker{d: d, fd: -1} }

// LinkTo gives the file rel of the tree the name dstName in the directory dst (a hard link).
func (w *Walker) LinkTo(rel string, dst *Dir, dstName string) error {
	dir, base := path.Split(rel)
	dir = strings.TrimSuffix(dir, "/")
	fd := w.d.fd
	if dir != "" {
		if dir != w.parent || w.fd < 0 {
			w.Close()
			pfd, _, err := w.d.openParent(rel)
			if err != nil {
				return &os.PathError{Op: "link", Path: w.d.errPath(rel), Err: err}
			}
			w.parent, w.fd = dir, pfd
		}
		fd = w.fd
	}
	if err := unix.Linkat(fd, base, dst.fd, dstName, 0); err != nil {
		return &os.PathError{Op: "link", Path: w.d.errPath(rel), Err: err}
	}
	return nil
}

// Close releases the directory the walker holds open.
func (w *Walker) Close() {
	if w.fd >= 0 {
		w.d.closeParent(w.fd)
	}
	w.parent, w.fd = "", -1
}

// Create makes the non-file entry e (a directory, symlink or special file) in the tree; its
// parent must exist. Regular files are written with Open.
func (d *Dir) Create(e TreeEntry, perm uint32) error {
	switch e.Type {
	case EntryDir:
		return d.Mkdir(e.Path, perm)
	case EntrySymlink:
		return d.Symlink(e.Target, e.Path)
	case EntryFIFO, EntrySocket, EntryCharDev, EntryBlockDev:
		return d.Mknod(e.Path, e.Type.Mode()|perm&0o7777, e.Rdev)
	}
	return fmt.Errorf("create %s: a %v is not created this way", d.errPath(e.Path), e.Type)
}

func readlinkat(dirfd int, name string) (string, error) {
	for size := 256; ; size *= 2 {
		buf := make([]byte, size)
		n, err := unix.Readlinkat(dirfd, name, buf)
		if err != nil {
			return "", err
		}
		if n < size {
			return string(buf[:n]), nil
		}
	}
}

// List lists the entries below the root with sizes, symlink targets and device numbers but no
// digests: what a checkpoint tree holds (see TreeHash).
func (d *Dir) List() ([]TreeEntry, error) {
	var out []TreeEntry
	err := listAt(d.fd, "", &out, nil, listSized)
	if err != nil {
		return nil, fmt.Errorf("list %s: %w", d.path, err)
	}
	return out, nil
}

// listKeyed is List that also returns, for each entry, the identity and version of a regular
// file as the listing's stat saw it (the zero key for other entries): a digest cached for that
// key needs no open of the file.
func (d *Dir) listKeyed() ([]TreeEntry, []digestKey, error) {
	var out []TreeEntry
	var keys []digestKey
	if err := listAt(d.fd, "", &out, &keys, listKeyed); err != nil {
		return nil, nil, fmt.Errorf("list %s: %w", d.path, err)
	}
	return out, keys, nil
}

// listAt appends the entries below the directory dirfd (whose path in the tree is rel) to out,
// parents before their children, and with keys set each entry's digest key to keys. Its
// subdirectories are listed by up to GOMAXPROCS goroutines (a step of 100,000 files costs one
// stat per file: on one thread that was most of a seal's hash), each holding one descriptor per
// level of the tree; the result is in the order a walk on one thread gives.
func listAt(dirfd int, rel string, out *[]TreeEntry, keys *[]digestKey, mode listMode) error {
	var g errgroup.Group
	g.SetLimit(runtime.GOMAXPROCS(0) - 1) // the caller's goroutine lists too
	root := &dirListing{}
	err := root.list(&g, dirfd, rel, mode)
	if gerr := g.Wait(); err == nil {
		err = gerr
	}
	if err != nil {
		return err
	}
	// Sized once: appending 100,000 entries of 88 bytes grew and copied the slice some twenty
	// times (a fifth of a CPU-second in a profile of a restart's adoption).
	n := root.count()
	*out = slices.Grow(*out, n)
	if keys != nil {
		*keys = slices.Grow(*keys, n)
	}
	root.flatten(out, keys)
	return nil
}

// count is the number of entries flatten appends.
func (l *dirListing) count() int {
	n := len(l.entries)
	for _, sub := range l.subs {
		n += sub.count()
	}
	return n
}

// ListUnsized is List without a stat of each regular file: their Size is -1, to be filled in
// by HashEntries (the stat of the descriptor it hashes), before which TreeHash refuses them.
// For a listing that is hashed anyway, such as the verification of a restarted agent's steps,
// it saves a system call per file; the file type comes from the directory entry (a stat only
// where the filesystem does not give it).
func (d *Dir) ListUnsized() ([]TreeEntry, error) {
	var out []TreeEntry
	if err := listAt(d.fd, "", &out, nil, listUnsized); err != nil {
		return nil, fmt.Errorf("list %s: %w", d.path, err)
	}
	return out, nil
}

// listMode says what a listing reads of each entry.
type listMode int

const (
	listSized   listMode = iota // a stat of every entry: types and sizes
	listKeyed                   // and each regular file's digest key
	listUnsized                 // regular files from the directory entry alone: Size -1
)

// dirListing is one directory's entries, and the listing of each subdirectory among them.
type dirListing struct {
	entries []TreeEntry
	keys    []digestKey
	subs    map[int]*dirListing // by index in entries
}

// list fills l with the directory dirfd (at rel in the tree) and, through g when it has a
// goroutine free and inline otherwise, with its subdirectories. dirfd stays the caller's.
func (l *dirListing) list(g *errgroup.Group, dirfd int, rel string, mode listMode) error {
	fd, err := unix.Openat(dirfd, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	f := os.NewFile(uintptr(fd), rel)
	var names []string
	var types []os.FileMode // listUnsized: each name's type as its directory entry gives it
	if mode == listUnsized {
		var ents []os.DirEntry
		ents, err = f.ReadDir(-1) // os lstats the entries whose type the filesystem omits
		names, types = make([]string, len(ents)), make([]os.FileMode, len(ents))
		for i, e := range ents {
			names[i], types[i] = e.Name(), e.Type()
		}
	} else {
		names, err = f.Readdirnames(-1)
	}
	f.Close()
	if err != nil {
		return err
	}
	keyed := mode == listKeyed
	l.entries = make([]TreeEntry, 0, len(names))
	if keyed {
		l.keys = make([]digestKey, 0, len(names))
	}
	for i, name := range names {
		p := name
		if rel != "" {
			p = rel + "/" + name
		}
		if types != nil && types[i].IsRegular() {
			l.entries = append(l.entries, TreeEntry{Path: p, Type: EntryFile, Size: -1})
			continue
		}
		var st unix.Stat_t
		if err := unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		e := TreeEntry{Path: p, Type: typeOfMode(st.Mode)}
		var k digestKey
		switch e.Type {
		case EntryFile:
			e.Size = st.Size
			k = digestKey{dev: st.Dev, ino: st.Ino, size: uint64(st.Size), mtime: st.Mtim.Nano()}
		case EntrySymlink:
			if e.Target, err = readlinkat(dirfd, name); err != nil {
				return fmt.Errorf("%s: %w", p, err)
			}
		case EntryCharDev, EntryBlockDev:
			e.Rdev = st.Rdev
		case EntryDir:
			sub, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
			if err != nil {
				return fmt.Errorf("%s: %w", p, err)
			}
			sl := &dirListing{}
			if l.subs == nil {
				l.subs = map[int]*dirListing{}
			}
			l.subs[len(l.entries)] = sl
			listSub := func() error {
				defer unix.Close(sub)
				return sl.list(g, sub, p, mode)
			}
			if !g.TryGo(listSub) {
				if err := listSub(); err != nil {
					return err
				}
			}
		case 0:
			return fmt.Errorf("%s: unknown file type %o", p, st.Mode&unix.S_IFMT)
		}
		l.entries = append(l.entries, e)
		if keyed {
			l.keys = append(l.keys, k)
		}
	}
	return nil
}

// flatten appends l's entries to out (and keys), each subdirectory's right after its own entry.
func (l *dirListing) flatten(out *[]TreeEntry, keys *[]digestKey) {
	for i, e := range l.entries {
		*out = append(*out, e)
		if keys != nil {
			*keys = append(*keys, l.keys[i])
		}
		if sub := l.subs[i]; sub != nil {
			sub.flatten(out, keys)
		}
	}
}

// typeOfMode maps the type bits of a stat mode to an entry type (0: unknown).
func typeOfMode(mode uint32) EntryType {
	switch mode & unix.S_IFMT {
	case unix.S_IFREG:
		return EntryFile
	case unix.S_IFDIR:
		return EntryDir
	case unix.S_IFLNK:
		return EntrySymlink
	case unix.S_IFIFO:
		return EntryFIFO
	case unix.S_IFSOCK:
		return EntrySocket
	case unix.S_IFCHR:
		return EntryCharDev
	case unix.S_IFBLK:
		return EntryBlockDev
	}
	return 0
}

// Mode is the stat type bits of a special entry type (0 for the others).
func (t EntryType) Mode() uint32 {
	switch t {
	case EntryFIFO:
		return unix.S_IFIFO
	case EntrySocket:
		return unix.S_IFSOCK
	case EntryCharDev:
		return unix.S_IFCHR
	case EntryBlockDev:
		return unix.S_IFBLK
	}
	return 0
}
