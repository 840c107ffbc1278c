package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// agent is one "mtcfs mount" child process with its own mount point, spool and backup location.
type agent struct {
	name     string
	dir      string // mount point
	spool    string // --spool; the agent mounts a tmpfs there
	backup   string // local directory behind --backup file://
	httpAddr string // from the "http endpoints addr=..." log line
	cmd      *exec.Cmd
	log      lockedBuffer // the agent's stdout and stderr
	exited   chan struct{}
	waitErr  error // set before exited is closed
	stopped  bool
}

// startAgent runs "mtcfs mount" in the foreground as a child under base and waits until it
// serves. The agent is registered with the bench before waiting, so that teardown stops it
// even if it never comes up.
func (b *bench) startAgent(ctx context.Context, name, backupDir string) (*agent, error) {
	a := &agent{
		name:   name,
		dir:    filepath.Join(b.base, name, "mnt"),
		spool:  filepath.Join(b.base, name, "spool"),
		backup: backupDir,
		exited: make(chan struct{}),
	}
	if err := os.MkdirAll(a.dir, 0o755); err != nil {
		return nil, err
	}
	a.cmd = exec.Command(b.bin, "mount", a.dir, "--memory", b.cfg.memory, "--spool", a.spool,
		"--backup", "file://"+backupDir, "--http", "127.0.0.1:0")
	a.cmd.Stdout, a.cmd.Stderr = &a.log, &a.log
	// Own process group: a terminal's Ctrl-C reaches replbench only, which then sends each agent
	// exactly one SIGINT (mtcfs treats a second one as "exit without unmounting").
	a.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := a.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", b.bin, err)
	}
	go func() {
		a.waitErr = a.cmd.Wait()
		close(a.exited)
	}()
	b.agents = append(b.agents, a)
	if err := a.waitServing(ctx, 30*time.Second); err != nil {
		return nil, fmt.Errorf("agent %s: %w", name, err)
	}
	return a, nil
}

var httpAddrRE = regexp.MustCompile(`msg="http endpoints" addr=(\S+)`)

// waitServing returns once the agent logged "serving", its HTTP address is known and
// /proc/mounts shows its FUSE mount.
func (a *agent) waitServing(ctx context.Context, timeout time.Duration) error {
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
			return fmt.Errorf("not mounted at %s after %v; its log:\n%s", a.dir, timeout, a.log.String())
		case <-tick.C:
			log := a.log.String()
			m := httpAddrRE.FindStringSubmatch(log)
			if m != nil && strings.Contains(log, "serving") && mountType(a.dir) == "fuse.mtcfs" {
				a.httpAddr = m[1]
				return nil
			}
		}
	}
}

// stop sends one SIGINT and waits for the agent to unmount and exit. The agent keeps its spool
// tmpfs mounted when the spool holds checkpoints (for a successor on the same mount); replbench
// starts no successor, so it detaches the spool lazily. A FUSE mount left behind is an error.
func (a *agent) stop() error {
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
			errs = append(errs, fmt.Errorf("mtcfs at %s did not exit within 40s of SIGINT; killed it", a.dir))
		}
	}
	if a.waitErr != nil {
		errs = append(errs, fmt.Errorf("mtcfs at %s exited with %v; its log:\n%s", a.dir, a.waitErr, a.log.String()))
	}
	if fstype := mountType(a.dir); fstype != "" {
		errs = append(errs, fmt.Errorf("%s (%s) was still mounted after its agent exited", a.dir, fstype), detach(a.dir))
	}
	for mountType(a.spool) != "" { // expected when the spool holds checkpoints: not an error
		if err := detach(a.spool); err != nil {
			errs = append(errs, err)
			break
		}
	}
	return errors.Join(errs...)
}

// detach unmounts dir, lazily if it is busy.
func detach(dir string) error {
	if unix.Unmount(dir, 0) == nil {
		return nil
	}
	if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
		return fmt.Errorf("umount -l %s: %w", dir, err)
	}
	return nil
}

// logDuration waits up to wait for a log line matching re (whose last group is a Go duration)
// and returns the duration of the last such line.
func (a *agent) logDuration(re *regexp.Regexp, wait time.Duration) (time.Duration, bool) {
	deadline := time.Now().Add(wait)
	for {
		if ms := re.FindAllStringSubmatch(a.log.String(), -1); len(ms) > 0 {
			m := ms[len(ms)-1]
			d, err := time.ParseDuration(m[len(m)-1])
			return d, err == nil
		}
		if time.Now().After(deadline) {
			return 0, false
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// agentStatus is the part of GET /status that replbench reads.
type agentStatus struct {
	Phase      string `json:"phase"`
	Job        string `json:"job"`
	LastBackup string `json:"last_backup"`
	Steps      []struct {
		Meta string `json:"meta"`
		Step int64  `json:"step"`
	} `json:"steps_in_ram"`
	Backup *struct {
		Step  int64 `json:"step"`
		Done  int64 `json:"done_bytes"`
		Total int64 `json:"total_bytes"`
	} `json:"backup"`
	Errors []string `json:"recent_errors"`
}

var httpClient = &http.Client{Timeout: 5 * time.Second}

func (a *agent) status() (agentStatus, error) {
	var st agentStatus
	resp, err := httpClient.Get("http://" + a.httpAddr + "/status")
	if err != nil {
		return st, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return st, fmt.Errorf("GET /status: %s", resp.Status)
	}
	return st, json.NewDecoder(resp.Body).Decode(&st)
}

// mountType returns the filesystem type mounted exactly at dir (the topmost), or "".
func mountType(dir string) string {
	t := ""
	for _, m := range readMounts() {
		if m.dir == dir {
			t = m.fstype
		}
	}
	return t
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
