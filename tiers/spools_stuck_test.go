package tiers

import (
	"context"
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

// TestMountPathStateAsksNoStoppedServer: the state of a mount path that is a mount point is
// known without a stat, which would wait for the mount's server (another agent, stopped); a path
// below such a mount is given mountStatTimeout and then counts as existing, never as gone.
func TestMountPathStateAsksNoStoppedServer(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting FUSE here needs root")
	}
	dir := t.TempDir()
	root := &stuckRoot{release: make(chan struct{})}
	zero := time.Duration(0)
	srv, err := gofs.Mount(dir, root, &gofs.Options{EntryTimeout: &zero, AttrTimeout: &zero, NegativeTimeout: &zero,
		MountOptions: fuse.MountOptions{DirectMount: true, FsName: "stuck", Name: "stuck"}})
	require.NoError(t, err)
	var once sync.Once
	unstick := func() { once.Do(func() { root.armed.Store(false); close(root.release) }) }
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
