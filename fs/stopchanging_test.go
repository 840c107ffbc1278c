package fs

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mtcfs/mtcfs/internal/syncbuf"
	"github.com/mtcfs/mtcfs/tiers"
)

// TestStopTellsTheJobKeepsChangingTheMount: a job that saves on after the stop began never
// leaves the mount alone for StopQuiet; the busy line (which names the processes once the mount
// is quiet and its unmount fails) never came, and the log said nothing until the give-up 30 s
// later (a black-box run). It says so after StopChangingTold, once, and the stop unmounts once
// the job pauses.
func TestStopTellsTheJobKeepsChangingTheMount(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mount tests need root")
	}
	defer func(d time.Duration) { StopChangingTold = d }(StopChangingTold)
	StopChangingTold = 300 * time.Millisecond
	base := t.TempDir()
	dir := filepath.Join(base, "mnt")
	require.NoError(t, os.Mkdir(dir, 0o755))
	spool, err := tiers.OpenSpool(tiers.SpoolConfig{Dir: filepath.Join(base, "spool"), Budget: 64 << 20, MountTmpfs: true})
	require.NoError(t, err)
	var log syncbuf.Buffer
	srv, err := Mount(dir, Options{Spool: spool, InProcess: true, Logger: slog.New(slog.NewTextHandler(&log, nil))})
	if err != nil {
		spool.Close()
		t.Fatal(err)
	}
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			srv.Unmount()
		}
		spool.Close()
	})

	var saving atomic.Bool
	saving.Store(true)
	saverDone := make(chan struct{})
	go func() { // a save every 50 ms
		defer close(saverDone)
		for i := 0; saving.Load(); i++ {
			os.WriteFile(filepath.Join(dir, fmt.Sprintf("f%d", i%20)), []byte("state"), 0o644)
			time.Sleep(50 * time.Millisecond)
		}
	}()
	giveUp := make(chan struct{})
	defer close(giveUp)
	errc := make(chan error, 1)
	go func() { errc <- srv.Stop(giveUp) }()
	const told = "the job keeps changing the mount (it saves on)"
	require.Eventually(t, func() bool { return strings.Contains(log.String(), told) }, 5*time.Second, 20*time.Millisecond, "%s", log.String())
	select {
	case err := <-errc:
		t.Fatalf("the stop ended while the job saved on: %v", err)
	default:
	}
	saving.Store(false)
	<-saverDone
	select {
	case err := <-errc:
		require.NoError(t, err)
		stopped = true
	case <-time.After(10 * time.Second):
		t.Fatal("the stop did not unmount once the job paused")
	}
	require.Equal(t, 1, strings.Count(log.String(), told), "told once")
}
