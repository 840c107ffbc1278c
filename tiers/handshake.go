package tiers

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"

	"github.com/mtcfs/mtcfs/layout"
)

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

// handshake answers a replicator.yaml (SPEC §2). It runs on the control loop and only does
// fast namespace work, so the yaml disappears well within the client's one-second poll; the
// restore runs on its own goroutine.
func (r *Replicator) handshake() {
	data, err := r.ns.ReadFile(layout.ReplicatorYAMLName, MaxConfigSize)
	if errors.Is(err, os.ErrNotExist) {
		return // already consumed (a close and a rename both announced it)
	}
	if err != nil {
		r.ns.Remove(layout.ReplicatorYAMLName)
		r.failLine(nil, fmt.Sprintf("%s: %v", layout.ReplicatorYAMLName, err))
		return
	}
	if len(strings.TrimSpace(string(data))) == 0 {
		r.ns.Remove(layout.ReplicatorYAMLName)
		r.log.Info("empty replicator.yaml deleted")
		return
	}
	cfg, warnings, err := ParseConfig(data, r.cfg.Getenv)

	// Whatever the content, the old incarnation is over: its uncommitted work is abandoned.
	r.mu.Lock()
	if old := r.inc; old != nil {
		old.cancel()
	}
	r.inc = nil
	r.mu.Unlock()

	if err != nil {
		r.failLine(partialConfig(data, r.cfg.Getenv), err.Error())
		r.ns.Remove(layout.ReplicatorYAMLName)
		r.log.Error("invalid replicator.yaml", "err", err)
		r.metrics.error(errKindConfig)
		return
	}
	inc := &incarnation{Incarnation: Incarnation{ID: randomID(), Config: cfg}, phase: "restoring"}
	inc.ctx, inc.cancel = context.WithCancel(r.ctx)
	r.cleanNamespace()
	for _, w := range warnings {
		r.errLine(cfg, w)
	}
	r.mu.Lock()
	lost := r.startupErrors
	r.startupErrors = nil
	r.mu.Unlock()
	for _, msg := range lost {
		r.errLine(cfg, msg)
	}
	r.freeOtherJobs(cfg)
	if err := r.cfg.Spool.SetJob(cfg.JobName); err != nil {
		r.log.Debug("spool owner record", "err", err) // a spool opened without a mount path has none
	}
	if err := r.ns.Remove(layout.ReplicatorYAMLName); err != nil {
		r.log.Error("delete replicator.yaml", "err", err)
	}
	r.mu.Lock()
	r.inc = inc
	r.lastCommitted = 0
	r.lastReplicated = -1
	clear(r.early) // the peers drop an earlier incarnation's early files when they see this one
	r.mu.Unlock()
	r.log.Info("new incarnation", "incarnation", inc.ID, "job", cfg.JobName, "framework", cfg.Framework,
		"rank", cfg.NodeRank, "nodes", cfg.Nodes, "workers", cfg.WorkersPerNode, "peers", cfg.Peers())
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		r.restoreIncarnation(inc)
	}()
}

// cleanNamespace removes everything but committed data, .meta files, jax-init-info.txt and
// the yaml (SPEC §2.4): stale markers, step directories and symlinks, tmp dirs, status files.
// Names waiting to be sealed stay: a committed step is never dropped.
func (r *Replicator) cleanNamespace() {
	ents, err := r.ns.List()
	if err != nil {
		r.log.Error("list namespace", "err", err)
		return
	}
	r.mu.Lock()
	pending := make(map[string]bool, len(r.pending))
	for k := range r.pending {
		pending[k] = true
	}
	r.mu.Unlock()
	for _, e := range ents {
		n := e.Name
		if pending[n] || n == layout.ReplicatorYAMLName || n == layout.JaxInitInfoName || strings.HasSuffix(n, ".meta") || layout.IsDataName(n) {
			continue
		}
		if err := r.ns.Remove(n); err != nil {
			r.log.Error("clean namespace", "name", n, "err", err)
		}
	}
}

// freeOtherJobs frees what this node's RAM holds of other jobs (a mount path reused by another
// job): it is never restored for this one and must not take this job's budget (SPEC §10).
func (r *Replicator) freeOtherJobs(cfg *Config) {
	var names []string
	r.mu.Lock()
	for name := range r.metas {
		if m, ok := layout.ParseMarkerName(name); ok && m.Job != cfg.JobName {
			names = append(names, name)
			delete(r.metas, name)
		}
	}
	r.mu.Unlock()
	if len(names) == 0 {
		return
	}
	sort.Strings(names)
	for _, name := range names {
		os.Remove(r.spoolDir("meta", name))
		r.ns.Remove(name)
	}
	r.retain(cfg) // frees the data no kept .meta names
	r.log.Warn("freed checkpoints of other jobs", "metas", names, "job", cfg.JobName)
	r.errLine(cfg, fmt.Sprintf("this node's RAM held checkpoints of other jobs (%s); they were freed: this mount now serves job %s", strings.Join(names, ", "), cfg.JobName))
}

// partialConfig recovers job name, rank and nodes from an invalid yaml for the failure line.
func partialConfig(data []byte, getenv func(string) string) *Config {
	c := &Config{NodeRank: -1, Nodes: -1}
	for _, line := range strings.Split(string(data), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		v = strings.Trim(strings.TrimSpace(os.Expand(strings.TrimSpace(v), getenv)), `"'`)
		switch strings.TrimSpace(k) {
		case "job-name":
			if layout.ValidateJobName(v) == nil {
				c.JobName = v // an unsafe name would break the line format
			}
		case "node-rank":
			if n, err := strconv.Atoi(v); err == nil {
				c.NodeRank = n
			}
		case "nodes":
			if n, err := strconv.Atoi(v); err == nil {
				c.Nodes = n
			}
		}
	}
	return c
}

// errLine appends a line to replicator.errors; failLine to replicator.failed (SPEC §2.3).
func (r *Replicator) errLine(cfg *Config, msg string) {
	r.appendLine(layout.ReplicatorErrorsName, "ERR", cfg, msg)
}
func (r *Replicator) failLine(cfg *Config, msg string) {
	r.appendLine(layout.ReplicatorFailedName, "FATAL", cfg, msg)
}

// incLine reports an error of a background task of inc; once a newer incarnation started, the
// line only goes to the log, since the first line of the new incarnation's replicator.errors
// must be its own (SPEC §2).
func (r *Replicator) incLine(inc *incarnation, msg string) {
	if r.current() != inc {
		r.log.Error("error of an earlier incarnation", "incarnation", inc.ID, "message", msg)
		return
	}
	r.errLine(inc.Config, msg)
}

func (r *Replicator) appendLine(file, level string, cfg *Config, msg string) {
	r.lineMu.Lock()
	defer r.lineMu.Unlock()
	job, rank, nodes := "?", "?", "?"
	if cfg != nil {
		if cfg.JobName != "" {
			job = cfg.JobName
		}
		if cfg.NodeRank >= 0 {
			rank = itoa(int64(cfg.NodeRank))
		}
		if cfg.Nodes >= 0 {
			nodes = itoa(int64(cfg.Nodes))
		}
	}
	msg = oneLine(msg)
	line := fmt.Sprintf("%s job=%s node=%s/%s %s %s\n", r.cfg.Now().UTC().Format("2006-01-02T15:04:05Z"), job, rank, nodes, level, msg)
	old, err := r.ns.ReadFile(file, 1<<20)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		r.log.Error("read "+file, "err", err)
	}
	if err := r.ns.WriteFile(file, append(old, line...)); err != nil {
		r.log.Error("write "+file, "err", err)
	}
	r.log.Warn("reported to the job", "file", file, "message", msg)
	r.mu.Lock()
	r.recentErrors = append(r.recentErrors, strings.TrimSpace(line))
	if len(r.recentErrors) > 20 {
		r.recentErrors = r.recentErrors[len(r.recentErrors)-20:]
	}
	r.mu.Unlock()
}
