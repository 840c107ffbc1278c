package tiers

import (
	"bytes"
	"context"
	"io"
	"math"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// Replication yields to the job's own saves (issue: a save started while the previous step
// replicates must not take much longer than an idle one). Pushing a step costs CPU on both
// ends (reading, checksums, hashing, socket copies); on a node whose CPUs the job's save keeps
// busy, every CPU-second a push takes during the save is taken from the save. So before a push
// starts (an early file to one peer, or a sealed step's data), it waits while the job is
// saving and the node's CPUs are contended; on a node with spare CPUs it goes at once.
//
//   - Saving: the job has a file open for writing on the mount and opened one in the last
//     savingOpenFor (a descriptor it keeps open, such as a log, counts until savingOpenFor after
//     its newest open, not for ever), or it opened one within the last savingGap (the gap
//     between one file's close and the next one's open). With a descriptor held open all
//     along, no new save begins (see savingQuiet), so once that is maxYield old nothing waits:
//     such a job's saves are not protected, and its replication is as without the yield.
//   - Contended: less than one CPU's worth of time was idle over the newest window of
//     idleWindow (/proc/stat: idle and iowait of all CPUs). A push needs about a CPU at each
//     end; taking it from a save whose CPUs are busy slows the save. (The kernel's pressure
//     stall information is no measure of this: a job that keeps exactly every CPU busy makes
//     no task wait until a push starts.) Where /proc/stat cannot be read, a save always
//     counts as contended: the job comes first.
//
// The early hasher (early.go) yields too, and to any use of the mount (waitForJob): it hashes
// each file the job closes so that sealing its step only combines digests, work that can wait
// until the job stops writing or reading, since the sealer hashes what was not hashed early.
// The sealer, hashing those files, yields to a next save only (waitForNextSave): the job opening
// files for writing after the commit it seals.
//
// The receiving end yields too (YieldToSaves, called by the peer receiver before it reads a
// push stream's chunks): receiving costs this node's CPUs as much as sending costs the
// sender's, and on a job that saves on every node at once the sender's own save may be over
// while this node's goes on.
//
// A push waits at most maxYield before it starts, and a push stream at most maxReceiveYield
// before its chunks are read (well within the sender's stall timeout, 30 s by default); and
// nothing waits once the save has gone on for maxYield (a save runs from an open until the job
// opened and closed nothing for savingQuiet; a job that never stops opening files would
// otherwise hold every push that long), so replication cannot be held back for ever. A
// transfer in progress is never paused between chunks. Restores never wait: the job waits for
// them.
const (
	savingOpenFor   = 30 * time.Second
	savingGap       = 50 * time.Millisecond
	minIdleCPUs     = 1.0
	idleWindow      = 50 * time.Millisecond
	maxYield        = 30 * time.Second
	maxReceiveYield = 10 * time.Second
)

// yielder tracks the job's saves and the idle CPUs for the pushes (see above). Its clock is
// the wall clock's monotonic reading (time.Now), not the replicator's: idle time is measured in
// real time, and a step of the wall clock must not make a save look endless or over.
type yielder struct {
	now  func() time.Time
	base time.Time // times below are nanoseconds since base
	// limit and receiveLimit are the longest a push waits to start and to be received
	// (maxYield, maxReceiveYield).
	limit, receiveLimit time.Duration
	// cpuIdle returns the cumulative idle time of all CPUs; false if unknown.
	cpuIdle func() (time.Duration, bool)

	writers     atomic.Int64 // handles open for writing on the mount
	lastOpen    atomic.Int64 // the newest open for writing
	lastClose   atomic.Int64 // the newest close of a handle open for writing
	lastRead    atomic.Int64 // the newest open for reading only
	savingSince atomic.Int64 // the open that started the current save
	usingSince  atomic.Int64 // the open (of either kind) that started the current use of the mount
	waited      atomic.Int64 // nanoseconds pushes spent waiting, for the metrics
	hashWaited  atomic.Int64 // nanoseconds the early hasher spent waiting, for the metrics
	// saveGap, readGap and nextSaveGap are savingGap as saving, usingMount (of reads) and
	// waitForNextSave use it. Tests on a loaded machine widen them, so that a scheduling stall
	// of the opens that stand for the job does not end a wait they check.
	saveGap, readGap, nextSaveGap atomic.Int64

	mu        sync.Mutex
	sampledAt time.Time     // GUARDED_BY(mu); zero: no baseline
	idle      time.Duration // GUARDED_BY(mu); the cumulative idle time at sampledAt
	contended bool          // GUARDED_BY(mu); over the last window
}

// never is the time of what has not happened: long enough ago for every comparison.
const never = math.MinInt64 / 2

func newYielder(cpuIdle func() (time.Duration, bool)) *yielder {
	return newYielderClock(cpuIdle, time.Now)
}

func newYielderClock(cpuIdle func() (time.Duration, bool), now func() time.Time) *yielder {
	if cpuIdle == nil {
		cpuIdle = procCPUIdle
	}
	y := &yielder{now: now, base: now(), limit: maxYield, receiveLimit: maxReceiveYield, cpuIdle: cpuIdle}
	y.lastOpen.Store(never)
	y.lastClose.Store(never)
	y.lastRead.Store(never)
	y.savingSince.Store(never)
	y.usingSince.Store(never)
	y.saveGap.Store(int64(savingGap))
	y.readGap.Store(int64(savingGap))
	y.nextSaveGap.Store(int64(savingGap))
	return y
}

// at is t as the yielder stores times.
func (y *yielder) at(t time.Time) int64 { return int64(t.Sub(y.base)) }

// savingQuiet is how long the job must have neither opened nor closed a file for writing before
// its next open starts a new save (for the bound on a save's waits): the gaps between the files
// of one save (the job computing or serialising the next one) are shorter.
const savingQuiet = time.Second

// opened and closed count the job's handles open for writing (Events.Opened and Events.Closed);
// opened also notes the job's opens for reading, which the early hasher yields to.
func (y *yielder) opened(writing bool) {
	now := y.at(y.now())
	quietWrites := y.writers.Load() <= 0 && now-max(y.lastOpen.Load(), y.lastClose.Load()) >= int64(savingQuiet)
	if quietWrites && now-y.lastRead.Load() >= int64(savingQuiet) {
		y.usingSince.Store(now)
	}
	if !writing {
		y.lastRead.Store(now)
		return
	}
	if quietWrites {
		y.savingSince.Store(now)
	}
	y.writers.Add(1)
	y.lastOpen.Store(now)
}

func (y *yielder) closed() {
	y.lastClose.Store(y.at(y.now()))
	if y.writers.Add(-1) < 0 {
		y.writers.Add(1) // a close without its open (an open before the agent listened)
	}
}

// saving reports whether the job is writing a checkpoint on this node now. A descriptor that
// stays open for writing (a log) counts until savingOpenFor after the job's newest open.
func (y *yielder) saving(now time.Time) bool {
	since := time.Duration(y.at(now) - y.lastOpen.Load())
	return since < time.Duration(y.saveGap.Load()) || (y.writers.Load() > 0 && since < savingOpenFor)
}

// saveAge is how long the current save has been going on.
func (y *yielder) saveAge(now time.Time) time.Duration {
	return time.Duration(y.at(now) - y.savingSince.Load())
}

// usingMount reports whether the job is saving, or opened a file for reading within the last
// savingGap (a restore, or a job that reads back what it wrote).
func (y *yielder) usingMount(now time.Time) bool {
	return y.saving(now) || y.at(now)-y.lastRead.Load() < y.readGap.Load()
}

// useAge is how long the job's current use of the mount (opens of either kind, no pause of
// savingQuiet) has been going on.
func (y *yielder) useAge(now time.Time) time.Duration {
	return time.Duration(y.at(now) - y.usingSince.Load())
}

// isContended reports whether less than minIdleCPUs were idle over the newest window, sampling
// the kernel's counters when the last sample is a window old.
func (y *yielder) isContended(now time.Time) bool {
	y.mu.Lock()
	defer y.mu.Unlock()
	if el := now.Sub(y.sampledAt); el >= idleWindow {
		idle, ok := y.cpuIdle()
		switch {
		case !ok:
			// Unknown: the job comes first. No baseline: the next reading starts a window.
			y.contended = true
			y.sampledAt = time.Time{}
			return true
		case !y.sampledAt.IsZero() && el < 10*idleWindow:
			y.contended = float64(idle-y.idle) < minIdleCPUs*float64(el)
		default:
			// The first sample, or an old one: measure a window from now on, and yield meanwhile
			// (a push that waits a window loses little; one that starts into a busy save costs it).
			y.contended = true
		}
		y.sampledAt, y.idle = now, idle
	}
	return y.contended
}

// wait returns once a push may start: at once unless the job is saving on a contended node,
// then when either stops, after limit, once the save is y.limit old, or when ctx ends. It
// returns how long it waited: 0 when it went at once.
func (y *yielder) wait(ctx context.Context, limit time.Duration) time.Duration {
	return y.waitWhile(ctx, limit, func(now time.Time) bool { return y.saving(now) && y.saveAge(now) < y.limit }, &y.waited)
}

// waitForJob returns once the early hasher may hash the next file: at once unless the job is
// using the mount (saving, or reading) on a contended node, then when either stops, after
// y.limit, once that use is y.limit old, or when ctx ends. The hash is not needed until the
// step is sealed, and the sealer hashes what was not hashed early; hashed while the job writes
// on a busy node, it took a third of the job's small-file write rate (bench/RESULTS.md).
func (y *yielder) waitForJob(ctx context.Context) time.Duration {
	return y.waitWhile(ctx, y.limit, func(now time.Time) bool { return y.usingMount(now) && y.useAge(now) < y.limit }, &y.hashWaited)
}

// openMark returns a mark of the job's newest open for writing, for waitForNextSave.
func (y *yielder) openMark() int64 { return y.lastOpen.Load() }

// waitForNextSave returns once the sealer may go on hashing a step it took when the job's newest
// open for writing was mark: at once unless the job has opened a file for writing since (a next
// save) within the last savingGap, on a contended node; then when the job stops opening files,
// after y.limit, once that save is y.limit old, or when ctx ends. Sealing hashes the files the
// early hasher left while the job saved the step, and a save started the moment the step
// committed would otherwise pay for them. It goes on at once when hurry says so (asked only
// while it would wait): the RAM the seal frees is what the job's next saves need.
func (y *yielder) waitForNextSave(ctx context.Context, mark int64, hurry func() bool) time.Duration {
	return y.waitWhile(ctx, y.limit, func(now time.Time) bool {
		last := y.lastOpen.Load()
		return last > mark && y.at(now)-last < y.nextSaveGap.Load() && y.saveAge(now) < y.limit && !hurry()
	}, &y.hashWaited)
}

// waitWhile waits while busy and the node is contended, for at most limit or until ctx ends,
// adds what it waited to total, and returns it (0 when it went at once).
func (y *yielder) waitWhile(ctx context.Context, limit time.Duration, busy func(time.Time) bool, total *atomic.Int64) time.Duration {
	start := y.now()
	slept := false
	for now := start; busy(now) && now.Sub(start) < limit && y.isContended(now); now = y.now() {
		slept = true
		t := time.NewTimer(idleWindow)
		select {
		case <-ctx.Done():
			t.Stop()
		case <-t.C:
			continue
		}
		break
	}
	if !slept {
		return 0
	}
	waited := y.now().Sub(start)
	total.Add(int64(waited))
	return waited
}

// waitedSeconds is the time pushes spent waiting for the job's saves.
func (y *yielder) waitedSeconds() float64 { return time.Duration(y.waited.Load()).Seconds() }

// hashWaitedSeconds is the time the early hasher spent waiting for the job.
func (y *yielder) hashWaitedSeconds() float64 { return time.Duration(y.hashWaited.Load()).Seconds() }

// procCPUIdle reads the idle and iowait time of all CPUs from /proc/stat's first line.
func procCPUIdle() (time.Duration, bool) {
	f, err := os.Open("/proc/stat")
	if err != nil {
		return 0, false
	}
	defer f.Close()
	var buf [512]byte
	n, _ := io.ReadFull(f, buf[:])
	return parseCPUIdle(buf[:n])
}

// userHZ is the unit of /proc/stat's times: USER_HZ, 100 on every Linux architecture Go runs on.
const userHZ = 100

// parseCPUIdle reads the idle (4th) and iowait (5th) fields of the "cpu " line.
func parseCPUIdle(b []byte) (time.Duration, bool) {
	line, _, _ := bytes.Cut(b, []byte("\n"))
	fields := bytes.Fields(line)
	if len(fields) < 6 || string(fields[0]) != "cpu" {
		return 0, false
	}
	var ticks int64
	for _, f := range fields[4:6] {
		v, err := strconv.ParseInt(string(f), 10, 64)
		if err != nil || v < 0 {
			return 0, false
		}
		ticks += v
	}
	return time.Duration(ticks) * (time.Second / userHZ), true
}
