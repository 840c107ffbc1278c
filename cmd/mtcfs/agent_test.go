package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/internal/fusectl"
	"github.com/mtcfs/mtcfs/tiers"
)

var binPath string

func TestMain(m *testing.M) {
	if spec := os.Getenv(writerEnv); spec != "" {
		runWriter(spec)
	}
	dir, err := os.MkdirTemp("", "mtcfs-bin")
	if err != nil {
		panic(err)
	}
	binPath = filepath.Join(dir, "mtcfs")
	// Agents started without --backup use the default location under $XDG_DATA_HOME: the
	// test binary's own directory, removed below, not the home directory of whoever runs it.
	if err := os.Setenv("XDG_DATA_HOME", filepath.Join(dir, "data")); err != nil {
		panic(err)
	}
	if out, err := exec.Command("go", "build", "-o", binPath, ".").CombinedOutput(); err != nil {
		panic("build mtcfs: " + err.Error() + "\n" + string(out))
	}
	code := m.Run()
	os.RemoveAll(dir)
	if fakeGCSDir != "" {
		os.RemoveAll(fakeGCSDir)
	}
	os.Exit(code)
}

// agent is an mtcfs process started by a test.
type agent struct {
	t     *testing.T
	cmd   *exec.Cmd
	dir   string
	spool string
	mu    sync.Mutex
	logs  []string
	done  chan struct{}
	err   error
}

// servingLine is in the agent's log line that says it serves (text and JSON formats alike); a
// bare "serving" also matches a warning that names another agent's mount.
const servingLine = "serving; stop with"

// startLogged starts cmd with its stderr going to a pipe of the caller's own and passes each
// line it writes to line, in order, from one goroutine. The channel receives Wait's result once
// every line was passed (or 5 s after the exit, if a process cmd started still holds the pipe).
// Not StderrPipe: Wait closes that pipe as soon as the process has exited, and the lines still
// in it were lost (CI once saw a clean stop whose last log lines were missing).
func startLogged(cmd *exec.Cmd, line func(string)) (<-chan error, error) {
	stderr, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	cmd.Stderr = w
	err = cmd.Start()
	w.Close()
	if err != nil {
		stderr.Close()
		return nil, err
	}
	scanned := make(chan struct{})
	go func() {
		defer close(scanned)
		sc := bufio.NewScanner(stderr)
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			line(sc.Text())
		}
		io.Copy(io.Discard, stderr) // after a line too long to scan: cmd must not block on its stderr
	}()
	exited := make(chan error, 1)
	go func() {
		err := cmd.Wait()
		select {
		case <-scanned: // every writer of the pipe is gone
		case <-time.After(5 * time.Second):
		}
		stderr.Close()
		<-scanned
		exited <- err
	}()
	return exited, nil
}

// startAgent runs "mtcfs mount dir args..." and waits until it serves. The test's cleanup kills
// it and detaches whatever it left mounted, also when the test failed half-way.
func startAgent(t *testing.T, dir, spool string, args ...string) *agent {
	t.Helper()
	return startAgentIn(t, nil, dir, spool, args...)
}

// startAgentIn is startAgent with the command run through prefix (e.g. "ip netns exec NS"),
// which must exec it in its own process.
func startAgentIn(t *testing.T, prefix []string, dir, spool string, args ...string) *agent {
	t.Helper()
	a := &agent{t: t, dir: dir, spool: spool, done: make(chan struct{})}
	mount := []string{"mount", dir, "--spool", spool, "--memory", "64MiB"}
	if spool == "" { // the default spool, under /dev/shm/mtcfs
		mount = []string{"mount", dir, "--memory", "64MiB"}
	}
	argv := append(append(append([]string(nil), prefix...), binPath), append(mount, args...)...)
	a.cmd = exec.Command(argv[0], argv[1:]...)
	serving := make(chan struct{})
	var once sync.Once
	exited, err := startLogged(a.cmd, func(line string) {
		a.mu.Lock()
		a.logs = append(a.logs, line)
		a.mu.Unlock()
		if strings.Contains(line, servingLine) {
			once.Do(func() { close(serving) })
		}
	})
	require.NoError(t, err)
	go func() { a.err = <-exited; close(a.done) }()
	t.Cleanup(func() {
		if t.Failed() {
			// What the agent said last, and whether it was still running: a failed test's
			// only view of an agent that died or misbehaved.
			select {
			case <-a.done:
				t.Logf("agent on %s had exited (%v); its last log lines:\n%s", dir, a.err, a.tail(80))
			default:
				t.Logf("agent on %s (still running); its last log lines:\n%s", dir, a.tail(80))
			}
		}
		a.cmd.Process.Kill()
		select {
		case <-a.done:
		case <-time.After(killedExitTimeout):
			t.Errorf("agent on %s did not exit within %v of SIGKILL; its threads:\n%s", dir, killedExitTimeout, threadStacks(a.cmd.Process.Pid))
			forceUnmount(dir) // aborting its connection frees a thread that waits on the mount
			<-a.done
		}
		forceUnmount(dir)
		forceUnmount(spool)
		if spool != "" && filepath.Dir(spool) == tiers.DefaultSpoolRoot() {
			os.Remove(spool) // a default-root spool given by --spool: its directory, empty now
		}
	})
	select {
	case <-serving:
	case <-a.done:
		t.Fatalf("agent exited before serving: %v\n%s", a.err, a.log())
	case <-time.After(15 * time.Second):
		t.Fatalf("agent did not start serving within 15s\n%s", a.log())
	}
	return a
}

// tail returns the last n lines of the agent's log.
func (a *agent) tail(n int) string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return strings.Join(a.logs[max(0, len(a.logs)-n):], "\n")
}

func (a *agent) log() string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return strings.Join(a.logs, "\n")
}

// wait waits for the agent to exit and returns its exit code.
func (a *agent) wait(d time.Duration) int {
	select {
	case <-a.done:
	case <-time.After(d):
		a.t.Fatalf("agent did not exit within %v\n%s", d, a.log())
	}
	var ee *exec.ExitError
	if errors.As(a.err, &ee) {
		return ee.ExitCode()
	}
	return 0
}

// killedExitTimeout bounds how long a test waits for an agent it sent SIGKILL to exit.
const killedExitTimeout = 10 * time.Second

// killAndWait sends SIGKILL to an agent started with cmd (not yet waited for) on mount dir, and
// fails the test if it does not exit: a process that waits on its own mount when the kill lands
// never exits, and holds the mount hung. It then aborts the connection so the process ends.
func killAndWait(t *testing.T, cmd *exec.Cmd, dir string) {
	t.Helper()
	require.NoError(t, cmd.Process.Kill())
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(killedExitTimeout):
		stacks := threadStacks(cmd.Process.Pid)
		forceUnmount(dir)
		<-done
		t.Fatalf("the agent did not exit within %v of SIGKILL; its threads:\n%s", killedExitTimeout, stacks)
	}
}

// threadStacks returns the state and kernel stack of every thread of process pid.
func threadStacks(pid int) string {
	var b strings.Builder
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*", pid))
	for _, task := range tasks {
		st, _ := os.ReadFile(filepath.Join(task, "stat"))
		stack, _ := os.ReadFile(filepath.Join(task, "stack"))
		fmt.Fprintf(&b, "%s %s\n%s", task, st, stack)
	}
	return b.String()
}

func forceUnmount(p string) {
	fusectl.Abort(p) // nothing may stay blocked on a mount whose agent is gone
	for isMounted(p) {
		if unix.Unmount(p, unix.MNT_DETACH) != nil {
			return
		}
	}
}

func isMounted(p string) bool {
	data, _ := os.ReadFile("/proc/self/mounts")
	for _, line := range strings.Split(string(data), "\n") {
		if f := strings.Fields(line); len(f) > 1 && f[1] == p {
			return true
		}
	}
	return false
}

func needRoot(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount")
	}
}

// TestKillAndRestart kills an agent with SIGKILL, sees the dead mount answer ENOTCONN, and
// checks that a new agent detaches it, serves again and removes its predecessor's files;
// SIGTERM then unmounts cleanly.
func TestKillAndRestart(t *testing.T) {
	needRoot(t)
	base := t.TempDir()
	dir, spool := filepath.Join(base, "mnt"), filepath.Join(base, "spool")
	require.NoError(t, os.Mkdir(dir, 0o755))

	a := startAgent(t, dir, spool)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "f"), []byte("x"), 0o644))
	require.NoError(t, a.cmd.Process.Signal(syscall.SIGKILL))
	a.wait(10 * time.Second)

	// The agent's notification helper (fs/notifier.go) keeps the connection up until it sees
	// the agent gone, a moment later; a request made meanwhile fails with ECONNABORTED when the
	// helper exits. Then every access fails at once with ENOTCONN (within a second here; 10 s
	// leave room for a loaded machine).
	var err error
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		_, err = os.Stat(filepath.Join(dir, "f"))
		if !errors.Is(err, syscall.ECONNABORTED) || time.Now().After(deadline) {
			break
		}
	}
	require.True(t, errors.Is(err, syscall.ENOTCONN), "a killed agent's mount should answer ENOTCONN, got %v", err)

	b := startAgent(t, dir, spool)
	require.Contains(t, b.log(), "detached a stale mount")
	require.NoError(t, os.WriteFile(filepath.Join(dir, "g"), []byte("y"), 0o644))
	got, err := os.ReadFile(filepath.Join(dir, "g"))
	require.NoError(t, err)
	require.Equal(t, "y", string(got))
	// The killed agent's open-ended file "f" was moved aside at the new agent's start and is
	// removed once the new agent has adopted what it keeps.
	require.Eventually(t, func() bool {
		trash, _ := filepath.Glob(filepath.Join(spool, ".files-trash-*"))
		return len(trash) == 0
	}, 10*time.Second, 20*time.Millisecond, "the predecessor's files are never removed")

	require.NoError(t, b.cmd.Process.Signal(syscall.SIGTERM))
	require.Equal(t, 0, b.wait(30*time.Second), "clean stop should exit 0\n%s", b.log())
	require.False(t, isMounted(dir), "mount left behind after SIGTERM")
	require.False(t, isMounted(spool), "spool left mounted after SIGTERM")
}

// TestStoppedAgentsMountIsNotTakenOver: a mount whose agent is stopped (SIGSTOP) does not
// answer; a second agent started on it waits --takeover-after for an answer, then refuses, naming
// the stopped agent, and leaves the mount alone: it is not stale, its agent may resume. (A mount
// that does not answer and that no agent process claims any more is aborted and replaced:
// fs's TestDetachStaleAbortsAMountThatDoesNotAnswer.)
func TestStoppedAgentsMountIsNotTakenOver(t *testing.T) {
	needRoot(t)
	base := t.TempDir()
	dir, spool := filepath.Join(base, "mnt"), filepath.Join(base, "spool")
	require.NoError(t, os.Mkdir(dir, 0o755))
	a := startAgent(t, dir, spool)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "f"), []byte("x"), 0o644))
	require.NoError(t, a.cmd.Process.Signal(syscall.SIGSTOP))
	t.Cleanup(func() { a.cmd.Process.Signal(syscall.SIGCONT) })

	out, code := runMtcfs(t, "mount", dir, "--spool", filepath.Join(base, "spool2"), "--memory", "64MiB", "--takeover-after", "2s")
	require.NotEqual(t, 0, code, out)
	assert.Contains(t, out, "does not answer yet; waiting for it before looking for its agent", "the wait is announced")
	assert.Contains(t, out, "up_to=2s")
	assert.Contains(t, out, fmt.Sprintf("agent process %d that mounted it still runs", a.cmd.Process.Pid))
	// mtcfs status names it, instead of only a timeout on its address (found by a black-box run).
	out, code = runMtcfs(t, "status", dir)
	require.Equal(t, 1, code, out)
	assert.Contains(t, out, fmt.Sprintf("the agent of %s (pid %d) is stopped (SIGSTOP, or a debugger)", dir, a.cmd.Process.Pid))

	require.NoError(t, a.cmd.Process.Signal(syscall.SIGCONT))
	got, err := os.ReadFile(filepath.Join(dir, "f"))
	require.NoError(t, err, "the resumed agent serves its mount again")
	assert.Equal(t, "x", string(got))
}

// TestHealthAndJSONLogs checks /livez, /readyz and the structured log keys.
func TestHealthAndJSONLogs(t *testing.T) {
	needRoot(t)
	base := t.TempDir()
	dir := filepath.Join(base, "mnt")
	require.NoError(t, os.Mkdir(dir, 0o755))
	a := startAgent(t, dir, filepath.Join(base, "spool"), "--http", "127.0.0.1:0", "--log-format", "json")
	// A line reported to the job is logged too: its text went under a second "message" key,
	// which strict JSON parsers refuse (an operator's black-box run).
	require.NoError(t, os.WriteFile(filepath.Join(dir, "replicator.yaml"), []byte("job-name: j\nnodes: 1\nnode-rank: 0\nframework: orbax\nno-such-key: 1\n"), 0o644))
	repWait(t, 10*time.Second, "the line reported to the job logged", func() bool { return strings.Contains(a.log(), "reported to the job") })

	var addr string
	for _, line := range strings.Split(a.log(), "\n") {
		var rec map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &rec), "log line is not JSON: %s", line)
		require.Contains(t, rec, "severity")
		require.Contains(t, rec, "message")
		require.Empty(t, duplicateKey(t, line), "a key twice in %s", line)
		if rec["message"] == "http endpoints" {
			addr, _ = rec["addr"].(string)
		}
	}
	require.NotEmpty(t, addr, "the chosen --http address should be logged")
	for _, path := range []string{"/livez", "/readyz"} {
		resp, err := http.Get("http://" + addr + path)
		require.NoError(t, err)
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode, "%s: %s", path, body)
	}
	require.NoError(t, a.cmd.Process.Signal(syscall.SIGINT))
	require.Equal(t, 0, a.wait(30*time.Second))
}

// TestMountErrors checks that bad input ends with a message that says what to do.
func TestMountErrors(t *testing.T) {
	base := t.TempDir()
	file := filepath.Join(base, "file")
	require.NoError(t, os.WriteFile(file, nil, 0o644))
	cases := []struct {
		name string
		args []string
		code int
		want string
	}{
		{"no dir", []string{"mount"}, 2, "want exactly one mount directory"},
		{"missing dir", []string{"mount", filepath.Join(base, "nope")}, 1, "does not exist; create it first"},
		{"not a dir", []string{"mount", file}, 1, "is not a directory"},
		{"bad size", []string{"mount", base, "--memory", "12XB"}, 2, "invalid size \"12XB\""},
		{"budget too small", []string{"mount", base, "--memory", "1MiB", "--spool", filepath.Join(t.TempDir(), "s")}, 1, "below the minimum 16.0MiB\n"},
		{"budget without a unit", []string{"mount", base, "--memory", "512", "--spool", filepath.Join(t.TempDir(), "s")}, 1, "below the minimum 16.0MiB (a number without a unit is bytes: give --memory a unit, such as --memory 2GiB)"},
		{"budget above the machine", []string{"mount", base, "--memory", "1000TiB"}, 2, "more than this machine's memory"},
		{"bad drain timeout", []string{"mount", base, "--drain-timeout", "-1s"}, 2, "want a duration ≥ 0"},
		{"drain timeout without a unit", []string{"mount", base, "--drain-timeout", "30"}, 2, `"30" is not a duration: want a number with a unit (ms, s, m, h), e.g. 30s or 2m`},
		{"bad takeover time", []string{"mount", base, "--takeover-after", "0s"}, 2, "want a duration > 0"},
		{"negative rank", []string{"mount", base, "--rank", "-1", "--jax-coordinator", "h:1"}, 2, "--rank -1: want a rank ≥ 0"},
		{"rank without coordinator", []string{"mount", base, "--rank", "0"}, 2, "--rank and --jax-coordinator go together"},
		{"bad go memory limit", []string{"mount", base, "--go-memory-limit", "lots"}, 2, "want auto, off or a size"},
		{"bad heap huge pages", []string{"mount", base, "--heap-huge-pages", "lots"}, 2, "want a size such as 128MiB, or off"},
		{"heap huge pages above the machine", []string{"mount", base, "--heap-huge-pages", "1000TiB"}, 2, "more than this machine's memory"},
		{"bad log format", []string{"mount", base, "--log-format", "xml"}, 2, "want json or text"},
		{"bad passthrough", []string{"mount", base, "--passthrough", "maybe"}, 2, "want auto, on or off"},
		{"unknown flag", []string{"mount", base, "--frobnicate"}, 2, "flag provided but not defined"},
		{"unknown command", []string{"frob"}, 2, "unknown command"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			out, err := exec.Command(binPath, tc.args...).CombinedOutput()
			var ee *exec.ExitError
			require.True(t, errors.As(err, &ee), "want a failing exit, got %v\n%s", err, out)
			require.Equal(t, tc.code, ee.ExitCode(), "%s", out)
			require.Contains(t, string(out), tc.want)
		})
	}
}

// TestMountErrorUnderJSONLogs: with --log-format json, an agent that fails to start says why in
// JSON lines only (it also printed one plain line, which a log parser expecting JSON refuses;
// an operator's black-box run).
func TestMountErrorUnderJSONLogs(t *testing.T) {
	base := t.TempDir()
	cmd := exec.Command(binPath, "mount", filepath.Join(base, "nope"), "--log-format", "json", "--spool", filepath.Join(base, "spool"))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	err := cmd.Run()
	var ee *exec.ExitError
	require.True(t, errors.As(err, &ee), "want a failing exit, got %v\n%s", err, stderr.String())
	require.Equal(t, 1, ee.ExitCode(), "%s", stderr.String())
	require.Contains(t, stderr.String(), "does not exist; create it first")
	for _, line := range strings.Split(strings.TrimSpace(stderr.String()), "\n") {
		var rec map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &rec), "log line is not JSON: %s", line)
	}
}

// TestSimultaneousStarts: two agents started on the same directory at the same moment (with
// spools of their own) both passed the check for a live mount and both mounted, the second
// hiding the first. The mount directory's lock makes them take turns: exactly one serves, and
// the other refuses, naming the live mount. Several rounds, since the race needs both starts
// to overlap.
func TestSimultaneousStarts(t *testing.T) {
	needRoot(t)
	base := t.TempDir()
	dir := filepath.Join(base, "mnt")
	require.NoError(t, os.Mkdir(dir, 0o755))
	backup := "file://" + filepath.Join(base, "backup")
	for round := range 4 {
		type started struct {
			cmd  *exec.Cmd
			mu   sync.Mutex
			log  []string
			done chan struct{} // closed once it exited, with err
			err  error
		}
		var agents [2]*started
		for i := range agents {
			spool := filepath.Join(base, fmt.Sprintf("spool-%d-%d", round, i))
			a := &started{cmd: exec.Command(binPath, "mount", dir, "--spool", spool, "--memory", "64MiB", "--backup", backup), done: make(chan struct{})}
			exited, err := startLogged(a.cmd, func(l string) { a.mu.Lock(); a.log = append(a.log, l); a.mu.Unlock() })
			require.NoError(t, err)
			go func() { a.err = <-exited; close(a.done) }()
			agents[i] = a
			t.Cleanup(func() {
				a.cmd.Process.Kill()
				<-a.done
				forceUnmount(dir)
				forceUnmount(spool)
			})
		}
		logOf := func(a *started) string { a.mu.Lock(); defer a.mu.Unlock(); return strings.Join(a.log, "\n") }
		// One of them exits: the one that found the other's mount.
		var loser, winner *started
		select {
		case <-agents[0].done:
			loser, winner = agents[0], agents[1]
		case <-agents[1].done:
			loser, winner = agents[1], agents[0]
		case <-time.After(30 * time.Second):
			t.Fatalf("round %d: both agents still run; mounts at %s: %d\n%s\n---\n%s", round, dir, fuseMountsAt(dir), logOf(agents[0]), logOf(agents[1]))
		}
		assert.Contains(t, logOf(loser), "is already a live FUSE mount", "round %d", round)
		require.Eventually(t, func() bool { return strings.Contains(logOf(winner), servingLine) }, 15*time.Second, 10*time.Millisecond,
			"round %d: the other agent serves\n%s", round, logOf(winner))
		assert.Equal(t, 1, fuseMountsAt(dir), "round %d: one mount at %s", round, dir)
		require.NoError(t, winner.cmd.Process.Signal(syscall.SIGTERM))
		select {
		case <-winner.done:
			require.NoError(t, winner.err, "round %d: clean stop\n%s", round, logOf(winner))
		case <-time.After(30 * time.Second):
			t.Fatalf("round %d: the serving agent did not stop", round)
		}
		require.Zero(t, fuseMountsAt(dir), "round %d: mount left behind", round)
	}
}

// TestStartWaitsForTheDirectoryLock: while another process holds the mount directory's lock (an
// agent starting there), a starting agent waits, says so after a second, and serves once the
// lock is released. (flock(1) on the directory from another mount namespace held it off too,
// tried by hand with unshare -m.)
func TestStartWaitsForTheDirectoryLock(t *testing.T) {
	needRoot(t)
	n := newRepNode(t)
	f, err := os.Open(n.dir)
	require.NoError(t, err)
	fd := int(f.Fd())
	require.NoError(t, unix.Flock(fd, unix.LOCK_EX))
	released := make(chan time.Time, 1) // before the unlock: the agent cannot serve earlier
	unlocked := make(chan struct{})
	// The agent says it waits after a second of waiting; it reaches the lock 0.1–0.3 s after
	// exec here, so 5 s leave room for a loaded machine.
	time.AfterFunc(5*time.Second, func() {
		released <- time.Now()
		unix.Flock(fd, unix.LOCK_UN)
		close(unlocked)
	})
	defer func() { <-unlocked; f.Close() }()
	a := n.start(t) // serves only after the release
	assert.Contains(t, a.log(), "waiting for another agent starting on the same directory")
	select {
	case <-released:
	default:
		t.Fatal("the agent served before the lock was released")
	}
	stopAgent(t, a)
}

// waitStopped waits until every thread of pid is stopped (state T in /proc/PID/task/*/stat),
// after a SIGSTOP.
func waitStopped(t *testing.T, pid int) {
	t.Helper()
	repWait(t, 10*time.Second, fmt.Sprintf("pid %d to stop", pid), func() bool {
		stats, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/stat", pid))
		for _, st := range stats {
			b, err := os.ReadFile(st)
			if err != nil {
				continue // a thread that exited
			}
			// The state follows the command name in parentheses, which may hold spaces.
			_, rest, ok := strings.Cut(string(b), ") ")
			if !ok || !strings.HasPrefix(rest, "T") {
				return false
			}
		}
		return len(stats) > 0
	})
}

// duplicateKey returns a key that the JSON object line has twice at its top level ("": none).
func duplicateKey(t *testing.T, line string) string {
	t.Helper()
	dec := json.NewDecoder(strings.NewReader(line))
	tok, err := dec.Token()
	require.NoError(t, err)
	require.Equal(t, json.Delim('{'), tok)
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		require.NoError(t, err)
		key := tok.(string)
		if seen[key] {
			return key
		}
		seen[key] = true
		var v json.RawMessage
		require.NoError(t, dec.Decode(&v))
	}
	return ""
}
