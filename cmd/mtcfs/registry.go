package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

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
	data, _ := json.Marshal(info)
	if err := os.MkdirAll(dir, 0o755); err == nil {
		os.WriteFile(p, data, 0o644)
	}
	return func() { os.Remove(p) }
}

// localAgents lists the agents running on this machine, dropping files of dead ones.
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
		p := filepath.Join(agentsDir(), e.Name())
		data, err := os.ReadFile(p)
		var info agentInfo
		if err != nil || json.Unmarshal(data, &info) != nil || !strings.HasSuffix(e.Name(), ".json") {
			continue
		}
		if unix.Kill(info.PID, 0) == unix.ESRCH {
			os.Remove(p)
			continue
		}
		out = append(out, info)
	}
	return out, nil
}

func (a agentInfo) String() string {
	return fmt.Sprintf("pid %d at %s (http %s)", a.PID, a.Dir, a.HTTP)
}
