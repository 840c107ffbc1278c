package tiers

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"
)

// PeerTransport moves sealed data between the agents of a job (package replication implements
// it over gRPC; cmd wires it). Both calls return only once the data was verified on arrival.
// Calls to different ranks must be able to run at once: a step is pushed to every peer in
// parallel.
type PeerTransport interface {
	// Push sends the sealed data or .meta file at path, named name, to rank's agent.
	Push(ctx context.Context, inc Incarnation, rank int, name, path string) error
	// Fetch copies the data name that rank's agent holds into dir/name. progress, if not nil,
	// is called with the bytes received so far and the total (safe for concurrent calls).
	Fetch(ctx context.Context, inc Incarnation, rank int, name, dir string, progress func(done, total int64)) error
}

// pushAttempts is how often a push to one peer is tried before the step counts as not
// replicated; pushBackoff is the wait before the second attempt, doubled each time.
const (
	pushAttempts = 3
	pushBackoff  = 500 * time.Millisecond
	// peerDownFor is how long a peer whose every attempt failed gets peerDownAttempts per step
	// (two: the first may fail on a connection that broke before the peer came back).
	peerDownFor      = 30 * time.Second
	peerDownAttempts = 2
)

// pushers are the per-peer pushers of the syncer, by rank, made on first use. Only the syncer's
// goroutine uses the map.
type pushers struct {
	*node
	transport PeerTransport // nil: no peers
	early     *earlyPushes
	lines     *jobLines
	byRank    map[int]*pusher
	// superseded reports whether a newer step of the same worker waits for its push already
	// (syncer.superseded): a failed push of such a step is not tried again (nil: never).
	superseded func(sealedStep) bool

	// pushing are the pushes running now, by rank, for status: a long one showed nothing but
	// "latest replicated … none yet" (found by a black-box run over a slow link).
	mu      sync.Mutex
	pushing map[int]PushView // GUARDED_BY(mu)
}

// PushView is a push of a sealed step to a peer, running now (Status.Pushing).
type PushView struct {
	inc     *incarnation
	Step    int64     `json:"step"`
	Rank    int       `json:"to_rank"`
	Started time.Time `json:"started"`
	Attempt int       `json:"attempt"`
}

// running records (attempt > 0) or forgets the push of c to rank.
func (ps *pushers) running(c commit, rank, attempt int, started time.Time) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if attempt == 0 {
		delete(ps.pushing, rank)
		return
	}
	if ps.pushing == nil {
		ps.pushing = map[int]PushView{}
	}
	ps.pushing[rank] = PushView{inc: c.inc, Step: c.step, Rank: rank, Started: started, Attempt: attempt}
}

// status lists the pushes of job's steps running now, by rank.
func (ps *pushers) status(job string) []PushView {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	var out []PushView
	for _, v := range ps.pushing {
		if v.inc.Config.JobName == job {
			out = append(out, v)
		}
	}
	slices.SortFunc(out, func(a, b PushView) int { return a.Rank - b.Rank })
	return out
}

func newPushers(n *node, transport PeerTransport, early *earlyPushes, lines *jobLines) *pushers {
	return &pushers{node: n, transport: transport, early: early, lines: lines, byRank: map[int]*pusher{}}
}

func (ps *pushers) to(rank int) *pusher {
	p := ps.byRank[rank]
	if p == nil {
		p = &pusher{pushers: ps, rank: rank}
		ps.byRank[rank] = p
	}
	return p
}

// pusher pushes sealed steps to one peer and owns what is known of that peer's health: a peer
// whose every attempt failed is "down" for peerDownFor, and gets fewer attempts per step
// meanwhile, so that a lost peer does not hold up every step for minutes. Each push runs on a
// goroutine the syncer starts for it and waits for before the next step: one push to a peer at
// a time.
type pusher struct {
	*pushers
	rank int

	mu        sync.Mutex
	downUntil time.Time // GUARDED_BY(mu)
}

// push pushes this node's data of a sealed step and its .meta to the peer (SPEC §4): the data
// first, so that the .meta never names data the peer lacks; in data-parallel mode only the
// .meta, since column-mates hold equivalent data. A failure is reported to the job, unless this
// is a later try (again: one attempt, since the later tries have their own schedule) of a step it
// was told of. It returns whether the peer acknowledged a verified replica. ctx is the
// incarnation's, or for a later try one that also ends when a newer step comes. dataBytes is the
// size of the data (for the metrics), computed once per step.
func (p *pusher) push(ctx context.Context, s sealedStep, early *earlyGroup, dataBytes func() int64, again bool) bool {
	c := s.commit
	cfg := c.inc.Config
	metaOnly := s.restored && slices.Contains(s.holders, p.rank)
	start := p.now()
	attempts := pushAttempts
	if p.isDown() {
		attempts = peerDownAttempts
	}
	if again {
		attempts = 1
	}
	var err error
	defer p.running(c, p.rank, 0, start)
	for attempt, wait := 1, pushBackoff; ; attempt, wait = attempt+1, wait*2 {
		p.running(c, p.rank, attempt, start)
		err = p.pushStep(ctx, c, s.dataName, s.meta, early, metaOnly)
		if err == nil || attempt >= attempts || ctx.Err() != nil {
			break
		}
		if p.superseded != nil && p.superseded(s) {
			// The newer step is pushed instead, now: tries of this one held it back, and
			// the syncs behind it with it, while a peer whose RAM was full refused them
			// (the syncs free the steps that filled it; a black-box run).
			break
		}
		p.log.Warn("replication failed, retrying", "step", c.step, "to", p.rank, "attempt", attempt, "err", err)
		select {
		case <-time.After(wait):
		case <-ctx.Done():
		}
	}
	if err != nil && ctx.Err() != nil {
		// The incarnation ended (a new replicator.yaml, or the agent stopping), or a newer
		// step superseded a later try: not the peer's failure, and not news for the job.
		return false
	}
	p.setDown(err != nil)
	if err != nil && again {
		p.log.Warn("replication failed again", "step", c.step, "to", p.rank, "err", err)
		return false
	}
	if err != nil && strings.Contains(err.Error(), errSenderLeftBehind) {
		// The receiver took part in a later restore than this node: the job restarted without
		// it. Told once (as superseded, after the grace), not at each save (black-box h63: ten
		// lines in 30 s).
		p.outdated(c.inc, err, p.lines.incs, p.lines)
		p.log.Warn("replication refused: this node was left behind by the job's restart", "step", c.step, "to", p.rank, "err", err)
		return false
	}
	if err != nil && c.inc.isSuperseded() {
		// The job went on without this node, and was told once: each later push's refusal
		// was one more line (black-box h61).
		p.log.Warn("replication failed (this node's incarnation is superseded)", "step", c.step, "to", p.rank, "err", err)
		return false
	}
	if err != nil {
		p.metrics.error(errKindReplication)
		p.lines.incLine(c.inc, fmt.Sprintf("replicating step %d to rank %d failed: %v", c.step, p.rank, err))
		if et, ok := p.early.transportFor(cfg); ok && early != nil {
			p.early.dropOn(et, c.inc, p.rank, c.group)
		}
		return false
	}
	sent := s.dataName
	if cfg.AssumeDataParallelism > 0 {
		sent = s.meta // column-mates hold the data
	}
	took := p.now().Sub(start)
	p.log.Info("replicated", "step", c.step, "data", sent, "to", p.rank, "took", took.String())
	p.metrics.replicated(took.Seconds())
	if cfg.AssumeDataParallelism == 0 && !metaOnly {
		p.metrics.moved("peer", "out", dataBytes())
	}
	return true
}

// pushStep pushes a step's data, then its .meta, to the peer; with metaOnly (the peer holds the
// data already) only the .meta.
func (p *pusher) pushStep(ctx context.Context, c commit, dataName, meta string, early *earlyGroup, metaOnly bool) error {
	if c.inc.Config.AssumeDataParallelism == 0 && !metaOnly {
		var err error
		src := p.spoolDir("sealed", dataName)
		p.yield.wait(ctx, p.yield.limit)
		if et, ok := p.early.transportFor(c.inc.Config); ok && early != nil {
			err = et.PushConsuming(ctx, c.inc.Incarnation, p.rank, dataName, src, c.group, early.ackedBy(p.rank))
		} else {
			err = p.transport.Push(ctx, c.inc.Incarnation, p.rank, dataName, src)
		}
		if err != nil {
			return err
		}
	}
	return p.transport.Push(ctx, c.inc.Incarnation, p.rank, meta, p.spoolDir("meta", meta))
}

func (p *pusher) isDown() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.now().Before(p.downUntil)
}

// setDown records the outcome of a push: down (every attempt failed) or up.
func (p *pusher) setDown(down bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if down {
		p.downUntil = p.now().Add(peerDownFor)
	} else {
		p.downUntil = time.Time{}
	}
}
