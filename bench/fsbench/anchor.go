package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/bench/internal/benchkit"
)

// The FUSE anchor is go-fuse's own loopback example server (github.com/hanwen/go-fuse/v2/
// example/loopback), built from the module cache at the go-fuse version of mtcfs's go.mod and
// serving a directory of its own tmpfs. It shows what a plain go-fuse server costs on this
// machine in the same run: kernel round trips and go-fuse's request loop, without mtcfs's spool,
// passthrough or replicator. It runs with -allow-other, which makes it mount with
// default_permissions as mtcfs does (permission checks in the kernel), and with the example's
// own cache timeouts (1 s for entries and attributes, no negative entries).
const loopbackPkg = "github.com/hanwen/go-fuse/v2/example/loopback"

// buildLoopback builds the loopback example into dir, from the module of mtcfs (whose go.mod
// pins go-fuse and whose go.sum holds its hash), and returns the binary's path.
func buildLoopback(ctx context.Context, dir string) (string, error) {
	root, err := exec.CommandContext(ctx, "go", "list", "-m", "-f", "{{.Dir}}", "github.com/mtcfs/mtcfs").Output()
	if err != nil {
		return "", fmt.Errorf("find the mtcfs module (run fsbench in bench/): %w", err)
	}
	bin := filepath.Join(dir, "loopback")
	cmd := exec.CommandContext(ctx, "go", "build", "-C", strings.TrimSpace(string(root)), "-o", bin, loopbackPkg)
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build %s: %v\n%s", loopbackPkg, err, out)
	}
	return bin, nil
}

// startAnchor mounts a tmpfs for the loopback's backing directory and starts the loopback server
// on a mount point of its own; ws.Close stops it (one SIGINT, on which it unmounts) and
// unmounts the tmpfs.
func (ts *targetSet) startAnchor(ctx context.Context) error {
	bin, err := buildLoopback(ctx, ts.base)
	if err != nil {
		return err
	}
	data := filepath.Join(ts.base, "anchor-data")
	dir := filepath.Join(ts.base, anchorTarget)
	for _, d := range []string{data, dir} {
		if err := os.Mkdir(d, 0o755); err != nil {
			return err
		}
	}
	if err := unix.Mount("fsbench-anchor", data, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "size="+tmpfsSize); err != nil {
		return fmt.Errorf("mount tmpfs at %s: %w", data, err)
	}
	ts.ws.Defer(func() error { return benchkit.Unmount(data) })

	cmd := exec.Command(bin, "-allow-other", "-directmount", "-q", dir, data)
	var log benchkit.LockedBuffer
	cmd.Stdout, cmd.Stderr = &log, &log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // a terminal's Ctrl-C reaches fsbench only
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", bin, err)
	}
	exited := make(chan struct{})
	var waitErr error // set before exited is closed
	go func() {
		waitErr = cmd.Wait()
		close(exited)
	}()
	stop := func() error {
		select {
		case <-exited:
			return errors.Join(fmt.Errorf("loopback exited early (%v): %s", waitErr, log.String()), benchkit.Unmount(dir))
		default:
		}
		cmd.Process.Signal(os.Interrupt)
		select {
		case <-exited:
		case <-time.After(30 * time.Second):
			cmd.Process.Kill()
			<-exited
		}
		if benchkit.MountType(dir) != "" {
			return errors.Join(errors.New("the loopback server left its mount behind"), benchkit.Unmount(dir))
		}
		return nil
	}
	ts.ws.Defer(stop)
	for deadline := time.Now().Add(30 * time.Second); benchkit.MountType(dir) != "fuse.loopback"; {
		select {
		case <-exited:
			return fmt.Errorf("loopback exited before mounting (%v): %s", waitErr, log.String())
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("loopback not mounted at %s after 30s: %s", dir, log.String())
		}
	}
	ts.servers = append(ts.servers, cmd.Process.Pid)
	ts.list = append(ts.list, &target{name: anchorTarget, dir: dir, skip: map[string]bool{"sequential": true}})
	return nil
}
