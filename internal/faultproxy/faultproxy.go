// Package faultproxy is a userspace TCP proxy that injects network faults between a client and
// a server, for tests: it black-holes, delays, resets and flips bits, per direction, and every
// fault can be switched on and off while traffic flows.
//
// Bit flips land, by default, only in the payload of HTTP/2 DATA frames (the proxy follows the
// framing): those are the bytes that carry gRPC messages. A flip in a frame header mostly kills
// the connection, which the reset fault covers, and a few header bits are ones HTTP/2 ignores
// (unused flags, the reserved bit), where a flip changes nothing there is to catch. Set
// Faults.FlipAnywhere for protocols other than HTTP/2.
//
// A black hole holds the bytes instead of dropping them, like a network that loses every packet
// while TCP keeps retransmitting: nothing moves in that direction (the sender's windows fill up
// and it stalls), and when the black hole is cleared the held bytes go through, unless the
// connection was given up meanwhile. New connections are accepted but not forwarded to the
// target while the client-to-server direction is black-holed.
package faultproxy

import (
	"encoding/binary"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Direction is one way of the byte stream.
type Direction int

const (
	// Up is client to server: the bytes the proxy's clients send.
	Up Direction = iota
	// Down is server to client.
	Down
)

func (d Direction) String() string {
	if d == Up {
		return "up"
	}
	return "down"
}

// Faults are what happens to one direction of every connection.
type Faults struct {
	// Blackhole holds every byte until it is cleared.
	Blackhole bool
	// Delay is slept before each read's bytes are forwarded.
	Delay time.Duration
	// FlipEvery is the mean number of bytes between flipped bits (one random bit of one byte);
	// 0 flips nothing. Counted over DATA frame payload unless FlipAnywhere.
	FlipEvery int64
	// FlipAnywhere flips bits anywhere in the stream instead of only in HTTP/2 DATA payloads.
	FlipAnywhere bool
}

// Proxy forwards the connections accepted on its address to a target address.
type Proxy struct {
	ln net.Listener

	target atomic.Pointer[string]

	blackholeAfter atomic.Int64 // forwarded bytes (both directions) after which both directions are black-holed; 0: never
	resetAfter     atomic.Int64 // forwarded bytes after which every connection is reset; 0: never
	resetting      atomic.Bool  // every connection is reset, new ones at once

	forwarded atomic.Int64
	flips     [2]atomic.Int64
	accepted  atomic.Int64
	resets    atomic.Int64

	mu      sync.Mutex
	faults  [2]Faults             // GUARDED_BY(mu)
	links   [2]Link               // GUARDED_BY(mu); for new connections
	changed chan struct{}         // GUARDED_BY(mu); closed and replaced when faults change
	conns   map[*net.TCPConn]bool // GUARDED_BY(mu)
	closed  bool                  // GUARDED_BY(mu)
	seed    atomic.Uint64
	wg      sync.WaitGroup
}

// New listens on listen (e.g. "127.0.0.1:0") and forwards to target. target may be "" and set
// later with SetTarget; connections accepted before that are closed.
func New(listen, target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return nil, err
	}
	p := &Proxy{ln: ln, changed: make(chan struct{}), conns: map[*net.TCPConn]bool{}}
	p.target.Store(&target)
	p.seed.Store(uint64(time.Now().UnixNano()))
	p.wg.Go(p.acceptLoop)
	return p, nil
}

// Addr is the address clients dial.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// SetTarget changes where new connections go.
func (p *Proxy) SetTarget(target string) { p.target.Store(&target) }

// Target is where new connections go.
func (p *Proxy) Target() string { return *p.target.Load() }

// Set replaces the faults of direction d, for existing and new connections.
func (p *Proxy) Set(d Direction, f Faults) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.faults[d] = f
	close(p.changed)
	p.changed = make(chan struct{})
}

// SetBoth gives both directions the same faults.
func (p *Proxy) SetBoth(f Faults) {
	p.Set(Up, f)
	p.Set(Down, f)
}

// Clear removes every fault: per-direction faults, Reset mode and the byte thresholds.
func (p *Proxy) Clear() {
	p.resetting.Store(false)
	p.blackholeAfter.Store(0)
	p.resetAfter.Store(0)
	p.SetBoth(Faults{})
}

// Faults returns the faults of direction d.
func (p *Proxy) Faults(d Direction) Faults {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.faults[d]
}

// BlackholeAfter black-holes both directions once n bytes were forwarded in all (0: never).
func (p *Proxy) BlackholeAfter(n int64) { p.blackholeAfter.Store(n) }

// ResetAfter resets every connection, and every later one as soon as it carries bytes, once n
// bytes were forwarded in all (0: never).
func (p *Proxy) ResetAfter(n int64) { p.resetAfter.Store(n) }

// SetReset switches reset mode: while on, every connection is reset now, and each new one as
// soon as it is accepted, with an RST (linger 0), as a crashed host or a middlebox does.
func (p *Proxy) SetReset(on bool) {
	p.resetting.Store(on)
	if on {
		p.ResetAll()
	}
}

// ResetAll resets every open connection once.
func (p *Proxy) ResetAll() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.resetLocked()
}

func (p *Proxy) resetLocked() {
	for c := range p.conns {
		c.SetLinger(0)
		c.Close()
		delete(p.conns, c)
	}
	p.resets.Add(1)
}

// Flips is the number of bits flipped in direction d so far.
func (p *Proxy) Flips(d Direction) int64 { return p.flips[d].Load() }

// Forwarded is the number of bytes read from either side so far.
func (p *Proxy) Forwarded() int64 { return p.forwarded.Load() }

// Accepted is the number of connections accepted so far.
func (p *Proxy) Accepted() int64 { return p.accepted.Load() }

// Close stops accepting, resets every connection and waits for the forwarding goroutines.
func (p *Proxy) Close() error {
	err := p.ln.Close()
	p.mu.Lock()
	if !p.closed {
		p.closed = true
		close(p.changed)
		p.changed = make(chan struct{})
	}
	p.resetLocked()
	p.mu.Unlock()
	p.wg.Wait()
	if errors.Is(err, net.ErrClosed) {
		err = nil
	}
	return err
}

// current returns d's faults and a channel closed when they change; ok is false once the proxy
// is closed.
func (p *Proxy) current(d Direction) (f Faults, changed <-chan struct{}, ok bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.faults[d], p.changed, !p.closed
}

// passable waits while d is black-holed. It returns the faults to apply, or false when the proxy
// closed or the connection died (dead is closed).
func (p *Proxy) passable(d Direction, dead <-chan struct{}) (Faults, bool) {
	for {
		f, changed, ok := p.current(d)
		if !ok {
			return f, false
		}
		if !f.Blackhole {
			return f, true
		}
		select {
		case <-changed:
		case <-dead:
			return f, false
		}
	}
}

// track registers a connection; false when the proxy is closed.
func (p *Proxy) track(cs ...*net.TCPConn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	for _, c := range cs {
		p.conns[c] = true
	}
	return true
}

func (p *Proxy) untrack(cs ...*net.TCPConn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range cs {
		delete(p.conns, c)
	}
}

func rst(c *net.TCPConn) {
	c.SetLinger(0)
	c.Close()
}

func (p *Proxy) acceptLoop() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.accepted.Add(1)
		client := c.(*net.TCPConn)
		if p.resetting.Load() {
			rst(client)
			continue
		}
		p.wg.Go(func() { p.serve(client) })
	}
}

// serve connects one accepted client to the target and forwards both ways.
func (p *Proxy) serve(client *net.TCPConn) {
	if !p.track(client) {
		rst(client)
		return
	}
	// A black-holed network does not even carry the handshake to the server: wait until the
	// black hole clears or the proxy closes (a nil channel never fires).
	if _, ok := p.passable(Up, nil); !ok {
		p.untrack(client)
		rst(client)
		return
	}
	// The link of a connection is the one set when it was accepted: read it before the target
	// sees the connection, so that a change made once the target has it applies to the next
	// connection only.
	links := [2]Link{p.link(Up), p.link(Down)}
	target := p.Target()
	s, err := net.DialTimeout("tcp", target, 10*time.Second)
	if err != nil || target == "" {
		if s != nil {
			s.Close()
		}
		p.untrack(client)
		rst(client)
		return
	}
	server := s.(*net.TCPConn)
	if !p.track(server) {
		p.untrack(client)
		rst(client)
		rst(server)
		return
	}
	connDead := make(chan struct{})
	var once sync.Once
	kill := func() { once.Do(func() { close(connDead) }) }
	seed := p.seed.Add(2)
	var shapers [2]*shaper
	for d, dst := range [2]*net.TCPConn{Up: server, Down: client} {
		if l := links[d]; l.on() {
			shapers[d] = newShaper(dst, l, connDead, pumpBuffer)
		}
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		p.pump(server, client, Up, &frameTracker{skip: len(http2Preface)}, seed, connDead, kill, shapers[Up])
	})
	wg.Go(func() { p.pump(client, server, Down, &frameTracker{}, seed+1, connDead, kill, shapers[Down]) })
	wg.Wait()
	p.untrack(client, server)
	client.Close()
	server.Close()
}

const http2Preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

// pumpBuffer is the size of pump's reads.
const pumpBuffer = 32 << 10

// pump copies src to dst in direction d, applying the faults, and the link through sh unless it
// is nil.
func (p *Proxy) pump(dst, src *net.TCPConn, d Direction, ft *frameTracker, seed uint64, dead chan struct{}, kill func(), sh *shaper) {
	defer kill()
	var err error
	var out io.Writer = dst
	if sh != nil {
		out = sh
	}
	defer func() {
		switch {
		case errors.Is(err, io.EOF):
			if sh != nil {
				sh.close() // deliver what is still on the link first
			}
			dst.CloseWrite() // the peer half-closed: pass it on
		case errors.Is(err, syscall.ECONNRESET):
			rst(dst) // the peer reset: pass it on
		}
		// Otherwise the proxy closed src (a reset or Close), which handles dst too.
		if sh != nil {
			sh.close()
		}
	}()
	rnd := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	buf := make([]byte, pumpBuffer)
	nextFlip := int64(-1)
	for {
		var n int
		n, err = src.Read(buf)
		if n > 0 {
			total := p.forwarded.Add(int64(n))
			if b := p.blackholeAfter.Load(); b > 0 && total >= b {
				p.blackholeAfter.Store(0)
				f := p.Faults(Up)
				f.Blackhole = true
				p.Set(Up, f)
				f = p.Faults(Down)
				f.Blackhole = true
				p.Set(Down, f)
			}
			if r := p.resetAfter.Load(); (r > 0 && total >= r) || p.resetting.Load() {
				p.ResetAll()
				return
			}
			f, ok := p.passable(d, dead)
			if !ok {
				return
			}
			if f.Delay > 0 {
				select {
				case <-time.After(f.Delay):
				case <-dead:
					return
				}
			}
			noFlip := func(int, int) {}
			flip := noFlip
			if f.FlipEvery > 0 {
				flip = func(i, j int) {
					for j > i {
						if nextFlip < 0 {
							nextFlip = rnd.Int64N(2 * f.FlipEvery)
						}
						if nextFlip >= int64(j-i) {
							nextFlip -= int64(j - i)
							return
						}
						i += int(nextFlip)
						buf[i] ^= 1 << rnd.IntN(8)
						p.flips[d].Add(1)
						i++
						nextFlip = -1
					}
				}
			}
			// The framing is followed all along, so that flips switched on later land in DATA.
			if f.FlipAnywhere {
				ft.scan(buf[:n], noFlip)
				flip(0, n)
			} else {
				ft.scan(buf[:n], flip)
			}
			if _, werr := out.Write(buf[:n]); werr != nil {
				err = nil
				rst(src)
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// frameTracker follows HTTP/2 framing over a byte stream and reports which bytes are DATA frame
// payload.
type frameTracker struct {
	skip        int // connection preface bytes still to pass
	hdr         [9]byte
	hdrN        int
	payloadLeft int
	data        bool
}

// scan calls fn(i, j) for every range buf[i:j] that is DATA payload.
func (ft *frameTracker) scan(buf []byte, fn func(i, j int)) {
	for i := 0; i < len(buf); {
		switch {
		case ft.skip > 0:
			k := min(ft.skip, len(buf)-i)
			ft.skip -= k
			i += k
		case ft.payloadLeft > 0:
			k := min(ft.payloadLeft, len(buf)-i)
			if ft.data {
				fn(i, i+k)
			}
			ft.payloadLeft -= k
			i += k
		default:
			ft.hdr[ft.hdrN] = buf[i]
			ft.hdrN++
			i++
			if ft.hdrN == len(ft.hdr) {
				ft.hdrN = 0
				ft.payloadLeft = int(binary.BigEndian.Uint32(append([]byte{0}, ft.hdr[:3]...)))
				ft.data = ft.hdr[3] == 0 // type DATA
			}
		}
	}
}
