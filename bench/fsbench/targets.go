package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/bench/internal/benchkit"
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

// targetSet owns the mounts and agent processes behind the targets; ws.Close stops the agents,
// unmounts the tmpfs and removes the temporary directory.
type targetSet struct {
	ws     benchkit.Workspace
	base   string // temporary directory holding the mount points and spools
	list   []*target
	agents []int // pids of the running agents
}

// setUpTargets mounts the baseline tmpfs and starts the two mtcfs agents under a new temporary
// directory in workDir. On error, what was already set up is torn down.
func setUpTargets(ctx context.Context, bin, workDir string) (*targetSet, error) {
	ts := &targetSet{}
	var err error
	if ts.base, err = ts.ws.TempDir(workDir, "fsbench-"); err != nil {
		return nil, err
	}
	if err := ts.mountTmpfs(); err != nil {
		return nil, errors.Join(err, ts.ws.Close())
	}
	for _, a := range []struct{ name, mode string }{{passthroughTarget, "on"}, {fallbackTarget, "off"}} {
		if err := ts.startAgent(ctx, bin, a.name, a.mode); err != nil {
			return nil, errors.Join(err, ts.ws.Close())
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
	ts.ws.Defer(func() error { return benchkit.Unmount(dir) })
	ts.list = append(ts.list, &target{name: tmpfsTarget, dir: dir})
	return nil
}

// startAgent runs "mtcfs mount" with the given --passthrough mode and waits until it serves.
func (ts *targetSet) startAgent(ctx context.Context, bin, name, passthrough string) error {
	a, err := ts.ws.StartAgent(ctx, benchkit.AgentConfig{
		Bin:   bin,
		Dir:   filepath.Join(ts.base, name),
		Spool: filepath.Join(ts.base, "spool-"+name),
		Flags: []string{"--memory", agentMemory, "--passthrough", passthrough},
	})
	if err != nil {
		return fmt.Errorf("mtcfs --passthrough %s: %w", passthrough, err)
	}
	ts.agents = append(ts.agents, a.Pid())
	ts.list = append(ts.list, &target{name: name, dir: a.Dir})
	return nil
}
