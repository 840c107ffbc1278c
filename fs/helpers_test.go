package fs

import (
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	"github.com/mtcfs/mtcfs/tiers"
)

// testMount mounts a fresh mtcfs with a tmpfs spool of budget bytes in a temporary directory.
func testMount(t testing.TB, mode PassthroughMode, budget int64, mods ...func(*Options)) (string, *tiers.Spool) {
	t.Helper()
	return testMountSpool(t, mode, tiers.SpoolConfig{Budget: budget, MountTmpfs: true}, mods...)
}

// testMountSpool mounts a fresh mtcfs on a spool made from cfg (cfg.Dir is filled in) and
// unmounts it (lazily if a failed test left something open) when the test ends, so no mount
// outlives the test run.
func testMountSpool(t testing.TB, mode PassthroughMode, cfg tiers.SpoolConfig, mods ...func(*Options)) (string, *tiers.Spool) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("mount tests need root (FUSE DirectMount and a tmpfs spool)")
	}
	base := t.TempDir()
	dir := filepath.Join(base, "mnt")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	cfg.Dir = filepath.Join(base, "spool")
	spool, err := tiers.OpenSpool(cfg)
	if err != nil {
		t.Fatal(err)
	}
	opts := Options{Spool: spool, Passthrough: mode, InProcess: true}
	for _, m := range mods {
		m(&opts)
	}
	srv, err := Mount(dir, opts)
	if err != nil {
		spool.Close()
		t.Fatal(err)
	}
	if mode == PassthroughOn && !srv.Passthrough() {
		t.Fatal("passthrough requested but not active")
	}
	t.Cleanup(func() {
		if err := srv.Unmount(); err != nil {
			t.Errorf("unmount: %v", err)
		}
		if err := spool.Close(); err != nil {
			t.Errorf("close spool: %v", err)
		}
	})
	return dir, spool
}

// modes are the data paths every kernel-facing test runs on.
var modes = []PassthroughMode{PassthroughOn, PassthroughOff}

func TestMain(m *testing.M) {
	if spec := os.Getenv(mapperEnv); spec != "" {
		os.Exit(runMapper(spec))
	}
	// Mount logs are noise in test output; failures say what they need.
	slog.SetDefault(slog.New(slog.NewTextHandler(io.Discard, nil)))
	os.Exit(m.Run())
}
