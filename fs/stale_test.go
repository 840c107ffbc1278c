package fs

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/internal/fusectl"
)

// hungMount mounts a FUSE filesystem at a new directory whose /dev/fuse descriptor the test
// holds and never reads: every access waits, as on the mount of an agent that was killed while
// one of its threads waited in the kernel. The cleanup aborts and detaches it.
func hungMount(t *testing.T) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount")
	}
	dir := filepath.Join(t.TempDir(), "mnt")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	dev, err := os.OpenFile("/dev/fuse", os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	opts := fmt.Sprintf("fd=%d,rootmode=40000,user_id=0,group_id=0", dev.Fd())
	if err := unix.Mount("mtcfs", dir, "fuse.mtcfs", unix.MS_NOSUID|unix.MS_NODEV, opts); err != nil {
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
	old := staleAnswerTimeout
	staleAnswerTimeout = 300 * time.Millisecond
	t.Cleanup(func() { staleAnswerTimeout = old })

	waiter := make(chan error, 1)
	go func() { // a job's access, waiting on the mount
		_, err := os.ReadDir(dir)
		waiter <- err
	}()
	select {
	case err := <-waiter:
		t.Fatalf("an access to the mount nobody serves returned (%v): the test's mount does not hang", err)
	case <-time.After(200 * time.Millisecond):
	}

	detached, err := DetachStale(dir)
	if err != nil || !detached {
		t.Fatalf("DetachStale = %v, %v; want the hung mount detached", detached, err)
	}
	if isFuseMountPoint(dir) {
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
