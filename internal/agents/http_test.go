package agents

import (
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestServe: /livez answers at once, /readyz only once ready, /status is what FetchStatus
// returns, /metrics is the handler given.
func TestServe(t *testing.T) {
	var ready atomic.Bool
	metrics := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "mtcfs_build_info 1\n") })
	addr, stop, err := Serve("127.0.0.1:0", &ready, func() any { return Info{PID: 42, Dir: "/ckpt"} }, metrics, slog.New(slog.DiscardHandler))
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
