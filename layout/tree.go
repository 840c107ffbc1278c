package layout

// The content hash that names a committed checkpoint (SPEC §1, §3).
//
// A single-file checkpoint is named by its FileDigest, which is the standard
// BLAKE3-256 of the file's bytes: `b3sum FILE` prints the same 64 hex digits.
// A directory checkpoint is named "D" + its TreeHash: BLAKE3-256 of a canonical
// listing of the tree (below) in which every regular file appears with its
// FileDigest. The two are computed differently, and the "D" keeps their names
// apart even if a file's bytes happened to equal a tree's listing.
//
// The work is split so that sealing is cheap: each file is hashed on its own,
// early (when it is closed after writing), and TreeHash at commit only sorts
// and hashes the small listing. A large file is cut into segments that are
// hashed concurrently; because each segment is an exact subtree of BLAKE3's own
// Merkle tree, the result is still the plain BLAKE3 of the whole file, whatever
// the segment size or the number of cores.
//
// Why BLAKE3 through lukechampine.com/blake3/guts: its subtree API lets the
// segments of one file be hashed on several cores and still give the plain
// BLAKE3 digest, and its SIMD kernels make hashing a file cost little more
// than reading it, the cheapest of the 256-bit hashes compared
// (BenchmarkHashFile and BenchmarkHashCandidates measure it against SHA-256
// and the library's own streaming hasher). Hashing
// each file when it is closed takes even that off the commit path. A faster
// 128-bit non-cryptographic hash (xxh3) was rejected: widening it to the 256
// bits a name promises would only be padding. Reads use 256 KiB buffers
// (hashBufSize), which stay in the core's L2 cache between the copy and the
// hash.
//
// What the hash covers: for every entry below the root, its path relative to
// the root (slash-separated), its type (regular file, directory, symlink), and
// for a file its size and bytes, for a symlink its target. Mode bits, owners
// and times are deliberately left out: a replica received from a peer, a tree
// restored from a backup or re-adopted after a restart gets fresh times and
// possibly different modes (umask, object stores keep none), and it must
// reproduce the same name to be recognised as the same checkpoint.
//
// The canonical listing, which other tools can recompute: the bytes
// "mtcfs tree v1\x00", then for each entry in bytewise order of Path:
//
//	'f' len(path) path size digest   regular file (digest: 32 bytes)
//	'd' len(path) path               directory
//	'l' len(path) path len(target) target   symlink
//	'p' len(path) path               FIFO
//	's' len(path) path               socket
//	'c' len(path) path rdev          character device
//	'b' len(path) path rdev          block device
//
// where len(...), size and rdev are uint64 little-endian. (The last four kinds were added
// after v1's first release; a tree without them hashes as it always did.) Every directory of the tree
// is listed, so an empty directory counts; the root itself is not.

import (
	"context"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"io"
	"math/bits"
	"os"
	"path"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"

	"golang.org/x/sync/errgroup"
	"golang.org/x/sys/unix"
	"lukechampine.com/blake3"
	"lukechampine.com/blake3/guts"
)

// FileDigest is the BLAKE3-256 of one regular file's bytes.
type FileDigest [32]byte

// String returns the digest as 64 lower-case hex digits. This is also the hash
// of a single-file checkpoint: its data name is DataName(d.String(), false).
func (d FileDigest) String() string { return hex.EncodeToString(d[:]) }

// EntryType is the kind of a TreeEntry.
type EntryType uint8

// The entry types a checkpoint tree may hold. FIFOs, sockets and device nodes carry no bytes: a
// checkpoint keeps them as what they are (their type, and a device's number), like tar does.
const (
	EntryFile     EntryType = 'f' // regular file: Size and Digest
	EntryDir      EntryType = 'd' // directory
	EntrySymlink  EntryType = 'l' // symbolic link: Target
	EntryFIFO     EntryType = 'p' // named pipe
	EntrySocket   EntryType = 's' // unix domain socket (the name only: no connection survives)
	EntryCharDev  EntryType = 'c' // character device: Rdev
	EntryBlockDev EntryType = 'b' // block device: Rdev
)

func (t EntryType) String() string {
	switch t {
	case EntryFile:
		return "file"
	case EntryDir:
		return "directory"
	case EntrySymlink:
		return "symlink"
	case EntryFIFO:
		return "fifo"
	case EntrySocket:
		return "socket"
	case EntryCharDev:
		return "character device"
	case EntryBlockDev:
		return "block device"
	}
	return fmt.Sprintf("EntryType(%d)", uint8(t))
}

// Special reports whether t is a FIFO, socket or device node: an entry without content.
func (t EntryType) Special() bool {
	return t == EntryFIFO || t == EntrySocket || t == EntryCharDev || t == EntryBlockDev
}

// TreeEntry describes one entry of a checkpoint tree for TreeHash. Fields that
// do not apply to the entry's type are ignored.
type TreeEntry struct {
	Path   string     // relative to the tree's root, slash-separated, e.g. "state/array_0"
	Type   EntryType  // EntryFile, EntryDir or EntrySymlink
	Size   int64      // EntryFile: length in bytes
	Digest FileDigest // EntryFile: HashFile of its bytes
	Target string     // EntrySymlink: the link's target, verbatim
	Rdev   uint64     // EntryCharDev, EntryBlockDev: the device number (as in stat's st_rdev)
}

// treeMagic starts the canonical listing; a new listing format gets a new one.
const treeMagic = "mtcfs tree v1\x00"

// TreeHash returns the hash of a directory tree, 64 lower-case hex digits
// (its data name is DataName(hash, true)). The order of entries does not
// matter. Directories that are parents of other entries may be omitted: they
// are implied. It fails on an invalid path (absolute, empty, ".", "..", or
// empty elements), a path given twice, an entry below a non-directory, an
// unknown type, a negative size or an empty symlink target.
func TreeHash(entries []TreeEntry) (string, error) {
	for _, e := range entries {
		if err := checkTreeEntry(e); err != nil {
			return "", err
		}
	}
	// The entries are put in order by their paths alone (a string header and an index: moving
	// an entry means moving a hundred bytes, with write barriers, and comparing through a
	// pointer to it misses the cache once more). Sorted, a path listed twice is next to
	// itself; only directories go into a set (a step has few of them and many files).
	type key struct {
		path string
		e    *TreeEntry
	}
	byPath := func(a, b key) int { return strings.Compare(a.path, b.path) }
	all := make([]key, len(entries))
	for i := range entries {
		all[i] = key{entries[i].Path, &entries[i]}
	}
	slices.SortFunc(all, byPath)
	dirs := map[string]bool{}
	for i, k := range all {
		if i > 0 && all[i-1].path == k.path {
			return "", fmt.Errorf("tree hash: %q is listed twice", k.path)
		}
		if k.e.Type == EntryDir {
			dirs[k.path] = true
		}
	}
	// Every parent must be a directory; add the ones that were left implicit.
	var implied []key
	for _, k := range all {
		for p := path.Dir(k.path); p != "." && !dirs[p]; p = path.Dir(p) {
			if j, found := slices.BinarySearchFunc(all, p, func(x key, p string) int { return strings.Compare(x.path, p) }); found {
				return "", fmt.Errorf("tree hash: %q is below %q, which is a %v", k.path, p, all[j].e.Type)
			}
			dirs[p] = true
			implied = append(implied, key{p, &TreeEntry{Path: p, Type: EntryDir}})
		}
	}
	if len(implied) > 0 {
		all = append(all, implied...)
		slices.SortFunc(all, byPath)
	}

	// The listing goes to the hasher in blocks of 64 KiB, where its vector code applies; an
	// entry at a time (under 100 bytes for a small file) went chunk by chunk in scalar code.
	// The digest does not depend on how the stream is cut.
	const block = 64 << 10
	h := blake3.New(32, nil)
	buf := make([]byte, 0, block+256)
	buf = append(buf, treeMagic...)
	for _, k := range all {
		e := k.e
		buf = append(buf, byte(e.Type))
		buf = binary.LittleEndian.AppendUint64(buf, uint64(len(e.Path)))
		buf = append(buf, e.Path...)
		switch e.Type {
		case EntryFile:
			buf = binary.LittleEndian.AppendUint64(buf, uint64(e.Size))
			buf = append(buf, e.Digest[:]...)
		case EntrySymlink:
			buf = binary.LittleEndian.AppendUint64(buf, uint64(len(e.Target)))
			buf = append(buf, e.Target...)
		case EntryCharDev, EntryBlockDev:
			buf = binary.LittleEndian.AppendUint64(buf, e.Rdev)
		}
		if len(buf) >= block {
			h.Write(buf)
			buf = buf[:0]
		}
	}
	h.Write(buf)
	return hex.EncodeToString(h.Sum(nil)), nil
}

// ValidPath reports whether p is a path inside a tree: relative, slash-separated, without empty,
// "." or ".." elements or a NUL byte. Unlike io/fs.ValidPath it takes any other bytes: a Linux
// name need not be UTF-8 (a Latin-1 "café" is 0x63 0x61 0x66 0xe9), and a checkpoint holding one
// is sealed, replicated and backed up like any other.
func ValidPath(p string) bool {
	if p == "" || strings.IndexByte(p, 0) >= 0 {
		return false
	}
	for {
		elem, rest, more := strings.Cut(p, "/")
		if elem == "" || elem == "." || elem == ".." {
			return false
		}
		if !more {
			return true
		}
		p = rest
	}
}

func checkTreeEntry(e TreeEntry) error {
	if !ValidPath(e.Path) {
		return fmt.Errorf("tree hash: invalid path %q: want a relative slash-separated path without empty, \".\" or \"..\" elements", e.Path)
	}
	switch e.Type {
	case EntryDir, EntryFIFO, EntrySocket, EntryCharDev, EntryBlockDev:
	case EntryFile:
		if e.Size < 0 {
			return fmt.Errorf("tree hash: %q has negative size %d", e.Path, e.Size)
		}
	case EntrySymlink:
		if e.Target == "" {
			return fmt.Errorf("tree hash: symlink %q has an empty target", e.Path)
		}
	default:
		return fmt.Errorf("tree hash: %q has unknown type %v", e.Path, e.Type)
	}
	return nil
}

// segmentSize is how much of a file one goroutine hashes. It must be a power
// of two and a multiple of guts.ChunkSize, so that each segment but the last
// is a complete subtree of BLAKE3's Merkle tree; the digest does not depend on
// it. Tests shrink it.
var segmentSize int64 = 64 << 20

// hashBufSize is the pread size: small enough to stay in L2 between the copy
// and the hash, a multiple of the SIMD group of chunks.
const hashBufSize = 256 << 10

// simdGroup is how many bytes guts hashes in one SIMD pass (16 chunks).
const simdGroup = guts.MaxSIMD * guts.ChunkSize

var hashBufs = sync.Pool{New: func() any { return new([hashBufSize]byte) }}

// hashSlots bounds the goroutines reading and hashing at any moment,
// process-wide, to GOMAXPROCS: background hashing of closed files, HashDir and
// the segments of large files share it. A slot is held only while one segment
// is hashed, never while waiting for another slot, so it cannot deadlock.
var hashSlots = make(chan struct{}, runtime.GOMAXPROCS(0))

// HashFile returns the BLAKE3-256 of the first size bytes of r, reading it
// with ReadAt (pread for an *os.File) in segments hashed concurrently. It
// fails if r has fewer than size bytes (the file shrank) or ctx is done; it
// does not notice bytes past size.
func HashFile(ctx context.Context, r io.ReaderAt, size int64) (FileDigest, error) {
	return hashFileFrom(ctx, r, size, nil)
}

// hashFileFrom is HashFile; first, when set, is the node of the file's first
// min(hashBufSize, segmentSize) bytes, already read and hashed (hashStatlessFd), size being
// larger than that: those bytes are not read again.
func hashFileFrom(ctx context.Context, r io.ReaderAt, size int64, first *guts.Node) (FileDigest, error) {
	seg := segmentSize
	if seg < guts.ChunkSize || seg&(seg-1) != 0 {
		return FileDigest{}, fmt.Errorf("hash file: segment size %d is not a power of two ≥ %d", seg, guts.ChunkSize)
	}
	if size < 0 {
		return FileDigest{}, fmt.Errorf("hash file: negative size %d", size)
	}
	if first != nil && size <= min(hashBufSize, seg) {
		return FileDigest{}, fmt.Errorf("hash file: %d bytes, no more than the first node's", size)
	}
	nseg := max(1, (size+seg-1)/seg)
	if nseg == 1 {
		root, err := hashSegmentFrom(ctx, r, 0, size, first)
		if err != nil {
			return FileDigest{}, err
		}
		return rootDigest(root), nil
	}

	// All segments but the last are complete subtrees: keep their chaining
	// values. The last one stays a node, because the root is built on it.
	cvs := make([][8]uint32, nseg-1)
	var last guts.Node
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(cap(hashSlots))
	for i := int64(0); i < nseg && gctx.Err() == nil; i++ {
		g.Go(func() error {
			off := i * seg
			var from *guts.Node
			if i == 0 {
				from = first
			}
			n, err := hashSegmentFrom(gctx, r, off, min(seg, size-off), from)
			if err != nil {
				return err
			}
			if i == nseg-1 {
				last = n
			} else {
				cvs[i] = guts.ChainingValue(n)
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return FileDigest{}, err
	}
	if err := context.Cause(ctx); err != nil {
		return FileDigest{}, err // cancelled before every segment started
	}
	var t subtreeStack
	for _, cv := range cvs {
		t.push(cv, 0) // heights in units of segments: all equal
	}
	return rootDigest(t.fold(last)), nil
}

// hashSegment hashes length bytes of r at off as the BLAKE3 subtree whose
// first chunk is chunk number off/ChunkSize of the file, and returns the
// subtree's root node, not yet finalised (the caller decides whether it is the
// root of the whole file). off is a multiple of the segment size. It reads
// hashBufSize bytes at a time; each buffer but the last is a complete subtree
// (hashBytes).
func hashSegment(ctx context.Context, r io.ReaderAt, off, length int64) (guts.Node, error) {
	return hashSegmentFrom(ctx, r, off, length, nil)
}

// hashSegmentFrom is hashSegment; first, when set (off is 0), is the node of the segment's first
// min(hashBufSize, segmentSize) bytes, which are not read again: the whole segment's node when
// a segment is no longer, else a complete subtree to start from.
func hashSegmentFrom(ctx context.Context, r io.ReaderAt, off, length int64, first *guts.Node) (guts.Node, error) {
	if first != nil && length <= hashBufSize {
		return *first, nil
	}
	select {
	case hashSlots <- struct{}{}:
	case <-ctx.Done():
		return guts.Node{}, context.Cause(ctx)
	}
	defer func() { <-hashSlots }()
	bufp := hashBufs.Get().(*[hashBufSize]byte)
	defer hashBufs.Put(bufp)

	base := uint64(off / guts.ChunkSize)
	var t subtreeStack
	pos := int64(0)
	if first != nil {
		t.push(guts.ChainingValue(*first), bits.TrailingZeros(hashBufSize/guts.ChunkSize))
		pos = hashBufSize
	}
	for {
		if err := ctx.Err(); err != nil {
			return guts.Node{}, context.Cause(ctx)
		}
		p := bufp[:min(hashBufSize, length-pos)]
		if err := readFull(r, p, off+pos); err != nil {
			return guts.Node{}, err
		}
		n := hashBytes(p, base+uint64(pos/guts.ChunkSize))
		if pos += int64(len(p)); pos >= length {
			return t.fold(n), nil // the last buffer (empty only for an empty file)
		}
		t.push(guts.ChainingValue(n), bits.TrailingZeros(hashBufSize/guts.ChunkSize))
	}
}

// readFull reads len(p) bytes of r at off: fewer (the file shrank) is an error.
func readFull(r io.ReaderAt, p []byte, off int64) error {
	if n, err := r.ReadAt(p, off); n < len(p) {
		if err == nil || err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return fmt.Errorf("hash file: read %d bytes at %d: %w", len(p), off, err)
	}
	return nil
}

// subtreeStack merges BLAKE3 subtrees pushed left to right, as the reference
// implementation does: at most one pending subtree per height.
type subtreeStack struct {
	cvs   [64][8]uint32
	count uint64 // sum of 1<<height pushed; bit i set = cvs[i] pending
}

func (t *subtreeStack) push(cv [8]uint32, height int) {
	i := height
	for ; t.count&(1<<i) != 0; i++ {
		cv = guts.ChainingValue(guts.ParentNode(t.cvs[i], cv, &guts.IV, 0))
	}
	t.cvs[i] = cv
	t.count += 1 << height
}

// fold returns the root node of everything pushed followed by last.
func (t *subtreeStack) fold(last guts.Node) guts.Node {
	for i := range bits.Len64(t.count) {
		if t.count&(1<<i) != 0 {
			last = guts.ParentNode(t.cvs[i], guts.ChainingValue(last), &guts.IV, 0)
		}
	}
	return last
}

func rootDigest(n guts.Node) (d FileDigest) {
	n.Flags |= guts.FlagRoot
	out := guts.WordsToBytes(guts.CompressNode(n))
	copy(d[:], out[:])
	return d
}

// HashDir returns the TreeHash of the directory dir (followed if it is a
// symlink), reading its files concurrently. It fails if the tree changes while
// it is read in a way it notices.
func HashDir(ctx context.Context, dir string) (string, error) { return hashDirCached(ctx, dir, nil) }

func hashDirCached(ctx context.Context, dir string, cache *DigestCache) (string, error) {
	d, err := OpenDir(dir)
	if err != nil {
		return "", fmt.Errorf("hash dir: %w", err)
	}
	defer d.Close()
	entries, keys, err := d.listKeyed()
	if err != nil {
		return "", fmt.Errorf("hash dir: %w", err)
	}
	return d.treeHash(ctx, entries, keys, cache, false)
}

// treeHash hashes the files of entries, a listing of d (keys, cache and statless as for
// hashEntries), and returns the tree's hash.
func (d *Dir) treeHash(ctx context.Context, entries []TreeEntry, keys []digestKey, cache *DigestCache, statless bool) (string, error) {
	if err := d.hashEntries(ctx, entries, keys, cache, statless); err != nil {
		return "", fmt.Errorf("hash dir %s: %w", d.path, err)
	}
	return TreeHash(entries)
}

// HashEntries fills in the Digest of every file entry, the files living below root (an entry
// with an empty Path is root itself, a regular file), several files at a time: many small
// files are the common case (one per array shard), and each still draws from hashSlots. A file
// whose size is not its entry's fails; an entry of size -1 (an unsized listing's) gets the
// file's. cache may be nil.
func HashEntries(ctx context.Context, root string, entries []TreeEntry, cache *DigestCache) error {
	if len(entries) == 1 && entries[0].Path == "" {
		size, d, err := hashFile(ctx, root, cache, func() (int, error) { return openRaw(root) })
		if err == nil && size != entries[0].Size {
			err = fmt.Errorf("%s: %d bytes, want %d (changed while hashing?)", root, size, entries[0].Size)
		}
		entries[0].Digest = d
		return err
	}
	d, err := OpenDir(root)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.HashEntries(ctx, entries, cache)
}

// pacerKey is the context key of WithPacer's func.
type pacerKey struct{}

// WithPacer returns ctx carrying pace, which a hash of a tree's files (HashDataCached,
// HashEntries) calls before each batch of files it opens, from its workers: a caller may wait
// there, to let other work go first.
func WithPacer(ctx context.Context, pace func()) context.Context {
	return context.WithValue(ctx, pacerKey{}, pace)
}

// HashEntries is the package function HashEntries for a tree that is already open.
func (d *Dir) HashEntries(ctx context.Context, entries []TreeEntry, cache *DigestCache) error {
	return d.hashEntries(ctx, entries, nil, cache, false)
}

// hashEntries is HashEntries; keys, when set, holds each entry's digest key as its listing saw
// it (listKeyed): a file whose digest the cache holds for that key is not even opened. This is
// what makes sealing a step of many small files, hashed as the job closed them, cost one stat
// per file (the listing's) instead of an open, a stat and a close more. With statless (and no
// cache), an unsized entry is hashed by hashStatlessFd: its digest may be wrong in the one way
// hashStatlessFd says, so a caller passing it checks a mismatch again without (VerifyListed).
func (d *Dir) hashEntries(ctx context.Context, entries []TreeEntry, keys []digestKey, cache *DigestCache, statless bool) error {
	if keys != nil && cache != nil {
		cache.mu.Lock()
		for i := range entries {
			if entries[i].Type == EntryFile && keys[i] != (digestKey{}) {
				if dg, ok := cache.m[keys[i]]; ok {
					entries[i].Digest, entries[i].Size = dg, int64(keys[i].size)
					keys[i] = digestKey{} // done
					continue
				}
			}
			keys[i] = digestKey{dev: ^uint64(0)} // to hash
		}
		cache.mu.Unlock()
	}
	var todo []int
	for i := range entries {
		if entries[i].Type == EntryFile && (keys == nil || cache == nil || keys[i] != (digestKey{})) {
			todo = append(todo, i)
		}
	}
	// A few workers take the files in turn; a goroutine per file cost more than the hashing of
	// a small file: each grew its stack for the vector code (runtime.copystack was a fifth of
	// the CPU of a restart adopting 100,000 files of 4 KiB). With many files, each worker opens
	// and closes them through an io_uring of its own, a batch per system call (uring.go).
	hashOne := func(ctx context.Context, e *TreeEntry, fd int) error {
		var size int64
		var dg FileDigest
		var err error
		if statless && cache == nil && e.Size < 0 {
			size, dg, err = hashStatlessFd(ctx, e.Path, fd)
		} else {
			size, dg, err = hashOpen(ctx, e.Path, cache, fd)
		}
		if err != nil {
			return err
		}
		if e.Size >= 0 && size != e.Size {
			return fmt.Errorf("%s: %d bytes, want %d (changed while hashing?)", e.Path, size, e.Size)
		}
		e.Digest, e.Size = dg, size // an unsized listing's (Dir.ListUnsized) size too
		return nil
	}
	g, gctx := errgroup.WithContext(ctx)
	var next atomic.Int64
	pace, _ := ctx.Value(pacerKey{}).(func())
	workers := min(cap(hashSlots), len(todo))
	batched := len(todo) >= ringFrom && ringFDsFit(workers)
	for range workers {
		g.Go(func() error {
			// Without a ring (few files, or none to be had) a worker takes one file at a time:
			// a batch would give one worker all of a few large files.
			b, step := plainOpener(d), int64(1)
			if batched {
				if rb := newBatchOpener(d); rb != nil {
					b, step = rb, ringBatch
				}
			}
			defer b.free()
			for {
				j := next.Add(step) - step
				if j >= int64(len(todo)) || gctx.Err() != nil {
					return nil
				}
				batch := todo[j:min(j+step, int64(len(todo)))]
				if pace != nil {
					pace()
				}
				fds := b.open(len(batch), func(k int) string { return entries[batch[k]].Path })
				var err error
				for k, i := range batch {
					fd := fds[k]
					if err == nil { // after an error the batch's descriptors are only closed
						if fd < 0 { // not opened by a ring: the plain call opens it, or says why not
							fd, err = d.openRaw(entries[i].Path)
						}
						if err == nil {
							err = hashOne(gctx, &entries[i], fd)
						}
					}
					if fd >= 0 {
						b.close(fd)
					}
				}
				if err != nil {
					return err
				}
			}
		})
	}
	if err := g.Wait(); err != nil {
		return err
	}
	return context.Cause(ctx) // cancelled before every file was hashed
}

// ListTreeUnsized is ListTree without regular files' sizes (Dir.ListUnsized).
func ListTreeUnsized(dir string) ([]TreeEntry, error) {
	d, err := OpenDir(dir)
	if err != nil {
		return nil, err
	}
	defer d.Close()
	return d.ListUnsized()
}

// ListTree lists the entries below dir with sizes, symlink targets and device numbers but no
// digests, read the way HashDir reads them, so that a sender and HashDir always agree on what a
// tree holds.
func ListTree(dir string) ([]TreeEntry, error) {
	d, err := OpenDir(dir)
	if err != nil {
		return nil, err
	}
	defer d.Close()
	return d.List()
}

// hashPath hashes the regular file at name, returning its size and digest. With a cache, a
// digest computed earlier for the same file (same inode, size and mtime) is reused.
func hashPath(ctx context.Context, name string, cache *DigestCache) (int64, FileDigest, error) {
	return hashFile(ctx, name, cache, func() (int, error) { return openRaw(name) })
}

// openRaw opens the file at name for hashFile. O_NONBLOCK: a FIFO put where a file was listed
// fails to hash (not a regular file) instead of blocking the open.
func openRaw(name string) (int, error) {
	for {
		fd, err := unix.Open(name, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return -1, &os.PathError{Op: "open", Path: name, Err: err}
		}
		return fd, nil
	}
}

// hashFile hashes the regular file open returns (name is for messages), as hashPath. It works on
// the bare descriptor, not an *os.File: a restart verifies every file of every step this way,
// and for files of a few KiB os.NewFile, its Stat and its Close cost as much CPU as the hashing
// (issue 12's restart handshake over 100,000 files).
func hashFile(ctx context.Context, name string, cache *DigestCache, open func() (int, error)) (int64, FileDigest, error) {
	fd, err := open()
	if err != nil {
		return 0, FileDigest{}, err
	}
	defer unix.Close(fd)
	return hashOpen(ctx, name, cache, fd)
}

// hashOpen is hashFile of the descriptor fd, which stays the caller's.
func hashOpen(ctx context.Context, name string, cache *DigestCache, fd int) (int64, FileDigest, error) {
	return hashOpenFrom(ctx, name, cache, fd, 0, nil)
}

// hashOpenFrom is hashOpen of a file whose first n bytes hashStatlessFd has read and hashed to
// first (nil: none): they are not read again, unless the file has shrunk since.
func hashOpenFrom(ctx context.Context, name string, cache *DigestCache, fd int, n int64, first *guts.Node) (int64, FileDigest, error) {
	var st unix.Stat_t
	if err := fstatRetry(fd, &st); err != nil {
		return 0, FileDigest{}, &os.PathError{Op: "stat", Path: name, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return 0, FileDigest{}, fmt.Errorf("%s is a %v, not a regular file", name, typeOfMode(st.Mode))
	}
	key := digestKey{dev: st.Dev, ino: st.Ino, size: uint64(st.Size), mtime: st.Mtim.Nano()}
	if d, ok := cache.get(key); ok {
		return st.Size, d, nil
	}
	var d FileDigest
	var err error
	switch {
	case first != nil && st.Size == n:
		d = rootDigest(*first)
	case first != nil && st.Size < n: // shrank since the read: hash what it holds now
		d, err = HashFile(ctx, fdReader(fd), st.Size)
	default:
		d, err = hashFileFrom(ctx, fdReader(fd), st.Size, first)
	}
	if err != nil {
		return 0, FileDigest{}, fmt.Errorf("%s: %w", name, err)
	}
	cache.put(key, d)
	return st.Size, d, nil
}

// hashStatlessFd is hashOpen without the stat for a file smaller than one read buffer, the
// common case of a step of many files (a restart verifies 100,000 such files; the stat was a
// tenth of its CPU): one pread that returns less than it asked for gives the file's bytes and
// size together, since a read of a regular file stops short only at its end. A file that fills
// the buffer is stat'd and hashed on from that buffer (hashOpenFrom); one whose read fails (a
// directory or a FIFO where a file was listed) is hashed by hashOpen on the same descriptor,
// which stats it. fd stays the caller's.
//
// What it gives up is a proof of type and of end for a file that reads as non-empty: a read cut
// short by something else (a file system that returns short reads, a device put where a file
// was listed) hashes a prefix. A tree's hash covers each file's size and digest, so that passes
// only if the prefix is byte for byte the file the tree recorded, with its size; otherwise the
// tree does not match, and the caller hashes it again with hashFile before it reports a
// mismatch (VerifyListed). A read of nothing is stat'd (an empty file is rare, and /dev/null
// reads as one).
func hashStatlessFd(ctx context.Context, name string, fd int) (int64, FileDigest, error) {
	select {
	case hashSlots <- struct{}{}:
	case <-ctx.Done():
		return 0, FileDigest{}, context.Cause(ctx)
	}
	bufp := hashBufs.Get().(*[hashBufSize]byte)
	buf := bufp[:min(hashBufSize, segmentSize)] // one segment: the digest is hashBytes' node
	n, err := statlessRead(fd, buf)
	short := err == nil && n > 0 && n < len(buf)
	full := err == nil && n == len(buf)
	var d FileDigest
	var first guts.Node
	switch {
	case short:
		d = rootDigest(hashBytes(buf[:n], 0))
	case full:
		first = hashBytes(buf, 0)
	}
	hashBufs.Put(bufp)
	<-hashSlots
	if short {
		return int64(n), d, nil
	}
	if full {
		return hashOpenFrom(ctx, name, nil, fd, int64(n), &first)
	}
	return hashOpen(ctx, name, nil, fd)
}

// statlessRead is hashStatlessFd's read; a test makes it stop short.
var statlessRead = preadOnce

// pread is unix.Pread; a test counts the bytes read.
var pread = unix.Pread

// preadOnce is one pread(2) of p at offset 0, retried only when interrupted before it read.
func preadOnce(fd int, p []byte) (int, error) {
	for {
		n, err := pread(fd, p, 0)
		if err != unix.EINTR {
			return n, err
		}
	}
}

func fstatRetry(fd int, st *unix.Stat_t) error {
	for {
		if err := unix.Fstat(fd, st); err != unix.EINTR {
			return err
		}
	}
}

// fdReader reads a descriptor with pread(2), as *os.File's ReadAt does, without the runtime
// poller's bookkeeping (hashFile's files are regular files: pread never waits for the poller).
type fdReader int

func (r fdReader) ReadAt(p []byte, off int64) (int, error) {
	n := 0
	for n < len(p) {
		m, err := pread(int(r), p[n:], off+int64(n))
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return n, err
		}
		if m == 0 {
			return n, io.EOF
		}
		n += m
	}
	return n, nil
}

// DigestCache remembers file digests by file identity and version (device, inode, size,
// mtime), so a file hashed in the background when the job closed it is not read again when its
// step is sealed. A file written after it was hashed has a new mtime and misses. The zero
// value is ready; a nil *DigestCache caches nothing.
type DigestCache struct {
	mu sync.Mutex
	m  map[digestKey]FileDigest
}

type digestKey struct {
	dev, ino, size uint64
	mtime          int64
}

// maxCachedDigests bounds the cache; past it, it starts over (a cache miss only costs a read).
// It holds the files of a step of a few hundred thousand small files (issue 12: at 1<<16, a
// step of 100,000 files hashed at close was hashed again at its seal), at under 100 bytes each.
const maxCachedDigests = 1 << 18

func digestKeyOf(info os.FileInfo) (digestKey, bool) {
	st, ok := info.Sys().(*syscall.Stat_t)
	if !ok {
		return digestKey{}, false
	}
	return digestKey{dev: uint64(st.Dev), ino: st.Ino, size: uint64(st.Size), mtime: st.Mtim.Nano()}, true
}

func (c *DigestCache) get(k digestKey) (FileDigest, bool) {
	if c == nil {
		return FileDigest{}, false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	d, ok := c.m[k]
	return d, ok
}

// Len returns how many digests the cache holds.
func (c *DigestCache) Len() int {
	if c == nil {
		return 0
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.m)
}

func (c *DigestCache) put(k digestKey, d FileDigest) {
	if c == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil || len(c.m) >= maxCachedDigests {
		c.m = map[digestKey]FileDigest{}
	}
	c.m[k] = d
}

// HashFileCached hashes the regular file at p into the cache (used to hash files early) and
// returns its digest.
func (c *DigestCache) HashFileCached(ctx context.Context, p string) (FileDigest, error) {
	_, d, err := hashPath(ctx, p, c)
	return d, err
}

// HashData hashes a checkpoint at p, a directory or a regular file (followed
// if p is a symlink, like a .restore marker): it returns the hash and whether
// it is a directory, so that DataName(hash, dir) is the checkpoint's name.
func HashData(ctx context.Context, p string) (hash string, dir bool, err error) {
	return HashDataCached(ctx, p, nil)
}

// HashDataCached is HashData reusing (and filling) the digests of cache.
func HashDataCached(ctx context.Context, p string, cache *DigestCache) (hash string, dir bool, err error) {
	info, err := os.Stat(p)
	if err != nil {
		return "", false, fmt.Errorf("hash data: %w", err)
	}
	if info.IsDir() {
		hash, err := hashDirCached(ctx, p, cache)
		return hash, true, err
	}
	_, d, err := hashPath(ctx, p, cache)
	if err != nil {
		return "", false, fmt.Errorf("hash data: %w", err)
	}
	return d.String(), false, nil
}

// HashMismatchError reports checkpoint content that does not match its
// expected hash. Want and Got are written as in data names: "D" + hex for a
// directory, hex for a file.
type HashMismatchError struct {
	Path      string
	Want, Got string
}

func (e *HashMismatchError) Error() string {
	return fmt.Sprintf("verify %s: content hashes to %s, want %s", e.Path, e.Got, e.Want)
}

// VerifyData checks that the checkpoint at p (see HashData) is a directory
// when dir is set, a regular file otherwise, and has the given hash. A
// mismatch is a *HashMismatchError; other errors say why p could not be read.
// It is what a receiver, a restore, restart adoption and `backups verify` use
// before data may serve a restore.
func VerifyData(ctx context.Context, p, hash string, dir bool) error {
	return VerifyListed(ctx, p, nil, hash, dir)
}

// VerifyListed is VerifyData given listing, ListTree's listing of p when p is a directory
// (the one a caller builds something from): the files it names are hashed, their digests
// filled in, without listing p again. With a nil listing, or dir false, it is VerifyData.
//
// A listing without sizes (ListTreeUnsized, all its files of size -1) gets them filled in, and
// its small files are hashed without a stat (hashStatlessFd); a tree that does not match that
// way is hashed again with a stat of every file before its mismatch is reported, so a short read
// that was not a file's end costs time, never a wrongly refused tree.
func VerifyListed(ctx context.Context, p string, listing []TreeEntry, hash string, dir bool) error {
	statless := dir && unsized(listing)
	got, gotDir, err := hashListed(ctx, p, listing, dir, statless)
	if err == nil && statless && got != hash {
		for i := range listing {
			if listing[i].Type == EntryFile {
				listing[i].Size, listing[i].Digest = -1, FileDigest{}
			}
		}
		got, gotDir, err = hashListed(ctx, p, listing, dir, false)
	}
	if err != nil {
		return err
	}
	if got != hash || gotDir != dir {
		return &HashMismatchError{Path: p, Want: strings.TrimSuffix(DataName(hash, dir), ".data"),
			Got: strings.TrimSuffix(DataName(got, gotDir), ".data")}
	}
	return nil
}

// unsized reports whether listing names files and none with its size (ListTreeUnsized's).
func unsized(listing []TreeEntry) bool {
	files := 0
	for i := range listing {
		if listing[i].Type == EntryFile {
			if listing[i].Size >= 0 {
				return false
			}
			files++
		}
	}
	return files > 0
}

// hashListed is HashData of p, hashing the files listing names when p is a directory so
// listed (statless as for hashEntries).
func hashListed(ctx context.Context, p string, listing []TreeEntry, dir, statless bool) (string, bool, error) {
	if listing == nil || !dir {
		return HashData(ctx, p)
	}
	d, err := OpenDir(p)
	if err != nil {
		return "", false, fmt.Errorf("hash dir: %w", err)
	}
	defer d.Close()
	got, err := d.treeHash(ctx, listing, nil, nil, statless)
	return got, true, err
}

// Remember records that the regular file at p, as it is now, has digest d: the caller knows it
// (it verified the file) and promises that the file is not written again.
func (c *DigestCache) Remember(p string, d FileDigest) error {
	info, err := os.Lstat(p)
	if err != nil {
		return err
	}
	return c.remember(p, info, d)
}

// RememberFile is Remember for a file that is open: its identity and version as they are now.
func (c *DigestCache) RememberFile(f *os.File, d FileDigest) error {
	info, err := f.Stat()
	if err != nil {
		return err
	}
	return c.remember(f.Name(), info, d)
}

func (c *DigestCache) remember(p string, info os.FileInfo, d FileDigest) error {
	if !info.Mode().IsRegular() {
		return fmt.Errorf("%s is a %v, not a regular file", p, info.Mode().Type())
	}
	if key, ok := digestKeyOf(info); ok {
		c.put(key, d)
	}
	return nil
}

// Lookup returns the digest cached for the regular file at p as it is now (same inode, size and
// mtime), and its size.
func (c *DigestCache) Lookup(p string) (FileDigest, int64, bool) {
	info, err := os.Lstat(p)
	if err != nil || !info.Mode().IsRegular() {
		return FileDigest{}, 0, false
	}
	key, ok := digestKeyOf(info)
	if !ok {
		return FileDigest{}, 0, false
	}
	d, ok := c.get(key)
	return d, info.Size(), ok
}
