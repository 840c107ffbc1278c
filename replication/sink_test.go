package replication

import (
	"bytes"
	"context"
	"errors"
	"hash/crc32"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"

	"github.com/mtcfs/mtcfs/layout"
)

// sendTo writes the files of src into s as chunks cut at the given size (a push's, or odd ones
// that split the arrival hash's segments), each chunk as several buffers like gRPC's; corrupt,
// if set, may change a chunk's bytes (the CRC is then computed over the changed bytes, as a
// sender that read them wrong would).
func sendTo(t *testing.T, s *sink, src string, chunk int64, rng *rand.Rand, corrupt func(file int, off int64, b []byte)) {
	t.Helper()
	for i, f := range s.m.pb.Files {
		data, err := os.ReadFile(filepath.Join(src, string(f.Path)))
		require.NoError(t, err)
		for off := int64(0); off < f.Size; off += chunk {
			b := append([]byte(nil), data[off:min(off+chunk, f.Size)]...)
			if corrupt != nil {
				corrupt(i, off, b)
			}
			var bufs mem.BufferSlice
			for rest := b; len(rest) > 0; {
				n := min(len(rest), 1+rng.IntN(200<<10))
				bufs = append(bufs, mem.SliceBuffer(rest[:n]))
				rest = rest[n:]
			}
			c := &inChunk{file: uint32(i), offset: off, crc: crc32.Checksum(b, castagnoli), data: bufs, size: len(b)}
			_, err := s.write(c, nil)
			require.NoError(t, err)
		}
	}
}

// TestSinkHashesChunksAsTheyArrive: once a file's last chunk is written, the sink knows its
// digest without reading the file (verify then reads nothing back), whether the chunks are a
// push's 4 MiB or cut at odd offsets that split the hash's segments; and a file whose bytes are
// not the ones the sender hashed still fails verify, with DataLoss.
func TestSinkHashesChunksAsTheyArrive(t *testing.T) {
	rng := rand.New(rand.NewPCG(51, 52))
	src := t.TempDir()
	sizes := []int{0, 1, 1024, 100<<10 + 3, 4 << 20, 9<<20 + 7}
	for i, n := range sizes {
		b := make([]byte, n)
		for j := range b {
			b[j] = byte(rng.Uint32())
		}
		require.NoError(t, os.WriteFile(filepath.Join(src, "f"+string(rune('a'+i))), b, 0o644))
	}
	hash, err := layout.HashDir(t.Context(), src)
	require.NoError(t, err)
	name := layout.DataName(hash, true)
	m, err := buildManifest(t.Context(), src, name, peerJob, nil)
	require.NoError(t, err)

	for _, chunk := range []int64{DefaultChunkSize, 100_003} {
		s, err := newSink(t.TempDir(), incomingPrefix, m)
		require.NoError(t, err)
		sendTo(t, s, src, chunk, rng, nil)
		for _, f := range m.pb.Files {
			if f.Size == 0 {
				continue // no chunk arrives: verify hashes nothing
			}
			d, _, ok := s.known.Lookup(filepath.Join(s.root, string(f.Path)))
			require.True(t, ok, "chunks of %d: the digest of %s (%d bytes) is known without reading it", chunk, f.Path, f.Size)
			require.Equal(t, layout.FileDigest(f.Blake3), d, "chunks of %d: %s", chunk, f.Path)
		}
		require.NoError(t, s.verify(context.Background()), "chunks of %d", chunk)
		require.NoError(t, s.discard(errors.New("test done")))
	}

	// A sender that read a byte wrong (and stamped the CRC of what it sent): the digest of what
	// arrived is not the manifest's.
	s, err := newSink(t.TempDir(), incomingPrefix, m)
	require.NoError(t, err)
	sendTo(t, s, src, DefaultChunkSize, rng, func(file int, off int64, b []byte) {
		if file == len(sizes)-1 && off == 4<<20 {
			b[12345] ^= 0x10
		}
	})
	err = s.verify(context.Background())
	require.Equal(t, codes.DataLoss, status.Code(err), "%v", err)
	require.ErrorContains(t, err, "hashes to")
	require.NoError(t, s.discard(errors.New("test done")))
}

// TestSinkDoesNotTrustTheHashOfAFailedWrite: when a chunk's write fails (EFBIG here, ENOSPC on a
// full tmpfs alike) and other chunks complete the file, the digest of what arrived is not the
// file's: verify must read the file and refuse it. (Found by review: the arrival hash counted
// the failed chunk's bytes and verify accepted a file with a hole. A failed write also fails its
// stream and the transfer; this is the check behind that.) Not parallel: the file size limit is
// the process's.
func TestSinkDoesNotTrustTheHashOfAFailedWrite(t *testing.T) {
	const mib = 1 << 20
	src := t.TempDir()
	data := make([]byte, 3*mib)
	for i := range data {
		data[i] = byte(i*7 + 1)
	}
	require.NoError(t, os.WriteFile(filepath.Join(src, "f"), data, 0o644))
	hash, err := layout.HashDir(t.Context(), src)
	require.NoError(t, err)
	m, err := buildManifest(t.Context(), src, layout.DataName(hash, true), peerJob, nil)
	require.NoError(t, err)
	s, err := newSink(t.TempDir(), incomingPrefix, m)
	require.NoError(t, err)
	defer s.discard(errors.New("test done"))

	chunk := func(off int64) *inChunk {
		b := data[off : off+mib]
		return &inChunk{file: 0, offset: off, crc: crc32.Checksum(b, castagnoli), data: mem.BufferSlice{mem.SliceBuffer(b)}, size: mib}
	}
	_, err = s.write(chunk(2*mib), nil) // the tail: the file has its full size from now on
	require.NoError(t, err)

	var old unix.Rlimit
	require.NoError(t, unix.Getrlimit(unix.RLIMIT_FSIZE, &old))
	require.NoError(t, unix.Setrlimit(unix.RLIMIT_FSIZE, &unix.Rlimit{Cur: mib, Max: old.Max}))
	_, werr := s.write(chunk(mib), nil)
	require.NoError(t, unix.Setrlimit(unix.RLIMIT_FSIZE, &old))
	require.Error(t, werr, "the middle chunk's write must fail for this test")

	_, err = s.write(chunk(0), nil) // completes the file
	require.NoError(t, err)

	onDisk, err := os.ReadFile(filepath.Join(s.root, "f"))
	require.NoError(t, err)
	require.False(t, bytes.Equal(onDisk, data), "the file on disk lacks the failed chunk")
	err = s.verify(context.Background())
	require.Equal(t, codes.DataLoss, status.Code(err), "verify must refuse a file whose bytes differ from the manifest's digest: %v", err)
}
