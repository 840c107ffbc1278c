package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/mtcfs/mtcfs/bench/internal/benchkit"
)

// What the agents measure themselves, from their /metrics (README: Metrics).
const (
	replSeconds    = "mtcfs_replication_duration_seconds" // one step pushed to one peer, acknowledged
	restoreSeconds = "mtcfs_restore_duration_seconds"     // one worker's data brought in, by source
)

// node is one simulated machine of a phase: its mount point and spool.
type node struct {
	rank       int
	dir, spool string
}

// phase runs f in a workspace of its own: a directory under the run's (dir) for its nodes and
// their shared backup location, and the agents f starts there. The agents are stopped and the
// directory removed when f returns, also when it fails.
func (b *bench) phase(name string, f func(ws *benchkit.Workspace, dir string) error) (err error) {
	ws := &benchkit.Workspace{}
	defer func() { err = errors.Join(err, ws.Close()) }()
	dir, err := ws.TempDir(b.base, name+"-")
	if err != nil {
		return err
	}
	return f(ws, dir)
}

// nodes returns the nodes of ranks 0 to n-1 below dir.
func nodes(dir string, n int) []node {
	var ns []node
	for r := range n {
		d := filepath.Join(dir, fmt.Sprintf("node%d", r))
		ns = append(ns, node{rank: r, dir: filepath.Join(d, "mnt"), spool: filepath.Join(d, "spool")})
	}
	return ns
}

// startAgent runs an agent for n in the phase's workspace, with --memory memory and the phase's
// shared backup location.
func (b *bench) startAgent(ctx context.Context, ws *benchkit.Workspace, dir string, n node, memory string) (*benchkit.Agent, error) {
	backup := filepath.Join(dir, "backup")
	if err := os.MkdirAll(backup, 0o755); err != nil {
		return nil, err
	}
	a, err := ws.StartAgent(ctx, benchkit.AgentConfig{
		Bin:        b.bin,
		Dir:        n.dir,
		Spool:      n.spool,
		Flags:      []string{"--memory", memory, "--backup", "file://" + backup, "--listen", "127.0.0.1:0"},
		KeepsSpool: true, // it holds checkpoints when stopped; Stop detaches it
	})
	if err != nil {
		return nil, fmt.Errorf("agent of rank %d: %w", n.rank, err)
	}
	return a, nil
}
