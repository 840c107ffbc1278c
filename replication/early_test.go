package replication

import (
	"context"
	"encoding/hex"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/replication/peerpb"
)

// reservations counts the bytes a receiver holds charged, as tiers.Spool.Reserve would.
type reservations struct {
	mu    sync.Mutex
	bytes int64
}

func (r *reservations) reserve(delta int64) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.bytes += delta
	return nil
}

func (r *reservations) held() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.bytes
}

// treeFiles lists the regular files of a tree: relative path → digest, and their total size.
func treeFiles(t *testing.T, root string) (map[string]layout.FileDigest, int64) {
	t.Helper()
	entries, err := layout.ListTree(root)
	require.NoError(t, err)
	require.NoError(t, layout.HashEntries(t.Context(), root, entries, nil))
	out := map[string]layout.FileDigest{}
	var total int64
	for _, e := range entries {
		if e.Type == layout.EntryFile {
			out[e.Path] = e.Digest
			total += e.Size
		}
	}
	return out, total
}

// pushEarly pushes the file rel of the tree at root as an early file of group and returns its
// digest.
func pushEarly(t *testing.T, s *Sender, conn grpc.ClientConnInterface, root, rel, group string) layout.FileDigest {
	t.Helper()
	p := filepath.Join(root, filepath.FromSlash(rel))
	hash, _, err := layout.HashData(t.Context(), p)
	require.NoError(t, err)
	req := pushReq(layout.DataName(hash, false), p)
	req.EarlyGroup = group
	require.NoError(t, s.Push(t.Context(), conn, req), "early push of %s", rel)
	b, err := hex.DecodeString(hash)
	require.NoError(t, err)
	return layout.FileDigest(b)
}

func earlyFiles(t *testing.T, p *testPeer) int {
	t.Helper()
	des, err := os.ReadDir(filepath.Join(p.incoming, earlyDirName))
	require.NoError(t, err)
	return len(des)
}

// Files pushed early are not sent again with the sealed tree: the tree arrives whole and
// verified, only the files not pushed early (or changed since) travel, and the early copies are
// released with their reservations taken over by the accepted data.
func TestEarlyPushThenConsume(t *testing.T) {
	rnd := rand.New(rand.NewPCG(3, 4))
	src, name := makeTree(t, rnd, 3*peerChunk+777)
	files, total := treeFiles(t, src)
	var res reservations
	p := startPeer(t, func(c *ReceiverConfig) { c.Reserve = res.reserve })
	conn := dial(t, p.addr)
	s := testSender(4)

	const group = "5.orbax-checkpoint-tmp-1700000000"
	presumed := map[layout.FileDigest]bool{}
	var early int64
	for rel, d := range files {
		if rel == "deep/a/b/c/d/leaf" || rel == "empty-file" {
			continue // closed too late to be pushed early; empty files are never pushed
		}
		require.Equal(t, d, pushEarly(t, s, conn, src, rel, group))
		presumed[d] = true
		info, err := os.Stat(filepath.Join(src, filepath.FromSlash(rel)))
		require.NoError(t, err)
		early += info.Size()
	}
	require.Equal(t, len(presumed), earlyFiles(t, p), "early files held aside")
	require.Empty(t, p.acceptedCalls(), "early files must not be published")
	require.Equal(t, early, res.held(), "early files stay charged while held")

	before := s.BytesSent()
	req := pushReq(name, src)
	req.ConsumesGroup, req.Presumed = group, presumed
	require.NoError(t, s.Push(t.Context(), conn, req))
	require.Equal(t, total-early, s.BytesSent()-before, "only the files not pushed early travel")
	require.Equal(t, []accepted{{peerJob, 1, name}}, p.acceptedCalls())
	requireHashesTo(t, filepath.Join(p.sealed, name), name)
	require.Equal(t, 0, earlyFiles(t, p), "the consumed group is released")
	require.Zero(t, res.held(), "the accepted tree's charge goes with it to Accept's side (the namespace charges what it imports)")
	p.requireNoIncoming(t)
}

// A presumed file the receiver no longer holds (dropped, or the receiver restarted) makes the
// push fall back to sending everything.
func TestEarlyFallbackWhenDropped(t *testing.T) {
	rnd := rand.New(rand.NewPCG(5, 6))
	src, name := makeTree(t, rnd, 2*peerChunk)
	files, total := treeFiles(t, src)
	var res reservations
	p := startPeer(t, func(c *ReceiverConfig) { c.Reserve = res.reserve })
	conn := dial(t, p.addr)
	s := testSender(2)
	const group = "7.tmp"
	presumed := map[layout.FileDigest]bool{}
	for rel := range files {
		if rel != "empty-file" {
			presumed[pushEarly(t, s, conn, src, rel, group)] = true
		}
	}
	require.NoError(t, s.Drop(t.Context(), conn, Identity{Job: peerJob, Incarnation: "inc-1", Rank: 1, Instance: s.Instance}, group))
	require.Equal(t, 0, earlyFiles(t, p), "Drop removes the group's files")
	require.Equal(t, int64(0), res.held(), "Drop refunds the group's bytes")

	before := s.BytesSent()
	req := pushReq(name, src)
	req.ConsumesGroup, req.Presumed = group, presumed
	require.NoError(t, s.Push(t.Context(), conn, req))
	require.Equal(t, total, s.BytesSent()-before, "everything is sent again")
	requireHashesTo(t, filepath.Join(p.sealed, name), name)
	require.Zero(t, res.held(), "accepted: its charge goes with it")
	p.requireNoIncoming(t)
}

// A file rewritten after its early push has another digest: it is sent with the tree, and the
// stale early copy is released without being used.
func TestEarlyFileChangedAfterPush(t *testing.T) {
	rnd := rand.New(rand.NewPCG(7, 8))
	src, _ := makeTree(t, rnd, peerChunk)
	const rel = "state/array_1/0.0"
	var res reservations
	p := startPeer(t, func(c *ReceiverConfig) { c.Reserve = res.reserve })
	conn := dial(t, p.addr)
	s := testSender(1)
	const group = "9.tmp"
	stale := pushEarly(t, s, conn, src, rel, group)
	require.NoError(t, os.WriteFile(filepath.Join(src, rel), []byte("rewritten after close"), 0o644))
	hash, _, err := layout.HashData(t.Context(), src)
	require.NoError(t, err)
	name := layout.DataName(hash, true)
	_, total := treeFiles(t, src)

	before := s.BytesSent()
	req := pushReq(name, src)
	req.ConsumesGroup, req.Presumed = group, map[layout.FileDigest]bool{stale: true}
	require.NoError(t, s.Push(t.Context(), conn, req))
	require.Equal(t, total, s.BytesSent()-before)
	requireHashesTo(t, filepath.Join(p.sealed, name), name)
	require.Equal(t, 0, earlyFiles(t, p))
	require.Zero(t, res.held(), "the unused early file is refunded, the accepted tree's charge goes with it")
}

// A call from a new incarnation of the sender drops what the old one pushed early (its steps
// were abandoned when the job restarted).
func TestEarlyGroupsOfAnEarlierIncarnationAreDropped(t *testing.T) {
	rnd := rand.New(rand.NewPCG(9, 10))
	src, _ := makeTree(t, rnd, peerChunk)
	var res reservations
	p := startPeer(t, func(c *ReceiverConfig) { c.Reserve = res.reserve })
	conn := dial(t, p.addr)
	s := testSender(1)
	pushEarly(t, s, conn, src, "state/array_1/0.0", "3.tmp")
	require.Equal(t, 1, earlyFiles(t, p))

	// Another rank's incarnation change does not touch rank 1's group.
	other := Identity{Job: peerJob, Incarnation: "inc-9", Rank: 2, Instance: "other"}
	require.NoError(t, s.Drop(t.Context(), conn, other, "unrelated"))
	require.Equal(t, 1, earlyFiles(t, p))

	next := Identity{Job: peerJob, Incarnation: "inc-2", Rank: 1, Instance: s.Instance}
	require.NoError(t, s.Drop(t.Context(), conn, next, "unrelated"))
	require.Equal(t, 0, earlyFiles(t, p))
	require.Equal(t, int64(0), res.held())
}

// Bad early pushes are refused before anything is written.
func TestEarlyPushValidation(t *testing.T) {
	rnd := rand.New(rand.NewPCG(11, 12))
	src, name := makeTree(t, rnd, peerChunk)
	p := startPeer(t, nil)
	conn := dial(t, p.addr)
	s := testSender(1)
	for _, group := range []string{"a/b", "..", string(make([]byte, 300))} {
		req := pushReq(name, src)
		req.ConsumesGroup = group
		err := s.Push(t.Context(), conn, req)
		require.Equal(t, codes.InvalidArgument, status.Code(err), "group %q: %v", group, err)
	}
	// A tree cannot be an early file.
	req := pushReq(name, src)
	req.EarlyGroup = "4.tmp"
	err := s.Push(t.Context(), conn, req)
	require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
	require.Equal(t, 0, earlyFiles(t, p))
	p.requireNoIncoming(t)

	// Presumed indices must be in range and strictly increasing.
	m := &manifest{pb: &peerpb.Manifest{DataName: name, Files: []*peerpb.File{{Path: []byte("a"), Size: 1}, {Path: []byte("b"), Size: 2}}}, total: 3}
	require.Error(t, m.presume([]uint32{1, 1}))
	require.Error(t, m.presume([]uint32{2}))
	require.NoError(t, m.presume([]uint32{0, 1}))
	require.Equal(t, int64(0), m.sendTotal)
}

// The group of a consuming push can be dropped while the push is being committed (a Drop, an
// idle expiry): the files the push took over stay charged to it, and the accepted tree is
// charged exactly once.
func TestEarlyGroupDroppedDuringConsumingPush(t *testing.T) {
	rnd := rand.New(rand.NewPCG(13, 14))
	src, name := makeTree(t, rnd, 2*peerChunk)
	files, _ := treeFiles(t, src)
	var res reservations
	var p *testPeer
	var conn grpc.ClientConnInterface
	s := testSender(2)
	const group = "8.tmp"
	dropped := false
	p = startPeer(t, func(c *ReceiverConfig) {
		c.Reserve = res.reserve
		accept := c.Accept
		c.Accept = func(ctx context.Context, job string, rank int, dataName, path string) error {
			if !dropped && strings.HasPrefix(dataName, "D") {
				dropped = true
				require.NoError(t, s.Drop(ctx, conn, Identity{Job: peerJob, Incarnation: "inc-1", Rank: 1, Instance: s.Instance}, group))
			}
			return accept(ctx, job, rank, dataName, path)
		}
	})
	conn = dial(t, p.addr)
	presumed := map[layout.FileDigest]bool{}
	for rel := range files {
		if rel != "empty-file" {
			presumed[pushEarly(t, s, conn, src, rel, group)] = true
		}
	}
	req := pushReq(name, src)
	req.ConsumesGroup, req.Presumed = group, presumed
	require.NoError(t, s.Push(t.Context(), conn, req))
	require.True(t, dropped)
	requireHashesTo(t, filepath.Join(p.sealed, name), name)
	require.Equal(t, 0, earlyFiles(t, p))
	require.Zero(t, res.held(), "every byte refunded once: the dropped group's and the accepted tree's")
}
