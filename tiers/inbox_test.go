package tiers

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mtcfs/mtcfs/layout"
)

// nopNamespace is a Namespace that accepts every change and holds nothing.
type nopNamespace struct{}

var _ Namespace = nopNamespace{}

func (nopNamespace) List() ([]DirEntry, error)              { return nil, nil }
func (nopNamespace) ReadFile(string, int64) ([]byte, error) { return nil, os.ErrNotExist }
func (nopNamespace) WriteFile(string, []byte) error         { return nil }
func (nopNamespace) Symlink(string, string) error           { return nil }
func (nopNamespace) Rename(string, string) error            { return nil }
func (nopNamespace) Remove(string) error                    { return nil }
func (nopNamespace) Seal(string, string) (SealInfo, error)  { return SealInfo{}, nil }
func (nopNamespace) HoldSpoolFile(context.Context, string) (string, context.Context, func(), error) {
	return "", nil, nil, os.ErrNotExist
}
func (nopNamespace) Import(string, string) error                      { return nil }
func (nopNamespace) Owner(string) (uint32, uint32, error)             { return 0, 0, os.ErrNotExist }
func (nopNamespace) Reown(string, *layout.Attrs, uint32) (int, error) { return 0, nil }
func (nopNamespace) ImportVerified(_, _ string, verify func([]layout.TreeEntry) error) error {
	return verify(nil)
}

// manualTimers replaces time.AfterFunc: timers fire when the test says so.
type manualTimers struct {
	mu     sync.Mutex
	timers []*manualTimer
}

type manualTimer struct {
	f       func()
	stopped bool
}

func (t *manualTimer) Stop() bool {
	was := !t.stopped
	t.stopped = true
	return was
}

func (m *manualTimers) afterFunc(_ time.Duration, f func()) stopper {
	m.mu.Lock()
	defer m.mu.Unlock()
	t := &manualTimer{f: f}
	m.timers = append(m.timers, t)
	return t
}

// fire runs timer i's function as time.AfterFunc would when its time is up, stopped or not
// (a timer stopped too late fires anyway).
func (m *manualTimers) fire(i int) {
	m.mu.Lock()
	t := m.timers[i]
	m.mu.Unlock()
	t.f()
}

// A replica hold ends when its .meta arrives; its timer must not end a later hold of the same
// data (before the fix, the timer of the first hold was never stopped and released whatever
// hold the data had when it fired).
func TestReplicaHoldTimerEndsOnlyItsOwnHold(t *testing.T) {
	spool, err := OpenSpool(SpoolConfig{Dir: t.TempDir(), Budget: MinBudget})
	if err != nil {
		t.Fatal(err)
	}
	n := &node{ns: nopNamespace{}, spool: spool, now: time.Now, log: slog.New(slog.DiscardHandler), digests: &layout.DigestCache{}}
	for _, d := range []string{"sealed", "meta"} {
		if err := os.MkdirAll(n.spoolDir(d), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	rt := newRetention(n, &incarnations{})
	ib := newInbox(n, rt)
	timers := &manualTimers{}
	ib.afterFunc = timers.afterFunc

	hash := strings.Repeat("ab", 32)
	data := hash + ".data"
	arrive := func() {
		t.Helper()
		p := filepath.Join(t.TempDir(), data)
		if err := os.WriteFile(p, []byte("replica"), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := ib.accept("job", 1, data, p); err != nil {
			t.Fatalf("accept data: %v", err)
		}
	}
	arriveMeta := func(step int64) {
		t.Helper()
		p := filepath.Join(t.TempDir(), "meta")
		if err := os.WriteFile(p, []byte(hash), 0o600); err != nil {
			t.Fatal(err)
		}
		name := layout.MarkerName{Job: "job", Step: step, Node: 1, Kind: layout.MarkerMeta}.String()
		if err := ib.accept("job", 1, name, p); err != nil {
			t.Fatalf("accept .meta: %v", err)
		}
	}

	arrive()
	if !rt.isHeld(data) {
		t.Fatal("replicated data is not held while it waits for its .meta")
	}
	arriveMeta(1)
	if rt.isHeld(data) {
		t.Fatal("the hold did not end when the .meta arrived")
	}
	if !timers.timers[0].stopped {
		t.Error("the first hold's timer was not stopped when its .meta arrived")
	}
	arrive() // the same data again (a later step with the same content, or a push retried)
	timers.fire(0)
	if !rt.isHeld(data) {
		t.Fatal("the first hold's timer ended the second hold of the same data")
	}
	timers.fire(1)
	if rt.isHeld(data) {
		t.Fatal("the second hold outlived its own timer")
	}
}
