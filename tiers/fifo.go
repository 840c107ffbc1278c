package tiers

import (
	"slices"
	"sync"
)

// fifo is an unbounded queue between two stages: pushing never blocks (a FUSE request, in
// particular, may push). Items pushed after close are dropped.
type fifo[T any] struct {
	mu     sync.Mutex
	items  []T  // GUARDED_BY(mu)
	closed bool // GUARDED_BY(mu)
	signal chan struct{}
}

func newFIFO[T any]() *fifo[T] { return &fifo[T]{signal: make(chan struct{}, 1)} }

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

// close makes pop return false once the queue is drained.
func (q *fifo[T]) close() {
	q.mu.Lock()
	q.closed = true
	q.mu.Unlock()
	q.wake()
}

// has reports whether an item for which pick holds is queued.
func (q *fifo[T]) has(pick func(T) bool) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return slices.ContainsFunc(q.items, pick)
}

// pop waits for the next item; ok is false once the queue is closed and drained. One goroutine
// pops from a queue.
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
