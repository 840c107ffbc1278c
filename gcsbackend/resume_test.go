package gcsbackend

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mtcfs/mtcfs/tiers"
)

// Resumable says yes only for an upload of the given step cut short that completing leaves
// nothing else in: no complete or damaged step, no .meta of another step, no data the step does
// not have, no object it does not know, no other shape recorded.
func TestResumable(t *testing.T) {
	ctx := context.Background()
	b := newTestBackups(t)
	const backup = "2025-06-30_14-30"
	shape := tiers.Shape{Nodes: 2, Workers: 1}
	dir := backupDir(testJob, backup)
	// A two-node upload of step 100 cut short: rank 0 finished, rank 1 uploaded part of its
	// data and no .meta.
	hashes := uploadStep(t, b, backup, 100, 2, 1)
	require.NoError(t, b.putShape(ctx, dir, shape))
	h1 := hashes[Slot{1, 0}]
	require.NoError(t, b.Store.Delete(ctx, dir+metaName(testJob, 100, Slot{1, 0})))
	require.NoError(t, b.Store.Delete(ctx, dir+manifestName(h1)))
	require.NoError(t, b.Store.Delete(ctx, dir+dataObject(h1, "state/array_1")))
	data := []string{hashes[Slot{0, 0}], h1}

	resumable := func(step int64, data []string, shape tiers.Shape) (bool, string) {
		t.Helper()
		ok, why, err := b.Resumable(ctx, testJob, backup, step, data, shape)
		require.NoError(t, err)
		return ok, why
	}
	ok, why := resumable(100, data, shape)
	assert.True(t, ok, why)
	ok, why = resumable(101, data, shape)
	assert.False(t, ok)
	assert.Equal(t, "it holds a .meta of step 100", why)
	ok, why = resumable(100, data[:1], shape)
	assert.False(t, ok)
	assert.Equal(t, fmt.Sprintf("it holds data of another step (%s)", dataName(h1)), why)
	ok, why = resumable(100, data, tiers.Shape{Nodes: 4, Workers: 1})
	assert.False(t, ok)
	assert.Contains(t, why, "it was taken by a job of 2 nodes")

	// Something it does not know stays, so the backup is not touched.
	require.NoError(t, PutBytes(ctx, b.Store, dir+"notes.txt", []byte("mine"), true))
	ok, why = resumable(100, data, shape)
	assert.False(t, ok)
	assert.Equal(t, "it holds notes.txt", why)
	require.NoError(t, b.Store.Delete(ctx, dir+"notes.txt"))

	// Completed (the upload resumed), it is no longer resumable.
	src := t.TempDir()
	writeTree(t, src, slotTree(100, Slot{1, 0}))
	require.NoError(t, b.Upload(ctx, UploadRequest{Job: testJob, Backup: backup, Step: 100, Slot: Slot{1, 0}, Hash: h1, Source: src, Shape: shape}))
	require.True(t, verify(t, b, backup, VerifyOptions{Nodes: 2, Workers: 1}).Complete())
	ok, why = resumable(100, data, shape)
	assert.False(t, ok)
	assert.Equal(t, "step 100 in it is complete", why)

	// Damaged since (rank 1's data lost after its .meta): not an upload cut short.
	require.NoError(t, b.Store.Delete(ctx, dir+dataObject(h1, "state/array_1")))
	ok, why = resumable(100, data, shape)
	assert.False(t, ok)
	assert.Equal(t, "step 100 in it is damaged", why)

	// A backup that does not exist.
	ok, why, err := b.Resumable(ctx, testJob, "2025-06-30_14-31", 100, data, shape)
	require.NoError(t, err)
	assert.False(t, ok)
	assert.Equal(t, "it is empty", why)
}

// A backup in the plain reference layout (data and .meta, no mtcfs manifest: the reference
// system's, or mtcfs backups export copied into a location) is not restored, and Verify says why
// rather than only "manifest missing" (found by a black-box run, which took it for damage).
func TestPlainReferenceLayoutIsNamed(t *testing.T) {
	ctx := context.Background()
	b := newTestBackups(t)
	const backup = "2025-06-30_14-30"
	hashes := uploadStep(t, b, backup, 7, 1, 1)
	h := hashes[Slot{0, 0}]
	require.NoError(t, b.Store.Delete(ctx, backupDir(testJob, backup)+manifestName(h)))
	r := verify(t, b, backup, VerifyOptions{Nodes: 1, Workers: 1})
	require.Len(t, r.Steps, 1)
	assert.False(t, r.Steps[0].Complete)
	assert.Contains(t, strings.Join(r.Steps[0].Problems, "\n"), "a backup in the plain reference layout")
}

// An upload of data whose manifest is already in the backup (an upload that finished before
// its .meta, cut short, now resumed) sends nothing again but the .meta.
func TestUploadOfDataAlreadyInTheBackupSendsOnlyTheMeta(t *testing.T) {
	ctx := context.Background()
	rec := &recordingStore{ObjectStore: newTestStore(t)}
	b := &Backups{Store: rec, Parallelism: 2}
	const backup = "2025-06-30_14-30"
	hashes := uploadStep(t, b, backup, 3, 1, 1)
	h := hashes[Slot{0, 0}]
	meta := backupDir(testJob, backup) + metaName(testJob, 3, Slot{0, 0})
	require.NoError(t, b.Store.Delete(ctx, meta)) // cut short before the .meta
	rec.mu.Lock()
	rec.puts = nil
	rec.mu.Unlock()
	src := t.TempDir()
	writeTree(t, src, slotTree(3, Slot{0, 0}))
	require.NoError(t, b.Upload(ctx, UploadRequest{Job: testJob, Backup: backup, Step: 3, Slot: Slot{0, 0}, Hash: h, Source: src}))
	rec.mu.Lock()
	defer rec.mu.Unlock()
	assert.Equal(t, []string{meta}, rec.puts)
	assert.True(t, verify(t, b, backup, VerifyOptions{Nodes: 1, Workers: 1}).Complete())
}

// A data-parallel node whose earlier attempt uploaded its own data (its column-mate was an
// earlier agent that named no data) is done when the order now names the column's data: before,
// the .meta naming other data failed create-if-absent at every retry, for ever (found by a
// review).
func TestNamingTheColumnsDataOfAFinishedSlot(t *testing.T) {
	ctx := context.Background()
	b := newTestBackups(t)
	const backup = "2025-06-30_14-30"
	hashes := uploadStep(t, b, backup, 4, 2, 1) // both ranks uploaded their own data
	err := b.Upload(ctx, UploadRequest{Job: testJob, Backup: backup, Step: 4, Slot: Slot{0, 0}, Hash: hashes[Slot{1, 0}]})
	require.NoError(t, err)
	assert.Equal(t, hashes[Slot{0, 0}], hashOf(t, b, backup, 4, Slot{0, 0}), "the finished slot keeps its .meta")
	assert.True(t, verify(t, b, backup, VerifyOptions{Nodes: 2, Workers: 1}).Complete())
}

// losingStore deletes the object named lose right after it is uploaded, as a store that lost it
// while the upload ran (an emulator restarted empty; a delete --force of the backup).
type losingStore struct {
	ObjectStore
	lose string
}

func (s *losingStore) PutFile(ctx context.Context, t FileTransfer) (uint32, error) {
	crc, err := s.ObjectStore.PutFile(ctx, t)
	if err == nil && strings.HasSuffix(t.Name, s.lose) {
		err = s.ObjectStore.Delete(ctx, t.Name)
	}
	return crc, err
}

// TestUploadOfDataTheStoreLostFails: an upload whose data objects are not all in the store when
// its manifest would be written fails (to be tried again) without writing the manifest or the
// .meta; one whose manifest is there from an earlier try but whose objects are not drops the
// manifest, so that the next try uploads them again. Before, the .meta named data that was not
// there: the backup counted complete, damaged, and the step was never backed up again (found
// by a black-box run).
func TestUploadOfDataTheStoreLostFails(t *testing.T) {
	ctx := context.Background()
	store := &losingStore{ObjectStore: newTestStore(t), lose: "state/array_0"}
	b := &Backups{Store: store, Parallelism: 3}
	const backup = "2025-06-30_14-30"
	dir := backupDir(testJob, backup)
	src := t.TempDir()
	writeTree(t, src, slotTree(7, Slot{0, 0}))
	h := fakeHash(true, "lost")
	req := UploadRequest{Job: testJob, Backup: backup, Step: 7, Slot: Slot{0, 0}, Hash: h, Source: src}
	err := b.Upload(ctx, req)
	require.ErrorIs(t, err, ErrObjectsMissing)
	assert.ErrorContains(t, err, "1 of 7 ("+dir+dataObject(h, "state/array_0")+" first)")
	for _, name := range []string{manifestName(h), metaName(testJob, 7, Slot{0, 0})} {
		_, err := store.Stat(ctx, dir+name)
		assert.True(t, IsNotFound(err), "%s written: %v", name, err)
	}
	store.lose = "none"
	require.NoError(t, b.Upload(ctx, req), "the try again uploads what was lost")
	assert.True(t, verify(t, b, backup, VerifyOptions{Deep: true}).Complete())

	// Lost after the manifest was written by a try cut short before its .meta.
	require.NoError(t, store.Delete(ctx, dir+metaName(testJob, 7, Slot{0, 0})))
	require.NoError(t, store.Delete(ctx, dir+dataObject(h, "state/array_1")))
	require.ErrorIs(t, b.Upload(ctx, req), ErrObjectsMissing)
	_, err = store.Stat(ctx, dir+manifestName(h))
	assert.True(t, IsNotFound(err), "the manifest of lost data stays: %v", err)
	require.NoError(t, b.Upload(ctx, req))
	assert.True(t, verify(t, b, backup, VerifyOptions{Deep: true}).Complete())
}
