package tiers

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/mtcfs/mtcfs/layout"
)

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

// heldAfter is yamlHeldWait, or heldWait when set.
func (h *handshake) heldAfter() time.Duration {
	if h.heldWait > 0 {
		return h.heldWait
	}
	return yamlHeldWait
}

// handshake answers the job's replicator.yaml (SPEC §2): it ends the running incarnation,
// starts the next one and its restore. It runs on the control loop and only does fast namespace
// work, so the yaml disappears well within the client's one-second poll; the restore runs on
// its own goroutine (restorer.run), which ends with the incarnation.
type handshake struct {
	*node
	getenv   func(string) string
	checkJob func(*Config) error  // ReplicatorConfig.CheckJob
	warnJob  func(*Config) string // ReplicatorConfig.WarnJob
	// recheck has the yaml answered as it is (answer(true)) on the control loop; heldTimer is
	// the pending one (at most one), heldWait how long it waits (yamlHeldWait; tests set it).
	recheck   func()
	heldTimer *time.Timer
	heldNode  uint64 // the file held (ControlVersion.Node)
	heldWait  time.Duration
	incs      *incarnations
	lines     *jobLines
	recorder  *commitRecorder // names waiting for sealing stay in the namespace
	restorer  *restorer
}

// yamlHeldWait is how long replicator.yaml may stay open for writing after a close of it before
// it is answered as it is: another process holding it open (an editor, a `tail -f` opened for
// writing by mistake) kept the job waiting until its 300 s ran out, told nothing (black-box
// h60). A yaml is written in milliseconds; half a one answered after this long gets the FATAL
// line a bad yaml gets.
const yamlHeldWait = 30 * time.Second

// answer reads and consumes replicator.yaml; held answers one still open for writing (a close
// of it came yamlHeldWait ago).
func (h *handshake) answer(held bool) {
	var data []byte
	var err error
	remove := func() error { return h.ns.Remove(layout.ReplicatorYAMLName) }
	cf, versioned := h.ns.(ControlFiles)
	if versioned {
		var v ControlVersion
		data, v, err = cf.ReadControl(layout.ReplicatorYAMLName, MaxConfigSize)
		if err == nil && v.Writing && !held {
			// Still being written (a handle open for writing): the last writer's close is
			// reported and answered (a `touch` while the job wrote had half a file answered);
			// if none comes, it is answered as it is after yamlHeldWait.
			h.log.Info("replicator.yaml is still open for writing: it is answered at its last writer's close, or as it is in " + h.heldAfter().String())
			if h.heldTimer == nil && h.recheck != nil {
				h.heldTimer, h.heldNode = time.AfterFunc(h.heldAfter(), h.recheck), v.Node
			}
			return
		}
		if held {
			h.heldTimer = nil
			if err == nil && v.Node != h.heldNode {
				return // not the file that was held: answered at its close
			}
			if err == nil && v.Writing {
				h.log.Warn("replicator.yaml is still open for writing by a process other than the one that closed it: answered as it is", "waited", h.heldAfter().String())
			}
		} else if h.heldTimer != nil {
			h.heldTimer.Stop() // answered at a close: a later yaml is not answered half written
			h.heldTimer = nil
		}
		if err == nil {
			// Only the version read: one the job wrote again meanwhile is answered next.
			remove = func() error {
				err := cf.RemoveControl(layout.ReplicatorYAMLName, v)
				if errors.Is(err, ErrReportChanged) {
					h.log.Warn("replicator.yaml was written again while the agent answered it: the new one is answered too")
					return nil
				}
				return err
			}
		}
	}
	if !versioned || errors.Is(err, os.ErrNotExist) { // not a regular file: ReadFile says what
		data, err = h.ns.ReadFile(layout.ReplicatorYAMLName, MaxConfigSize)
	}
	if errors.Is(err, os.ErrNotExist) {
		return // already consumed (a close and a rename both announced it)
	}
	if err != nil {
		remove()
		h.lines.failLine(nil, fmt.Sprintf("%s: %v", layout.ReplicatorYAMLName, err))
		return
	}
	if len(strings.TrimSpace(string(data))) == 0 {
		remove()
		h.log.Info("empty replicator.yaml deleted")
		return
	}
	cfg, warnings, err := ParseConfig(data, h.getenv)
	refused := false // valid, but not a job this agent can serve
	if checker, ok := h.restorer.coord.(JobChecker); ok && err == nil {
		err = checker.CheckJob(cfg)
		refused = err != nil
	}
	if h.checkJob != nil && err == nil {
		err = h.checkJob(cfg)
		refused = err != nil
	}

	// Whatever the content, the old incarnation is over: its uncommitted work is abandoned.
	h.incs.end()

	if err != nil {
		h.lines.failLine(partialConfig(data, h.getenv), err.Error())
		remove()
		if refused {
			h.log.Error("replicator.yaml refused: this agent cannot serve the job", "err", err)
		} else {
			h.log.Error("invalid replicator.yaml", "err", err)
		}
		h.metrics.error(errKindConfig)
		return
	}
	inc := newIncarnation(h.ctx, cfg)
	inc.Superseded = h.incs.supersede(inc.ID)
	// The job's user: a root writer says nothing of it (a launcher may write the yaml for a job
	// that then runs as someone else), and root reads any checkpoint anyway.
	var jobUID, jobGID uint32
	if uid, gid, err := h.ns.Owner(layout.ReplicatorYAMLName); err == nil {
		jobUID, jobGID = uid, gid
		switch ro, ok := h.ns.(RootOwned); {
		case uid == 0:
		case ok && ro.RootOwner() != uid:
			inc.stranger = int64(uid)
		default:
			inc.user = int64(uid)
		}
		if o, ok := h.ns.(AgentFilesOwner); ok {
			o.OwnAgentFiles(uid, gid) // the markers and reports of this start are the job's
		}
	}
	unread := h.lines.takeUnread(cfg.JobName)
	h.cleanNamespace()
	if h.warnJob != nil {
		if w := h.warnJob(cfg); w != "" {
			warnings = append(warnings, w)
		}
	}
	for _, w := range warnings {
		h.lines.errLine(cfg, w)
	}
	for _, msg := range h.incs.takeStartupErrors() {
		h.lines.errLine(cfg, msg)
	}
	if len(unread) > 0 {
		h.lines.errLines(cfg, unread)
	}
	run := Running{Incarnation: inc.ID, Framework: cfg.Framework, Rank: cfg.NodeRank, Nodes: cfg.Nodes, Since: h.now().UTC(), TracksRestore: true, UID: jobUID, GID: jobGID}
	if err := h.withRoom(func() error { return h.spool.SetRunning(cfg.JobName, run) }); errors.Is(err, errNoOwnerRecord) {
		h.log.Debug("spool owner record", "err", err)
	} else if err != nil {
		// The next agent will not know that this job ran: were it restarted under the job, it
		// could not tell the job that its saves are no longer checkpointed.
		h.log.Warn("record the job's incarnation in the spool's owner record", "err", err)
	}
	if err := remove(); err != nil {
		h.log.Error("delete replicator.yaml", "err", err)
	}
	// The new incarnation starts with no early groups: the peers drop an earlier one's when
	// they see this one.
	h.incs.begin(inc)
	h.log.Info("new incarnation", "incarnation", inc.ID, "job", cfg.JobName, "framework", cfg.Framework,
		"rank", cfg.NodeRank, "nodes", cfg.Nodes, "workers", cfg.WorkersPerNode, "peers", JoinAtMost(cfg.Peers(), maxRanksNamed))
	if outside := cfg.PeersOutsideColumn(); len(outside) > 0 {
		h.log.Warn("peer-ranks name ranks outside this node's data-parallel column (the ranks equal to it mod nodes/assume-data-parallelism): the job's column-mates are not mtcfs's, so this node backs up its own data, and a restore takes the columns from the .meta replicas the nodes hold (see README, data-parallel mode)",
			"rank", cfg.NodeRank, "peers_outside_column", outside, "partitions", cfg.Nodes/cfg.AssumeDataParallelism)
	}
	h.tasks.Go(func() { h.restorer.run(inc) })
}

// cleanNamespace removes everything but committed data, .meta files, jax-init-info.txt and
// the yaml (SPEC §2.4): stale markers, step directories and symlinks, tmp dirs, status files.
// Names waiting to be sealed stay: a committed step is never dropped.
func (h *handshake) cleanNamespace() {
	ents, err := h.ns.List()
	if err != nil {
		h.log.Error("list namespace", "err", err)
		return
	}
	pending := h.recorder.pendingNames()
	var removed []string
	for _, e := range ents {
		n := e.Name
		if pending[n] || n == layout.ReplicatorYAMLName || n == layout.JaxInitInfoName || strings.HasSuffix(n, ".meta") || layout.IsDataName(n) {
			continue
		}
		if err := h.ns.Remove(n); err != nil {
			h.log.Error("clean namespace", "name", n, "err", err)
		} else {
			removed = append(removed, n)
		}
	}
	if len(removed) > 0 {
		// The job's own files (a config.json, logs) went without a word (a black-box run).
		h.log.Info("removed the top-level entries that are not checkpoints, as at every replicator.yaml (SPEC §2.4): the mount keeps only checkpoints",
			"count", len(removed), "names", listSome(removed, 10))
	}
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
