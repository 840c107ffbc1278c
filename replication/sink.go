package replication

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/replication/peerpb"
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// sink receives the files of one manifest into a private directory and verifies them. Both ends
// use it: the receiver of a push and the caller of a fetch. Chunks may arrive from several
// streams at once; verify runs after every stream ended.
//
// Every entry of a tree is created and opened relative to a descriptor of its parent directory
// (layout.Dir), never through a path that the kernel resolves from outside: paths may be longer
// than PATH_MAX, and no symlink inside the tree is ever followed, whatever the peer sent.
type sink struct {
	m    *manifest
	tmp  string // private directory (mode 0700), removed by discard
	root string // tmp/<data name>: the data itself
	// dir is root open as a tree, for a directory's data; nil for a single file and once the
	// sink was discarded. Holders of dirMu.RLock may use it: discard closes it under the write
	// lock, so its descriptor number is never reused under a concurrent open.
	dirMu sync.RWMutex
	dir   *layout.Dir // GUARDED_BY(dirMu)
	// dropped holds why discard was called; writes fail from then on.
	dropped atomic.Pointer[error]
	files   []sinkFile
	// known holds the digests verify need not read the files for: those of the files adopt
	// linked in (verified when they arrived as early files, and not written since) and of the
	// files hashed as their chunks arrived (sinkFile.hash).
	known *layout.DigestCache
	// corrupt counts the chunks that failed their CRC32C on arrival (nil: not counted).
	corrupt *atomic.Int64
}

// sinkFile tracks what arrived for one file.
type sinkFile struct {
	mu      sync.Mutex
	f       *os.File // GUARDED_BY(mu); open while bytes are missing
	have    []span   // GUARDED_BY(mu); sorted, disjoint, merged ranges written or being written
	done    int64    // GUARDED_BY(mu); bytes written
	writers int      // GUARDED_BY(mu); writes in progress
	// hash is the file's digest being computed from the chunks as they arrive, while their
	// bytes are still in the CPU's caches; nil before the first chunk and once the file is
	// complete. What it holds is a few chaining values per run of chunks that arrived.
	hash *layout.ArrivalHash // GUARDED_BY(mu)
	// failed says a write of this file failed: what it holds is not what arrived.
	failed bool // GUARDED_BY(mu)
}

type span struct{ lo, hi int64 }

// newSink creates a private directory in dir (named prefix + random) holding the manifest's
// directories, symlinks, special entries and empty files (but not the files m presumes: adopt
// links those in).
func newSink(dir, prefix string, m *manifest) (*sink, error) {
	tmp, err := os.MkdirTemp(dir, prefix)
	if err != nil {
		return nil, fmt.Errorf("create incoming directory: %w", err)
	}
	s := &sink{m: m, tmp: tmp, root: filepath.Join(tmp, m.pb.DataName), files: make([]sinkFile, len(m.pb.Files)), known: &layout.DigestCache{}}
	if err := s.create(); err != nil {
		s.discard(err)
		return nil, fmt.Errorf("create %s: %w", m.pb.DataName, err)
	}
	return s, nil
}

// openFile opens file i of the data with flags (O_NOFOLLOW implied).
func (s *sink) openFile(i int, flags int, perm uint32) (*os.File, error) {
	if s.m.kind != kindTree {
		return os.OpenFile(s.root, flags|syscall.O_NOFOLLOW, os.FileMode(perm))
	}
	s.dirMu.RLock()
	defer s.dirMu.RUnlock()
	if s.dir == nil {
		return nil, errors.New("the transfer's directory is gone")
	}
	return s.dir.Open(string(s.m.pb.Files[i].Path), flags, perm)
}

func (s *sink) create() error {
	if len(s.m.pb.Attrs) > 0 { // checkManifest decoded them
		if err := os.WriteFile(layout.AttrsFile(s.root), s.m.pb.Attrs, 0o600); err != nil {
			return err
		}
	}
	if s.m.kind != kindTree {
		f, err := s.openFile(0, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
		if err != nil {
			return err
		}
		return f.Close()
	}
	if err := os.Mkdir(s.root, 0o755); err != nil {
		return err
	}
	d, err := layout.OpenDir(s.root)
	if err != nil {
		return err
	}
	s.dirMu.Lock()
	s.dir = d
	s.dirMu.Unlock()
	return buildTree(d, s.m) // nothing discards the sink before newSink returns it
}

// buildTree creates the entries of m's tree in root, an empty directory: directories (also those
// the manifest leaves implicit), empty regular files (except the presumed ones), symlinks and
// special entries. Entries are made in path order, each relative to a descriptor of its parent,
// which is opened from its own parent's descriptor without following a symlink: the work is
// linear in the total length of the paths, whatever their depth, and an entry listed below a
// symlink or a file (checkManifest refuses that already) fails here too instead of landing
// wherever the link points.
func buildTree(root *layout.Dir, m *manifest) error {
	type item struct {
		e    layout.TreeEntry
		skip bool // a presumed file: only its parent directories are made
	}
	entries := m.entries()
	items := make([]item, len(entries))
	for i, e := range entries {
		items[i] = item{e: e, skip: i < len(m.pb.Files) && !m.sent(i)} // entry i < len(Files) is file i
	}
	slices.SortFunc(items, func(a, b item) int { return strings.Compare(a.e.Path, b.e.Path) })

	// open[k] is the directory named by the first k elements of names; open[0] is root.
	open := []*layout.Dir{root}
	var names []string
	defer func() {
		for _, d := range open[1:] {
			d.Close()
		}
	}()
	for _, it := range items {
		elems := strings.Split(it.e.Path, "/")
		parent, base := elems[:len(elems)-1], elems[len(elems)-1]
		keep := 0
		for keep < len(names) && keep < len(parent) && names[keep] == parent[keep] {
			keep++
		}
		for _, d := range open[keep+1:] {
			d.Close()
		}
		open, names = open[:keep+1], names[:keep]
		for _, name := range parent[keep:] {
			top := open[len(open)-1]
			sub, err := top.OpenDir(name)
			if errors.Is(err, fs.ErrNotExist) { // a directory the manifest left implicit
				if err = top.Mkdir(name, 0o755); err == nil {
					sub, err = top.OpenDir(name)
				}
			}
			if err != nil {
				return fmt.Errorf("%q: parent %q: %w", it.e.Path, strings.Join(append(names, name), "/"), unwrapPath(err))
			}
			open, names = append(open, sub), append(names, name)
		}
		top := open[len(open)-1]
		var err error
		switch e := it.e; {
		case e.Type == layout.EntryFile:
			if it.skip {
				continue
			}
			var f *os.File
			if f, err = top.Open(base, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644); err == nil {
				err = f.Close()
			}
		case e.Type == layout.EntryDir:
			err = top.Mkdir(base, 0o755)
		case e.Type == layout.EntrySymlink:
			err = top.Symlink(e.Target, base)
		case e.Type.Special():
			err = top.Create(layout.TreeEntry{Path: base, Type: e.Type, Rdev: e.Rdev}, 0o644)
			if err != nil && (e.Type == layout.EntryCharDev || e.Type == layout.EntryBlockDev) && errors.Is(err, unix.EPERM) {
				return errPrecondition("%v %q (%d:%d) cannot be created here: %v; holding a checkpoint with device nodes "+
					"needs an agent allowed to mknod them (CAP_MKNOD outside a user namespace)",
					e.Type, e.Path, unix.Major(e.Rdev), unix.Minor(e.Rdev), unwrapPath(err))
			}
		default:
			err = fmt.Errorf("unknown entry type %v", e.Type)
		}
		if err != nil {
			return fmt.Errorf("%q: %w", it.e.Path, unwrapPath(err))
		}
	}
	return nil
}

// unwrapPath drops the path of an *fs.PathError, which for a deep tree repeats a long prefix the
// caller names better.
func unwrapPath(err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return fmt.Errorf("%s: %w", pe.Op, pe.Err)
	}
	return err
}

// write checks one chunk and writes it in place with pwritev: a chunk as it is straight from
// the buffers it arrived in, a compressed one (Chunk.codec) from its decoded form in inf. A
// chunk must lie inside its file and must not overlap bytes already received. It returns the
// original bytes written.
func (s *sink) write(c *inChunk, inf *inflater) (int64, error) {
	if err := s.droppedErr(); err != nil {
		return 0, err
	}
	if c.file >= uint32(len(s.files)) {
		return 0, errInvalid("chunk for file %d of %d", c.file, len(s.files))
	}
	meta := s.m.pb.Files[c.file]
	n := int64(c.size)
	fits := n > 0 && c.offset >= 0 && c.offset <= meta.Size-n
	if c.codec != 0 { // the decoded length is checked against the file before decoding
		fits = n > 0 && c.offset >= 0 && c.offset < meta.Size
	}
	if !fits {
		return 0, errInvalid("chunk of %d bytes at %d does not fit %q (%d bytes)", n, c.offset, meta.Path, meta.Size)
	}
	pieces := make([][]byte, len(c.data))
	var crc uint32
	for i, b := range c.data {
		pieces[i] = b.ReadOnlyData()
		crc = crc32.Update(crc, castagnoli, pieces[i])
	}
	if crc != c.crc {
		if s.corrupt != nil {
			s.corrupt.Add(1)
		}
		return 0, errCorrupt("chunk of %q at %d (%d bytes): CRC32C %08x, sender said %08x", meta.Path, c.offset, c.size, crc, c.crc)
	}
	switch c.codec {
	case 0:
	case codecPlanes:
		plain, err := inf.decode(c, meta.Size-c.offset)
		if err != nil {
			return 0, errCorrupt("compressed chunk of %q at %d (%d bytes): %v", meta.Path, c.offset, c.size, err)
		}
		pieces, n = [][]byte{plain}, int64(len(plain))
	default:
		return 0, errInvalid("chunk of %q at %d: unknown codec %d", meta.Path, c.offset, c.codec)
	}

	sf := &s.files[c.file]
	sf.mu.Lock()
	if err := sf.claim(span{c.offset, c.offset + n}); err != nil {
		sf.mu.Unlock()
		return 0, errInvalid("%q: %v", meta.Path, err)
	}
	if sf.f == nil {
		// Read and write: the hash reads back the bytes no single chunk held whole.
		f, err := s.openFile(int(c.file), os.O_RDWR, 0)
		if err != nil {
			sf.mu.Unlock()
			if derr := s.droppedErr(); derr != nil {
				return 0, derr
			}
			return 0, fmt.Errorf("open %q: %w", meta.Path, err)
		}
		sf.f = f
	}
	if sf.hash == nil {
		sf.hash = layout.NewArrivalHash(meta.Size)
	}
	f, h := sf.f, sf.hash
	sf.writers++
	sf.mu.Unlock()

	h.Add(pieces, c.offset) // before pwritev, which consumes pieces
	werr := pwritev(f, pieces, c.offset)

	sf.mu.Lock()
	defer sf.mu.Unlock()
	sf.writers--
	sf.done += n
	sf.failed = sf.failed || werr != nil
	if sf.done == meta.Size && sf.writers == 0 && sf.f != nil {
		if !sf.failed {
			// Every byte was written, each exactly once (claim): the digest of what arrived
			// is the file's. verify finds it by the file's identity and version; should
			// anything change the file after this, it misses and reads the file instead.
			// After a failed write it reads the file (a failed write fails its stream and
			// the transfer anyway).
			if d, err := sf.hash.Finish(context.Background(), sf.f); err == nil {
				s.known.RememberFile(sf.f, d)
			}
		}
		sf.hash = nil // needed no longer
		if err := sf.f.Close(); err != nil && werr == nil {
			werr = err
		}
		sf.f = nil
	}
	if werr != nil {
		if err := s.droppedErr(); err != nil {
			return 0, err
		}
		return 0, fmt.Errorf("write %q at %d: %w", meta.Path, c.offset, werr)
	}
	return n, nil
}

// maxIovecs is IOV_MAX: the most buffers one pwritev takes.
const maxIovecs = 1024

// pwritev writes pieces, concatenated, at off. It goes through f's SyscallConn, which holds
// the descriptor for the duration: discard closing f meanwhile cannot hand the descriptor
// number to another file under this write.
func pwritev(f *os.File, pieces [][]byte, off int64) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var werr error
	err = rc.Write(func(fd uintptr) bool {
		for len(pieces) > 0 {
			batch := pieces[:min(len(pieces), maxIovecs)]
			n, err := unix.Pwritev(int(fd), batch, off)
			if err == unix.EINTR {
				continue
			}
			if err != nil {
				werr = err
				return true
			}
			if n == 0 {
				werr = io.ErrShortWrite
				return true
			}
			off += int64(n)
			for n > 0 { // drop what was written; a partial write leaves a partial piece
				if k := len(pieces[0]); n >= k {
					pieces, n = pieces[1:], n-k
				} else {
					pieces[0], n = pieces[0][n:], 0
				}
			}
		}
		return true
	})
	if err != nil {
		return err
	}
	return werr
}

// adopt makes file i, a presumed file (which newSink did not create), a hard link to src, an
// early file already verified to have digest d and the manifest's size, instead of receiving
// its bytes. Call it before any chunk arrives.
func (s *sink) adopt(i int, src string, d layout.FileDigest) error {
	if s.m.kind != kindTree {
		return fmt.Errorf("%s: only the files of a tree are adopted", s.m.pb.DataName)
	}
	s.dirMu.RLock()
	err := errors.New("the transfer's directory is gone")
	if s.dir != nil {
		err = s.dir.Link(src, string(s.m.pb.Files[i].Path))
	}
	s.dirMu.RUnlock()
	if err != nil {
		return err
	}
	// src and the link are one inode: the digest is remembered by inode, size and mtime.
	if err := s.known.Remember(src, d); err != nil {
		return err
	}
	size := s.m.pb.Files[i].Size
	sf := &s.files[i]
	sf.mu.Lock()
	defer sf.mu.Unlock()
	if err := sf.claim(span{0, size}); err != nil {
		return err
	}
	sf.done = size
	return nil
}

// claim records sp as received, refusing overlaps.
func (sf *sinkFile) claim(sp span) error {
	i, _ := slices.BinarySearchFunc(sf.have, sp.lo, func(h span, lo int64) int { return cmpInt(h.hi, lo+1) })
	// sf.have[i] is the first span ending after sp.lo (hi > lo).
	if i < len(sf.have) && sf.have[i].lo < sp.hi {
		return fmt.Errorf("bytes [%d, %d) arrived twice", max(sp.lo, sf.have[i].lo), min(sp.hi, sf.have[i].hi))
	}
	joinLeft := i > 0 && sf.have[i-1].hi == sp.lo
	joinRight := i < len(sf.have) && sf.have[i].lo == sp.hi
	switch {
	case joinLeft && joinRight:
		sf.have[i-1].hi = sf.have[i].hi
		sf.have = slices.Delete(sf.have, i, i+1)
	case joinLeft:
		sf.have[i-1].hi = sp.hi
	case joinRight:
		sf.have[i].lo = sp.lo
	default:
		sf.have = slices.Insert(sf.have, i, sp)
	}
	return nil
}

func cmpInt(a, b int64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// verify checks, after the last chunk, that every file is complete and has its BLAKE3 digest,
// and that the tree on disk hashes to the name (layout.TreeHash). Failed checks are DataLoss.
func (s *sink) verify(ctx context.Context) error {
	pb := s.m.pb
	for i := range s.files {
		sf := &s.files[i]
		sf.mu.Lock()
		done, writers := sf.done, sf.writers
		sf.mu.Unlock()
		if done != pb.Files[i].Size || writers != 0 {
			return errPrecondition("%s: %q incomplete: %d of %d bytes arrived", pb.DataName, pb.Files[i].Path, done, pb.Files[i].Size)
		}
	}
	// Hash what is on disk, not the manifest: directories and symlinks count too, and a file the
	// manifest does not list is an error.
	want := make(map[string]*peerpb.File, len(pb.Files))
	for _, f := range pb.Files {
		want[string(f.Path)] = f
	}
	var entries []layout.TreeEntry
	if s.m.kind != kindTree {
		entries = []layout.TreeEntry{{Type: layout.EntryFile, Size: pb.Files[0].Size}} // the file itself
	} else {
		var err error
		if entries, err = layout.ListTree(s.root); err != nil {
			return errCorrupt("%s: %v", pb.DataName, err)
		}
		for _, e := range entries {
			if f, ok := want[e.Path]; e.Type == layout.EntryFile && (!ok || f.Size != e.Size) {
				return errCorrupt("%s: unexpected file %q (%d bytes)", pb.DataName, e.Path, e.Size)
			}
		}
	}
	if err := layout.HashEntries(ctx, s.root, entries, s.known); err != nil {
		if ctx.Err() != nil {
			return err
		}
		return errCorrupt("%s: %v", pb.DataName, err)
	}
	for _, e := range entries {
		if f := want[e.Path]; e.Type == layout.EntryFile && e.Digest != layout.FileDigest(f.Blake3) {
			return errCorrupt("%s: %q hashes to %s, the header said %s", pb.DataName, e.Path, e.Digest, hex.EncodeToString(f.Blake3))
		}
	}
	switch s.m.kind {
	case kindMeta:
		content, err := os.ReadFile(s.root)
		if err != nil {
			return err
		}
		if !layout.IsDataName(string(content) + ".data") {
			return errInvalid("%s: content %q is not a data hash", pb.DataName, content)
		}
	case kindTree:
		got, err := layout.TreeHash(entries)
		if err != nil {
			return errCorrupt("%s: %v", pb.DataName, err)
		}
		if got != pb.TreeHash {
			return errCorrupt("%s: received tree hashes to %s", pb.DataName, got)
		}
	}
	return nil
}

// errFinished is the reason a sink is discarded after its data was taken over.
var errFinished = errors.New("transfer finished")

// droppedErr says why the sink was discarded, nil while it is not.
func (s *sink) droppedErr() error {
	if reason := s.dropped.Load(); reason != nil {
		return errAborted("transfer of %s was dropped: %v", s.m.pb.DataName, *reason)
	}
	return nil
}

// discard drops everything received, for reason: later writes fail, and the private directory
// goes. Only the first reason is kept.
func (s *sink) discard(reason error) error {
	s.dropped.CompareAndSwap(nil, &reason)
	s.dirMu.Lock()
	if s.dir != nil {
		s.dir.Close()
		s.dir = nil
	}
	s.dirMu.Unlock()
	for i := range s.files {
		sf := &s.files[i]
		sf.mu.Lock()
		if sf.f != nil {
			sf.f.Close()
			sf.f = nil
		}
		sf.mu.Unlock()
	}
	if err := os.RemoveAll(s.tmp); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove %s: %w", s.tmp, err)
	}
	return nil
}
