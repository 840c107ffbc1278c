package crashsim

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/internal/agents"
	"github.com/mtcfs/mtcfs/internal/fusectl"
	"github.com/mtcfs/mtcfs/tiers"
)

// agent is one "mtcfs mount" process, started in its own process group so that a terminal's
// Ctrl-C reaches the driver only.
type agent struct {
	rank       int
	dir, spool string
	cmd        *exec.Cmd
	pid        int
	http       string
	started    time.Time

	mu    sync.Mutex
	lines []logLine // GUARDED_BY(mu)

	done    chan struct{}
	waitErr error // set before done is closed
	killed  time.Time
}

type logLine struct {
	at   time.Time
	text string
}

var httpAddrRE = regexp.MustCompile(`msg="http endpoints" addr=(\S+)`)

// lineWriter splits the agent's output into timestamped lines.
type lineWriter struct {
	a   *agent
	buf []byte
}

func (w *lineWriter) Write(p []byte) (int, error) {
	w.buf = append(w.buf, p...)
	now := time.Now()
	for {
		i := bytes.IndexByte(w.buf, '\n')
		if i < 0 {
			break
		}
		w.a.mu.Lock()
		w.a.lines = append(w.a.lines, logLine{at: now, text: string(w.buf[:i])})
		w.a.mu.Unlock()
		w.buf = w.buf[i+1:]
	}
	return len(p), nil
}

// startAgent runs the agent and waits until it serves: it logged "serving" (adoption of the
// spool is done by then), its http address is known, and its FUSE mount is in /proc/mounts.
func startAgent(ctx context.Context, bin string, rank int, dir, spool string, args []string) (*agent, error) {
	a := &agent{rank: rank, dir: dir, spool: spool, done: make(chan struct{}), started: time.Now()}
	argv := append([]string{"mount", dir, "--spool", spool}, args...)
	a.cmd = exec.Command(bin, argv...)
	lw := &lineWriter{a: a}
	a.cmd.Stdout, a.cmd.Stderr = lw, lw
	a.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := a.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	a.pid = a.cmd.Process.Pid
	go func() {
		a.waitErr = a.cmd.Wait()
		close(a.done)
	}()
	deadline := time.Now().Add(30 * time.Second)
	for {
		log := a.log()
		if m := httpAddrRE.FindStringSubmatch(log); m != nil && strings.Contains(log, "serving") && mountType(dir) == "fuse.mtcfs" {
			a.http = m[1]
			return a, nil
		}
		select {
		case <-a.done:
			return a, fmt.Errorf("rank %d: agent exited before serving (%v); its log:\n%s", rank, a.waitErr, log)
		case <-ctx.Done():
			a.kill()
			return a, ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			a.kill()
			return a, fmt.Errorf("rank %d: agent did not serve within 30s; its log:\n%s", rank, log)
		}
	}
}

func (a *agent) alive() bool {
	select {
	case <-a.done:
		return false
	default:
		return true
	}
}

// kill sends SIGKILL and waits for the process to be gone.
func (a *agent) kill() {
	if a.alive() {
		a.killed = time.Now()
		a.cmd.Process.Signal(syscall.SIGKILL)
	}
	<-a.done
}

// stop sends SIGTERM and waits (a running backup may drain for up to 30 s); an agent that does
// not exit in time is killed and reported.
func (a *agent) stop() error {
	if !a.alive() {
		return nil
	}
	a.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-a.done:
	case <-time.After(60 * time.Second):
		a.kill()
		return fmt.Errorf("rank %d: agent did not exit within 60s of SIGTERM", a.rank)
	}
	var ee *exec.ExitError
	if errors.As(a.waitErr, &ee) {
		return fmt.Errorf("rank %d: clean stop exited with %v", a.rank, a.waitErr)
	}
	return nil
}

func (a *agent) log() string {
	a.mu.Lock()
	defer a.mu.Unlock()
	var b strings.Builder
	for _, l := range a.lines {
		b.WriteString(l.text)
		b.WriteByte('\n')
	}
	return b.String()
}

// mark is a position in the log, for linesSince.
func (a *agent) mark() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.lines)
}

func (a *agent) linesSince(mark int) []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []string
	for _, l := range a.lines[min(mark, len(a.lines)):] {
		out = append(out, l.text)
	}
	return out
}

// loggedAfter reports whether a line containing s carries a time (its time= field, the agent's
// clock, the same machine's) after t.
func (a *agent) loggedAfter(s string, t time.Time) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	for i := len(a.lines) - 1; i >= 0 && a.lines[i].at.After(t); i-- {
		if !strings.Contains(a.lines[i].text, s) {
			continue
		}
		m := logTimeRE.FindStringSubmatch(a.lines[i].text)
		if m == nil {
			continue
		}
		if at, err := time.Parse(time.RFC3339Nano, m[1]); err == nil && at.After(t) {
			return true
		}
	}
	return false
}

var logTimeRE = regexp.MustCompile(`^time=(\S+)`)

// tail returns the last n lines of the log.
func (a *agent) tail(n int) string {
	a.mu.Lock()
	defer a.mu.Unlock()
	var b strings.Builder
	for _, l := range a.lines[max(0, len(a.lines)-n):] {
		b.WriteString("    " + l.text + "\n")
	}
	return b.String()
}

// status returns the agent's /status document.
func (a *agent) status() (tiers.Status, error) {
	var st tiers.Status
	raw, err := agents.FetchStatus(a.http)
	if err != nil {
		return st, err
	}
	return st, json.Unmarshal(raw, &st)
}

// Mounts.

type mountEntry struct{ source, dir, fstype string }

func readMounts() []mountEntry {
	data, err := os.ReadFile("/proc/self/mounts")
	if err != nil {
		return nil
	}
	unescape := strings.NewReplacer(`\040`, " ", `\011`, "\t", `\012`, "\n", `\134`, `\`)
	var out []mountEntry
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) >= 3 {
			out = append(out, mountEntry{source: f[0], dir: unescape.Replace(f[1]), fstype: f[2]})
		}
	}
	return out
}

// mountType is the type of the topmost mount at dir, "" if none.
func mountType(dir string) string {
	t := ""
	for _, m := range readMounts() {
		if m.dir == dir {
			t = m.fstype
		}
	}
	return t
}

// mountsAt counts the mounts stacked at dir.
func mountsAt(dir string) int {
	n := 0
	for _, m := range readMounts() {
		if m.dir == dir {
			n++
		}
	}
	return n
}

// mountsUnder lists the mount points at or below dir.
func mountsUnder(dir string) []string {
	var out []string
	for _, m := range readMounts() {
		if m.dir == dir || strings.HasPrefix(m.dir, dir+"/") {
			out = append(out, m.dir+" ("+m.fstype+")")
		}
	}
	return out
}

// forceUnmount detaches everything mounted at dir.
func forceUnmount(dir string) {
	fusectl.Abort(dir) // nothing may stay blocked on a mount whose agent is gone
	for mountsAt(dir) > 0 {
		if unix.Unmount(dir, unix.MNT_DETACH) != nil {
			return
		}
	}
}
