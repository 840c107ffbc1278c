package fs

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mtcfs/mtcfs/tiers"
)

// TestENOSPC fills the spool past --memory: the write that does not fit fails with ENOSPC, the
// files written before stay intact, statfs reports the budget, and deleting a file gives the
// space back. It runs on both data paths and on both kinds of budget enforcement.
func TestENOSPC(t *testing.T) {
	const budget = 32 << 20
	cases := []struct {
		name       string
		mode       PassthroughMode
		mountTmpfs bool
	}{
		{"passthrough-tmpfs", PassthroughOn, true},
		{"fallback-tmpfs", PassthroughOff, true},
		{"fallback-accounted", PassthroughOff, false}, // what an unprivileged agent gets
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var dir string
			if tc.mountTmpfs {
				dir, _ = testMount(t, tc.mode, budget)
			} else {
				dir, _ = testMountSpool(t, tc.mode, tiers.SpoolConfig{Budget: budget})
			}
			var st syscall.Statfs_t
			require.NoError(t, syscall.Statfs(dir, &st))
			require.InDelta(t, budget, int64(st.Blocks)*st.Bsize, budget/50, "statfs size should be the budget")

			chunk := bytes.Repeat([]byte{0xAB}, 1<<20)
			var kept []string
			var sawENOSPC bool
			for i := 0; i < 64 && !sawENOSPC; i++ {
				p := filepath.Join(dir, "f", string(rune('a'+i/26))+string(rune('a'+i%26)))
				require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
				f, err := os.Create(p)
				require.NoError(t, err)
				for j := 0; j < 4; j++ {
					if _, err := f.Write(chunk); err != nil {
						require.True(t, errors.Is(err, syscall.ENOSPC), "want ENOSPC, got %v", err)
						sawENOSPC = true
						break
					}
				}
				f.Close()
				if !sawENOSPC {
					kept = append(kept, p)
				}
			}
			require.True(t, sawENOSPC, "writing 64 MiB into a %d MiB budget never failed", budget>>20)
			require.NotEmpty(t, kept)

			require.NoError(t, syscall.Statfs(dir, &st))
			require.Less(t, int64(st.Bavail)*st.Bsize, int64(2<<20), "statfs should show the spool nearly full")

			for _, p := range kept {
				got, err := os.ReadFile(p)
				require.NoError(t, err)
				require.Equal(t, 4<<20, len(got), "%s lost bytes after ENOSPC", p)
				require.True(t, bytes.Equal(got[:1<<20], chunk) && bytes.Equal(got[3<<20:], chunk), "%s corrupted", p)
			}

			// Space comes back when files go away.
			for _, p := range kept[:2] {
				require.NoError(t, os.Remove(p))
			}
			require.NoError(t, os.WriteFile(filepath.Join(dir, "after"), bytes.Repeat(chunk, 4), 0o644))
		})
	}
}
