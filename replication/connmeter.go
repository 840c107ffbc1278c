package replication

import (
	"context"
	"fmt"
	"net"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// A transfer's stall watchdog counts whole chunks (4 MiB by default): on a slow link shared by
// several streams, a chunk could take longer than the stall timeout to cross while the link
// moved bytes all along, and every try of a restore's fetch failed as stalled (a black-box run at
// 200 KB/s: "no chunk moved for 33s" while 2 MB crossed every 10 s). A connMeter counts the bytes
// that arrive on a peer connection, and a fetch on that connection is not stalled while they
// do. Bytes count in lumps of connMeterLump, so that keepalive pings and window updates (a few
// dozen bytes) do not keep a stuck transfer alive.
//
// Only arriving bytes count: what a push writes is taken by socket buffers (and by any proxy on
// the way) long before it crosses, and the window updates that tell what the peer consumed are
// too small to tell from pings. A push on such a link still fails as stalled, and is tried
// again later (README: a link slower than a chunk per stall timeout).
type connMeter struct {
	last    atomic.Int64 // Unix nanoseconds when the last lump of bytes completed (0: none)
	pending atomic.Int64 // bytes moved since
}

// connMeterLump is how many bytes a connection must move to count as moving.
const connMeterLump = 64 << 10

func (m *connMeter) add(n int) {
	if n > 0 && m.pending.Add(int64(n)) >= connMeterLump {
		m.pending.Store(0)
		m.last.Store(time.Now().UnixNano())
	}
}

// lastMoved returns when the connection last moved a lump of bytes (zero: never).
func (m *connMeter) lastMoved() time.Time {
	if m == nil {
		return time.Time{}
	}
	if ns := m.last.Load(); ns != 0 {
		return time.Unix(0, ns)
	}
	return time.Time{}
}

// meteredConn counts what arrives on a connection into its meter.
type meteredConn struct {
	net.Conn
	m *connMeter
}

func (c *meteredConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	c.m.add(n)
	return n, err
}

// meteredDialer dials TCP connections counted by m. gRPC gives a connection it dialed itself a
// TCP_USER_TIMEOUT of the keepalive timeout, so that the kernel drops a connection whose writes
// go unacknowledged (a peer gone, a black-holed link) after 10 s; it cannot on a wrapped one (a
// review measured 0 instead of 10000 ms), so the dialer sets it. A custom dialer also means
// that gRPC does not send peer connections through an HTTP(S)_PROXY of the environment.
func meteredDialer(m *connMeter) func(context.Context, string) (net.Conn, error) {
	return func(ctx context.Context, addr string) (net.Conn, error) {
		var d net.Dialer
		c, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			return nil, err
		}
		if tc, ok := c.(*net.TCPConn); ok {
			if err := setUserTimeout(tc, keepaliveTimeout); err != nil {
				c.Close()
				return nil, fmt.Errorf("set TCP_USER_TIMEOUT: %w", err)
			}
		}
		return &meteredConn{Conn: c, m: m}, nil
	}
}

// setUserTimeout sets the connection's TCP_USER_TIMEOUT.
func setUserTimeout(c *net.TCPConn, d time.Duration) error {
	raw, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := raw.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(d.Milliseconds()))
	}); err != nil {
		return err
	}
	return serr
}

type connMeterKey struct{}

// withConnMeter gives the transfers made with ctx the meter of their connection.
func withConnMeter(ctx context.Context, m *connMeter) context.Context {
	return context.WithValue(ctx, connMeterKey{}, m)
}

func connMeterFrom(ctx context.Context) *connMeter {
	m, _ := ctx.Value(connMeterKey{}).(*connMeter)
	return m
}
