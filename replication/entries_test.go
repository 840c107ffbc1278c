package replication

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mtcfs/mtcfs/internal/faultproxy"
	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/replication/peerpb"
)

// Trees holding every entry type and paths longer than PATH_MAX travel intact: pushed, fetched,
// pushed early; and whatever a peer sends, the receiver writes nothing outside its directory.

// deepPath returns a path of 250-byte elements, named after c, longer than n bytes.
func deepPath(c byte, n int) string {
	var elems []string
	for l := 0; l <= n; l += 251 {
		elems = append(elems, strings.Repeat(string(c), 250))
	}
	return strings.Join(elems, "/")
}

// specialTree is a tree made with layout.Dir for these tests.
type specialTree struct {
	src, name string
	deepFile  string // a regular file whose path inside the tree is > 4200 bytes
	devices   bool   // it holds device nodes
}

// makeSpecialTree makes a tree with FIFOs, a socket, symlinks (relative, dangling, absolute,
// leading out of the tree), empty directories, and files, a FIFO and a symlink at paths longer
// than 4200 bytes; with devices, also a character and a block device node (root only).
func makeSpecialTree(t *testing.T, rnd *rand.Rand, devices bool) specialTree {
	t.Helper()
	src := filepath.Join(t.TempDir(), "tree")
	require.NoError(t, os.Mkdir(src, 0o755))
	d, err := layout.OpenDir(src)
	require.NoError(t, err)
	defer d.Close()
	deep := "state/" + deepPath('q', 4200)
	write := func(rel string, size int) {
		require.NoError(t, d.MkdirAll(path.Dir(rel), 0o755))
		f, err := d.Open(rel, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
		require.NoError(t, err)
		data := make([]byte, size)
		for i := range data {
			data[i] = byte(rnd.Uint32())
		}
		_, err = f.Write(data)
		require.NoError(t, err)
		require.NoError(t, f.Close())
	}
	create := func(e layout.TreeEntry) {
		require.NoError(t, d.MkdirAll(path.Dir(e.Path), 0o755))
		require.NoError(t, d.Create(e, 0o644), "create %v %.60q", e.Type, e.Path)
	}
	write("_CHECKPOINT_METADATA", 300)
	write(deep+"/shard", 2*peerChunk+123)
	write(deep+"/empty", 0)
	write("state/small", 10)
	create(layout.TreeEntry{Path: "pipes/fifo", Type: layout.EntryFIFO})
	create(layout.TreeEntry{Path: "pipes/socket", Type: layout.EntrySocket})
	create(layout.TreeEntry{Path: deep + "/fifo", Type: layout.EntryFIFO})
	create(layout.TreeEntry{Path: "links/relative", Type: layout.EntrySymlink, Target: "../_CHECKPOINT_METADATA"})
	create(layout.TreeEntry{Path: "links/dangling", Type: layout.EntrySymlink, Target: "no/such/file"})
	create(layout.TreeEntry{Path: "links/absolute", Type: layout.EntrySymlink, Target: "/etc/passwd"})
	create(layout.TreeEntry{Path: "links/out", Type: layout.EntrySymlink, Target: "../../../outside"})
	create(layout.TreeEntry{Path: deep + "/up", Type: layout.EntrySymlink, Target: "../../.."})
	create(layout.TreeEntry{Path: "empty-dir", Type: layout.EntryDir})
	create(layout.TreeEntry{Path: deep + "/empty-dir", Type: layout.EntryDir})
	if devices {
		create(layout.TreeEntry{Path: "dev/char", Type: layout.EntryCharDev, Rdev: unix.Mkdev(1, 3)})
		create(layout.TreeEntry{Path: "dev/block", Type: layout.EntryBlockDev, Rdev: unix.Mkdev(7, 200)})
	}
	hash, err := layout.HashDir(t.Context(), src)
	require.NoError(t, err)
	return specialTree{src: src, name: layout.DataName(hash, true), deepFile: deep + "/shard", devices: devices}
}

// canMknod reports whether this process may create device nodes.
func canMknod(t *testing.T) bool {
	p := filepath.Join(t.TempDir(), "probe")
	if err := unix.Mknod(p, unix.S_IFCHR|0o600, int(unix.Mkdev(1, 3))); err != nil {
		return false
	}
	os.Remove(p)
	return true
}

// listed is a tree's listing with file digests, in path order.
func listed(t *testing.T, root string) []layout.TreeEntry {
	t.Helper()
	d, err := layout.OpenDir(root)
	require.NoError(t, err)
	defer d.Close()
	entries, err := d.List()
	require.NoError(t, err)
	require.NoError(t, d.HashEntries(t.Context(), entries, nil))
	slices.SortFunc(entries, func(a, b layout.TreeEntry) int { return cmp.Compare(a.Path, b.Path) })
	return entries
}

// requireSameTree checks that got holds exactly want's entries (types, sizes, bytes, targets,
// device numbers) and that both hash (layout.HashDir) to name.
func requireSameTree(t *testing.T, want, got, name string) {
	t.Helper()
	we, ge := listed(t, want), listed(t, got)
	require.Equal(t, len(we), len(ge), "entry count")
	for i := range we {
		require.Equal(t, we[i], ge[i], "entry %d (%.80q)", i, we[i].Path)
	}
	for _, dir := range []string{want, got} {
		hash, err := layout.HashDir(t.Context(), dir)
		require.NoError(t, err)
		require.Equal(t, name, layout.DataName(hash, true), "%s", dir)
	}
}

// requireEntryTypes checks that the tree at root holds an entry of every type it should.
func requireEntryTypes(t *testing.T, tr specialTree, root string) {
	t.Helper()
	seen := map[layout.EntryType]int{}
	var deepFile bool
	for _, e := range listed(t, root) {
		seen[e.Type]++
		deepFile = deepFile || (e.Path == tr.deepFile && e.Type == layout.EntryFile && e.Size > 0)
	}
	require.True(t, deepFile, "the %d-byte path is missing", len(tr.deepFile))
	require.Greater(t, len(tr.deepFile), 4200)
	want := []layout.EntryType{layout.EntryFile, layout.EntryDir, layout.EntrySymlink, layout.EntryFIFO, layout.EntrySocket}
	if tr.devices {
		want = append(want, layout.EntryCharDev, layout.EntryBlockDev)
	}
	for _, typ := range want {
		require.Positive(t, seen[typ], "no %v in %s", typ, root)
	}
}

func TestPushAndFetchEveryEntryType(t *testing.T) {
	devices := canMknod(t)
	if !devices {
		t.Log("this process cannot mknod device nodes: the tree holds none (TestDeviceNodesNeedMknod covers that case)")
	}
	tr := makeSpecialTree(t, rand.New(rand.NewPCG(41, 42)), devices)
	requireEntryTypes(t, tr, tr.src)
	p := startPeer(t, nil)
	conn := dial(t, p.addr)
	for _, streams := range []int{1, 4} {
		t.Run(fmt.Sprintf("push/%d streams", streams), func(t *testing.T) {
			require.NoError(t, testSender(streams).Push(t.Context(), conn, pushReq(tr.name, tr.src)))
			replica := filepath.Join(p.sealed, tr.name)
			requireSameTree(t, tr.src, replica, tr.name)
			requireEntryTypes(t, tr, replica)
			require.NoError(t, os.RemoveAll(replica)) // room for the next push
		})
	}
	require.Len(t, p.acceptedCalls(), 2)

	t.Run("push over a link that flips bits", func(t *testing.T) {
		fp := newFaultProxy(t, p.addr)
		fp.Set(faultproxy.Up, faultproxy.Faults{FlipEvery: 20_000})
		err := testSender(2).Push(t.Context(), dial(t, fp.Addr()), pushReq(tr.name, tr.src))
		require.NotZero(t, fp.Flips(faultproxy.Up), "the proxy flipped nothing")
		require.Error(t, err, "%d bits flipped, yet the push succeeded", fp.Flips(faultproxy.Up))
		require.Len(t, p.acceptedCalls(), 2, "Accept was called for damaged data")
	})

	// The peer holds the tree; a node restoring fetches it back.
	require.NoError(t, testSender(2).Push(t.Context(), conn, pushReq(tr.name, tr.src)))
	for _, streams := range []int{1, 3} {
		t.Run(fmt.Sprintf("fetch/%d streams", streams), func(t *testing.T) {
			dst := t.TempDir()
			require.NoError(t, testSender(streams).Fetch(t.Context(), conn,
				FetchRequest{Job: peerJob, Incarnation: "inc-1", Rank: 2, DataName: tr.name, Dir: dst}))
			requireSameTree(t, tr.src, filepath.Join(dst, tr.name), tr.name)
			requireEntryTypes(t, tr, filepath.Join(dst, tr.name))
			des, err := os.ReadDir(dst)
			require.NoError(t, err)
			require.Len(t, des, 1, "only the fetched data may be left in the directory")
		})
	}
	p.requireNoIncoming(t)
}

// An early file that lives at a path longer than PATH_MAX in its tree is adopted by the push
// that consumes its group, and only the other files travel.
func TestEarlyFileAtLongPath(t *testing.T) {
	tr := makeSpecialTree(t, rand.New(rand.NewPCG(43, 44)), false)
	p := startPeer(t, nil)
	conn := dial(t, p.addr)
	s := testSender(2)

	// The agent pushes early from the spool's flat copy of the file, whatever its path in the step.
	spoolFile := filepath.Join(t.TempDir(), "spool-file-1")
	d, err := layout.OpenDir(tr.src)
	require.NoError(t, err)
	f, err := d.Open(tr.deepFile, os.O_RDONLY, 0)
	require.NoError(t, err)
	data, err := io.ReadAll(f)
	f.Close()
	d.Close()
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(spoolFile, data, 0o644))
	const group = "7.orbax-checkpoint-tmp-1700000000"
	digest := pushEarly(t, s, conn, filepath.Dir(spoolFile), filepath.Base(spoolFile), group)
	require.Equal(t, 1, earlyFiles(t, p))

	_, total := treeFiles(t, tr.src)
	before := s.BytesSent()
	req := pushReq(tr.name, tr.src)
	req.ConsumesGroup, req.Presumed = group, map[layout.FileDigest]bool{digest: true}
	require.NoError(t, s.Push(t.Context(), conn, req))
	require.Equal(t, total-int64(len(data)), s.BytesSent()-before, "the early file must not travel again")
	requireSameTree(t, tr.src, filepath.Join(p.sealed, tr.name), tr.name)
	p.requireNoIncoming(t)
}

// A peer cannot make the receiver write outside its incoming directory: not with a symlink to
// somewhere else followed by entries below it (refused before anything is written), and not
// even if such a manifest got past the checks (the sink never follows a symlink).
func TestReceiverWritesNothingOutside(t *testing.T) {
	outside := t.TempDir()
	file := func(p string) *peerpb.File { return &peerpb.File{Path: []byte(p), Size: 1, Blake3: make([]byte, 32)} }
	link := func(p string) *peerpb.Symlink { return &peerpb.Symlink{Path: []byte(p), Target: []byte(outside)} }
	manifests := map[string]*peerpb.Manifest{
		"file below a symlink":      {Symlinks: []*peerpb.Symlink{link("a")}, Files: []*peerpb.File{file("a/x")}},
		"empty file below":          {Symlinks: []*peerpb.Symlink{link("a")}, Files: []*peerpb.File{{Path: []byte("a/x"), Blake3: make([]byte, 32)}}},
		"directory below":           {Symlinks: []*peerpb.Symlink{link("a")}, Dirs: [][]byte{[]byte("a/d")}},
		"symlink below":             {Symlinks: []*peerpb.Symlink{link("a"), {Path: []byte("a/l"), Target: []byte("x")}}},
		"FIFO below":                {Symlinks: []*peerpb.Symlink{link("a")}, Specials: []*peerpb.Special{{Path: []byte("a/p"), Type: peerpb.SpecialType_SPECIAL_TYPE_FIFO}}},
		"deep below":                {Symlinks: []*peerpb.Symlink{link("a")}, Files: []*peerpb.File{file("a/b/c/x")}},
		"symlink in a deep parent":  {Symlinks: []*peerpb.Symlink{link("d/a")}, Files: []*peerpb.File{file("d/a/x")}},
		"file below a file":         {Files: []*peerpb.File{file("a"), file("a/x")}},
		"long path below a symlink": {Symlinks: []*peerpb.Symlink{link("a")}, Files: []*peerpb.File{file("a/" + deepPath('z', 4200))}},
	}
	anyName := "D" + strings.Repeat("0", 64) + ".data"

	t.Run("over the wire", func(t *testing.T) {
		p := startPeer(t, nil)
		raw := newRawPeer(t, dial(t, p.addr))
		for what, m := range manifests {
			m := &peerpb.Manifest{DataName: anyName, TreeHash: strings.Repeat("0", 64), Files: m.Files, Dirs: m.Dirs,
				Symlinks: m.Symlinks, Specials: m.Specials}
			h := &peerpb.PushHeader{TransferId: strings.Repeat("ab", 16), Job: peerJob, Incarnation: "inc-1", SenderRank: 1,
				SenderInstance: "instance-1", Manifest: m}
			err := raw.pushHeader(t.Context(), h, raw.creds(1))
			require.Equal(t, codes.InvalidArgument, status.Code(err), "%s: %v", what, err)
		}
		requireEmptyDir(t, outside)
		require.Empty(t, p.acceptedCalls())
		p.requireNoIncoming(t)
	})

	// The sink on its own, given manifests that bypassed checkManifest.
	t.Run("sink", func(t *testing.T) {
		incoming := t.TempDir()
		for what, pb := range manifests {
			pb.DataName = anyName
			m := &manifest{pb: pb, kind: kindTree}
			for _, f := range pb.Files {
				m.total += f.Size
			}
			s, err := newSink(incoming, incomingPrefix, m)
			if err == nil {
				s.discard(errors.New("test"))
			}
			require.Error(t, err, "%s: the sink built a tree with an entry below a non-directory", what)
			require.True(t, errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR),
				"%s: want the symlink (ELOOP) or file (ENOTDIR) refused as a parent: %v", what, err)
			requireEmptyDir(t, outside)
			requireEmptyDir(t, incoming)
		}
	})
}

// deviceChildEnv makes the test binary run TestDeviceNodesNeedMknod's child side: the tree it
// names is pushed and fetched by a process that cannot mknod.
const deviceChildEnv = "MTCFS_TEST_DEVICE_TREE"

// A receiver (or fetcher) that cannot create device nodes refuses a tree holding one with a
// clear FailedPrecondition before any byte moves, and keeps nothing; FIFOs and sockets need no
// privilege and still go through. The receiver runs in a user namespace, where mknod of a
// device fails even for its root.
func TestDeviceNodesNeedMknod(t *testing.T) {
	if src := os.Getenv(deviceChildEnv); src != "" {
		deviceChild(t, src)
		return
	}
	if !canMknod(t) {
		t.Skip("making a tree with device nodes needs CAP_MKNOD")
	}
	tr := makeSpecialTree(t, rand.New(rand.NewPCG(45, 46)), true)
	cmd := exec.Command(os.Args[0], "-test.run=^TestDeviceNodesNeedMknod$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), deviceChildEnv+"="+tr.src+"\n"+tr.name)
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWUSER,
		UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getuid(), Size: 1}},
		GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getgid(), Size: 1}}}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	if errors.Is(err, syscall.EPERM) || errors.Is(err, syscall.EINVAL) || errors.Is(err, syscall.ENOSPC) {
		t.Skipf("no user namespace for the child: %v", err)
	}
	t.Logf("child:\n%s", out.String())
	require.NoError(t, err)
	require.Contains(t, out.String(), "--- PASS: TestDeviceNodesNeedMknod")
	require.Contains(t, out.String(), "device-child: checked")
}

func deviceChild(t *testing.T, env string) {
	src, name, _ := strings.Cut(env, "\n")
	require.False(t, canMknod(t), "the child was meant to run without CAP_MKNOD")
	p := startPeer(t, nil)
	conn := dial(t, p.addr)

	err := testSender(2).Push(t.Context(), conn, pushReq(name, src))
	require.Equal(t, codes.FailedPrecondition, status.Code(err), "%v", err)
	require.ErrorContains(t, err, "CAP_MKNOD")
	require.Empty(t, p.acceptedCalls())
	t.Logf("push refused: %v", err)

	// A fetcher without the privilege refuses the same tree served by a peer.
	served := startPeer(t, nil)
	require.NoError(t, os.Symlink(src, filepath.Join(served.sealed, name)))
	dst := t.TempDir()
	err = testSender(2).Fetch(t.Context(), dial(t, served.addr), FetchRequest{Job: peerJob, Incarnation: "inc-1", DataName: name, Dir: dst})
	require.Equal(t, codes.FailedPrecondition, status.Code(err), "%v", err)
	require.ErrorContains(t, err, "CAP_MKNOD")
	requireEmptyDir(t, dst)
	t.Logf("fetch refused: %v", err)

	// FIFOs and sockets need no privilege.
	tr := makeSpecialTree(t, rand.New(rand.NewPCG(47, 48)), false)
	require.NoError(t, testSender(2).Push(t.Context(), conn, pushReq(tr.name, tr.src)))
	requireSameTree(t, tr.src, filepath.Join(p.sealed, tr.name), tr.name)
	p.requireNoIncoming(t)
	t.Log("device-child: checked")
}

// attrsToSend sends the owners and modes kept beside the data as they are, and leaves them out
// (with a warning) when they do not parse or would not fit in the header beside the manifest.
func TestAttrsToSend(t *testing.T) {
	src := filepath.Join(t.TempDir(), "D.data")
	assert.Nil(t, attrsToSend(src, 100), "none kept")
	a := layout.NewAttrsBuilder(layout.Attr{Mode: 0o700, UID: 1000, GID: 1000}, true).Attrs()
	require.NoError(t, layout.WriteAttrs(src, a))
	assert.Equal(t, a.Encode(), attrsToSend(src, 100))
	assert.Nil(t, attrsToSend(src, maxMessage-messageOverhead), "no room beside the manifest")
	require.NoError(t, os.WriteFile(layout.AttrsFile(src), []byte("not attrs"), 0o600))
	assert.Nil(t, attrsToSend(src, 100), "kept attrs that do not parse")
}
