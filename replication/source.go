package replication

import (
	"context"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"time"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/planecodec"
)

// Chunk sizes. Measured with bench/peerbench (bench/RESULTS.md): see DefaultChunkSize.
const (
	// DefaultChunkSize is the bytes per chunk a Sender uses when not told otherwise.
	DefaultChunkSize = 4 << 20
	// MaxChunkSize is the largest chunk a receiver takes; a message must fit in it plus
	// messageOverhead.
	MaxChunkSize = 16 << 20
	// minChunkSize keeps per-message overhead small whatever a caller asks for.
	minChunkSize = 64 << 10
	// messageOverhead is what a message may hold besides chunk bytes. A PushHeader is a message
	// too, so it also bounds the manifest: about 100 000 files of 60-byte paths.
	messageOverhead = 8 << 20
)

// chunkOut is where sendShare hands one stream's chunks, and what it counted of them.
type chunkOut struct {
	send     func(*outChunk) error
	progress func() // after each chunk; nil: none
	// compress, if set, is asked before each chunk whether to send it compressed; planecodec
	// still keeps a chunk as it is where coding does not pay, and such a chunk goes as it is.
	compress func() bool
	enc      *planecodec.Encoder // from encoders, once a chunk was compressed

	orig, wire int64         // chunk bytes read and sent
	coded      int64         // chunks sent compressed
	wait       time.Duration // spent in send: waiting for the network (flow control, the socket)

	// announced, if set, says whether the receiver has announced itself (its codecs header);
	// before it returns true the receiver may be holding the stream (ReceiverConfig.Yield)
	// while chunks fill the flow-control window. before is orig, wire and wait as they were
	// when the first chunk after the announcement was sent: what crossed before it is not
	// the link's measure.
	announced func() bool
	before    struct {
		orig, wire int64
		wait       time.Duration
		taken      bool
	}
}

// release returns the encoder's scratch to the pool.
func (o *chunkOut) release() {
	if o.enc != nil {
		encoders.Put(o.enc)
		o.enc = nil
	}
}

// sendShare reads the pieces of the data at root and hands them to out as CRC32C-stamped
// chunks of at most chunkSize bytes, in order. Each chunk is read (pread) into a buffer from
// chunkBuffers that out.send passes on to gRPC without a copy (see peerCodec); a compressed
// chunk is encoded into another buffer from chunkBuffers, passed on the same way. It returns
// the bytes sent (as read).
//
// The files of a tree are opened relative to root's descriptor (layout.Dir): their paths may be
// longer than PATH_MAX below root, and no symlink inside the tree is followed.
func sendShare(ctx context.Context, root string, m *manifest, pieces []piece, chunkSize int, out *chunkOut) (int64, error) {
	if len(pieces) == 0 {
		return 0, nil
	}
	open := func(int) (*os.File, error) { return os.Open(root) } // a single file: root itself
	if m.kind == kindTree {
		d, err := layout.OpenDir(root)
		if err != nil {
			return 0, err
		}
		defer d.Close()
		open = func(i int) (*os.File, error) { return d.Open(string(m.pb.Files[i].Path), os.O_RDONLY, 0) }
	}
	var sent int64
	for _, p := range pieces {
		if err := sendPiece(ctx, open, m, p, chunkSize, out); err != nil {
			return sent, err
		}
		sent += p.n
	}
	return sent, nil
}

func sendPiece(ctx context.Context, open func(int) (*os.File, error), m *manifest, p piece, chunkSize int, out *chunkOut) error {
	meta := m.pb.Files[p.file]
	f, err := open(p.file)
	if err != nil {
		return err
	}
	defer f.Close()
	if info, err := f.Stat(); err != nil {
		return err
	} else if !info.Mode().IsRegular() {
		return errCorrupt("%s: %q changed since it was hashed: no longer a regular file", m.pb.DataName, meta.Path)
	} else if info.Size() != meta.Size {
		return errCorrupt("%s: %q changed since it was hashed: %d bytes, was %d", m.pb.DataName, meta.Path, info.Size(), meta.Size)
	}
	for off, end := p.off, p.off+p.n; off < end; {
		if err := ctx.Err(); err != nil {
			return context.Cause(ctx)
		}
		buf := chunkBuffers.Get(int(min(int64(chunkSize), end-off)))
		if n, err := f.ReadAt(*buf, off); n < len(*buf) {
			chunkBuffers.Put(buf)
			if err == nil || err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return fmt.Errorf("read %q at %d: %w", meta.Path, off, err)
		}
		n := len(*buf)
		c := &outChunk{file: uint32(p.file), offset: off, buf: buf}
		if out.compress != nil && out.compress() {
			out.encode(c)
		}
		c.crc = crc32.Checksum(*c.buf, castagnoli)
		wire := len(*c.buf)
		if out.announced != nil && !out.before.taken && out.announced() {
			out.before.orig, out.before.wire, out.before.wait, out.before.taken = out.orig, out.wire, out.wait, true
		}
		start := time.Now()
		if err := out.send(c); err != nil {
			return err
		}
		out.wait += time.Since(start)
		out.orig += int64(n)
		out.wire += int64(wire)
		if out.progress != nil {
			out.progress()
		}
		off += int64(n)
	}
	return nil
}

// encode replaces c's bytes with their planecodec form where coding pays.
func (o *chunkOut) encode(c *outChunk) {
	if o.enc == nil {
		o.enc = encoders.Get().(*planecodec.Encoder)
	}
	src := *c.buf
	dst := chunkBuffers.Get(planecodec.MaxEncodedLen(len(src)))
	coded, err := o.enc.Encode((*dst)[:0], src)
	if err != nil || len(coded) >= len(src) {
		chunkBuffers.Put(dst) // stored raw by the codec: sent as it is, which costs the receiver nothing
		return
	}
	*dst = coded
	chunkBuffers.Put(c.buf)
	c.buf, c.codec = dst, codecPlanes
	o.coded++
}
