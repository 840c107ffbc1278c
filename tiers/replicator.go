package tiers

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
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
}

// JaxInit is the content of jax-init-info.txt.
type JaxInit struct {
	Rank        int
	Coordinator string // host:port
}

// Replicator is the checkpoint brain of one node: it answers the job's replicator.yaml,
// seals committed steps into content-addressed data, restores, and backs up. It receives the
// job's actions as Events from package fs and changes the namespace through Namespace.
//
// Goroutines (all stopped by Close; those that must finish committed work do not use Start's
// context, see each):
//   - the control loop: consumes events in order, runs handshakes;
//   - the sealer: seals committed steps one by one (never on the control loop, so that a new
//     replicator.yaml is answered within a second even while a large step is hashed). Commits
//     are recorded in the spool on the job's own request, before its rename or close returns
//     (recordCommit), and queued for the sealer;
//   - the syncer: pushes each sealed step to the peers and syncs it with the coordinator, in
//     order (a slow peer delays the sync of later steps, not their sealing);
//   - the prehasher, hashing files as the job closes them, and earlyWorkers early pushers
//     sending them to the peers before their step commits;
//   - per incarnation, a restore goroutine (cancelled by the next handshake), and once the
//     incarnation negotiated, a backup loop taking the coordinator's orders (at most one backup
//     runs at a time; Close lets it finish for DrainTimeout).
//
// LOCK ORDERING: publishMu before lineMu before mu. mu is never held across Namespace or
// BackupStore calls.
type Replicator struct {
	cfg ReplicatorConfig
	log *slog.Logger
	ns  Namespace

	// publishMu makes "data appears in spool/sealed and gets its .meta" atomic with respect to
	// retention, which would otherwise free data that has no .meta yet.
	publishMu sync.Mutex
	// lineMu serialises appends to replicator.errors and replicator.failed.
	lineMu sync.Mutex

	queue fifo[event]
	sealQ fifo[pendingCommit] // recorded commits, to the sealer
	syncQ fifo[sealedStep]    // sealed (or restored) steps, to the syncer
	// prehash carries paths of files the job closed after writing; they are hashed in the
	// background so that sealing their step only combines digests.
	prehash chan string
	digests layout.DigestCache

	ctx     context.Context
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	metrics *Metrics // nil: none

	mu      sync.Mutex
	inc     *incarnation      // GUARDED_BY(mu); nil before the first valid handshake
	metas   map[string]string // GUARDED_BY(mu); .meta name → hash, for every .meta held
	pending map[string]bool   // GUARDED_BY(mu); top-level names queued for sealing
	// pendingChanged is closed (and replaced) whenever a name leaves pending.
	pendingChanged chan struct{} // GUARDED_BY(mu)
	// startupErrors say what the agent found broken in the spool a previous agent left (a
	// recorded commit it could not seal, data failing its hash): reported to the job at the next
	// handshake, never dropped silently.
	startupErrors []string // GUARDED_BY(mu)
	// verified holds the data names whose content this agent hashed itself (sealing, adoption,
	// arrival from a peer or a backup) and that the job cannot have changed since (the fs layer
	// makes committed trees immutable): a restore from RAM uses them without hashing them again.
	verified      map[string]bool   // GUARDED_BY(mu)
	inFlight      map[string]int    // GUARDED_BY(mu); data names being sealed or restored
	replicaHolds  map[string]func() // GUARDED_BY(mu); replicated data waiting for its .meta
	backup        *Progress         // GUARDED_BY(mu); the running backup
	backups       sync.WaitGroup    // running backups, for Close to drain
	stopping      bool              // GUARDED_BY(mu); Close began: no new backup starts
	lastBackup    string            // GUARDED_BY(mu)
	restore       *Progress         // GUARDED_BY(mu); the running restore
	recentErrors  []string          // GUARDED_BY(mu)
	lastCommitted int64             // GUARDED_BY(mu); highest complete step of the incarnation
	lastSealed    int64             // GUARDED_BY(mu); highest step sealed by this agent (-1: none)
	lastBackedUp  int64             // GUARDED_BY(mu); highest step whose part this node backed up (-1: none)
	// lastReplicated is the highest step of the incarnation the coordinator reported replicated
	// on every node (-1: none yet).
	lastReplicated int64 // GUARDED_BY(mu)
	// early holds, by top-level name, the files pushed to peers before their step committed.
	early  map[string]*earlyGroup // GUARDED_BY(mu)
	earlyQ chan earlyPush
	// peerDown holds, by rank, until when a peer whose pushes all failed gets fewer attempts per
	// step (peerDownAttempts), so that a lost peer does not hold up every step for minutes.
	peerDown map[int]time.Time // GUARDED_BY(mu)
}

// incarnation is the state of one start of the job.
type incarnation struct {
	Incarnation
	ctx      context.Context
	cancel   context.CancelFunc
	phase    string // "restoring", "running", "failed"
	restored int64  // step restored (0: none)
}

// NewReplicator makes a replicator; pass it to fs.Mount as the Events, then call Start.
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
	r := &Replicator{cfg: cfg, log: cfg.Logger, metas: map[string]string{}, pending: map[string]bool{}, inFlight: map[string]int{}, replicaHolds: map[string]func(){}, lastReplicated: -1,
		early: map[string]*earlyGroup{}, peerDown: map[int]time.Time{}, pendingChanged: make(chan struct{}), verified: map[string]bool{}, lastSealed: -1, lastBackedUp: -1}
	if cfg.Registerer != nil {
		r.metrics = NewMetrics(cfg.Registerer, r)
	}
	r.queue.init()
	r.sealQ.init()
	r.syncQ.init()
	return r
}

// Start adopts committed data a previous agent left in the spool, writes jax-init-info.txt,
// and starts serving events. ctx bounds the replicator's life.
func (r *Replicator) Start(ctx context.Context, ns Namespace) error {
	r.ns = ns
	r.ctx, r.cancel = context.WithCancel(ctx)
	r.prehash = make(chan string, 4096)
	r.earlyQ = make(chan earlyPush, 4096)
	if err := r.adoptCommits(); err != nil {
		return err
	}
	if err := r.adopt(r.ctx); err != nil {
		return err
	}
	if j := r.cfg.JaxInit; j != nil {
		content := []byte(strings.Join([]string{itoa(int64(j.Rank)), j.Coordinator, ""}, "\n"))
		if err := ns.WriteFile(layout.JaxInitInfoName, content); err != nil {
			return err
		}
	}
	r.wg.Add(4 + earlyWorkers)
	go r.controlLoop()
	go r.sealer()
	go r.syncer()
	go r.prehasher()
	for range earlyWorkers {
		go r.earlyPusher()
	}
	return nil
}

// Close stops the replicator's goroutines: a running backup gets DrainTimeout to finish (then it
// is cut short, and left incomplete: its .meta, uploaded last, is missing); running restores
// are cancelled; steps already committed are sealed first.
func (r *Replicator) Close() {
	if r.cancel == nil {
		return
	}
	r.queue.close()
	r.mu.Lock()
	r.stopping = true
	running := r.backup
	r.mu.Unlock()
	if running != nil {
		drain := r.cfg.DrainTimeout
		if drain == 0 {
			drain = DefaultDrainTimeout
		}
		drain = max(drain, 0)
		r.log.Info("stopping: letting the running backup finish", "backup", running.Backup, "step", running.Step, "drain_timeout", drain.String())
		if !r.drainBackups(drain) {
			r.log.Warn("the running backup did not finish within the drain time: cut short, it stays incomplete and the next agent retries it",
				"backup", running.Backup, "step", running.Step, "drain_timeout", drain.String())
		}
	}
	r.cancel()  // restores and backups stop; sealing runs on its own context and finishes
	r.wg.Wait() // the control loop closes sealQ, so the sealer drains what was committed
}

// Events (called on FUSE request goroutines: record and return; a commit is recorded in the
// spool before returning).

func (r *Replicator) Closed(path string) { r.queue.push(event{kind: evClosed, path: path}) }
func (r *Replicator) Renamed(oldPath, newPath string, typ layout.EntryType) {
	ev := event{kind: evRenamed, path: newPath, old: oldPath, typ: typ}
	r.recordCommit(ev)
	r.queue.push(ev)
}
func (r *Replicator) TooLarge(path string) { r.queue.push(event{kind: evTooLarge, path: path}) }
func (r *Replicator) Created(path string, typ layout.EntryType) {
	r.queue.push(event{kind: evCreated, path: path, typ: typ})
}
func (r *Replicator) Flushed(path string) { r.recordCommit(event{kind: evClosed, path: path}) }

var _ Events = (*Replicator)(nil)

func (r *Replicator) controlLoop() {
	defer r.wg.Done()
	defer r.sealQ.close()
	defer close(r.prehash)
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
	if strings.Contains(ev.path, "/") {
		// Only top-level names carry meaning; a file closed inside a step being saved is
		// hashed now, while the job writes the rest (and pushed to peers). Writers that close
		// a temporary name and rename it (tensorstore) are caught at the rename.
		if ev.kind == evClosed || (ev.kind == evRenamed && ev.typ == layout.EntryFile) {
			select {
			case r.prehash <- ev.path:
			default: // the sealer hashes what was not hashed early
			}
		}
		return
	}
	isYAML := ev.path == layout.ReplicatorYAMLName
	switch {
	case ev.kind == evTooLarge && (isYAML || ev.path == layout.ReplicatorYAMLTmpName):
		r.ns.Remove(ev.path)
		r.failLine(nil, fmt.Sprintf("%s: larger than %d bytes; discarded", layout.ReplicatorYAMLName, MaxConfigSize))
	case isYAML && (ev.kind == evRenamed || ev.kind == evCreated) && ev.typ != layout.EntryFile:
		// A directory or symlink would otherwise sit there forever while the job waits for the
		// file to be consumed.
		r.ns.Remove(ev.path)
		r.failLine(nil, fmt.Sprintf("%s: is a %v; write it as a regular file (a symlink is not followed); removed", layout.ReplicatorYAMLName, ev.typ))
	case isYAML && (ev.kind == evClosed || ev.kind == evRenamed || ev.kind == evCreated):
		r.handshake()
	case ev.kind == evClosed || ev.kind == evCreated:
		r.recordCommit(ev) // pytorch .save: normally recorded at its flush already
	}
}

func (r *Replicator) isVerified(dataName string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.verified[dataName]
}

func (r *Replicator) markVerified(dataName string) {
	r.mu.Lock()
	r.verified[dataName] = true
	r.mu.Unlock()
}

// startupError records a problem found in the spool at start, for the next handshake.
func (r *Replicator) startupError(msg string) {
	r.mu.Lock()
	r.startupErrors = append(r.startupErrors, msg)
	r.mu.Unlock()
}

func (r *Replicator) current() *incarnation {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.inc
}

func (r *Replicator) spoolDir(parts ...string) string {
	return filepath.Join(append([]string{r.cfg.Spool.Dir()}, parts...)...)
}

func randomID() string {
	var b [8]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// event is one change reported by package fs.
type event struct {
	kind      int
	path, old string
	typ       layout.EntryType
}

const (
	evClosed = iota
	evRenamed
	evTooLarge
	evCreated
)

// fifo is an unbounded queue: pushing never blocks (a FUSE request, in particular). Items pushed
// after close are dropped.
type fifo[T any] struct {
	mu     sync.Mutex
	items  []T  // GUARDED_BY(mu)
	closed bool // GUARDED_BY(mu)
	signal chan struct{}
}

func (q *fifo[T]) init() { q.signal = make(chan struct{}, 1) }

func (q *fifo[T]) push(v T) {
	q.mu.Lock()
	if !q.closed {
		q.items = append(q.items, v)
	}
	q.mu.Unlock()
	q.wake()
}

func (q *fifo[T]) wake() {
	select {
	case q.signal <- struct{}{}:
	default:
	}
}

func (q *fifo[T]) close() {
	q.mu.Lock()
	q.closed = true
	q.mu.Unlock()
	q.wake()
}

// pop waits for the next item; ok is false once the queue is closed and drained.
func (q *fifo[T]) pop() (T, bool) {
	for {
		q.mu.Lock()
		if len(q.items) > 0 {
			v := q.items[0]
			var zero T
			q.items[0] = zero
			q.items = q.items[1:]
			q.mu.Unlock()
			return v, true
		}
		closed := q.closed
		q.mu.Unlock()
		if closed {
			var zero T
			return zero, false
		}
		<-q.signal
	}
}
