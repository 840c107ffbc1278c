package replication

import (
	"encoding/binary"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// faultProxy is a TCP proxy between a gRPC client and server that injects faults: it can
// black-hole both directions, delay every read, reset every connection, and flip random bits.
// Bit flips land only in the payload of HTTP/2 DATA frames (the proxy follows the framing):
// those are the bytes that carry gRPC messages. A flip in a frame header mostly kills the
// connection, which other faults cover, and a few header bits are ones HTTP/2 ignores (unused
// flags, the reserved bit), where a flip changes nothing there is to catch.
type faultProxy struct {
	t      *testing.T
	ln     net.Listener
	target string

	// Faults, set before traffic or atomically.
	blackholeAfter atomic.Int64 // forwarded bytes (both directions) after which nothing moves; 0: never
	resetAfter     atomic.Int64 // forwarded bytes after which every connection is reset; 0: never
	delay          atomic.Int64 // nanoseconds slept before forwarding each read
	flipEvery      atomic.Int64 // mean DATA payload bytes between bit flips, client to server; 0: none
	flipToClient   atomic.Bool  // flip server-to-client traffic instead

	forwarded atomic.Int64
	flips     atomic.Int64

	mu    sync.Mutex
	conns []*net.TCPConn // GUARDED_BY(mu)
	black chan struct{}  // closed when the black hole opens
	once  sync.Once
	wg    sync.WaitGroup
}

func newFaultProxy(t *testing.T, target string) *faultProxy {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &faultProxy{t: t, ln: ln, target: target, black: make(chan struct{})}
	p.wg.Go(p.acceptLoop)
	t.Cleanup(p.close)
	return p
}

func (p *faultProxy) addr() string { return p.ln.Addr().String() }

func (p *faultProxy) acceptLoop() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", p.target)
		if err != nil {
			c.Close()
			continue
		}
		client, server := c.(*net.TCPConn), s.(*net.TCPConn)
		p.mu.Lock()
		p.conns = append(p.conns, client, server)
		p.mu.Unlock()
		seed := uint64(time.Now().UnixNano())
		p.wg.Go(func() { p.pump(server, client, !p.flipToClient.Load(), &frameTracker{skip: len(http2Preface)}, seed) })
		p.wg.Go(func() { p.pump(client, server, p.flipToClient.Load(), &frameTracker{}, seed+1) })
	}
}

const http2Preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

// pump copies src to dst, applying the faults. flip says whether this direction gets bit flips.
func (p *faultProxy) pump(dst, src *net.TCPConn, flip bool, ft *frameTracker, seed uint64) {
	defer dst.CloseWrite()
	rnd := rand.New(rand.NewPCG(seed, seed))
	buf := make([]byte, 32<<10)
	nextFlip := int64(-1)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if d := p.delay.Load(); d > 0 {
				time.Sleep(time.Duration(d))
			}
			total := p.forwarded.Add(int64(n))
			if b := p.blackholeAfter.Load(); b > 0 && total >= b {
				p.once.Do(func() { close(p.black) })
			}
			if r := p.resetAfter.Load(); r > 0 && total >= r {
				p.resetAll()
				return
			}
			select {
			case <-p.black:
				io.Copy(io.Discard, src) // swallow everything until the connection dies
				return
			default:
			}
			if every := p.flipEvery.Load(); flip && every > 0 {
				ft.scan(buf[:n], func(i, j int) {
					for int64(j-i) > 0 {
						if nextFlip < 0 {
							nextFlip = rnd.Int64N(2 * every)
						}
						if nextFlip >= int64(j-i) {
							nextFlip -= int64(j - i)
							return
						}
						i += int(nextFlip)
						buf[i] ^= 1 << rnd.IntN(8)
						p.flips.Add(1)
						i++
						nextFlip = -1
					}
				})
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// resetAll closes every connection with an RST (linger 0), as a crashed host or a middlebox would.
func (p *faultProxy) resetAll() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		c.SetLinger(0)
		c.Close()
	}
}

func (p *faultProxy) close() {
	p.ln.Close()
	p.resetAll()
	p.once.Do(func() { close(p.black) })
	p.wg.Wait()
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
