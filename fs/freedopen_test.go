package fs

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/tiers"
)

// TestFreedButOpen: of the data the agent removed from the top, FreedButOpen counts the files
// a process still maps through the mount (with passthrough the kernel released their handles
// at the descriptors' close) or holds open, and nothing else: not freed data nobody holds, not
// data that is live (never freed, or freed and back since, as after a restore), not a file
// unmapped and closed since.
func TestFreedButOpen(t *testing.T) {
	const size = 1 << 20
	for _, mode := range []PassthroughMode{PassthroughAuto, PassthroughOff} {
		t.Run(string(mode), func(t *testing.T) {
			dir, srv, _, spool := mountWithEvents(t, mode)
			fb, ok := srv.Namespace().(tiers.FreedButOpen)
			require.True(t, ok, "the namespace counts freed files still held")
			name := func(c string) string { return "D" + strings.Repeat(c, 64) + ".data" }
			put := func(n string) {
				src := filepath.Join(spool.Dir(), "sealed-"+n)
				require.NoError(t, os.MkdirAll(src, 0o755))
				require.NoError(t, os.WriteFile(filepath.Join(src, "w"), make([]byte, size), 0o644))
				require.NoError(t, srv.Namespace().Import(src, n))
			}
			mapped := func(n string) (unmap func()) {
				f, err := os.Open(filepath.Join(dir, n, "w"))
				require.NoError(t, err)
				defer f.Close()
				m, err := unix.Mmap(int(f.Fd()), 0, size, unix.PROT_READ, unix.MAP_SHARED)
				require.NoError(t, err)
				_ = m[size-1]
				done := false
				unmap = func() {
					if !done {
						done = true
						unix.Munmap(m)
					}
				}
				t.Cleanup(unmap) // before the unmount
				return unmap
			}
			held, free, live, back := name("a"), name("b"), name("c"), name("d")
			for _, n := range []string{held, free, live, back} {
				put(n)
			}
			unmapHeld := mapped(held)
			mapped(live)
			open, err := os.Open(filepath.Join(dir, back, "w")) // a descriptor, no mapping
			require.NoError(t, err)
			for _, n := range []string{held, free, back} {
				require.NoError(t, srv.Namespace().Remove(n))
			}
			files, bytes := fb.FreedButOpen(0)
			assert.Equal(t, 2, files, "the mapped and the open file of freed data")
			assert.Equal(t, int64(2*size), bytes)

			// The open one's data comes back (a restore), and its old file is closed; the
			// mapped one is unmapped.
			require.NoError(t, open.Close())
			put(back)
			mapped(back)
			unmapHeld()
			deadline := time.Now().Add(5 * time.Second)
			for {
				if files, bytes = fb.FreedButOpen(0); files == 0 || time.Now().After(deadline) {
					break // the releases are asynchronous
				}
				time.Sleep(20 * time.Millisecond)
			}
			assert.Zero(t, files, "nothing freed is held now (%d bytes counted)", bytes)
		})
	}
}
