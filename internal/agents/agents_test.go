package agents

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestPlantedEntriesDoNotCount: as root, the registry directories of users (in a world-writable
// /tmp) are read for `mtcfs status`, but an entry there counts only if its file belongs to the
// user its pid runs as; and a stopping agent is looked for only in root's registry, so that no
// user can hold a root agent back for two minutes with an entry naming its mount.
func TestPlantedEntriesDoNotCount(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the registries of other users are read as root only")
	}
	t.Setenv("TMPDIR", t.TempDir())
	dir := filepath.Join(os.TempDir(), "mtcfs-1000", "agents")
	require.NoError(t, os.MkdirAll(dir, 0o777))
	me := os.Getpid()
	start, err := ProcStartTime(me)
	require.NoError(t, err)
	p := filepath.Join(dir, strconv.Itoa(me)+".json")
	data, _ := json.Marshal(Info{PID: me, Dir: "/srv/root-mount", HTTP: "127.0.0.1:1", Stopping: true, StartTime: start})
	require.NoError(t, os.WriteFile(p, data, 0o644))
	listed := func() bool {
		list, err := Local()
		require.NoError(t, err)
		for _, a := range list {
			if a.Dir == "/srv/root-mount" {
				return true
			}
		}
		return false
	}

	require.NoError(t, os.Chown(p, 1000, 1000)) // uid 1000 names root's process (this test)
	assert.False(t, listed(), "an entry whose file is not its process's user's")
	require.NoError(t, os.Chown(p, 0, 0))
	assert.True(t, listed(), "an entry of its process's user, in a user's directory")
	_, stopping := Stopping("/srv/root-mount")
	assert.False(t, stopping, "only this user's and root's registries hold a stopping agent")
}

// TestStopped: a process stopped with SIGSTOP is told from a running one (mtcfs status names a
// stopped agent instead of only timing out on it).
func TestStopped(t *testing.T) {
	cmd := exec.Command("sleep", "30")
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	pid := cmd.Process.Pid
	assert.False(t, Stopped(pid))
	require.NoError(t, cmd.Process.Signal(syscall.SIGSTOP))
	assert.Eventually(t, func() bool { return Stopped(pid) }, 5*time.Second, time.Millisecond)
	require.NoError(t, cmd.Process.Signal(syscall.SIGCONT))
	assert.Eventually(t, func() bool { return !Stopped(pid) }, 5*time.Second, time.Millisecond)
	assert.False(t, Stopped(1<<30), "no such process")
}

// TestZombieIsNotAlive: an agent that died and that its parent has not reaped yet (a zombie)
// is not a running agent; status and spool list counted it as one (found by a black-box run).
func TestZombieIsNotAlive(t *testing.T) {
	cmd := exec.Command("sleep", "30")
	require.NoError(t, cmd.Start())
	reaped := false
	t.Cleanup(func() {
		if !reaped {
			cmd.Process.Kill()
			cmd.Wait()
		}
	})
	pid := cmd.Process.Pid
	start, err := ProcStartTime(pid)
	require.NoError(t, err)
	p := filepath.Join(t.TempDir(), "agent.json")
	require.NoError(t, os.WriteFile(p, nil, 0o644))
	info := Info{PID: pid, Dir: "/srv/x", StartTime: start}
	assert.True(t, alive(info, p))
	require.NoError(t, cmd.Process.Kill())
	assert.Eventually(t, func() bool { return procState(pid) == 'Z' }, 5*time.Second, time.Millisecond, "not reaped: a zombie")
	assert.False(t, alive(info, p), "a zombie")
	cmd.Wait()
	reaped = true
	assert.False(t, alive(info, p), "gone")
}

// TestPlantedEntryInOwnRegistry: in a user's own registry directory, which another user may
// have made first (a world-writable /tmp), only the user's files count: a planted entry held the
// user's spool "in use" and answered their status (found by a black-box run).
func TestPlantedEntryInOwnRegistry(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: to give the entry to another user")
	}
	dir := t.TempDir()
	me := os.Getpid()
	start, err := ProcStartTime(me)
	require.NoError(t, err)
	p := filepath.Join(dir, strconv.Itoa(me)+".json")
	data, _ := json.Marshal(Info{PID: me, Dir: "/srv/mine", StartTime: start})
	require.NoError(t, os.WriteFile(p, data, 0o644))
	list, err := localIn([]string{dir})
	require.NoError(t, err)
	require.Len(t, list, 1, "this user's entry")
	require.NoError(t, os.Chown(p, 1000, 1000))
	list, err = localIn([]string{dir})
	require.NoError(t, err)
	assert.Empty(t, list, "an entry another user planted in this user's directory")
}
