package main

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestStopSignalDeliveredTwice: GNU timeout(1) signals the command and then its process group,
// so the agent gets two SIGTERMs microseconds apart. That is one request to stop: the agent
// waits for its unmount and exits 0. A second signal after repeatWindow still ends the wait
// for an unmount that cannot finish (a file held open in the mount).
func TestStopSignalDeliveredTwice(t *testing.T) {
	needRoot(t)
	base := t.TempDir()
	// Under timeout(1) itself (--preserve-status: its exit status is the agent's). Two
	// SIGTERMs sent by hand at once may merge into one pending signal; timeout's arrive after
	// the agent took the first.
	dir := filepath.Join(base, "mnt")
	require.NoError(t, os.Mkdir(dir, 0o755))
	a := startAgentIn(t, []string{"timeout", "--preserve-status", "4"}, dir, filepath.Join(base, "spool"))
	assert.Equal(t, 0, a.wait(30*time.Second), "a repeated SIGTERM is one stop\n%s", a.log())
	assert.NotContains(t, a.log(), "second signal")
	assert.Contains(t, a.log(), "unmounted")
	assert.False(t, isMounted(dir), "the agent unmounted before it exited")

	// A real second signal: the mount stays busy, and the agent stops waiting for it.
	dir2 := filepath.Join(base, "mnt2")
	require.NoError(t, os.Mkdir(dir2, 0o755))
	b := startAgent(t, dir2, filepath.Join(base, "spool2"))
	held, err := os.Create(filepath.Join(dir2, "held"))
	require.NoError(t, err)
	defer held.Close()
	require.NoError(t, b.cmd.Process.Signal(syscall.SIGTERM))
	time.Sleep(repeatWindow + 500*time.Millisecond)
	select {
	case <-b.done:
		t.Fatalf("the agent exited while a file was held open in its mount\n%s", b.log())
	default:
	}
	require.NoError(t, b.cmd.Process.Signal(syscall.SIGTERM))
	assert.NotEqual(t, 0, b.wait(10*time.Second))
	assert.Contains(t, b.log(), "second signal: exiting without waiting for the unmount")
	held.Close()
	forceUnmount(dir2)
}
