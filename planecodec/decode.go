package planecodec

import (
	"encoding/binary"
	"fmt"
	"slices"

	"github.com/klauspost/compress/huff0"
)

// Decoder decompresses chunks. It keeps its scratch from chunk to chunk, so that decoding
// allocates nothing once it has seen a chunk of the largest size; it is not safe for concurrent
// use (one per goroutine).
type Decoder struct {
	maxLen int
	huff   huff0.Scratch
	blocks []byte // one decoded block per coded plane, plane k's at [k·B, (k+1)·B)
}

// NewDecoder returns a decoder that refuses chunks whose original length is above maxLen (at
// most MaxLen): the header declares that length, and the decoder allocates up to it, so maxLen
// bounds what a corrupt or hostile chunk can make it allocate.
func NewDecoder(maxLen int) *Decoder {
	return &Decoder{maxLen: min(maxLen, MaxLen)}
}

// Decode checks that src is exactly one valid chunk (header, CRC32C of the stored bytes,
// structure) and appends the original bytes to dst. Invalid input gives an error wrapping
// ErrCorrupt. With cap(dst)-len(dst) at least the original length it does not allocate.
func (d *Decoder) Decode(dst, src []byte) ([]byte, error) {
	h, err := ParseHeader(src)
	if err != nil {
		return dst, err
	}
	if h.Len > d.maxLen {
		return dst, fmt.Errorf("planecodec: chunk of %d bytes above the decoder's limit of %d", h.Len, d.maxLen)
	}
	if len(src) != h.Stored {
		return dst, corrupt("%d bytes given for a chunk of %d", len(src), h.Stored)
	}
	if crc := chunkCRC(src); crc != h.CRC {
		return dst, corrupt("CRC32C %08x, header says %08x", crc, h.CRC)
	}
	if h.Method == Raw {
		return append(dst, src[headerLen:]...), nil
	}
	return d.decodePlanes(dst, src, h)
}

func (d *Decoder) decodePlanes(dst, src []byte, h Header) ([]byte, error) {
	w := h.Width
	n := h.Len / w
	table := src[headerLen : headerLen+w*planeEntryLen]
	pos := headerLen + w*planeEntryLen
	tail := src[pos : pos+h.Len%w] // ParseHeader checked the length
	pos += len(tail)

	// Check the plane table before allocating anything.
	blockLen := 1 << h.BlockLog
	blocks := (n + blockLen - 1) / blockLen
	end := pos
	coded := false
	for k := range w {
		stored := int(binary.LittleEndian.Uint32(table[k*planeEntryLen+1:]))
		switch table[k*planeEntryLen] {
		case planeRaw:
			if stored != n {
				return dst, corrupt("raw plane %d holds %d bytes, want %d", k, stored, n)
			}
		case planeCoded:
			if stored < blocks*(blockHeaderLen+1) {
				return dst, corrupt("coded plane %d holds %d bytes, too few for %d blocks", k, stored, blocks)
			}
			coded = true
		default:
			return dst, corrupt("plane %d coding %d", k, table[k*planeEntryLen])
		}
		if stored > len(src)-end {
			return dst, corrupt("plane %d runs past the end of the chunk", k)
		}
		end += stored
	}
	if end != len(src) {
		return dst, corrupt("%d bytes after the last plane", len(src)-end)
	}

	// Block by block: decode block i of every coded plane into the scratch and join it with the
	// same range of the raw planes, read straight from the input, so that the working set stays
	// a few blocks wide (in cache) and the scratch is w blocks, not a chunk.
	if coded && cap(d.blocks) < w*blockLen {
		d.blocks = make([]byte, w*blockLen)
	}
	var bodies [4][]byte // a raw plane's bytes, or the blocks of a coded plane not yet decoded
	for k := range w {
		stored := int(binary.LittleEndian.Uint32(table[k*planeEntryLen+1:]))
		bodies[k] = src[pos : pos+stored]
		pos += stored
	}
	start := len(dst)
	dst = slices.Grow(dst, h.Len)[:start+h.Len]
	out := dst[start:]
	for off := 0; off < n; off += blockLen {
		m := min(blockLen, n-off)
		var planes [4][]byte
		for k := range w {
			if table[k*planeEntryLen] == planeRaw {
				planes[k] = bodies[k][off : off+m]
				continue
			}
			planes[k] = d.blocks[k*blockLen : k*blockLen+m]
			rest, err := d.decodeBlock(planes[k], bodies[k])
			if err != nil {
				return dst[:start], fmt.Errorf("plane %d, block at %d: %w", k, off, err)
			}
			bodies[k] = rest
		}
		joinPlanes(out[off*w:(off+m)*w], planes[:w], w)
	}
	for k := range w {
		if table[k*planeEntryLen] == planeCoded && len(bodies[k]) != 0 {
			return dst[:start], corrupt("plane %d: %d bytes after the last block", k, len(bodies[k]))
		}
	}
	copy(out[w*n:], tail)
	return dst, nil
}

// decodeBlock fills b from the block at the start of body and returns the rest of body.
func (d *Decoder) decodeBlock(b, body []byte) ([]byte, error) {
	if len(body) < blockHeaderLen {
		return nil, corrupt("truncated block header")
	}
	kind := body[0]
	size := int(body[1]) | int(body[2])<<8 | int(body[3])<<16
	body = body[blockHeaderLen:]
	if size > len(body) {
		return nil, corrupt("block of %d bytes, %d left", size, len(body))
	}
	data, rest := body[:size], body[size:]
	switch kind {
	case blockRaw:
		if size != len(b) {
			return nil, corrupt("raw block of %d bytes, want %d", size, len(b))
		}
		copy(b, data)
	case blockRLE:
		if size != 1 {
			return nil, corrupt("RLE block of %d bytes", size)
		}
		b[0] = data[0]
		for filled := 1; filled < len(b); filled *= 2 {
			copy(b[filled:], b[:filled])
		}
	case blockHuff:
		s, streams, err := huff0.ReadTable(data, &d.huff)
		if err != nil {
			return nil, corrupt("huff0 table: %v", err)
		}
		out, err := s.Decoder().Decompress4X(b[:0:len(b)], streams)
		if err != nil {
			return nil, corrupt("huff0: %v", err)
		}
		if len(out) != len(b) || &out[0] != &b[0] {
			return nil, corrupt("huff0 block of %d bytes, want %d", len(out), len(b))
		}
	default:
		return nil, corrupt("block kind %d", kind)
	}
	return rest, nil
}
