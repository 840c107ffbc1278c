package tiers

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

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

// earlyPushes hashes the files the job closes inside a step directory and pushes them to the
// peers before the step commits. Its goroutines: the hasher (runHasher) ends when the control
// loop closes hashQ, and then closes pushQ, which ends the earlyWorkers pushers (runPusher).
// Pushes run on their incarnation's context. The groups pushed belong to their incarnation
// (incarnation.early).
type earlyPushes struct {
	*node
	transport PeerTransport // nil: no peers
	incs      *incarnations
	// hashQ carries the files the job closed after writing; they are hashed in the background
	// so that sealing their step only combines digests.
	hashQ chan closedFile
	pushQ chan earlyPush // hashed files, to the pushers
}

// closedFile is a file the job closed, to hash and, when g is set, to push early in g (which
// counts it as pending from the moment the control loop saw the close).
type closedFile struct {
	path  string
	g     *earlyGroup
	group string
}

func newEarlyPushes(n *node, transport PeerTransport, incs *incarnations) *earlyPushes {
	return &earlyPushes{node: n, transport: transport, incs: incs, hashQ: make(chan closedFile, 4096), pushQ: make(chan earlyPush, 4096)}
}

// earlyGroup is what this node pushed early for one top-level directory of an incarnation.
type earlyGroup struct {
	inc       *incarnation
	committed bool // GUARDED_BY(inc.mu); renamed to a step, being sealed
	// superseded: the step is not pushed (a newer one is queued already); its queued early
	// pushes are not made (syncer.skipPush)
	superseded atomic.Bool
	pending    sync.WaitGroup // early pushes queued or running
	mu         sync.Mutex
	acked      map[int]map[layout.FileDigest]bool // GUARDED_BY(mu); by peer rank
	queued     map[layout.FileDigest]bool         // GUARDED_BY(mu); contents queued for a push
}

// firstOf reports whether no file with digest d was queued for a push in g yet, and records it.
func (g *earlyGroup) firstOf(d layout.FileDigest) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.queued[d] {
		return false
	}
	g.queued[d] = true
	return true
}

// earlyPush is one closed file to push early.
type earlyPush struct {
	g           *earlyGroup
	group, path string // path: the file in the spool
	name        string // the file in the mount, as the job closed it
}

// closed queues the file the job closed at path for hashing (and then an early push); called by
// the control loop. A full queue drops it: the sealer hashes what was not hashed early.
//
// The early push is counted in its group here, before the hash, and not once the file is
// hashed: the commit that follows the close is handled after it, and the sealed push waits for
// the group's pending pushes (take). Counted after the hash, a file still being hashed when the
// step was pushed went twice: in the sealed push, and then early into a group of the old name
// that nothing consumed (clusterbench's peers held one 16 MiB state file twice at their peak).
func (e *earlyPushes) closed(path string) {
	f := closedFile{path: path}
	f.g, f.group = e.groupOf(path)
	select {
	case e.hashQ <- f:
	default:
		if f.g != nil {
			f.g.pending.Done()
		}
	}
}

// closeHasher ends the hasher; called by the control loop when it ends.
func (e *earlyPushes) closeHasher() { close(e.hashQ) }

// transportFor returns the transport's early side when early pushes apply to cfg: peers, data
// replicated (not data-parallel), and commits that rename a directory.
func (e *earlyPushes) transportFor(cfg *Config) (EarlyTransport, bool) {
	et, ok := e.transport.(EarlyTransport)
	if !ok || len(cfg.Peers()) == 0 || cfg.AssumeDataParallelism > 0 || cfg.Framework == FrameworkPyTorch {
		return nil, false
	}
	return et, true
}

// runHasher hashes files the job closed after writing into the digest cache. A step whose files
// were hashed this way seals in the time it takes to combine their digests. It waits while the
// job uses the mount on a busy node (yielder.waitForJob): a step committed meanwhile has the
// files not hashed yet hashed by its sealer.
func (e *earlyPushes) runHasher() {
	defer close(e.pushQ)
	for f := range e.hashQ {
		var d layout.FileDigest
		if f.g == nil || !f.g.isCommitted() {
			// The job first; a full queue meanwhile drops files (closed). Not for a file of
			// a committed step: its sealed push waits for it (take).
			e.yield.waitForJob(e.ctx)
		}
		p, held, end, err := e.ns.HoldSpoolFile(e.ctx, f.path)
		if err == nil {
			// Held: a job that deletes the file meanwhile cancels the hash, and its next write
			// waits for the descriptor to close (a black-box run: ENOSPC right after deleting a
			// file that filled the budget, while this hash held its bytes).
			if d, err = e.digests.HashFileCached(held, p); err != nil && held.Err() == nil {
				e.log.Debug("early hash failed", "path", f.path, "err", err)
			}
			end()
		} // else gone or renamed meanwhile: the sealer hashes it if it matters
		if f.g == nil {
			continue
		}
		if err != nil || f.g.inc.ctx.Err() != nil || !f.g.firstOf(d) {
			// The file goes with the sealed data, or its bytes are pushed already: a writer
			// that closes a temporary name and renames it (tensorstore) reports the file twice,
			// and identical files need to cross once.
			f.g.pending.Done()
			continue
		}
		select {
		case e.pushQ <- earlyPush{g: f.g, group: f.group, path: p, name: f.path}:
		default:
			f.g.pending.Done() // the queue is full: the file goes with the sealed data
		}
	}
}

// groupOf returns the early group of the current incarnation that the file the job closed at
// path (inside a top-level directory) is pushed in, with one more push pending, or nil when the
// file is not pushed early.
func (e *earlyPushes) groupOf(path string) (*earlyGroup, string) {
	inc := e.incs.get()
	if inc == nil || inc.ctx.Err() != nil {
		return nil, ""
	}
	if _, ok := e.transportFor(inc.Config); !ok {
		return nil, ""
	}
	group, _, _ := strings.Cut(path, "/")
	if _, committed := layout.ParseStepDir(group); committed || layout.IsDataName(group) {
		return nil, "" // written into a committed name: that is not a step being saved
	}
	if !utf8.ValidString(group) {
		return nil, "" // the group's name travels as a protobuf string: the step goes whole at its commit
	}
	return inc.earlyGroup(group), group
}

// runPusher pushes queued files to every peer.
func (e *earlyPushes) runPusher() {
	for p := range e.pushQ {
		inc := p.g.inc
		if et, ok := e.transportFor(inc.Config); ok && inc.ctx.Err() == nil && !p.g.superseded.Load() {
			for _, peer := range inc.Config.Peers() {
				if p.g.superseded.Load() {
					break
				}
				e.yield.wait(inc.ctx, e.yield.limit)
				// Held while it reads, as the hash; a file renamed since (a writer's temporary
				// name) is read unheld.
				ctx, end := inc.ctx, func() {}
				if sp, held, stop, err := e.ns.HoldSpoolFile(inc.ctx, p.name); err == nil {
					if sp == p.path {
						ctx, end = held, stop
					} else {
						stop()
					}
				}
				d, err := et.PushEarly(ctx, inc.Incarnation, peer, p.group, p.path)
				end()
				if err != nil {
					// Not fatal: the file is sent with the sealed data.
					e.log.Debug("early push failed", "group", p.group, "to", peer, "err", err)
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

// take removes and returns the early group a commit renamed from (nil if none), once its queued
// pushes finished, so that the sealed push can count on them. The pushes run on the
// incarnation's context, so they end soon once it is over.
func (e *earlyPushes) take(c commit) *earlyGroup {
	if c.group == "" {
		return nil
	}
	g := c.inc.takeEarlyGroup(c.group)
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

// peers returns the ranks that acknowledged files of g.
func (g *earlyGroup) peers() []int {
	g.mu.Lock()
	defer g.mu.Unlock()
	var peers []int
	for peer := range g.acked {
		peers = append(peers, peer)
	}
	return peers
}

// dropAbandoned drops on the peers the early groups of inc, the current incarnation, whose
// directory the job removed without committing it (an abandoned save). Groups still being
// written, or committed and waiting to be sealed, stay. (A new incarnation starts with no
// groups: the peers drop an earlier one's when they see the new one.)
func (e *earlyPushes) dropAbandoned(inc *incarnation) {
	et, ok := e.transportFor(inc.Config)
	if !ok || !e.incs.isCurrent(inc) {
		return
	}
	ents, err := e.ns.List()
	if err != nil {
		return
	}
	present := make(map[string]bool, len(ents))
	for _, ent := range ents {
		present[ent.Name] = true
	}
	for name, g := range inc.abandonedEarlyGroups(present) {
		for _, peer := range g.peers() {
			if e.dropOn(et, inc, peer, name) == nil {
				e.log.Info("abandoned step dropped on peer", "group", name, "peer", peer)
			}
		}
	}
}

// dropOn asks peer to discard the early files of group, bounded by dropTimeout (a peer that
// does not answer drops the group when it goes idle or the job restarts).
func (e *earlyPushes) dropOn(et EarlyTransport, inc *incarnation, peer int, group string) error {
	ctx, cancel := context.WithTimeout(inc.ctx, dropTimeout)
	defer cancel()
	err := et.DropEarly(ctx, inc.Incarnation, peer, group)
	if err != nil {
		e.log.Debug("drop early files", "group", group, "on", peer, "err", err)
	}
	return err
}

// earlyGroup returns inc's group of the top-level name, made on first use, with one more push
// pending (the caller queues it, or calls pending.Done).
func (inc *incarnation) earlyGroup(name string) *earlyGroup {
	inc.mu.Lock()
	defer inc.mu.Unlock()
	g := inc.early[name]
	if g == nil {
		g = &earlyGroup{inc: inc, acked: map[int]map[layout.FileDigest]bool{}, queued: map[layout.FileDigest]bool{}}
		inc.early[name] = g
	}
	g.pending.Add(1)
	return g
}

// isCommitted reports whether g's step was committed (earlyCommitted).
func (g *earlyGroup) isCommitted() bool {
	g.inc.mu.Lock()
	defer g.inc.mu.Unlock()
	return g.committed
}

// earlyCommitted marks the group of the name a step was saved under as committed (the rename
// that committed it was recorded): it is no longer abandoned when its name leaves the namespace.
func (inc *incarnation) earlyCommitted(name string) {
	inc.mu.Lock()
	if g := inc.early[name]; g != nil {
		g.committed = true
	}
	inc.mu.Unlock()
}

// takeEarlyGroup removes and returns the group of name (nil if none).
func (inc *incarnation) takeEarlyGroup(name string) *earlyGroup {
	inc.mu.Lock()
	defer inc.mu.Unlock()
	g := inc.early[name]
	delete(inc.early, name)
	return g
}

// abandonedEarlyGroups removes and returns the groups not committed whose name is not present.
func (inc *incarnation) abandonedEarlyGroups(present map[string]bool) map[string]*earlyGroup {
	inc.mu.Lock()
	defer inc.mu.Unlock()
	abandoned := map[string]*earlyGroup{}
	for name, g := range inc.early {
		if !g.committed && !present[name] {
			abandoned[name] = g
			delete(inc.early, name)
		}
	}
	return abandoned
}
