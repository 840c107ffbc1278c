package layout

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Attrs are the owners and permission bits of a data's entries as the job left them. The data's
// content name (TreeHash) leaves them out, as it leaves out times: two nodes saving the same bytes
// name them alike. They travel beside the data (<data>.attrs in the spool, a peer push's
// manifest, a backup's <hash>.data.attrs object), so that a restored checkpoint has the owners
// and modes it was saved with rather than the agent's (root, 0644 and 0755); data without them
// (an earlier agent's, the reference system's) restores with those defaults.
//
// Most trees have one owner, one mode for files and one for directories: those are the
// defaults, and only the entries that differ are listed. Example:
//
//	mtcfs attrs v1
//	default 1000 1000 0644 0755
//	0600 1000 1000 "state/secret"
//	0700 0 0 "state/private"
//
// (uid, gid, file mode and directory mode; then mode, uid, gid and Go-quoted path of each entry
// that differs; the top gives the defaults, so it is never listed). A symlink's mode is not kept (it is always 0777);
// a special file (FIFO, socket, device) takes the file mode.
type Attrs struct {
	UID, GID          uint32
	FileMode, DirMode uint32 // permission bits, set-id and sticky bits
	Except            map[string]Attr
}

// Attr is one entry's owner and mode.
type Attr struct {
	Mode, UID, GID uint32
}

// AttrsFile is where the Attrs of the data at dataPath are kept: beside it, as
// "<dataPath>.attrs" (spool/sealed/<hash>.data.attrs, a commit record's data.attrs, a transfer's
// incoming data). Whoever moves or removes the data moves or removes it too.
func AttrsFile(dataPath string) string { return dataPath + ".attrs" }

// ReadAttrs reads the Attrs kept for the data at dataPath: nil and an error wrapping
// os.ErrNotExist when there are none.
func ReadAttrs(dataPath string) (*Attrs, error) {
	a, _, err := ReadAttrsEncoded(dataPath)
	return a, err
}

// ReadAttrsEncoded is ReadAttrs that also returns the bytes read, which are a's encoding
// (DecodeAttrs takes only that): what a sender passes on as it is.
func ReadAttrsEncoded(dataPath string) (*Attrs, []byte, error) {
	f, err := os.Open(AttrsFile(dataPath))
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, MaxAttrsSize+1))
	if err != nil {
		return nil, nil, err
	}
	a, err := DecodeAttrs(data)
	if err != nil {
		return nil, nil, err
	}
	return a, data, nil
}

// RenameWithAttrs renames the data at src to dst with the Attrs kept beside it, if any. The
// attrs go first: a crash in between leaves attrs without data (whoever lists the data's
// directory removes such orphans), never data without the attrs it came with; a failed data
// rename puts the attrs back.
func RenameWithAttrs(src, dst string) error {
	moved := true
	if err := os.Rename(AttrsFile(src), AttrsFile(dst)); errors.Is(err, os.ErrNotExist) {
		moved = false
	} else if err != nil {
		return err
	}
	if err := os.Rename(src, dst); err != nil {
		if moved {
			os.Rename(AttrsFile(dst), AttrsFile(src))
		}
		return err
	}
	return nil
}

// ErrAttrsTooLarge is the error of a WriteAttrs whose encoding readers would refuse.
var ErrAttrsTooLarge = fmt.Errorf("owners and modes: more than %d bytes encoded", MaxAttrsSize)

// WriteAttrs keeps a for the data at dataPath (nil: nothing to keep), through a temporary name.
// It refuses (ErrAttrsTooLarge) an encoding longer than MaxAttrsSize.
func WriteAttrs(dataPath string, a *Attrs) error {
	if a == nil {
		return nil
	}
	enc := a.Encode()
	if len(enc) > MaxAttrsSize {
		return ErrAttrsTooLarge
	}
	return WriteFileAtomic(AttrsFile(dataPath), enc)
}

// WriteFileAtomic writes data to p (mode 0600) through a temporary name beside it
// (".<name>.tmp"), removed if anything fails: p holds the old content or the new, whole.
func WriteFileAtomic(p string, data []byte) error {
	tmp := filepath.Join(filepath.Dir(p), "."+filepath.Base(p)+".tmp")
	err := os.WriteFile(tmp, data, 0o600)
	if err == nil {
		err = os.Rename(tmp, p)
	}
	if err != nil {
		os.Remove(tmp)
	}
	return err
}

// attrsMagic starts an encoding; a new format gets a new one.
const attrsMagic = "mtcfs attrs v1"

// MaxAttrsSize bounds an encoding a reader accepts (a tree of a million entries that all differ
// from the defaults, with short names).
const MaxAttrsSize = 64 << 20

// AttrsBuilder makes Attrs from the entries of a tree, visited in any order.
type AttrsBuilder struct {
	a Attrs
	// files are the regular and special files owned by the top's owner and group: which of
	// them are listed waits for the file mode most of them have.
	files []pendingFile
	done  bool
}

type pendingFile struct {
	mode uint32
	path func() string
}

// NewAttrsBuilder starts Attrs whose defaults are the owner and mode of the top of the tree.
// For a directory (dir), its mode is the directory mode, and the file mode is the one most of
// the files of the top's owner and group have (ties: the directory mode without the execute,
// set-id and sticky bits, as one umask makes 0755 and 0644, else the lowest): a job whose
// files are written through mkstemp (0600) into 0755 directories lists none of them. The
// encoding does not depend on the order of the entries.
func NewAttrsBuilder(top Attr, dir bool) *AttrsBuilder {
	mode := top.Mode & 0o7777
	b := &AttrsBuilder{a: Attrs{UID: top.UID, GID: top.GID, FileMode: mode, DirMode: 0o755}}
	if dir {
		b.a.FileMode, b.a.DirMode = mode&0o666, mode
	}
	return b
}

// Add records the entry at path (relative, slash-separated) of type t; path is called only when
// the entry differs from the defaults.
func (b *AttrsBuilder) Add(t EntryType, at Attr, path func() string) {
	at.Mode &= 0o7777
	switch {
	case t == EntrySymlink:
		at.Mode = 0
	case t != EntryDir && at.UID == b.a.UID && at.GID == b.a.GID:
		b.files = append(b.files, pendingFile{at.Mode, path})
		return
	}
	if at != b.a.defaultOf(t) {
		b.except(path(), at)
	}
}

func (b *AttrsBuilder) except(path string, at Attr) {
	if b.a.Except == nil {
		b.a.Except = map[string]Attr{}
	}
	b.a.Except[path] = at
}

// Attrs returns what was added.
func (b *AttrsBuilder) Attrs() *Attrs {
	if !b.done && len(b.files) > 0 {
		count := map[uint32]int{}
		for _, f := range b.files {
			count[f.mode]++
		}
		best := b.a.FileMode
		for m, n := range count {
			if n > count[best] || n == count[best] && m < best && best != b.a.FileMode {
				best = m
			}
		}
		b.a.FileMode = best
		for _, f := range b.files {
			if f.mode != best {
				b.except(f.path(), Attr{f.mode, b.a.UID, b.a.GID})
			}
		}
		b.files = nil
	}
	b.done = true
	return &b.a
}

// defaultOf is what an entry of type t has when it is not listed.
func (a *Attrs) defaultOf(t EntryType) Attr {
	switch t {
	case EntryDir:
		return Attr{a.DirMode, a.UID, a.GID}
	case EntrySymlink:
		return Attr{0, a.UID, a.GID}
	default:
		return Attr{a.FileMode, a.UID, a.GID}
	}
}

// Of returns the owner and mode of the entry at path, of type t ("" is the top).
func (a *Attrs) Of(path string, t EntryType) Attr {
	if at, ok := a.Except[path]; ok {
		return at
	}
	return a.defaultOf(t)
}

// Encode returns the text form shown on Attrs, its entries in path order.
func (a *Attrs) Encode() []byte {
	var buf bytes.Buffer
	fmt.Fprintf(&buf, "%s\ndefault %d %d %04o %04o\n", attrsMagic, a.UID, a.GID, a.FileMode, a.DirMode)
	paths := make([]string, 0, len(a.Except))
	for p := range a.Except {
		paths = append(paths, p)
	}
	slices.Sort(paths)
	for _, p := range paths {
		at := a.Except[p]
		fmt.Fprintf(&buf, "%04o %d %d %s\n", at.Mode, at.UID, at.GID, strconv.Quote(p))
	}
	return buf.Bytes()
}

// DecodeAttrs reads what Encode wrote, refusing anything else: another format, a mode beyond
// the permission, set-id and sticky bits, an invalid path, a path given twice.
func DecodeAttrs(data []byte) (*Attrs, error) {
	if len(data) > MaxAttrsSize {
		return nil, fmt.Errorf("attrs: %d bytes, more than %d", len(data), MaxAttrsSize)
	}
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(nil, 1<<20)
	line := 0
	bad := func(format string, args ...any) error {
		return fmt.Errorf("attrs line %d: %s", line, fmt.Sprintf(format, args...))
	}
	next := func() (string, bool) {
		if !sc.Scan() {
			return "", false
		}
		line++
		return sc.Text(), true
	}
	if l, ok := next(); !ok || l != attrsMagic {
		return nil, fmt.Errorf("attrs: not %q", attrsMagic)
	}
	l, ok := next()
	if !ok {
		return nil, bad("no defaults")
	}
	var a Attrs
	f := strings.Split(l, " ")
	if len(f) != 5 || f[0] != "default" {
		return nil, bad("want %q, got %q", "default UID GID FILEMODE DIRMODE", l)
	}
	var err error
	if a.UID, a.GID, err = parseOwner(f[1], f[2]); err != nil {
		return nil, bad("%v", err)
	}
	if a.FileMode, err = parseMode(f[3]); err != nil {
		return nil, bad("%v", err)
	}
	if a.DirMode, err = parseMode(f[4]); err != nil {
		return nil, bad("%v", err)
	}
	for {
		l, ok := next()
		if !ok {
			break
		}
		fields := strings.SplitN(l, " ", 4)
		if len(fields) != 4 {
			return nil, bad("want MODE UID GID \"PATH\", got %q", l)
		}
		var at Attr
		if at.Mode, err = parseMode(fields[0]); err != nil {
			return nil, bad("%v", err)
		}
		if at.UID, at.GID, err = parseOwner(fields[1], fields[2]); err != nil {
			return nil, bad("%v", err)
		}
		p, err := strconv.Unquote(fields[3])
		if err != nil {
			return nil, bad("bad path %s", fields[3])
		}
		if p != "" && !ValidPath(p) {
			return nil, bad("invalid path %q", p)
		}
		if a.Except == nil {
			a.Except = map[string]Attr{}
		}
		if _, dup := a.Except[p]; dup {
			return nil, bad("%q given twice", p)
		}
		a.Except[p] = at
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("attrs: %w", err)
	}
	// Only what Encode writes: modes of four digits, paths in order and quoted one way (a raw
	// byte that is not UTF-8 inside the quotes would come back as U+FFFD, another path).
	if !bytes.Equal(a.Encode(), data) {
		return nil, errors.New("attrs: not in the form Encode writes")
	}
	return &a, nil
}

func parseOwner(u, g string) (uid, gid uint32, err error) {
	uid64, err1 := strconv.ParseUint(u, 10, 32)
	gid64, err2 := strconv.ParseUint(g, 10, 32)
	if err1 != nil || err2 != nil {
		return 0, 0, fmt.Errorf("bad owner %q %q", u, g)
	}
	return uint32(uid64), uint32(gid64), nil
}

func parseMode(s string) (uint32, error) {
	m, err := strconv.ParseUint(s, 8, 32)
	if err != nil || m&^0o7777 != 0 {
		return 0, fmt.Errorf("bad mode %q", s)
	}
	return uint32(m), nil
}

// ApplyAttrs gives the data at p (a file, or a directory tree) the modes a keeps, and with
// owners its owners too (root only may give files away); a nil a changes nothing. Directories
// get theirs last, deepest first, so that a mode that closes one does not stop the walk. Symlinks
// keep their mode (always 0777); owners are set before modes, since a chown clears set-id bits.
// Paths of any length work (Dir). An export wrote every file 0600 and every directory 0700,
// root's, though owners and modes travel in every tier (black-box h57).
func ApplyAttrs(p string, a *Attrs, owners bool) error {
	if a == nil {
		return nil
	}
	set := func(chown func(uid, gid int) error, chmod func(mode uint32) error, at Attr, t EntryType) error {
		if owners {
			if err := chown(int(at.UID), int(at.GID)); err != nil {
				return err
			}
		}
		if t == EntrySymlink {
			return nil
		}
		return chmod(at.Mode)
	}
	fi, err := os.Lstat(p)
	if err != nil {
		return err
	}
	if !fi.IsDir() {
		return set(func(u, g int) error { return os.Lchown(p, u, g) }, func(m uint32) error { return unix.Chmod(p, m) }, a.Of("", EntryFile), EntryFile)
	}
	d, err := OpenDir(p)
	if err != nil {
		return err
	}
	defer d.Close()
	entries, err := d.ListUnsized()
	if err != nil {
		return err
	}
	apply := func(e TreeEntry) error {
		return d.at("chmod", e.Path, func(dirfd int, name string) error {
			return set(func(u, g int) error { return unix.Fchownat(dirfd, name, u, g, unix.AT_SYMLINK_NOFOLLOW) },
				func(m uint32) error { return unix.Fchmodat(dirfd, name, m, 0) }, a.Of(e.Path, e.Type), e.Type)
		})
	}
	var dirs []TreeEntry
	for _, e := range entries {
		if e.Type == EntryDir {
			dirs = append(dirs, e)
		} else if err := apply(e); err != nil {
			return err
		}
	}
	slices.SortFunc(dirs, func(x, y TreeEntry) int { return strings.Count(y.Path, "/") - strings.Count(x.Path, "/") })
	for _, e := range dirs {
		if err := apply(e); err != nil {
			return err
		}
	}
	return set(func(u, g int) error { return unix.Fchown(d.fd, u, g) }, func(m uint32) error { return unix.Fchmod(d.fd, m) }, a.Of("", EntryDir), EntryDir)
}
