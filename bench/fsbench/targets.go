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
	anchorTarget      = "anchor"         // go-fuse's loopback example, see anchor.go
	floorDataTarget   = "floor-loopback" // the go-fuse floor's sequential rows: bench/fuseanchor DIR
	floorMemTarget    = "floor-memory"   // its other rows: bench/fuseanchor -mem (see anchor.go)
	beforeTarget      = "before"         // -before's agent, --passthrough on
)

// A target is a directory the workloads run in.
type target struct {
	name string
	dir  string
	// agent, for an mtcfs target: its FUSE request counts are read from /metrics.
	agent *benchkit.Agent
	// server is the pid of the FUSE server behind dir (0 for tmpfs): the pinned create pass
	// moves its threads.
	server int
	skip   map[string]bool // workloads not run on this target
}

// requests returns the FUSE requests the target's agent has served, by operation (nil, nil for
// a target that is not an mtcfs agent).
func (t *target) requests() (map[string]float64, error) {
	if t.agent == nil {
		return nil, nil
	}
	m, err := t.agent.Metrics()
	if err != nil {
		return nil, err
	}
	fam := m["mtcfs_fuse_requests_total"]
	if fam == nil {
		return nil, fmt.Errorf("the agent at %s exports no mtcfs_fuse_requests_total", t.dir)
	}
	out := map[string]float64{}
	for _, mt := range fam.GetMetric() {
		for _, l := range mt.GetLabel() {
			if l.GetName() == "op" {
				out[l.GetValue()] = mt.GetCounter().GetValue()
			}
		}
	}
	return out, nil
}

// targetSet owns the mounts and agent processes behind the targets; ws.Close stops the agents,
// unmounts the tmpfs and removes the temporary directory.
type targetSet struct {
	ws      benchkit.Workspace
	base    string // temporary directory holding the mount points and spools
	list    []*target
	agents  []int // pids of the running agents
	servers []int // pids of the other FUSE servers (the anchors)
}

// setUpTargets mounts the baseline tmpfs and starts the two mtcfs agents, the agent of the
// before binary (unless before is ""), the FUSE anchor and the two servers of the go-fuse floor
// (unless noAnchor) under a new temporary directory in workDir. On error, what was already set
// up is torn down.
func setUpTargets(ctx context.Context, bin, before, workDir string, noAnchor bool) (*targetSet, error) {
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
	if before != "" {
		if err := ts.startAgent(ctx, before, beforeTarget, "on"); err != nil {
			return nil, errors.Join(fmt.Errorf("-before: %w", err), ts.ws.Close())
		}
	}
	if !noAnchor {
		if err := ts.startAnchor(ctx); err != nil {
			return nil, errors.Join(fmt.Errorf("FUSE anchor: %w", err), ts.ws.Close())
		}
		if err := ts.startFloor(ctx); err != nil {
			return nil, errors.Join(fmt.Errorf("go-fuse floor: %w", err), ts.ws.Close())
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
	ts.list = append(ts.list, &target{name: name, dir: a.Dir, agent: a, server: a.Pid()})
	return nil
}
