package tiers

import (
	"context"
	"strings"
	"sync"
	"time"

	"github.com/mtcfs/mtcfs/layout"
)

// EarlyTransport is implemented by a PeerTransport that can move a step's files while the job is
// still writing the step (SPEC §4: files start streaming when they are closed, before the step
// commits). The replicator pushes each file the job closes inside a step directory as an early
// file of that directory's top-level name (the group); when the step commits, the sealed data is
// pushed consuming the group, so only what was not pushed early crosses the network after the
// commit. A group whose step is abandoned is dropped on the peers.
type EarlyTransport interface {
	// PushEarly sends the file at path, closed inside group, to rank's agent, which keeps it
	// aside, verified and unpublished. It returns the file's digest once the peer acknowledged.
	PushEarly(ctx context.Context, inc Incarnation, rank int, group, path string) (layout.FileDigest, error)
	// PushConsuming is Push for sealed data whose files were pushed early under group; files
	// whose digest is in acked are not sent again.
	PushConsuming(ctx context.Context, inc Incarnation, rank int, name, path, group string, acked map[layout.FileDigest]bool) error
	// DropEarly discards the early files of group on rank's agent.
	DropEarly(ctx context.Context, inc Incarnation, rank int, group string) error
}

// earlyWorkers is how many early pushes run at once (each one to every peer in turn): enough to
// keep a link busy with the many small files of a checkpoint.
const earlyWorkers = 4

// dropTimeout bounds a DropEarly call; a peer that does not answer drops the group anyway when
// it goes idle or the job restarts.
const dropTimeout = 5 * time.Second

// earlyGroup is what this node pushed early for one top-level directory of the current
// incarnation.
type earlyGroup struct {
	inc       *incarnation
	committed bool           // GUARDED_BY(Replicator.mu); renamed to a step, being sealed
	pending   sync.WaitGroup // early pushes queued or running
	mu        sync.Mutex
	acked     map[int]map[layout.FileDigest]bool // GUARDED_BY(mu); by peer rank
}

// earlyPush is one closed file to push early.
type earlyPush struct {
	g           *earlyGroup
	group, path string // path: the file in the spool
}

// earlyTransport returns the transport's early side when early pushes apply to inc: peers,
// data replicated (not data-parallel), and commits that rename a directory.
func (r *Replicator) earlyTransport(cfg *Config) (EarlyTransport, bool) {
	et, ok := r.cfg.Peers.(EarlyTransport)
	if !ok || len(cfg.Peers()) == 0 || cfg.AssumeDataParallelism > 0 || cfg.Framework == FrameworkPyTorch {
		return nil, false
	}
	return et, true
}

// queueEarly schedules an early push of the file the job closed at path (inside a top-level
// directory), whose bytes are at spoolPath. Called by the prehasher once the file is hashed.
func (r *Replicator) queueEarly(path, spoolPath string) {
	inc := r.current()
	if inc == nil || inc.ctx.Err() != nil {
		return
	}
	if _, ok := r.earlyTransport(inc.Config); !ok {
		return
	}
	group, _, _ := strings.Cut(path, "/")
	if _, committed := layout.ParseStepDir(group); committed || layout.IsDataName(group) {
		return // written into a committed name: that is not a step being saved
	}
	r.mu.Lock()
	if r.inc != inc {
		r.mu.Unlock()
		return
	}
	g := r.early[group]
	if g == nil || g.inc != inc {
		g = &earlyGroup{inc: inc, acked: map[int]map[layout.FileDigest]bool{}}
		r.early[group] = g
	}
	g.pending.Add(1)
	r.mu.Unlock()
	select {
	case r.earlyQ <- earlyPush{g: g, group: group, path: spoolPath}:
	default:
		g.pending.Done() // the queue is full: the file goes with the sealed data
	}
}

// earlyPusher pushes queued files to every peer.
func (r *Replicator) earlyPusher() {
	defer r.wg.Done()
	for p := range r.earlyQ {
		inc := p.g.inc
		if et, ok := r.earlyTransport(inc.Config); ok && inc.ctx.Err() == nil {
			for _, peer := range inc.Config.Peers() {
				d, err := et.PushEarly(inc.ctx, inc.Incarnation, peer, p.group, p.path)
				if err != nil {
					// Not fatal: the file is sent with the sealed data.
					r.log.Debug("early push failed", "group", p.group, "to", peer, "err", err)
					continue
				}
				p.g.mu.Lock()
				if p.g.acked[peer] == nil {
					p.g.acked[peer] = map[layout.FileDigest]bool{}
				}
				p.g.acked[peer][d] = true
				p.g.mu.Unlock()
			}
		}
		p.g.pending.Done()
	}
}

// takeEarly removes and returns the early group a commit renamed from (nil if none), once its
// queued pushes finished, so that the sealed push can count on them. The pushes run on the
// incarnation's context, so they end soon once it is over.
func (r *Replicator) takeEarly(c commit) *earlyGroup {
	if c.group == "" {
		return nil
	}
	r.mu.Lock()
	g := r.early[c.group]
	if g != nil && g.inc == c.inc {
		delete(r.early, c.group)
	} else {
		g = nil
	}
	r.mu.Unlock()
	if g != nil {
		g.pending.Wait()
	}
	return g
}

// ackedBy returns the digests peer acknowledged in g.
func (g *earlyGroup) ackedBy(peer int) map[layout.FileDigest]bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	out := make(map[layout.FileDigest]bool, len(g.acked[peer]))
	for d := range g.acked[peer] {
		out[d] = true
	}
	return out
}

// dropAbandoned drops on the peers the early groups of inc, the current incarnation, whose
// directory the job removed without committing it (an abandoned save). Groups still being
// written, or committed and waiting to be sealed, stay. (A new incarnation starts with no
// groups: the peers drop an earlier one's when they see the new one.)
func (r *Replicator) dropAbandoned(inc *incarnation) {
	et, ok := r.earlyTransport(inc.Config)
	if !ok || r.current() != inc {
		return
	}
	ents, err := r.ns.List()
	if err != nil {
		return
	}
	present := make(map[string]bool, len(ents))
	for _, e := range ents {
		present[e.Name] = true
	}
	abandoned := map[string]*earlyGroup{}
	r.mu.Lock()
	for name, g := range r.early {
		if g.inc == inc && !g.committed && !present[name] {
			abandoned[name] = g
			delete(r.early, name)
		}
	}
	r.mu.Unlock()
	for name, g := range abandoned {
		g.mu.Lock()
		var peers []int
		for peer := range g.acked {
			peers = append(peers, peer)
		}
		g.mu.Unlock()
		for _, peer := range peers {
			if r.dropEarlyOn(et, inc, peer, name) == nil {
				r.log.Info("abandoned step dropped on peer", "group", name, "peer", peer)
			}
		}
	}
}

// dropEarlyOn asks peer to discard the early files of group, bounded by dropTimeout (a peer
// that does not answer drops the group when it goes idle or the job restarts).
func (r *Replicator) dropEarlyOn(et EarlyTransport, inc *incarnation, peer int, group string) error {
	ctx, cancel := context.WithTimeout(inc.ctx, dropTimeout)
	defer cancel()
	err := et.DropEarly(ctx, inc.Incarnation, peer, group)
	if err != nil {
		r.log.Debug("drop early files", "group", group, "on", peer, "err", err)
	}
	return err
}
