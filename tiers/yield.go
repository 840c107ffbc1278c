package tiers

import (
	"bytes"
	"context"
	"io"
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
//   - Saving: the job has a file open for writing on the mount, opened in the last
//     savingOpenFor (a descriptor held for longer, such as a log file, does not count past
//     that), or opened one within the last savingGap (the gap between one file's close and the
//     next one's open).
//   - Contended: less than one CPU's worth of time was idle over the newest window of
//     idleWindow (/proc/stat: idle and iowait of all CPUs). A push needs about a CPU at each
//     end; taking it from a save whose CPUs are busy slows the save. (The kernel's pressure
//     stall information is no measure of this: a job that keeps exactly every CPU busy makes
//     no task wait until a push starts.) Where /proc/stat cannot be read, a save always
//     counts as contended: the job comes first.
//
// The receiving end yields too (YieldToSaves, called by the peer receiver before it reads a
// push stream's chunks): receiving costs this node's CPUs as much as sending costs the
// sender's, and on a job that saves on every node at once the sender's own save may be over
// while this node's goes on.
//
// A push waits at most maxYield before it starts, and a push stream at most maxReceiveYield
// before its chunks are read (well within the sender's stall timeout, 30 s by default); and
// nothing waits once the save has gone on for maxYield (a job that never stops opening files
// would otherwise hold every push that long), so replication cannot be held back for ever. A
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
// the wall clock (time.Now), not the replicator's: idle time is measured in real time.
type yielder struct {
	now func() time.Time
	// limit and receiveLimit are the longest a push waits to start and to be received
	// (maxYield, maxReceiveYield).
	limit, receiveLimit time.Duration
	// cpuIdle returns the cumulative idle time of all CPUs; false if unknown.
	cpuIdle func() (time.Duration, bool)

	writers     atomic.Int64 // handles open for writing on the mount
	lastOpen    atomic.Int64 // UnixNano of the newest open for writing
	savingSince atomic.Int64 // UnixNano of the open that started the current save
	waited      atomic.Int64 // nanoseconds pushes spent waiting, for the metrics

	mu        sync.Mutex
	sampledAt time.Time     // GUARDED_BY(mu)
	idle      time.Duration // GUARDED_BY(mu); the cumulative idle time at sampledAt
	contended bool          // GUARDED_BY(mu); over the last window
}

func newYielder(cpuIdle func() (time.Duration, bool)) *yielder {
	if cpuIdle == nil {
		cpuIdle = procCPUIdle
	}
	return &yielder{now: time.Now, limit: maxYield, receiveLimit: maxReceiveYield, cpuIdle: cpuIdle}
}

// opened and closed count the job's handles open for writing (Events.OpenedForWriting and
// Events.Closed).
func (y *yielder) opened() {
	now := y.now()
	if !y.saving(now) {
		y.savingSince.Store(now.UnixNano())
	}
	y.writers.Add(1)
	y.lastOpen.Store(now.UnixNano())
}

func (y *yielder) closed() {
	if y.writers.Add(-1) < 0 {
		y.writers.Add(1) // a close without its open (an open before the agent listened)
	}
}

// saving reports whether the job is writing a checkpoint on this node now.
func (y *yielder) saving(now time.Time) bool {
	since := now.Sub(time.Unix(0, y.lastOpen.Load()))
	return since < savingGap || (y.writers.Load() > 0 && since < savingOpenFor)
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
			y.contended = true
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
// then when either stops, after limit, once the save is limit old, or when ctx ends.
func (y *yielder) wait(ctx context.Context, limit time.Duration) {
	start := y.now()
	for {
		now := y.now()
		if !y.saving(now) || now.Sub(start) >= limit || now.Sub(time.Unix(0, y.savingSince.Load())) >= y.limit ||
			!y.isContended(now) {
			break
		}
		t := time.NewTimer(idleWindow)
		select {
		case <-ctx.Done():
			t.Stop()
			y.waited.Add(int64(y.now().Sub(start)))
			return
		case <-t.C:
		}
	}
	y.waited.Add(int64(y.now().Sub(start)))
}

// waitedSeconds is the time pushes spent waiting for the job's saves.
func (y *yielder) waitedSeconds() float64 { return time.Duration(y.waited.Load()).Seconds() }

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
