package layout

import (
	"context"
	"fmt"
	"io"
	"math/bits"
	"sync"

	"lukechampine.com/blake3/guts"
)

// arrivalSegment is the unit ArrivalHash hashes: a power of two and a multiple of simdGroup, so
// that each segment but a file's last is a complete subtree of BLAKE3's tree and is hashed by
// the library's vector code from end to end. Bytes of a segment that arrive split between two
// ranges are read back by Finish: with a push's 4 MiB chunks, at most one segment at each end
// of a stream's share of a file.
const arrivalSegment = 64 << 10

// ArrivalHash computes a file's BLAKE3 digest from its bytes while a receiver gets them, in
// ranges of any size and in any order, from the buffers they arrived in: the bytes are hashed
// while they are still in the CPU's caches instead of being read back from the spool. Add may
// run concurrently for disjoint ranges; the digest is the same as HashFile's.
//
// Its memory follows how the bytes arrived, not the size the sender declared: hashed segments
// are kept as aligned blocks of 2^k segments (each a subtree of BLAKE3's tree), and two sibling
// blocks are merged into their parent as soon as both are there, so a run of consecutive
// segments costs at most two chaining values per level, wherever it starts.
type ArrivalHash struct {
	size    int64
	nseg    int64
	mu      sync.Mutex
	blocks  map[arrivalBlock][8]uint32 // GUARDED_BY(mu); disjoint, none holding the last segment
	last    guts.Node                  // GUARDED_BY(mu); the last segment's node (it may be the root)
	hasLast bool                       // GUARDED_BY(mu)
}

// arrivalBlock is the segments [index<<level, (index+1)<<level).
type arrivalBlock struct {
	level uint8
	index int64
}

// NewArrivalHash starts the digest of a file of size bytes.
func NewArrivalHash(size int64) *ArrivalHash {
	return &ArrivalHash{size: size, nseg: arrivalSegments(size), blocks: map[arrivalBlock][8]uint32{}}
}

func arrivalSegments(size int64) int64 { return max(1, (size+arrivalSegment-1)/arrivalSegment) }

var (
	arrivalScratch = sync.Pool{New: func() any { return new([arrivalSegment]byte) }}
	groupScratch   = sync.Pool{New: func() any { return new([simdGroup]byte) }}
)

// Add hashes the segments of the file's bytes [off, off+len) that data, its pieces concatenated,
// holds whole. Bytes past the file's size are ignored.
func (h *ArrivalHash) Add(data [][]byte, off int64) {
	var total int64
	for _, p := range data {
		total += int64(len(p))
	}
	end := min(off+total, h.size)
	var scratch *[arrivalSegment]byte
	defer func() {
		if scratch != nil {
			arrivalScratch.Put(scratch)
		}
	}()
	for i := (off + arrivalSegment - 1) / arrivalSegment; ; i++ {
		lo := i * arrivalSegment
		hi := min(lo+arrivalSegment, h.size)
		if lo >= h.size || hi > end {
			return
		}
		seg, ok := contiguous(data, lo-off, hi-lo)
		if !ok {
			if scratch == nil {
				scratch = arrivalScratch.Get().(*[arrivalSegment]byte)
			}
			seg = gather(scratch[:hi-lo], data, lo-off)
		}
		h.put(i, hashBytes(seg, uint64(lo/guts.ChunkSize)))
	}
}

// put records segment i's node.
func (h *ArrivalHash) put(i int64, n guts.Node) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, ok := h.blockAt(i); ok {
		return
	}
	if i == h.nseg-1 {
		h.last, h.hasLast = n, true
		return
	}
	b, cv := arrivalBlock{0, i}, guts.ChainingValue(n)
	for {
		// The parent is a subtree of the file's tree only if it ends before the last segment,
		// which stays a node of its own (it may be the root).
		if parentEnd := (b.index>>1 + 1) << (b.level + 1); parentEnd > h.nseg-1 {
			break
		}
		sib := arrivalBlock{b.level, b.index ^ 1}
		scv, ok := h.blocks[sib]
		if !ok {
			break
		}
		delete(h.blocks, sib)
		if b.index&1 == 0 {
			cv = guts.ChainingValue(guts.ParentNode(cv, scv, &guts.IV, 0))
		} else {
			cv = guts.ChainingValue(guts.ParentNode(scv, cv, &guts.IV, 0))
		}
		b = arrivalBlock{b.level + 1, b.index >> 1}
	}
	h.blocks[b] = cv
}

// blockAt returns the block that holds segment i, if segment i was hashed (the last segment:
// level 0, with the zero value). REQUIRES h.mu
func (h *ArrivalHash) blockAt(i int64) (arrivalBlock, bool) {
	if i == h.nseg-1 {
		return arrivalBlock{0, i}, h.hasLast
	}
	for l := range uint8(bits.Len64(uint64(h.nseg))) { // no block is larger than the file
		b := arrivalBlock{l, i >> l}
		if _, ok := h.blocks[b]; ok {
			return b, true
		}
	}
	return arrivalBlock{}, false
}

// gaps calls f with each segment not hashed yet, in order. REQUIRES h.mu
func (h *ArrivalHash) gaps(f func(i int64)) {
	for i := int64(0); i < h.nseg; {
		if b, ok := h.blockAt(i); ok {
			i = (b.index + 1) << b.level
			continue
		}
		f(i)
		i++
	}
}

// missing returns how many bytes Finish would read back (for tests).
func (h *ArrivalHash) missing() int64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	var n int64
	h.gaps(func(i int64) { n += min(arrivalSegment, h.size-i*arrivalSegment) })
	return n
}

// Finish returns the file's digest, reading the segments that no Add held whole from r (the
// file as written). Call it once every byte was added or written.
func (h *ArrivalHash) Finish(ctx context.Context, r io.ReaderAt) (FileDigest, error) {
	h.mu.Lock()
	var missing []int64
	h.gaps(func(i int64) { missing = append(missing, i) })
	h.mu.Unlock()
	if len(missing) > 0 {
		buf := arrivalScratch.Get().(*[arrivalSegment]byte)
		defer arrivalScratch.Put(buf)
		for _, i := range missing {
			if err := ctx.Err(); err != nil {
				return FileDigest{}, context.Cause(ctx)
			}
			lo := i * arrivalSegment
			p := buf[:min(arrivalSegment, h.size-lo)]
			if err := readFull(r, p, lo); err != nil {
				return FileDigest{}, err
			}
			h.put(i, hashBytes(p, uint64(lo/guts.ChunkSize)))
		}
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	var t subtreeStack
	for i := int64(0); i < h.nseg-1; {
		b, ok := h.blockAt(i)
		if !ok {
			return FileDigest{}, fmt.Errorf("arrival hash: segment %d of %d missing", i, h.nseg)
		}
		t.push(h.blocks[b], int(b.level)) // heights in units of segments
		i = (b.index + 1) << b.level
	}
	if !h.hasLast {
		return FileDigest{}, fmt.Errorf("arrival hash: the last segment (%d) is missing", h.nseg-1)
	}
	return rootDigest(t.fold(h.last)), nil
}

// contiguous returns the n bytes at off of data's concatenation if one piece holds them.
func contiguous(data [][]byte, off, n int64) ([]byte, bool) {
	for _, p := range data {
		if off < int64(len(p)) {
			if off+n <= int64(len(p)) {
				return p[off : off+n], true
			}
			return nil, false
		}
		off -= int64(len(p))
	}
	return nil, n == 0
}

// gather copies len(dst) bytes at off of data's concatenation into dst.
func gather(dst []byte, data [][]byte, off int64) []byte {
	out := dst
	for _, p := range data {
		if len(dst) == 0 {
			break
		}
		if off >= int64(len(p)) {
			off -= int64(len(p))
			continue
		}
		k := copy(dst, p[off:])
		dst, off = dst[k:], 0
	}
	return out
}

// hashBytes returns the node of the BLAKE3 subtree of p, whose first chunk is chunk number base
// of the file; p is a power-of-two number of chunks, or the end of the file. Complete groups of
// simdGroup bytes go through the vector code, and the group holding the last chunk is the final
// node (it may be the root). Every group starts at a multiple of simdGroup, so each is a node of
// BLAKE3's tree. HashFile's segments and ArrivalHash's both come here.
func hashBytes(p []byte, base uint64) guts.Node {
	if len(p) <= guts.ChunkSize {
		return guts.CompressChunk(p, &guts.IV, base, 0)
	}
	lastGroup := (len(p) - 1) / simdGroup * simdGroup
	var t subtreeStack
	for pos := 0; pos < lastGroup; pos += simdGroup {
		n := guts.CompressBuffer((*[simdGroup]byte)(p[pos:pos+simdGroup]), simdGroup, &guts.IV, base+uint64(pos/guts.ChunkSize), 0)
		t.push(guts.ChainingValue(n), bits.TrailingZeros(guts.MaxSIMD))
	}
	tail := p[lastGroup:]
	counter := base + uint64(lastGroup/guts.ChunkSize)
	var last guts.Node
	switch {
	case len(tail) <= guts.ChunkSize:
		last = guts.CompressChunk(tail, &guts.IV, counter, 0)
	case cap(tail) >= simdGroup: // the vector code reads a whole group; it hashes len(tail)
		last = guts.CompressBuffer((*[simdGroup]byte)(tail[:simdGroup]), len(tail), &guts.IV, counter, 0)
	default: // rare (a buffer ending within a group): not a 16 KiB array in every call's frame
		g := groupScratch.Get().(*[simdGroup]byte)
		copy(g[:], tail)
		last = guts.CompressBuffer(g, len(tail), &guts.IV, counter, 0)
		groupScratch.Put(g)
	}
	return t.fold(last)
}
