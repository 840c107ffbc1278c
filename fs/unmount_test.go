package fs

import (
	"maps"
	"os"
	"path/filepath"
	"testing"

	"github.com/mtcfs/mtcfs/tiers"
)

// TestUnmountClosesTheDeviceDescriptors: once Unmount returns, this process holds none of the
// mount's /dev/fuse descriptors (go-fuse's, the notifier's duplicate). A mount started next
// tells its own descriptor by the numbers that appeared (newServer): one closing meanwhile
// would hand it a number already seen, and that mount would run without its notifier.
func TestUnmountClosesTheDeviceDescriptors(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mount tests need root (FUSE DirectMount and a tmpfs spool)")
	}
	before := fuseDescriptors()
	for i := range 20 {
		base := t.TempDir()
		dir := filepath.Join(base, "mnt")
		if err := os.Mkdir(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		spool, err := tiers.OpenSpool(tiers.SpoolConfig{Dir: filepath.Join(base, "spool"), Budget: 64 << 20, MountTmpfs: true})
		if err != nil {
			t.Fatal(err)
		}
		srv, err := Mount(dir, Options{Spool: spool, Passthrough: PassthroughOff, InProcess: true})
		if err != nil {
			spool.Close()
			t.Fatal(err)
		}
		if len(fuseDescriptors()) <= len(before) {
			t.Error("the mount holds no /dev/fuse descriptor of its own")
		}
		if err := srv.Unmount(); err != nil {
			t.Fatal(err)
		}
		after := fuseDescriptors()
		if err := spool.Close(); err != nil {
			t.Fatal(err)
		}
		if !maps.Equal(after, before) {
			t.Fatalf("mount %d: /dev/fuse descriptors %v right after Unmount, %v before the mount", i, after, before)
		}
	}
}
