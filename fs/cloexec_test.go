package fs

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
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
