package replication

import (
	"context"
	"hash/crc32"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/mtcfs/mtcfs/replication/peerpb"
)

// rawPeer calls the peer service directly, to send what a Sender never would.
type rawPeer struct{ client peerpb.PeerClient }

func newRawPeer(t *testing.T, conn grpc.ClientConnInterface) *rawPeer {
	return &rawPeer{client: peerpb.NewPeerClient(conn)}
}

// creds authenticates as rank of peerJob, incarnation inc-1, instance instance-1.
func (r *rawPeer) creds(rank int) grpc.CallOption {
	return grpc.PerRPCCredentials(Credentials(Identity{Job: peerJob, Incarnation: "inc-1", Rank: rank, Instance: "instance-1"}, peerSecret))
}

// call makes one call of method with the given credentials (none if nil) and returns its error.
func (r *rawPeer) call(ctx context.Context, method string, creds grpc.CallOption) error {
	var opts []grpc.CallOption
	if creds != nil {
		opts = append(opts, creds)
	}
	id := strings.Repeat("0", 32)
	switch method {
	case "PushFiles":
		return r.pushHeader(ctx, &peerpb.PushHeader{TransferId: id}, opts...)
	case "Commit":
		_, err := r.client.Commit(ctx, &peerpb.CommitRequest{TransferId: id}, opts...)
		return err
	case "Abandon":
		_, err := r.client.Abandon(ctx, &peerpb.AbandonRequest{TransferId: id}, opts...)
		return err
	case "Fetch":
		s, err := r.client.Fetch(ctx, &peerpb.FetchRequest{DataName: "D" + strings.Repeat("0", 64) + ".data", StreamCount: 1}, opts...)
		if err != nil {
			return err
		}
		_, err = s.Recv()
		return err
	}
	panic(method)
}

// pushHeader opens a stream, sends h and the chunks, and returns the stream's status.
func (r *rawPeer) pushHeader(ctx context.Context, h *peerpb.PushHeader, opts ...grpc.CallOption) error {
	return r.push(ctx, h, nil, opts...)
}

func (r *rawPeer) push(ctx context.Context, h *peerpb.PushHeader, chunks []*peerpb.Chunk, opts ...grpc.CallOption) error {
	s, err := r.client.PushFiles(ctx, opts...)
	if err != nil {
		return err
	}
	if err := s.Send(&peerpb.PushMessage{Kind: &peerpb.PushMessage_Header{Header: h}}); err != nil {
		_, err = s.CloseAndRecv()
		return err
	}
	for _, c := range chunks {
		if err := s.Send(&peerpb.PushMessage{Kind: &peerpb.PushMessage_Chunk{Chunk: c}}); err != nil {
			break // the status comes with CloseAndRecv
		}
	}
	_, err = s.CloseAndRecv()
	return err
}

// validHeader is the header a Sender would send for the data at src.
func validHeader(t *testing.T, name, src string) *peerpb.PushHeader {
	t.Helper()
	m, err := buildManifest(t.Context(), src, name, peerJob, nil)
	require.NoError(t, err)
	return &peerpb.PushHeader{TransferId: strings.Repeat("ab", 16), Job: peerJob, Incarnation: "inc-1", SenderRank: 1,
		SenderInstance: "instance-1", Manifest: m.pb}
}

func TestHeaderValidation(t *testing.T) {
	src, name := makeTree(t, rand.New(rand.NewPCG(21, 22)), 1000)
	p := startPeer(t, nil)
	raw := newRawPeer(t, dial(t, p.addr))
	file := func(path string) *peerpb.File {
		return &peerpb.File{Path: []byte(path), Size: 1, Blake3: make([]byte, 32)}
	}
	cases := []struct {
		name   string
		mutate func(h *peerpb.PushHeader)
		want   codes.Code
	}{
		{"parent directory in a file path", func(h *peerpb.PushHeader) { h.Manifest.Files[0].Path = []byte("../escape") }, codes.InvalidArgument},
		{"absolute file path", func(h *peerpb.PushHeader) { h.Manifest.Files[0].Path = []byte("/etc/passwd") }, codes.InvalidArgument},
		{"empty path element", func(h *peerpb.PushHeader) { h.Manifest.Files = []*peerpb.File{file("a//b")} }, codes.InvalidArgument},
		{"dot element", func(h *peerpb.PushHeader) { h.Manifest.Files = []*peerpb.File{file("a/./b")} }, codes.InvalidArgument},
		{"empty file path in a tree", func(h *peerpb.PushHeader) { h.Manifest.Files = []*peerpb.File{file("")} }, codes.InvalidArgument},
		{"NUL in a path", func(h *peerpb.PushHeader) { h.Manifest.Files = []*peerpb.File{file("a\x00b")} }, codes.InvalidArgument},
		{"directory climbing out", func(h *peerpb.PushHeader) { h.Manifest.Dirs = append(h.Manifest.Dirs, []byte("a/../../x")) }, codes.InvalidArgument},
		{"path past the length cap", func(h *peerpb.PushHeader) {
			h.Manifest.Dirs = append(h.Manifest.Dirs, []byte(strings.Repeat(strings.Repeat("d", 200)+"/", maxPathLen/201+1)+"x"))
		}, codes.InvalidArgument},
		{"element past NAME_MAX", func(h *peerpb.PushHeader) {
			h.Manifest.Dirs = append(h.Manifest.Dirs, []byte(strings.Repeat("d", 256)))
		}, codes.InvalidArgument},
		{"empty symlink target", func(h *peerpb.PushHeader) {
			h.Manifest.Symlinks = append(h.Manifest.Symlinks, &peerpb.Symlink{Path: []byte("evil"), Target: []byte("")})
		}, codes.InvalidArgument},
		{"NUL in a symlink target", func(h *peerpb.PushHeader) {
			h.Manifest.Symlinks = append(h.Manifest.Symlinks, &peerpb.Symlink{Path: []byte("evil"), Target: []byte("a\x00b")})
		}, codes.InvalidArgument},
		{"file below a symlink", func(h *peerpb.PushHeader) {
			h.Manifest.Symlinks = append(h.Manifest.Symlinks, &peerpb.Symlink{Path: []byte("zz"), Target: []byte("/etc")})
			h.Manifest.Files = append(h.Manifest.Files, file("zz/passwd"))
		}, codes.InvalidArgument},
		{"directory below a symlink", func(h *peerpb.PushHeader) {
			h.Manifest.Symlinks = append(h.Manifest.Symlinks, &peerpb.Symlink{Path: []byte("zz"), Target: []byte("/etc")})
			h.Manifest.Dirs = append(h.Manifest.Dirs, []byte("zz/cron.d"))
		}, codes.InvalidArgument},
		{"symlink below a FIFO", func(h *peerpb.PushHeader) {
			h.Manifest.Specials = append(h.Manifest.Specials, &peerpb.Special{Path: []byte("zz"), Type: peerpb.SpecialType_SPECIAL_TYPE_FIFO})
			h.Manifest.Symlinks = append(h.Manifest.Symlinks, &peerpb.Symlink{Path: []byte("zz/l"), Target: []byte("x")})
		}, codes.InvalidArgument},
		{"special of unknown type", func(h *peerpb.PushHeader) {
			h.Manifest.Specials = append(h.Manifest.Specials, &peerpb.Special{Path: []byte("zz"), Type: 99})
		}, codes.InvalidArgument},
		{"special of unspecified type", func(h *peerpb.PushHeader) {
			h.Manifest.Specials = append(h.Manifest.Specials, &peerpb.Special{Path: []byte("zz")})
		}, codes.InvalidArgument},
		{"FIFO with a device number", func(h *peerpb.PushHeader) {
			h.Manifest.Specials = append(h.Manifest.Specials, &peerpb.Special{Path: []byte("zz"), Type: peerpb.SpecialType_SPECIAL_TYPE_FIFO, Rdev: 1})
		}, codes.InvalidArgument},
		{"device number past 32 bits", func(h *peerpb.PushHeader) {
			h.Manifest.Specials = append(h.Manifest.Specials, &peerpb.Special{Path: []byte("zz"), Type: peerpb.SpecialType_SPECIAL_TYPE_CHAR_DEVICE, Rdev: 1 << 32})
		}, codes.InvalidArgument},
		{"special in a single-file manifest", func(h *peerpb.PushHeader) {
			h.Manifest = &peerpb.Manifest{DataName: strings.Repeat("0", 64) + ".data", TreeHash: strings.Repeat("0", 64), Files: []*peerpb.File{file("")},
				Specials: []*peerpb.Special{{Path: []byte("p"), Type: peerpb.SpecialType_SPECIAL_TYPE_FIFO}}}
		}, codes.InvalidArgument},
		{"upper-case data name", func(h *peerpb.PushHeader) { h.Manifest.DataName = strings.ToUpper(name[:65]) + ".data" }, codes.InvalidArgument},
		{"data name with a path", func(h *peerpb.PushHeader) { h.Manifest.DataName = "../" + name }, codes.InvalidArgument},
		{"data name without .data", func(h *peerpb.PushHeader) { h.Manifest.DataName = strings.TrimSuffix(name, ".data") }, codes.InvalidArgument},
		{".meta of another job", func(h *peerpb.PushHeader) {
			h.Manifest = &peerpb.Manifest{DataName: "other-s1-n1-w0.meta", TreeHash: strings.Repeat("0", 64), Files: []*peerpb.File{file("")}}
		}, codes.InvalidArgument},
		{"files out of order", func(h *peerpb.PushHeader) {
			fs := h.Manifest.Files
			fs[0], fs[1] = fs[1], fs[0]
		}, codes.InvalidArgument},
		{"short digest", func(h *peerpb.PushHeader) { h.Manifest.Files[0].Blake3 = h.Manifest.Files[0].Blake3[:31] }, codes.InvalidArgument},
		{"attrs that do not parse", func(h *peerpb.PushHeader) { h.Manifest.Attrs = []byte("mtcfs attrs v1\ndefault 0 0 0644\n") }, codes.InvalidArgument},
		{"attrs naming a path that climbs out", func(h *peerpb.PushHeader) {
			h.Manifest.Attrs = []byte("mtcfs attrs v1\ndefault 0 0 0644 0755\n0600 0 0 \"../x\"\n")
		}, codes.InvalidArgument},
		{".meta with attrs", func(h *peerpb.PushHeader) {
			h.Manifest = &peerpb.Manifest{DataName: peerJob + "-s1-n1-w0.meta", TreeHash: strings.Repeat("0", 64), Files: []*peerpb.File{file("")},
				Attrs: []byte("mtcfs attrs v1\ndefault 0 0 0644 0755\n")}
		}, codes.InvalidArgument},
		{"negative size", func(h *peerpb.PushHeader) { h.Manifest.Files[0].Size = -1 }, codes.InvalidArgument},
		{"bad transfer id", func(h *peerpb.PushHeader) { h.TransferId = "../../x" }, codes.InvalidArgument},
		{"listing that does not hash to the name", func(h *peerpb.PushHeader) { h.Manifest.Files[0].Blake3[0] ^= 1 }, codes.DataLoss},
		{"declared size past every cap", func(h *peerpb.PushHeader) {
			h.Manifest.Files[0].Size = 1 << 40
		}, codes.DataLoss}, // the listing no longer hashes to the name: refused before the cap is looked at
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := validHeader(t, name, src)
			tc.mutate(h)
			err := raw.pushHeader(t.Context(), h, raw.creds(1))
			require.Equal(t, tc.want, status.Code(err), "%v", err)
		})
	}
	require.Empty(t, p.acceptedCalls())
	p.requireNoIncoming(t)
}

func TestChunkValidation(t *testing.T) {
	src, name := makeTree(t, rand.New(rand.NewPCG(31, 32)), 2*peerChunk)
	p := startPeer(t, func(c *ReceiverConfig) { c.IdleTimeout = 200 * time.Millisecond })
	raw := newRawPeer(t, dial(t, p.addr))
	h := validHeader(t, name, src)
	big := -1
	for i, f := range h.Manifest.Files {
		if f.Size == 2*peerChunk {
			big = i
		}
	}
	require.NotEqual(t, -1, big)
	chunk := func(off int64, n int) *peerpb.Chunk {
		data := make([]byte, n)
		return &peerpb.Chunk{File: uint32(big), Offset: off, Data: data, Crc32C: crc32.Checksum(data, castagnoli)}
	}
	badCRC := chunk(0, 10)
	badCRC.Crc32C ^= 1
	cases := []struct {
		name   string
		chunks []*peerpb.Chunk
		want   codes.Code
	}{
		{"CRC mismatch", []*peerpb.Chunk{badCRC}, codes.DataLoss},
		{"past the end of the file", []*peerpb.Chunk{chunk(2*peerChunk-5, 10)}, codes.InvalidArgument},
		{"negative offset", []*peerpb.Chunk{chunk(-1, 10)}, codes.InvalidArgument},
		{"no such file", []*peerpb.Chunk{{File: 9999, Data: []byte{1}, Crc32C: crc32.Checksum([]byte{1}, castagnoli)}}, codes.InvalidArgument},
		{"overlapping chunks", []*peerpb.Chunk{chunk(0, 100), chunk(200, 100), chunk(250, 10)}, codes.InvalidArgument},
		{"empty chunk", []*peerpb.Chunk{chunk(0, 0)}, codes.InvalidArgument},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := proto.Clone(h).(*peerpb.PushHeader)
			h.TransferId = strings.Repeat(string("0123456789abcdef"[i]), 32)
			err := raw.push(t.Context(), h, tc.chunks, raw.creds(1))
			require.Equal(t, tc.want, status.Code(err), "%v", err)
			_, err = raw.client.Commit(t.Context(), &peerpb.CommitRequest{TransferId: h.TransferId}, raw.creds(1))
			require.Equal(t, codes.NotFound, status.Code(err), "a failed stream must drop its transfer: %v", err)
		})
	}

	t.Run("commit with bytes missing", func(t *testing.T) {
		h := proto.Clone(h).(*peerpb.PushHeader)
		h.TransferId = strings.Repeat("e", 32)
		require.NoError(t, raw.push(t.Context(), h, []*peerpb.Chunk{chunk(0, 100)}, raw.creds(1)))
		_, err := raw.client.Commit(t.Context(), &peerpb.CommitRequest{TransferId: h.TransferId}, raw.creds(2))
		require.Equal(t, codes.PermissionDenied, status.Code(err), "another rank must not commit it: %v", err)
		_, err = raw.client.Commit(t.Context(), &peerpb.CommitRequest{TransferId: h.TransferId}, raw.creds(1))
		require.Equal(t, codes.FailedPrecondition, status.Code(err), "%v", err)
	})
	t.Run("abandoned by the idle timeout", func(t *testing.T) {
		h := proto.Clone(h).(*peerpb.PushHeader)
		h.TransferId = strings.Repeat("f", 32)
		require.NoError(t, raw.push(t.Context(), h, []*peerpb.Chunk{chunk(0, 100)}, raw.creds(1)))
		p.waitNoIncoming(t)
	})
	require.Empty(t, p.acceptedCalls())
	p.requireNoIncoming(t)
}

// Symlink targets are kept verbatim (absolute, dangling or leading out of the tree, as the job
// made them); only what symlink(2) cannot hold is refused.
func TestCheckSymlinkTarget(t *testing.T) {
	cases := []struct {
		target string
		ok     bool
	}{
		{"a/b/c", true},
		{"../../../outside", true},
		{"/etc/passwd", true},
		{"no/such/file", true},
		{"..", true},
		{strings.Repeat("x", maxTargetLen), true},
		{strings.Repeat("x", maxTargetLen+1), false},
		{"", false},
		{"a\x00b", false},
	}
	for _, tc := range cases {
		err := checkSymlinkTarget("l", tc.target)
		require.Equal(t, tc.ok, err == nil, "-> %.40q: %v", tc.target, err)
	}
}

// TestShare checks that the shares of every stream count cover every byte exactly once.
func TestShare(t *testing.T) {
	m := &manifest{pb: &peerpb.Manifest{}, kind: kindTree}
	for _, size := range []int64{0, 10, 0, 1, 1 << 20, 3, 0, 77777} {
		m.pb.Files = append(m.pb.Files, &peerpb.File{Size: size})
		m.total += size
	}
	for n := 1; n <= 9; n++ {
		seen := make([]int64, len(m.pb.Files))
		next := make([]int64, len(m.pb.Files))
		for i := range n {
			for _, pc := range m.share(i, n) {
				require.Equal(t, next[pc.file], pc.off, "n=%d: pieces of file %d must follow each other", n, pc.file)
				require.Positive(t, pc.n)
				next[pc.file] += pc.n
				seen[pc.file] += pc.n
			}
		}
		for i, f := range m.pb.Files {
			require.Equal(t, f.Size, seen[i], "n=%d: file %d", n, i)
		}
	}
}

func TestSinkClaim(t *testing.T) {
	var sf sinkFile
	for _, sp := range []span{{10, 20}, {30, 40}, {20, 30}, {0, 5}, {5, 10}} {
		require.NoError(t, sf.claim(sp))
	}
	require.Equal(t, []span{{0, 40}}, sf.have)
	for _, sp := range []span{{39, 41}, {0, 1}, {15, 16}, {-5, 1}} {
		require.Error(t, sf.claim(sp), "%v overlaps", sp)
	}
	require.NoError(t, sf.claim(span{40, 41}))
	require.NoError(t, sf.claim(span{50, 60}))
	require.NoError(t, sf.claim(span{45, 46}))
	require.Equal(t, []span{{0, 41}, {45, 46}, {50, 60}}, sf.have)
}

// TestLateStreamGetsTheTransfersReason: a stream that joins a transfer the receiver has dropped
// is refused with the transfer's own reason and code, not a bare Aborted. The sender returns the
// first error any of its streams gets, and a late stream's can be the first: TestDeviceNodesNeedMknod
// saw Aborted "failed already" instead of the FailedPrecondition of the tree it cannot hold
// (once in 8 runs of go test -race ./replication -count=8).
func TestLateStreamGetsTheTransfersReason(t *testing.T) {
	src, name := makeTree(t, rand.New(rand.NewPCG(61, 62)), 1000)
	p := startPeer(t, nil)
	raw := newRawPeer(t, dial(t, p.addr))
	h := validHeader(t, name, src)
	bad := &peerpb.Chunk{File: 0, Offset: 0, Data: []byte{1}, Crc32C: 12345}
	err := raw.push(t.Context(), h, []*peerpb.Chunk{bad}, raw.creds(1))
	require.Equal(t, codes.DataLoss, status.Code(err), "%v", err)
	require.EqualValues(t, 1, p.recv.CorruptChunks(), "the chunk counted (mtcfs_peer_chunks_corrupt_total)")

	err = raw.pushHeader(t.Context(), h, raw.creds(1)) // the second stream, late
	require.Equal(t, codes.DataLoss, status.Code(err), "%v", err)
	require.ErrorContains(t, err, "failed already")
	require.ErrorContains(t, err, "CRC32C")
	require.Empty(t, p.acceptedCalls())
}
