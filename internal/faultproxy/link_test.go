package faultproxy

import (
	"bytes"
	"math/rand/v2"
	"testing"
	"time"
)

// TestLinkRate sends 4 MiB through a 16 MB/s link: it cannot arrive in under about 0.26 s (less
// the burst allowance), and it must arrive intact.
func TestLinkRate(t *testing.T) {
	s := newSink(t, false)
	p := newProxy(t, s.ln.Addr().String())
	p.SetLink(Up, Link{BytesPerSecond: 16e6})
	c := dial(t, p.Addr())
	want := make([]byte, 4<<20)
	rand.NewChaCha8([32]byte{1}).Read(want)
	start := time.Now()
	if _, err := c.Write(want); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "4 MiB at the sink", func() bool { return len(s.received(0)) >= len(want) })
	if took := time.Since(start); took < 200*time.Millisecond {
		t.Errorf("4 MiB through a 16 MB/s link took %v, want ≥ 0.2 s", took)
	}
	if !bytes.Equal(s.received(0), want) {
		t.Error("bytes changed on the way")
	}
}

// TestLinkLatency: a round trip through a link with 50 ms each way takes at least 100 ms, and
// the latency does not cap the throughput at a read per latency.
func TestLinkLatency(t *testing.T) {
	s := newSink(t, true)
	p := newProxy(t, s.ln.Addr().String())
	p.SetLinkBoth(Link{Latency: 50 * time.Millisecond})
	c := dial(t, p.Addr())
	start := time.Now()
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	got, err := readFull(c, 4, 5*time.Second)
	if err != nil || string(got) != "ping" {
		t.Fatalf("echo: %q, %v", got, err)
	}
	if took := time.Since(start); took < 100*time.Millisecond {
		t.Errorf("round trip took %v, want ≥ 100 ms", took)
	}
	// 8 MiB in 32 KiB reads would take 12.8 s if every read waited out the latency in turn.
	big := make([]byte, 8<<20)
	go c.Write(big)
	if _, err := readFull(c, len(big), 5*time.Second); err != nil {
		t.Fatalf("8 MiB echo through a 50 ms link: %v", err)
	}
}

// TestLinkIsPerConnection: links set after a connection was accepted do not touch it; a
// half-close is passed on after the queued bytes.
func TestLinkIsPerConnection(t *testing.T) {
	s := newSink(t, false)
	p := newProxy(t, s.ln.Addr().String())
	p.SetLink(Up, Link{BytesPerSecond: 1e6, Latency: 20 * time.Millisecond})
	shaped := dial(t, p.Addr())
	waitFor(t, "the shaped connection", func() bool { return s.accepted() == 1 })
	p.SetLinkBoth(Link{})
	plain := dial(t, p.Addr())
	waitFor(t, "the plain connection", func() bool { return s.accepted() == 2 })
	msg := bytes.Repeat([]byte("x"), 100<<10)
	start := time.Now()
	if _, err := plain.Write(msg); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the plain bytes", func() bool { return len(s.received(1)) == len(msg) })
	plainTook := time.Since(start)
	start = time.Now()
	if _, err := shaped.Write(msg); err != nil {
		t.Fatal(err)
	}
	shaped.(interface{ CloseWrite() error }).CloseWrite()
	waitFor(t, "the shaped bytes", func() bool { return len(s.received(0)) == len(msg) })
	// 100 KiB at 1 MB/s, less the 64 KiB burst, plus 20 ms: at least 50 ms.
	if took := time.Since(start); took < 50*time.Millisecond {
		t.Errorf("shaped 100 KiB took %v (plain %v), want ≥ 50 ms", took, plainTook)
	}
}
