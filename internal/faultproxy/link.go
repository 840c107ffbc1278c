package faultproxy

import (
	"net"
	"sync"
	"time"
)

// Link shapes one direction of every connection like a network path, for benchmarks: each
// connection gets its own rate limit (a token bucket per connection and direction, as a path
// where a single TCP stream tops out while parallel streams add up), and every byte is held for
// a one-way latency without that latency limiting the throughput (the bytes in flight are
// queued, as on a long path, up to a bound that covers twice the bandwidth-delay product).
//
// A Link applies to the connections accepted after SetLink; the faults of Set apply as well,
// before the link (they act on the bytes as read, the link on when they are written).
type Link struct {
	// BytesPerSecond caps each connection in this direction; 0 leaves it unlimited.
	BytesPerSecond int64
	// Latency is the one-way delay of every byte; half the round-trip time.
	Latency time.Duration
}

func (l Link) on() bool { return l.BytesPerSecond > 0 || l.Latency > 0 }

// linkBurst is how far, in bytes, a connection may run ahead of its rate after an idle spell or
// a late wake-up.
const linkBurst = 64 << 10

// SetLink shapes direction d of the connections accepted from now on.
func (p *Proxy) SetLink(d Direction, l Link) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.links[d] = l
}

// SetLinkBoth gives both directions of new connections the same link.
func (p *Proxy) SetLinkBoth(l Link) {
	p.SetLink(Up, l)
	p.SetLink(Down, l)
}

func (p *Proxy) link(d Direction) Link {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.links[d]
}

// shaper writes to one side of a connection through a Link: Write queues a copy of the bytes,
// stamped with when they may arrive, and a goroutine writes them out at the link's rate.
type shaper struct {
	dst  *net.TCPConn
	link Link
	dead <-chan struct{}
	ch   chan shapedChunk
	free chan []byte
	done chan struct{}
	once sync.Once

	mu  sync.Mutex
	err error // GUARDED_BY(mu); the first failed write
}

type shapedChunk struct {
	b   []byte
	due time.Time
}

func newShaper(dst *net.TCPConn, l Link, dead <-chan struct{}, chunk int) *shaper {
	queue := 256 // unlimited rate: 8 MiB of 32 KiB reads in flight
	if l.BytesPerSecond > 0 {
		bdp := float64(l.BytesPerSecond) * l.Latency.Seconds()
		queue = max(16, int(2*bdp)/chunk+4)
	}
	s := &shaper{dst: dst, link: l, dead: dead, ch: make(chan shapedChunk, queue), free: make(chan []byte, queue+1), done: make(chan struct{})}
	go s.run()
	return s
}

// Write queues a copy of b; it fails with the error of an earlier write, or when the connection
// died.
func (s *shaper) Write(b []byte) (int, error) {
	s.mu.Lock()
	err := s.err
	s.mu.Unlock()
	if err != nil {
		return 0, err
	}
	var c []byte
	select {
	case c = <-s.free:
	default:
	}
	c = append(c[:0], b...)
	select {
	case s.ch <- shapedChunk{b: c, due: time.Now().Add(s.link.Latency)}:
		return len(b), nil
	case <-s.dead:
		return 0, net.ErrClosed
	}
}

// close waits until the queued bytes are written (or dropped, after a failed write or when the
// connection died).
func (s *shaper) close() {
	s.once.Do(func() { close(s.ch) })
	<-s.done
}

func (s *shaper) failed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err != nil
}

// wait sleeps until t; false when the connection died meanwhile.
func (s *shaper) wait(t time.Time) bool {
	d := time.Until(t)
	if d <= 0 {
		return true
	}
	tm := time.NewTimer(d)
	defer tm.Stop()
	select {
	case <-tm.C:
		return true
	case <-s.dead:
		return false
	}
}

func (s *shaper) run() {
	defer close(s.done)
	var next time.Time // when the link is free again, at its rate
	var slack time.Duration
	if r := s.link.BytesPerSecond; r > 0 {
		slack = time.Duration(float64(linkBurst) / float64(r) * float64(time.Second))
	}
	for c := range s.ch {
		if s.failed() || !s.wait(c.due) {
			s.drop(c.b)
			continue
		}
		if r := s.link.BytesPerSecond; r > 0 {
			if floor := time.Now().Add(-slack); next.Before(floor) {
				next = floor
			}
			next = next.Add(time.Duration(float64(len(c.b)) / float64(r) * float64(time.Second)))
			if !s.wait(next) {
				s.drop(c.b)
				continue
			}
		}
		if _, err := s.dst.Write(c.b); err != nil {
			s.mu.Lock()
			s.err = err
			s.mu.Unlock()
		}
		s.drop(c.b)
	}
}

// drop returns a chunk's buffer to the free list.
func (s *shaper) drop(b []byte) {
	select {
	case s.free <- b:
	default:
	}
}
