package gcsbackend

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mtcfs/mtcfs/tiers"
)

// DeleteIncomplete removes an incomplete backup (an upload cut short that no agent completed:
// `backups verify` exits 1 while it is there), and nothing else: not a backup with a complete
// step, not the pinned one, not one written to a moment ago unless forced.
func TestDeleteIncomplete(t *testing.T) {
	ctx := context.Background()
	b := newTestBackups(t)
	const complete, cut = "2025-06-30_14-30", "2025-06-30_14-31"
	uploadStep(t, b, complete, 4, 2, 1)
	uploadStep(t, b, cut, 5, 2, 1, Slot{1, 0}) // rank 1 never finished
	for _, name := range []string{complete, cut} {
		require.NoError(t, b.putShape(ctx, backupDir(testJob, name), tiers.Shape{Nodes: 2, Workers: 1}))
	}

	_, err := b.DeleteIncomplete(ctx, testJob, cut, false)
	require.Error(t, err, "written a moment ago: an upload may be running")
	assert.Contains(t, err.Error(), "an upload may still be running into it")

	b.now = func() time.Time { return time.Now().Add(time.Hour) }
	_, err = b.DeleteIncomplete(ctx, testJob, complete, false)
	require.ErrorIs(t, err, ErrNotIncomplete)

	require.NoError(t, b.SetRestoreVersion(ctx, testJob, complete)) // pins are checked on the backup named
	n, err := b.DeleteIncomplete(ctx, testJob, cut, false)
	require.NoError(t, err)
	assert.Positive(t, n)
	names, err := b.Names(ctx, testJob)
	require.NoError(t, err)
	assert.Equal(t, []string{complete}, names)
	assert.True(t, verify(t, b, complete, VerifyOptions{Nodes: 2, Workers: 1}).Complete())

	_, err = b.DeleteIncomplete(ctx, testJob, cut, false)
	assert.True(t, IsNotFound(err), "a backup that is gone: %v", err)
}

// crashingStore fails every Delete after the first n: a delete cut short by kill -9.
type crashingStore struct {
	ObjectStore
	left atomic.Int32
}

func (s *crashingStore) Delete(ctx context.Context, name string) error {
	if s.left.Add(-1) < 0 {
		return errors.New("killed")
	}
	return s.ObjectStore.Delete(ctx, name)
}

// A delete cut short leaves a backup the next delete removes: .meta files go first, so what is
// left never reads as damaged (a .meta naming missing data), which delete refuses.
func TestDeleteIncompleteCutShortCanBeDoneAgain(t *testing.T) {
	ctx := context.Background()
	store := newTestStore(t)
	b := &Backups{Store: store, Parallelism: 1, now: func() time.Time { return time.Now().Add(time.Hour) }}
	const cut = "2025-06-30_14-31"
	uploadStep(t, b, cut, 5, 3, 1, Slot{2, 0})
	require.NoError(t, b.putShape(ctx, backupDir(testJob, cut), tiers.Shape{Nodes: 3, Workers: 1}))

	crashing := &crashingStore{ObjectStore: store}
	crashing.left.Store(3)
	_, err := (&Backups{Store: crashing, Parallelism: 1, now: b.now}).DeleteIncomplete(ctx, testJob, cut, false)
	require.Error(t, err)
	r := verify(t, b, cut, VerifyOptions{Nodes: 3, Workers: 1})
	assert.False(t, r.Damaged(), "a delete cut short left a damaged-looking backup: %+v", r)
	_, err = b.DeleteIncomplete(ctx, testJob, cut, false)
	require.NoError(t, err)
	names, err := b.Names(ctx, testJob)
	require.NoError(t, err)
	assert.Empty(t, names)
}
