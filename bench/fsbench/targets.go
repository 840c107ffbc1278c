package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Every target gets the same amount of memory: tmpfs size and mtcfs --memory.
const (
	tmpfsSize   = "4g"
	agentMemory = "4GiB"
)

// Names of the targets, also the column titles of the report. tmpfs is the baseline.
const (
	tmpfsTarget       = "tmpfs"
	passthroughTarget = "passthrough"
	fallbackTarget    = "fallback"
)

// A target is a directory the workloads run in.
type target struct {
	name string
	dir  string
}

// targetSet owns the mounts and agent processes behind the targets.
type targetSet struct {
	base    string // temporary directory holding the mount points and spools
	list    []*target
	agents  []int          // pids of the running agents
	closers []func() error // in setup order; tearDown runs them in reverse
}

// setUpTargets mounts the baseline tmpfs and starts the two mtcfs agents under a new temporary
// directory in workDir. On error, what was already set up is torn down.
func setUpTargets(ctx context.Context, bin, workDir string) (*targetSet, error) {
	base, err := os.MkdirTemp(workDir, "fsbench-")
	if err != nil {
		return nil, err
	}
	ts := &targetSet{base: base}
	if err := ts.mountTmpfs(); err != nil {
		return nil, errors.Join(err, ts.tearDown())
	}
	for _, a := range []struct{ name, mode string }{{passthroughTarget, "on"}, {fallbackTarget, "off"}} {
		if err := ts.startAgent(ctx, bin, a.name, a.mode); err != nil {
			return nil, errors.Join(err, ts.tearDown())
		}
	}
	return ts, nil
}

func (ts *targetSet) mountTmpfs() error {
	dir := filepath.Join(ts.base, tmpfsTarget)
	if err := os.Mkdir(dir, 0o755); err != nil {
		return err
	}
	if err := unix.Mount("fsbench", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "size="+tmpfsSize); err != nil {
		return fmt.Errorf("mount tmpfs at %s: %w", dir, err)
	}
	ts.closers = append(ts.closers, func() error { return unmountLeftover(dir, false) })
	ts.list = append(ts.list, &target{name: tmpfsTarget, dir: dir})
	return nil
}

// tearDown stops the agents, unmounts, and removes the temporary directory unless something is
// still mounted below it (removing through a live mount would delete its files).
func (ts *targetSet) tearDown() error {
	var errs []error
	for i := len(ts.closers) - 1; i >= 0; i-- {
		errs = append(errs, ts.closers[i]())
	}
	ts.closers = nil
	if left := mountsUnder(ts.base); len(left) > 0 {
		errs = append(errs, fmt.Errorf("still mounted, not removing %s: %s", ts.base, strings.Join(left, ", ")))
	} else {
		errs = append(errs, os.RemoveAll(ts.base))
	}
	return errors.Join(errs...)
}

// agent is one mtcfs mount process.
type agent struct {
	dir, spool string
	cmd        *exec.Cmd
	log        lockedBuffer // the agent's stdout and stderr
	exited     chan struct{}
	waitErr    error // set before exited is closed
}

// startAgent runs "mtcfs mount" in the foreground as a child and waits until it serves.
func (ts *targetSet) startAgent(ctx context.Context, bin, name, passthrough string) error {
	a := &agent{
		dir:    filepath.Join(ts.base, name),
		spool:  filepath.Join(ts.base, "spool-"+name),
		exited: make(chan struct{}),
	}
	if err := os.Mkdir(a.dir, 0o755); err != nil {
		return err
	}
	a.cmd = exec.Command(bin, "mount", a.dir, "--memory", agentMemory, "--passthrough", passthrough, "--spool", a.spool)
	a.cmd.Stdout, a.cmd.Stderr = &a.log, &a.log
	// Own process group: Ctrl-C in the terminal reaches fsbench only, which then sends each agent
	// exactly one SIGINT (mtcfs treats a second one as "exit without unmounting").
	a.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := a.cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", bin, err)
	}
	go func() {
		a.waitErr = a.cmd.Wait()
		close(a.exited)
	}()
	ts.closers = append(ts.closers, a.stop)
	ts.agents = append(ts.agents, a.cmd.Process.Pid)
	if err := a.waitServing(ctx, 30*time.Second); err != nil {
		return fmt.Errorf("mtcfs --passthrough %s: %w", passthrough, err)
	}
	ts.list = append(ts.list, &target{name: name, dir: a.dir})
	return nil
}

// waitServing returns once the agent logged "serving" and /proc/mounts shows its FUSE mount.
func (a *agent) waitServing(ctx context.Context, timeout time.Duration) error {
	deadline := time.After(timeout)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-a.exited:
			return fmt.Errorf("agent exited before serving (%v); its log:\n%s", a.waitErr, a.log.String())
		case <-deadline:
			return fmt.Errorf("not mounted at %s after %v; its log:\n%s", a.dir, timeout, a.log.String())
		case <-tick.C:
			if strings.Contains(a.log.String(), "serving") && mountType(a.dir) == "fuse.mtcfs" {
				return nil
			}
		}
	}
}

// stop sends SIGINT and waits for the agent to unmount and exit; whatever stays mounted after
// that is an error and is detached lazily.
func (a *agent) stop() error {
	var errs []error
	select {
	case <-a.exited:
	default:
		a.cmd.Process.Signal(os.Interrupt)
		select {
		case <-a.exited:
		case <-time.After(40 * time.Second): // mtcfs gives a busy unmount 30s
			a.cmd.Process.Kill()
			<-a.exited
			errs = append(errs, fmt.Errorf("mtcfs at %s did not exit within 40s of SIGINT; killed it", a.dir))
		}
	}
	if a.waitErr != nil {
		errs = append(errs, fmt.Errorf("mtcfs at %s exited with %v; its log:\n%s", a.dir, a.waitErr, a.log.String()))
	}
	errs = append(errs, unmountLeftover(a.dir, true), unmountLeftover(a.spool, true))
	return errors.Join(errs...)
}

// unmountLeftover unmounts dir if something is mounted there. With leftover, any mount is
// unexpected (its owner should have removed it) and reported as an error.
func unmountLeftover(dir string, leftover bool) error {
	fstype := mountType(dir)
	if fstype == "" {
		return nil
	}
	var err error
	if leftover {
		err = fmt.Errorf("%s (%s) was still mounted after its agent exited", dir, fstype)
	}
	if unix.Unmount(dir, 0) == nil {
		return err
	}
	if e := unix.Unmount(dir, unix.MNT_DETACH); e != nil {
		return errors.Join(err, fmt.Errorf("umount -l %s: %w", dir, e))
	}
	return errors.Join(err, fmt.Errorf("%s was busy; detached it lazily", dir))
}

// mountType returns the filesystem type mounted exactly at dir, or "".
func mountType(dir string) string {
	for _, m := range readMounts() {
		if m.dir == dir {
			return m.fstype
		}
	}
	return ""
}

// mountsUnder lists the mount points at or below dir.
func mountsUnder(dir string) []string {
	var out []string
	for _, m := range readMounts() {
		if m.dir == dir || strings.HasPrefix(m.dir, dir+"/") {
			out = append(out, m.dir)
		}
	}
	return out
}

type mountEntry struct{ dir, fstype string }

// readMounts parses /proc/mounts; later entries (mounts on top) come last.
func readMounts() []mountEntry {
	data, err := os.ReadFile("/proc/mounts")
	if err != nil {
		return nil
	}
	unescape := strings.NewReplacer(`\040`, " ", `\011`, "\t", `\012`, "\n", `\134`, `\`)
	var out []mountEntry
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) >= 3 {
			out = append(out, mountEntry{dir: unescape.Replace(f[1]), fstype: f[2]})
		}
	}
	return out
}

// lockedBuffer collects a child's output; exec writes to it from its own goroutines.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer // GUARDED_BY(mu)
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
