package replication

import (
	"errors"
	"fmt"
	"math/bits"
	"sync"

	"google.golang.org/grpc/encoding"
	grpcproto "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// Chunk bytes cross this process without being copied by the gRPC layer. gRPC's proto codec
// copies a chunk three times on its way (marshalling, assembling the received HTTP/2 frames
// into one buffer, unmarshalling) and zeroes two fresh buffers for it; on a 2-CPU machine that
// was a quarter of the CPU time of a push (bench/peerbench). peerCodec encodes and decodes the
// chunk messages itself, in the wire format that peer.proto defines:
//
//   - outgoing, a chunk is three buffers handed to gRPC: the encoded fields before the bytes,
//     the pread buffer itself (returned to chunkBuffers once gRPC wrote it), and the CRC field;
//   - incoming, a chunk keeps references to gRPC's receive buffers holding its bytes, which the
//     receiver CRC-checks and writes with pwritev straight from there, then frees.
//
// Every other message goes through gRPC's proto codec. A stream's header, and any message an
// ordinary protobuf implementation sends, decodes as usual: the format is the same.

// peerCodec is the codec of the peer service's calls: ServerOptions installs it on the server,
// the Sender on its calls. It keeps the name "proto", so the content type on the wire is the
// standard one.
type peerCodec struct{}

var protoCodec = encoding.GetCodecV2(grpcproto.Name)

func (peerCodec) Name() string { return grpcproto.Name }

func (peerCodec) Marshal(v any) (mem.BufferSlice, error) {
	if c, ok := v.(*outChunk); ok {
		return c.encode(), nil
	}
	return protoCodec.Marshal(v)
}

func (peerCodec) Unmarshal(data mem.BufferSlice, v any) error {
	if m, ok := v.(*inMessage); ok {
		return m.decode(data)
	}
	return protoCodec.Unmarshal(data, v)
}

// The field numbers of peer.proto that the codec reads and writes.
const (
	fieldHeader     = 1 // PushMessage.header, FetchMessage.manifest
	fieldChunk      = 2 // PushMessage.chunk, FetchMessage.chunk
	fieldChunkFile  = 1 // Chunk.file
	fieldChunkOff   = 2 // Chunk.offset
	fieldChunkData  = 3 // Chunk.data
	fieldChunkCRC32 = 4 // Chunk.crc32c
	fieldChunkCodec = 5 // Chunk.codec
)

// outChunk is a Chunk being sent, as a PushMessage or FetchMessage (the chunk is field 2 of
// both). buf holds the bytes; it comes from chunkBuffers, and once sent, gRPC owns it and puts
// it back when it has written it.
type outChunk struct {
	file   uint32
	offset int64
	crc    uint32
	codec  uint32 // Chunk.codec: 0, or codecPlanes when buf holds a planecodec chunk
	buf    *[]byte
}

func (c *outChunk) encode() mem.BufferSlice {
	data := *c.buf
	var body []byte
	if c.file != 0 { // proto3 leaves zero values out
		body = protowire.AppendTag(body, fieldChunkFile, protowire.VarintType)
		body = protowire.AppendVarint(body, uint64(c.file))
	}
	if c.offset != 0 {
		body = protowire.AppendTag(body, fieldChunkOff, protowire.VarintType)
		body = protowire.AppendVarint(body, uint64(c.offset))
	}
	if c.codec != 0 {
		body = protowire.AppendTag(body, fieldChunkCodec, protowire.VarintType)
		body = protowire.AppendVarint(body, uint64(c.codec))
	}
	body = protowire.AppendTag(body, fieldChunkData, protowire.BytesType)
	body = protowire.AppendVarint(body, uint64(len(data)))
	suffix := protowire.AppendTag(nil, fieldChunkCRC32, protowire.Fixed32Type)
	suffix = protowire.AppendFixed32(suffix, c.crc)

	prefix := protowire.AppendTag(make([]byte, 0, 16+len(body)), fieldChunk, protowire.BytesType)
	prefix = protowire.AppendVarint(prefix, uint64(len(body)+len(data)+len(suffix)))
	prefix = append(prefix, body...)
	return mem.BufferSlice{mem.SliceBuffer(prefix), mem.NewBuffer(c.buf, chunkBuffers), mem.SliceBuffer(suffix)}
}

// inMessage receives a PushMessage or FetchMessage. A header (field 1) is unmarshalled into
// header, which the caller sets to a *peerpb.PushHeader or *peerpb.Manifest; a chunk (field 2)
// goes to chunk, whose data refers to gRPC's buffers until chunk.release.
type inMessage struct {
	header   proto.Message
	isHeader bool
	chunk    inChunk
}

// inChunk is a received Chunk.
type inChunk struct {
	file   uint32
	offset int64
	crc    uint32
	codec  uint32          // Chunk.codec
	data   mem.BufferSlice // the chunk's bytes, in gRPC's receive buffers; we hold a reference
	size   int
}

// release drops the references to the chunk's bytes.
func (c *inChunk) release() {
	c.data.Free()
	c.data, c.size = nil, 0
}

var errMalformed = errors.New("malformed message")

func (m *inMessage) decode(data mem.BufferSlice) error {
	m.isHeader = false
	r := cursor{bufs: data}
	seen := false
	for r.left() > 0 {
		num, typ, err := r.tag()
		if err != nil {
			return err
		}
		switch {
		case num == fieldHeader && typ == protowire.BytesType:
			b, err := r.bytes()
			if err != nil {
				return err
			}
			m.chunk.release()
			if err := proto.Unmarshal(b, m.header); err != nil {
				return err
			}
			m.isHeader, seen = true, true
		case num == fieldChunk && typ == protowire.BytesType:
			n, err := r.length()
			if err != nil {
				return err
			}
			m.chunk.release()
			m.chunk = inChunk{} // fields left out are zero
			if err := m.chunk.decode(r.sub(n)); err != nil {
				m.chunk.release()
				return err
			}
			r.skip(n)
			m.isHeader, seen = false, true
		default:
			if err := r.skipField(typ); err != nil {
				return err
			}
		}
	}
	if !seen {
		return fmt.Errorf("%w: neither a header nor a chunk", errMalformed)
	}
	return nil
}

func (c *inChunk) decode(r cursor) error {
	for r.left() > 0 {
		num, typ, err := r.tag()
		if err != nil {
			return err
		}
		switch {
		case num == fieldChunkFile && typ == protowire.VarintType:
			v, err := r.varint()
			if err != nil {
				return err
			}
			c.file = uint32(v)
		case num == fieldChunkOff && typ == protowire.VarintType:
			v, err := r.varint()
			if err != nil {
				return err
			}
			c.offset = int64(v)
		case num == fieldChunkCodec && typ == protowire.VarintType:
			v, err := r.varint()
			if err != nil {
				return err
			}
			c.codec = uint32(v)
		case num == fieldChunkCRC32 && typ == protowire.Fixed32Type:
			v, err := r.fixed(4)
			if err != nil {
				return err
			}
			c.crc = uint32(v)
		case num == fieldChunkData && typ == protowire.BytesType:
			n, err := r.length()
			if err != nil {
				return err
			}
			c.data.Free()
			c.data, c.size = r.take(n), n
		default:
			if err := r.skipField(typ); err != nil {
				return err
			}
		}
	}
	return nil
}

// cursor reads protobuf wire format from a BufferSlice without copying it.
type cursor struct {
	bufs mem.BufferSlice
	i    int // current buffer
	off  int // offset in it
	end  int // bytes left to read; set by sub, else computed
	set  bool
}

func (r *cursor) left() int {
	if !r.set {
		r.end, r.set = r.bufs.Len(), true
	}
	return r.end
}

func (r *cursor) byte() (byte, error) {
	if r.left() == 0 {
		return 0, fmt.Errorf("%w: truncated", errMalformed)
	}
	for r.off == r.bufs[r.i].Len() {
		r.i, r.off = r.i+1, 0
	}
	b := r.bufs[r.i].ReadOnlyData()[r.off]
	r.off++
	r.end--
	return b, nil
}

func (r *cursor) varint() (uint64, error) {
	var v uint64
	for shift := 0; shift < 64; shift += 7 {
		b, err := r.byte()
		if err != nil {
			return 0, err
		}
		v |= uint64(b&0x7f) << shift
		if b < 0x80 {
			return v, nil
		}
	}
	return 0, fmt.Errorf("%w: varint too long", errMalformed)
}

func (r *cursor) tag() (protowire.Number, protowire.Type, error) {
	v, err := r.varint()
	if err != nil {
		return 0, 0, err
	}
	num, typ := protowire.Number(v>>3), protowire.Type(v&7)
	if !num.IsValid() {
		return 0, 0, fmt.Errorf("%w: field number %d", errMalformed, num)
	}
	return num, typ, nil
}

func (r *cursor) fixed(n int) (uint64, error) {
	var v uint64
	for i := range n {
		b, err := r.byte()
		if err != nil {
			return 0, err
		}
		v |= uint64(b) << (8 * i)
	}
	return v, nil
}

// length reads a length prefix and checks that that many bytes follow.
func (r *cursor) length() (int, error) {
	v, err := r.varint()
	if err != nil {
		return 0, err
	}
	if v > uint64(r.left()) {
		return 0, fmt.Errorf("%w: length %d past the end", errMalformed, v)
	}
	return int(v), nil
}

// sub returns a cursor over the next n bytes (checked by length); r does not move.
func (r *cursor) sub(n int) cursor {
	s := *r
	s.end, s.set = n, true
	return s
}

// skip moves past n bytes (n ≤ left).
func (r *cursor) skip(n int) {
	r.end -= n
	for n > 0 {
		k := min(n, r.bufs[r.i].Len()-r.off)
		r.off += k
		n -= k
		if r.off == r.bufs[r.i].Len() && n > 0 {
			r.i, r.off = r.i+1, 0
		}
	}
}

// take returns the next n bytes as buffers that share gRPC's memory, each holding a reference.
func (r *cursor) take(n int) mem.BufferSlice {
	var out mem.BufferSlice
	for rest := n; rest > 0; {
		for r.off == r.bufs[r.i].Len() {
			r.i, r.off = r.i+1, 0
		}
		k := min(rest, r.bufs[r.i].Len()-r.off)
		out = append(out, r.bufs[r.i].Slice(r.off, r.off+k))
		r.off += k
		rest -= k
	}
	r.end -= n
	return out
}

// bytes reads a length-prefixed field into a new slice (headers are small and parsed by proto).
func (r *cursor) bytes() ([]byte, error) {
	n, err := r.length()
	if err != nil {
		return nil, err
	}
	b := make([]byte, n)
	for i := range b {
		b[i], _ = r.byte()
	}
	return b, nil
}

func (r *cursor) skipField(typ protowire.Type) error {
	switch typ {
	case protowire.VarintType:
		_, err := r.varint()
		return err
	case protowire.Fixed32Type:
		_, err := r.fixed(4)
		return err
	case protowire.Fixed64Type:
		_, err := r.fixed(8)
		return err
	case protowire.BytesType:
		n, err := r.length()
		if err == nil {
			r.skip(n)
		}
		return err
	}
	return fmt.Errorf("%w: wire type %d", errMalformed, typ)
}

// chunkBuffers pools the buffers of outgoing chunks, by size class (powers of two), without
// zeroing them: every byte sent is read into the buffer first. It is a mem.BufferPool, so
// gRPC returns a buffer to it once written.
var chunkBuffers = &bufferPool{}

type bufferPool struct {
	classes [64]sync.Pool // class k holds buffers of capacity 1<<k
}

var _ mem.BufferPool = (*bufferPool)(nil)

func (p *bufferPool) Get(n int) *[]byte {
	k := bits.Len(uint(max(n, 1) - 1)) // smallest k with 1<<k ≥ n
	if b, ok := p.classes[k].Get().(*[]byte); ok {
		*b = (*b)[:n]
		return b
	}
	b := make([]byte, n, 1<<k)
	return &b
}

func (p *bufferPool) Put(b *[]byte) {
	c := cap(*b)
	if c == 0 || c&(c-1) != 0 {
		return // not one of ours
	}
	*b = (*b)[:c]
	p.classes[bits.Len(uint(c))-1].Put(b)
}
