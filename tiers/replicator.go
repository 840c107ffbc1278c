package tiers

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/prometheus/client_golang/prometheus"
)

// ReplicatorConfig wires a Replicator.
type ReplicatorConfig struct {
	Spool       *Spool
	Coordinator Coordinator
	Store       BackupStore         // nil: no backup tier
	Peers       PeerTransport       // nil: no replication to peers
	Getenv      func(string) string // for $VAR expansion in replicator.yaml; nil means os.Getenv
	Now         func() time.Time    // nil means time.Now
	Logger      *slog.Logger        // nil means slog.Default()
	// JaxInit, when set, is written to jax-init-info.txt at start so that an unmodified
	// Orbax/MaxText job learns its process id and coordinator (SPEC §1).
	JaxInit *JaxInit
	// DrainTimeout is how long Close lets a running backup finish; 0 means DefaultDrainTimeout,
	// a negative value none (the backup is cut short at once).
	DrainTimeout time.Duration
	// Registerer, when set, gets the replicator's Prometheus metrics (see Metrics).
	Registerer prometheus.Registerer
	// BeforeSeal, when set, is called by the sealer before it touches a recorded commit of
	// step: tests stop it there to take the spool as a kill -9 right after the rename leaves it.
	BeforeSeal func(step int64)
	// CPUIdle returns the cumulative idle time of all CPUs (false: unknown), for pushes to
	// yield to the job's saves on a busy node (yield.go); nil reads /proc/stat. Tests set it.
	CPUIdle func() (time.Duration, bool)
	// RestoreWait is how long after its handshake an Orbax job still waits for its restore
	// markers (SPEC §9: 300 s), with some slack; 0 means DefaultRestoreWait. An agent restarted
	// in that window tells the job at once, and withdraws the line once the wait is over.
	RestoreWait time.Duration
	// KeptSpools lists this machine's orphaned spools and those of the agent's mount directory
	// (Spools.OrphanedOrOf), so that a restore that finds less
	// than a kept spool of the job holds, where no agent serves it, says so; nil: none looked at.
	KeptSpools func() ([]SpoolInfo, error)
	// CheckJob, when set, refuses (in replicator.failed) a valid job this agent cannot serve
	// from how it was started: a file:// backup location whose directory for the job holds the
	// mount (its backups would go into the agent's own RAM).
	CheckJob func(cfg *Config) error
	// WarnJob, when set, returns a line the job gets in replicator.errors at each handshake
	// ("": none): a file:// backup location the agent may not write to, or that does not
	// exist, which only its start's log told of (black-box h57: the job saved for 10 minutes
	// with every backup bound to fail, told nothing).
	WarnJob func(cfg *Config) string
	// YAMLHeldWait is how long a replicator.yaml held open for writing after a close of it waits
	// before it is answered as it is (0: 30 s).
	YAMLHeldWait time.Duration
}

// DefaultRestoreWait is ReplicatorConfig.RestoreWait's default: the Orbax client's 300 s,
// plus 30 s for its polling and the time its handshake took.
const DefaultRestoreWait = 330 * time.Second

// JaxInit is the content of jax-init-info.txt.
type JaxInit struct {
	Rank        int
	Coordinator string // host:port
}

// Replicator is the checkpoint brain of one node: it answers the job's replicator.yaml,
// seals committed steps into content-addressed data, replicates them to peers, restores, and
// backs up. It receives the job's actions as Events from package fs and changes the namespace
// through Namespace.
//
// It is a pipeline of stages, each owning its state and its lock, wired in NewReplicator:
//
//	retention  (retention.go)    what this node holds in RAM (.meta files and data), and what
//	                             it may free; the other stages publish data through it
//	recorder   (commit.go)       records a commit in the spool before the job's rename returns
//	sealer     (seal.go)         turns a recorded commit into <hash>.data and its .meta
//	syncer     (sync.go)         pushes a sealed step to the peers, to all at once, through one
//	           (push.go)         pusher per peer; then syncs it with the coordinator
//	backups    (backup.go)       takes the coordinator's backup orders
//	handshake  (handshake.go)    answers replicator.yaml: ends the incarnation and starts the
//	           (incarnation.go)  next one and its restore (restore.go), which starts its backup
//	                             loop and queues the restored step to the syncer
//	inbox      (inbox.go)        publishes the replicas peers push
//
// and beside them the early pushes (early.go: files sent to the peers while the job still
// writes their step), the lines reported to the job (joblines.go) and adoption of what a
// previous agent left in the spool (adopt.go, at Start).
//
// Goroutines, all started with node.tasks.Go and waited for by Close:
//   - the control loop (run): handles the job's events in order and runs handshakes; it ends
//     once Close closed the event queue and it handled what was queued, and then closes the
//     sealer's queue and the hasher's channel;
//   - the sealer: seals recorded commits one by one (never on the control loop, so that a new
//     replicator.yaml is answered within a second even while a large step is hashed); it uses
//     no cancellable context, drains its queue and then closes the syncer's;
//   - the syncer: replicates and syncs sealed steps in order (a slow peer delays the sync of
//     later steps, not their sealing); for each step it runs one push per peer, each on its
//     own goroutine, and waits for all of them; it drains its queue, and pushes end with their
//     incarnation;
//   - the hasher, hashing files as the job closes them, and earlyWorkers early pushers sending
//     them to the peers before their step commits; each ends when its channel closes;
//   - per incarnation, a restore goroutine and, once the incarnation negotiated, a backup loop;
//     both end with the incarnation's context (the next handshake, or Close). Close lets a
//     running backup finish for DrainTimeout first.
//
// The inbox's replica holds are timers, stopped by Close; so is the syncer's timer of a later
// try of failed pushes (stopped when its goroutine ends), and a later try's watcher of newer
// steps is a goroutine the try waits for.
//
// LOCK ORDERING: retention.publishMu before jobLines.writeMu; retention.publishMu before
// inbox.mu before retention.mu. Every other mutex is a leaf: nothing else is locked while it is
// held. No lock but publishMu and writeMu is held across a Namespace, BackupStore,
// PeerTransport or Coordinator call.
type Replicator struct {
	cfg    ReplicatorConfig
	node   *node
	queue  *fifo[event] // the job's events, to the control loop; open from NewReplicator on
	closed atomic.Bool  // Close ran (the agent calls it on its stop, and again deferred)

	incs      *incarnations
	lines     *jobLines
	retention *retention
	handshake *handshake
	recorder  *commitRecorder
	sealer    *sealer
	early     *earlyPushes
	syncer    *syncer
	backups   *backupRunner
	inbox     *inbox

	cancel context.CancelFunc // ends node.ctx; nil before Start
	// interrupted, from Start until the job saves or restarts: the incarnation of an Orbax
	// job the agent before this one answered (tellInterrupted). Set by Start before the
	// control loop runs; only the control loop uses it afterwards.
	interrupted *interruptedJob
}

// node is what every stage shares. ns and ctx are set by Start before it starts any goroutine,
// and before any handshake: no stage uses them earlier (an event that arrives before Start only
// waits in the queue, and a commit needs an incarnation). Nothing in node changes after that.
type node struct {
	ns      Namespace
	spool   *Spool
	now     func() time.Time
	log     *slog.Logger
	metrics *Metrics // nil: none
	// digests caches the digests of files hashed as the job closed them; sealing, adoption and
	// the peer transport reuse them. It is safe for concurrent use.
	digests *layout.DigestCache
	// ctx is the agent's life (Start's context): cancelled by Close once the running backup had
	// its drain time. Sealing never uses it.
	ctx context.Context
	// tasks counts every goroutine of the replicator, for Close.
	tasks sync.WaitGroup
	// yield holds pushes back while the job saves on a busy node (yield.go).
	yield *yielder
	// waits says when a restore waiting for the other nodes tells of it (waitnotice.go).
	waits *waitNotices
	// supersededAfter is supersededAfter, or (tests) what is set here.
	supersededWait atomic.Int64
	// fds are spare descriptors for the agent's own records (fdreserve.go).
	fds *fdReserve
	// hashFault, a test's (export_test.go, set before Start), may fail the hashing of a
	// commit's record, in sealing and in adoption alike.
	hashFault func(step int64) error
}

// hashCommit is hashRecord of the record at dir of step, as sealing and adoption do it.
func (n *node) hashCommit(ctx context.Context, dir string, step int64) (string, error) {
	if n.hashFault != nil {
		if err := n.hashFault(step); err != nil {
			return "", err
		}
	}
	return hashRecord(ctx, dir, n.digests)
}

// withRoom runs write, and again after some of the spool's headroom was freed for it while it
// fails for lack of room (see HeadroomSize): the agent's records must not fail because the job
// filled its budget. The headroom is first taken back if there is room for it.
func (n *node) withRoom(write func() error) error { return n.withRoomWith(write, n.fds.retry) }

// withRoomWith is withRoom with the descriptor reserve's retry or tryRetry (on a FUSE request).
func (n *node) withRoomWith(write func() error, retry func(func() error) error) error {
	n.spool.FillHeadroom()
	err := retry(write)
	for used := false; n.spool.UseHeadroom(err); used = true {
		if !used {
			n.log.Warn("the spool is full: the agent's records use its headroom", "err", err)
		}
		err = retry(write)
	}
	return err
}

// writeFile writes one of the agent's own files (a .meta, a status line, a marker) into the
// namespace, in the spool's headroom if the job's writes used up the budget: each such write
// needs a page, and one without the headroom failed the agent's start, its restore, or the line
// telling the job why (found by black-box runs, one call site at a time).
func (n *node) writeFile(name string, data []byte) error {
	return n.withRoom(func() error { return n.ns.WriteFile(name, data) })
}

// spoolDir is a path in the spool.
func (n *node) spoolDir(parts ...string) string {
	return filepath.Join(append([]string{n.spool.Dir()}, parts...)...)
}

// hasName reports whether the namespace holds the top-level name.
func (n *node) hasName(name string) bool {
	_, _, err := n.ns.Owner(name) // one lookup, not a listing of the top
	return err == nil
}

// NewReplicator makes a replicator; pass it to fs.Mount as the Events, then call Start. It wires
// the stages: each gets the stages it hands work to or asks, nothing more.
func NewReplicator(cfg ReplicatorConfig) *Replicator {
	if cfg.Getenv == nil {
		cfg.Getenv = os.Getenv
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	n := &node{spool: cfg.Spool, now: cfg.Now, log: cfg.Logger, digests: &layout.DigestCache{}, yield: newYielder(cfg.CPUIdle),
		waits: newWaitNotices(), fds: &fdReserve{}}
	r := &Replicator{cfg: cfg, node: n, queue: newFIFO[event]()}
	if cfg.Registerer != nil {
		n.metrics = NewMetrics(cfg.Registerer, r)
	}

	// The queues between the stages: pushing never blocks (a FUSE request may push).
	sealQ := newFIFO[pendingCommit]() // recorded commits, to the sealer
	syncQ := newFIFO[sealedStep]()    // sealed or restored steps, to the syncer

	// State the stages share: the job's incarnations, the lines reported to it, and what this
	// node holds in RAM (retention).
	r.incs = &incarnations{}
	if run := cfg.Spool.Owner().Running; run != nil && run.Incarnation != "" {
		// The previous agent's on this spool: a call of it held by a stalled link may still
		// reach the coordinator.
		r.incs.given = []string{run.Incarnation}
	}
	r.lines = &jobLines{node: n, incs: r.incs}
	r.retention = newRetention(n, r.incs)

	// A step's way: committed (recorded before the job's rename returns), sealed, pushed to the
	// peers and synced with the coordinator, which then orders its backup.
	r.recorder = newCommitRecorder(n, r.incs, sealQ, r.lines)
	r.sealer = &sealer{node: n, in: sealQ, out: syncQ, beforeSeal: cfg.BeforeSeal, recorder: r.recorder, retention: r.retention, incs: r.incs,
		lines: r.lines, lastSealed: -1}
	r.sealer.retryFor.Store(int64(sealRetryFor))
	r.early = newEarlyPushes(n, cfg.Peers, r.incs)
	r.syncer = &syncer{node: n, in: syncQ, coord: cfg.Coordinator, incs: r.incs, retention: r.retention, lines: r.lines,
		pushers: newPushers(n, cfg.Peers, r.early, r.lines)}
	r.syncer.pushers.superseded = r.syncer.superseded
	r.syncer.rePushFirst.Store(int64(rePushFirst))
	r.syncer.rePushMax.Store(int64(rePushMax))
	r.backups = newBackupRunner(n, cfg.Store, cfg.Coordinator, r.retention, r.lines, cfg.DrainTimeout)
	r.sealer.backups = r.backups

	// The start of each incarnation: the handshake answers replicator.yaml and starts the
	// restore, which waits until what was committed before is sealed, restores, starts the
	// incarnation's backup loop and queues the restored step to the syncer.
	r.handshake = &handshake{node: n, getenv: cfg.Getenv, incs: r.incs, lines: r.lines, checkJob: cfg.CheckJob, warnJob: cfg.WarnJob,
		recheck: func() { r.queue.push(event{kind: evYAMLHeld, path: layout.ReplicatorYAMLName}) }, heldWait: cfg.YAMLHeldWait,
		recorder: r.recorder, restorer: &restorer{node: n, coord: cfg.Coordinator, store: cfg.Store, peers: cfg.Peers,
			incs: r.incs, lines: r.lines, retention: r.retention, recorder: r.recorder, backups: r.backups, synced: syncQ,
			keptSpools: cfg.KeptSpools, sealer: r.sealer}}

	// Replicas from peers land in the inbox.
	r.inbox = newInbox(n, r.retention)
	return r
}

// Start adopts committed data a previous agent left in the spool, writes jax-init-info.txt,
// and starts the stages' goroutines. ctx bounds the replicator's life.
func (r *Replicator) Start(ctx context.Context, ns Namespace) (err error) {
	n := r.node
	n.ns = ns
	if o, ok := ns.(AgentFilesOwner); ok {
		if run := n.spool.Owner().Running; run != nil {
			o.OwnAgentFiles(run.UID, run.GID) // the last job's user, until its next handshake
		}
	}
	n.ctx, r.cancel = context.WithCancel(ctx)
	n.fds.fill()
	defer func() {
		if err != nil {
			n.fds.close()
		}
	}()
	// The job is told at its first save (tellInterrupted), which the control loop sees once
	// adoption is over. A replicator.yaml already there (one the job wrote while no agent was
	// mounted, or right now) means the job is restarting: it needs no telling. Only an Orbax
	// job reads replicator.failed at each save; NeMo and pytorch jobs read it at their start
	// only, so a line for them would stay and abort their restart (a local rank other than 0
	// reads it before rank 0 wrote the yaml): they are only warned of in the log.
	if o := n.spool.Owner(); o.Running != nil && o.Job != "" && !n.hasName(layout.ReplicatorYAMLName) {
		told := " (an Orbax job is told in replicator.failed at its next save)"
		if f := o.Running.Framework; f != FrameworkOrbax && f != "" {
			told = " (a " + o.Running.Framework + " job reads replicator.failed at its start only: it is not told)"
		}
		n.log.Warn("the agent before this one stopped after it answered a job: if that job still runs, it must restart"+told,
			"job", o.Job, "framework", o.Running.Framework, "incarnation", o.Running.Incarnation, "rank", o.Running.Rank, "since", o.Running.Since)
		if o.Running.Framework == FrameworkOrbax {
			p := &interruptedJob{job: o.Job, run: *o.Running}
			if until := o.Running.Since.Add(r.restoreWait()); o.Running.TracksRestore && n.now().Before(until) {
				r.tellRestoreInterrupted(p, until, o.Running.Restored)
			}
			// Also armed in the restore window: a job that took its marker just before the
			// agent stopped (the record not written yet) may save after the line is withdrawn.
			r.interrupted = p
		}
	}
	if err := r.recorder.adoptRecords(r.incs.startupError); err != nil {
		return err
	}
	if err := r.retention.adopt(n.ctx, r.incs.startupError); err != nil {
		return err
	}
	n.spool.RemoveTrash()
	if total, used := n.spool.Usage(); !n.spool.KernelEnforced() && used > total {
		// As root such a spool is refused at start (OpenSpool); without root the agent serves
		// it, and the job can restore it, but not save (found by a black-box run).
		n.log.Warn("the kept spool holds more than the memory budget: the job can restore from it, but its saves fail with ENOSPC; restart the agent with a larger --memory, or free the spool (mtcfs spool free) and restore from a peer or a backup",
			"holds", FormatSize(used), "memory", FormatSize(total))
	}
	if j := r.cfg.JaxInit; j != nil {
		content := []byte(strings.Join([]string{itoa(int64(j.Rank)), j.Coordinator, ""}, "\n"))
		if err := n.writeFile(layout.JaxInitInfoName, content); err != nil {
			return err
		}
	}
	n.tasks.Go(r.run)
	n.tasks.Go(r.sealer.run)
	n.tasks.Go(r.syncer.run)
	n.tasks.Go(r.early.runHasher)
	for range earlyWorkers {
		n.tasks.Go(r.early.runPusher)
	}
	return nil
}

// interruptedJob is the incarnation the agent before this one answered on the spool.
type interruptedJob struct {
	job string
	run Running
}

// tellInterrupted tells a job that still runs that this agent does not checkpoint its saves:
// the agent before it on this spool was stopped (an upgrade, a crash) after it answered
// incarnation run of the job, and an incarnation lives in one agent's memory. It is called at
// the job's first save through the mount without an incarnation (jobActivity): the job checks
// replicator.failed at each save (Orbax), aborts at its next one and restarts, restoring its
// newest checkpoint. Written at the agent's start instead, the line sat in the mount of a job
// that had ended, for the next job's processes to read before its handshake removed it (a
// NeMo local rank other than 0 checks it once the yaml is absent, maybe before rank 0 wrote
// it). Before, a job still running went on saving, every save "succeeded", and none was
// checkpointed (found by a black-box rolling upgrade).
func (r *Replicator) tellInterrupted(p *interruptedJob) {
	r.node.log.Warn("the job writes here without a replicator.yaml since the agent restarted: told to restart in replicator.failed",
		"job", p.job, "incarnation", p.run.Incarnation)
	r.lines.failLine(p.config(), restartNotice+p.while("was running")+
		" an agent restart ends the incarnation, and the steps saved since the agent stopped are not checkpointed; restart the job (it restores its newest checkpoint)")
}

// restartNotice starts the lines that tell a job its agent restarted under it.
const restartNotice = "the mtcfs agent of this node was restarted "

// config is the job as its lines name it.
func (p *interruptedJob) config() *Config {
	return &Config{JobName: p.job, NodeRank: p.run.Rank, Nodes: p.run.Nodes}
}

// while names the incarnation in a restart notice, and what it did (which tells the two
// notices apart: the restore window's line is withdrawn by that text).
func (p *interruptedJob) while(did string) string {
	return fmt.Sprintf("while incarnation %s (since %s) %s:", p.run.Incarnation, p.run.Since.Format(time.RFC3339), did)
}

// tellRestoreInterrupted tells an Orbax job whose restore markers the agent before this one
// had not published yet that none will come: the job polls replicator.failed while it waits
// for them (SPEC §9), and would otherwise time out after 300 s. So too when they were published
// (published: the record says so) but the agent stopped before the job saw them: they went with
// its mount (a black-box run: the job waited its 300 s); a job that took them is told the same
// at its next save in any case (tellInterrupted), which reads this line. The job may have ended
// as well (the restart of a whole node, say): the line is withdrawn at until, when the job's
// wait is over anyway, so that it does not stay for the next job to read (a NeMo local rank
// other than 0 reads it before its rank 0 writes the yaml; an Orbax job's handshake removes it).
func (r *Replicator) tellRestoreInterrupted(p *interruptedJob, until time.Time, published bool) {
	n := r.node
	// ours tells this line from tellInterrupted's for the same incarnation, which withdraw
	// must leave.
	ours := p.while("waited for its restore")
	what := " an agent restart ends the incarnation, and its restore markers will not come; restart the job (it restores its newest checkpoint)"
	if published {
		ours = p.while("had its restore markers published")
		what = " an agent restart ends the incarnation, and its markers went with the agent's mount: a job that had not seen them waits in vain, one that had fails at its next save; restart the job (it restores its newest checkpoint)"
	}
	n.log.Warn("the job may wait for its restore markers: the agent restarted in the restore window; told to restart in replicator.failed",
		"job", p.job, "incarnation", p.run.Incarnation, "markers_published", published, "withdrawn_at", until)
	r.lines.failLine(p.config(), restartNotice+ours+what)
	n.tasks.Go(func() {
		t := time.NewTimer(until.Sub(n.now()))
		defer t.Stop()
		select {
		case <-n.ctx.Done():
			return
		case <-t.C:
		}
		if r.lines.withdraw(layout.ReplicatorFailedName, ours) {
			n.log.Info("no job read the restart notice while it could wait for its restore: withdrawn", "incarnation", p.run.Incarnation)
		}
	})
}

func (r *Replicator) restoreWait() time.Duration {
	if r.cfg.RestoreWait > 0 {
		return r.cfg.RestoreWait
	}
	return DefaultRestoreWait
}

// jobActivity reports whether ev is an Orbax save going on: a write in or to a step directory
// (S.orbax-checkpoint-tmp or S). Other names (a launcher's logs, say) say nothing of the job.
func jobActivity(ev event) bool {
	top, _, _ := strings.Cut(ev.path, "/")
	if step, ok := strings.CutSuffix(top, layout.OrbaxTmpSuffix); ok {
		top = step
	}
	return top != "" && strings.Trim(top, "0123456789") == ""
}

// Close stops the replicator's goroutines: a running backup gets DrainTimeout to finish (then it
// is cut short, and left incomplete: its .meta, uploaded last, is missing); running restores
// and pushes are cancelled; steps already committed are sealed first.
func (r *Replicator) Close() {
	if r.cancel == nil || !r.closed.CompareAndSwap(false, true) {
		return // a second call logged the stop's warnings twice (an operator's black-box run)
	}
	r.queue.close()  // the control loop ends once it handled what was queued
	r.backups.stop() // no new backup starts; the running one gets the drain time
	if st := r.Status(); st.InRAMOnly != nil {
		// A stop before the backup interval left the newest step in RAM only, and the stop said
		// only "spool kept" (found by a black-box run).
		r.node.log.Warn("stopping with the newest step in no backup yet: it lives in RAM only (this node's kept spool, and its peers') until the job runs again and a backup takes it",
			"job", st.Job, "step", *st.InRAMOnly, "backed_up", st.BackedUp)
	}
	r.cancel()           // incarnations, restores, pushes and backups end; sealing does not
	r.node.tasks.Wait()  // the control loop closes the sealer's queue: what was committed is sealed
	r.inbox.stopTimers() // replica holds no longer matter
	r.node.fds.close()
}

// Events (called on FUSE request goroutines: record and return; a commit is recorded in the
// spool before returning).

func (r *Replicator) Opened(writing bool) { r.node.yield.opened(writing) }

// TellAtHandshake gives the job's next replicator.yaml a line in replicator.errors: something the
// agent found at its start.
func (r *Replicator) TellAtHandshake(line string) { r.incs.startupError(line) }

// YieldToSaves returns once a push stream from a peer may be received: at once, unless this
// node's job is saving while its CPUs are contended (see yield.go); at most 10 s later. It
// reports whether it held the stream at all.
func (r *Replicator) YieldToSaves(ctx context.Context) bool {
	return r.node.yield.wait(ctx, r.node.yield.receiveLimit) > 0
}

func (r *Replicator) Closed(path string) {
	r.node.yield.closed()
	r.queue.push(event{kind: evClosed, path: path})
}
func (r *Replicator) Renamed(oldPath, newPath string, typ layout.EntryType) {
	ev := event{kind: evRenamed, path: newPath, old: oldPath, typ: typ}
	r.recorder.record(ev)
	r.queue.push(ev)
}
func (r *Replicator) TooLarge(path string) { r.queue.push(event{kind: evTooLarge, path: path}) }
func (r *Replicator) Created(path string, typ layout.EntryType) {
	r.queue.push(event{kind: evCreated, path: path, typ: typ})
}
func (r *Replicator) Flushed(path string) {
	r.recorder.record(event{kind: evClosed, path: path, fresh: true})
}
func (r *Replicator) Abandoned(path, why string) {
	r.node.yield.closed()
	r.queue.push(event{kind: evAbandoned, path: path, why: why})
}

// Unread takes back lines of a report file (replicator.errors, replicator.failed) the job
// removed without having read them: they are written again (fs.UnreadLines).
func (r *Replicator) Unread(name string, lines []string) { r.lines.giveBack(name, lines) }

var _ Events = (*Replicator)(nil)

// AcceptReplica takes data or a .meta a peer pushed, already verified by the transport, and
// publishes it in the spool and the namespace (SPEC §4: a replica appears only once verified).
// path is moved, not copied.
func (r *Replicator) AcceptReplica(ctx context.Context, job string, rank int, name, path string) error {
	return r.inbox.accept(job, rank, name, path)
}

// AdmitReplica says why this node takes no replica of job from rank now (nil: it takes it).
// It takes replicas only while it serves an incarnation of job: an agent whose job has not
// written replicator.yaml since the agent started is outside the running job, and a replica
// acknowledged there counted as replicated while no restore of the job would ever ask it (a
// black-box run: a replaced machine's old agent, still named by a static --peers, took rank 0's
// replicas, and the step "replicated on every node" was lost with rank 0's RAM).
//
// generation is the restore generation the sender's incarnation took part in (0: none
// recorded): an incarnation here that took part in another one is of the job's timeline as it
// was at an earlier start, not of the running job (the old agent never restarted, its job's
// processes gone; a review).
func (r *Replicator) AdmitReplica(job string, rank int, generation int64) error {
	inc := r.incs.get()
	switch {
	case inc == nil:
		return fmt.Errorf("the agent at this address serves no job: its job has not written replicator.yaml since it started (a machine replaced, whose peers' --peers still name this address? a replica here would be outside the job)")
	case inc.Config.JobName != job:
		return fmt.Errorf("the agent at this address serves job %s, not %s", inc.Config.JobName, job)
	}
	if own := r.RestoreGeneration(job, inc.ID); generation > 0 && own > 0 && generation < own {
		// The sender is the one left behind: the message blamed this agent's address and
		// --peers (black-box h63).
		return fmt.Errorf("%s: rank %d took part in restore %d of job %s, the agent at this address in restore %d, a later one: the job restarted without rank %d's node, whose saves are no longer replicated (restart the job there)", errSenderLeftBehind, rank, generation, job, own, rank)
	} else if generation > 0 && own > 0 && generation != own {
		return fmt.Errorf("the agent at this address took part in restore %d of job %s, rank %d in restore %d: it is not a node of the running job (a machine replaced, whose peers' --peers still name this address? its job's processes may be gone while it runs)", own, job, rank, generation)
	}
	return nil
}

// RestoreGeneration is the generation of the restore that incarnation inc of job took part in
// (0: none recorded for it: its restore has not recorded one yet, or failed, or was of a
// coordinator that numbers none).
func (r *Replicator) RestoreGeneration(job, inc string) int64 {
	return r.node.spool.RestoreGeneration(job, inc)
}

// RefusedForRoom is told when this node refused a peer's replica for lack of room: the job's own
// saves then fail with ENOSPC too, while the steps its RAM holds wait for that replica. Only the
// peer's job was told; this node's job got bare ENOSPC for ever (found by a black-box run).
func (r *Replicator) RefusedForRoom() {
	if inc := r.incs.get(); inc != nil {
		r.retention.warnIfFillingBecause(r.lines, inc, true, "a peer's replica was refused for lack of room on this node: ")
	}
}

// SealedPath is where this node holds the data name, for peers that fetch it.
func (r *Replicator) SealedPath(name string) (string, error) { return r.retention.sealedPath(name) }

// DropCorrupt drops data this node holds that failed its check when a peer asked for it (a bit
// flipped in RAM, a write behind the agent's back): it is neither served nor restored again,
// the job is told, and the next restore plans without it (before, every restart planned a
// fetch of it, which failed, and the restore with it).
func (r *Replicator) DropCorrupt(dataName string, why error) {
	if !layout.IsDataName(dataName) || !r.retention.dropUnheld(dataName) {
		return // gone already (each stream of a fetch tells), or in use: the next ask drops it
	}
	r.node.metrics.error(errKindVerify)
	msg := fmt.Sprintf("the copy of %s in this node's RAM fails its check (%v): dropped; a peer that asked for it restores from another copy", dataName, why)
	if inc := r.incs.get(); inc != nil {
		r.lines.errLine(inc.Config, msg)
		return
	}
	r.node.log.Error(msg)
}

// Digests is the cache of file digests computed when files were closed; the peer transport
// reuses them instead of reading the data again.
func (r *Replicator) Digests() *layout.DigestCache { return r.node.digests }

// run is the control loop: it handles the job's events in order.
func (r *Replicator) run() {
	defer r.sealer.in.close()
	defer r.early.closeHasher()
	for {
		ev, ok := r.queue.pop()
		if !ok {
			return
		}
		r.handle(ev)
	}
}

// handle dispatches one event from the job.
func (r *Replicator) handle(ev event) {
	// Before any incarnation: a yaml disarms the notice (the job restarts, and no incarnation
	// begins before its handshake), a save fires it.
	if p := r.interrupted; p != nil {
		switch {
		case strings.HasPrefix(ev.path, layout.ReplicatorYAMLName):
			r.interrupted = nil
		case jobActivity(ev):
			r.interrupted = nil
			r.tellInterrupted(p)
		}
	}
	if dir, base := path.Split(ev.path); dir != "" && base == layout.ReplicatorYAMLName && (ev.kind == evClosed || ev.kind == evRenamed) && !isStepTree(ev.path) {
		r.answerMisplaced(strings.TrimSuffix(dir, "/"))
		return
	}
	if strings.Contains(ev.path, "/") {
		// Only top-level names carry meaning; a file closed inside a step being saved is
		// hashed now, while the job writes the rest (and pushed to peers). Writers that close
		// a temporary name and rename it (tensorstore) are caught at the rename.
		if ev.kind == evClosed || (ev.kind == evRenamed && ev.typ == layout.EntryFile) {
			r.early.closed(ev.path)
			top, _, _ := strings.Cut(ev.path, "/")
			r.recorder.noteWrittenIn(top)
		}
		return
	}
	isYAML := ev.path == layout.ReplicatorYAMLName
	switch {
	case ev.kind == evTooLarge && (isYAML || ev.path == layout.ReplicatorYAMLTmpName):
		r.node.ns.Remove(ev.path)
		r.lines.failLine(nil, fmt.Sprintf("%s: larger than %d bytes; discarded", layout.ReplicatorYAMLName, MaxConfigSize))
	case isYAML && (ev.kind == evRenamed || ev.kind == evCreated) && ev.typ != layout.EntryFile:
		// A directory or symlink would otherwise sit there forever while the job waits for the
		// file to be consumed.
		r.node.ns.Remove(ev.path)
		r.lines.failLine(nil, fmt.Sprintf("%s: is a %v; write it as a regular file (a symlink is not followed); removed", layout.ReplicatorYAMLName, ev.typ))
	case isYAML && (ev.kind == evClosed || ev.kind == evRenamed || ev.kind == evCreated):
		r.handshake.answer(false)
	case isYAML && ev.kind == evYAMLHeld:
		r.handshake.answer(true)
	case ev.kind == evClosed || ev.kind == evCreated:
		r.recorder.record(ev) // pytorch .save: normally recorded at its flush already
		r.recorder.noteMisnamed(ev)
	case ev.kind == evRenamed:
		r.recorder.noteMisnamed(ev) // recorded on the rename's request already
	case ev.kind == evAbandoned:
		// A torch.save cut short by a kill -9 was committed, sealed, backed up and restored as
		// the newest step, which the job then could not load (found by a black-box run).
		r.node.log.Warn("a .save cut short is not a commit", "name", ev.path, "why", ev.why)
		if inc := r.incs.get(); inc != nil {
			r.lines.incLine(inc, fmt.Sprintf("%s: %s; not committed (it is cut short)", ev.path, ev.why))
		}
	}
}

// isStepTree reports whether p lies in a tree the job saves as a checkpoint (a step, its
// temporary directory, a NeMo step=, a .save): a file named replicator.yaml there is data.
func isStepTree(p string) bool {
	top, _, _ := strings.Cut(p, "/")
	if _, err := strconv.ParseInt(top, 10, 64); err == nil {
		return true
	}
	return strings.HasSuffix(top, ".orbax-checkpoint-tmp") || strings.HasPrefix(top, "step=") || strings.HasSuffix(top, ".save") ||
		layout.IsDataName(top) || strings.Contains(top, ".tmp")
}

// answerMisplaced answers a replicator.yaml the job wrote into dir, a directory of the mount,
// with a replicator.failed there saying where it belongs (MisplacedYAML).
func (r *Replicator) answerMisplaced(dir string) {
	msg := fmt.Sprintf("%s was written into %s/, a directory of the mtcfs mount, not its root: the agent answers only the replicator.yaml at the root of the directory it mounts, and steps saved in %s/ are not checkpoints; set CHECKPOINT_DIR to the mount point itself",
		layout.ReplicatorYAMLName, dir, dir)
	r.node.log.Error("a replicator.yaml written into a directory of the mount, not its root, is refused", "dir", dir)
	m, ok := r.node.ns.(MisplacedYAML)
	if !ok {
		return
	}
	line := fmt.Sprintf("%s job=? node=?/? FATAL %s\n", r.node.now().UTC().Format("2006-01-02T15:04:05Z"), msg)
	if err := m.AnswerMisplaced(dir, layout.ReplicatorYAMLName, layout.ReplicatorFailedName, []byte(line)); err != nil {
		r.node.log.Warn("cannot answer the replicator.yaml written into a directory of the mount", "dir", dir, "err", err)
	}
}

// outdated is told of an ErrOtherIncarnation answer (err) to a call of inc (noteOutdated).
func (n *node) outdated(inc *incarnation, err error, incs *incarnations, lines *jobLines) {
	if !incs.isCurrent(inc) {
		return
	}
	after := supersededAfter
	if d := n.supersededWait.Load(); d > 0 {
		after = time.Duration(d)
	}
	inc.noteOutdated(err, after, func() bool { return incs.isCurrent(inc) }, func(line string) {
		n.log.Warn(line, "incarnation", inc.ID)
		lines.incLine(inc, line)
	})
}

// errSenderLeftBehind starts the refusal of a replica whose sender's incarnation took part in
// an earlier restore than this node's: the sender recognises it in the error text (it crosses
// the peer transport as text).
const errSenderLeftBehind = "the sending node is not a node of the running job"

func randomID() string {
	var b [8]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// event is one change reported by package fs.
type event struct {
	kind int
	path string
	old  string // a rename's old path
	why  string // for evAbandoned: why the file is cut short
	// filled, of an evCreated step directory: the job wrote a file in it since (noteWrittenIn).
	filled bool
	// fresh, of an evClosed: the close committing a file that no close committed before
	// (Events.Flushed), never a later close of the same .save, even while an earlier commit of
	// the name waits for sealing (a save of the same step again, right after the first).
	fresh bool
	typ   layout.EntryType
}

const (
	evClosed = iota
	evRenamed
	evTooLarge
	evCreated
	evAbandoned
	evYAMLHeld // a replicator.yaml held open for writing since yamlHeldWait: answered as it is
)
