package main

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"net"
	"os"
	"path/filepath"
	"sync"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/mem"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/replication"
)

// The gRPC minimal pipeline is the minimal pipeline's work carried by one gRPC stream instead
// of a TCP connection: the least any transfer over gRPC that follows SPEC §3 (chunks that carry
// the sender's CRC32C) can do. It shows what gRPC itself costs on this machine, apart from
// mtcfs's protocol:
//
//   - the sender preads each 4 MiB chunk of a file (gRPC writes from memory; it cannot
//     sendfile), computes its CRC32C and sends it as one raw message (a 16-byte header: file,
//     offset, CRC, then the bytes) through a codec that copies nothing, with the transport
//     settings of the peer service (replication.ServerOptions and DialOptions: windows, buffer
//     sizes, the receive buffer pool);
//   - the receiver keeps gRPC's receive buffers (no copy), checks the chunk's CRC32C against the
//     sender's, hashes the chunk for the file's BLAKE3 (compared with the source's at the end)
//     and writes the buffers with pwritev, as the minimal pipeline's receiver does. gRPC hands
//     the bytes over in pieces of one HTTP/2 frame (16 KiB); fed to the BLAKE3 library's
//     streaming Write in such pieces, hashing alone took more CPU than the whole TCP pipeline,
//     so the receiver hashes them as mtcfs's does, with layout.ArrivalHash (64 KiB segments
//     gathered from the pieces, hashed by the library's vector code).
//
// It has no manifest, no tree hash, no incoming directory and no authentication: everything
// mtcfs's push does beyond it is mtcfs's protocol. What it does beyond the TCP minimal pipeline
// is gRPC's, with two more: the sender's CRC32C (SPEC §3), and hashing 64 KiB segments gathered
// from 16 KiB frames where the TCP receiver hashes 4 MiB it read in one piece.
const grpcMinimalLabel = "gRPC minimal pipeline: one gRPC stream, sender pread + CRC32C, receiver as above"

const rawHeader = 16 // file index u32, CRC32C u32, offset u64

var rawDesc = grpc.StreamDesc{StreamName: "Push", ClientStreams: true, ServerStreams: true}

const rawMethod = "/peerbench.Raw/Push"

// rawOut is a chunk being sent; buf comes from rawBuffers and goes back once gRPC wrote it.
type rawOut struct {
	hdr [rawHeader]byte
	buf *[]byte
}

// rawIn is a chunk received: references to gRPC's receive buffers.
type rawIn struct{ data mem.BufferSlice }

// rawCodec moves rawOut and rawIn without copying their bytes.
type rawCodec struct{}

func (rawCodec) Name() string { return "peerbench-raw" }

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	m, ok := v.(*rawOut)
	if !ok {
		return nil, fmt.Errorf("rawCodec: cannot marshal %T", v)
	}
	return mem.BufferSlice{mem.SliceBuffer(m.hdr[:]), mem.NewBuffer(m.buf, rawBuffers)}, nil
}

func (rawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	m, ok := v.(*rawIn)
	if !ok {
		return fmt.Errorf("rawCodec: cannot unmarshal into %T", v)
	}
	data.Ref() // gRPC frees data when Unmarshal returns; the receiver frees it when written
	m.data = data
	return nil
}

// rawBuffers is the sender's pool of chunk buffers.
var rawBuffers = &chunkPool{}

type chunkPool struct{ p sync.Pool }

func (c *chunkPool) Get(n int) *[]byte {
	if b, ok := c.p.Get().(*[]byte); ok && cap(*b) >= n {
		*b = (*b)[:n]
		return b
	}
	b := make([]byte, n)
	return &b
}

func (c *chunkPool) Put(b *[]byte) { c.p.Put(b) }

// grpcMin is the gRPC minimal pipeline's server and connection.
type grpcMin struct {
	srv  *grpc.Server
	conn *grpc.ClientConn
}

func startGRPCMin(b *bench) (*grpcMin, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	g := &grpcMin{}
	// The peer service's transport settings; the codec given last replaces the peer codec.
	g.srv = grpc.NewServer(append(replication.ServerOptions(), grpc.ForceServerCodecV2(rawCodec{}))...)
	desc := rawDesc
	desc.Handler = func(_ any, stream grpc.ServerStream) error { return b.rawReceive(stream) }
	g.srv.RegisterService(&grpc.ServiceDesc{ServiceName: "peerbench.Raw", HandlerType: (*any)(nil), Streams: []grpc.StreamDesc{desc}}, struct{}{})
	go g.srv.Serve(ln)
	g.conn, err = grpc.NewClient(ln.Addr().String(), append(replication.DialOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		g.srv.Stop()
		return nil, err
	}
	return g, nil
}

func (g *grpcMin) close() {
	g.conn.Close()
	g.srv.Stop()
}

// grpcMinimal sends the tree over one stream and returns when the receiver has checked and
// written every chunk and every file's BLAKE3.
func (b *bench) grpcMinimal(ctx context.Context) error {
	if err := os.Mkdir(b.received, 0o755); err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := b.grpcMin.conn.NewStream(ctx, &rawDesc, rawMethod, grpc.ForceCodecV2(rawCodec{}))
	if err != nil {
		return err
	}
	const chunk = replication.DefaultChunkSize
	for i, f := range b.tcpFiles {
		in, err := os.Open(filepath.Join(b.src, f.name))
		if err != nil {
			return err
		}
		for off := int64(0); off < f.size; off += chunk {
			m := &rawOut{buf: rawBuffers.Get(int(min(chunk, f.size-off)))}
			if _, err = in.ReadAt(*m.buf, off); err != nil {
				rawBuffers.Put(m.buf)
				break
			}
			binary.LittleEndian.PutUint32(m.hdr[0:], uint32(i))
			binary.LittleEndian.PutUint32(m.hdr[4:], crc32.Checksum(*m.buf, castagnoli))
			binary.LittleEndian.PutUint64(m.hdr[8:], uint64(off))
			if err = stream.SendMsg(m); err == io.EOF {
				// The receiver ended the stream: its status says why.
				if err = stream.RecvMsg(&rawIn{}); err == nil || err == io.EOF {
					err = errors.New("gRPC minimal pipeline: the receiver ended the stream early")
				}
			}
			if err != nil {
				break
			}
		}
		in.Close()
		if err != nil {
			return err
		}
	}
	if err := stream.CloseSend(); err != nil {
		return err
	}
	if err := stream.RecvMsg(&rawIn{}); err != io.EOF {
		return fmt.Errorf("gRPC minimal pipeline: the receiver ended with %v", err)
	}
	return nil
}

// rawReceive is the receiving end of grpcMinimal: chunks arrive in file order on one stream.
func (b *bench) rawReceive(stream grpc.ServerStream) error {
	var out *os.File
	var h *layout.ArrivalHash
	cur := -1
	var next int64 // the offset the next chunk of file cur must start at
	defer func() {
		if out != nil {
			out.Close()
		}
	}()
	var iov [][]byte
	for {
		var m rawIn
		err := stream.RecvMsg(&m)
		if err == io.EOF {
			if out != nil {
				return fmt.Errorf("gRPC minimal pipeline: stream ended inside %s", b.tcpFiles[cur].name)
			}
			return nil
		}
		if err != nil {
			return err
		}
		err = func() error {
			defer m.data.Free()
			var hdr [rawHeader]byte
			if m.data.Len() < rawHeader {
				return errors.New("gRPC minimal pipeline: short chunk")
			}
			iov = iov[:0]
			skip := rawHeader
			for _, buf := range m.data {
				p := buf.ReadOnlyData()
				if skip > 0 {
					n := copy(hdr[rawHeader-skip:], p[:min(skip, len(p))])
					skip -= n
					p = p[n:]
				}
				if len(p) > 0 {
					iov = append(iov, p)
				}
			}
			file := int(binary.LittleEndian.Uint32(hdr[0:]))
			off := int64(binary.LittleEndian.Uint64(hdr[8:]))
			if file != cur {
				if out != nil || file != cur+1 || file >= len(b.tcpFiles) {
					return fmt.Errorf("gRPC minimal pipeline: chunk of file %d out of order", file)
				}
				var err error
				if out, err = os.Create(filepath.Join(b.received, b.tcpFiles[file].name)); err != nil {
					return err
				}
				h, cur, next = layout.NewArrivalHash(b.tcpFiles[file].size), file, 0
			}
			if out == nil || off != next {
				return fmt.Errorf("gRPC minimal pipeline: chunk of file %d at %d, want %d", file, off, next)
			}
			var crc uint32
			n := int64(0)
			for _, p := range iov {
				crc = crc32.Update(crc, castagnoli, p)
				n += int64(len(p))
			}
			h.Add(iov, off)
			f := b.tcpFiles[file]
			if off+n > f.size {
				return fmt.Errorf("gRPC minimal pipeline: chunk of %s at %d runs past its size %d", f.name, off, f.size)
			}
			if crc != binary.LittleEndian.Uint32(hdr[4:]) {
				return fmt.Errorf("gRPC minimal pipeline: CRC32C mismatch in %s at %d", b.tcpFiles[file].name, off)
			}
			if err := pwritevAll(int(out.Fd()), iov, off); err != nil {
				return err
			}
			if next = off + n; next < f.size {
				return nil
			}
			sum, err := h.Finish(stream.Context(), out)
			if cerr := out.Close(); err == nil {
				err = cerr
			}
			out = nil
			if err == nil {
				err = b.checkSum(f.name, sum[:])
			}
			return err
		}()
		if err != nil {
			return err
		}
	}
}

// pwritevAll writes iov at off, continuing after short writes.
func pwritevAll(fd int, iov [][]byte, off int64) error {
	for len(iov) > 0 {
		n, err := unix.Pwritev(fd, iov[:min(len(iov), 1024)], off)
		if err != nil {
			return err
		}
		if n == 0 {
			return io.ErrShortWrite
		}
		off += int64(n)
		for n > 0 && len(iov) > 0 {
			if n < len(iov[0]) {
				iov[0] = iov[0][n:]
				n = 0
			} else {
				n -= len(iov[0])
				iov = iov[1:]
			}
		}
	}
	return nil
}
