package fs

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/hanwen/go-fuse/v2/fuse"
	"github.com/mtcfs/mtcfs/internal/fusectl"
)

// hungMount mounts a FUSE filesystem at a new directory whose /dev/fuse descriptor the test
// holds and never reads: every access waits, as on the mount of an agent that was killed while
// one of its threads waited in the kernel. The cleanup aborts and detaches it.
func hungMount(t *testing.T) string {
	t.Helper()
	return hungMountOf(t, mountType)
}

// hungMountOf is hungMount for a mount of file system type fstype ("fuse.NAME").
func hungMountOf(t *testing.T, fstype string) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount")
	}
	// A space in the path: mountinfo escapes it (\040), and the abort must find the mount all
	// the same.
	dir := filepath.Join(t.TempDir(), "hung mnt")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	dev, err := os.OpenFile("/dev/fuse", os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	opts := fmt.Sprintf("fd=%d,rootmode=40000,user_id=0,group_id=0", dev.Fd())
	if err := unix.Mount(strings.TrimPrefix(fstype, "fuse."), dir, fstype, unix.MS_NOSUID|unix.MS_NODEV, opts); err != nil {
		dev.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		fusectl.Abort(dir)
		unix.Unmount(dir, unix.MNT_DETACH)
		dev.Close()
	})
	return dir
}

// TestDetachStaleAbortsAMountThatDoesNotAnswer: a mount nobody serves and no "mtcfs mount"
// process claims is aborted and detached, and what waited on it is freed.
func TestDetachStaleAbortsAMountThatDoesNotAnswer(t *testing.T) {
	dir := hungMount(t)

	waiter := waitingAccess(dir) // a job's access, waiting on the mount
	if returned, err := answeredWithin(waiter, 200*time.Millisecond); returned {
		t.Fatalf("an access to the mount nobody serves returned (%v): the test's mount does not hang", err)
	}

	detached, err := DetachStale(dir, 300*time.Millisecond)
	if err != nil || !detached {
		t.Fatalf("DetachStale = %v, %v; want the hung mount detached", detached, err)
	}
	if fuseMountType(dir) != "" {
		t.Error("the hung mount is still mounted")
	}
	select {
	case err := <-waiter:
		if !errors.Is(err, unix.ENOTCONN) && !errors.Is(err, unix.ECONNABORTED) {
			t.Errorf("the waiting access returned %v, want ENOTCONN or ECONNABORTED", err)
		}
	case <-time.After(5 * time.Second):
		t.Error("the access that waited on the mount is still waiting after the abort")
	}
}

// TestDetachStaleLeavesAnotherFileSystemsMount: a FUSE mount of another file system (gcsfuse,
// sshfs) that does not answer is not aborted, even with no "mtcfs mount" process for it: its
// server may be alive and waiting on its network, and an abort would lose what it has not
// written yet. DetachStale names it and leaves it mounted.
func TestDetachStaleLeavesAnotherFileSystemsMount(t *testing.T) {
	dir := hungMountOf(t, "fuse.sshfs")
	detached, err := DetachStale(dir, 300*time.Millisecond)
	if err == nil || detached {
		t.Fatalf("DetachStale = %v, %v; want a refusal", detached, err)
	}
	for _, want := range []string{"is a fuse.sshfs mount that does not answer", "not an mtcfs mount"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	if got := fuseMountType(dir); got != "fuse.sshfs" {
		t.Errorf("the mount at %s is now %q, want it left as fuse.sshfs", dir, got)
	}
	if returned, err := answeredWithin(waitingAccess(dir), 200*time.Millisecond); returned { // ends at the cleanup's abort
		t.Errorf("an access to the mount returned (%v): its connection was aborted", err)
	}
}

// waitingAccess reads the directory dir in the background; the channel gets the result.
func waitingAccess(dir string) <-chan error {
	done := make(chan error, 1)
	go func() {
		_, err := os.ReadDir(dir)
		done <- err
	}()
	return done
}

// answeredWithin tells whether access returned within d, and what.
func answeredWithin(access <-chan error, d time.Duration) (bool, error) {
	select {
	case err := <-access:
		return true, err
	case <-time.After(d):
		return false, nil
	}
}

// TestNotificationsWaitInTheHelper: a notification about a name at the root waits for the root's
// lock while a job's lookup there holds it and waits for the agent. That wait happens in the
// helper process, never in a thread of the mounting process, so a SIGKILL of the agent finds
// none of its threads stuck in the kernel (see notifier.go); once the lookup is answered the
// notification goes through.
func TestNotificationsWaitInTheHelper(t *testing.T) {
	dir, srv, _, _ := mountWithEvents(t, PassthroughAuto)
	e := srv.ns.m.notifier.Load()
	if e == nil || !e.usesHelper() {
		t.Fatal("the mount has no notification helper")
	}
	helper := e.entries.helper.cmd.Process.Pid
	_, release := stallLookup(t, dir)
	done := make(chan struct{})
	go func() {
		srv.ns.changed("other")
		close(done)
	}()
	const inval = "fuse_reverse_inval_entry"
	waitInKernel(t, helper, inval)
	if s := kernelStacks(os.Getpid()); strings.Contains(s, inval) {
		t.Fatalf("a thread of the mounting process waits in %s:\n%s", inval, s)
	}
	select {
	case <-done:
		t.Fatal("the notification went through while the root's lock was held")
	default:
	}
	release()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("the notification still waits after the lookup was answered")
	}
}

// stallLookup makes a job's lookup of "stalled" at the root of the mount at dir wait in the
// mount's LOOKUP (lookupHook) until release, or the test's end: the kernel holds the root's lock
// meanwhile. It returns once the lookup has reached the mount; job receives the lookup's error.
func stallLookup(t *testing.T, dir string) (job <-chan error, release func()) {
	t.Helper()
	entered, released := make(chan struct{}), make(chan struct{})
	var enter, free sync.Once
	hook := func(name string) {
		if name == "stalled" {
			enter.Do(func() { close(entered) })
			<-released
		}
	}
	lookupHook.Store(&hook)
	release = func() { free.Do(func() { close(released) }) }
	t.Cleanup(func() { lookupHook.Store(nil); release() })
	errc := make(chan error, 1)
	go func() {
		_, err := os.Stat(filepath.Join(dir, "stalled"))
		errc <- err
	}()
	select {
	case <-entered:
	case <-time.After(5 * time.Second):
		t.Fatal("the stalled lookup never reached the agent")
	}
	return errc, release
}

// waitInKernel waits until a thread of process pid waits in the kernel function fn.
func waitInKernel(t *testing.T, pid int, fn string) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); !strings.Contains(kernelStacks(pid), fn); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("process %d never waited in %s; its threads:\n%s", pid, fn, kernelStacks(pid))
		}
	}
}

// kernelStacks returns the kernel stacks of every thread of process pid.
func kernelStacks(pid int) string {
	var b strings.Builder
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/stack", pid))
	for _, p := range tasks {
		st, _ := os.ReadFile(p)
		b.Write(st)
	}
	return b.String()
}

// TestHelperAbortsWhenTheAgentIsGoneMidWrite: the helper's write waits for the root's lock, held
// by a job's lookup that no one will answer, when the agent goes away (here: its end of the
// helper's life pipe is closed, as the kernel does when the agent exits). The helper then aborts
// the connection, which ends the lookup and its own write, and exits; the mount answers ENOTCONN.
func TestHelperAbortsWhenTheAgentIsGoneMidWrite(t *testing.T) {
	dir, srv, _, _ := mountWithEvents(t, PassthroughAuto)
	e := srv.ns.m.notifier.Load()
	if e == nil || !e.usesHelper() {
		t.Fatal("the mount has no notification helper")
	}
	h := e.entries.helper
	job, _ := stallLookup(t, dir)
	sent := make(chan error, 1)
	go func() { sent <- e.expire(fuse.FUSE_ROOT_ID, "other") }()
	waitInKernel(t, h.cmd.Process.Pid, "fuse_reverse_inval_entry")
	h.life.Close() // the agent is gone, as far as the helper can tell
	requireAborted(t, dir, h, "lookup", job)
	select {
	case <-sent:
	case <-time.After(5 * time.Second):
		t.Fatal("the notification still waits after the abort")
	}
}

// requireAborted checks that once the agent is gone, helper h aborts the connection of the
// mount at dir: the job's call what, waiting for the agent, returns (on job) with the connection
// aborted, h exits, and the mount answers ENOTCONN.
func requireAborted(t *testing.T, dir string, h *notifierHelper, what string, job <-chan error) {
	t.Helper()
	select {
	case err := <-job:
		if !errors.Is(err, unix.ECONNABORTED) && !errors.Is(err, unix.ENOTCONN) {
			t.Errorf("the job's %s returned %v, want the connection aborted", what, err)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("the job's %s still waits: the helper did not abort the connection", what)
	}
	pid := h.cmd.Process.Pid // reaped by startNotifier's cmd.Wait once it exits
	for deadline := time.Now().Add(5 * time.Second); unix.Kill(pid, 0) == nil; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Error("the helper did not exit")
			break
		}
	}
	var st unix.Statfs_t // statfs always asks the server (a stat may come from the kernel's cache)
	if err := unix.Statfs(dir, &st); !errors.Is(err, unix.ENOTCONN) {
		t.Errorf("the mount answers %v after the abort, want ENOTCONN", err)
	}
}

// TestCheckMountableRefusesTheRoot: a mount on / (given as /, or through a symlink to it) would
// hide the whole file system from everything in the mount namespace; it is refused before
// anything is mounted.
func TestCheckMountableRefusesTheRoot(t *testing.T) {
	link := filepath.Join(t.TempDir(), "root")
	if err := os.Symlink("/", link); err != nil {
		t.Fatal(err)
	}
	for _, dir := range []string{"/", link, "/tmp/.."} {
		err := CheckMountable(dir)
		if err == nil || !strings.Contains(err.Error(), "would hide the whole file system") {
			t.Errorf("CheckMountable(%q) = %v, want a refusal", dir, err)
		}
	}
	if err := CheckMountable(t.TempDir()); err != nil && strings.Contains(err.Error(), "whole file system") {
		t.Errorf("an ordinary directory was refused: %v", err)
	}
}
