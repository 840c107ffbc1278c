package tiers

import (
	"fmt"
	"sync/atomic"
	"time"

	"github.com/mtcfs/mtcfs/layout"
)

// Progress describes a running restore or backup; Done is updated as bytes move.
type Progress struct {
	Kind    string    `json:"kind"` // "restore" or "backup"
	Step    int64     `json:"step"`
	Source  string    `json:"source,omitempty"` // restore: "peer <rank>", "backup <name>"
	Backup  string    `json:"backup,omitempty"` // backup name
	Started time.Time `json:"started"`
	Total   int64     `json:"total_bytes"`
	done    atomic.Int64
	moved   atomic.Int64 // when done last grew (Unix nanoseconds; 0: not yet, Started counts)
}

// Done reports the bytes moved so far.
func (p *Progress) Done() int64 { return p.done.Load() }

// LastMoved is when bytes last moved (Started before any did).
func (p *Progress) LastMoved() time.Time {
	if ns := p.moved.Load(); ns != 0 {
		return time.Unix(0, ns)
	}
	return p.Started
}

// StalledAfter is how long a transfer may move no byte before status and the log say so: a
// peer stopped (SIGSTOP, a frozen VM) mid-transfer showed only a rate falling and "about 6s
// left" (black-box h58). Progress counts whole chunks (4 MiB): 10 s covers a slow link's.
const StalledAfter = 10 * time.Second

// Stalled says how long no byte moved, when that is StalledAfter or more ("": it moves).
func Stalled(lastMoved, now time.Time) string {
	if idle := now.Sub(lastMoved); idle >= StalledAfter {
		return fmt.Sprintf("no byte moved for %s (the source may not answer)", idle.Round(time.Second))
	}
	return ""
}

// update records progress; concurrent callers (parallel streams) may report out of order, so
// done only ever grows.
func (p *Progress) update(done, total int64) {
	for {
		old := p.done.Load()
		if done <= old {
			break
		}
		if p.done.CompareAndSwap(old, done) {
			p.moved.Store(time.Now().UnixNano())
			break
		}
	}
	atomic.StoreInt64(&p.Total, total)
}

// Status is what `mtcfs status` shows about this node.
type Status struct {
	Incarnation string `json:"incarnation,omitempty"`
	Job         string `json:"job,omitempty"`
	Framework   string `json:"framework,omitempty"`
	Rank        int    `json:"rank"`
	Nodes       int    `json:"nodes"`
	Phase       string `json:"phase"` // idle, restoring, running, failed
	// Waiting says what a restore waits for when it waits for the other nodes.
	Waiting   string `json:"waiting,omitempty"`
	Restored  int64  `json:"restored_step"`
	Committed int64  `json:"latest_committed_step"`
	Sealed    int64  `json:"latest_sealed_step"`
	// BackedUp is the newest step whose part this node uploaded to a backup, or restored from
	// one, or restored from RAM while the job's newest complete backup held it (-1: none yet).
	BackedUp int64 `json:"latest_backed_up_step"`
	// InRAMOnly is the newest step this agent sealed that no backup of its holds yet (nil: none,
	// or no backup tier). Only what this agent sealed: a step restored from RAM after an agent
	// restart may be in a backup the agent does not know of (a review).
	InRAMOnly *int64 `json:"newest_step_in_ram_only,omitempty"`
	// Replicated is the newest step the coordinator reported held by every node's peers
	// (-1: none in this incarnation). Losing any one node cannot lose it.
	Replicated int64         `json:"latest_replicated_step"`
	Steps      []StepInRAM   `json:"steps_in_ram"`
	Restore    *ProgressView `json:"restore,omitempty"`
	Backup     *ProgressView `json:"backup,omitempty"`
	// RePush is the newest step's pushes that failed and are tried again later, if any.
	RePush *RePushView `json:"re_push,omitempty"`
	// Syncing is the step whose sync with the coordinator has waited SyncWaitShown or longer,
	// if any: the steps committed after it wait for it (their pushes too).
	Syncing *SyncingView `json:"syncing,omitempty"`
	// Sealing is the committed step whose record or hash failed on a shortage and is being
	// tried again, if any.
	Sealing *SealTryView `json:"sealing_retried,omitempty"`
	// Pushing are the pushes of a sealed step to peers running now, by rank.
	Pushing     []PushView  `json:"pushing,omitempty"`
	LastBackup  string      `json:"last_backup,omitempty"`
	BackupStore string      `json:"backup_store,omitempty"`
	Spool       SpoolStatus `json:"spool"`
	Errors      []string    `json:"recent_errors,omitempty"`
}

// StepInRAM is one .meta held in RAM.
type StepInRAM struct {
	Meta string `json:"meta"`
	Step int64  `json:"step"`
	Rank int    `json:"rank"`
	Data string `json:"data"`
}

// SyncingView is a sync with the coordinator under way (Status.Syncing).
type SyncingView struct {
	Step  int64     `json:"step"`
	Since time.Time `json:"since"`
	// WaitingFor names the ranks the sync waits for, as far as this node can tell ("": not known).
	WaitingFor string `json:"waiting_for,omitempty"`
}

// SyncWaitShown is how long a sync waits before the status shows it: a sync waits for every
// node's report of the step, which takes a moment in a healthy job.
const SyncWaitShown = 5 * time.Second

// RePushView is the step whose pushes to some peers failed and are tried again later (syncer).
type RePushView struct {
	inc    *incarnation
	Step   int64     `json:"step"`
	To     []int     `json:"to_ranks"`
	Failed int       `json:"failed_tries"` // the first one included
	Trying bool      `json:"trying"`       // a try is running now
	Next   time.Time `json:"next_try"`     // when not Trying
}

// SealTryView is a committed step whose record or hash failed on a passing shortage (open
// files, memory, the spool's room) and is tried again until Until. Until it is sealed the step
// is not in RAM for a restore: a job restart waits for the tries, and a step still not sealed
// at Until is lost to it (the job is told).
type SealTryView struct {
	job       string
	Step      int64     `json:"step"`
	Worker    int       `json:"worker"`
	Committed time.Time `json:"committed"`
	// Recorded: the commit record is written, and only the hash failed (the agent's next start
	// seals a record kept at the give-up).
	Recorded bool      `json:"recorded"`
	Tries    int       `json:"failed_tries"` // the first one included
	Err      string    `json:"last_error"`
	Until    time.Time `json:"tried_until"`
}

// ProgressView is a snapshot of a Progress.
type ProgressView struct {
	Kind    string    `json:"kind"`
	Step    int64     `json:"step"`
	Source  string    `json:"source,omitempty"`
	Backup  string    `json:"backup,omitempty"`
	Started time.Time `json:"started"`
	Done    int64     `json:"done_bytes"`
	Total   int64     `json:"total_bytes"`
	// LastMoved is when bytes last moved (Started before any did).
	LastMoved time.Time `json:"last_moved"`
}

// SpoolStatus is the RAM tier's size and use.
type SpoolStatus struct {
	Dir    string `json:"dir"`
	Budget int64  `json:"budget_bytes"`
	Used   int64  `json:"used_bytes"`
}

func (p *Progress) view() *ProgressView {
	if p == nil {
		return nil
	}
	return &ProgressView{Kind: p.Kind, Step: p.Step, Source: p.Source, Backup: p.Backup, Started: p.Started,
		Done: p.Done(), Total: atomic.LoadInt64(&p.Total), LastMoved: p.LastMoved()}
}

// completeStep returns the newest step of cfg's job and rank of which steps (the .meta files
// held) hold every worker's part (-1: none).
func completeStep(steps []StepInRAM, cfg *Config) int64 {
	workers := map[int64]map[int]bool{}
	for _, s := range steps {
		m, ok := layout.ParseMarkerName(s.Meta)
		if !ok || m.Job != cfg.JobName || m.Node != cfg.NodeRank || m.Worker >= cfg.WorkersPerNode {
			continue
		}
		if workers[m.Step] == nil {
			workers[m.Step] = map[int]bool{}
		}
		workers[m.Step][m.Worker] = true
	}
	newest := int64(-1)
	for step, w := range workers {
		if len(w) == cfg.WorkersPerNode {
			newest = max(newest, step)
		}
	}
	return newest
}

// Status returns a snapshot for `mtcfs status`. Each stage is read under its own lock, one
// after the other.
func (r *Replicator) Status() Status {
	st := Status{Phase: "idle", Rank: -1, Committed: -1, Replicated: -1}
	current, last := r.incs.both()
	job := "" // the job the steps shown are of: the newest incarnation's
	restored := int64(0)
	if last != nil {
		last.mu.Lock()
		st.Committed, st.Replicated, restored = last.committed, last.replicated, last.restored
		last.mu.Unlock()
		job = last.Config.JobName
	}
	if inc := current; inc != nil {
		st.Incarnation, st.Job, st.Framework = inc.ID, inc.Config.JobName, inc.Config.Framework
		st.Rank, st.Nodes = inc.Config.NodeRank, inc.Config.Nodes
		inc.mu.Lock()
		st.Phase, st.Restored, st.Restore, st.Waiting = inc.phase, inc.restored, inc.restore.view(), inc.waiting
		inc.mu.Unlock()
	}
	// The restored step is sealed data too: before, a node that restored step 20 and had not
	// sealed a step since said sealed -1 beside committed and replicated 20.
	st.Sealed = r.sealer.latest(job)
	sealedHere := st.Sealed
	if restored > 0 { // 0: nothing restored (a restored step 0 is not told apart)
		st.Sealed = max(st.Sealed, restored)
	}
	var backup *Progress
	backup, st.LastBackup, st.BackedUp = r.backups.status(job)
	// A step restored from RAM that no backup holds is in RAM only too (restored from a backup,
	// or from RAM with the newest backup holding it, BackedUp says so): before, status said so
	// before an agent restart and no longer after it.
	inRAM := sealedHere
	if restored > 0 {
		inRAM = max(inRAM, restored)
	}
	if r.cfg.Store != nil && inRAM >= 0 && inRAM > st.BackedUp {
		st.InRAMOnly = &inRAM
	}
	st.Backup = backup.view()
	st.RePush = r.syncer.status(job)
	st.Syncing = r.syncer.syncingView(job)
	st.Sealing = r.sealer.tryingView(job)
	st.Pushing = r.syncer.pushers.status(job)
	st.Errors = r.lines.recentErrors(job)
	st.Steps = r.retention.steps()
	if inc := current; inc != nil {
		// A step every worker of this node committed and sealed counts as committed at once,
		// not once the coordinator's sync took it: syncs go one at a time, and a node whose
		// sync waited for a stopped rank 0 said "latest committed 60" beside step 70 in RAM
		// and being pushed (black-box h58: 4 of 4).
		st.Committed = max(st.Committed, completeStep(st.Steps, inc.Config))
	}
	if r.cfg.Store != nil {
		st.BackupStore = r.cfg.Store.String()
	}
	st.Spool.Dir = r.cfg.Spool.Dir()
	st.Spool.Budget, st.Spool.Used = r.cfg.Spool.Usage()
	return st
}
