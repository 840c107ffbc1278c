package planecodec

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
)

// The chunk format; see the package doc.
const (
	magic   = "MTPC"
	version = 1

	headerLen     = 20 // magic, version, method, width, block log, original length, payload length, CRC32C
	planeEntryLen = 5  // coding, stored length

	// MaxLen is the longest chunk the format holds: the original length is a uint32, and the
	// encoder's and decoder's scratch grows to the chunk's size, so chunks stay in the MiB range.
	MaxLen = 1 << 30
)

// Method says how a chunk's bytes are stored.
type Method uint8

const (
	// Raw chunks hold the original bytes as they are.
	Raw Method = 0
	// Planes chunks hold the bytes split into byte planes, each plane raw or entropy coded.
	Planes Method = 1
)

func (m Method) String() string {
	switch m {
	case Raw:
		return "raw"
	case Planes:
		return "planes"
	}
	return fmt.Sprintf("method(%d)", uint8(m))
}

// Plane codings (the plane table) and block kinds (inside a coded plane).
const (
	planeRaw   = 0 // the plane's bytes as they are
	planeCoded = 1 // a sequence of blocks

	blockRaw  = 0 // the block's bytes as they are
	blockHuff = 1 // huff0 4X: table and four streams
	blockRLE  = 2 // one byte, repeated for the whole block

	blockHeaderLen = 4 // kind (1 byte), stored length (3 bytes)
)

// ErrCorrupt is wrapped by every error about input that is not a valid chunk.
var ErrCorrupt = errors.New("planecodec: corrupt chunk")

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Header is the fixed part at the start of every encoded chunk.
type Header struct {
	Method   Method
	Width    int // element width in bytes: 1 for Raw, 1, 2 or 4 for Planes
	BlockLog int // Planes: coded planes are cut into blocks of 1<<BlockLog bytes; 0 for Raw
	Len      int // length of the original bytes
	Stored   int // length of the whole encoded chunk, header included
	CRC      uint32
}

func corrupt(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrCorrupt}, args...)...)
}

// ParseHeader reads the header at the start of src. It checks the fields for consistency but
// not the CRC, and src may end before the chunk does: Stored says how long the chunk is, so that
// a sequence of chunks can be cut apart.
func ParseHeader(src []byte) (Header, error) {
	if len(src) < headerLen {
		return Header{}, corrupt("%d bytes, shorter than a header", len(src))
	}
	if string(src[:4]) != magic {
		return Header{}, corrupt("bad magic %q", src[:4])
	}
	if src[4] != version {
		return Header{}, corrupt("version %d, want %d", src[4], version)
	}
	h := Header{
		Method:   Method(src[5]),
		Width:    int(src[6]),
		BlockLog: int(src[7]),
		Len:      int(binary.LittleEndian.Uint32(src[8:])),
		Stored:   headerLen + int(binary.LittleEndian.Uint32(src[12:])),
		CRC:      binary.LittleEndian.Uint32(src[16:]),
	}
	if h.Len > MaxLen {
		return Header{}, corrupt("original length %d above %d", h.Len, MaxLen)
	}
	switch h.Method {
	case Raw:
		if h.Width != 1 || h.BlockLog != 0 || h.Stored != headerLen+h.Len {
			return Header{}, corrupt("raw chunk with width %d, block log %d, %d bytes stored for %d", h.Width, h.BlockLog, h.Stored-headerLen, h.Len)
		}
	case Planes:
		if h.Width != 1 && h.Width != 2 && h.Width != 4 {
			return Header{}, corrupt("width %d", h.Width)
		}
		if h.BlockLog < MinBlockLog || h.BlockLog > MaxBlockLog {
			return Header{}, corrupt("block log %d", h.BlockLog)
		}
		if h.Stored < headerLen+h.Width*planeEntryLen+h.Len%h.Width {
			return Header{}, corrupt("%d bytes stored, less than the plane table", h.Stored-headerLen)
		}
	default:
		return Header{}, corrupt("method %d", h.Method)
	}
	return h, nil
}

// putHeader writes h into dst[:headerLen], CRC field included.
func putHeader(dst []byte, h Header) {
	copy(dst, magic)
	dst[4] = version
	dst[5] = byte(h.Method)
	dst[6] = byte(h.Width)
	dst[7] = byte(h.BlockLog)
	binary.LittleEndian.PutUint32(dst[8:], uint32(h.Len))
	binary.LittleEndian.PutUint32(dst[12:], uint32(h.Stored-headerLen))
	binary.LittleEndian.PutUint32(dst[16:], h.CRC)
}

// chunkCRC is the CRC32C of an encoded chunk: its header up to the CRC field, then its payload.
func chunkCRC(chunk []byte) uint32 {
	return crc32.Update(crc32.Update(0, castagnoli, chunk[:16]), castagnoli, chunk[headerLen:])
}
