package planecodec

import (
	"encoding/binary"
	"fmt"
	"slices"

	"github.com/klauspost/compress/huff0"
)

// Block lengths of coded planes, as log2: each block has its own huff0 table, so smaller blocks
// follow the statistics of neighbouring tensors more closely, but each costs a table, a table
// build and a table read. bench/RESULTS.md (codecbench) has the measurements behind the default
// of 32 KiB.
const (
	MinBlockLog     = 12
	MaxBlockLog     = 17 // huff0 takes blocks up to 256 KiB − 1
	DefaultBlockLog = 15
)

// MaxEncodedLen is the most an encoded chunk of n bytes takes: a raw chunk's.
func MaxEncodedLen(n int) int { return headerLen + n }

// Encoder compresses chunks; the zero value is ready to use. It keeps its scratch from chunk to
// chunk, so that encoding allocates nothing once it has seen a chunk of the largest size; it is
// not safe for concurrent use (one per goroutine).
type Encoder struct {
	// BlockLog is the log2 of the block length of coded planes, MinBlockLog to MaxBlockLog;
	// 0 means DefaultBlockLog. Decoders read it from each chunk's header.
	BlockLog int
	// Width, if not 0, is the element width (1, 2 or 4) instead of the one the sample picks:
	// for callers that know the data type, and for measurements. The sample still decides
	// which planes to code and whether to code the chunk at all.
	Width int

	huff   huff0.Scratch
	planes []byte // the chunk split into planes, plane k at [k·n, (k+1)·n)
}

// Encode appends the encoded form of src to dst and returns the extended slice: planes where
// the sample says coding pays, else the bytes as they are behind a header (never more than
// MaxEncodedLen(len(src)) bytes). With cap(dst)-len(dst) ≥ MaxEncodedLen(len(src)) it does not
// allocate. Chunks longer than MaxLen are refused.
func (e *Encoder) Encode(dst, src []byte) ([]byte, error) {
	if len(src) > MaxLen {
		return dst, fmt.Errorf("planecodec: chunk of %d bytes above the limit of %d", len(src), MaxLen)
	}
	if e.BlockLog != 0 && (e.BlockLog < MinBlockLog || e.BlockLog > MaxBlockLog) {
		return dst, fmt.Errorf("planecodec: block log %d outside %d–%d", e.BlockLog, MinBlockLog, MaxBlockLog)
	}
	if e.Width != 0 && e.Width != 1 && e.Width != 2 && e.Width != 4 {
		return dst, fmt.Errorf("planecodec: width %d, want 1, 2 or 4", e.Width)
	}
	start := len(dst)
	dst = slices.Grow(dst, MaxEncodedLen(len(src)))
	e.huff.Reuse = huff0.ReusePolicyNone // every block carries its own table
	e.huff.WantLogLess = 5               // a block must save 1/32 of itself, or it is stored raw
	if p := planChunk(src, e.Width); p.width != 0 {
		if out, ok := e.appendPlanes(dst, src, p); ok {
			return out, nil
		}
	}
	return appendRaw(dst[:start], src), nil
}

func appendRaw(dst, src []byte) []byte {
	start := len(dst)
	dst = append(dst, make([]byte, headerLen)...)
	dst = append(dst, src...)
	chunk := dst[start:]
	h := Header{Method: Raw, Width: 1, Len: len(src), Stored: len(chunk)}
	putHeader(chunk, h)
	binary.LittleEndian.PutUint32(chunk[16:], chunkCRC(chunk))
	return dst
}

// appendPlanes appends the Planes form of src, unless it would take as many bytes as the raw
// form: then it reports false. dst has room for the raw form, so it never reallocates.
func (e *Encoder) appendPlanes(dst, src []byte, p plan) ([]byte, bool) {
	w := p.width
	n := len(src) / w
	tail := len(src) % w
	start := len(dst)
	limit := start + MaxEncodedLen(len(src)) // the raw form's end: the planes must end before it

	dst = dst[:start+headerLen+w*planeEntryLen]
	dst = append(dst, src[len(src)-tail:]...)

	if cap(e.planes) < w*n {
		e.planes = make([]byte, w*n)
	}
	var planes [4][]byte
	for k := range w {
		planes[k] = e.planes[k*n : (k+1)*n]
	}
	splitPlanes(planes[:w], src, w)

	blockLog := e.BlockLog
	if blockLog == 0 {
		blockLog = DefaultBlockLog
	}
	blockLen := 1 << blockLog
	for k := range w {
		entry := dst[start+headerLen+k*planeEntryLen:]
		planeStart := len(dst)
		if !p.code[k] {
			if len(dst)+n >= limit {
				return nil, false
			}
			entry[0] = planeRaw
			dst = append(dst, planes[k]...)
		} else {
			entry[0] = planeCoded
			for off := 0; off < n; off += blockLen {
				kind, data := e.encodeBlock(planes[k][off:min(off+blockLen, n)])
				if len(dst)+blockHeaderLen+len(data) >= limit {
					return nil, false
				}
				dst = append(dst, kind, byte(len(data)), byte(len(data)>>8), byte(len(data)>>16))
				dst = append(dst, data...)
			}
		}
		binary.LittleEndian.PutUint32(entry[1:], uint32(len(dst)-planeStart))
	}

	chunk := dst[start:]
	putHeader(chunk, Header{Method: Planes, Width: w, BlockLog: blockLog, Len: len(src), Stored: len(chunk)})
	binary.LittleEndian.PutUint32(chunk[16:], chunkCRC(chunk))
	return dst, true
}

// encodeBlock entropy codes one block of a plane; data is valid until the next call.
func (e *Encoder) encodeBlock(b []byte) (kind byte, data []byte) {
	out, _, err := huff0.Compress4X(b, &e.huff)
	switch err {
	case nil:
		return blockHuff, out
	case huff0.ErrUseRLE:
		return blockRLE, b[:1]
	}
	// ErrIncompressible, or anything else huff0 refuses: the bytes as they are are always right.
	return blockRaw, b
}
