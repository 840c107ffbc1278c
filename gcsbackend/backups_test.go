package gcsbackend

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sync/semaphore"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/tiers"
)

const testJob = "llama-7b"

// fakeHash returns a well-formed data hash derived from seed. The backup
// layer does not recompute hashes (tiers does), so any 64 hex digits do.
func fakeHash(dir bool, seed string) string {
	sum := sha256.Sum256([]byte(seed))
	if dir {
		return "D" + hex.EncodeToString(sum[:])
	}
	return hex.EncodeToString(sum[:])
}

// writeTree creates files (relative path → content) and directories
// (relative paths ending in "/") under root.
func writeTree(t *testing.T, root string, entries map[string]string) {
	t.Helper()
	for rel, content := range entries {
		p := filepath.Join(root, filepath.FromSlash(rel))
		if strings.HasSuffix(rel, "/") {
			require.NoError(t, os.MkdirAll(p, 0o755))
			continue
		}
		require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
		require.NoError(t, os.WriteFile(p, []byte(content), 0o644))
	}
}

// readTree is the inverse of writeTree.
func readTree(t *testing.T, root string) map[string]string {
	t.Helper()
	got := map[string]string{}
	require.NoError(t, filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == root {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		rel = filepath.ToSlash(rel)
		if d.IsDir() {
			if entries, _ := os.ReadDir(p); len(entries) == 0 {
				got[rel+"/"] = ""
			}
			return nil
		}
		b, err := os.ReadFile(p)
		got[rel] = string(b)
		return err
	}))
	return got
}

// slotTree is the checkpoint tree of one slot at one step: an Orbax-like
// layout, with an empty directory that only the manifest can carry.
func slotTree(step int64, s Slot) map[string]string {
	return map[string]string{
		"_CHECKPOINT_METADATA":             fmt.Sprintf(`{"step": %d}`, step),
		"commit_success.txt":               "ok",
		"state/array_0":                    strings.Repeat(fmt.Sprintf("s%d%s ", step, s), 500),
		"state/array_1":                    fmt.Sprintf("%d %s", step, s),
		"process_metadata/" + s.String():   "{}",
		"state/empty/":                     "",
		"state/.zarray":                    "hidden",
		"state/nested/deeper/__0_0.distcp": "distcp",
	}
}

// uploadStep uploads step for nodes×workers slots into backup, skipping the
// slots in skip, and returns the hash of each slot.
func uploadStep(t *testing.T, b *Backups, backup string, step int64, nodes, workers int, skip ...Slot) map[Slot]string {
	t.Helper()
	hashes := map[Slot]string{}
	for r := 0; r < nodes; r++ {
		for w := 0; w < workers; w++ {
			s := Slot{r, w}
			if contains(skip, s) {
				continue
			}
			src := t.TempDir()
			writeTree(t, src, slotTree(step, s))
			h := fakeHash(true, fmt.Sprint(backup, step, s))
			require.NoError(t, b.Upload(context.Background(), UploadRequest{
				Job: testJob, Backup: backup, Step: step, Slot: s, Hash: h, Source: src,
			}))
			hashes[s] = h
		}
	}
	return hashes
}

func contains(slots []Slot, s Slot) bool {
	for _, x := range slots {
		if x == s {
			return true
		}
	}
	return false
}

// testStores holds, per running test, the store factory that newTestStore
// uses instead of file://, so that one test body runs against several stores
// (see TestBackupsOnGCSFake).
var testStores sync.Map // *testing.T → func(*testing.T) ObjectStore

// runOnStore runs test as a subtest whose newTestStore calls newStore.
func runOnStore(t *testing.T, name string, newStore func(*testing.T) ObjectStore, test func(*testing.T)) {
	t.Run(name, func(t *testing.T) {
		testStores.Store(t, newStore)
		t.Cleanup(func() { testStores.Delete(t) })
		test(t)
	})
}

// newTestStore returns an empty store: file:// unless runOnStore says
// otherwise.
func newTestStore(t *testing.T) ObjectStore {
	if f, ok := testStores.Load(t); ok {
		return f.(func(*testing.T) ObjectStore)(t)
	}
	return newTestLocalDir(t)
}

func newTestBackups(t *testing.T) *Backups {
	return &Backups{Store: newTestStore(t), Parallelism: 3}
}

func verify(t *testing.T, b *Backups, backup string, opts VerifyOptions) BackupReport {
	t.Helper()
	r, err := b.Verify(context.Background(), testJob, backup, opts)
	require.NoError(t, err)
	return r
}

func TestUploadVerifyComplete(t *testing.T) {
	b := newTestBackups(t)
	const backup = "2025-06-30_14-30"
	hashes := uploadStep(t, b, backup, 100, 2, 2)

	for _, opts := range []VerifyOptions{{Nodes: 2, Workers: 2}, {}, {Deep: true}} {
		r := verify(t, b, backup, opts)
		assert.Equal(t, backup, r.Name)
		assert.Equal(t, 2, r.Nodes, "%+v", opts)
		assert.Equal(t, 2, r.Workers, "%+v", opts)
		assert.Equal(t, opts.Nodes == 0, r.Inferred)
		require.Len(t, r.Steps, 1)
		assert.Equal(t, int64(100), r.Steps[0].Step)
		assert.Empty(t, r.Steps[0].Problems, "%+v", opts)
		assert.True(t, r.Steps[0].Complete, "%+v", opts)
		assert.Equal(t, hashes, r.Steps[0].Data)
		assert.True(t, r.Complete())
		step, ok := r.HighestComplete()
		assert.True(t, ok)
		assert.Equal(t, int64(100), step)
	}

	// The layout is the reference system's, plus the manifest sidecar.
	ctx := context.Background()
	h := hashes[Slot{1, 0}]
	meta, err := ReadSmall(ctx, b.Store, testJob+"/"+backup+"/"+testJob+"-s100-n1-w0.meta", 1024)
	require.NoError(t, err)
	assert.Equal(t, h, string(meta), ".meta holds exactly the hash, no newline")
	for _, name := range []string{h + ".data/state/array_0", h + ".data/state/nested/deeper/__0_0.distcp", h + ".data/state/.zarray", h + ".data.manifest"} {
		_, err := b.Store.Stat(ctx, testJob+"/"+backup+"/"+name)
		assert.NoError(t, err, "expected object %s", name)
	}
}

func TestManifestIsDeterministic(t *testing.T) {
	src := t.TempDir()
	writeTree(t, src, map[string]string{"b": "1", "a/z": "2", "a.x": "3", "a/y/": ""})
	h := fakeHash(true, "m")
	b1, b2 := newTestBackups(t), newTestBackups(t)
	for _, b := range []*Backups{b1, b2} {
		require.NoError(t, b.Upload(context.Background(), UploadRequest{Job: testJob, Backup: "2025-01-01_00-00", Hash: h, Source: src}))
	}
	name := testJob + "/2025-01-01_00-00/" + h + ".data.manifest"
	m1, err := ReadSmall(context.Background(), b1.Store, name, 1<<20)
	require.NoError(t, err)
	m2, err := ReadSmall(context.Background(), b2.Store, name, 1<<20)
	require.NoError(t, err)
	assert.Equal(t, string(m1), string(m2))
	assert.Equal(t, `{"format":"mtcfs-manifest-v1","kind":"dir","dirs":["a","a/y"],"files":[`+
		`{"path":"a.x","size":1,"crc32c":"`+fmt.Sprintf("%08x", crcOf([]byte("3")))+`"},`+
		`{"path":"a/z","size":1,"crc32c":"`+fmt.Sprintf("%08x", crcOf([]byte("2")))+`"},`+
		`{"path":"b","size":1,"crc32c":"`+fmt.Sprintf("%08x", crcOf([]byte("1")))+`"}]}`+"\n", string(m1))
}

func TestMissingDataMakesBackupIncomplete(t *testing.T) {
	ctx := context.Background()
	b := newTestBackups(t)
	const older, newer = "2025-06-30_14-00", "2025-06-30_14-30"
	uploadStep(t, b, older, 90, 2, 1)
	hashes := uploadStep(t, b, newer, 100, 2, 1)

	got, step, ok, err := b.NewestComplete(ctx, testJob, 2, 1)
	require.NoError(t, err)
	require.True(t, ok)
	assert.Equal(t, newer, got)
	assert.Equal(t, int64(100), step)

	victim := testJob + "/" + newer + "/" + hashes[Slot{1, 0}] + ".data/state/array_1"
	require.NoError(t, b.Store.Delete(ctx, victim))
	r := verify(t, b, newer, VerifyOptions{Nodes: 2, Workers: 1})
	require.Len(t, r.Steps, 1)
	assert.False(t, r.Steps[0].Complete)
	assert.False(t, r.Complete())
	require.Len(t, r.Steps[0].Problems, 1)
	assert.Contains(t, r.Steps[0].Problems[0], "state/array_1 missing")
	assert.True(t, r.Steps[0].Damaged, "every .meta is there: the upload finished, the data was lost since")
	assert.True(t, r.Damaged())

	got, step, ok, err = b.NewestComplete(ctx, testJob, 2, 1)
	require.NoError(t, err)
	require.True(t, ok, "the older complete backup must be chosen")
	assert.Equal(t, older, got)
	assert.Equal(t, int64(90), step)

	// Without the manifest the data cannot be proven complete.
	require.NoError(t, b.Store.Delete(ctx, testJob+"/"+older+"/"+hashOf(t, b, older, 90, Slot{0, 0})+".data.manifest"))
	_, _, ok, err = b.NewestComplete(ctx, testJob, 2, 1)
	require.NoError(t, err)
	assert.False(t, ok, "no complete backup is left")
	r = verify(t, b, older, VerifyOptions{})
	assert.Contains(t, strings.Join(r.Steps[0].Problems, "\n"), "manifest")
}

// hashOf reads the hash a slot's .meta names.
func hashOf(t *testing.T, b *Backups, backup string, step int64, s Slot) string {
	t.Helper()
	meta, err := ReadSmall(context.Background(), b.Store, testJob+"/"+backup+"/"+metaName(testJob, step, s), 1024)
	require.NoError(t, err)
	return string(meta)
}

func TestMissingMetaMakesBackupIncomplete(t *testing.T) {
	b := newTestBackups(t)
	const backup = "2025-06-30_14-30"
	uploadStep(t, b, backup, 7, 3, 2, Slot{1, 0})

	for _, opts := range []VerifyOptions{{Nodes: 3, Workers: 2}, {}} {
		r := verify(t, b, backup, opts)
		require.Len(t, r.Steps, 1)
		assert.False(t, r.Steps[0].Complete, "%+v", opts)
		assert.Equal(t, []string{"n1-w0: .meta missing"}, r.Steps[0].Problems)
		assert.NotContains(t, r.Steps[0].Data, Slot{1, 0})
		assert.False(t, r.Steps[0].Damaged, "an upload that never finished is not damage")
		assert.False(t, r.Damaged())
	}
	_, _, ok, err := b.NewestComplete(context.Background(), testJob, 3, 2)
	require.NoError(t, err)
	assert.False(t, ok)
}

func TestMissingHighestRank(t *testing.T) {
	b := newTestBackups(t)
	const backup = "2025-06-30_14-30"
	uploadStep(t, b, backup, 7, 3, 1, Slot{2, 0})

	// Inference cannot know rank 2 exists (documented); the known count can.
	r := verify(t, b, backup, VerifyOptions{})
	assert.Equal(t, 2, r.Nodes)
	assert.True(t, r.Inferred)
	r = verify(t, b, backup, VerifyOptions{Nodes: 3})
	assert.Equal(t, []string{"n2-w0: .meta missing"}, r.Steps[0].Problems)
	assert.Equal(t, 1, r.Workers, "workers are still inferred")
	assert.True(t, r.Inferred)
}

func TestHighestCompleteStepWithinBackup(t *testing.T) {
	b := newTestBackups(t)
	const backup = "2025-06-30_14-30"
	uploadStep(t, b, backup, 10, 2, 1)
	uploadStep(t, b, backup, 20, 2, 1, Slot{1, 0}) // interrupted
	r := verify(t, b, backup, VerifyOptions{})
	require.Len(t, r.Steps, 2)
	assert.Equal(t, int64(20), r.Steps[0].Step, "highest step first")
	assert.False(t, r.Steps[0].Complete)
	assert.True(t, r.Steps[1].Complete)
	assert.False(t, r.Complete(), "a backup holding an interrupted step is not complete")
	step, ok := r.HighestComplete()
	assert.True(t, ok)
	assert.Equal(t, int64(10), step)

	got, step, ok, err := b.NewestComplete(context.Background(), testJob, 2, 1)
	require.NoError(t, err)
	assert.True(t, ok)
	assert.Equal(t, backup, got)
	assert.Equal(t, int64(10), step)
}

func TestCorruptionDetected(t *testing.T) {
	ctx := context.Background()
	b := newTestBackups(t)
	const backup = "2025-06-30_14-30"
	hashes := uploadStep(t, b, backup, 5, 1, 1)
	h := hashes[Slot{0, 0}]
	p := b.Store.(*localDir).path(testJob + "/" + backup + "/" + h + ".data/state/array_0")
	fi, err := os.Stat(p)
	require.NoError(t, err)

	flipByte(t, p, 100)
	// Bit rot leaves the mtime alone: only reading the data notices.
	require.NoError(t, os.Chtimes(p, fi.ModTime(), fi.ModTime()))
	r := verify(t, b, backup, VerifyOptions{Deep: true})
	assert.False(t, r.Steps[0].Complete)
	require.Len(t, r.Steps[0].Problems, 1)
	assert.Contains(t, r.Steps[0].Problems[0], "state/array_0 content")
	assert.True(t, r.Steps[0].Damaged)

	dest := filepath.Join(t.TempDir(), h+".data")
	err = b.Download(ctx, DownloadRequest{Job: testJob, Backup: backup, Hash: h, Dest: dest})
	var ce *ChecksumError
	require.True(t, errors.As(err, &ce), "want *ChecksumError, got %v", err)
	_, err = os.Lstat(dest)
	assert.True(t, errors.Is(err, fs.ErrNotExist), "a failed download must not appear at its destination")
	entries, err := os.ReadDir(filepath.Dir(dest))
	require.NoError(t, err)
	assert.Empty(t, entries, "a failed download must remove its temporary tree")

	// An in-place edit changes the mtime: the cheap check notices too.
	require.NoError(t, os.Chtimes(p, time.Now(), fi.ModTime().Add(time.Second)))
	r = verify(t, b, backup, VerifyOptions{})
	assert.False(t, r.Steps[0].Complete)
	assert.Contains(t, strings.Join(r.Steps[0].Problems, "\n"), "crc32c")
}

func flipByte(t *testing.T, path string, off int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	require.NoError(t, err)
	defer f.Close()
	var c [1]byte
	_, err = f.ReadAt(c[:], off)
	require.NoError(t, err)
	c[0] ^= 0x40
	_, err = f.WriteAt(c[:], off)
	require.NoError(t, err)
}

func TestDownloadRoundTrip(t *testing.T) {
	ctx := context.Background()
	b := newTestBackups(t)
	const backup = "2025-06-30_14-30"
	tree := slotTree(3, Slot{0, 0})
	src := t.TempDir()
	writeTree(t, src, tree)
	dirHash := fakeHash(true, "dir")
	var upCalls []int64
	var upTotal int64
	require.NoError(t, b.Upload(ctx, UploadRequest{Job: testJob, Backup: backup, Step: 3, Hash: dirHash, Source: src,
		Progress: func(done, total int64) { upCalls = append(upCalls, done); upTotal = total }}))
	assertProgress(t, upCalls, upTotal, tree)

	var downCalls []int64
	var downTotal int64
	dest := filepath.Join(t.TempDir(), dirHash+".data")
	require.NoError(t, b.Download(ctx, DownloadRequest{Job: testJob, Backup: backup, Hash: dirHash, Dest: dest,
		Progress: func(done, total int64) { downCalls = append(downCalls, done); downTotal = total }}))
	assert.Equal(t, tree, readTree(t, dest), "the restored tree, empty directories included")
	assertProgress(t, downCalls, downTotal, tree)

	err := b.Download(ctx, DownloadRequest{Job: testJob, Backup: backup, Hash: dirHash, Dest: dest})
	assert.ErrorIs(t, err, fs.ErrExist, "an existing destination is never overwritten")
	// The source kept no owners and modes (layout.AttrsFile): none in the backup, none restored.
	_, err = b.Store.Stat(ctx, testJob+"/"+backup+"/"+dirHash+".data.attrs")
	assert.True(t, IsNotFound(err), "%v", err)
	assert.NoFileExists(t, layout.AttrsFile(dest))

	// A single-file checkpoint is one object, <hash>.data. Its source keeps the owner and mode
	// the job saved it with: the backup holds them beside it, and the restore puts them beside
	// the data it restores.
	file := filepath.Join(t.TempDir(), "model.pt")
	require.NoError(t, os.WriteFile(file, []byte("torch weights"), 0o644))
	attrs := layout.NewAttrsBuilder(layout.Attr{Mode: 0o600, UID: 1000, GID: 1000}, false).Attrs()
	require.NoError(t, layout.WriteAttrs(file, attrs))
	fileHash := fakeHash(false, "file")
	require.NoError(t, b.Upload(ctx, UploadRequest{Job: testJob, Backup: backup, Step: 3, Slot: Slot{1, 0}, Hash: fileHash, Source: file}))
	stored, err := ReadSmall(ctx, b.Store, testJob+"/"+backup+"/"+fileHash+".data.attrs", 1<<10)
	require.NoError(t, err)
	assert.Equal(t, string(attrs.Encode()), string(stored))
	a, err := b.Store.Stat(ctx, testJob+"/"+backup+"/"+fileHash+".data")
	require.NoError(t, err)
	assert.Equal(t, int64(len("torch weights")), a.Size)
	dest = filepath.Join(t.TempDir(), fileHash+".data")
	require.NoError(t, b.Download(ctx, DownloadRequest{Job: testJob, Backup: backup, Hash: fileHash, Dest: dest, Attrs: true}))
	got, err := os.ReadFile(dest)
	require.NoError(t, err)
	assert.Equal(t, "torch weights", string(got))
	kept, err := layout.ReadAttrs(dest)
	require.NoError(t, err)
	assert.Equal(t, attrs, kept)
	// Attrs that do not parse restore the data with the agent's defaults, not at all.
	require.NoError(t, PutBytes(ctx, b.Store, testJob+"/"+backup+"/"+fileHash+".data.attrs", []byte("mtcfs attrs v9\n"), false))
	dest = filepath.Join(t.TempDir(), fileHash+".data")
	require.NoError(t, b.Download(ctx, DownloadRequest{Job: testJob, Backup: backup, Hash: fileHash, Dest: dest, Attrs: true}))
	assert.FileExists(t, dest)
	assert.NoFileExists(t, layout.AttrsFile(dest))

	r := verify(t, b, backup, VerifyOptions{Deep: true})
	assert.True(t, r.Complete(), "%+v", r)
	assert.Equal(t, map[Slot]string{{0, 0}: dirHash, {1, 0}: fileHash}, r.Steps[0].Data)

	err = b.Download(ctx, DownloadRequest{Job: testJob, Backup: backup, Hash: fakeHash(true, "absent"), Dest: filepath.Join(t.TempDir(), "x")})
	assert.True(t, IsNotFound(err), "data not in the backup: want NotFoundError, got %v", err)
}

// assertProgress checks that progress started at 0, never went back and
// ended at the total, which is the tree's byte count.
func assertProgress(t *testing.T, calls []int64, total int64, tree map[string]string) {
	t.Helper()
	var want int64
	for _, c := range tree {
		want += int64(len(c))
	}
	assert.Equal(t, want, total, "progress total")
	require.NotEmpty(t, calls)
	assert.Equal(t, int64(0), calls[0], "progress starts at 0")
	assert.Equal(t, want, calls[len(calls)-1], "progress ends at the total")
	assert.IsNonDecreasing(t, calls)
}

// recordingStore records successful Puts and PutFiles and can fail chosen
// ones.
type recordingStore struct {
	ObjectStore
	failOn string // substring of names whose Put or PutFile fails

	mu   sync.Mutex
	puts []string // GUARDED_BY(mu)
}

func (r *recordingStore) record(name string, put func() error) error {
	if r.failOn != "" && strings.Contains(name, r.failOn) {
		return errors.New("injected failure")
	}
	err := put()
	if err == nil {
		r.mu.Lock()
		r.puts = append(r.puts, name)
		r.mu.Unlock()
	}
	return err
}

func (r *recordingStore) Put(ctx context.Context, req PutRequest) error {
	return r.record(req.Name, func() error { return r.ObjectStore.Put(ctx, req) })
}

func (r *recordingStore) PutFile(ctx context.Context, t FileTransfer) (crc uint32, err error) {
	err = r.record(t.Name, func() error { crc, err = r.ObjectStore.PutFile(ctx, t); return err })
	return crc, err
}

func TestUploadWritesMetaLast(t *testing.T) {
	rec := &recordingStore{ObjectStore: newTestStore(t)}
	b := &Backups{Store: rec, Parallelism: 4}
	uploadStep(t, b, "2025-06-30_14-30", 1, 1, 1)
	n := len(rec.puts)
	require.Greater(t, n, 3)
	assert.True(t, strings.HasSuffix(rec.puts[n-1], ".meta"), "last Put: %s", rec.puts[n-1])
	assert.True(t, strings.HasSuffix(rec.puts[n-2], ".data.manifest"), "Put before the .meta: %s", rec.puts[n-2])
	for _, p := range rec.puts[:n-2] {
		assert.Contains(t, p, ".data/", "data objects come first")
	}
}

func TestFailedUploadLeavesNoMeta(t *testing.T) {
	rec := &recordingStore{ObjectStore: newTestStore(t), failOn: "array_1"}
	b := &Backups{Store: rec}
	src := t.TempDir()
	writeTree(t, src, slotTree(1, Slot{}))
	err := b.Upload(context.Background(), UploadRequest{Job: testJob, Backup: "2025-06-30_14-30", Step: 1, Hash: fakeHash(true, "x"), Source: src})
	require.ErrorContains(t, err, "injected failure")
	for _, p := range rec.puts {
		assert.False(t, strings.HasSuffix(p, ".meta") || strings.HasSuffix(p, ".manifest"), "nothing may claim the data after a failure: %s", p)
	}
	r, err := b.Verify(context.Background(), testJob, "2025-06-30_14-30", VerifyOptions{Nodes: 1, Workers: 1})
	if IsNotFound(err) {
		return // the failure stopped the other files before any was written
	}
	require.NoError(t, err)
	assert.Empty(t, r.Steps, "no .meta, no step")
	assert.False(t, r.Complete())
}

func TestUploadDataParallelMetaOnly(t *testing.T) {
	ctx := context.Background()
	b := newTestBackups(t)
	const backup = "2025-06-30_14-30"
	h := fakeHash(true, "column 0")

	// Rank 0's column-mate (rank 1, the last partition) has not uploaded yet.
	err := b.Upload(ctx, UploadRequest{Job: testJob, Backup: backup, Step: 4, Slot: Slot{0, 0}, Hash: h})
	assert.True(t, IsNotFound(err), "a .meta naming absent data must be refused, got %v", err)
	assert.ErrorIs(t, err, tiers.ErrDataNotInBackup)

	src := t.TempDir()
	writeTree(t, src, slotTree(4, Slot{}))
	require.NoError(t, b.Upload(ctx, UploadRequest{Job: testJob, Backup: backup, Step: 4, Slot: Slot{1, 0}, Hash: h, Source: src}))
	require.NoError(t, b.Upload(ctx, UploadRequest{Job: testJob, Backup: backup, Step: 4, Slot: Slot{0, 0}, Hash: h}))
	r := verify(t, b, backup, VerifyOptions{Nodes: 2, Workers: 1, Deep: true})
	assert.True(t, r.Complete(), "%+v", r)
	assert.Equal(t, map[Slot]string{{0, 0}: h, {1, 0}: h}, r.Steps[0].Data)
}

func TestConcurrentUploadsOfIdenticalData(t *testing.T) {
	b := newTestBackups(t)
	const backup = "2025-06-30_14-30"
	h := fakeHash(true, "same")
	var wg sync.WaitGroup
	var failures atomic.Int32
	for r := range 3 {
		src := t.TempDir()
		writeTree(t, src, slotTree(9, Slot{})) // identical content on every node
		wg.Go(func() {
			err := b.Upload(context.Background(), UploadRequest{Job: testJob, Backup: backup, Step: 9, Slot: Slot{r, 0}, Hash: h, Source: src})
			if !assert.NoError(t, err, "rank %d", r) {
				failures.Add(1)
			}
		})
	}
	wg.Wait()
	require.Zero(t, failures.Load())
	assert.True(t, verify(t, b, backup, VerifyOptions{Nodes: 3, Deep: true}).Complete())

	// The same name with other content is a conflict, not an overwrite.
	src := t.TempDir()
	writeTree(t, src, map[string]string{"_CHECKPOINT_METADATA": "different"})
	err := b.Upload(context.Background(), UploadRequest{Job: testJob, Backup: backup, Step: 9, Slot: Slot{3, 0}, Hash: h, Source: src})
	var pe *PreconditionError
	assert.True(t, errors.As(err, &pe), "want *PreconditionError, got %v", err)
}

func TestUploadRejectsBadRequests(t *testing.T) {
	ctx := context.Background()
	b := newTestBackups(t)
	dir := t.TempDir()
	writeTree(t, dir, map[string]string{"a": "a"})
	file := filepath.Join(dir, "a")
	ok := UploadRequest{Job: testJob, Backup: "2025-06-30_14-30", Hash: fakeHash(true, "x"), Source: dir}
	require.NoError(t, b.Upload(ctx, ok))

	for _, tc := range []struct {
		name    string
		edit    func(r *UploadRequest)
		wantErr string
	}{
		{"job with slash", func(r *UploadRequest) { r.Job = "a/b" }, "job name"},
		{"empty job", func(r *UploadRequest) { r.Job = "" }, "job name"},
		{"backup name", func(r *UploadRequest) { r.Backup = "latest" }, "YYYY-MM-DD_HH-MM"},
		{"hash", func(r *UploadRequest) { r.Hash = "D" + strings.Repeat("A", 64) }, "64 lowercase hex"},
		{"file hash for a directory", func(r *UploadRequest) { r.Hash = fakeHash(false, "x") }, "D prefix"},
		{"directory hash for a file", func(r *UploadRequest) { r.Source = file }, "D prefix"},
		{"missing source", func(r *UploadRequest) { r.Source = filepath.Join(dir, "absent") }, "no such file"},
		{"negative step", func(r *UploadRequest) { r.Step = -1 }, "negative"},
	} {
		req := ok
		tc.edit(&req)
		err := b.Upload(ctx, req)
		if assert.Error(t, err, tc.name) {
			assert.Contains(t, err.Error(), tc.wantErr, tc.name)
		}
	}
}

func TestNamesAndListOrder(t *testing.T) {
	ctx := context.Background()
	b := newTestBackups(t)
	for _, name := range []string{"2025-06-30_09-05", "2026-01-01_00-00", "2025-06-30_14-30"} {
		uploadStep(t, b, name, 1, 1, 1)
	}
	uploadStep(t, b, "2025-12-31_23-59", 1, 2, 1, Slot{0, 0}) // incomplete
	// Names that are not backups are ignored.
	put(t, b.Store, testJob+"/restore.version", "2025-06-30_14-30")
	put(t, b.Store, testJob+"/latest/x", "x")
	put(t, b.Store, testJob+"/2025-6-30_14-30/x", "x")
	put(t, b.Store, testJob+"/2025-06-30_14-30-extra/x", "x")
	put(t, b.Store, "other-job/2027-01-01_00-00/x", "x")

	want := []string{"2026-01-01_00-00", "2025-12-31_23-59", "2025-06-30_14-30", "2025-06-30_09-05"}
	got, err := b.Names(ctx, testJob)
	require.NoError(t, err)
	assert.Equal(t, want, got)

	reports, err := b.List(ctx, testJob)
	require.NoError(t, err)
	require.Len(t, reports, 4)
	for i, r := range reports {
		assert.Equal(t, want[i], r.Name)
		assert.Equal(t, r.Name != "2025-12-31_23-59", r.Complete(), "%s", r.Name)
	}

	none, err := b.Names(ctx, "no-such-job")
	require.NoError(t, err)
	assert.Empty(t, none)
	_, _, ok, err := b.NewestComplete(ctx, "no-such-job", 1, 1)
	require.NoError(t, err)
	assert.False(t, ok)
	_, err = b.Verify(ctx, testJob, "2020-01-01_00-00", VerifyOptions{})
	assert.True(t, IsNotFound(err), "a missing backup: want NotFoundError, got %v", err)
}

func TestRestoreVersion(t *testing.T) {
	ctx := context.Background()
	b := newTestBackups(t)

	_, ok, err := b.ReadRestoreVersion(ctx, testJob)
	require.NoError(t, err)
	assert.False(t, ok)

	require.NoError(t, b.SetRestoreVersion(ctx, testJob, "2025-06-30_14-30"))
	name, ok, err := b.ReadRestoreVersion(ctx, testJob)
	require.NoError(t, err)
	assert.True(t, ok)
	assert.Equal(t, "2025-06-30_14-30", name)

	// What `echo NAME | gcloud storage cp - …` or an editor writes.
	put(t, b.Store, testJob+"/restore.version", "  2025-07-01_00-00 \r\n\n")
	name, ok, err = b.ReadRestoreVersion(ctx, testJob)
	require.NoError(t, err)
	assert.True(t, ok)
	assert.Equal(t, "2025-07-01_00-00", name)

	assert.ErrorContains(t, b.SetRestoreVersion(ctx, testJob, "yesterday"), "YYYY-MM-DD_HH-MM")

	require.NoError(t, b.ClearRestoreVersion(ctx, testJob))
	_, ok, err = b.ReadRestoreVersion(ctx, testJob)
	require.NoError(t, err)
	assert.False(t, ok)
	require.NoError(t, b.ClearRestoreVersion(ctx, testJob), "clearing an absent pin is not an error")
}

// TestBackupNamesAreValid: the names the coordinator gives backups (layout.BackupName) are the
// ones this package accepts.
func TestBackupNamesAreValid(t *testing.T) {
	zone := time.FixedZone("UTC+9", 9*3600)
	for _, at := range []time.Time{time.Now(), time.Date(2025, 6, 30, 23, 30, 59, 999, zone)} {
		assert.NoError(t, validateBackupName(layout.BackupName(at)), at)
	}
	assert.Error(t, validateBackupName("2025-06-30_14-30-00"))
}

func TestParseMetaName(t *testing.T) {
	for _, tc := range []struct {
		name string
		step int64
		slot Slot
		ok   bool
	}{
		{"llama-7b-s100-n3-w1.meta", 100, Slot{3, 1}, true},
		{"llama-7b-s0-n0-w0.meta", 0, Slot{0, 0}, true},
		{"llama-7b-s007-n0-w0.meta", 0, Slot{}, false}, // not canonical
		{"llama-7b-s1-n01-w0.meta", 0, Slot{}, false},
		{"other-s1-n0-w0.meta", 0, Slot{}, false},
		{"llama-7b-s1-n0-w0.restore", 0, Slot{}, false},
		{"llama-7b-s1-n0-w0.meta.tmp", 0, Slot{}, false},
		{"llama-7b-s99999999999999999999-n0-w0.meta", 0, Slot{}, false}, // overflow
	} {
		step, slot, ok := parseMetaName(testJob, tc.name)
		assert.Equal(t, tc.ok, ok, tc.name)
		if tc.ok {
			assert.Equal(t, tc.step, step, tc.name)
			assert.Equal(t, tc.slot, slot, tc.name)
		}
	}
}

func TestDecodeManifestRejectsUntrustedContent(t *testing.T) {
	dir, file := fakeHash(true, "d"), fakeHash(false, "f")
	for _, tc := range []struct {
		hash, json, wantErr string
	}{
		{dir, `{"format":"mtcfs-manifest-v4","kind":"dir","files":[]}`, "format"},
		{file, `{"format":"mtcfs-manifest-v2","kind":"file","files":[{"path":"","size":1,"crc32c":"00000000","codec":"planecodec"}]}`, "compressed"},
		{dir, `{"format":"mtcfs-manifest-v1","kind":"file","files":[{"path":"","size":1,"crc32c":"00000000"}]}`, "kind"},
		{dir, `{"format":"mtcfs-manifest-v1","kind":"dir","files":[{"path":"../etc/passwd","size":1,"crc32c":"00000000"}]}`, ".."},
		{dir, `{"format":"mtcfs-manifest-v1","kind":"dir","files":[{"path":"/abs","size":1,"crc32c":"00000000"}]}`, "absolute"},
		{dir, `{"format":"mtcfs-manifest-v1","kind":"dir","dirs":["a/../../x"],"files":[]}`, ".."},
		{dir, `{"format":"mtcfs-manifest-v1","kind":"dir","files":[{"path":"a","size":1,"crc32c":"00000000"},{"path":"a","size":1,"crc32c":"00000000"}]}`, "twice"},
		{dir, `{"format":"mtcfs-manifest-v1","kind":"dir","files":[{"path":"a","size":-1,"crc32c":"00000000"}]}`, "negative"},
		{dir, `{"format":"mtcfs-manifest-v1","kind":"dir","files":[{"path":"a","size":1,"crc32c":"xyz"}]}`, "8 hex"},
		{file, `{"format":"mtcfs-manifest-v1","kind":"file","files":[{"path":"a","size":1,"crc32c":"00000000"}]}`, "single-file"},
		{file, `not json`, "invalid character"},
	} {
		_, err := decodeManifest([]byte(tc.json), tc.hash)
		if assert.Error(t, err, tc.json) {
			assert.Contains(t, err.Error(), tc.wantErr, tc.json)
		}
	}
	m, err := decodeManifest([]byte(`{"format":"mtcfs-manifest-v1","kind":"file","files":[{"path":"","size":3,"crc32c":"0000abcd"}],"future":1}`), file)
	require.NoError(t, err, "unknown fields are ignored")
	assert.Equal(t, crc32cHex(0xabcd), m.Files[0].CRC32C)
}

func TestForEach(t *testing.T) {
	ctx := context.Background()
	var running, peak atomic.Int32
	var done atomic.Int32
	require.NoError(t, forEach(ctx, 3, 50, func(ctx context.Context, i int) error {
		n := running.Add(1)
		for {
			p := peak.Load()
			if n <= p || peak.CompareAndSwap(p, n) {
				break
			}
		}
		time.Sleep(100 * time.Microsecond)
		running.Add(-1)
		done.Add(1)
		return nil
	}))
	assert.Equal(t, int32(50), done.Load())
	assert.LessOrEqual(t, peak.Load(), int32(3), "parallelism bound")

	// Call 0 fails; every other call holds its slot until the failure cancels its ctx, so
	// however the goroutines are scheduled, at most the two in flight and the one the loop
	// was already handing out start before the loop sees the cancellation.
	boom := errors.New("boom")
	var calls atomic.Int32
	err := forEach(ctx, 2, 1000, func(ctx context.Context, i int) error {
		calls.Add(1)
		if i == 0 {
			return boom
		}
		<-ctx.Done()
		return ctx.Err()
	})
	assert.ErrorIs(t, err, boom, "the first error is the one returned")
	assert.LessOrEqual(t, calls.Load(), int32(3), "an error stops further calls")

	cctx, cancel := context.WithCancel(ctx)
	cancel()
	assert.ErrorIs(t, forEach(cctx, 2, 10, func(context.Context, int) error { return nil }), context.Canceled)
}

// An upload that knows the job's shape records it in the backup, so that a backup missing the
// whole highest rank is incomplete also to a reader that does not know the shape (mtcfs backups
// list|verify, restore-version set).
// TestEachRequest: the parts of a file start in order, within the bound of
// requests shared by the files of one transfer, and an error stops the rest.
func TestEachRequest(t *testing.T) {
	ctx := context.Background()
	for _, units := range []int64{1, 2} {
		shared := semaphore.NewWeighted(units)
		var mu sync.Mutex
		order := map[int][]int{}
		var running, peak atomic.Int32
		errs := make([]error, 3)
		var wg sync.WaitGroup
		for f := range errs {
			wg.Go(func() {
				tr := FileTransfer{Requests: shared}
				errs[f] = tr.eachRequest(ctx, 20, func(ctx context.Context, i int) error {
					n := running.Add(1)
					for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
					}
					mu.Lock()
					order[f] = append(order[f], i)
					mu.Unlock()
					time.Sleep(100 * time.Microsecond)
					running.Add(-1)
					return nil
				})
			})
		}
		wg.Wait()
		for f, err := range errs {
			require.NoError(t, err, "file %d", f)
			require.Len(t, order[f], 20, "file %d", f)
			if units == 1 {
				// One unit: part i+1 cannot be acquired before part i released it.
				assert.IsIncreasing(t, order[f], "file %d: parts start in order", f)
			}
		}
		assert.LessOrEqual(t, peak.Load(), int32(units), "requests of all files within the shared bound")
	}

	boom := errors.New("boom")
	var calls atomic.Int32
	tr := FileTransfer{Requests: semaphore.NewWeighted(1)}
	err := tr.eachRequest(ctx, 100, func(ctx context.Context, i int) error {
		calls.Add(1)
		if i == 3 {
			return boom
		}
		return nil
	})
	assert.ErrorIs(t, err, boom)
	assert.Equal(t, int32(4), calls.Load(), "with one unit, nothing starts after the failing part")
}

// TestEachRequestReturnsWhyNotTheCancelled: the part that fails first cancels the others before
// it returns, and one of them may return its cancellation first; the error must still be the
// failure (a loaded run said "context canceled" where the read had given up after 3 attempts).
func TestEachRequestReturnsWhyNotTheCancelled(t *testing.T) {
	boom := errors.New("boom")
	part1Done := make(chan struct{})
	afterPartCancelled = func() { <-part1Done } // part 1 returns its cancellation first
	t.Cleanup(func() { afterPartCancelled = nil })
	tr := FileTransfer{Requests: semaphore.NewWeighted(2)}
	waiting := make(chan struct{})
	err := tr.eachRequest(context.Background(), 2, func(ctx context.Context, i int) error {
		if i == 1 {
			defer close(part1Done)
			close(waiting)
			<-ctx.Done()
			return fmt.Errorf("part 1: %w", ctx.Err())
		}
		<-waiting
		return boom
	})
	require.ErrorIs(t, err, boom)
}

func TestRecordedShapeFindsAMissingHighestRank(t *testing.T) {
	b := newTestBackups(t)
	const backup = "2025-06-30_14-30"
	src := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(src, "w"), []byte("weights"), 0o644))
	for r := range 2 { // rank 2 of 3 never uploads
		require.NoError(t, b.Upload(context.Background(), UploadRequest{
			Job: testJob, Backup: backup, Step: 7, Slot: Slot{r, 0}, Hash: fakeHash(true, fmt.Sprint(r)), Source: src,
			Shape: tiers.Shape{Nodes: 3, Workers: 1},
		}))
	}
	r := verify(t, b, backup, VerifyOptions{})
	assert.Equal(t, 3, r.Nodes, "the recorded shape, not the inferred one")
	assert.False(t, r.Inferred)
	require.Len(t, r.Steps, 1)
	assert.Equal(t, []string{"n2-w0: .meta missing"}, r.Steps[0].Problems)
	assert.False(t, r.Complete())
	// Another shape in the same backup is refused (the ranks disagree on the job).
	err := b.Upload(context.Background(), UploadRequest{Job: testJob, Backup: backup, Step: 7, Slot: Slot{2, 0},
		Hash: fakeHash(true, "2"), Source: src, Shape: tiers.Shape{Nodes: 4, Workers: 1}})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "shape")
}

// TestShapeRecordOfAnEarlierAgent: nodes of one job upgraded one after another write one backup.
// An earlier agent recorded the shape without data-parallelism; a later one, of the same nodes
// and workers, uploads into that backup (before, its create-if-absent record failed on the other
// bytes, and so did every upload of that node); another shape is still refused, and so is
// another data-parallelism than the 0 a node of this version recorded beside it.
func TestShapeRecordOfAnEarlierAgent(t *testing.T) {
	ctx := context.Background()
	b := newTestBackups(t)
	const backup = "2025-06-30_14-30"
	dir := testJob + "/" + backup + "/"
	require.NoError(t, PutBytes(ctx, b.Store, dir+shapeName, []byte(`{"format":"mtcfs-backup-v1","nodes":2,"workers":1}`), true))
	src := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(src, "w"), []byte("weights"), 0o644))
	up := func(rank int, shape tiers.Shape) error {
		return b.Upload(ctx, UploadRequest{Job: testJob, Backup: backup, Step: 7, Slot: Slot{rank, 0},
			Hash: fakeHash(true, fmt.Sprint(rank)), Source: src, Shape: shape})
	}
	require.NoError(t, up(0, tiers.Shape{Nodes: 2, Workers: 1}))
	// That node recorded its data-parallelism, 0, beside the earlier record: a node of the same
	// backup that says otherwise is of another job shape.
	err := up(1, tiers.Shape{Nodes: 2, Workers: 1, DataParallelism: 2})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "shape")
	err = up(1, tiers.Shape{Nodes: 3, Workers: 1})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "shape")
	require.NoError(t, up(1, tiers.Shape{Nodes: 2, Workers: 1}))
	r := verify(t, b, backup, VerifyOptions{})
	assert.Equal(t, 2, r.Nodes)
	assert.True(t, r.Complete(), "%+v", r)

	// Where no node of this version recorded a data-parallelism of 0, the earlier record says
	// nothing against a data-parallel job of the same nodes and workers.
	const dpBackup = "2025-06-30_14-31"
	require.NoError(t, PutBytes(ctx, b.Store, testJob+"/"+dpBackup+"/"+shapeName, []byte(`{"format":"mtcfs-backup-v1","nodes":2,"workers":1}`), true))
	for rank := range 2 {
		require.NoError(t, b.Upload(ctx, UploadRequest{Job: testJob, Backup: dpBackup, Step: 7, Slot: Slot{rank, 0},
			Hash: fakeHash(true, fmt.Sprint(rank)), Source: src, Shape: tiers.Shape{Nodes: 2, Workers: 1, DataParallelism: 2}}),
			"an unrecorded data-parallelism says nothing against it")
	}
}

// TestShapeRecordAsAnEarlierAgentWritesIt: without data-parallelism the record is the bytes an
// agent before data-parallelism writes for the same shape, so that such an agent, whose
// create-if-absent accepts no other bytes, uploads into a backup a later agent recorded first.
func TestShapeRecordAsAnEarlierAgentWritesIt(t *testing.T) {
	ctx := context.Background()
	b := newTestBackups(t)
	const backup = "2025-06-30_14-30"
	dir := testJob + "/" + backup + "/"
	require.NoError(t, b.putShape(ctx, dir, tiers.Shape{Nodes: 2, Workers: 1}))
	earlier := []byte(`{"format":"mtcfs-backup-v1","nodes":2,"workers":1}`)
	require.NoError(t, PutBytes(ctx, b.Store, dir+shapeName, earlier, true), "an earlier agent's create-if-absent")
	got, err := ReadSmall(ctx, b.Store, dir+shapeName, 4096)
	require.NoError(t, err)
	assert.Equal(t, string(earlier), string(got))
	s0, ok := b.readShape(ctx, dir)
	require.True(t, ok)
	assert.Equal(t, 0, s0.DataParallelism, "off, as recorded beside it (not 'not recorded')")

	const dp = "2025-06-30_14-31"
	require.NoError(t, b.putShape(ctx, testJob+"/"+dp+"/", tiers.Shape{Nodes: 4, Workers: 1, DataParallelism: 2}))
	s, ok := b.readShape(ctx, testJob+"/"+dp+"/")
	require.True(t, ok)
	assert.Equal(t, 2, s.DataParallelism, "data-parallelism is recorded when there is some")
}

// TestMetaNamingNoDataIsDamage: a .meta is written last, by mtcfs, and names a data hash; one
// that names none was written over since.
func TestMetaNamingNoDataIsDamage(t *testing.T) {
	b := newTestBackups(t)
	const backup = "2025-06-30_14-30"
	uploadStep(t, b, backup, 7, 1, 1)
	require.NoError(t, PutBytes(context.Background(), b.Store, testJob+"/"+backup+"/"+metaName(testJob, 7, Slot{0, 0}), []byte("not a hash"), false))
	r := verify(t, b, backup, VerifyOptions{})
	require.Len(t, r.Steps, 1)
	assert.False(t, r.Steps[0].Complete)
	assert.True(t, r.Steps[0].Damaged)
	assert.Contains(t, strings.Join(r.Steps[0].Problems, "\n"), "is not a data hash")
}

// TestMarkDamaged: data a restore found damaged (bit rot that left the listing's CRC32C alone,
// so the cheap verification passes) makes its steps damaged from then on, with the reason.
func TestMarkDamaged(t *testing.T) {
	ctx := context.Background()
	b := newTestBackups(t)
	const backup = "2025-06-30_14-30"
	hashes := uploadStep(t, b, backup, 5, 2, 1)
	r := verify(t, b, backup, VerifyOptions{})
	require.True(t, r.Steps[0].Complete)

	require.NoError(t, b.MarkDamaged(ctx, testJob, backup, hashes[Slot{1, 0}], "rank 1: crc32c mismatch"))
	r = verify(t, b, backup, VerifyOptions{})
	require.Len(t, r.Steps, 1)
	assert.False(t, r.Steps[0].Complete)
	assert.True(t, r.Steps[0].Damaged)
	assert.Equal(t, []string{hashes[Slot{1, 0}] + ".data: a restore found it damaged: rank 1: crc32c mismatch"}, r.Steps[0].Problems)
	_, _, ok, err := b.NewestComplete(ctx, testJob, 2, 1)
	require.NoError(t, err)
	assert.False(t, ok, "a damaged step is never chosen")
	assert.Error(t, b.MarkDamaged(ctx, testJob, backup, "not-a-hash", "x"))

	// Deleting the record (a backup repaired by hand, as the README says) clears it.
	require.NoError(t, b.Store.Delete(ctx, testJob+"/"+backup+"/"+hashes[Slot{1, 0}]+".data.damaged"))
	r = verify(t, b, backup, VerifyOptions{})
	assert.True(t, r.Steps[0].Complete, r.Steps[0].Problems)
	assert.False(t, r.Steps[0].Damaged)
}

// hidingStore lists as a paged GCS listing can while an upload finishes: the first hide
// listings lack the objects named in hidden (written before the .meta the listing shows).
type hidingStore struct {
	ObjectStore
	hidden map[string]bool
	hide   int
	lists  int
}

func (s *hidingStore) List(ctx context.Context, prefix, delimiter string) ([]ObjectAttrs, []string, error) {
	objs, prefixes, err := s.ObjectStore.List(ctx, prefix, delimiter)
	if s.lists++; s.lists > s.hide {
		return objs, prefixes, err
	}
	var kept []ObjectAttrs
	for _, o := range objs {
		if !s.hidden[o.Name] {
			kept = append(kept, o)
		}
	}
	return kept, prefixes, err
}

// TestDamageIsConfirmedByASecondListing: a step whose data one listing missed is looked at
// again; only data missing from both listings is damage. An upload that finished during a paged
// listing is not reported damaged.
func TestDamageIsConfirmedByASecondListing(t *testing.T) {
	const backup = "2025-06-30_14-30"
	for _, tc := range []struct {
		hide    int
		damaged bool
	}{{1, false}, {2, true}} {
		b := newTestBackups(t)
		hashes := uploadStep(t, b, backup, 5, 1, 1)
		objs, _, err := b.Store.List(context.Background(), testJob+"/"+backup+"/", "")
		require.NoError(t, err)
		hidden := map[string]bool{}
		for _, o := range objs {
			if strings.HasPrefix(o.Name, testJob+"/"+backup+"/"+hashes[Slot{0, 0}]+".data/") {
				hidden[o.Name] = true
				break
			}
		}
		require.Len(t, hidden, 1)
		hs := &hidingStore{ObjectStore: b.Store, hidden: hidden, hide: tc.hide}
		r, err := (&Backups{Store: hs}).Verify(context.Background(), testJob, backup, VerifyOptions{})
		require.NoError(t, err)
		require.Len(t, r.Steps, 1)
		assert.Equal(t, tc.damaged, r.Steps[0].Damaged, "hidden from %d listing(s)", tc.hide)
		assert.Equal(t, 2, hs.lists, "a step that looks damaged is listed again")

		// A deep verification reads every object: it does not do so twice.
		hs.lists = 0
		r, err = (&Backups{Store: hs}).Verify(context.Background(), testJob, backup, VerifyOptions{Deep: true})
		require.NoError(t, err)
		assert.Equal(t, 1, hs.lists, "a deep verification lists once")
		assert.False(t, r.Steps[0].Complete)
	}
}

// TestManifestOfANewerVersionIsNotDamage: a manifest this version cannot read is a problem
// (the step is not restorable here) but not damage: after a downgrade, the backup is intact.
func TestManifestOfANewerVersionIsNotDamage(t *testing.T) {
	b := newTestBackups(t)
	const backup = "2025-06-30_14-30"
	hashes := uploadStep(t, b, backup, 5, 1, 1)
	h := hashes[Slot{0, 0}]
	name := testJob + "/" + backup + "/" + manifestName(h)
	data, err := ReadSmall(context.Background(), b.Store, name, 1<<20)
	require.NoError(t, err)
	newer := strings.Replace(string(data), `"format":"`, `"format":"x-`, 1)
	require.NotEqual(t, string(data), newer)
	require.NoError(t, PutBytes(context.Background(), b.Store, name, []byte(newer), false))
	r := verify(t, b, backup, VerifyOptions{})
	require.Len(t, r.Steps, 1)
	assert.False(t, r.Steps[0].Complete)
	assert.False(t, r.Steps[0].Damaged)
	assert.Contains(t, strings.Join(r.Steps[0].Problems, "\n"), "a newer mtcfs wrote it?")
}

// listCountingStore counts the listings of a backup.
type listCountingStore struct {
	ObjectStore
	lists atomic.Int32
}

func (s *listCountingStore) List(ctx context.Context, prefix, delim string) ([]ObjectAttrs, []string, error) {
	s.lists.Add(1)
	return s.ObjectStore.List(ctx, prefix, delim)
}

// TestVerifyListsOnceWhenDamageIsRecorded: a step damaged by a record (MarkDamaged) or a .meta
// that names no data is damaged whatever a second listing shows, so Verify does not list and
// read the backup again for it (it did at every restore plan once a restore had marked it). A
// step damaged by what the listing showed (an object missing) is still listed twice.
func TestVerifyListsOnceWhenDamageIsRecorded(t *testing.T) {
	ctx := context.Background()
	counting := &listCountingStore{ObjectStore: newTestStore(t)}
	b := &Backups{Store: counting, Parallelism: 3}
	const backup = "2025-06-30_14-30"
	hashes := uploadStep(t, b, backup, 5, 2, 1)
	require.NoError(t, b.MarkDamaged(ctx, testJob, backup, hashes[Slot{1, 0}], "rank 1: crc32c mismatch"))
	counting.lists.Store(0)
	r := verify(t, b, backup, VerifyOptions{})
	require.True(t, r.Steps[0].Damaged)
	assert.Equal(t, int32(1), counting.lists.Load(), "listings of a backup whose damage is recorded")

	// The record goes and an object of the data goes: damage only the listing shows.
	require.NoError(t, b.Store.Delete(ctx, testJob+"/"+backup+"/"+hashes[Slot{1, 0}]+".data.damaged"))
	objs, _, err := b.Store.List(ctx, testJob+"/"+backup+"/"+hashes[Slot{1, 0}]+".data/", "")
	require.NoError(t, err)
	require.NotEmpty(t, objs)
	require.NoError(t, b.Store.Delete(ctx, objs[0].Name))
	counting.lists.Store(0)
	r = verify(t, b, backup, VerifyOptions{})
	require.True(t, r.Steps[0].Damaged)
	assert.Equal(t, int32(2), counting.lists.Load(), "listings of a backup damaged as its listing shows")
}
