package main

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	mfs "github.com/mtcfs/mtcfs/fs"
)

// fakeMount is an unmounter whose Stop returns when released, or left in place when the stop
// gives up.
type fakeMount struct{ release chan error }

func (m fakeMount) Stop(giveUp <-chan struct{}) error {
	select {
	case err := <-m.release:
		return err
	case <-giveUp:
		return mfs.ErrLeftInPlace
	}
}

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
// mount) keeps its mount in place and serves it after one SIGTERM, and exits at a second one
// sent after repeatWindow, leaving the mount in place, unserved. Before, the busy mount was
// detached at the first signal: a save the job made by its path meanwhile (Orbax saves by
// absolute path) went into the plain directory below, was told to have succeeded, and was lost
// under the next mount (a black-box run of a Kubernetes node agent: 30 s of such saves). The
// next agent started on the directory replaces the mount left in place.
func TestSecondSignalEndsUnmountWait(t *testing.T) {
	needRoot(t)
	base := t.TempDir()
	dir := filepath.Join(base, "mnt")
	require.NoError(t, os.Mkdir(dir, 0o755))
	spool := filepath.Join(base, "spool")
	a := startAgent(t, dir, spool)
	held, err := os.Create(filepath.Join(dir, "held"))
	require.NoError(t, err)
	defer held.Close()
	t.Cleanup(func() { forceUnmount(dir) })
	require.NoError(t, a.cmd.Process.Signal(syscall.SIGTERM))
	repWait(t, 10*time.Second, "the agent to say its mount is busy", func() bool { return strings.Contains(a.log(), "the mount is busy") })
	require.True(t, isMounted(dir), "the busy mount was detached at the first signal")
	require.NoError(t, os.WriteFile(filepath.Join(dir, "during-stop"), []byte("x"), 0o644), "the mount still serves while the stop waits")
	time.Sleep(repeatWindow + time.Second) // the second SIGTERM must not count as a repeat
	select {
	case <-a.done:
		t.Fatalf("the agent exited while a file was held open in its mount\n%s", a.log())
	default:
	}
	require.NoError(t, a.cmd.Process.Signal(syscall.SIGTERM))
	assert.NotEqual(t, 0, a.wait(10*time.Second))
	assert.Contains(t, a.log(), "second signal: exiting without waiting for the processes that use the mount: it is left in place, unserved")
	assert.True(t, isMounted(dir), "the mount is left in place")
	_, err = os.Stat(filepath.Join(dir, "anything"))
	assert.ErrorIs(t, err, syscall.ENOTCONN, "the mount left in place is unserved")
	held.Close() // (its writes may still succeed: with passthrough they go to the spool's file)

	// The next agent on the directory replaces it; what the stop served meanwhile was written
	// into the mount, so the directory below holds nothing.
	b := startAgent(t, dir, spool)
	assert.Contains(t, b.log(), "detached a stale mount left by an agent that died")
	assert.NotContains(t, b.log(), "the mount hides entries")
	stopAgent(t, b)
	ents, err := os.ReadDir(dir)
	require.NoError(t, err)
	assert.Empty(t, ents, "the plain directory below the mount")
}

// TestHangupStopsCleanly: SIGHUP (the terminal an agent was started from was closed) stops the
// agent as SIGTERM does: exit 0, nothing left mounted. Before, it killed the agent where it
// stood, and the job's directory answered "Transport endpoint is not connected".
func TestHangupStopsCleanly(t *testing.T) {
	needRoot(t)
	n := newRepNode(t)
	a := n.start(t)
	require.NoError(t, a.cmd.Process.Signal(syscall.SIGHUP))
	require.Equal(t, 0, a.wait(30*time.Second), "SIGHUP should stop cleanly\n%s", a.log())
	assert.Contains(t, a.log(), "stopping")
	assert.False(t, isMounted(n.dir), "mount left behind after SIGHUP")
}

// TestBrokenLogPipe: the agent's stderr is a pipe whose reader goes away (a journald restart,
// `mtcfs mount … 2>&1 | head`). Its next log line fails, and the agent goes on serving; it then
// stops cleanly. Before, Go's default for SIGPIPE on fd 2 ended the agent where it stood.
func TestBrokenLogPipe(t *testing.T) {
	needRoot(t)
	n := newRepNode(t)
	r, w, err := os.Pipe()
	require.NoError(t, err)
	cmd := exec.Command(binPath, "mount", n.dir, "--spool", n.spool, "--memory", "64MiB", "--backup", n.backupURL())
	cmd.Stderr = w
	require.NoError(t, cmd.Start())
	w.Close()
	done := make(chan struct{}) // closed once the agent exited, with waitErr
	var waitErr error
	go func() { waitErr = cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-done
		forceUnmount(n.dir)
		forceUnmount(n.spool)
	})
	sc := bufio.NewScanner(r)
	for sc.Scan() && !strings.Contains(sc.Text(), servingLine) {
	}
	require.NoError(t, r.Close(), "the log's reader goes away") // the agent's next line gets EPIPE

	// The job's handshake makes the agent log (new incarnation, restore plan, …).
	yaml := "job-name: pipe\nframework: orbax\nnode-rank: 0\nnodes: 1\npeer-ranks: []\nbackup-interval-minutes: 600\n"
	require.NoError(t, os.WriteFile(filepath.Join(n.dir, "replicator.yaml"), []byte(yaml), 0o644))
	repWait(t, 10*time.Second, "the fresh-start marker", func() bool {
		return pathExists(filepath.Join(n.dir, "pipe-s0-n0-w0.restore"))
	})
	select {
	case <-done:
		t.Fatalf("the agent exited after its log pipe broke: %v", waitErr)
	default:
	}
	require.NoError(t, os.WriteFile(filepath.Join(n.dir, "after"), []byte("x"), 0o644), "the mount still serves")
	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	select {
	case <-done:
		require.NoError(t, waitErr, "a clean stop exits 0, its log lines lost")
	case <-time.After(30 * time.Second):
		t.Fatal("the agent did not stop")
	}
	assert.False(t, isMounted(n.dir), "mount left behind")
}

// TestStopSaysWhoKeepsTheMountBusy: a stop waits while processes use the mount (up to 30 s).
// Before, the agent logged "stopping" and nothing more until it went, and an agent started on
// the directory meanwhile (a restart typed right after a Ctrl-C) failed at once ("already a
// live FUSE mount", or "spool in use"). Now the stopping agent names the processes, and the new
// one waits for it to finish, then serves.
func TestStopSaysWhoKeepsTheMountBusy(t *testing.T) {
	needRoot(t)
	n := newRepNode(t)
	a := n.start(t)
	child := exec.Command("sleep", "60")
	child.Dir = n.dir
	require.NoError(t, child.Start())
	t.Cleanup(func() { child.Process.Kill(); child.Wait() })
	held, err := os.Create(filepath.Join(n.dir, "held"))
	require.NoError(t, err)
	defer held.Close()
	comm, err := os.ReadFile("/proc/self/comm")
	require.NoError(t, err)

	require.NoError(t, a.cmd.Process.Signal(syscall.SIGTERM))
	repWait(t, 10*time.Second, "the agent to say its mount is busy", func() bool { return strings.Contains(a.log(), "the mount is busy") })
	log := a.log()
	assert.Contains(t, log, fmt.Sprintf("pid %d (sleep: working directory)", child.Process.Pid))
	assert.Contains(t, log, fmt.Sprintf("pid %d (%s: 1 open file)", os.Getpid(), strings.TrimSpace(string(comm))))

	// An agent started meanwhile waits for the stopping one.
	var mu sync.Mutex
	var lines []string
	servedEarly := false // the new agent said it serves while the old one had not exited
	logged := func(s string) bool {
		mu.Lock()
		defer mu.Unlock()
		return strings.Contains(strings.Join(lines, "\n"), s)
	}
	b := exec.Command(binPath, "mount", n.dir, "--spool", n.spool, "--memory", "64MiB", "--backup", n.backupURL())
	exited, err := startLogged(b, func(line string) {
		mu.Lock()
		defer mu.Unlock()
		lines = append(lines, line)
		if strings.Contains(line, servingLine) {
			select {
			case <-a.done:
			default:
				servedEarly = true
			}
		}
	})
	require.NoError(t, err)
	bDone := make(chan struct{}) // closed once b exited (exited yields once: read it in one place)
	var bErr error
	go func() { bErr = <-exited; close(bDone) }()
	t.Cleanup(func() {
		b.Process.Kill()
		<-bDone
		forceUnmount(n.dir)
		forceUnmount(n.spool)
	})
	repWait(t, 10*time.Second, "the new agent to wait for the stopping one", func() bool {
		return logged("waiting for the agent that is stopping on this directory to finish") && logged(fmt.Sprintf("pid=%d", a.cmd.Process.Pid))
	})
	assert.False(t, logged(servingLine), "the new agent served while the old one was stopping")

	// They leave: the stop completes, and the new agent serves.
	held.Close()
	child.Process.Kill()
	child.Wait()
	assert.Equal(t, 0, a.wait(30*time.Second), "%s", a.log())
	repWait(t, 20*time.Second, "the new agent to serve", func() bool { return logged(servingLine) })
	assert.True(t, logged("the stopping agent is gone"))
	mu.Lock()
	assert.False(t, servedEarly, "the new agent served before the stopping one exited")
	mu.Unlock()
	stopStarted(t, b, bDone, &bErr)
	assert.False(t, isMounted(n.dir))
}

// TestReplacementPodWaitsForTheStoppingAgentOfItsSpool: a Kubernetes Job's replacement pod
// starts while the old pod still terminates. Its sidecar agent has the same mount path, in a
// mount namespace of its own (another emptyDir), and the node's spool, which the old agent holds
// while it stops (draining a backup, or waiting for its mount's users). It does not see the old
// agent in its registry of agents; it waits for the spool instead of failing at once with
// "spool … is in use" and being restarted with back-off (80 s in a black-box run), and then
// serves with the old agent's RAM.
func TestReplacementPodWaitsForTheStoppingAgentOfItsSpool(t *testing.T) {
	needRoot(t)
	n := newRepNode(t)
	a := n.start(t)
	t.Cleanup(func() { forceUnmount(n.dir); forceUnmount(n.spool) })
	held, err := os.Create(filepath.Join(n.dir, "held")) // keeps the old agent stopping
	require.NoError(t, err)
	t.Cleanup(func() { held.Close() })
	require.NoError(t, a.cmd.Process.Signal(syscall.SIGTERM))
	repWait(t, 10*time.Second, "the old agent to wait for its mount's users", func() bool { return strings.Contains(a.log(), "the mount is busy") })

	// The new pod: the same mount path in its own mount namespace, without the old pod's mount
	// and without the machine's registry of agents.
	script := fmt.Sprintf(`umount -l %s && mkdir -p /run/mtcfs && mount -t tmpfs tmpfs /run/mtcfs && exec "$0" "$@"`, n.dir)
	b := exec.Command("unshare", "-m", "--propagation", "private", "sh", "-c", script,
		binPath, "mount", n.dir, "--spool", n.spool, "--memory", "64MiB", "--backup", n.backupURL())
	var mu sync.Mutex
	var lines []string
	logged := func(s string) bool {
		mu.Lock()
		defer mu.Unlock()
		return strings.Contains(strings.Join(lines, "\n"), s)
	}
	exited, err := startLogged(b, func(line string) {
		mu.Lock()
		defer mu.Unlock()
		lines = append(lines, line)
	})
	require.NoError(t, err)
	bDone := make(chan struct{})
	var bErr error
	go func() { bErr = <-exited; close(bDone) }()
	t.Cleanup(func() { b.Process.Kill(); <-bDone })
	repWait(t, 10*time.Second, "the new agent to wait for the stopping one", func() bool {
		select {
		case <-bDone:
			mu.Lock()
			defer mu.Unlock()
			t.Fatalf("the new agent exited while the old one stopped: %v\n%s", bErr, strings.Join(lines, "\n"))
		default:
		}
		return logged("waiting for the agent that is stopping with this spool") && logged(fmt.Sprintf("pid=%d", a.cmd.Process.Pid))
	})
	assert.False(t, logged(servingLine), "the new agent served while the old one held the spool")

	held.Close()
	assert.Equal(t, 0, a.wait(30*time.Second), "%s", a.log())
	repWait(t, 20*time.Second, "the new agent to serve", func() bool { return logged(servingLine) })
	assert.True(t, logged("the stopping agent let the spool go"))
	stopStarted(t, b, bDone, &bErr)
}

// TestStopLeavesAloneWhatIsMountedAtItsDirectoryNow: the mount was detached from outside
// (umount -l) while a file in it stays open, and something else was mounted at the directory
// since (here a tmpfs; another agent's mount, say). The stop must not unmount that: it waits for
// its own mount's users, and ends when they leave. Before, the stop unmounted whatever was at
// the directory (and a review made a stopping agent detach another session's spool, whose
// mount had taken the numbers the detached mount had in the mount table).
func TestStopLeavesAloneWhatIsMountedAtItsDirectoryNow(t *testing.T) {
	needRoot(t)
	n := newRepNode(t)
	a := n.start(t)
	t.Cleanup(func() { forceUnmount(n.dir); forceUnmount(n.dir) })
	held, err := os.Create(filepath.Join(n.dir, "held"))
	require.NoError(t, err)
	t.Cleanup(func() { held.Close() })
	require.NoError(t, unix.Unmount(n.dir, unix.MNT_DETACH))
	require.NoError(t, unix.Mount("tmpfs", n.dir, "tmpfs", 0, "size=1m"))
	require.NoError(t, os.WriteFile(filepath.Join(n.dir, "other"), []byte("x"), 0o644))

	require.NoError(t, a.cmd.Process.Signal(syscall.SIGTERM))
	repWait(t, 10*time.Second, "the agent to see its mount detached from outside", func() bool {
		return strings.Contains(a.log(), "the mount was detached from outside")
	})
	time.Sleep(time.Second) // a few of the stop's tries
	_, err = os.Stat(filepath.Join(n.dir, "other"))
	require.NoError(t, err, "the stopping agent unmounted what is at its directory now\n%s", a.log())

	held.Close() // its mount's last user leaves: the connection ends, and so does the stop
	assert.Equal(t, 0, a.wait(30*time.Second), "%s", a.log())
	_, err = os.Stat(filepath.Join(n.dir, "other"))
	assert.NoError(t, err, "what is at the directory now")
	require.NoError(t, unix.Unmount(n.dir, 0))
}

// TestStopWaitsForASaveInProgress: a save in progress at the SIGTERM, made file after file by
// path (open, write, close, with short gaps, as a job writes its tensors), goes into the mount
// whole: the stop unmounts only once the mount has seen no change for a moment. Before, the
// unmount came in a gap between two files (the mount was idle, or its one open file had just
// been closed), and the rest of the save, committed by its rename, landed in the plain directory
// below and was lost (a black-box run: 3 of 3).
func TestStopWaitsForASaveInProgress(t *testing.T) {
	needRoot(t)
	n := newRepNode(t)
	a := n.start(t)
	t.Cleanup(func() { forceUnmount(n.dir) })
	yaml := "job-name: quiet\nframework: orbax\nnode-rank: 0\nnodes: 1\npeer-ranks: []\nbackup-interval-minutes: 600\n"
	require.NoError(t, os.WriteFile(filepath.Join(n.dir, "replicator.yaml"), []byte(yaml), 0o644))
	repWait(t, 10*time.Second, "the fresh-start marker", func() bool {
		return pathExists(filepath.Join(n.dir, "quiet-s0-n0-w0.restore"))
	})
	tmp := filepath.Join(n.dir, "1.orbax-checkpoint-tmp")
	require.NoError(t, os.Mkdir(tmp, 0o755))
	require.NoError(t, a.cmd.Process.Signal(syscall.SIGTERM))
	for i := range 20 { // about 0.6 s of a save after the signal
		require.NoError(t, os.WriteFile(filepath.Join(tmp, fmt.Sprintf("f%02d", i)), []byte(strings.Repeat("x", 4096)), 0o644), "file %d", i)
		time.Sleep(30 * time.Millisecond)
	}
	require.NoError(t, os.Rename(tmp, filepath.Join(n.dir, "1")))
	assert.Equal(t, 0, a.wait(30*time.Second), "%s", a.log())
	ents, err := os.ReadDir(n.dir)
	require.NoError(t, err)
	assert.Empty(t, ents, "the directory below the mount: the save landed there\n%s", a.log())

	b := n.start(t)
	require.NoError(t, os.WriteFile(filepath.Join(n.dir, "replicator.yaml"), []byte(yaml), 0o644))
	repWait(t, 10*time.Second, "the restore of step 1", func() bool {
		return pathExists(filepath.Join(n.dir, "quiet-s1-n0-w0.restore"))
	})
	stopAgent(t, b)
}

// stopStarted stops an agent a test started with startLogged (done closes once it exited, its
// error then in *err) and requires a clean exit within 30 s.
func stopStarted(t *testing.T, cmd *exec.Cmd, done <-chan struct{}, err *error) {
	t.Helper()
	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	select {
	case <-done:
		assert.NoError(t, *err)
	case <-time.After(30 * time.Second):
		t.Fatal("the new agent did not stop")
	}
}
