package layout

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"hash"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"lukechampine.com/blake3"
)

// setSegmentSize shrinks the hashing segment for one test.
func setSegmentSize(t testing.TB, n int64) {
	old := segmentSize
	segmentSize = n
	t.Cleanup(func() { segmentSize = old })
}

func randomBytes(seed uint64, n int64) []byte {
	b := make([]byte, n)
	rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8)}).Read(b)
	return b
}

// blake3Vectors are the default-length (32-byte) hashes of the official BLAKE3 test vectors
// (test_vectors/test_vectors.json of github.com/BLAKE3-team/BLAKE3): input_len bytes of the
// repeating sequence 0, 1, …, 250.
var blake3Vectors = []struct {
	n    int
	hash string
}{
	{0, "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"},
	{1, "2d3adedff11b61f14c886e35afa036736dcd87a74d27b5c1510225d0f592e213"},
	{1023, "10108970eeda3eb932baac1428c7a2163b0e924c9a9e25b35bba72b28f70bd11"},
	{1024, "42214739f095a406f3fc83deb889744ac00df831c10daa55189b5d121c855af7"},
	{1025, "d00278ae47eb27b34faecf67b4fe263f82d5412916c1ffd97c8cb7fb814b8444"},
	{2048, "e776b6028c7cd22a4d0ba182a8bf62205d2ef576467e838ed6f2529b85fba24a"},
	{2049, "5f4d72f40d7a5f82b15ca2b2e44b1de3c2ef86c426c95c1af0b6879522563030"},
	{3072, "b98cb0ff3623be03326b373de6b9095218513e64f1ee2edd2525c7ad1e5cffd2"},
	{3073, "7124b49501012f81cc7f11ca069ec9226cecb8a2c850cfe644e327d22d3e1cd3"},
	{4096, "015094013f57a5277b59d8475c0501042c0b642e531b0a1c8f58d2163229e969"},
	{4097, "9b4052b38f1c5fc8b1f9ff7ac7b27cd242487b3d890d15c96a1c25b8aa0fb995"},
	{5120, "9cadc15fed8b5d854562b26a9536d9707cadeda9b143978f319ab34230535833"},
	{5121, "628bd2cb2004694adaab7bbd778a25df25c47b9d4155a55f8fbd79f2fe154cff"},
	{6144, "3e2e5b74e048f3add6d21faab3f83aa44d3b2278afb83b80b3c35164ebeca205"},
	{6145, "f1323a8631446cc50536a9f705ee5cb619424d46887f3c376c695b70e0f0507f"},
	{7168, "61da957ec2499a95d6b8023e2b0e604ec7f6b50e80a9678b89d2628e99ada77a"},
	{7169, "a003fc7a51754a9b3c7fae0367ab3d782dccf28855a03d435f8cfe74605e7817"},
	{8192, "aae792484c8efe4f19e2ca7d371d8c467ffb10748d8a5a1ae579948f718a2a63"},
	{8193, "bab6c09cb8ce8cf459261398d2e7aef35700bf488116ceb94a36d0f5f1b7bc3b"},
	{16384, "f875d6646de28985646f34ee13be9a576fd515f76b5b0a26bb324735041ddde4"},
	{31744, "62b6960e1a44bcc1eb1a611a8d6235b6b4b78f32e7abc4fb4c6cdcce94895c47"},
	{102400, "bc3e3d41a1146b069abffad3c0d44860cf664390afce4d9661f7902e7943e085"},
}

// HashFile must be plain BLAKE3 of the bytes, whatever the segment size: the
// name of a single-file checkpoint is `b3sum` of it. The official test
// vectors pin it down for inputs up to 100 KiB, cut into segments of 1 KiB
// and up (so that they take several segments, SIMD groups and a partial last
// chunk); sizes around the read buffer and larger segments, which no vector
// reaches, are compared with the library's own streaming hasher, which the
// vectors check too.
func TestHashFileIsBLAKE3(t *testing.T) {
	const k = 1 << 10
	for _, seg := range []int64{1 * k, 2 * k, 4 * k, 16 * k, 64 * k, 1 << 20} {
		setSegmentSize(t, seg)
		for _, v := range blake3Vectors {
			data := make([]byte, v.n)
			for i := range data {
				data[i] = byte(i % 251)
			}
			got, err := HashFile(t.Context(), bytes.NewReader(data), int64(v.n))
			if err != nil {
				t.Fatalf("segment %d, vector %d: %v", seg, v.n, err)
			}
			if got.String() != v.hash {
				t.Errorf("segment %d, test vector of %d bytes: HashFile = %v, want %s", seg, v.n, got, v.hash)
			}
			if lib := FileDigest(blake3.Sum256(data)); lib.String() != v.hash {
				t.Fatalf("test vector of %d bytes: blake3.Sum256 = %v, want %s", v.n, lib, v.hash)
			}
		}
		sizes := []int64{seg - 1, seg, seg + 1, 2 * seg, 3*seg + 5, 5*simdGroup + 3*k + 7,
			hashBufSize - 1, hashBufSize, hashBufSize + 1, 2*hashBufSize + k,
			// small files, hashed in one vector pass: every chunk count up to 16
			k + 1, 2 * k, 3*k - 1, 4 * k, 5*k + 1, 7*k + 512, 8 * k, 9*k + 1, 11 * k, 13*k - 1,
			15*k + 3, simdGroup - 1, simdGroup}
		for _, size := range sizes {
			data := randomBytes(uint64(size), size)
			got, err := HashFile(t.Context(), bytes.NewReader(data), size)
			if err != nil {
				t.Fatalf("segment %d, size %d: %v", seg, size, err)
			}
			if want := blake3.Sum256(data); got != FileDigest(want) {
				t.Errorf("segment %d, size %d: HashFile = %v, want BLAKE3 %x", seg, size, got, want)
			}
		}
	}
}

func TestHashFileKnownAnswer(t *testing.T) {
	d, err := HashFile(t.Context(), strings.NewReader(""), 0)
	if err != nil {
		t.Fatal(err)
	}
	// BLAKE3 of the empty input, from the BLAKE3 specification.
	if want := "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"; d.String() != want {
		t.Errorf("HashFile(empty) = %v, want %s", d, want)
	}
}

func TestHashFileErrors(t *testing.T) {
	setSegmentSize(t, 4<<10)
	data := randomBytes(1, 20<<10)
	if _, err := HashFile(t.Context(), bytes.NewReader(data), int64(len(data))+1); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Errorf("file shorter than size: err = %v, want io.ErrUnexpectedEOF", err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if _, err := HashFile(ctx, bytes.NewReader(data), int64(len(data))); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled context: err = %v, want context.Canceled", err)
	}
	if _, err := HashFile(t.Context(), bytes.NewReader(data), -1); err == nil {
		t.Error("negative size: no error")
	}
}

// treeNode is one entry to create on disk: a file with content, a directory
// (dir), or a symlink (target).
type treeNode struct {
	path, content, target string
	dir                   bool
}

func makeTree(t *testing.T, nodes []treeNode) string {
	t.Helper()
	root := t.TempDir()
	for _, n := range nodes {
		p := filepath.Join(root, filepath.FromSlash(n.path))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		var err error
		switch {
		case n.dir:
			err = os.MkdirAll(p, 0o755)
		case n.target != "":
			err = os.Symlink(n.target, p)
		default:
			err = os.WriteFile(p, []byte(n.content), 0o644)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	return root
}

func hashDir(t *testing.T, dir string) string {
	t.Helper()
	h, err := HashDir(t.Context(), dir)
	if err != nil {
		t.Fatalf("HashDir: %v", err)
	}
	if len(h) != 64 || strings.Trim(h, "0123456789abcdef") != "" {
		t.Fatalf("HashDir = %q, want 64 lower-case hex digits", h)
	}
	return h
}

func TestHashDirContent(t *testing.T) {
	base := []treeNode{
		{path: "_CHECKPOINT_METADATA", content: `{"step": 7}`},
		{path: "state/array_0", content: "0123456789"},
		{path: "state/array_1", content: ""},
		{path: "state/latest", target: "array_0"},
		{path: "process_metadata/empty", dir: true},
	}
	reversed := make([]treeNode, len(base))
	for i, n := range base {
		reversed[len(base)-1-i] = n
	}
	with := func(change func([]treeNode) []treeNode) []treeNode {
		return change(append([]treeNode(nil), base...))
	}
	same := []struct {
		name  string
		nodes []treeNode
		after func(t *testing.T, root string) // changes that must not count
	}{
		{name: "created in reverse order", nodes: reversed},
		{name: "modes and times differ", nodes: base, after: func(t *testing.T, root string) {
			for _, p := range []string{"state/array_0", "state", "process_metadata/empty"} {
				if err := os.Chmod(filepath.Join(root, p), 0o700); err != nil {
					t.Fatal(err)
				}
				old := time.Date(2001, 2, 3, 4, 5, 6, 0, time.UTC)
				if err := os.Chtimes(filepath.Join(root, p), old, old); err != nil {
					t.Fatal(err)
				}
			}
		}},
	}
	differ := []struct {
		name  string
		nodes []treeNode
	}{
		{"extra empty dir", with(func(n []treeNode) []treeNode { return append(n, treeNode{path: "state/x", dir: true}) })},
		{"symlink target changed", with(func(n []treeNode) []treeNode { n[3].target = "array_1"; return n })},
		{"symlink instead of file", with(func(n []treeNode) []treeNode { n[1] = treeNode{path: n[1].path, target: "0123456789"}; return n })},
		{"one byte flipped", with(func(n []treeNode) []treeNode { n[1].content = "0123456788"; return n })},
		{"byte appended", with(func(n []treeNode) []treeNode { n[1].content += "\x00"; return n })},
		{"file renamed", with(func(n []treeNode) []treeNode { n[1].path = "state/array_9"; return n })},
		{"file moved to another dir", with(func(n []treeNode) []treeNode { n[1].path = "process_metadata/array_0"; return n })},
		{"empty file removed", with(func(n []treeNode) []treeNode { return append(n[:2], n[3:]...) })},
		{"empty dir became empty file", with(func(n []treeNode) []treeNode { n[4] = treeNode{path: n[4].path}; return n })},
		{"bytes moved between files", with(func(n []treeNode) []treeNode { n[1].content, n[2].content = "01234", "56789"; return n })},
	}

	want := hashDir(t, makeTree(t, base))
	for _, c := range same {
		root := makeTree(t, c.nodes)
		if c.after != nil {
			c.after(t, root)
		}
		if got := hashDir(t, root); got != want {
			t.Errorf("%s: hash %s, want the base tree's %s", c.name, got, want)
		}
	}
	seen := map[string]string{want: "base tree"}
	for _, c := range differ {
		got := hashDir(t, makeTree(t, c.nodes))
		if other, dup := seen[got]; dup {
			t.Errorf("%s: hash %s equals that of %s", c.name, got, other)
		}
		seen[got] = c.name
	}
}

func TestTreeHash(t *testing.T) {
	d := FileDigest{1}
	entries := []TreeEntry{
		{Path: "a", Type: EntryDir},
		{Path: "a/b", Type: EntryFile, Size: 3, Digest: d},
		{Path: "a/c", Type: EntrySymlink, Target: "b"},
		{Path: "z", Type: EntryDir},
	}
	want, err := TreeHash(entries)
	if err != nil {
		t.Fatal(err)
	}
	// The listing format is part of every checkpoint's name: it must never
	// change by accident (replicas, backups and restarts compare names). The
	// value was computed apart from this code, by writing the listing as the
	// format in tree.go describes it and hashing it with another BLAKE3
	// implementation.
	if golden := "d2b25a0c41b4a89df8d470d369a44b65c297936a46b39647f8a99ca9bccbf52a"; want != golden {
		t.Errorf("TreeHash = %s, want %s: the listing format changed; old names would no longer verify", want, golden)
	}
	equal := map[string][]TreeEntry{
		"reversed":              {entries[3], entries[2], entries[1], entries[0]},
		"parent dir implied":    {entries[1], entries[2], entries[3]},
		"unused fields ignored": {{Path: "a", Type: EntryDir, Size: 9, Target: "x"}, entries[1], {Path: "a/c", Type: EntrySymlink, Target: "b", Digest: d}, entries[3]},
	}
	for name, es := range equal {
		if got, err := TreeHash(es); err != nil || got != want {
			t.Errorf("%s: TreeHash = %s, %v; want %s", name, got, err, want)
		}
	}
	differ := map[string][]TreeEntry{
		"size":            {entries[0], {Path: "a/b", Type: EntryFile, Size: 4, Digest: d}, entries[2], entries[3]},
		"digest":          {entries[0], {Path: "a/b", Type: EntryFile, Size: 3}, entries[2], entries[3]},
		"target":          {entries[0], entries[1], {Path: "a/c", Type: EntrySymlink, Target: "bb"}, entries[3]},
		"empty dir gone":  entries[:3],
		"path boundaries": {entries[0], {Path: "a/b", Type: EntryFile, Size: 3, Digest: d}, {Path: "a/cz", Type: EntrySymlink, Target: "b"}},
	}
	for name, es := range differ {
		if got, err := TreeHash(es); err != nil || got == want {
			t.Errorf("%s changed: TreeHash = %s, %v; want a hash other than %s", name, got, err, want)
		}
	}
	empty, err := TreeHash(nil)
	if err != nil || empty == want || len(empty) != 64 {
		t.Errorf("TreeHash(nil) = %q, %v", empty, err)
	}
}

func TestTreeHashRejects(t *testing.T) {
	file := TreeEntry{Path: "f", Type: EntryFile}
	cases := map[string][]TreeEntry{
		"empty path":         {{Path: "", Type: EntryDir}},
		"dot":                {{Path: ".", Type: EntryDir}},
		"dot dot":            {{Path: "a/../b", Type: EntryFile}},
		"absolute":           {{Path: "/a", Type: EntryFile}},
		"trailing slash":     {{Path: "a/", Type: EntryDir}},
		"double slash":       {{Path: "a//b", Type: EntryFile}},
		"duplicate":          {file, file},
		"file and dir":       {file, {Path: "f", Type: EntryDir}},
		"below a file":       {file, {Path: "f/x", Type: EntryFile}},
		"below a symlink":    {{Path: "l", Type: EntrySymlink, Target: "d"}, {Path: "l/x/y", Type: EntryFile}},
		"unknown type":       {{Path: "x", Type: 0}},
		"negative size":      {{Path: "x", Type: EntryFile, Size: -1}},
		"empty link target":  {{Path: "x", Type: EntrySymlink}},
		"deep below a file":  {{Path: "a/b/c", Type: EntryFile}, {Path: "a", Type: EntryFile}},
		"parent after child": {{Path: "a/b", Type: EntryDir}, {Path: "a/b/c", Type: EntryFile}, {Path: "a", Type: EntrySymlink, Target: "t"}},
		"NUL":                {{Path: "a\x00b", Type: EntryFile}},
	}
	for name, es := range cases {
		if h, err := TreeHash(es); err == nil {
			t.Errorf("%s: TreeHash = %s, want an error", name, h)
		}
	}
}

// A Linux name is bytes: one that is not UTF-8 (Latin-1 "café") is part of a tree like any
// other. io/fs.ValidPath refused it, and the seal of a step holding one failed.
func TestTreeHashTakesNamesThatAreNotUTF8(t *testing.T) {
	for _, p := range []string{"caf\xe9", "\xff/\xfe\x80", "a/b\xc3"} {
		assert.True(t, ValidPath(p), "%q", p)
		h, err := TreeHash([]TreeEntry{{Path: p, Type: EntryFile}, {Path: "l", Type: EntrySymlink, Target: "\xe9"}})
		require.NoError(t, err, "%q", p)
		assert.Len(t, h, 64)
	}
	for _, p := range []string{"", ".", "..", "a/", "/a", "a//b", "a/./b", "a\x00"} {
		assert.False(t, ValidPath(p), "%q", p)
	}
	a, _ := TreeHash([]TreeEntry{{Path: "caf\xe9", Type: EntryFile}})
	b, _ := TreeHash([]TreeEntry{{Path: "café", Type: EntryFile}})
	assert.NotEqual(t, a, b, "the bytes are the name")
}

// HashDir must equal TreeHash over entries built from HashFile: the FUSE
// layer builds its entries that way from files hashed at close.
func TestHashDirMatchesTreeHash(t *testing.T) {
	setSegmentSize(t, 16<<10)
	big := string(randomBytes(2, 3*16<<10+100))
	root := makeTree(t, []treeNode{
		{path: "big", content: big},
		{path: "d/small", content: "x"},
		{path: "d/e/empty", content: ""},
		{path: "d/link", target: "../big"},
		{path: "f/g", dir: true},
	})
	var entries []TreeEntry
	for _, n := range []struct {
		path, content string
	}{{"big", big}, {"d/small", "x"}, {"d/e/empty", ""}} {
		d, err := HashFile(t.Context(), strings.NewReader(n.content), int64(len(n.content)))
		if err != nil {
			t.Fatal(err)
		}
		entries = append(entries, TreeEntry{Path: n.path, Type: EntryFile, Size: int64(len(n.content)), Digest: d})
	}
	entries = append(entries, TreeEntry{Path: "d/link", Type: EntrySymlink, Target: "../big"}, TreeEntry{Path: "f/g", Type: EntryDir})
	want, err := TreeHash(entries)
	if err != nil {
		t.Fatal(err)
	}
	if got := hashDir(t, root); got != want {
		t.Errorf("HashDir = %s, TreeHash of HashFile entries = %s", got, want)
	}
}

// Special files are part of a tree: listed with their type (and a device's number) and
// counted by the hash, so a tree that gains or loses one gets another name.
func TestHashDirCountsSpecialFiles(t *testing.T) {
	root := makeTree(t, []treeNode{{path: "a", content: "x"}})
	before := hashDir(t, root)
	if err := syscall.Mkfifo(filepath.Join(root, "fifo"), 0o644); err != nil {
		t.Skipf("mkfifo: %v", err)
	}
	if err := syscall.Mknod(filepath.Join(root, "sock"), syscall.S_IFSOCK|0o600, 0); err != nil {
		t.Fatalf("mknod socket: %v", err)
	}
	entries, err := ListTree(root)
	if err != nil {
		t.Fatal(err)
	}
	types := map[string]EntryType{}
	for _, e := range entries {
		types[e.Path] = e.Type
	}
	if types["fifo"] != EntryFIFO || types["sock"] != EntrySocket || types["a"] != EntryFile {
		t.Fatalf("ListTree types = %v", types)
	}
	withSpecials := hashDir(t, root)
	if withSpecials == before {
		t.Fatalf("adding a FIFO and a socket did not change the hash")
	}
	want, err := TreeHash([]TreeEntry{{Path: "a", Type: EntryFile, Size: 1, Digest: FileDigest(blake3.Sum256([]byte("x")))},
		{Path: "fifo", Type: EntryFIFO}, {Path: "sock", Type: EntrySocket}})
	if err != nil || want != withSpecials {
		t.Fatalf("TreeHash of the listing = %s, %v; HashDir = %s", want, err, withSpecials)
	}
	// Device numbers count.
	c1, _ := TreeHash([]TreeEntry{{Path: "d", Type: EntryCharDev, Rdev: 0x0102}})
	c2, _ := TreeHash([]TreeEntry{{Path: "d", Type: EntryCharDev, Rdev: 0x0103}})
	b1, _ := TreeHash([]TreeEntry{{Path: "d", Type: EntryBlockDev, Rdev: 0x0102}})
	if c1 == c2 || c1 == b1 {
		t.Errorf("device entries: %s %s %s must all differ", c1, c2, b1)
	}
}

// A file listed as a regular file and replaced before it is hashed by a FIFO (or grown) fails the
// hash with a message instead of blocking the open of the FIFO for ever or hashing what the
// listing did not see.
func TestHashEntriesRefusesWhatTheListingDidNotSee(t *testing.T) {
	root := makeTree(t, []treeNode{{path: "d/a", content: "x"}, {path: "d/b", content: "y"}})
	entries, err := ListTree(root)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(root, "d/a")); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mkfifo(filepath.Join(root, "d/a"), 0o644); err != nil {
		t.Skipf("mkfifo: %v", err)
	}
	done := make(chan error, 1)
	go func() { done <- HashEntries(t.Context(), root, entries, nil) }()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "not a regular file") {
			t.Fatalf("HashEntries with a FIFO where a file was listed = %v, want 'not a regular file'", err)
		}
	case <-time.After(10 * time.Second):
		// Unblock the open so the goroutine ends, then fail.
		if f, err := os.OpenFile(filepath.Join(root, "d/a"), os.O_WRONLY, 0); err == nil {
			f.Close()
		}
		t.Fatal("HashEntries blocked for 10 s opening a FIFO where a file was listed")
	}
	if err := os.Remove(filepath.Join(root, "d/a")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "d/a"), []byte("xx"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := HashEntries(t.Context(), root, entries, nil); err == nil || !strings.Contains(err.Error(), "2 bytes, want 1") {
		t.Fatalf("HashEntries of a file grown since the listing = %v, want a size mismatch", err)
	}
}

// A tree whose paths are longer than PATH_MAX once prefixed with where it lives is listed,
// hashed, created and read like any other.
func TestDirLongPaths(t *testing.T) {
	root := t.TempDir()
	d, err := OpenDir(root)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	var rel string
	for i := 0; len(rel) < 5000; i++ {
		if rel != "" {
			rel += "/"
		}
		rel += strings.Repeat(string(rune('a'+i%26)), 200)
	}
	if err := d.MkdirAll(rel, 0o755); err != nil {
		t.Fatalf("MkdirAll of a %d-byte path: %v", len(rel), err)
	}
	f, err := d.Open(rel+"/file", os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString("deep")
	f.Close()
	if err := d.Symlink("../x", rel+"/link"); err != nil {
		t.Fatal(err)
	}
	entries, err := d.List()
	if err != nil {
		t.Fatal(err)
	}
	var sawFile, sawLink bool
	for _, e := range entries {
		sawFile = sawFile || (e.Path == rel+"/file" && e.Type == EntryFile && e.Size == 4)
		sawLink = sawLink || (e.Path == rel+"/link" && e.Type == EntrySymlink && e.Target == "../x")
	}
	if !sawFile || !sawLink {
		t.Fatalf("List of a deep tree misses the file (%v) or the link (%v)", sawFile, sawLink)
	}
	if _, err := HashDir(t.Context(), root); err != nil {
		t.Fatalf("HashDir of a deep tree: %v", err)
	}
	// Open never follows a symlink inside the tree, also for a long path.
	if _, err := d.Open(rel+"/link", os.O_RDONLY, 0); err == nil {
		t.Fatalf("Open followed a symlink")
	}
}

func TestHashDataAndVerify(t *testing.T) {
	tree := makeTree(t, []treeNode{{path: "a", content: "x"}, {path: "b", dir: true}})
	file := filepath.Join(t.TempDir(), "ckpt.save")
	if err := os.WriteFile(file, []byte("hello"), 0o644); err != nil {
		t.Fatal(err)
	}
	// A .restore marker is a symlink to the data; hashing follows it.
	link := filepath.Join(t.TempDir(), "x.restore")
	if err := os.Symlink(tree, link); err != nil {
		t.Fatal(err)
	}
	treeHash := hashDir(t, tree)
	fileHash := FileDigest(blake3.Sum256([]byte("hello"))).String()

	for _, c := range []struct {
		path, hash string
		dir        bool
	}{{tree, treeHash, true}, {link, treeHash, true}, {file, fileHash, false}} {
		h, dir, err := HashData(t.Context(), c.path)
		if err != nil || h != c.hash || dir != c.dir {
			t.Errorf("HashData(%s) = %s, %v, %v; want %s, %v", c.path, h, dir, err, c.hash, c.dir)
		}
		if err := VerifyData(t.Context(), c.path, c.hash, c.dir); err != nil {
			t.Errorf("VerifyData(%s) of its own hash: %v", c.path, err)
		}
	}

	mismatches := []struct {
		name, path, hash string
		dir              bool
	}{
		{"wrong tree hash", tree, fileHash, true},
		{"tree verified as a file", tree, treeHash, false},
		{"file verified as a tree", file, fileHash, true},
		{"wrong file hash", file, treeHash, false},
	}
	for _, c := range mismatches {
		err := VerifyData(t.Context(), c.path, c.hash, c.dir)
		var mm *HashMismatchError
		if !errors.As(err, &mm) {
			t.Errorf("%s: VerifyData = %v, want a *HashMismatchError", c.name, err)
			continue
		}
		if mm.Path != c.path || !strings.Contains(err.Error(), c.hash) {
			t.Errorf("%s: error %q should name the path and the wanted hash %s", c.name, err, c.hash)
		}
	}
	var mm *HashMismatchError
	if err := VerifyData(t.Context(), filepath.Join(tree, "missing"), treeHash, true); err == nil || errors.As(err, &mm) {
		t.Errorf("VerifyData of a missing path = %v, want a read error, not a mismatch", err)
	}
}

// Benchmarks: 256 MiB on tmpfs, as a checkpoint file lives in the spool.
// Compare BenchmarkHashFile with BenchmarkHashRead (the cost of reading
// alone) and BenchmarkHashCandidates (other hashes through the same reads).
//
//	go test -run '^$' -bench 'Hash' -benchtime 8x ./tiers/

const benchFileSize = 256 << 20

// benchTmpfs returns a new directory on tmpfs (/dev/shm; the test's temporary directory where
// there is none), removed when the benchmark ends: the benchmarks measure hashing, not a disk.
func benchTmpfs(b *testing.B, pattern string) string {
	dir := "/dev/shm"
	if _, err := os.Stat(dir); err != nil {
		dir = b.TempDir()
	}
	root, err := os.MkdirTemp(dir, pattern)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { os.RemoveAll(root) })
	return root
}

func benchFile(b *testing.B) *os.File {
	if testing.Short() {
		b.Skip("reads 256 MiB")
	}
	f, err := os.Create(filepath.Join(benchTmpfs(b, "mtcfs-treehash-bench-*"), "data"))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { f.Close() })
	if _, err := f.Write(randomBytes(3, benchFileSize)); err != nil {
		b.Fatal(err)
	}
	return f
}

// readSegments reads benchFileSize bytes of f with hashBufSize preads,
// workers segments at a time, and passes each segment's bytes to a new hash
// from newHash (nil: read only).
func readSegments(b *testing.B, f *os.File, workers int, newHash func() hash.Hash) {
	seg := int64(benchFileSize / workers)
	var wg sync.WaitGroup
	for w := range int64(workers) {
		wg.Go(func() {
			buf := make([]byte, hashBufSize)
			var h hash.Hash
			if newHash != nil {
				h = newHash()
			}
			for off := w * seg; off < (w+1)*seg; off += hashBufSize {
				if _, err := f.ReadAt(buf, off); err != nil {
					b.Error(err)
					return
				}
				if h != nil {
					h.Write(buf)
				}
			}
			if h != nil {
				h.Sum(nil)
			}
		})
	}
	wg.Wait()
}

func BenchmarkHashRead(b *testing.B) {
	f := benchFile(b)
	for _, workers := range []int{1, 2} {
		b.Run(map[int]string{1: "serial", 2: "parallel"}[workers], func(b *testing.B) {
			b.SetBytes(benchFileSize)
			for b.Loop() {
				readSegments(b, f, workers, nil)
			}
		})
	}
}

func BenchmarkHashFile(b *testing.B) {
	f := benchFile(b)
	for _, c := range []struct {
		name string
		seg  int64
	}{{"serial", benchFileSize}, {"parallel", segmentSize}} {
		b.Run(c.name, func(b *testing.B) {
			setSegmentSize(b, c.seg)
			b.SetBytes(benchFileSize)
			for b.Loop() {
				if _, err := HashFile(b.Context(), f, benchFileSize); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkHashCandidates(b *testing.B) {
	f := benchFile(b)
	for _, c := range []struct {
		name    string
		newHash func() hash.Hash
	}{
		{"blake3-hasher", func() hash.Hash { return blake3.New(32, nil) }},
		{"sha256", sha256.New},
	} {
		for _, workers := range []int{1, 2} {
			b.Run(c.name+map[int]string{1: "/serial", 2: "/parallel"}[workers], func(b *testing.B) {
				b.SetBytes(benchFileSize)
				for b.Loop() {
					readSegments(b, f, workers, c.newHash)
				}
			})
		}
	}
}

// BenchmarkHashEntries hashes a tree of many small files (one per array
// shard is the common case) on tmpfs, without a digest cache, opening the
// files one by one and through rings (uring.go).
func BenchmarkHashEntries(b *testing.B) {
	if testing.Short() {
		b.Skip("writes 10,000 files")
	}
	const files, size = 10000, 8 << 10
	root := benchShards(b, "mtcfs-hashentries-bench-*", files, size, 1)
	entries, err := ListTree(root)
	if err != nil {
		b.Fatal(err)
	}
	forEachOpener(b, func(b *testing.B) {
		b.SetBytes(files * size)
		for b.Loop() {
			if err := HashEntries(b.Context(), root, entries, nil); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkVerifyUnsized is a restart's verification of a step (VerifyListed of
// an unsized listing) of 10,000 files of 4 KiB in 10 directories, on tmpfs.
func BenchmarkVerifyUnsized(b *testing.B) {
	if testing.Short() {
		b.Skip("writes 10,000 files")
	}
	const files, size = 10000, 4 << 10
	root := benchShards(b, "mtcfs-verify-bench-*", files, size, 10)
	hash, _, err := HashData(b.Context(), root)
	if err != nil {
		b.Fatal(err)
	}
	forEachOpener(b, func(b *testing.B) {
		b.SetBytes(files * size)
		for b.Loop() {
			listing, err := ListTreeUnsized(root)
			if err != nil {
				b.Fatal(err)
			}
			if err := VerifyListed(b.Context(), root, listing, hash, true); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// benchShards writes files files of size bytes each (the same bytes) in dirs directories of a
// new tmpfs directory named after pattern, and returns it.
func benchShards(b *testing.B, pattern string, files, size, dirs int) string {
	root := benchTmpfs(b, pattern)
	data := randomBytes(uint64(size), int64(size))
	for i := range files {
		dir := root
		if dirs > 1 {
			dir = filepath.Join(root, fmt.Sprintf("d%d", i%dirs))
			if err := os.MkdirAll(dir, 0o755); err != nil {
				b.Fatal(err)
			}
		}
		if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("shard-%05d", i)), data, 0o644); err != nil {
			b.Fatal(err)
		}
	}
	return root
}

// forEachOpener runs f with files opened one by one and, where the kernel
// allows io_uring, through rings.
func forEachOpener(b *testing.B, f func(b *testing.B)) {
	from := ringFrom
	b.Cleanup(func() { ringFrom = from })
	b.Run("opens=plain", func(b *testing.B) {
		ringFrom = math.MaxInt
		f(b)
	})
	b.Run("opens=ring", func(b *testing.B) {
		ringFrom = from
		made := ringsMade.Load()
		f(b)
		if ringsMade.Load() == made {
			b.Fatal("no ring was set up")
		}
	})
}

// A hash of many files calls WithPacer's func before each batch it opens, and waits for it.
func TestHashPacer(t *testing.T) {
	dir := t.TempDir()
	for i := range 100 {
		if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("f%03d", i)), []byte{byte(i)}, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, _, err := HashData(t.Context(), dir)
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	gate := make(chan struct{})
	ctx := WithPacer(t.Context(), func() {
		calls.Add(1)
		<-gate
	})
	done := make(chan string, 1)
	go func() {
		got, _, err := HashDataCached(ctx, dir, &DigestCache{})
		if err != nil {
			t.Error(err)
		}
		done <- got
	}()
	select {
	case <-done:
		t.Fatal("the hash went on while its pacer held it")
	case <-time.After(200 * time.Millisecond):
	}
	close(gate)
	if got := <-done; got != want {
		t.Fatalf("paced hash %s, want %s", got, want)
	}
	if calls.Load() == 0 {
		t.Fatal("the pacer was not called")
	}
}
