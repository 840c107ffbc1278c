package tiers

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/mtcfs/mtcfs/layout"
)

// PeerTransport moves sealed data between the agents of a job (package replication implements
// it over gRPC; cmd wires it). Both calls return only once the data was verified on arrival.
type PeerTransport interface {
	// Push sends the sealed data or .meta file at path, named name, to rank's agent.
	Push(ctx context.Context, inc Incarnation, rank int, name, path string) error
	// Fetch copies the data name that rank's agent holds into dir/name. progress, if not nil,
	// is called with the bytes received so far and the total (safe for concurrent calls).
	Fetch(ctx context.Context, inc Incarnation, rank int, name, dir string, progress func(done, total int64)) error
}

// replicaHoldTime bounds how long replicated data waits for its .meta before retention may
// free it (the sender pushes the data first and the .meta right after).
const replicaHoldTime = 5 * time.Minute

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

// replicate pushes this node's data of a sealed step and its .meta to the step's peers (SPEC
// §4): the data first, so that the .meta never names data the peer lacks; in data-parallel mode
// only the .meta, since column-mates hold equivalent data. It reports whether every peer
// acknowledged a verified replica (true when there are no peers): only those count.
func (r *Replicator) replicate(s sealedStep) bool {
	c, dataName, meta := s.commit, s.dataName, s.meta
	cfg := c.inc.Config
	peers := cfg.Peers()
	if len(peers) == 0 {
		return true
	}
	if r.cfg.Peers == nil {
		return false
	}
	all := true
	dataBytes := int64(-1) // the data's size, once needed
	early := r.takeEarly(c)
	defer r.dropAbandoned(c.inc)
	for _, peer := range peers {
		peerStart := r.cfg.Now()
		attempts := pushAttempts
		r.mu.Lock()
		if r.cfg.Now().Before(r.peerDown[peer]) {
			attempts = peerDownAttempts
		}
		r.mu.Unlock()
		var err error
		for attempt, wait := 1, pushBackoff; ; attempt, wait = attempt+1, wait*2 {
			err = r.pushStep(c, peer, dataName, meta, early, s.restored && slices.Contains(s.holders, peer))
			if err == nil || attempt >= attempts || c.inc.ctx.Err() != nil {
				break
			}
			r.log.Warn("replication failed, retrying", "step", c.step, "to", peer, "attempt", attempt, "err", err)
			select {
			case <-time.After(wait):
			case <-c.inc.ctx.Done():
			}
		}
		if err != nil && c.inc.ctx.Err() != nil {
			// The incarnation ended (a new replicator.yaml, or the agent stopping): not the
			// peer's failure, and not news for the job.
			return false
		}
		r.mu.Lock()
		if err != nil {
			r.peerDown[peer] = r.cfg.Now().Add(peerDownFor)
		} else {
			delete(r.peerDown, peer)
		}
		r.mu.Unlock()
		if err != nil {
			all = false
			r.metrics.error(errKindReplication)
			r.incLine(c.inc, fmt.Sprintf("replicating step %d to rank %d failed: %v", c.step, peer, err))
			if et, ok := r.earlyTransport(c.inc.Config); ok && early != nil {
				r.dropEarlyOn(et, c.inc, peer, c.group)
			}
			continue
		}
		sent := dataName
		if cfg.AssumeDataParallelism > 0 {
			sent = meta // column-mates hold the data
		}
		took := r.cfg.Now().Sub(peerStart)
		r.log.Info("replicated", "step", c.step, "data", sent, "to", peer, "took", took.String())
		r.metrics.replicated(took.Seconds())
		if cfg.AssumeDataParallelism == 0 && !(s.restored && slices.Contains(s.holders, peer)) {
			if dataBytes < 0 {
				dataBytes = treeBytes(r.spoolDir("sealed", dataName))
			}
			r.metrics.moved("peer", "out", dataBytes)
		}
	}
	return all
}

// pushStep pushes a step's data, then its .meta, to peer; with metaOnly (the peer holds the data
// already) only the .meta.
func (r *Replicator) pushStep(c commit, peer int, dataName, meta string, early *earlyGroup, metaOnly bool) error {
	if c.inc.Config.AssumeDataParallelism == 0 && !metaOnly {
		var err error
		src := r.spoolDir("sealed", dataName)
		if et, ok := r.earlyTransport(c.inc.Config); ok && early != nil {
			err = et.PushConsuming(c.inc.ctx, c.inc.Incarnation, peer, dataName, src, c.group, early.ackedBy(peer))
		} else {
			err = r.cfg.Peers.Push(c.inc.ctx, c.inc.Incarnation, peer, dataName, src)
		}
		if err != nil {
			return err
		}
	}
	return r.cfg.Peers.Push(c.inc.ctx, c.inc.Incarnation, peer, meta, r.spoolDir("meta", meta))
}

// AcceptReplica takes data or a .meta a peer pushed, already verified by the transport, and
// publishes it in the spool and the namespace (SPEC §4: a replica appears only once verified).
// path is moved, not copied.
func (r *Replicator) AcceptReplica(ctx context.Context, job string, rank int, name, path string) error {
	if m, ok := layout.ParseMarkerName(name); ok && m.Kind == layout.MarkerMeta {
		content, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		hash := strings.TrimSpace(string(content))
		if _, _, ok := layout.ParseDataName(hash + ".data"); !ok || m.Job != job {
			return fmt.Errorf("replica %s from rank %d: bad content %q", name, rank, hash)
		}
		r.publishMu.Lock()
		defer r.publishMu.Unlock()
		if err := r.writeMeta(name, hash); err != nil {
			return err
		}
		r.releaseReplicaHold(hash + ".data")
		r.log.Info("replica received", "meta", name, "from", rank)
		return nil
	}
	if !layout.IsDataName(name) {
		return fmt.Errorf("replica from rank %d: %q is neither data nor a .meta", rank, name)
	}
	r.publishMu.Lock()
	defer r.publishMu.Unlock()
	sealed := r.spoolDir("sealed", name)
	if _, err := os.Lstat(sealed); err == nil {
		os.RemoveAll(path) // already held (same content sealed here or replicated before)
	} else if err := os.Rename(path, sealed); err != nil {
		return err
	} else {
		r.markVerified(name) // the transport verified it on arrival
		r.metrics.moved("peer", "in", treeBytes(sealed))
	}
	if !r.hasName(name) {
		if err := r.ns.Import(sealed, name); err != nil {
			return err
		}
	}
	r.mu.Lock()
	if _, held := r.replicaHolds[name]; !held {
		release := r.holdLocked(name)
		r.replicaHolds[name] = release
		time.AfterFunc(replicaHoldTime, func() { r.releaseReplicaHold(name) })
	}
	r.mu.Unlock()
	return nil
}

func (r *Replicator) releaseReplicaHold(name string) {
	r.mu.Lock()
	release, ok := r.replicaHolds[name]
	delete(r.replicaHolds, name)
	r.mu.Unlock()
	if ok {
		release()
	}
}

// SealedPath is where this node holds the data name, for peers that fetch it.
func (r *Replicator) SealedPath(name string) (string, error) {
	if !layout.IsDataName(name) {
		return "", fmt.Errorf("%q: %w", name, os.ErrNotExist)
	}
	p := r.spoolDir("sealed", name)
	if _, err := os.Lstat(p); err != nil {
		return "", err
	}
	return p, nil
}

// Digests is the cache of file digests computed when files were closed; the peer transport
// reuses them instead of reading the data again.
func (r *Replicator) Digests() *layout.DigestCache { return &r.digests }
