package main

import (
	"context"
	"fmt"
	"path/filepath"

	"github.com/mtcfs/mtcfs/bench/internal/benchkit"
)

// agent is one "mtcfs mount" child with its own mount point, spool and backup location.
type agent struct {
	*benchkit.Agent
	name string
}

// startAgent runs "mtcfs mount" in the foreground as a child under base and waits until it
// serves. The run's workspace stops it at the end, if nothing did before.
func (b *bench) startAgent(ctx context.Context, name, backupDir string) (*agent, error) {
	a, err := b.ws.StartAgent(ctx, benchkit.AgentConfig{
		Bin:        b.bin,
		Dir:        filepath.Join(b.base, name, "mnt"),
		Spool:      filepath.Join(b.base, name, "spool"),
		Flags:      []string{"--memory", b.cfg.memory, "--backup", "file://" + backupDir, "--http", "127.0.0.1:0"},
		KeepsSpool: true, // replbench starts no successor on the same spool
	})
	if err != nil {
		return nil, fmt.Errorf("agent %s: %w", name, err)
	}
	return &agent{Agent: a, name: name}, nil
}
