package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"syscall"
	"time"

	"github.com/mtcfs/mtcfs/bench/internal/benchkit"
)

// agent is one "mtcfs mount" child of the three-node job.
type agent struct {
	*benchkit.Agent
	rank   int
	killed bool // SIGKILLed by kill; its mounts were taken care of there
}

// node is one simulated machine of a repetition: mount point, spool, the shared backup.
type node struct {
	rank       int
	dir, spool string
}

func (b *bench) nodes(rep int) []node {
	var ns []node
	for r := range 3 {
		d := filepath.Join(b.repDir(rep), fmt.Sprintf("node%d", r))
		ns = append(ns, node{rank: r, dir: filepath.Join(d, "mnt"), spool: filepath.Join(d, "spool")})
	}
	return ns
}

// startAgent runs an agent for n with the repetition's shared backup location and registers it
// for teardown.
func (b *bench) startAgent(ctx context.Context, rep int, n node) (*agent, error) {
	return b.startAgentMem(ctx, rep, n, b.cfg.memory)
}

// startAgentMem is startAgent with another --memory.
func (b *bench) startAgentMem(ctx context.Context, rep int, n node, memory string) (*agent, error) {
	backup := filepath.Join(b.repDir(rep), "backup")
	if err := os.MkdirAll(backup, 0o755); err != nil {
		return nil, err
	}
	a, err := benchkit.StartAgent(ctx, benchkit.AgentConfig{
		Bin:        b.bin,
		Dir:        n.dir,
		Spool:      n.spool,
		Flags:      []string{"--memory", memory, "--backup", "file://" + backup, "--listen", "127.0.0.1:0"},
		KeepsSpool: true, // it holds checkpoints when stopped; teardown detaches it
	})
	if err != nil {
		return nil, fmt.Errorf("agent of rank %d: %w", n.rank, err)
	}
	ag := &agent{Agent: a, rank: n.rank}
	b.agents = append(b.agents, ag)
	return ag, nil
}

// stop stops a live agent (one SIGINT, see benchkit.Agent.Stop); a killed one is gone already.
func (a *agent) stop() error {
	if a.killed {
		return nil
	}
	return a.Stop()
}

// kill is a node replacement: SIGKILL the agent, wait for it to be gone, unmount its dead FUSE
// mount and its spool tmpfs, and remove the spool directory (its RAM is lost).
func (a *agent) kill() error {
	pid := a.Pid()
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		return fmt.Errorf("kill -9 %d: %w", pid, err)
	}
	a.killed = true
	deadline := time.Now().Add(10 * time.Second)
	// benchkit reaps the child; once reaped, the pid is gone.
	for syscall.Kill(pid, 0) == nil {
		if time.Now().After(deadline) {
			return fmt.Errorf("agent %d still there 10s after SIGKILL", pid)
		}
		time.Sleep(5 * time.Millisecond)
	}
	var errs []error
	for _, dir := range []string{a.Dir, a.Spool} {
		for i := 0; i < 5 && benchkit.MountType(dir) != ""; i++ {
			if err := benchkit.Unmount(dir); err != nil {
				fmt.Fprintf(os.Stderr, "clusterbench:   note: %v\n", err)
			}
		}
		if t := benchkit.MountType(dir); t != "" {
			errs = append(errs, fmt.Errorf("%s (%s) still mounted after the kill", dir, t))
		}
	}
	if len(errs) > 0 {
		return errors.Join(errs...)
	}
	return os.RemoveAll(a.Spool)
}

var (
	replicatedRE = regexp.MustCompile(`msg=replicated step=(\d+) .*?to=(\d+) took=(\S+)`)
	peerRestRE   = regexp.MustCompile(`msg="restored from a peer" .*?took=(\S+)`)
)

// replicatedTook waits up to wait for the agent's own "replicated step=N ... took=" line for
// step (the sender logs it after the peer's acknowledgement, which may come after the replica's
// .meta is visible) and returns its figure in ms.
func (a *agent) replicatedTook(step int64, wait time.Duration) (float64, bool) {
	deadline := time.Now().Add(wait)
	for {
		for _, m := range replicatedRE.FindAllStringSubmatch(a.Log(), -1) {
			if m[1] == fmt.Sprint(step) {
				d, err := time.ParseDuration(m[3])
				return float64(d) / 1e6, err == nil
			}
		}
		if time.Now().After(deadline) {
			return 0, false
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// peerRestoreTook waits up to wait for "restored from a peer ... took=" and returns it in ms.
func (a *agent) peerRestoreTook(wait time.Duration) (float64, bool) {
	deadline := time.Now().Add(wait)
	for {
		if m := peerRestRE.FindStringSubmatch(a.Log()); m != nil {
			d, err := time.ParseDuration(m[1])
			return float64(d) / 1e6, err == nil
		}
		if time.Now().After(deadline) {
			return 0, false
		}
		time.Sleep(5 * time.Millisecond)
	}
}
