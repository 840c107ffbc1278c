package benchkit

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"time"
)

// AgentBinary returns the absolute path of the mtcfs binary at path, after checking that it is
// there.
func AgentBinary(path string) (string, error) {
	bin, err := filepath.Abs(path)
	if err != nil {
		return "", err
	}
	if _, err := os.Stat(bin); err != nil {
		return "", fmt.Errorf("mtcfs binary: %w (build it first: make build in the repository root)", err)
	}
	return bin, nil
}

// AgentConfig says how to run one "mtcfs mount" child.
type AgentConfig struct {
	Bin   string   // the mtcfs binary
	Dir   string   // mount point; created if missing
	Spool string   // --spool; the agent mounts a tmpfs there
	Flags []string // further flags of "mtcfs mount", e.g. --memory
	// KeepsSpool says the agent may leave its spool tmpfs mounted when it exits (it does when the
	// spool holds checkpoints, for a successor on the same mount). Stop then detaches the spool
	// without complaint; otherwise a spool left mounted is an error.
	KeepsSpool bool
}

// Agent is one running "mtcfs mount" process. Its methods are for the goroutine that started
// it; only the log is written concurrently (by exec's copying goroutines). What a bench measures
// of the agent it reads from the agent's /status and /metrics (observe.go), not from its log.
type Agent struct {
	Dir, Spool string // as configured
	// HTTP is the address of the agent's /status and /metrics (--http, by default a free port
	// on 127.0.0.1, which the agent logs).
	HTTP       string
	keepsSpool bool
	cmd        *exec.Cmd
	log        LockedBuffer // the agent's stdout and stderr
	exited     chan struct{}
	waitErr    error // set before exited is closed
	stopped    bool
	successor  bool // StopForSuccessor: the spool stays mounted
}

// StartAgent runs "mtcfs mount" in the foreground as a child and waits until it serves: it
// logged its HTTP address and "serving", and /proc/mounts shows its FUSE mount. If it does not
// come up within 30s (or ctx ends first), StartAgent stops it and returns the error.
//
// The agent runs in its own process group: a terminal's Ctrl-C reaches the bench program only,
// which then sends each agent exactly one SIGINT through Stop (mtcfs treats a second one as "exit
// without unmounting").
func StartAgent(ctx context.Context, cfg AgentConfig) (*Agent, error) {
	a := &Agent{Dir: cfg.Dir, Spool: cfg.Spool, keepsSpool: cfg.KeepsSpool, exited: make(chan struct{})}
	if err := os.MkdirAll(a.Dir, 0o755); err != nil {
		return nil, err
	}
	args := append([]string{"mount", a.Dir, "--spool", a.Spool}, cfg.Flags...)
	a.cmd = exec.Command(cfg.Bin, args...)
	a.cmd.Stdout, a.cmd.Stderr = &a.log, &a.log
	a.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := a.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", cfg.Bin, err)
	}
	go func() {
		a.waitErr = a.cmd.Wait()
		close(a.exited)
	}()
	if err := a.waitServing(ctx, 30*time.Second); err != nil {
		return nil, errors.Join(err, a.Stop())
	}
	return a, nil
}

// httpAddrRE finds the address the agent serves /status and /metrics on in its log.
var httpAddrRE = regexp.MustCompile(`msg="http endpoints" addr=(\S+)`)

func (a *Agent) waitServing(ctx context.Context, timeout time.Duration) error {
	deadline := time.After(timeout)
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-a.exited:
			return fmt.Errorf("exited before serving (%v); its log:\n%s", a.waitErr, a.log.String())
		case <-deadline:
			return fmt.Errorf("not mounted at %s after %v; its log:\n%s", a.Dir, timeout, a.log.String())
		case <-tick.C:
			log := a.log.String()
			m := httpAddrRE.FindStringSubmatch(log)
			if m != nil && strings.Contains(log, "serving") && MountType(a.Dir) == "fuse.mtcfs" {
				a.HTTP = m[1]
				return nil
			}
		}
	}
}

// Log returns what the agent wrote to stdout and stderr so far.
func (a *Agent) Log() string { return a.log.String() }

// Pid is the agent's process id.
func (a *Agent) Pid() int { return a.cmd.Process.Pid }

// Stop sends one SIGINT and waits for the agent to unmount and exit, killing it after 40s.
// A FUSE mount left behind is an error and is unmounted, lazily if busy; so is a spool left
// mounted, unless the agent KeepsSpool. Stop may be called more than once.
func (a *Agent) Stop() error {
	if a.stopped {
		return nil
	}
	a.stopped = true
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
			errs = append(errs, fmt.Errorf("mtcfs at %s did not exit within 40s of SIGINT; killed it", a.Dir))
		}
	}
	if a.waitErr != nil {
		errs = append(errs, fmt.Errorf("mtcfs at %s exited with %v; its log:\n%s", a.Dir, a.waitErr, a.log.String()))
	}
	errs = append(errs, leftover(a.Dir))
	if !a.keepsSpool {
		errs = append(errs, leftover(a.Spool))
	}
	for a.keepsSpool && !a.successor && MountType(a.Spool) != "" { // expected when the spool holds checkpoints: not an error
		if err := Unmount(a.Spool); err != nil {
			errs = append(errs, err)
			break
		}
	}
	return errors.Join(errs...)
}

// StopForSuccessor is Stop for an agent that a successor on the same spool replaces (a restart):
// the spool tmpfs the agent kept stays mounted, with its checkpoints, for the next agent, whose
// own Stop (or the Workspace) detaches it.
func (a *Agent) StopForSuccessor() error {
	a.successor = true
	return a.Stop()
}

// Kill replaces the agent's node, as a machine that is lost does: SIGKILL, then, once the
// process is gone, its dead FUSE mount and its spool tmpfs are detached and the spool directory
// removed (its RAM is lost). Stop does nothing afterwards.
func (a *Agent) Kill() error {
	if a.stopped {
		return nil
	}
	a.stopped = true
	if err := a.cmd.Process.Kill(); err != nil {
		return fmt.Errorf("kill -9 %d: %w", a.Pid(), err)
	}
	select {
	case <-a.exited:
	case <-time.After(10 * time.Second):
		return fmt.Errorf("agent %d still there 10s after SIGKILL", a.Pid())
	}
	var errs []error
	for _, dir := range []string{a.Dir, a.Spool} {
		for i := 0; i < 5 && MountType(dir) != ""; i++ {
			if err := Unmount(dir); err != nil {
				fmt.Fprintf(os.Stderr, "note: %v\n", err) // a dead FUSE mount is busy for a moment
			}
		}
		if t := MountType(dir); t != "" {
			errs = append(errs, fmt.Errorf("%s (%s) still mounted after the kill", dir, t))
		}
	}
	if len(errs) > 0 {
		return errors.Join(errs...)
	}
	return os.RemoveAll(a.Spool)
}

// leftover reports and unmounts what is still mounted at dir after its agent exited.
func leftover(dir string) error {
	fstype := MountType(dir)
	if fstype == "" {
		return nil
	}
	return errors.Join(fmt.Errorf("%s (%s) was still mounted after its agent exited", dir, fstype), Unmount(dir))
}

// LockedBuffer collects a child's output; exec writes to it from its own goroutines.
type LockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer // GUARDED_BY(mu)
}

func (b *LockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *LockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
