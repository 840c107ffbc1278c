package fs

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// mapperEnv makes the test binary a mapper (runMapper) instead of running the tests.
const mapperEnv = "MTCFS_TEST_MAPPER"

// runMapper is a job that writes through a shared writable mapping: spec is "size:byte:path".
// It creates the file with size bytes, fills the mapping with the byte, prints "ready", and
// keeps the mapping open until its standard input ends. It runs in a process of its own: a
// page fault on the mount in the process that serves it can wait for a request only that
// process's Go runtime would serve, which may be stopping the world for the faulting thread.
func runMapper(spec string) int {
	parts := strings.SplitN(spec, ":", 3)
	if len(parts) != 3 {
		return 2
	}
	size, err1 := strconv.Atoi(parts[0])
	pattern, err2 := strconv.Atoi(parts[1])
	if err1 != nil || err2 != nil {
		return 2
	}
	f, err := os.OpenFile(parts[2], os.O_CREATE|os.O_RDWR, 0o644)
	if err == nil {
		err = f.Truncate(int64(size))
	}
	var m []byte
	if err == nil {
		m, err = unix.Mmap(int(f.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	}
	if err != nil {
		fmt.Println(err)
		return 1
	}
	for i := range m {
		m[i] = byte(pattern)
	}
	fmt.Println("ready")
	os.Stdin.Read(make([]byte, 1))
	return 0
}

// mapDirty has a process of its own create p with size bytes and write pattern through a
// shared writable mapping that stays open until the test ends: the pages stay dirty in the
// kernel's page cache of the mount (fallback path) until something writes them back.
func mapDirty(t *testing.T, p string, size int, pattern byte) {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%d:%d:%s", mapperEnv, size, pattern, p))
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		stdin.Close()
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
		}
	})
	line := make(chan string, 1)
	go func() {
		l, _ := bufio.NewReader(stdout).ReadString('\n')
		line <- l
	}()
	select {
	case l := <-line:
		require.Equal(t, "ready\n", l, "the mapper failed")
	case <-time.After(30 * time.Second):
		t.Fatal("the mapper did not fill its mapping in 30 s")
	}
}

// TestWriteBackWaitsInTheHelper: the rename that commits a step has the kernel write back the
// pages a job dirtied through a mapping, and the kernel's wait for those WRITE requests happens
// in the pages' helper process, never in a thread of the mounting process: a SIGKILL of the
// agent then finds none of its threads waiting for replies it would never send (see
// writeback.go). Once the WRITE is answered the rename completes with the bytes.
func TestWriteBackWaitsInTheHelper(t *testing.T) {
	dir, srv, _, _ := mountWithEvents(t, PassthroughOff)
	e := srv.ns.m.notifier.Load()
	if e == nil || !e.pages.usesHelper() {
		t.Fatal("the mount has no helper for page notifications")
	}
	helper := e.pages.helper.cmd.Process.Pid
	require.NotEqual(t, e.entries.helper.cmd.Process.Pid, helper, "each kind of notification has a helper of its own")

	tmp := filepath.Join(dir, "7.orbax-checkpoint-tmp")
	require.NoError(t, os.Mkdir(tmp, 0o755))
	const size = 64 << 10
	mapDirty(t, filepath.Join(tmp, "m.bin"), size, 'm')

	entered, released := make(chan struct{}), make(chan struct{})
	var enter, free sync.Once
	hook := func(path string) {
		if strings.HasSuffix(path, "m.bin") {
			enter.Do(func() { close(entered) })
			<-released
		}
	}
	writeHook.Store(&hook)
	release := func() { free.Do(func() { close(released) }) }
	t.Cleanup(func() { writeHook.Store(nil); release() })

	renamed := make(chan error, 1)
	go func() { renamed <- os.Rename(tmp, filepath.Join(dir, "7")) }()
	select {
	case <-entered:
	case <-time.After(5 * time.Second):
		t.Fatal("the rename never wrote the mapped pages back")
	}
	const inval = "fuse_reverse_inval_inode"
	waitInKernel(t, helper, inval)
	if s := kernelStacks(os.Getpid()); strings.Contains(s, inval) {
		t.Fatalf("a thread of the mounting process waits in %s:\n%s", inval, s)
	}
	select {
	case err := <-renamed:
		t.Fatalf("the rename returned (%v) before the mapped pages were written back", err)
	default:
	}
	release()
	select {
	case err := <-renamed:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("the rename still waits after the WRITE was answered")
	}
	got, err := os.ReadFile(filepath.Join(dir, "7", "m.bin"))
	require.NoError(t, err)
	require.True(t, bytes.Equal(bytes.Repeat([]byte{'m'}, size), got), "the committed file lacks the mapped bytes")
}

// TestRefusedWriteBackFailsTheRename: pages the job dirtied through a mapping that the agent
// cannot store when the kernel writes them back (the spool is full) are dropped by the kernel,
// and the step would be committed without them. The rename fails instead, with ENOSPC, and the
// step keeps its temporary name.
func TestRefusedWriteBackFailsTheRename(t *testing.T) {
	const budget = 16 << 20
	dir, _ := testMount(t, PassthroughOff, budget)
	tmp := filepath.Join(dir, "7.orbax-checkpoint-tmp")
	require.NoError(t, os.Mkdir(tmp, 0o755))
	mapDirty(t, filepath.Join(tmp, "m.bin"), 2*budget, 'm') // sparse: only the write-back needs room

	err := os.Rename(tmp, filepath.Join(dir, "7"))
	require.True(t, errors.Is(err, syscall.ENOSPC), "the rename returned %v, want ENOSPC", err)
	_, err = os.Stat(filepath.Join(dir, "7"))
	require.True(t, errors.Is(err, os.ErrNotExist), "the step was committed: %v", err)
	_, err = os.Stat(tmp)
	require.NoError(t, err, "the step keeps its temporary name")

	// Rewritten from nothing, the file has no lost pages any more: the commit goes through.
	require.NoError(t, os.WriteFile(filepath.Join(tmp, "m.bin"), []byte("rewritten"), 0o644))
	require.NoError(t, os.Rename(tmp, filepath.Join(dir, "7")))
	got, err := os.ReadFile(filepath.Join(dir, "7", "m.bin"))
	require.NoError(t, err)
	require.Equal(t, "rewritten", string(got))
}

// TestPagesHelperAbortsWhenTheAgentIsGone: the pages' helper waits in the kernel for a WRITE of
// the write-back that no one will answer when the agent goes away (here: its end of the
// helper's life pipe is closed, as the kernel does when the agent exits). The helper aborts the
// connection, which ends the WRITE, its own write and the job's rename, and exits; the mount
// answers ENOTCONN, as after any kill, instead of hanging.
func TestPagesHelperAbortsWhenTheAgentIsGone(t *testing.T) {
	dir, srv, _, _ := mountWithEvents(t, PassthroughOff)
	e := srv.ns.m.notifier.Load()
	if e == nil || !e.pages.usesHelper() {
		t.Fatal("the mount has no helper for page notifications")
	}
	h := e.pages.helper
	tmp := filepath.Join(dir, "7.orbax-checkpoint-tmp")
	require.NoError(t, os.Mkdir(tmp, 0o755))
	mapDirty(t, filepath.Join(tmp, "m.bin"), 64<<10, 'm')

	released := make(chan struct{})
	var free sync.Once
	hook := func(path string) {
		if strings.HasSuffix(path, "m.bin") {
			<-released
		}
	}
	writeHook.Store(&hook)
	t.Cleanup(func() { writeHook.Store(nil); free.Do(func() { close(released) }) })

	renamed := make(chan error, 1)
	go func() { renamed <- os.Rename(tmp, filepath.Join(dir, "7")) }()
	waitInKernel(t, h.cmd.Process.Pid, "fuse_reverse_inval_inode")
	h.life.Close() // the agent is gone, as far as the helper can tell
	requireAborted(t, dir, h, "rename", renamed)
}

// TestWriteInFlightIsInTheCopy: a file still open for writing at a commit is copied into the
// checkpoint. A WRITE that passed its checks before the commit froze the file and is still
// storing its bytes when the copy starts is waited for: the job is told the write succeeded, so
// the checkpoint has it whole (it had a torn one, found by a black-box run). A write after the
// freeze fails with EROFS.
func TestWriteInFlightIsInTheCopy(t *testing.T) {
	dir, srv, _, _ := mountWithEvents(t, PassthroughOff)
	tmp := filepath.Join(dir, "7.orbax-checkpoint-tmp")
	require.NoError(t, os.Mkdir(tmp, 0o755))
	f, err := os.OpenFile(filepath.Join(tmp, "w.bin"), os.O_CREATE|os.O_RDWR, 0o644)
	require.NoError(t, err)
	defer f.Close()
	const size = 256 << 10
	_, err = f.WriteAt(bytes.Repeat([]byte{'a'}, size), 0)
	require.NoError(t, err)

	entered, released := make(chan struct{}), make(chan struct{})
	var enter, free sync.Once
	hook := func(path string) {
		if strings.HasSuffix(path, "w.bin") {
			enter.Do(func() { close(entered) })
			<-released
		}
	}
	writeHook.Store(&hook)
	release := func() { free.Do(func() { close(released) }) }
	// Before f.Close, deferred above: a close waits for the write in flight on its descriptor.
	defer func() { writeHook.Store(nil); release() }()
	wrote := make(chan error, 1)
	go func() {
		_, err := f.WriteAt(bytes.Repeat([]byte{'b'}, size), 0)
		wrote <- err
	}()
	select {
	case <-entered:
	case <-time.After(5 * time.Second):
		t.Fatal("the write never reached the agent")
	}

	dst := filepath.Join(t.TempDir(), "sealed")
	sealed := make(chan error, 1)
	go func() {
		_, err := srv.Namespace().Seal("7.orbax-checkpoint-tmp", dst)
		sealed <- err
	}()
	select {
	case err := <-sealed:
		t.Fatalf("the seal returned (%v) while a write it had let through was storing its bytes", err)
	case <-time.After(300 * time.Millisecond):
	}
	release()
	require.NoError(t, <-wrote, "the write passed its checks before the freeze")
	require.NoError(t, <-sealed)
	got, err := os.ReadFile(filepath.Join(dst, "w.bin"))
	require.NoError(t, err)
	require.True(t, bytes.Equal(bytes.Repeat([]byte{'b'}, size), got), "the checkpoint has %d bytes of the write that succeeded, of %d", bytes.Count(got, []byte{'b'}), size)
	writeHook.Store(nil)
	_, err = f.WriteAt([]byte("late"), 0)
	require.True(t, errors.Is(err, syscall.EROFS), "a write after the freeze returned %v, want EROFS", err)
}

// TestLostPagesFailTheSeal: a file some of whose mapped pages were refused at a write-back is not
// taken into a checkpoint, whatever commits it (a link or a close commits a pytorch .save without
// a rename): the seal fails and says why.
func TestLostPagesFailTheSeal(t *testing.T) {
	const budget = 16 << 20
	dir, srv, _, _ := mountWithEventsBudget(t, PassthroughOff, budget)
	mapDirty(t, filepath.Join(dir, "m.bin"), 2*budget, 'm')
	// The mapper's pages go back at its munmap at the latest.
	f, err := os.OpenFile(filepath.Join(dir, "m.bin"), os.O_RDWR, 0)
	require.NoError(t, err)
	err = f.Sync() // the write-back
	f.Close()
	require.True(t, errors.Is(err, syscall.ENOSPC), "fsync returned %v: the write-back must have been refused", err)
	_, err = srv.Namespace().Seal("m.bin", filepath.Join(t.TempDir(), "sealed"))
	var lost *LostPagesError
	require.True(t, errors.As(err, &lost), "the seal returned %v, want the lost pages named", err)
	require.True(t, errors.Is(err, syscall.ENOSPC), "%v", err)
}

// TestRenameFailsWhenCopiesDoNotFit: a file still open for writing at a commit's rename is copied
// into the checkpoint; when the copies cannot fit in the spool, the rename fails with ENOSPC
// (it returned, and the step could not be sealed). Closed, the file is linked, and the rename
// goes through.
func TestRenameFailsWhenCopiesDoNotFit(t *testing.T) {
	const budget = 16 << 20
	for _, mode := range modes {
		t.Run(string(mode), func(t *testing.T) {
			dir, _ := testMount(t, mode, budget)
			tmp := filepath.Join(dir, "7.orbax-checkpoint-tmp")
			require.NoError(t, os.Mkdir(tmp, 0o755))
			f, err := os.OpenFile(filepath.Join(tmp, "big.bin"), os.O_CREATE|os.O_RDWR, 0o644)
			require.NoError(t, err)
			defer f.Close()
			_, err = f.Write(bytes.Repeat([]byte{'b'}, 10<<20))
			require.NoError(t, err)

			err = os.Rename(tmp, filepath.Join(dir, "7"))
			require.True(t, errors.Is(err, syscall.ENOSPC), "the rename returned %v, want ENOSPC", err)
			require.NoError(t, f.Close())
			require.NoError(t, os.Rename(tmp, filepath.Join(dir, "7")), "closed, the file is linked")
		})
	}
}
