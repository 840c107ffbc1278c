package fs

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/mtcfs/mtcfs/layout"
)

// countsEvents is an Events listener that only takes the mount's request counter.
type countsEvents struct{ counts func() map[string]uint64 }

func (e *countsEvents) Closed(string)                                  {}
func (e *countsEvents) Renamed(string, string, layout.EntryType)       {}
func (e *countsEvents) TooLarge(string)                                {}
func (e *countsEvents) Opened(bool)                                    {}
func (e *countsEvents) Created(string, layout.EntryType)               {}
func (e *countsEvents) Flushed(string)                                 {}
func (e *countsEvents) Abandoned(string, string)                       {}
func (e *countsEvents) ObserveFUSERequests(f func() map[string]uint64) { e.counts = f }

// TestRequestCounts checks that the mount counts the requests it serves, by operation, and hands
// the counter to an Events listener that asks for it (the replicator exports it).
func TestRequestCounts(t *testing.T) {
	for _, mode := range modes {
		t.Run(string(mode), func(t *testing.T) {
			ev := &countsEvents{}
			dir, _ := testMount(t, mode, 64<<20, func(o *Options) { o.Events = ev })
			if ev.counts == nil {
				t.Fatal("Mount did not hand its request counter to the Events")
			}
			d := filepath.Join(dir, "d")
			if err := os.Mkdir(d, 0o755); err != nil {
				t.Fatal(err)
			}
			before := ev.counts()
			const n = 20
			for i := range n {
				f, err := os.OpenFile(filepath.Join(d, fmt.Sprint(i)), os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
				if err != nil {
					t.Fatal(err)
				}
				f.Close()
			}
			var after map[string]uint64
			for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
				after = ev.counts()
				if after["release"]-before["release"] >= n || time.Now().After(deadline) {
					break
				}
			}
			diff := func(op string) uint64 { return after[op] - before[op] }
			if diff("create") != n || diff("release") != n {
				t.Errorf("%d create+close: %d CREATE and %d RELEASE counted, want %d each (all: %v)", n, diff("create"), diff("release"), n, after)
			}
			if diff("lookup") < n {
				t.Errorf("%d create+close of new names: %d LOOKUP counted, want at least %d", n, diff("lookup"), n)
			}
			if diff("flush") != 0 {
				t.Errorf("close(2) sent %d FLUSH; FOPEN_NOFLUSH should spare it", diff("flush"))
			}
		})
	}
}

// TestMountDoesNotTouchItself: a mount made for an agent (InProcess false) has served no request
// when Mount returns, so the agent's own process never waits on its mount (a SIGKILL during such
// a wait leaves it unkillable, see Mount). With InProcess (go-fuse's poll hack) the mount's own
// open is seen, which shows the count would catch one.
func TestMountDoesNotTouchItself(t *testing.T) {
	for _, inProcess := range []bool{false, true} {
		t.Run(fmt.Sprint("InProcess=", inProcess), func(t *testing.T) {
			ev := &countsEvents{}
			testMount(t, PassthroughOff, 16<<20, func(o *Options) { o.Events = ev; o.InProcess = inProcess })
			served := ev.counts()
			if inProcess && served["getattr"] == 0 {
				t.Errorf("with the poll hack, the mount's own open should be counted (a GETATTR of the root at least); counted: %v", served)
			}
			if !inProcess && len(served) != 0 {
				t.Errorf("the mount served requests before anyone used it: %v", served)
			}
		})
	}
}
