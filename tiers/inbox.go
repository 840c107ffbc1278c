package tiers

import (
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/mtcfs/mtcfs/layout"
)

// replicaHoldTime bounds how long replicated data waits for its .meta before retention may
// free it (the sender pushes the data first and the .meta right after).
const replicaHoldTime = 5 * time.Minute

// inbox publishes the replicas peers push to this node (SPEC §4: a replica appears only once
// verified, which the transport did): data first, then its .meta. Replicated data waits for
// its .meta under a replica hold, so that retention does not free it meanwhile; the hold ends
// when the .meta arrives or after replicaHoldTime, whichever comes first. Accept runs on the
// transport's goroutines; the holds' timers are stopped by Close.
type inbox struct {
	*node
	retention *retention
	holdTime  time.Duration
	// afterFunc is time.AfterFunc (tests replace it).
	afterFunc func(time.Duration, func()) stopper

	mu    sync.Mutex
	holds map[string]*replicaHold // GUARDED_BY(mu); by data name
}

// stopper is a timer as far as the inbox is concerned.
type stopper interface{ Stop() bool }

// replicaHold keeps replicated data from retention until its .meta arrives or timer fires.
type replicaHold struct {
	release func()
	timer   stopper // GUARDED_BY(inbox.mu)
}

func newInbox(n *node, rt *retention) *inbox {
	return &inbox{node: n, retention: rt, holdTime: replicaHoldTime, holds: map[string]*replicaHold{},
		afterFunc: func(d time.Duration, f func()) stopper { return time.AfterFunc(d, f) }}
}

// accept takes data or a .meta rank pushed for job; path is moved, not copied.
func (ib *inbox) accept(job string, rank int, name, path string) error {
	if m, ok := layout.ParseMarkerName(name); ok && m.Kind == layout.MarkerMeta {
		content, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		hash := strings.TrimSpace(string(content))
		if _, _, ok := layout.ParseDataName(hash + ".data"); !ok || m.Job != job {
			return fmt.Errorf("replica %s from rank %d: bad content %q", name, rank, hash)
		}
		err = ib.retention.publish(func() error {
			if err := ib.retention.writeMeta(name, hash); err != nil {
				return err
			}
			ib.release(hash + ".data")
			return nil
		})
		if err != nil {
			return err
		}
		ib.log.Info("replica received", "meta", name, "from", rank)
		return nil
	}
	if !layout.IsDataName(name) {
		return fmt.Errorf("replica from rank %d: %q is neither data nor a .meta", rank, name)
	}
	return ib.retention.publish(func() error {
		sealed := ib.spoolDir("sealed", name)
		if dup, err := moveData(path, sealed); err != nil {
			return err
		} else if !dup { // else already held (same content sealed here or replicated before)
			ib.retention.markVerified(name) // the transport verified it on arrival
			ib.metrics.moved("peer", "in", treeBytes(sealed))
		}
		if !ib.hasName(name) {
			if err := ib.ns.Import(sealed, name); err != nil {
				return err
			}
		}
		ib.hold(name)
		return nil
	})
}

// hold keeps the data name from retention until its .meta arrives or holdTime passes; data
// already held keeps its hold.
func (ib *inbox) hold(name string) {
	ib.mu.Lock()
	defer ib.mu.Unlock()
	if _, held := ib.holds[name]; held {
		return
	}
	h := &replicaHold{release: ib.retention.hold(name)}
	// The timer ends this hold only: a newer hold of the same data has its own.
	h.timer = ib.afterFunc(ib.holdTime, func() { ib.expire(name, h) })
	ib.holds[name] = h
}

// release ends the hold of the data name, if any: its .meta arrived.
func (ib *inbox) release(name string) {
	ib.mu.Lock()
	h := ib.holds[name]
	if h != nil {
		delete(ib.holds, name)
		h.timer.Stop()
	}
	ib.mu.Unlock()
	if h != nil {
		h.release()
	}
}

// expire ends h when its time is up, unless it already ended.
func (ib *inbox) expire(name string, h *replicaHold) {
	ib.mu.Lock()
	current := ib.holds[name] == h
	if current {
		delete(ib.holds, name)
	}
	ib.mu.Unlock()
	if current {
		h.release()
	}
}

// stopTimers stops the timers of the holds (Close).
func (ib *inbox) stopTimers() {
	ib.mu.Lock()
	defer ib.mu.Unlock()
	for _, h := range ib.holds {
		h.timer.Stop()
	}
}
