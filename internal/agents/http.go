package agents

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Serve serves an agent's HTTP endpoints on addr: /livez (the process runs), /readyz (ready
// returns "": the filesystem is mounted and serves; else why not), /status (status() as JSON,
// what `mtcfs status` reads) and /metrics (Prometheus). It returns the address it listens on and
// how to stop.
func Serve(addr string, ready func() string, status func() any, metrics http.Handler, log *slog.Logger) (string, func(), error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return "", nil, err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/livez", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, r *http.Request) {
		if why := ready(); why != "" {
			http.Error(w, why, http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/status", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		enc.Encode(status())
	})
	mux.Handle("/metrics", metrics)
	hs := &http.Server{Handler: closeOnSpare(mux), ReadHeaderTimeout: 5 * time.Second, IdleTimeout: time.Minute,
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn),
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			if _, ok := c.(*spareConn); ok {
				ctx = context.WithValue(ctx, onSpareKey{}, true)
			}
			return ctx
		}}
	go hs.Serve(newSpareListener(ln))
	log.Info("http endpoints", "addr", ln.Addr().String(), "paths", "/livez /readyz /status /metrics")
	return ln.Addr().String(), func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		hs.Shutdown(ctx)
	}, nil
}

// FetchStatus returns the /status document of the agent whose endpoints are at addr.
func FetchStatus(addr string) (json.RawMessage, error) {
	c := http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get("http://" + addr + "/status")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s: %s", resp.Status, strings.TrimSpace(string(body)))
	}
	return body, nil
}

// spareListener keeps one descriptor in reserve for the endpoints. A job holding many files open
// in the mount takes the agent's descriptors, and accept(2) then failed with EMFILE: status and
// metrics went unanswered exactly when they would have said why (a black-box run with a lowered
// limit). On EMFILE the spare is closed and the accept tried again; the spare is taken back when
// that connection closes, so one connection at a time is served on it.
type spareListener struct {
	net.Listener
	mu     sync.Mutex
	spare  int  // GUARDED_BY(mu); -1 while lent to a connection or not held
	closed bool // GUARDED_BY(mu); a connection closed after the listener takes nothing back
}

func newSpareListener(ln net.Listener) *spareListener {
	l := &spareListener{Listener: ln, spare: -1}
	l.refill()
	return l
}

// refill opens the spare if it is not held, as far as the limit lets it.
func (l *spareListener) refill() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.spare >= 0 || l.closed {
		return
	}
	if fd, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0); err == nil {
		l.spare = fd
	}
}

func (l *spareListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.mu.Lock()
		lent := l.spare < 0 && !l.closed
		l.mu.Unlock()
		if lent {
			// Accepted while the spare is not held: perhaps on the descriptor a connection on
			// the spare just gave back, before the spare was taken again. It is one too: a
			// scraper keeping it alive kept the spare's descriptor (a review).
			l.refill()
			return &spareConn{Conn: c, l: l}, nil
		}
		return c, nil
	}
	if !errors.Is(err, syscall.EMFILE) && !errors.Is(err, syscall.ENFILE) {
		return c, err
	}
	l.mu.Lock()
	if l.spare < 0 {
		l.mu.Unlock()
		l.refill() // lent and given back while the limit held: try to take it once more
		return nil, err
	}
	unix.Close(l.spare)
	l.spare = -1
	l.mu.Unlock()
	c, err = l.Listener.Accept()
	if err != nil {
		l.refill()
		return nil, err
	}
	return &spareConn{Conn: c, l: l}, nil
}

func (l *spareListener) Close() error {
	l.mu.Lock()
	l.closed = true
	if l.spare >= 0 {
		unix.Close(l.spare)
		l.spare = -1
	}
	l.mu.Unlock()
	return l.Listener.Close()
}

// onSpareKey marks the context of a request that came on the spare descriptor.
type onSpareKey struct{}

// closeOnSpare closes a connection on the spare after its response: a client keeping it alive (a
// Prometheus scraper does) kept the spare, and `mtcfs status` was not let in.
func closeOnSpare(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Context().Value(onSpareKey{}) != nil {
			w.Header().Set("Connection", "close")
		}
		h.ServeHTTP(w, r)
	})
}

// spareConn is a connection accepted on the spare: closing it takes the spare back.
type spareConn struct {
	net.Conn
	l    *spareListener
	once sync.Once
}

func (c *spareConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.l.refill)
	return err
}
