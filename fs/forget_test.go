package fs

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// TestOpenOfAFileTheJobReplacedMeanwhile: an open(2) that resolved a name before another process
// renamed a file over it (or unlinked it) sends its OPEN for the old node afterwards. On tmpfs it
// opens the old content; the agent had freed the old bytes when the last name went and the open
// failed with ENOENT (black-box h53: 1 open in 5, in a loop reading a file another process kept
// replacing by rename, the way state files are written). An O_PATH descriptor holds the node in
// the kernel as such an open does between its lookup and its OPEN; reopening it through /proc
// sends that OPEN. The old bytes must go once the kernel lets the node go.
func TestOpenOfAFileTheJobReplacedMeanwhile(t *testing.T) {
	for _, mode := range modes {
		for _, how := range []string{"rename", "unlink"} {
			t.Run(string(mode)+"/"+how, func(t *testing.T) {
				dir, spool := testMount(t, mode, 1<<30)
				p := filepath.Join(dir, "state")
				require.NoError(t, os.WriteFile(p, []byte("old content"), 0o644))
				fd, err := unix.Open(p, unix.O_PATH|unix.O_CLOEXEC, 0)
				require.NoError(t, err)
				closed := false
				closeFd := func() {
					if !closed {
						closed = true
						unix.Close(fd)
					}
				}
				t.Cleanup(closeFd)

				if how == "rename" {
					tmp := filepath.Join(dir, "state.tmp")
					require.NoError(t, os.WriteFile(tmp, []byte("new content"), 0o644))
					require.NoError(t, os.Rename(tmp, p))
				} else {
					require.NoError(t, os.Remove(p))
				}
				b, err := os.ReadFile(fmt.Sprintf("/proc/self/fd/%d", fd))
				require.NoError(t, err, "open of the node the name held before the %s", how)
				require.Equal(t, "old content", string(b))
				// Still there while the kernel holds the node, also once that open is closed.
				b, err = os.ReadFile(fmt.Sprintf("/proc/self/fd/%d", fd))
				require.NoError(t, err)
				require.Equal(t, "old content", string(b))
				want := 0
				if how == "rename" {
					b, err := os.ReadFile(p)
					require.NoError(t, err)
					require.Equal(t, "new content", string(b))
					want = 1
				}
				require.Len(t, spoolFiles(t, spool.FilesDir()), want+1, "the old bytes are kept while the kernel holds the node")

				closeFd()
				require.Eventually(t, func() bool { return len(spoolFiles(t, spool.FilesDir())) == want },
					5*time.Second, 5*time.Millisecond, "the old bytes go once the kernel forgets the node")
			})
		}
	}
}

// spoolFiles lists the spool files in dir.
func spoolFiles(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	require.NoError(t, err)
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	return names
}
