package fs

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mtcfs/mtcfs/tiers"
)

// The mount root takes the owner, group and mode of the mount point, or what Options.Owner
// says (SPEC §10 Ownership).
func TestRootTakesTheMountPointsOwner(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	u, g, m := uint32(2000), uint32(3000), uint32(0o770)
	for _, tc := range []struct {
		name          string
		owner         RootOwner
		uid, gid, mod uint32
	}{
		{"the mount point's", RootOwner{}, 1000, 1001, 0o750},
		{"overridden", RootOwner{UID: &u, GID: &g, Mode: &m}, 2000, 3000, 0o770},
	} {
		t.Run(tc.name, func(t *testing.T) {
			base := t.TempDir()
			dir := filepath.Join(base, "mnt")
			require.NoError(t, os.Mkdir(dir, 0o750))
			require.NoError(t, os.Chmod(dir, 0o750))
			require.NoError(t, os.Chown(dir, 1000, 1001))
			spool, err := tiers.OpenSpool(tiers.SpoolConfig{Dir: filepath.Join(base, "spool"), Budget: 64 << 20, MountTmpfs: true})
			require.NoError(t, err)
			defer spool.Close()
			srv, err := Mount(dir, Options{Spool: spool, Owner: tc.owner, InProcess: true})
			require.NoError(t, err)
			defer srv.Unmount()
			var st syscall.Stat_t
			require.NoError(t, syscall.Stat(dir, &st))
			require.Equal(t, tc.uid, st.Uid)
			require.Equal(t, tc.gid, st.Gid)
			require.Equal(t, tc.mod, st.Mode&0o7777)
		})
	}
}
