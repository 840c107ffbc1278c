package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/tiers"
)

// agentInfo is what a running agent publishes about itself so that `mtcfs status` finds it
// without flags.
type agentInfo struct {
	PID         int    `json:"pid"`
	Dir         string `json:"dir"`
	HTTP        string `json:"http"`
	Version     string `json:"version"`
	Passthrough bool   `json:"passthrough"`
	SpoolDir    string `json:"spool_dir,omitempty"`
	// StartTime is the agent process's start time (field 22 of /proc/PID/stat, clock ticks
	// since boot): a file whose pid now names a process with another start time is stale.
	StartTime uint64 `json:"start_time,omitempty"`
}

// statusReply is the /status document.
type statusReply struct {
	agentInfo
	tiers.Status
}

// agentsDir holds one small file per running agent on this machine.
func agentsDir() string {
	if os.Geteuid() == 0 {
		return "/run/mtcfs/agents"
	}
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" {
		return filepath.Join(d, "mtcfs", "agents")
	}
	return filepath.Join(os.TempDir(), "mtcfs-"+strconv.Itoa(os.Getuid()), "agents")
}

func registerAgent(info agentInfo) (unregister func()) {
	dir := agentsDir()
	p := filepath.Join(dir, strconv.Itoa(info.PID)+".json")
	if info.StartTime == 0 {
		info.StartTime, _ = procStartTime(info.PID)
	}
	data, _ := json.Marshal(info)
	if err := os.MkdirAll(dir, 0o755); err == nil {
		tmp := p + ".tmp"
		if os.WriteFile(tmp, data, 0o644) == nil {
			os.Rename(tmp, p)
		}
	}
	return func() { os.Remove(p) }
}

// localAgents lists the agents running on this machine, removing the files of agents that are
// gone: their pid is dead, or now names another process (pid reuse).
func localAgents() ([]agentInfo, error) {
	ents, err := os.ReadDir(agentsDir())
	if os.IsNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []agentInfo
	for _, e := range ents {
		if !strings.HasSuffix(e.Name(), ".json") {
			continue
		}
		p := filepath.Join(agentsDir(), e.Name())
		data, err := os.ReadFile(p)
		var info agentInfo
		if err != nil || json.Unmarshal(data, &info) != nil || info.PID <= 0 {
			continue
		}
		if !agentAlive(info, p) {
			os.Remove(p)
			continue
		}
		out = append(out, info)
	}
	return out, nil
}

// agentAlive reports whether the process that wrote the registry file p still runs.
func agentAlive(info agentInfo, p string) bool {
	if unix.Kill(info.PID, 0) == unix.ESRCH {
		return false
	}
	start, err := procStartTime(info.PID)
	if err != nil {
		return !os.IsNotExist(err) // gone between the two looks; otherwise we cannot tell
	}
	if info.StartTime != 0 {
		return start == info.StartTime
	}
	// A file written by an agent that did not record its start time: the process must have
	// started before the file was written.
	fi, err := os.Stat(p)
	if err != nil {
		return true
	}
	started, ok := bootTime()
	if !ok {
		return true
	}
	started = started.Add(time.Duration(start) * time.Second / clockTicks)
	return !started.After(fi.ModTime().Add(time.Second))
}

// clockTicks is USER_HZ, the unit of /proc/PID/stat times: 100 on every Linux architecture
// Go supports.
const clockTicks = 100

// procStartTime reads field 22 (starttime) of /proc/pid/stat.
func procStartTime(pid int) (uint64, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// The command name (field 2) is in parentheses and may hold spaces and parentheses: the
	// fields after it start after the last ')'.
	i := bytes.LastIndexByte(data, ')')
	if i < 0 {
		return 0, fmt.Errorf("/proc/%d/stat: unexpected format", pid)
	}
	fields := strings.Fields(string(data[i+1:]))
	const idx = 22 - 3 // fields[0] is field 3 (state)
	if len(fields) <= idx {
		return 0, fmt.Errorf("/proc/%d/stat: unexpected format", pid)
	}
	return strconv.ParseUint(fields[idx], 10, 64)
}

// bootTime is the btime line of /proc/stat.
func bootTime() (time.Time, bool) {
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		return time.Time{}, false
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "btime "); ok {
			if n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64); err == nil {
				return time.Unix(n, 0), true
			}
		}
	}
	return time.Time{}, false
}

func (a agentInfo) String() string {
	return fmt.Sprintf("pid %d at %s (http %s)", a.PID, a.Dir, a.HTTP)
}
