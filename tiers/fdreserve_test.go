package tiers

import (
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// TestFDReserveGivesARecordItsDescriptors: in a process whose descriptors are all taken (a job
// holding as many files open in the mount as the agent's limit allows), a write of the agent's
// own record fails with EMFILE, and succeeds through the reserve, which is filled again once
// descriptors are free. It runs in a child process: the limit is the whole process's.
func TestFDReserveGivesARecordItsDescriptors(t *testing.T) {
	if os.Getenv("MTCFS_FDRESERVE_CHILD") == "" {
		cmd := exec.Command(os.Args[0], "-test.run=^TestFDReserveGivesARecordItsDescriptors$", "-test.v")
		cmd.Env = append(os.Environ(), "MTCFS_FDRESERVE_CHILD=1")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("child: %v\n%s", err, out)
		}
		return
	}
	dir := t.TempDir()
	write := func(name string) func() error {
		return func() error { return os.WriteFile(filepath.Join(dir, name), []byte("{}"), 0o600) }
	}
	var r fdReserve
	r.fill()
	require.Len(t, r.fds, fdReserveSize)
	// Take every descriptor left under a limit a little above what is open now.
	var lim unix.Rlimit
	require.NoError(t, unix.Getrlimit(unix.RLIMIT_NOFILE, &lim))
	lim.Cur = 256
	require.NoError(t, unix.Setrlimit(unix.RLIMIT_NOFILE, &lim))
	var taken []int
	for {
		fd, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			require.ErrorIs(t, err, syscall.EMFILE)
			break
		}
		taken = append(taken, fd)
	}
	require.ErrorIs(t, write("plain")(), syscall.EMFILE, "without the reserve")
	require.NoError(t, r.retry(write("record")), "through the reserve")
	require.Len(t, r.fds, fdReserveSize, "filled again: the write closed its descriptor")
	hold := func() error { // a write that keeps its descriptor
		fd, err := unix.Open(filepath.Join(dir, "held"), unix.O_CREAT|unix.O_WRONLY|unix.O_CLOEXEC, 0o600)
		if err == nil {
			taken = append(taken, fd)
		}
		return err
	}
	require.NoError(t, r.retry(hold), "through the reserve")
	require.Len(t, r.fds, fdReserveSize-1, "filled again as far as the limit lets it")
	var nilReserve *fdReserve
	require.ErrorIs(t, nilReserve.retry(hold), syscall.EMFILE, "no reserve: the error")
	for _, fd := range taken {
		unix.Close(fd)
	}
	require.NoError(t, r.retry(func() error { return nil }))
	require.Len(t, r.fds, fdReserveSize, "a retry takes the descriptors back once they are free")
	r.close()
	r.fill()
	require.Empty(t, r.fds, "closed: nothing opened again")
}

// TestFDReserveRetriesTakeTurns: a second write failing for lack of descriptors while a first
// one runs on the released reserve waits for its turn, and gets the reserve filled again. Before,
// its refill took the released descriptors back from under the first write (a review).
func TestFDReserveRetriesTakeTurns(t *testing.T) {
	var r fdReserve
	r.fill()
	defer r.close()
	emfileFirst := func(inReserve func()) func() error {
		calls := 0
		return func() error {
			if calls++; calls == 1 {
				return syscall.EMFILE
			}
			if inReserve != nil {
				inReserve()
			}
			return nil
		}
	}
	inA, goA, aDone, bDone := make(chan struct{}), make(chan struct{}), make(chan error, 1), make(chan error, 1)
	go func() {
		aDone <- r.retry(emfileFirst(func() {
			close(inA)
			<-goA
		}))
	}()
	<-inA
	r.mu.Lock()
	released := len(r.fds)
	r.mu.Unlock()
	require.Zero(t, released, "the first write runs on the released reserve")
	go func() { bDone <- r.retry(emfileFirst(nil)) }()
	select {
	case err := <-bDone:
		t.Fatalf("the second write returned (%v) while the first held the reserve", err)
	case <-time.After(100 * time.Millisecond):
	}
	r.mu.Lock()
	released = len(r.fds)
	r.mu.Unlock()
	require.Zero(t, released, "nothing took the released descriptors back")
	close(goA)
	require.NoError(t, <-aDone)
	require.NoError(t, <-bDone)
	require.Len(t, r.fds, fdReserveSize)
}
