package replication

import (
	"context"
	"fmt"
	"hash/crc32"
	"io"
	"os"

	"github.com/mtcfs/mtcfs/layout"
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

// sendShare reads the pieces of the data at root and hands them to send as CRC32C-stamped
// chunks of at most chunkSize bytes, in order. Each chunk is read (pread) into a buffer from
// chunkBuffers that send passes on to gRPC without a copy (see peerCodec). progress is called
// after each chunk. It returns the bytes sent.
//
// The files of a tree are opened relative to root's descriptor (layout.Dir): their paths may be
// longer than PATH_MAX below root, and no symlink inside the tree is followed.
func sendShare(ctx context.Context, root string, m *manifest, pieces []piece, chunkSize int,
	send func(*outChunk) error, progress func()) (int64, error) {
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
		open = func(i int) (*os.File, error) { return d.Open(m.pb.Files[i].Path, os.O_RDONLY, 0) }
	}
	var sent int64
	for _, p := range pieces {
		if err := sendPiece(ctx, open, m, p, chunkSize, send, progress); err != nil {
			return sent, err
		}
		sent += p.n
	}
	return sent, nil
}

func sendPiece(ctx context.Context, open func(int) (*os.File, error), m *manifest, p piece, chunkSize int,
	send func(*outChunk) error, progress func()) error {
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
		if err := send(&outChunk{file: uint32(p.file), offset: off, crc: crc32.Checksum(*buf, castagnoli), buf: buf}); err != nil {
			return err
		}
		progress()
		off += int64(n)
	}
	return nil
}
