package fs

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mtcfs/mtcfs/internal/fusectl"
)

// TestChildrenDoNotInheritTheFUSEDevice: a process started after the mount holds no descriptor
// of /dev/fuse. With one (go-fuse's direct mount leaves it inheritable), the child keeps the
// connection alive after the agent dies, and its own requests to the mount hang unkillable —
// seen when a test binary timed out under pjdfstest.
func TestChildrenDoNotInheritTheFUSEDevice(t *testing.T) {
	for _, mode := range []PassthroughMode{PassthroughAuto, PassthroughOff} {
		t.Run(string(mode), func(t *testing.T) {
			testMount(t, mode, 64<<20)
			out, err := exec.Command("sh", "-c", `for f in /proc/$$/fd/*; do readlink "$f"; done; true`).CombinedOutput()
			require.NoError(t, err, "%s", out)
			require.NotContains(t, strings.Split(string(out), "\n"), "/dev/fuse", "descriptors of the child:\n%s", out)
		})
	}
}

// TestFusectlAbort: fusectl.Abort, which the agent tests use before detaching a dead agent's
// mount, makes every access to the mount fail with ENOTCONN instead of waiting, and leaves no
// fusectl mount behind.
func TestFusectlAbort(t *testing.T) {
	dir, _ := testMount(t, PassthroughAuto, 64<<20)
	before := fusectlMounts(t) // systemd mounts it at boot on most distributions
	require.NoError(t, fusectl.Abort(dir))
	_, err := os.Stat(filepath.Join(dir, "x"))
	require.ErrorIs(t, err, syscall.ENOTCONN)
	require.Equal(t, before, fusectlMounts(t), "fusectl mounts before and after the abort")
}

// fusectlMounts counts the fusectl mounts in this process's mount table.
func fusectlMounts(t *testing.T) int {
	t.Helper()
	mounts, err := os.ReadFile("/proc/self/mounts")
	require.NoError(t, err)
	return strings.Count(string(mounts), " fusectl ")
}
