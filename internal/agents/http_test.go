package agents

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestServe: /livez answers at once, /readyz only once ready, /status is what FetchStatus
// returns, /metrics is the handler given.
func TestServe(t *testing.T) {
	var ready atomic.Bool
	metrics := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "mtcfs_build_info 1\n") })
	var why atomic.Value // what ready says once the mount is up ("": ready)
	why.Store("")
	readyz := func() string {
		if !ready.Load() {
			return "not mounted"
		}
		return why.Load().(string)
	}
	addr, stop, err := Serve("127.0.0.1:0", readyz, func() any { return Info{PID: 42, Dir: "/ckpt"} }, metrics, slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	defer stop()
	get := func(path string) (int, string) {
		t.Helper()
		resp, err := http.Get("http://" + addr + path)
		require.NoError(t, err)
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, string(body)
	}
	code, _ := get("/livez")
	assert.Equal(t, http.StatusOK, code)
	code, body := get("/readyz")
	assert.Equal(t, http.StatusServiceUnavailable, code, "not ready before the mount")
	assert.Contains(t, body, "not mounted")
	ready.Store(true)
	code, _ = get("/readyz")
	assert.Equal(t, http.StatusOK, code)
	why.Store("the mount was detached")
	code, body = get("/readyz")
	assert.Equal(t, http.StatusServiceUnavailable, code, "a mount that went away")
	assert.Contains(t, body, "the mount was detached")
	why.Store("")
	_, body = get("/metrics")
	assert.Equal(t, "mtcfs_build_info 1\n", body)

	raw, err := FetchStatus(addr)
	require.NoError(t, err)
	var got Info
	require.NoError(t, json.Unmarshal(raw, &got))
	assert.Equal(t, Info{PID: 42, Dir: "/ckpt"}, got)

	_, err = FetchStatus(strings.TrimSuffix(addr, "/") + "/nothing")
	assert.Error(t, err, "a path that is not an agent's answers 404")
}

// TestServeOutOfDescriptors: an agent whose descriptors a job took (EMFILE on every open) still
// answers /status, one connection after another (before, accept(2) failed and `mtcfs status`
// timed out), also when a client keeps its connection alive. The agent is a child process: the limit is the whole process's.
func TestServeOutOfDescriptors(t *testing.T) {
	if os.Getenv("MTCFS_TEST_EMFILE_CHILD") == "1" {
		emfileChild()
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestServeOutOfDescriptors$")
	cmd.Env = append(os.Environ(), "MTCFS_TEST_EMFILE_CHILD=1")
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	require.NoError(t, err, "the child prints its address once out of descriptors")
	addr, ok := strings.CutPrefix(strings.TrimSpace(line), "addr ")
	require.True(t, ok, "child said %q", line)

	// Each request on a client of its own, which keeps its connection alive if the agent lets
	// it (a Prometheus scraper does): one on the spare must not keep the next one out.
	for i := range 3 {
		c := http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{}}
		resp, err := c.Get("http://" + addr + "/status")
		require.NoError(t, err, "request %d", i)
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, resp.StatusCode)
		assert.Contains(t, string(body), `"pid": 7`, "request %d", i)
	}
}

// emfileChild serves, then opens descriptors until none is left, says its address and waits.
func emfileChild() {
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &syscall.Rlimit{Cur: 64, Max: 64}); err != nil {
		fmt.Println("setrlimit", err)
		os.Exit(1)
	}
	var ready atomic.Bool
	addr, _, err := Serve("127.0.0.1:0", func() string {
		if ready.Load() {
			return ""
		}
		return "not mounted"
	}, func() any { return Info{PID: 7} }, http.NotFoundHandler(), slog.New(slog.DiscardHandler))
	if err != nil {
		fmt.Println("serve", err)
		os.Exit(1)
	}
	var held []*os.File
	for {
		f, err := os.Open(os.DevNull)
		if err != nil {
			if !errors.Is(err, syscall.EMFILE) {
				fmt.Println("open", err)
				os.Exit(1)
			}
			break
		}
		held = append(held, f)
	}
	fmt.Println("addr", addr)
	time.Sleep(2 * time.Minute) // killed by the test
	runtime.KeepAlive(held)
}
