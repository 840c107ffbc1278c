package gcsbackend

import (
	"context"
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
