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
// Its memory follows what arrived, not the size the sender declared: segments hashed in order
// from the start are folded at once (a stack of at most 64 chaining values); only those that
// arrived ahead of a gap are kept, 32 bytes (plus a map entry) per 64 KiB.
type ArrivalHash struct {
	size    int64
	nseg    int64
	mu      sync.Mutex
	prefix  subtreeStack        // GUARDED_BY(mu); segments [0, next) folded
	next    int64               // GUARDED_BY(mu); the first segment not folded yet
	ahead   map[int64][8]uint32 // GUARDED_BY(mu); chaining values of segments past next (but the last)
	last    guts.Node           // GUARDED_BY(mu); the last segment's node (it may be the root)
	hasLast bool                // GUARDED_BY(mu)
}

// NewArrivalHash starts the digest of a file of size bytes.
func NewArrivalHash(size int64) *ArrivalHash {
	return &ArrivalHash{size: size, nseg: arrivalSegments(size)}
}

func arrivalSegments(size int64) int64 { return max(1, (size+arrivalSegment-1)/arrivalSegment) }

var arrivalScratch = sync.Pool{New: func() any { return new([arrivalSegment]byte) }}

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
	switch {
	case h.has(i):
	case i == h.nseg-1:
		h.last, h.hasLast = n, true
	case i == h.next:
		h.prefix.push(guts.ChainingValue(n), 0) // heights in units of segments: all equal
		for h.next++; h.next < h.nseg-1; h.next++ {
			cv, ok := h.ahead[h.next]
			if !ok {
				break
			}
			delete(h.ahead, h.next)
			h.prefix.push(cv, 0)
		}
	default:
		if h.ahead == nil {
			h.ahead = map[int64][8]uint32{}
		}
		h.ahead[i] = guts.ChainingValue(n)
	}
}

// has reports whether segment i was hashed. REQUIRES h.mu
func (h *ArrivalHash) has(i int64) bool {
	if i == h.nseg-1 {
		return h.hasLast
	}
	_, ahead := h.ahead[i]
	return i < h.next || ahead
}

// Missing returns how many bytes Finish would read back.
func (h *ArrivalHash) Missing() int64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	var n int64
	for i := h.next; i < h.nseg; i++ {
		if !h.has(i) {
			n += min(arrivalSegment, h.size-i*arrivalSegment)
		}
	}
	return n
}

// Finish returns the file's digest, reading the segments that no Add held whole from r (the
// file as written). Call it once every byte was added or written.
func (h *ArrivalHash) Finish(ctx context.Context, r io.ReaderAt) (FileDigest, error) {
	var buf *[arrivalSegment]byte
	h.mu.Lock()
	from := h.next
	h.mu.Unlock()
	for i := from; i < h.nseg; i++ {
		h.mu.Lock()
		has := h.has(i)
		h.mu.Unlock()
		if has {
			continue
		}
		if err := ctx.Err(); err != nil {
			return FileDigest{}, context.Cause(ctx)
		}
		if buf == nil {
			buf = arrivalScratch.Get().(*[arrivalSegment]byte)
			defer arrivalScratch.Put(buf)
		}
		lo := i * arrivalSegment
		p := buf[:min(arrivalSegment, h.size-lo)]
		if err := readFull(r, p, lo); err != nil {
			return FileDigest{}, err
		}
		h.put(i, hashBytes(p, uint64(lo/guts.ChunkSize)))
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.next != h.nseg-1 || !h.hasLast {
		return FileDigest{}, fmt.Errorf("arrival hash: segments %d to %d missing", h.next, h.nseg-1)
	}
	t := h.prefix // Finish may be called again: fold a copy
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

// hashBytes returns the node of the BLAKE3 subtree of p, a whole segment whose first chunk is
// chunk number base of the file: complete groups of simdGroup bytes through the vector code, the
// group holding the last chunk as the final node (it may be the root). Every group starts at a
// multiple of simdGroup, so each is a node of BLAKE3's tree.
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
	case len(tail) == simdGroup:
		last = guts.CompressBuffer((*[simdGroup]byte)(tail), simdGroup, &guts.IV, counter, 0)
	default:
		var g [simdGroup]byte // the vector code reads a whole group
		copy(g[:], tail)
		last = guts.CompressBuffer(&g, len(tail), &guts.IV, counter, 0)
	}
	return t.fold(last)
}
