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
// example/loopback), built from the module cache at the go-fuse version of bench/go.mod, which
// is upstream's (mtcfs itself builds with the patched copy in third_party/go-fuse), and serving a
// directory of its own tmpfs. It shows what a plain go-fuse server costs on this
// machine in the same run: kernel round trips and go-fuse's request loop, without mtcfs's spool,
// passthrough or replicator. It runs with -allow-other, which makes it mount with
// default_permissions as mtcfs does (permission checks in the kernel), and with the example's
// own cache timeouts (1 s for entries and attributes, no negative entries).
const loopbackPkg = "github.com/hanwen/go-fuse/v2/example/loopback"

// goBuild builds package pkg of module (found with go list, so fsbench must run in bench/, whose
// go.mod pins both modules) into dir/name and returns the binary's path.
func goBuild(ctx context.Context, module, pkg, dir, name string) (string, error) {
	root, err := exec.CommandContext(ctx, "go", "list", "-m", "-f", "{{.Dir}}", module).Output()
	if err != nil {
		return "", fmt.Errorf("find module %s (run fsbench in bench/): %w", module, err)
	}
	bin := filepath.Join(dir, name)
	cmd := exec.CommandContext(ctx, "go", "build", "-C", strings.TrimSpace(string(root)), "-o", bin, pkg)
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build %s: %v\n%s", pkg, err, out)
	}
	return bin, nil
}

// The go-fuse floor is bench/fuseanchor, mounted with mtcfs's settings (1 MiB requests, the page
// cache kept across opens, extended attributes off, 5 s timeouts), in two processes: go-fuse's
// loopback node and file types with passthrough turned off, over a tmpfs of its own, for the
// sequential workloads; and a tree of go-fuse inodes that stores no file bytes, which answers
// every request with no system call behind it, for the create, stat and small-file workloads.
// Each row shows what a go-fuse server without passthrough costs on this machine with (nearly)
// nothing of its own to do.
const fuseAnchorPkg = "github.com/mtcfs/mtcfs/bench/fuseanchor"

// startAnchor starts go-fuse's loopback example (the FUSE anchor of the metadata and
// small-file workloads), built from upstream go-fuse at the version of bench/go.mod.
func (ts *targetSet) startAnchor(ctx context.Context) error {
	bin, err := goBuild(ctx, "github.com/mtcfs/mtcfs/bench", loopbackPkg, ts.base, "loopback")
	if err != nil {
		return err
	}
	return ts.startServer(ctx, anchorTarget, "fuse.loopback", true, map[string]bool{"sequential": true},
		func(dir, data string) *exec.Cmd {
			return exec.Command(bin, "-allow-other", "-directmount", "-q", dir, data)
		})
}

// startFloor starts the two processes of the go-fuse floor (bench/fuseanchor).
func (ts *targetSet) startFloor(ctx context.Context) error {
	bin, err := goBuild(ctx, "github.com/mtcfs/mtcfs/bench", fuseAnchorPkg, ts.base, "fuseanchor")
	if err != nil {
		return err
	}
	err = ts.startServer(ctx, floorDataTarget, "fuse.fuseanchor", true, map[string]bool{"create": true, "stat": true, "small": true},
		func(dir, data string) *exec.Cmd { return exec.Command(bin, dir, data) })
	if err != nil {
		return err
	}
	return ts.startServer(ctx, floorMemTarget, "fuse.fuseanchor", false, map[string]bool{"sequential": true},
		func(dir, _ string) *exec.Cmd { return exec.Command(bin, "-mem", dir) })
}

// startServer starts a FUSE server (the command cmd returns for the mount point and the backing
// directory) on a mount point of its own, named name, with a tmpfs of its own as the backing
// directory if backed; it waits until a mount of type fsType is there. ws.Close stops the
// server (one SIGINT, on which it unmounts) and unmounts the tmpfs. The target skips the
// workloads in skip.
func (ts *targetSet) startServer(ctx context.Context, name, fsType string, backed bool, skip map[string]bool, command func(dir, data string) *exec.Cmd) error {
	data := filepath.Join(ts.base, name+"-data")
	dir := filepath.Join(ts.base, name)
	if err := os.Mkdir(dir, 0o755); err != nil {
		return err
	}
	if backed {
		if err := os.Mkdir(data, 0o755); err != nil {
			return err
		}
		if err := unix.Mount("fsbench-"+name, data, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "size="+tmpfsSize); err != nil {
			return fmt.Errorf("mount tmpfs at %s: %w", data, err)
		}
		ts.ws.Defer(func() error { return benchkit.Unmount(data) })
	}

	cmd := command(dir, data)
	bin := filepath.Base(cmd.Path)
	var log benchkit.LockedBuffer
	cmd.Stdout, cmd.Stderr = &log, &log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // a terminal's Ctrl-C reaches fsbench only
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", cmd.Path, err)
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
			return errors.Join(fmt.Errorf("%s exited early (%v): %s", bin, waitErr, log.String()), benchkit.Unmount(dir))
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
			return errors.Join(fmt.Errorf("%s left its mount behind", bin), benchkit.Unmount(dir))
		}
		return nil
	}
	ts.ws.Defer(stop)
	for deadline := time.Now().Add(30 * time.Second); benchkit.MountType(dir) != fsType; {
		select {
		case <-exited:
			return fmt.Errorf("%s exited before mounting (%v): %s", bin, waitErr, log.String())
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not mounted at %s after 30s: %s", bin, dir, log.String())
		}
	}
	ts.servers = append(ts.servers, cmd.Process.Pid)
	ts.list = append(ts.list, &target{name: name, dir: dir, skip: skip, server: cmd.Process.Pid})
	return nil
}
