package faultproxy

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"math/bits"
	"net"
	"sync"
	"syscall"
	"testing"
	"time"
)

// sink is a TCP server that records what each connection sent and, when echo is set, sends it
// back.
type sink struct {
	ln   net.Listener
	echo bool

	mu    sync.Mutex
	got   [][]byte
	conns int
	wg    sync.WaitGroup
}

func newSink(t *testing.T, echo bool) *sink {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &sink{ln: ln, echo: echo}
	s.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s.mu.Lock()
			i := len(s.got)
			s.got = append(s.got, nil)
			s.conns++
			s.mu.Unlock()
			s.wg.Go(func() {
				defer c.Close()
				buf := make([]byte, 4096)
				for {
					n, err := c.Read(buf)
					if n > 0 {
						s.mu.Lock()
						s.got[i] = append(s.got[i], buf[:n]...)
						s.mu.Unlock()
						if s.echo {
							if _, err := c.Write(buf[:n]); err != nil {
								return
							}
						}
					}
					if err != nil {
						return
					}
				}
			})
		}
	})
	t.Cleanup(func() { ln.Close() })
	return s
}

func (s *sink) received(i int) []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	if i >= len(s.got) {
		return nil
	}
	return append([]byte(nil), s.got[i]...)
}

func (s *sink) accepted() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.conns
}

func newProxy(t *testing.T, target string) *Proxy {
	t.Helper()
	p, err := New("127.0.0.1:0", target)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

func dial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// readFull reads n bytes with a deadline.
func readFull(c net.Conn, n int, d time.Duration) ([]byte, error) {
	c.SetReadDeadline(time.Now().Add(d))
	defer c.SetReadDeadline(time.Time{})
	buf := make([]byte, n)
	_, err := io.ReadFull(c, buf)
	return buf, err
}

func TestForwards(t *testing.T) {
	s := newSink(t, true)
	p := newProxy(t, s.ln.Addr().String())
	c := dial(t, p.Addr())
	msg := bytes.Repeat([]byte("checkpoint "), 10000)
	go c.Write(msg)
	got, err := readFull(c, len(msg), 10*time.Second)
	if err != nil || !bytes.Equal(got, msg) {
		t.Fatalf("echo through the proxy: %v (equal %v)", err, bytes.Equal(got, msg))
	}
	if p.Forwarded() != int64(2*len(msg)) {
		t.Errorf("forwarded %d bytes, want %d", p.Forwarded(), 2*len(msg))
	}
}

func TestDelay(t *testing.T) {
	s := newSink(t, true)
	p := newProxy(t, s.ln.Addr().String())
	p.Set(Down, Faults{Delay: 200 * time.Millisecond})
	c := dial(t, p.Addr())
	start := time.Now()
	c.Write([]byte("x"))
	if _, err := readFull(c, 1, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took < 200*time.Millisecond {
		t.Errorf("round trip took %v with a 200ms delay down", took)
	}
	p.Set(Down, Faults{})
	c.Write([]byte("y"))
	if got, err := readFull(c, 1, 10*time.Second); err != nil || string(got) != "y" {
		t.Fatalf("after clearing the delay: %q %v", got, err)
	}
}

// TestBlackhole: nothing moves in a black-holed direction; the held bytes arrive once it is
// cleared; a connection made during the black hole reaches the server only after it.
func TestBlackhole(t *testing.T) {
	s := newSink(t, true)
	p := newProxy(t, s.ln.Addr().String())
	c := dial(t, p.Addr())
	c.Write([]byte("a"))
	if _, err := readFull(c, 1, 10*time.Second); err != nil {
		t.Fatal(err)
	}

	p.Set(Up, Faults{Blackhole: true})
	c.Write([]byte("bc"))
	if _, err := readFull(c, 1, 300*time.Millisecond); err == nil {
		t.Fatal("bytes crossed a black hole")
	}
	if got := s.received(0); string(got) != "a" {
		t.Fatalf("server got %q through a black hole", got)
	}
	c2 := dial(t, p.Addr())
	time.Sleep(100 * time.Millisecond)
	if n := s.accepted(); n != 1 {
		t.Fatalf("a connection made during a black hole reached the server (%d connections)", n)
	}

	p.Set(Up, Faults{})
	if got, err := readFull(c, 2, 10*time.Second); err != nil || string(got) != "bc" {
		t.Fatalf("held bytes after the black hole cleared: %q %v", got, err)
	}
	c2.Write([]byte("z"))
	if got, err := readFull(c2, 1, 10*time.Second); err != nil || string(got) != "z" {
		t.Fatalf("connection made during the black hole: %q %v", got, err)
	}

	// Down only: the server gets the bytes, the client gets nothing back.
	p.Set(Down, Faults{Blackhole: true})
	c.Write([]byte("d"))
	waitFor(t, "the server to receive d", func() bool { return string(s.received(0)) == "abcd" })
	if _, err := readFull(c, 1, 200*time.Millisecond); err == nil {
		t.Fatal("bytes came back through a black hole")
	}
	p.Clear()
	if got, err := readFull(c, 1, 10*time.Second); err != nil || string(got) != "d" {
		t.Fatalf("held reply: %q %v", got, err)
	}
}

func TestBlackholeAfter(t *testing.T) {
	s := newSink(t, false)
	p := newProxy(t, s.ln.Addr().String())
	p.BlackholeAfter(1000)
	c := dial(t, p.Addr())
	c.Write(make([]byte, 800))
	waitFor(t, "800 bytes", func() bool { return len(s.received(0)) == 800 })
	c.Write(make([]byte, 800))
	time.Sleep(200 * time.Millisecond)
	if n := len(s.received(0)); n != 800 {
		t.Fatalf("server got %d bytes, want 800: the threshold black-holes the read that crosses it", n)
	}
	if !p.Faults(Up).Blackhole || !p.Faults(Down).Blackhole {
		t.Fatal("both directions should be black-holed")
	}
}

func isReset(err error) bool {
	return errors.Is(err, syscall.ECONNRESET) || errors.Is(err, io.EOF) || errors.Is(err, syscall.EPIPE)
}

// TestReset: reset mode kills open connections with an RST and every new one at once; switched
// off, connections work again.
func TestReset(t *testing.T) {
	s := newSink(t, true)
	p := newProxy(t, s.ln.Addr().String())
	c := dial(t, p.Addr())
	c.Write([]byte("a"))
	if _, err := readFull(c, 1, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	p.SetReset(true)
	if _, err := readFull(c, 1, 10*time.Second); !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("open connection after reset: want ECONNRESET, got %v", err)
	}
	// A new connection is reset before or right after connect returns.
	if c2, err := net.Dial("tcp", p.Addr()); err == nil {
		defer c2.Close()
		c2.Write([]byte("b"))
		if _, err := readFull(c2, 1, 10*time.Second); !isReset(err) {
			t.Fatalf("new connection in reset mode: want a reset, got %v", err)
		}
	} else if !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("dial in reset mode: %v", err)
	}
	p.SetReset(false)
	c3 := dial(t, p.Addr())
	c3.Write([]byte("c"))
	if got, err := readFull(c3, 1, 10*time.Second); err != nil || string(got) != "c" {
		t.Fatalf("after reset mode: %q %v", got, err)
	}
}

func TestResetAfter(t *testing.T) {
	s := newSink(t, false)
	p := newProxy(t, s.ln.Addr().String())
	p.ResetAfter(1000)
	c := dial(t, p.Addr())
	c.Write(make([]byte, 500))
	waitFor(t, "500 bytes", func() bool { return len(s.received(0)) == 500 })
	c.Write(make([]byte, 600))
	if _, err := readFull(c, 1, 10*time.Second); !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("want ECONNRESET past the threshold, got %v", err)
	}
}

// TestFlipsAnywhere sends zeros: every flipped bit shows as a one at the other end, in the
// direction asked for only.
func TestFlipsAnywhere(t *testing.T) {
	for _, d := range []Direction{Up, Down} {
		t.Run(d.String(), func(t *testing.T) {
			s := newSink(t, true)
			p := newProxy(t, s.ln.Addr().String())
			p.Set(d, Faults{FlipEvery: 5000, FlipAnywhere: true})
			c := dial(t, p.Addr())
			const size = 1 << 20
			go c.Write(make([]byte, size))
			got, err := readFull(c, size, 20*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			ones := 0
			for _, b := range got {
				ones += bits.OnesCount8(b)
			}
			up := 0
			for _, b := range s.received(0) {
				up += bits.OnesCount8(b)
			}
			if p.Flips(d) < 50 {
				t.Fatalf("only %d flips in 1 MiB at one per ~5000 bytes", p.Flips(d))
			}
			if other := 1 - d; p.Flips(other) != 0 {
				t.Fatalf("%d flips in the other direction", p.Flips(other))
			}
			if int64(ones) != p.Flips(d) {
				t.Fatalf("client saw %d flipped bits, the proxy flipped %d", ones, p.Flips(d))
			}
			if wantUp := map[Direction]int64{Up: p.Flips(Up), Down: 0}[d]; int64(up) != wantUp {
				t.Fatalf("server saw %d flipped bits, want %d", up, wantUp)
			}
		})
	}
}

func frame(typ byte, payload []byte) []byte {
	h := make([]byte, 9)
	binary.BigEndian.PutUint32(h, uint32(len(payload))<<8|uint32(typ))
	h[4] = 0
	binary.BigEndian.PutUint32(h[5:], 1) // stream 1
	return append(h, payload...)
}

// TestFlipsOnlyDATA: by default only HTTP/2 DATA payloads are damaged; the preface, frame
// headers and other frames arrive intact, split across reads in any way.
func TestFlipsOnlyDATA(t *testing.T) {
	s := newSink(t, false)
	p := newProxy(t, s.ln.Addr().String())
	p.Set(Up, Faults{FlipEvery: 1})
	c := dial(t, p.Addr())
	var stream []byte
	var dataAt [][2]int // payload ranges of DATA frames
	stream = append(stream, http2Preface...)
	for i := range 40 {
		stream = append(stream, frame(1, bytes.Repeat([]byte{0}, 50+i))...) // HEADERS
		f := frame(0, bytes.Repeat([]byte{0}, 300+7*i))                     // DATA
		dataAt = append(dataAt, [2]int{len(stream) + 9, len(stream) + len(f)})
		stream = append(stream, f...)
	}
	for off := 0; off < len(stream); off += 777 { // odd chunks: headers split across reads
		c.Write(stream[off:min(off+777, len(stream))])
		time.Sleep(time.Millisecond)
	}
	waitFor(t, "the whole stream", func() bool { return len(s.received(0)) == len(stream) })
	got := s.received(0)
	inData := func(i int) bool {
		for _, r := range dataAt {
			if i >= r[0] && i < r[1] {
				return true
			}
		}
		return false
	}
	flipped := 0
	for i := range got {
		if got[i] != stream[i] {
			if !inData(i) {
				t.Fatalf("byte %d outside DATA payload changed", i)
			}
			flipped += bits.OnesCount8(got[i] ^ stream[i])
		}
	}
	if flipped == 0 || int64(flipped) != p.Flips(Up) {
		t.Fatalf("%d bits differ, the proxy flipped %d", flipped, p.Flips(Up))
	}
}

// TestSetTarget: connections go where the target says when the proxy connects them.
func TestSetTarget(t *testing.T) {
	a, b := newSink(t, false), newSink(t, false)
	p := newProxy(t, "")
	if c, err := net.Dial("tcp", p.Addr()); err == nil {
		if _, err := readFull(c, 1, 5*time.Second); err == nil {
			t.Fatal("a connection without a target should be closed")
		}
		c.Close()
	}
	p.SetTarget(a.ln.Addr().String())
	dial(t, p.Addr()).Write([]byte("a"))
	waitFor(t, "target a", func() bool { return string(a.received(0)) == "a" })
	p.SetTarget(b.ln.Addr().String())
	dial(t, p.Addr()).Write([]byte("b"))
	waitFor(t, "both targets", func() bool { return string(a.received(0)) == "a" && string(b.received(0)) == "b" })
}

// TestCloseReleasesHeldConnections: Close returns although connections wait in a black hole.
func TestCloseReleasesHeldConnections(t *testing.T) {
	s := newSink(t, true)
	p, err := New("127.0.0.1:0", s.ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	c := dial(t, p.Addr())
	c.Write([]byte("a"))
	readFull(c, 1, 5*time.Second)
	p.SetBoth(Faults{Blackhole: true})
	c.Write([]byte("b"))
	dial(t, p.Addr())
	time.Sleep(50 * time.Millisecond)
	done := make(chan error)
	go func() { done <- p.Close() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Close hangs on black-holed connections")
	}
}
