package tiers

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestParseCPUIdle(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want time.Duration
		ok   bool
	}{
		{"cpu  4705 356 584 3699176 1234 0 111 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n", (3699176 + 1234) * 10 * time.Millisecond, true},
		{"cpu 1 2 3 4", 0, false},
		{"cpu 1 2 3 4 5", 90 * time.Millisecond, true},
		{"cpu0 1 2 3 4 5 6 7\n", 0, false},
		{"cpu 1 2 3 x 5 6 7\n", 0, false},
		{"cpu 1 2 3 -4 5 6 7\n", 0, false},
		{"", 0, false},
	} {
		got, ok := parseCPUIdle([]byte(tc.in))
		if got != tc.want || ok != tc.ok {
			t.Errorf("parseCPUIdle(%q) = %v, %v; want %v, %v", tc.in, got, ok, tc.want, tc.ok)
		}
	}
	// The kernel running the tests: its /proc/stat parses. (That the sum only grows is not
	// checked: iowait, counted in it, can go back (proc(5)), and so can the sum.)
	if _, ok := procCPUIdle(); !ok {
		t.Fatal("/proc/stat does not parse")
	}
}

func TestYielderKnowsWhenTheJobSaves(t *testing.T) {
	now := time.Unix(1000, 0)
	y := newYielderClock(nil, func() time.Time { return now })
	if y.saving(now) {
		t.Fatal("saving before any open")
	}
	y.opened(true)
	if !y.saving(now) {
		t.Fatal("not saving with a file just opened for writing")
	}
	now = now.Add(5 * time.Second) // one large file being written
	if !y.saving(now) {
		t.Fatal("not saving with a file open for writing for 5s")
	}
	y.closed()
	if y.saving(now) {
		t.Fatal("saving 5s after the only open, with nothing open")
	}
	y.opened(true)
	y.closed()
	now = now.Add(savingGap / 2)
	if !y.saving(now) {
		t.Fatal("not saving between two files (an open just before)")
	}
	now = now.Add(savingGap)
	if y.saving(now) {
		t.Fatal("saving after the gap, with nothing open")
	}
	// A descriptor the job keeps open (a log) stops counting as a save after savingOpenFor.
	y.opened(true)
	now = now.Add(savingOpenFor + time.Second)
	if y.saving(now) {
		t.Fatal("a handle open for longer than savingOpenFor counts as a save")
	}
	y.closed()
	// A close without its open (opened before the agent listened) does not go negative.
	y.closed()
	if n := y.writers.Load(); n != 0 {
		t.Fatalf("writers = %d after an unmatched close, want 0", n)
	}
}

// idleClock is a CPU idle source: the cumulative idle time grows by cpus idle CPUs per wall
// second, or is unknown.
type idleClock struct {
	mu    sync.Mutex
	cpus  float64
	known bool
	// clocked: a yielder reads its time from now, and the idle time grows with the time it
	// read last (last), not with time.Now at the read.
	clocked bool
	last    time.Time
	at      time.Time
	idle    time.Duration
	calls   atomic.Int64
}

// now is time.Now for the yielder that reads c (newYielderClock(c.read, c.now)): c's idle time
// then grows by cpus times the time between that yielder's samples exactly. Measured on
// time.Now at the read, a goroutine preempted between the yielder's clock and its read of c
// (for a window, 50 ms, on a loaded machine) made half a CPU idle look like one.
func (c *idleClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.clocked, c.last = true, time.Now()
	return c.last
}

func (c *idleClock) read() (time.Duration, bool) {
	c.calls.Add(1)
	c.mu.Lock()
	defer c.mu.Unlock()
	now := time.Now()
	if c.clocked {
		now = c.last
	}
	if !c.at.IsZero() {
		c.idle += time.Duration(c.cpus * float64(now.Sub(c.at)))
	}
	c.at = now
	return c.idle, c.known
}

func (c *idleClock) set(cpus float64) {
	c.read()
	c.mu.Lock()
	defer c.mu.Unlock()
	c.cpus = cpus
}

// waitAsync runs y.wait and returns a channel closed when it returned.
func waitAsync(ctx context.Context, y *yielder) chan struct{} {
	done := make(chan struct{})
	go func() {
		y.wait(ctx, y.limit)
		close(done)
	}()
	return done
}

func returned(done chan struct{}, within time.Duration) bool {
	select {
	case <-done:
		return true
	case <-time.After(within):
		return false
	}
}

func TestYielderHoldsPushesWhileTheJobSavesOnABusyNode(t *testing.T) {
	for _, tc := range []struct {
		name string
		idle *idleClock
	}{
		{"half a CPU idle", &idleClock{cpus: 0.5, known: true}},
		{"idle time unknown", &idleClock{cpus: 8}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			y := newYielderClock(tc.idle.read, tc.idle.now)
			y.opened(true) // the job writes a file
			done := waitAsync(t.Context(), y)
			if returned(done, 300*time.Millisecond) {
				t.Fatal("a push started while the job was saving on a contended node")
			}
			y.closed() // the save ended
			if !returned(done, 10*time.Second) {
				t.Fatal("the push still waits after the save ended")
			}
			if y.waitedSeconds() <= 0 {
				t.Fatal("the wait was not counted")
			}
		})
	}
}

func TestYielderGoesWithSpareCPUs(t *testing.T) {
	p := &idleClock{cpus: 0.5, known: true}
	y := newYielderClock(p.read, p.now)
	y.opened(true)
	done := waitAsync(t.Context(), y)
	if returned(done, 100*time.Millisecond) {
		t.Fatal("a push started while the job was saving on a contended node")
	}
	p.set(1.5) // a CPU and a half to spare
	if !returned(done, 10*time.Second) {
		t.Fatal("the push still waits with spare CPUs")
	}
	// Not saving: no wait (reported as none), the idle time is not even read.
	y.closed()
	y.lastOpen.Store(never)
	calls := p.calls.Load()
	if d := y.wait(t.Context(), y.limit); d != 0 {
		t.Fatalf("wait reported %v with no save under way", d)
	}
	if n := p.calls.Load() - calls; n != 0 {
		t.Fatalf("the idle time was read %d times with no save under way", n)
	}
}

func TestYielderWaitIsBounded(t *testing.T) {
	y := newYielder((&idleClock{known: true}).read)
	y.limit = 50 * time.Millisecond
	y.opened(true) // and never closed: a job that keeps saving
	if !returned(waitAsync(t.Context(), y), 10*time.Second) {
		t.Fatal("a push waited past the limit")
	}
	// A job that never stops opening files: once its save is y.limit old, nothing waits. The
	// opener below opens every 5 ms; the gap is widened to an hour so that no scheduling stall
	// of it (CI runs this with -race beside other packages) ends the save. (A stall longer than
	// savingQuiet starts a new save, which then bounds the wait: later, still after begin.)
	y.limit = 200 * time.Millisecond
	y.saveGap.Store(int64(time.Hour))
	y.closed()
	y.lastOpen.Store(never) // the first save is over
	y.lastClose.Store(never)
	stop := make(chan struct{})
	opener := make(chan struct{})
	begin := time.Now() // before the save's first open, however late the goroutines below run
	go func() {
		defer close(opener)
		for {
			y.opened(true)
			y.closed()
			select {
			case <-stop:
				return
			case <-time.After(5 * time.Millisecond):
			}
		}
	}()
	waits := make(chan time.Duration, 1)
	go func() {
		time.Sleep(100 * time.Millisecond) // into the save
		y.wait(t.Context(), time.Hour)
		waits <- time.Since(begin)
	}()
	select {
	case d := <-waits:
		if !y.saving(time.Now()) {
			t.Fatal("the job stopped saving")
		}
		// The save began after begin: a wait that held the push until the save was y.limit
		// old returned y.limit after begin or later.
		if d < y.limit {
			t.Fatalf("the push went at most %v into a save, before the save was %v old", d, y.limit)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a push waits on in a save older than the limit")
	}
	close(stop)
	<-opener

	ctx, cancel := context.WithCancel(t.Context())
	y.limit = time.Hour
	y.opened(true)
	done := waitAsync(ctx, y)
	cancel()
	if !returned(done, 10*time.Second) {
		t.Fatal("a push waits on after its context ended")
	}
}

// A save is one from its first open until the job has neither opened nor closed a file for
// writing for savingQuiet: the gaps between its files (longer than savingGap, when the job
// computes the next one) do not start a new save, so the bound on a save's waits holds.
func TestYielderSaveSpansTheGapsBetweenFiles(t *testing.T) {
	now := time.Unix(1000, 0)
	y := newYielderClock(nil, func() time.Time { return now })
	y.opened(true)
	y.closed()
	start := now
	for range 5 {
		now = now.Add(200 * time.Millisecond) // the job prepares the next file
		if y.saving(now) {
			t.Fatal("saving in a gap with nothing open")
		}
		y.opened(true)
		y.closed()
	}
	if got := y.saveAge(now); got != now.Sub(start) {
		t.Fatalf("save age %v after files 200 ms apart, want %v", got, now.Sub(start))
	}
	now = now.Add(savingQuiet)
	y.opened(true)
	if got := y.saveAge(now); got != 0 {
		t.Fatalf("save age %v after %v without a file, want a new save", got, savingQuiet)
	}
}

// A job that keeps a descriptor open for writing all along (a log in the mount): its saves
// count as one, which is soon older than the bound, so pushes do not wait (rather than wait
// 30 s after every open).
func TestYielderWithADescriptorHeldOpen(t *testing.T) {
	now := time.Unix(1000, 0)
	y := newYielderClock((&idleClock{known: true}).read, func() time.Time { return now })
	y.opened(true) // the log, never closed
	now = now.Add(time.Minute)
	y.opened(true) // a file of a save
	if !y.saving(now) {
		t.Fatal("not saving with a file just opened")
	}
	if d := y.wait(t.Context(), time.Hour); d != 0 {
		t.Fatalf("a push waited %v with a log held open for a minute", d)
	}
}

// The early hasher yields to any use of the mount: reads too, which pushes do not wait for.
// Its waits are bounded like a push's: once the job's use of the mount is y.limit old,
// nothing waits.
func TestYielderHoldsTheHasherWhileTheJobReads(t *testing.T) {
	now := time.Unix(1000, 0)
	y := newYielderClock((&idleClock{known: true}).read, func() time.Time { return now })
	if y.usingMount(now) {
		t.Fatal("using the mount before any open")
	}
	first := now
	y.opened(false)
	if y.saving(now) {
		t.Fatal("a read-only open counts as a save")
	}
	if !y.usingMount(now) {
		t.Fatal("not using the mount with a file just opened for reading")
	}
	if d := y.wait(t.Context(), time.Hour); d != 0 {
		t.Fatalf("a push waited %v for the job's reads", d)
	}
	now = now.Add(savingGap)
	if y.usingMount(now) {
		t.Fatal("using the mount a gap after the only read-only open")
	}
	// Reads 200 ms apart go on with the same use of the mount, which ages; a pause of
	// savingQuiet ends it.
	for range 5 {
		now = now.Add(200 * time.Millisecond)
		y.opened(false)
	}
	if got := y.useAge(now); got != now.Sub(first) {
		t.Fatalf("use age %v after reads 200 ms apart, want %v", got, now.Sub(first))
	}
	now = now.Add(savingQuiet)
	y.opened(true)
	if got := y.useAge(now); got != 0 {
		t.Fatalf("use age %v after %v without an open, want a new use", got, savingQuiet)
	}
	if got := y.saveAge(now); got != 0 {
		t.Fatalf("save age %v at the first open for writing, want 0", got)
	}
}

// The test's clock moves only when the test moves it (the job's reads with it), so the hasher's
// first look, however late its goroutine runs, comes where the test wants it: 100 ms into the
// job's reads, 100 ms before the use of the mount is y.limit old.
func TestYielderHasherWaitIsBounded(t *testing.T) {
	var clock atomic.Int64 // nanoseconds past base: the wait reads it from its goroutine
	base := time.Unix(1000, 0)
	idle := &idleClock{known: true} // no CPU idle
	y := newYielderClock(idle.read, func() time.Time { return base.Add(time.Duration(clock.Load())) })
	y.limit = 200 * time.Millisecond
	read := func(until time.Duration) { // the job opens a file for reading every 5 ms
		for clock.Load() < int64(until) {
			clock.Add(int64(5 * time.Millisecond))
			y.opened(false)
		}
	}
	y.opened(false) // the job begins reading
	read(100 * time.Millisecond)
	done := make(chan time.Duration, 1)
	go func() { done <- y.waitForJob(t.Context()) }()
	// The hasher's first look reads the idle time (the job is using the mount): from then on, it
	// sees the clock the test moves.
	for idle.calls.Load() == 0 {
		select {
		case d := <-done:
			t.Fatalf("the hasher went at once (waited %v) while the job was reading on a busy node", d)
		case <-time.After(time.Millisecond):
		}
	}
	read(195 * time.Millisecond)
	select {
	case d := <-done:
		t.Fatalf("the hasher went after %v, the job's use of the mount %v old, before it was %v old", d, 195*time.Millisecond, y.limit)
	case <-time.After(3 * idleWindow): // it looks every idleWindow
	}
	// The use is y.limit old from the first read on, whenever the hasher came (its own wait
	// is 100 ms old then, half its bound).
	read(200 * time.Millisecond)
	select {
	case d := <-done:
		if d != 100*time.Millisecond {
			t.Fatalf("the hasher waited %v, want 100ms (from its first look to the use's bound)", d)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the hasher waits on once the job's use of the mount is older than the limit")
	}
	if y.hashWaitedSeconds() != 0.1 || y.waitedSeconds() != 0 {
		t.Fatalf("waits counted: hasher %vs, pushes %vs; want 0.1s, 0s", y.hashWaitedSeconds(), y.waitedSeconds())
	}
	// A hasher that comes once the use is older than the bound goes at once.
	read(205 * time.Millisecond)
	if d := y.waitForJob(t.Context()); d != 0 {
		t.Fatalf("the hasher waited %v in a use of the mount older than the limit", d)
	}
}

// The sealer waits only for opens for writing after its commit's mark (a next save), not for
// the save it seals nor for a descriptor held open since before.
func TestYielderSealerWaitsOnlyForANextSave(t *testing.T) {
	var clock atomic.Int64 // nanoseconds past base: the wait reads it from its goroutine
	base := time.Unix(1000, 0)
	now := func() time.Time { return base.Add(time.Duration(clock.Load())) }
	y := newYielderClock((&idleClock{known: true}).read, now)
	y.opened(true) // the step's last file, or a log held open
	mark := y.openMark()
	never := func() bool { return false }
	if d := y.waitForNextSave(t.Context(), mark, never); d != 0 {
		t.Fatalf("the sealer waited %v for the save it seals", d)
	}
	// A next save: an open after the mark. The wait ends once that open is savingGap old.
	clock.Add(int64(time.Millisecond))
	y.opened(true)
	done := make(chan time.Duration, 1)
	go func() { done <- y.waitForNextSave(t.Context(), mark, never) }()
	select {
	case <-done:
		t.Fatal("the sealer went on during a next save on a busy node")
	case <-time.After(100 * time.Millisecond):
	}
	clock.Add(int64(savingGap))
	select {
	case waited := <-done:
		if waited <= 0 {
			t.Fatal("the wait was not reported")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the sealer still waits after the next save's opens stopped")
	}

	// In a hurry (commits wait behind, or the RAM fills), it waits no longer: the job's saves
	// back to back had its committed steps pile up unsealed until ENOSPC (a black-box run).
	var hurry atomic.Bool
	clock.Add(int64(time.Millisecond))
	y.opened(true)
	go func() { done <- y.waitForNextSave(t.Context(), mark, hurry.Load) }()
	select {
	case <-done:
		t.Fatal("the sealer went on during a next save on a busy node")
	case <-time.After(100 * time.Millisecond):
	}
	hurry.Store(true)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the sealer still waits in a hurry")
	}
}
