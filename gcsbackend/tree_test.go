package gcsbackend

import (
	"context"
	"encoding/json"
	"io"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/layout"
)

// oddTree is what buildOddTree made: the paths the tests look at.
type oddTree struct {
	long    string // a file whose path is over 1100 bytes
	deep    string // a file whose path is near PATH_MAX relative to the root
	big     string // a file large enough for a composite upload, below a long path
	devices bool   // device nodes were created (root only)
}

// buildOddTree creates, through layout.Dir, a checkpoint tree holding every
// kind of entry a step may hold: files (one empty), an empty directory,
// relative, absolute and dangling symlinks and one whose target is not
// UTF-8, a FIFO, a socket, device nodes when running as root, names an
// object store cannot take as they are, a path over 1100 bytes and one
// that is longer than PATH_MAX once prefixed with root.
func buildOddTree(t *testing.T, root string) oddTree {
	t.Helper()
	d, err := layout.OpenDir(root)
	require.NoError(t, err)
	defer d.Close()
	mkParent := func(p string) {
		if dir := path.Dir(p); dir != "." {
			require.NoError(t, d.MkdirAll(dir, 0o755))
		}
	}
	file := func(p string, data []byte) {
		mkParent(p)
		f, err := d.Open(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
		require.NoError(t, err)
		_, err = f.Write(data)
		require.NoError(t, err)
		require.NoError(t, f.Close())
	}
	link := func(target, p string) {
		mkParent(p)
		require.NoError(t, d.Symlink(target, p))
	}
	special := func(p string, mode uint32, dev uint64) {
		mkParent(p)
		require.NoError(t, d.Mknod(p, mode|0o644, dev))
	}
	var tr oddTree

	file("_CHECKPOINT_METADATA", []byte(`{"step": 7}`))
	file("state/array_0", randomBytes(300<<10, 1))
	file("state/empty", nil)
	file(tempPrefix+"not-a-temporary", []byte("the job's own file")) // reserved segment: mapped
	file("odd\nname", []byte("a newline in a name"))                 // GCS refuses it: mapped
	require.NoError(t, d.MkdirAll("empty-dir", 0o755))
	require.NoError(t, d.MkdirAll("nested/empty/deeper", 0o755))
	link("state", "latest")
	link("../_CHECKPOINT_METADATA", "state/relative")
	link("/etc/hostname", "absolute")
	link("no/such/target", "dangling")
	link("\xff\xfe not UTF-8", "binary-target")
	special("pipes/fifo", unix.S_IFIFO, 0)
	special("pipes/sock", unix.S_IFSOCK, 0)
	if os.Geteuid() == 0 {
		special("dev/null", unix.S_IFCHR, unix.Mkdev(1, 3))
		special("dev/loop7", unix.S_IFBLK, unix.Mkdev(7, 7))
		tr.devices = true
	}

	seg := func(c byte, n int) string { return strings.Repeat(string(c), n) }
	long := "long"
	for range 6 {
		long += "/" + seg('l', 200)
	}
	tr.long = long + "/file"
	file(tr.long, []byte("long path"))
	tr.big = long + "/big"
	file(tr.big, randomBytes(3<<20+5, 2))

	deep := "deep"
	for len(deep) < 4000-250 {
		deep += "/" + seg('d', 250)
	}
	deep += "/" + seg('e', 4000-len(deep)-1)
	tr.deep = deep + "/" + seg('f', 4090-len(deep)-1)
	require.Len(t, tr.deep, 4090)
	file(tr.deep, []byte("near PATH_MAX"))
	link("../../up", deep+"/link")
	special(deep+"/fifo", unix.S_IFIFO, 0)
	require.Greater(t, len(root)+1+len(tr.deep), unix.PathMax)
	return tr
}

// listSorted lists a tree with layout.Dir, sorted by path.
func listSorted(t *testing.T, root string) []layout.TreeEntry {
	t.Helper()
	entries, err := layout.ListTree(root)
	require.NoError(t, err)
	slices.SortFunc(entries, func(a, b layout.TreeEntry) int { return strings.Compare(a.Path, b.Path) })
	return entries
}

// assertSameTree compares two trees entry by entry (paths, types, sizes,
// symlink targets, device numbers) and file by file (bytes).
func assertSameTree(t *testing.T, want, got string) {
	t.Helper()
	we, ge := listSorted(t, want), listSorted(t, got)
	require.Equal(t, we, ge)
	wd, err := layout.OpenDir(want)
	require.NoError(t, err)
	defer wd.Close()
	gd, err := layout.OpenDir(got)
	require.NoError(t, err)
	defer gd.Close()
	read := func(d *layout.Dir, p string) []byte {
		f, err := d.Open(p, os.O_RDONLY, 0)
		require.NoError(t, err)
		defer f.Close()
		b, err := io.ReadAll(f)
		require.NoError(t, err)
		return b
	}
	for _, e := range we {
		if e.Type == layout.EntryFile {
			assert.True(t, string(read(wd, e.Path)) == string(read(gd, e.Path)), "bytes of %.80q differ", e.Path)
		}
	}
}

func readManifestOf(t *testing.T, b *Backups, backup, hash string) *manifest {
	t.Helper()
	m, err := b.readManifest(context.Background(), backupDir(testJob, backup), hash)
	require.NoError(t, err)
	return m
}

// TestOddTreeRoundTrip: a tree with symlinks, special files, an empty
// directory and long paths is backed up, verified complete, restored
// identical (entry by entry and by tree hash), on file:// and on the GCS
// emulator, and every object name fits the store.
func TestOddTreeRoundTrip(t *testing.T) {
	for _, tc := range []struct {
		name  string
		store func(t *testing.T) ObjectStore
	}{
		{"file", newTestLocalDir},
		{"gcs", newTestFakeGCS},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			const backup = "2026-01-02_03-04"
			b := &Backups{Store: tc.store(t), Parallelism: 4}
			src := filepath.Join(t.TempDir(), "src")
			require.NoError(t, os.Mkdir(src, 0o755))
			tr := buildOddTree(t, src)
			srcHash, err := layout.HashDir(ctx, src)
			require.NoError(t, err)
			h := "D" + srcHash

			require.NoError(t, b.Upload(ctx, UploadRequest{Job: testJob, Backup: backup, Step: 7, Hash: h, Source: src}))
			for _, deep := range []bool{false, true} {
				rep := verify(t, b, backup, VerifyOptions{Nodes: 1, Workers: 1, Deep: deep})
				require.Len(t, rep.Steps, 1)
				assert.True(t, rep.Steps[0].Complete, "deep=%v: %v", deep, rep.Steps[0].Problems)
			}

			m := readManifestOf(t, b, backup, h)
			assert.Equal(t, manifestFormatV2, m.Format)
			mapped := map[string]string{}
			for _, f := range m.Files {
				if f.Object != "" {
					mapped[string(f.Path)] = f.Object
				}
			}
			for _, p := range []string{tr.long, tr.deep, tr.big, tempPrefix + "not-a-temporary", "odd\nname"} {
				assert.Equal(t, longObject(h, p), mapped[p], "%.60q must be stored under a mapped name", p)
			}
			assert.Len(t, mapped, 5, "short, plain names are stored as themselves")
			wantSpecials := 3
			if tr.devices {
				wantSpecials += 2
			}
			assert.Len(t, m.Specials, wantSpecials)
			assert.Len(t, m.Symlinks, 6)

			objs, _, err := b.Store.List(ctx, "", "")
			require.NoError(t, err)
			budget := b.nameBudget()
			for _, o := range objs {
				assert.LessOrEqual(t, len(o.Name), budget, "object %.60q… is too long for the store", o.Name)
			}

			dest := filepath.Join(t.TempDir(), "restored")
			require.NoError(t, b.Download(ctx, DownloadRequest{Job: testJob, Backup: backup, Hash: h, Dest: dest}))
			assertSameTree(t, src, dest)
			got, err := layout.HashDir(ctx, dest)
			require.NoError(t, err)
			assert.Equal(t, srcHash, got, "the restored tree must hash as the source")
			st, err := os.Lstat(filepath.Join(dest, "absolute"))
			require.NoError(t, err)
			assert.Equal(t, os.ModeSymlink, st.Mode().Type(), "a symlink is restored as a symlink, not followed")

			// A damaged object deep in the tree: the download fails and
			// leaves nothing behind, however deep the partial tree was.
			require.NoError(t, PutBytes(ctx, b.Store, backupDir(testJob, backup)+longObject(h, tr.deep), []byte("damaged"), false))
			parent := t.TempDir()
			err = b.Download(ctx, DownloadRequest{Job: testJob, Backup: backup, Hash: h, Dest: filepath.Join(parent, "r")})
			require.Error(t, err)
			left, err := os.ReadDir(parent)
			require.NoError(t, err)
			assert.Empty(t, left, "a failed download leaves no partial tree")
		})
	}
}

// TestOddTreeManifestIsDeterministic: two copies of the tree (other inodes,
// other creation order) uploaded by two nodes give byte-identical manifests,
// so their create-if-absent uploads agree.
func TestOddTreeManifestIsDeterministic(t *testing.T) {
	ctx := context.Background()
	store := newTestLocalDir(t)
	var manifests []string
	h := fakeHash(true, "odd")
	for i := range 2 {
		src := filepath.Join(t.TempDir(), "src")
		require.NoError(t, os.Mkdir(src, 0o755))
		buildOddTree(t, src)
		b := &Backups{Store: store}
		require.NoError(t, b.Upload(ctx, UploadRequest{Job: testJob, Backup: "2026-01-02_03-04", Slot: Slot{i, 0}, Hash: h, Source: src}))
		data, err := ReadSmall(ctx, store, backupDir(testJob, "2026-01-02_03-04")+manifestName(h), 1<<20)
		require.NoError(t, err)
		manifests = append(manifests, string(data))
	}
	assert.Equal(t, manifests[0], manifests[1])
	var raw map[string]any
	require.NoError(t, json.Unmarshal([]byte(manifests[0]), &raw))
	assert.NotContains(t, manifests[0], "ino", "no node identity")
	for _, k := range []string{"dirs", "files", "symlinks", "specials"} {
		list, _ := raw[k].([]any)
		var paths []string
		for _, e := range list {
			switch e := e.(type) {
			case string:
				paths = append(paths, e)
			case map[string]any:
				p, _ := e["path"].(string)
				paths = append(paths, p)
			}
		}
		assert.True(t, slices.IsSorted(paths), "%s must be sorted by path", k)
	}
}

// TestLongNameBudgetFollowsStorePrefix: a path whose object name fits 1024
// bytes on its own but not with a gs:// prefix is mapped on that store only.
func TestLongNameBudgetFollowsStorePrefix(t *testing.T) {
	ctx := context.Background()
	const backup = "2026-01-02_03-04"
	h := fakeHash(true, "budget")
	dir := backupDir(testJob, backup)
	// An object name of exactly 1020 bytes.
	n := 1020 - len(dir+dataObject(h, ""))
	p := "b/" + strings.Repeat("x", 250) + "/" + strings.Repeat("y", 250) + "/" + strings.Repeat("z", 250) + "/"
	p += strings.Repeat("w", n-len(p)-1)
	require.Len(t, dir+dataObject(h, p), 1020)

	for _, tc := range []struct {
		name   string
		store  func(t *testing.T) ObjectStore
		mapped bool
	}{
		{"file", newTestLocalDir, false},
		{"gcs without prefix", func(t *testing.T) ObjectStore { return newFakeGCS(t).store(t, "", testGCSOptions()) }, false},
		{"gcs with prefix", newTestFakeGCS, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src := t.TempDir()
			writeTree(t, src, map[string]string{p: "content", "short": "s"})
			b := &Backups{Store: tc.store(t)}
			require.NoError(t, b.Upload(ctx, UploadRequest{Job: testJob, Backup: backup, Hash: h, Source: src}))
			m := readManifestOf(t, b, backup, h)
			want, format := "", manifestFormatV1
			if tc.mapped {
				want, format = longObject(h, p), manifestFormatV2
			}
			assert.Equal(t, format, m.Format, "a tree that needs no v2 feature keeps the v1 format")
			for _, f := range m.Files {
				if string(f.Path) == p {
					assert.Equal(t, want, f.Object)
				}
			}
			rep := verify(t, b, backup, VerifyOptions{Nodes: 1, Workers: 1, Deep: true})
			assert.True(t, rep.Steps[0].Complete, rep.Steps[0].Problems)
			dest := filepath.Join(t.TempDir(), "r")
			require.NoError(t, b.Download(ctx, DownloadRequest{Job: testJob, Backup: backup, Hash: h, Dest: dest}))
			assertSameTree(t, src, dest)
		})
	}

	// The store itself refuses a name that does not fit with its prefix.
	s := newTestFakeGCS(t)
	err := PutBytes(ctx, s, dir+dataObject(h, p), []byte("x"), true)
	assert.ErrorContains(t, err, "longer than 1024 bytes with the prefix")
}

// TestNonUTF8NamesRoundTrip: names that are not UTF-8, which JSON strings
// cannot carry, survive the manifest (base64) and the store (mapped).
func TestNonUTF8NamesRoundTrip(t *testing.T) {
	ctx := context.Background()
	src := t.TempDir()
	writeTree(t, src, map[string]string{"d\xff/f\xfe": "bytes", "plain": "p", "e\xfa/": ""})
	b := newTestBackups(t)
	h := fakeHash(true, "utf8")
	require.NoError(t, b.Upload(ctx, UploadRequest{Job: testJob, Backup: "2026-01-02_03-04", Hash: h, Source: src}))
	m := readManifestOf(t, b, "2026-01-02_03-04", h)
	assert.Equal(t, manifestFormatV2, m.Format)
	rep := verify(t, b, "2026-01-02_03-04", VerifyOptions{Nodes: 1, Workers: 1})
	assert.True(t, rep.Steps[0].Complete, rep.Steps[0].Problems)
	dest := filepath.Join(t.TempDir(), "r")
	require.NoError(t, b.Download(ctx, DownloadRequest{Job: testJob, Backup: "2026-01-02_03-04", Hash: h, Dest: dest}))
	assertSameTree(t, src, dest)
}

// TestMappedObjectProblemsAreReported: a missing or damaged mapped object
// makes the step incomplete, and the report names the file.
func TestMappedObjectProblemsAreReported(t *testing.T) {
	ctx := context.Background()
	const backup = "2026-01-02_03-04"
	b := newTestBackups(t)
	src := t.TempDir()
	long := strings.Repeat("a", 250) + "/" + strings.Repeat("b", 250) + "/" + strings.Repeat("c", 250) + "/" + strings.Repeat("d", 250) + "/f"
	writeTree(t, src, map[string]string{long: "long", "s": "short"})
	h := fakeHash(true, "mapped")
	require.NoError(t, b.Upload(ctx, UploadRequest{Job: testJob, Backup: backup, Hash: h, Source: src}))
	obj := backupDir(testJob, backup) + longObject(h, long)

	require.NoError(t, PutBytes(ctx, b.Store, obj, []byte("LONG"), false))
	rep := verify(t, b, backup, VerifyOptions{Deep: true})
	assert.False(t, rep.Steps[0].Complete)
	assert.Contains(t, strings.Join(rep.Steps[0].Problems, "\n"), "differs from the manifest")
	err := b.Download(ctx, DownloadRequest{Job: testJob, Backup: backup, Hash: h, Dest: filepath.Join(t.TempDir(), "r")})
	var ce *ChecksumError
	assert.ErrorAs(t, err, &ce)

	require.NoError(t, b.Store.Delete(ctx, obj))
	rep = verify(t, b, backup, VerifyOptions{})
	assert.False(t, rep.Steps[0].Complete)
	problems := strings.Join(rep.Steps[0].Problems, "\n")
	assert.Contains(t, problems, longObject(h, long)+" (file")
	assert.Contains(t, problems, "missing")
}

// TestDecodeManifestV2RejectsUntrustedContent: what a v2 manifest adds is
// validated before Download creates anything.
func TestDecodeManifestV2RejectsUntrustedContent(t *testing.T) {
	dir := fakeHash(true, "d")
	const v1, v2 = `{"format":"mtcfs-manifest-v1","kind":"dir","files":[],`, `{"format":"mtcfs-manifest-v2","kind":"dir","files":[],`
	for _, tc := range []struct{ json, wantErr string }{
		{v1 + `"symlinks":[{"path":"l","target":"x"}]}`, "cannot hold"},
		{v1 + `"specials":[{"path":"p","type":"fifo"}]}`, "cannot hold"},
		{`{"format":"mtcfs-manifest-v1","kind":"dir","files":[{"path":"a","size":1,"crc32c":"00000000","object":"` + longObject(dir, "a") + `"}]}`, "cannot hold"},
		{v2 + `"symlinks":[{"path":"l","target":""}]}`, "empty target"},
		{v2 + `"symlinks":[{"path":"l","target":"a\u0000b"}]}`, "NUL"},
		{v2 + `"symlinks":[{"path":"l","target":"` + strings.Repeat("t", 4096) + `"}]}`, "longer than"},
		{v2 + `"symlinks":[{"path":"../l","target":"x"}]}`, ".."},
		{v2 + `"symlinks":[{"path":"l","target":{"base64":"!!"}}]}`, "illegal base64"},
		{v2 + `"symlinks":[{"path":"l","target":7}]}`, "want a string"},
		{v2 + `"specials":[{"path":"p","type":"door"}]}`, "unknown type"},
		{v2 + `"specials":[{"path":"p","type":""}]}`, "unknown type"},
		{v2 + `"specials":[{"path":"p","type":"fifo","rdev":5}]}`, "device number"},
		{v2 + `"specials":[{"path":"/p","type":"socket"}]}`, "absolute"},
		{v2 + `"dirs":["l"],"symlinks":[{"path":"l","target":"x"}]}`, "twice"},
		{v2 + `"symlinks":[{"path":"l","target":"/etc"}],"specials":[{"path":"l/passwd","type":"fifo"}]}`, "below"},
		{`{"format":"mtcfs-manifest-v2","kind":"dir","files":[{"path":"f","size":1,"crc32c":"00000000"},{"path":"f/g","size":1,"crc32c":"00000000"}]}`, "below"},
		{`{"format":"mtcfs-manifest-v2","kind":"dir","files":[{"path":"a","size":1,"crc32c":"00000000","object":"` + longObject(dir, "b") + `"}]}`, "is not"},
		{`{"format":"mtcfs-manifest-v2","kind":"dir","files":[{"path":"a","size":1,"crc32c":"00000000","object":"../../other-job/x"}]}`, "is not"},
		{`{"format":"mtcfs-manifest-v2","kind":"dir","files":[{"path":"` + strings.Repeat("n", 256) + `","size":1,"crc32c":"00000000","object":"` + longObject(dir, strings.Repeat("n", 256)) + `"}]}`, "longer than 255"},
		{`{"format":"mtcfs-manifest-v2","kind":"dir","files":[{"path":"` + strings.Repeat("n/", 600) + `f","size":1,"crc32c":"00000000"}]}`, "longer than 1024"},
		{`{"format":"mtcfs-manifest-v2","kind":"dir","files":[{"path":".mtcfs-tmp-x","size":1,"crc32c":"00000000"}]}`, "reserved"},
	} {
		_, err := decodeManifest([]byte(tc.json), dir)
		if assert.Error(t, err, tc.json) {
			assert.Contains(t, err.Error(), tc.wantErr, "%.200s", tc.json)
		}
	}
	_, err := decodeManifest([]byte(`{"format":"mtcfs-manifest-v2","kind":"file","files":[{"path":"","size":1,"crc32c":"00000000"}],"symlinks":[{"path":"l","target":"x"}]}`), fakeHash(false, "f"))
	assert.ErrorContains(t, err, "single-file")

	// Accepted: every kind, a mapped object, a target that is not UTF-8.
	ok := `{"format":"mtcfs-manifest-v2","kind":"dir","dirs":["d"],` +
		`"files":[{"path":"d/f","size":1,"crc32c":"00000000","object":"` + longObject(dir, "d/f") + `"}],` +
		`"symlinks":[{"path":"d/l","target":{"base64":"/w=="}}],` +
		`"specials":[{"path":"c","type":"chardev","rdev":259},{"path":"s","type":"socket"}]}`
	m, err := decodeManifest([]byte(ok), dir)
	require.NoError(t, err)
	assert.Equal(t, text("\xff"), m.Symlinks[0].Target)
	data, err := m.encode()
	require.NoError(t, err)
	assert.JSONEq(t, ok, string(data), "encode(decode(x)) == x")
}
