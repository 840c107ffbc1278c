package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"path/filepath"
	"regexp"
	"time"

	"github.com/mtcfs/mtcfs/bench/internal/benchkit"
)

// agent is one "mtcfs mount" child with its own mount point, spool and backup location.
type agent struct {
	*benchkit.Agent
	name     string
	httpAddr string // from the "http endpoints addr=..." log line
}

var httpAddrRE = regexp.MustCompile(`msg="http endpoints" addr=(\S+)`)

// startAgent runs "mtcfs mount" in the foreground as a child under base and waits until it
// serves and its HTTP address is known. The agent is registered with the bench, so that
// teardown stops it.
func (b *bench) startAgent(ctx context.Context, name, backupDir string) (*agent, error) {
	a := &agent{name: name}
	var err error
	a.Agent, err = benchkit.StartAgent(ctx, benchkit.AgentConfig{
		Bin:        b.bin,
		Dir:        filepath.Join(b.base, name, "mnt"),
		Spool:      filepath.Join(b.base, name, "spool"),
		Flags:      []string{"--memory", b.cfg.memory, "--backup", "file://" + backupDir, "--http", "127.0.0.1:0"},
		KeepsSpool: true, // replbench starts no successor on the same spool
		Ready: func(log string) bool {
			m := httpAddrRE.FindStringSubmatch(log)
			if m != nil {
				a.httpAddr = m[1]
			}
			return m != nil
		},
	})
	if err != nil {
		return nil, fmt.Errorf("agent %s: %w", name, err)
	}
	b.agents = append(b.agents, a)
	return a, nil
}

// logDuration waits up to wait for a log line matching re (whose last group is a Go duration)
// and returns the duration of the last such line.
func (a *agent) logDuration(re *regexp.Regexp, wait time.Duration) (time.Duration, bool) {
	deadline := time.Now().Add(wait)
	for {
		if ms := re.FindAllStringSubmatch(a.Log(), -1); len(ms) > 0 {
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
