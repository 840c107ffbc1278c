package main

import (
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// fakeMount is an unmounter whose Unmount returns when released.
type fakeMount struct{ release chan error }

func (m fakeMount) Unmount() error { return <-m.release }

// TestUnmountBoundedRepeatedSignal: while the unmount runs, the same signal again within
// repeatWindow of the first is part of the same stop (GNU timeout(1) sends the command one
// SIGTERM and its process group another); a later one, or another signal, ends the wait.
func TestUnmountBoundedRepeatedSignal(t *testing.T) {
	t0 := time.Now()
	first := stopSignal{sig: syscall.SIGTERM, at: t0}
	// run reports whether unmountBounded returned before the unmount ended. Where a return is
	// expected (wantEarly) it waits up to 10 s for it (a loaded machine may start the goroutine
	// late); otherwise 200 ms show that it waits.
	run := func(wantEarly bool, more ...stopSignal) (error, bool) {
		m := fakeMount{release: make(chan error, 1)}
		sigs := make(chan stopSignal, len(more))
		for _, s := range more {
			sigs <- s
		}
		errc := make(chan error, 1)
		go func() { errc <- unmountBounded(m, sigs, first) }()
		patience := 200 * time.Millisecond
		if wantEarly {
			patience = 10 * time.Second
		}
		select {
		case err := <-errc:
			return err, true // returned before the unmount ended
		case <-time.After(patience):
		}
		m.release <- errors.New("unmounted")
		return <-errc, false
	}

	err, early := run(false, stopSignal{sig: syscall.SIGTERM, at: t0.Add(time.Millisecond)})
	assert.False(t, early, "a repeat 1 ms later must not end the wait: %v", err)
	assert.EqualError(t, err, "unmounted")

	err, early = run(true, stopSignal{sig: syscall.SIGTERM, at: t0.Add(repeatWindow)})
	assert.True(t, early, "a SIGTERM %v later is a second signal", repeatWindow)
	assert.ErrorContains(t, err, "second signal")

	err, early = run(true, stopSignal{sig: syscall.SIGINT, at: t0.Add(time.Millisecond)})
	assert.True(t, early, "another signal is a second signal, however soon")
	assert.ErrorContains(t, err, "second signal")

	err, early = run(false)
	assert.False(t, early)
	assert.EqualError(t, err, "unmounted")
}

// TestNotifyStopStampsArrival: a signal is stamped when it arrives, not when it is read.
func TestNotifyStopStampsArrival(t *testing.T) {
	sigs, stop := notifyStop()
	defer stop()
	before := time.Now()
	require.NoError(t, syscall.Kill(os.Getpid(), syscall.SIGTERM))
	time.Sleep(3 * time.Second) // the signal waits, as during the replicator's drain
	select {
	case s := <-sigs:
		assert.Equal(t, syscall.SIGTERM, s.sig)
		assert.Less(t, s.at.Sub(before), 2*time.Second, "stamped on arrival, not when read")
	case <-time.After(5 * time.Second):
		t.Fatal("the SIGTERM was not delivered")
	}
}

// TestSecondSignalEndsUnmountWait: an agent whose unmount cannot finish (a file held open in the
// mount) keeps waiting after one SIGTERM, and exits at a second one sent after repeatWindow.
func TestSecondSignalEndsUnmountWait(t *testing.T) {
	needRoot(t)
	base := t.TempDir()
	dir := filepath.Join(base, "mnt")
	require.NoError(t, os.Mkdir(dir, 0o755))
	a := startAgent(t, dir, filepath.Join(base, "spool"))
	held, err := os.Create(filepath.Join(dir, "held"))
	require.NoError(t, err)
	defer held.Close()
	require.NoError(t, a.cmd.Process.Signal(syscall.SIGTERM))
	time.Sleep(repeatWindow + 2*time.Second) // the second SIGTERM must not count as a repeat
	select {
	case <-a.done:
		t.Fatalf("the agent exited while a file was held open in its mount\n%s", a.log())
	default:
	}
	require.NoError(t, a.cmd.Process.Signal(syscall.SIGTERM))
	assert.NotEqual(t, 0, a.wait(10*time.Second))
	assert.Contains(t, a.log(), "second signal: exiting without waiting for the unmount")
	held.Close()
	forceUnmount(dir)
}
