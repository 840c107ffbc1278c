package tiers

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// Incarnation is one start of the training job: one replicator.yaml.
type Incarnation struct {
	ID     string // unique per start, random
	Config *Config
}

// SyncReport is what a node tells the coordinator after it committed (and replicated) a step.
type SyncReport struct {
	Step          int64
	BackupRunning bool // this node is still uploading an earlier backup
	// Replicated is true when every peer of this node acknowledged a verified replica of the
	// step (or the node has no peers). Only acknowledged replicas count (SPEC §4).
	Replicated bool
}

// SyncDecision is the coordinator's answer to a sync.
type SyncDecision struct {
	// Backup names the backup this step must be uploaded to ("" when none is due).
	Backup string
	// Replicated is true when every node reported the step replicated: it survives the loss of
	// any one node.
	Replicated bool
}

// Coordinator runs the job-wide decisions (SPEC §4–6). The rank-0 agent coordinates; every
// node talks to it through this interface. A one-node job uses LocalCoordinator.
type Coordinator interface {
	// Negotiate sends this node's inventory and returns the plan once every node reported.
	Negotiate(ctx context.Context, inc Incarnation, inv Inventory) (RestorePlan, error)
	// Restored says this node holds what the plan needs; it returns once every node does
	// (the barrier before .restore markers).
	Restored(ctx context.Context, inc Incarnation) error
	// Sync reports a committed step and returns the job's decision for it.
	Sync(ctx context.Context, inc Incarnation, rep SyncReport) (SyncDecision, error)
}

// ErrNeedsPeers is returned for a multi-node job when no cluster coordinator is configured.
var ErrNeedsPeers = errors.New("this agent has no peers configured")

// LocalCoordinator coordinates a job of one node.
type LocalCoordinator struct {
	Store BackupStore      // nil: no backups
	Now   func() time.Time // injected clock; nil means time.Now

	mu       sync.Mutex
	inc      string            // GUARDED_BY(mu)
	plan     RestorePlan       // GUARDED_BY(mu)
	schedule BackupSchedule    // GUARDED_BY(mu)
	job      string            // GUARDED_BY(mu); the job of the current incarnation
	lastName map[string]string // GUARDED_BY(mu); newest backup name per job, across incarnations
}

var _ Coordinator = (*LocalCoordinator)(nil)

func (c *LocalCoordinator) now() time.Time {
	if c.Now != nil {
		return c.Now()
	}
	return time.Now()
}

func (c *LocalCoordinator) Negotiate(ctx context.Context, inc Incarnation, inv Inventory) (RestorePlan, error) {
	if inc.Config.Nodes > 1 {
		return RestorePlan{}, fmt.Errorf("nodes: %d: %w (a multi-node job needs the peer service)", inc.Config.Nodes, ErrNeedsPeers)
	}
	plan, err := PlanRestore(ctx, inc.Config, []Inventory{inv}, c.Store)
	if err != nil {
		return plan, err
	}
	// Backup names must stay unique across restarts within one minute: start from the newest
	// name the store already has.
	var newest string
	if c.Store != nil {
		if names, err := c.Store.Backups(ctx, inc.Config.JobName); err == nil && len(names) > 0 {
			newest = names[0]
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.lastName == nil {
		c.lastName = map[string]string{}
	}
	if c.job != "" {
		c.lastName[c.job] = max(c.lastName[c.job], c.schedule.lastName)
	}
	job := inc.Config.JobName
	c.lastName[job] = max(c.lastName[job], newest)
	every, steps := inc.Config.BackupInterval()
	c.inc, c.job, c.plan = inc.ID, job, plan
	c.schedule = BackupSchedule{Every: every, Steps: steps, lastName: c.lastName[job]}
	return plan, nil
}

func (c *LocalCoordinator) Restored(ctx context.Context, inc Incarnation) error { return nil }

func (c *LocalCoordinator) Sync(ctx context.Context, inc Incarnation, rep SyncReport) (SyncDecision, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if inc.ID != c.inc {
		return SyncDecision{}, fmt.Errorf("sync from incarnation %s, coordinating %s", inc.ID, c.inc)
	}
	// restore.version is a one-shot override: gone after the first sync of a new checkpoint.
	if c.plan.Pinned != "" && c.Store != nil && (!c.plan.Found || rep.Step != c.plan.Step) {
		if err := c.Store.ClearRestoreVersion(ctx, inc.Config.JobName); err != nil {
			return SyncDecision{}, fmt.Errorf("delete restore.version: %w", err)
		}
		c.plan.Pinned = ""
	}
	dec := SyncDecision{Replicated: rep.Replicated}
	if c.Store != nil {
		dec.Backup = c.schedule.Due(c.now(), rep.BackupRunning)
	}
	return dec, nil
}

// BackupSchedule decides when a backup is due (SPEC §6): every Every of wall time, the clock
// starting at the first sync, or every Steps synced steps; never while one runs; one per UTC
// minute at most, since the minute names the backup.
type BackupSchedule struct {
	Every time.Duration
	Steps int

	started  bool
	last     time.Time // when the clock last started: first sync or last backup
	synced   int       // steps since the last backup
	lastName string
}

// Due records a sync at now and returns the name of the backup to take, or "".
func (s *BackupSchedule) Due(now time.Time, running bool) string {
	if !s.started {
		s.started, s.last = true, now
	}
	s.synced++
	due := (s.Steps > 0 && s.synced >= s.Steps) || (s.Every > 0 && now.Sub(s.last) >= s.Every)
	name := BackupName(now)
	if !due || running || name == s.lastName {
		return ""
	}
	s.last, s.synced, s.lastName = now, 0, name
	return name
}

// BackupName names a backup taken at t: its UTC minute.
func BackupName(t time.Time) string { return t.UTC().Format("2006-01-02_15-04") }
