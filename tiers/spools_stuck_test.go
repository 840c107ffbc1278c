package tiers

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mtcfs/mtcfs/internal/fusectl"
)

// stuckRoot is the root of a FUSE file system whose server stops answering once armed, as an
// agent does under SIGSTOP: its LOOKUPs and GETATTRs wait until released.
type stuckRoot struct {
	gofs.Inode
	armed   atomic.Bool
	release chan struct{}
	asked   atomic.Int32 // requests that waited
}

var (
	_ = (gofs.NodeLookuper)((*stuckRoot)(nil))
	_ = (gofs.NodeGetattrer)((*stuckRoot)(nil))
)

func (r *stuckRoot) stall() {
	if r.armed.Load() {
		r.asked.Add(1)
		<-r.release
	}
}

func (r *stuckRoot) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	r.stall()
	return nil, syscall.ENOENT
}

func (r *stuckRoot) Getattr(ctx context.Context, fh gofs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	r.stall()
	out.Mode = syscall.S_IFDIR | 0o755
	return 0
}

// stuckMount mounts a stuckRoot (not armed) at a new directory, and sets mountStatTimeout to
// 200 ms for the test; unstick releases the waiting requests.
func stuckMount(t *testing.T) (dir string, root *stuckRoot, unstick func()) {
	dir = t.TempDir()
	root = &stuckRoot{release: make(chan struct{})}
	zero := time.Duration(0)
	srv, err := gofs.Mount(dir, root, &gofs.Options{EntryTimeout: &zero, AttrTimeout: &zero, NegativeTimeout: &zero,
		MountOptions: fuse.MountOptions{DirectMount: true, FsName: "stuck", Name: "stuck"}})
	require.NoError(t, err)
	var once sync.Once
	unstick = func() { once.Do(func() { root.armed.Store(false); close(root.release) }) }
	t.Cleanup(func() {
		unstick()
		if srv.Unmount() != nil {
			fusectl.Abort(dir)
			syscall.Unmount(dir, syscall.MNT_DETACH)
		}
	})
	old := mountStatTimeout
	mountStatTimeout = 200 * time.Millisecond
	t.Cleanup(func() { mountStatTimeout = old })
	return dir, root, unstick
}

// TestOrphanedAsksNoStoppedServer: the orphaned spools a restore looks for at every start are
// found without a stat of a mount directory that is a mount point (another agent's, stopped),
// and one below such a mount that does not answer is not orphaned. Before, the look waited for
// the stopped server, and each restore left a goroutine waiting (found by a review).
func TestOrphanedAsksNoStoppedServer(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting FUSE here needs root")
	}
	dir, root, _ := stuckMount(t)
	base := t.TempDir()
	gone := filepath.Join(base, "gone")
	require.NoError(t, os.Mkdir(gone, 0o755))
	var dirs []string
	for i, mnt := range []string{dir, filepath.Join(dir, "below"), gone} {
		sd := filepath.Join(base, fmt.Sprintf("spool%d", i))
		s, err := OpenSpool(SpoolConfig{Dir: sd, Budget: MinBudget, MountPath: mnt})
		require.NoError(t, err)
		require.NoError(t, os.MkdirAll(filepath.Join(sd, "meta"), 0o700)) // a step: the spool is kept
		require.NoError(t, os.WriteFile(filepath.Join(sd, "meta", "llama-s10-n0-w0.meta"), []byte("abc"), 0o600))
		s.Release(slog.New(slog.DiscardHandler))
		dirs = append(dirs, sd)
	}
	require.NoError(t, os.Remove(gone))
	h := Spools{Dirs: func() []string { return dirs }, Users: func() ([]SpoolUser, error) { return nil, nil }}
	root.armed.Store(true)
	done := make(chan []SpoolInfo, 1)
	go func() {
		found, err := h.Orphaned()
		assert.NoError(t, err)
		done <- found
	}()
	select {
	case found := <-done:
		require.Len(t, found, 1)
		assert.Equal(t, dirs[2], found[0].Dir, "the spool of the mount directory gone")
	case <-time.After(10 * time.Second): // a hang, whatever the machine's speed
		t.Fatal("Orphaned waited for the stopped server")
	}
}

// TestMountPathStateAsksNoStoppedServer: the state of a mount path that is a mount point is
// known without a stat, which would wait for the mount's server (another agent, stopped); a path
// below such a mount is given mountStatTimeout and then counts as existing, never as gone.
func TestMountPathStateAsksNoStoppedServer(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting FUSE here needs root")
	}
	dir, root, unstick := stuckMount(t)
	root.armed.Store(true)

	state := func(p string) string {
		done := make(chan string, 1)
		go func() { done <- mountPathState(p, readMounts()) }()
		select {
		case s := <-done:
			return s
		case <-time.After(10 * time.Second): // a hang, whatever the machine's speed
			t.Fatalf("mountPathState(%s) waited for the stopped server", p)
			return ""
		}
	}
	assert.Equal(t, MountExists, state(dir), "a mount point exists")
	assert.Zero(t, root.asked.Load(), "the mount point's state asked its server")
	assert.Equal(t, MountExists, state(filepath.Join(dir, "below")), "a path whose lstat does not answer counts as existing")
	// The lstat goes on in the background: its LOOKUP reaches the server (it may not have
	// within the timeout on a loaded machine; the state is the same either way).
	require.Eventually(t, func() bool { return root.asked.Load() > 0 }, 10*time.Second, 10*time.Millisecond,
		"the path below the mount was asked for")
	unstick()
	assert.Equal(t, MountGone, state(filepath.Join(dir, "below")), "answered, the path below is gone")
}

// TestFindAsksNoStoppedServer: `mtcfs spool free MOUNT` of a mount whose agent is stopped
// (SIGSTOP) finds the spool without asking the mount: a FUSE mount is never taken for a spool
// directory. Before, its lstat waited for the stopped agent, for as long as it was stopped
// (found by a black-box run).
func TestFindAsksNoStoppedServer(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting FUSE here needs root")
	}
	dir, root, _ := stuckMount(t)
	sd := filepath.Join(t.TempDir(), "spool")
	s, err := OpenSpool(SpoolConfig{Dir: sd, Budget: MinBudget, MountPath: dir})
	require.NoError(t, err)
	require.NoError(t, os.MkdirAll(filepath.Join(sd, "meta"), 0o700)) // a step: the spool is kept
	require.NoError(t, os.WriteFile(filepath.Join(sd, "meta", "llama-s10-n0-w0.meta"), []byte("abc"), 0o600))
	s.Release(slog.New(slog.DiscardHandler))
	h := Spools{Dirs: func() []string { return []string{sd} }, Users: func() ([]SpoolUser, error) { return nil, nil }}
	spools, err := h.List()
	require.NoError(t, err)
	root.armed.Store(true)
	done := make(chan []SpoolInfo, 1)
	go func() {
		found, err := h.Find(dir, spools)
		assert.NoError(t, err)
		done <- found
	}()
	select {
	case found := <-done:
		require.Len(t, found, 1)
		assert.Equal(t, sd, found[0].Dir)
	case <-time.After(10 * time.Second): // a hang, whatever the machine's speed
		t.Fatal("Find waited for the stopped server")
	}
	assert.Zero(t, root.asked.Load(), "the mount was asked")
}
