package fusectl

import (
	"os"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestAbortOfNoMount: a directory that is not a FUSE mount is left alone, and no fusectl mount
// stays behind. (Aborting a live connection is exercised by the agent tests' cleanup.)
func TestAbortOfNoMount(t *testing.T) {
	require.NoError(t, Abort(t.TempDir()))
	data, err := os.ReadFile("/proc/self/mounts")
	require.NoError(t, err)
	require.NotContains(t, string(data), " fusectl ")
}
