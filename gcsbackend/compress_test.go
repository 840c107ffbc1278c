package gcsbackend

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/planecodec"
)

// trainingData returns a planecodec/testdata file (weights and Adam moments
// of a real training run) repeated times times.
func trainingData(t testing.TB, name string, times int) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "planecodec", "testdata", name))
	require.NoError(t, err)
	return bytes.Repeat(b, times)
}

// compressedTree is a checkpoint as a trainer writes it: bf16 and fp32
// weights and moments (compressible), random bytes (not), small metadata.
func compressedTree(t testing.TB) map[string][]byte {
	return map[string][]byte{
		"state/weights_bf16":   trainingData(t, "weights_bf16.bin", 5), // 3.5 MiB: parts on the fake GCS
		"state/adam_m_bf16":    trainingData(t, "adam_m_bf16.bin", 1),
		"state/adam_v_bf16":    trainingData(t, "adam_v_bf16.bin", 1),
		"state/weights_fp32":   trainingData(t, "weights_fp32.bin", 1),
		"state/random":         randomBytes(1<<20+123, 5),
		"_CHECKPOINT_METADATA": []byte(`{"step": 7}`),
		"state/empty":          {},
	}
}

func writeBinTree(t testing.TB, root string, files map[string][]byte) {
	t.Helper()
	for rel, content := range files {
		p := filepath.Join(root, filepath.FromSlash(rel))
		require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
		require.NoError(t, os.WriteFile(p, content, 0o644))
	}
}

func requireSameFiles(t *testing.T, want map[string][]byte, root string) {
	t.Helper()
	got := readTree(t, root)
	require.Len(t, got, len(want), "files below %s", root)
	for rel, content := range want {
		g, ok := got[rel]
		require.True(t, ok, "%s missing", rel)
		require.True(t, bytes.Equal(content, []byte(g)), "%s differs (%d bytes, want %d)", rel, len(g), len(content))
	}
}

// compressedBackups is a Backups with compression on and small chunks, so
// that test files span many chunks and the GCS store's parts cut chunks.
func compressedBackups(store ObjectStore) *Backups {
	return &Backups{Store: store, Compress: CompressAuto, chunkLenForTest: 256 << 10}
}

func uploadTree(t *testing.T, b *Backups, backup string, step int64, slot Slot, files map[string][]byte) string {
	t.Helper()
	src := t.TempDir()
	writeBinTree(t, src, files)
	h := fakeHash(true, fmt.Sprint(backup, step, slot, b.Compress))
	require.NoError(t, b.Upload(context.Background(), UploadRequest{Job: testJob, Backup: backup, Step: step, Slot: slot, Hash: h, Source: src}))
	return h
}

func readTestManifest(t *testing.T, b *Backups, backup, hash string) *manifest {
	t.Helper()
	m, err := b.readManifest(context.Background(), backupDir(testJob, backup), hash)
	require.NoError(t, err)
	return m
}

// TestCompressedRoundTrip: with Compress auto the bf16 and fp32 files are
// stored compressed, smaller, and recorded as such in a v3 manifest; random
// bytes and small files stay plain; the backup verifies complete, cheaply and
// deeply, and restores byte for byte, on file:// and on GCS.
func TestCompressedRoundTrip(t *testing.T) {
	for _, st := range []struct {
		name     string
		newStore func(*testing.T) ObjectStore
	}{{"file", newTestLocalDir}, {"gcs", newTestFakeGCS}} {
		t.Run(st.name, func(t *testing.T) {
			ctx := context.Background()
			b := compressedBackups(st.newStore(t))
			files := compressedTree(t)
			var done, total int64
			src := t.TempDir()
			writeBinTree(t, src, files)
			h := fakeHash(true, "round trip")
			require.NoError(t, b.Upload(ctx, UploadRequest{Job: testJob, Backup: "2026-01-01_00-00", Step: 7, Hash: h, Source: src,
				Progress: func(d, tot int64) { assert.GreaterOrEqual(t, d, done); done, total = d, tot }}))
			assert.Equal(t, total, done, "upload progress ends at the file bytes")

			m := readTestManifest(t, b, "2026-01-01_00-00", h)
			assert.Equal(t, manifestFormatV3, m.Format)
			dir := backupDir(testJob, "2026-01-01_00-00")
			for _, f := range m.Files {
				a, err := b.Store.Stat(ctx, dir+f.object(h))
				require.NoError(t, err)
				switch {
				case strings.Contains(string(f.Path), "bf16"):
					require.Equal(t, codecPlanes, f.Codec, f.Path)
					assert.Less(t, float64(a.Size), 0.75*float64(f.Size), "%s stored in %d bytes of %d", f.Path, a.Size, f.Size)
					assert.Equal(t, f.StoredSize, a.Size)
					assert.Equal(t, uint32(f.StoredCRC32C), a.CRC32C)
				case strings.Contains(string(f.Path), "fp32"):
					require.Equal(t, codecPlanes, f.Codec, f.Path)
					assert.Less(t, float64(a.Size), 0.9*float64(f.Size), "%s stored in %d bytes of %d", f.Path, a.Size, f.Size)
				default:
					assert.Empty(t, f.Codec, "%s stays plain", f.Path)
					assert.Equal(t, f.Size, a.Size)
				}
				assert.Equal(t, crc32.Checksum(files[string(f.Path)], crcTable), uint32(f.CRC32C), "%s: the manifest's crc32c is the plain bytes'", f.Path)
			}

			for _, deep := range []bool{false, true} {
				rep, err := b.Verify(ctx, testJob, "2026-01-01_00-00", VerifyOptions{Nodes: 1, Workers: 1, Deep: deep})
				require.NoError(t, err)
				require.True(t, rep.Complete(), "deep %v: %+v", deep, rep.Steps)
			}

			// A reader with compression off restores it too.
			plain := &Backups{Store: b.Store}
			dest := filepath.Join(t.TempDir(), "restored")
			done, total = 0, 0
			require.NoError(t, plain.Download(ctx, DownloadRequest{Job: testJob, Backup: "2026-01-01_00-00", Hash: h, Dest: dest,
				Progress: func(d, tot int64) { assert.GreaterOrEqual(t, d, done); done, total = d, tot }}))
			assert.Equal(t, total, done, "download progress ends at the file bytes")
			requireSameFiles(t, files, dest)
		})
	}
}

// TestCompressRandomData: data that does not compress is stored as it is —
// not a byte larger, and readable by any tool — and the manifest keeps the
// old format.
func TestCompressRandomData(t *testing.T) {
	ctx := context.Background()
	b := compressedBackups(newTestLocalDir(t))
	files := map[string][]byte{"a": randomBytes(3<<20, 1), "b": randomBytes(1<<20+7, 2)}
	h := uploadTree(t, b, "2026-01-01_00-00", 1, Slot{}, files)
	m := readTestManifest(t, b, "2026-01-01_00-00", h)
	assert.Equal(t, manifestFormatV1, m.Format)
	var plain, stored int64
	for _, f := range m.Files {
		a, err := b.Store.Stat(ctx, backupDir(testJob, "2026-01-01_00-00")+f.object(h))
		require.NoError(t, err)
		plain += f.Size
		stored += a.Size
		assert.Empty(t, f.Codec)
	}
	assert.LessOrEqual(t, float64(stored), 1.005*float64(plain), "random data stored in %d bytes of %d", stored, plain)
}

// TestCompressedCorruptChunk: a stored chunk damaged after the upload is
// reported by Verify (cheap and deep), and refused by Download, which
// leaves nothing at the destination.
func TestCompressedCorruptChunk(t *testing.T) {
	quickReadsAgain(t) // damage in the store reads alike twice
	for _, st := range []struct {
		name     string
		newStore func(*testing.T) ObjectStore
	}{{"file", newTestLocalDir}, {"gcs", newTestFakeGCS}} {
		t.Run(st.name, func(t *testing.T) {
			ctx := context.Background()
			b := compressedBackups(st.newStore(t))
			files := map[string][]byte{"w": trainingData(t, "weights_bf16.bin", 2)}
			h := uploadTree(t, b, "2026-01-01_00-00", 1, Slot{}, files)
			m := readTestManifest(t, b, "2026-01-01_00-00", h)
			f := m.Files[0]
			require.Equal(t, codecPlanes, f.Codec)
			name := backupDir(testJob, "2026-01-01_00-00") + f.object(h)

			// Flip one byte in the middle of the second chunk, size unchanged.
			r, err := b.Store.Open(ctx, name, 0, -1)
			require.NoError(t, err)
			var buf bytes.Buffer
			_, err = buf.ReadFrom(r)
			r.Close()
			require.NoError(t, err)
			data := buf.Bytes()
			data[f.Chunks[0]+f.Chunks[1]/2] ^= 0x10
			require.NoError(t, PutBytes(ctx, b.Store, name, data, false))

			for _, deep := range []bool{false, true} {
				rep, err := b.Verify(ctx, testJob, "2026-01-01_00-00", VerifyOptions{Nodes: 1, Workers: 1, Deep: deep})
				require.NoError(t, err)
				require.False(t, rep.Complete(), "deep %v", deep)
				assert.Contains(t, strings.Join(rep.Steps[0].Problems, "\n"), "w", "deep %v", deep)
			}
			dest := filepath.Join(t.TempDir(), "restored")
			err = b.Download(ctx, DownloadRequest{Job: testJob, Backup: "2026-01-01_00-00", Hash: h, Dest: dest})
			require.Error(t, err)
			assert.ErrorIs(t, err, planecodec.ErrCorrupt)
			assert.NoFileExists(t, dest)
			assert.NoDirExists(t, dest)

			// The deep check does not trust the store's CRC32C: make the
			// manifest agree with the damaged object, and it still fails.
			m.Files[0].StoredCRC32C = crc32cHex(crc32.Checksum(data, crcTable))
			enc, err := m.encode()
			require.NoError(t, err)
			require.NoError(t, PutBytes(ctx, b.Store, backupDir(testJob, "2026-01-01_00-00")+manifestName(h), enc, false))
			rep, err := b.Verify(ctx, testJob, "2026-01-01_00-00", VerifyOptions{Nodes: 1, Workers: 1})
			require.NoError(t, err)
			require.True(t, rep.Complete(), "the cheap check trusts the store's CRC32C")
			rep, err = b.Verify(ctx, testJob, "2026-01-01_00-00", VerifyOptions{Nodes: 1, Workers: 1, Deep: true})
			require.NoError(t, err)
			require.False(t, rep.Complete(), "the deep check decodes every chunk")
			err = b.Download(ctx, DownloadRequest{Job: testJob, Backup: "2026-01-01_00-00", Hash: h, Dest: dest})
			assert.ErrorIs(t, err, planecodec.ErrCorrupt)
		})
	}
}

// quickReadsAgain makes the pauses between reads of bytes damaged on the way short for the test.
func quickReadsAgain(t *testing.T) {
	old := transitPause
	transitPause = time.Millisecond
	t.Cleanup(func() { transitPause = old })
}

// damagingStore flips one byte, at a different place each time, in the first
// damage reads of objects whose name contains match: bytes damaged on the way.
type damagingStore struct {
	ObjectStore
	match  string
	mu     sync.Mutex
	damage int // reads left to damage (negative: all)
	reads  int // reads damaged
}

func (s *damagingStore) Open(ctx context.Context, name string, off, length int64) (io.ReadCloser, error) {
	r, err := s.ObjectStore.Open(ctx, name, off, length)
	if err != nil || !strings.Contains(name, s.match) {
		return r, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.damage == 0 {
		return r, nil
	}
	s.damage--
	s.reads++
	b, err := io.ReadAll(r)
	r.Close()
	if err != nil {
		return nil, err
	}
	if len(b) > 0 {
		b[(len(b)/3+s.reads*7919)%len(b)] ^= 0x20
	}
	return io.NopCloser(bytes.NewReader(b)), nil
}

// TestCompressedChunkDamagedOnTheWay: a compressed object whose bytes arrive
// damaged is read again from the damaged chunk: damaged a few times, the
// download restores it byte for byte and a deep verify finds nothing; damaged
// differently on every read, both fail saying so, not with planecodec's
// ErrCorrupt (a restore marks the backup's data damaged for good on that).
// Before, the first damaged read failed the download, and two such downloads
// marked intact backup data damaged.
func TestCompressedChunkDamagedOnTheWay(t *testing.T) {
	quickReadsAgain(t)
	ctx := context.Background()
	ds := &damagingStore{ObjectStore: newTestLocalDir(t)}
	b := compressedBackups(ds)
	files := map[string][]byte{"w": trainingData(t, "weights_bf16.bin", 2)}
	h := uploadTree(t, b, "2026-01-01_00-00", 1, Slot{}, files)
	m := readTestManifest(t, b, "2026-01-01_00-00", h)
	require.Equal(t, codecPlanes, m.Files[0].Codec)
	ds.match = m.Files[0].object(h)

	ds.damage = transitReads - 1
	dest := filepath.Join(t.TempDir(), "restored")
	require.NoError(t, b.Download(ctx, DownloadRequest{Job: testJob, Backup: "2026-01-01_00-00", Hash: h, Dest: dest}))
	require.Equal(t, transitReads-1, ds.reads, "every damaged read was made")
	requireSameFiles(t, files, dest)

	ds.damage, ds.reads = transitReads-1, 0
	rep, err := b.Verify(ctx, testJob, "2026-01-01_00-00", VerifyOptions{Nodes: 1, Workers: 1, Deep: true})
	require.NoError(t, err)
	require.True(t, rep.Complete(), "problems: %v", rep.Steps[0].Problems)
	require.Equal(t, transitReads-1, ds.reads)

	ds.damage = -1
	dest2 := filepath.Join(t.TempDir(), "restored")
	err = b.Download(ctx, DownloadRequest{Job: testJob, Backup: "2026-01-01_00-00", Hash: h, Dest: dest2})
	require.Error(t, err)
	assert.NotErrorIs(t, err, planecodec.ErrCorrupt, "damaged on the way is not damage in the store")
	assert.Contains(t, err.Error(), "damaged on the way")
	assert.NoFileExists(t, dest2)
	assert.NoDirExists(t, dest2)
	_, err = b.Verify(ctx, testJob, "2026-01-01_00-00", VerifyOptions{Nodes: 1, Workers: 1, Deep: true})
	require.Error(t, err, "a deep verify that cannot read the bytes intact says so, not DAMAGED")
	assert.Contains(t, err.Error(), "damaged on the way")
}

// TestOldManifestRestores: a backup written before compression existed (a
// v1 manifest as earlier versions wrote it, plain objects) restores and
// verifies with compression on, and compression off still writes exactly
// that format.
func TestOldManifestRestores(t *testing.T) {
	ctx := context.Background()
	store := newTestLocalDir(t)
	h := fakeHash(true, "old")
	dir := backupDir(testJob, "2025-06-01_00-00")
	content := trainingData(t, "weights_bf16.bin", 1)
	require.NoError(t, PutBytes(ctx, store, dir+dataObject(h, "state/w"), content, true))
	old := fmt.Sprintf(`{"format":"mtcfs-manifest-v1","kind":"dir","dirs":["state"],"files":[{"path":"state/w","size":%d,"crc32c":"%08x"}]}`+"\n",
		len(content), crc32.Checksum(content, crcTable))
	require.NoError(t, PutBytes(ctx, store, dir+manifestName(h), []byte(old), true))
	require.NoError(t, PutBytes(ctx, store, dir+metaName(testJob, 3, Slot{}), []byte(h), true))

	b := compressedBackups(store)
	rep, err := b.Verify(ctx, testJob, "2025-06-01_00-00", VerifyOptions{Deep: true})
	require.NoError(t, err)
	require.True(t, rep.Complete(), "%+v", rep.Steps)
	dest := filepath.Join(t.TempDir(), "restored")
	require.NoError(t, b.Download(ctx, DownloadRequest{Job: testJob, Backup: "2025-06-01_00-00", Hash: h, Dest: dest}))
	requireSameFiles(t, map[string][]byte{"state/w": content}, dest)

	// Compression off writes the old format, byte for byte.
	off := &Backups{Store: store}
	src := t.TempDir()
	writeBinTree(t, src, map[string][]byte{"state/w": content})
	h2 := fakeHash(true, "old, again")
	require.NoError(t, off.Upload(ctx, UploadRequest{Job: testJob, Backup: "2025-06-01_00-01", Step: 3, Hash: h2, Source: src}))
	got, err := ReadSmall(ctx, store, backupDir(testJob, "2025-06-01_00-01")+manifestName(h2), 1<<20)
	require.NoError(t, err)
	assert.Equal(t, old, string(got))
}

// TestManifestV3Checks: compressed entries are refused in older formats and
// when their fields disagree.
func TestManifestV3Checks(t *testing.T) {
	h := fakeHash(false, "one file")
	good := manifestFile{Size: 600 << 10, CRC32C: 1, Codec: codecPlanes, StoredSize: 280<<10 + 60, StoredCRC32C: 2,
		ChunkLen: 256 << 10, Chunks: []int64{100<<10 + 20, 100<<10 + 20, 80<<10 + 20}}
	m := &manifest{Kind: kindFile, Files: []manifestFile{good}}
	data, err := m.encode()
	require.NoError(t, err)
	_, err = decodeManifest(data, h)
	require.NoError(t, err)
	assert.Contains(t, string(data), manifestFormatV3)

	for name, edit := range map[string]func(f *manifestFile, m *manifest){
		"v2 format":     func(f *manifestFile, m *manifest) { m.Format = manifestFormatV2 },
		"unknown codec": func(f *manifestFile, m *manifest) { f.Codec = "zstd" },
		"missing codec": func(f *manifestFile, m *manifest) { f.Codec = "" },
		"chunk count":   func(f *manifestFile, m *manifest) { f.Chunks = f.Chunks[:2] },
		"stored size":   func(f *manifestFile, m *manifest) { f.StoredSize++ },
		"huge chunk":    func(f *manifestFile, m *manifest) { f.ChunkLen = 1 << 30 },
		"chunk above file": func(f *manifestFile, m *manifest) {
			f.Chunks[2] = 200 << 10
			f.StoredSize = f.Chunks[0] + f.Chunks[1] + f.Chunks[2]
		},
	} {
		f := good
		f.Chunks = append([]int64(nil), good.Chunks...)
		m := &manifest{Format: manifestFormatV3, Kind: kindFile, Files: []manifestFile{f}}
		edit(&m.Files[0], m)
		data, err := json.Marshal(m)
		require.NoError(t, err)
		_, err = decodeManifest(data, h)
		assert.Error(t, err, name)
	}
}

// TestExport: export writes the complete steps of a compressed backup in the
// plain reference layout, into a new directory whose missing parents it
// makes; a missing backup and a non-empty or unusable destination are clear errors.
func TestExport(t *testing.T) {
	ctx := context.Background()
	b := compressedBackups(newTestLocalDir(t))
	files0 := compressedTree(t)
	files1 := map[string][]byte{"model.safetensors": trainingData(t, "adam_v_bf16.bin", 2)}
	h0 := uploadHashedTree(t, b, "2026-01-01_00-00", 5, Slot{0, 0}, files0)
	h1 := uploadHashedTree(t, b, "2026-01-01_00-00", 5, Slot{1, 0}, files1)

	out := filepath.Join(t.TempDir(), "exports", "llama", "export") // missing parents are made
	var last, total int64
	rep, err := b.Export(ctx, ExportRequest{Job: testJob, Backup: "2026-01-01_00-00", Dir: out,
		Progress: func(d, tot int64) { assert.GreaterOrEqual(t, d, last); last, total = d, tot }})
	require.NoError(t, err)
	assert.Equal(t, []int64{5}, rep.Steps)
	assert.Equal(t, total, last)
	assert.Equal(t, total, rep.Bytes)
	requireSameFiles(t, files0, filepath.Join(out, h0+".data"))
	requireSameFiles(t, files1, filepath.Join(out, h1+".data"))
	for slot, h := range map[Slot]string{{0, 0}: h0, {1, 0}: h1} {
		got, err := os.ReadFile(filepath.Join(out, metaName(testJob, 5, slot)))
		require.NoError(t, err)
		assert.Equal(t, h, string(got))
	}
	entries, err := os.ReadDir(out)
	require.NoError(t, err)
	assert.Len(t, entries, 4, "two .meta and two .data, nothing else (the owners and modes stay behind: %v)", entries)

	_, err = b.Export(ctx, ExportRequest{Job: testJob, Backup: "2026-01-01_00-00", Dir: out})
	assert.ErrorContains(t, err, "not empty")

	// A backup whose data a restore recorded damaged says so (it said "no complete step").
	require.NoError(t, b.MarkDamaged(ctx, testJob, "2026-01-01_00-00", h1, "test: failed its check"))
	_, err = b.Export(ctx, ExportRequest{Job: testJob, Backup: "2026-01-01_00-00", Dir: filepath.Join(t.TempDir(), "d")})
	assert.ErrorContains(t, err, "is DAMAGED")
	assert.ErrorContains(t, err, "test: failed its check")
	require.NoError(t, b.Store.Delete(ctx, backupDir(testJob, "2026-01-01_00-00")+dataName(h1)+".damaged"))
	_, err = b.Export(ctx, ExportRequest{Job: testJob, Backup: "2026-02-02_00-00", Dir: filepath.Join(t.TempDir(), "x")})
	var nf *NotFoundError
	assert.True(t, errors.As(err, &nf), "missing backup: %v", err)
	file := filepath.Join(t.TempDir(), "file")
	require.NoError(t, os.WriteFile(file, nil, 0o644))
	_, err = b.Export(ctx, ExportRequest{Job: testJob, Backup: "2026-01-01_00-00", Dir: file})
	assert.ErrorContains(t, err, "not a directory")
	_, err = b.Export(ctx, ExportRequest{Job: testJob, Backup: "2026-01-01_00-00", Dir: filepath.Join(file, "sub")})
	assert.Error(t, err)

	// A data whose content does not hash to its name (stored under a wrong name, or changed
	// behind the manifest's back) is refused, and no .meta points at it.
	uploadTree(t, b, "2026-01-02_00-00", 6, Slot{0, 0}, files1)
	bad := filepath.Join(t.TempDir(), "bad")
	_, err = b.Export(ctx, ExportRequest{Job: testJob, Backup: "2026-01-02_00-00", Dir: bad})
	assert.ErrorContains(t, err, "content hashes to")
	metas, _ := filepath.Glob(filepath.Join(bad, "*.meta"))
	assert.Empty(t, metas)
}

// uploadHashedTree is uploadTree with the tree's real BLAKE3 name, as the agent names data,
// and the owners and modes the agent keeps beside it.
func uploadHashedTree(t *testing.T, b *Backups, backup string, step int64, slot Slot, files map[string][]byte) string {
	t.Helper()
	src := t.TempDir()
	writeBinTree(t, src, files)
	require.NoError(t, layout.WriteAttrs(src, layout.NewAttrsBuilder(layout.Attr{Mode: 0o700, UID: 1000, GID: 1000}, true).Attrs()))
	h, isDir, err := layout.HashData(context.Background(), src)
	require.NoError(t, err)
	require.True(t, isDir)
	h = strings.TrimSuffix(layout.DataName(h, isDir), ".data")
	require.NoError(t, b.Upload(context.Background(), UploadRequest{Job: testJob, Backup: backup, Step: step, Slot: slot, Hash: h, Source: src}))
	return h
}

// TestPlanKeepsTheChunksItHasRoomFor: an upload sends the chunks its plan
// kept as they are, and encodes only the others a second time; the object
// it reads is the same either way, the budget comes back when the plan is
// released, and a file that changes after its plan is caught on a chunk
// encoded again.
func TestPlanKeepsTheChunksItHasRoomFor(t *testing.T) {
	const chunkLen = 64 << 10
	data := trainingData(t, "weights_bf16.bin", 1)[:5*chunkLen+1000] // 6 chunks, the last short
	path := filepath.Join(t.TempDir(), "weights_bf16")
	require.NoError(t, os.WriteFile(path, data, 0o644))
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()

	// The object as planecodec makes it, chunk by chunk.
	var want []byte
	var e planecodec.Encoder
	for off := 0; off < len(data); off += chunkLen {
		want, err = e.Encode(want, data[off:min(off+chunkLen, len(data))])
		require.NoError(t, err)
	}

	c := newCodec(chunkLen, 4)
	cache := newChunkCache(2, &c.stored)
	defer cache.drop()
	plan, err := c.planFile(context.Background(), f, int64(len(data)))
	require.NoError(t, err)
	require.Len(t, plan.kept, 6)
	for i, k := range plan.kept {
		assert.Equal(t, i < 4, k != nil, "chunk %d kept", i)
	}
	assert.False(t, c.keep.TryAcquire(1), "the budget is spent")
	assert.Equal(t, int64(6), c.encodes.Load(), "the plan encodes every chunk once")
	require.Equal(t, int64(len(want)), plan.stored())
	assert.Equal(t, crc32.Checksum(want, crcTable), plan.storedCRC)

	view := &encodedFile{src: f, plan: plan, codec: c, cache: cache}
	got := make([]byte, plan.stored())
	for off := 0; off < len(got); off += 1000 { // small reads, as a request's copy makes them
		n, err := view.ReadAt(got[off:min(off+1000, len(got))], int64(off))
		require.NoError(t, err)
		require.Equal(t, min(1000, len(got)-off), n)
	}
	require.True(t, bytes.Equal(want, got), "the object read is planecodec's encoding of the file")
	assert.Equal(t, int64(8), c.encodes.Load(), "only the 2 chunks not kept are encoded again")

	plan.release(c)
	assert.True(t, c.keep.TryAcquire(4), "releasing the plan gives its 4 chunks back")
	c.keep.Release(4)

	// The file changes after the plan (a chunk of other bytes, the same
	// length): a kept chunk is sent as planned; a chunk encoded again differs
	// from the plan, which the store's CRC32C check refuses.
	plan, err = c.planFile(context.Background(), f, int64(len(data)))
	require.NoError(t, err)
	defer plan.release(c)
	changed := bytes.Clone(data)
	copy(changed[5*chunkLen:], randomBytes(1000, 9))
	require.NoError(t, os.WriteFile(path, changed, 0o644)) // the same inode: f reads it
	view = &encodedFile{src: f, plan: plan, codec: c, cache: cache}
	kept := make([]byte, plan.offs[1])
	_, err = view.ReadAt(kept, 0)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(want[:plan.offs[1]], kept), "a kept chunk is the plan's bytes")
	last := make([]byte, plan.offs[6]-plan.offs[5])
	n, err := view.ReadAt(last, plan.offs[5])
	if err == nil {
		assert.NotEqual(t, plan.crcs[5], crc32.Checksum(last[:n], crcTable), "a changed chunk encoded again cannot pass as the plan's")
	} else {
		assert.Contains(t, err.Error(), "the file changed during the upload")
	}
}

// writeDuringPlan is a file that is written (at its start) when its second chunk is read.
type writeDuringPlan struct {
	*os.File
	chunkLen int64
	once     sync.Once
}

func (w *writeDuringPlan) ReadAt(p []byte, off int64) (int, error) {
	if off >= w.chunkLen {
		w.once.Do(func() { w.File.WriteAt([]byte("torn"), 0) })
	}
	return w.File.ReadAt(p, off)
}

// TestPlanRefusesAFileWrittenMeanwhile: the upload sends the chunks the plan kept as the plan
// read them, so a file written while it was being planned is refused (it would go out torn,
// with a manifest whose CRC32C matches the torn bytes).
func TestPlanRefusesAFileWrittenMeanwhile(t *testing.T) {
	const chunkLen = 64 << 10
	data := trainingData(t, "weights_bf16.bin", 1)[:3*chunkLen]
	path := filepath.Join(t.TempDir(), "weights_bf16")
	require.NoError(t, os.WriteFile(path, data, 0o644))
	time.Sleep(20 * time.Millisecond) // past the file system's timestamp granularity
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	require.NoError(t, err)
	defer f.Close()

	c := newCodec(chunkLen, 8)
	plan, err := c.planFile(context.Background(), f, int64(len(data)))
	require.NoError(t, err, "a file left alone")
	plan.release(c)

	time.Sleep(20 * time.Millisecond)
	_, err = c.planFile(context.Background(), &writeDuringPlan{File: f, chunkLen: chunkLen}, int64(len(data)))
	require.ErrorContains(t, err, "the file changed while it was encoded")
	assert.True(t, c.keep.TryAcquire(8), "a refused plan keeps no chunk")
}

// nextChunkDamagingStore damages, in each read of the object that spans two chunks or more, a
// byte of the second chunk it reads: a read again from the damaged chunk then damages the next.
type nextChunkDamagingStore struct {
	ObjectStore
	object string
	chunks []int64 // the stored chunk lengths
	mu     sync.Mutex
	reads  int
}

func (s *nextChunkDamagingStore) Open(ctx context.Context, name string, off, length int64) (io.ReadCloser, error) {
	r, err := s.ObjectStore.Open(ctx, name, off, length)
	if err != nil || !strings.HasSuffix(name, s.object) {
		return r, err
	}
	var at int64 // stored offset of the chunk the read starts at
	k := 0
	for k < len(s.chunks) && at < off {
		at += s.chunks[k]
		k++
	}
	if k+1 >= len(s.chunks) || off+length < at+s.chunks[k]+s.chunks[k+1] {
		return r, nil
	}
	b, err := io.ReadAll(r)
	r.Close()
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	s.reads++
	s.mu.Unlock()
	b[s.chunks[k]+s.chunks[k+1]/2] ^= 0x04
	return io.NopCloser(bytes.NewReader(b)), nil
}

// TestCompressedChunksDamagedOneAfterAnother: each chunk of a range arrives damaged once, one
// after another: more damaged reads than transitReads in all, but each chunk read again once.
// The reads again were counted for the whole range, and its seventh damaged chunk failed the
// download (a review).
func TestCompressedChunksDamagedOneAfterAnother(t *testing.T) {
	quickReadsAgain(t)
	ds := &nextChunkDamagingStore{ObjectStore: newTestLocalDir(t)}
	b := compressedBackups(ds)
	files := map[string][]byte{"w": trainingData(t, "weights_bf16.bin", 3)}
	h := uploadTree(t, b, "2026-01-01_00-00", 1, Slot{}, files)
	m := readTestManifest(t, b, "2026-01-01_00-00", h)
	require.Equal(t, codecPlanes, m.Files[0].Codec)
	require.Greater(t, len(m.Files[0].Chunks), chunksPerRead, "a whole range of chunks")
	ds.object, ds.chunks = m.Files[0].object(h), m.Files[0].Chunks
	dest := filepath.Join(t.TempDir(), "restored")
	require.NoError(t, b.Download(context.Background(), DownloadRequest{Job: testJob, Backup: "2026-01-01_00-00", Hash: h, Dest: dest}))
	require.Greater(t, ds.reads, transitReads, "more damaged reads than one chunk may have")
	requireSameFiles(t, files, dest)
}

// TestCompressedChunkDamagedAlikeOnTheWayOnGCS: a compressed object whose bytes arrive damaged
// the same way on every read (a faulty proxy or NIC), while GCS keeps it with the CRC32C the
// manifest recorded, is damaged on the way: the download fails saying so, without planecodec's
// ErrCorrupt, on which a restore records the data damaged for good (black-box h55: an intact
// backup recorded damaged, a step lost at the next start). Damage in the store (the object
// rewritten) is still ErrCorrupt (TestCompressedCorruptChunk).
func TestCompressedChunkDamagedAlikeOnTheWayOnGCS(t *testing.T) {
	quickReadsAgain(t)
	f := newFakeGCS(t)
	b := compressedBackups(f.store(t, "backups/test", testGCSOptions()))
	files := map[string][]byte{"w": trainingData(t, "weights_bf16.bin", 2)}
	h := uploadTree(t, b, "2026-01-01_00-00", 1, Slot{}, files)
	m := readTestManifest(t, b, "2026-01-01_00-00", h)
	require.Equal(t, codecPlanes, m.Files[0].Codec)
	object := m.Files[0].object(h)
	rule := f.faults.add(1<<30, func(r *http.Request) bool {
		return isMediaRead(r) && strings.Contains(r.URL.Path, strings.TrimPrefix(object, "/"))
	}, corruptResponse)
	dest := filepath.Join(t.TempDir(), "restored")
	err := b.Download(context.Background(), DownloadRequest{Job: testJob, Backup: "2026-01-01_00-00", Hash: h, Dest: dest})
	require.Error(t, err)
	require.Positive(t, f.faults.hits(rule), "the object was read through the fault")
	assert.NotErrorIs(t, err, planecodec.ErrCorrupt, "damaged on the way is not damage in the store")
	assert.Contains(t, err.Error(), "damaged on the way")
	assert.NoDirExists(t, dest)
}

// TestExportKeepsOwnersAndModes: an exported step has the owners (as root) and modes the backup
// keeps for it, as a restore does. Every file came out root's 0600, every directory 0700
// (black-box h57).
func TestExportKeepsOwnersAndModes(t *testing.T) {
	ctx := context.Background()
	b := compressedBackups(newTestLocalDir(t))
	src := t.TempDir()
	writeBinTree(t, src, map[string][]byte{"state/a": []byte("weights"), "state/secret": []byte("key"), "meta.json": []byte("{}")})
	ab := layout.NewAttrsBuilder(layout.Attr{Mode: 0o750, UID: 1000, GID: 1000}, true)
	ab.Add(layout.EntryDir, layout.Attr{Mode: 0o710, UID: 1000, GID: 1000}, func() string { return "state" })
	ab.Add(layout.EntryFile, layout.Attr{Mode: 0o640, UID: 1000, GID: 1000}, func() string { return "state/a" })
	ab.Add(layout.EntryFile, layout.Attr{Mode: 0o640, UID: 1000, GID: 1000}, func() string { return "meta.json" })
	ab.Add(layout.EntryFile, layout.Attr{Mode: 0o4600, UID: 1001, GID: 1002}, func() string { return "state/secret" })
	require.NoError(t, layout.WriteAttrs(src, ab.Attrs()))
	h, isDir, err := layout.HashData(ctx, src)
	require.NoError(t, err)
	require.True(t, isDir)
	h = strings.TrimSuffix(layout.DataName(h, isDir), ".data")
	require.NoError(t, b.Upload(ctx, UploadRequest{Job: testJob, Backup: "2026-01-01_00-00", Step: 5, Slot: Slot{0, 0}, Hash: h, Source: src}))

	out := filepath.Join(t.TempDir(), "export")
	_, err = b.Export(ctx, ExportRequest{Job: testJob, Backup: "2026-01-01_00-00", Dir: out})
	require.NoError(t, err)
	root := os.Geteuid() == 0
	for rel, want := range map[string]layout.Attr{
		"": {Mode: 0o750, UID: 1000, GID: 1000}, "state": {Mode: 0o710, UID: 1000, GID: 1000},
		"state/a": {Mode: 0o640, UID: 1000, GID: 1000}, "meta.json": {Mode: 0o640, UID: 1000, GID: 1000},
		"state/secret": {Mode: 0o4600, UID: 1001, GID: 1002},
	} {
		var st unix.Stat_t
		require.NoError(t, unix.Lstat(filepath.Join(out, h+".data", rel), &st))
		assert.Equal(t, want.Mode, st.Mode&0o7777, "mode of %q", rel)
		if root {
			assert.Equal(t, [2]uint32{want.UID, want.GID}, [2]uint32{st.Uid, st.Gid}, "owner of %q", rel)
		}
	}
}
