package fs

import (
	"context"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// Space returns at once (SPEC §10).
//
// A regular file's bytes live in its spool file, which the agent keeps open once per handle and,
// with passthrough, registers with the kernel as the backing file. The bytes are freed only when
// the last name is gone AND the agent has closed its descriptors and unregistered the backing
// file, which it does when the FUSE RELEASE of the last handle arrives. close(2) does not wait
// for that: it queues the RELEASE and returns (most opens carry FOPEN_NOFLUSH, so not even a
// FLUSH round trip is made). A job that hits ENOSPC, closes and deletes its partial file and
// writes again at once got ENOSPC a second time, for as long as the release took.
//
// What the kernel guarantees is the order: close(2) has queued the RELEASE before it returns,
// and the agent reads requests first in, first out, so a RELEASE queued by a close(2) that
// returned before the job's next request (unlink, create, write) has been read before that
// request; it may only still be running on another goroutine. So:
//
//   - A file whose last name goes while the agent still has handles of it (or is releasing
//     one) is doomed (mtfs.doomed) until the RELEASE of its last handle is done, backing file
//     unregistered. Its handles are either released-pending or really open (the job still
//     holds a descriptor or, with passthrough, a mapping of the spool file: such a file keeps
//     its bytes, as on tmpfs).
//   - When a doomed file holds bytes and the spool is short of space (less than shortOfSpace
//     free), the requests that would need them wait for the releases: the unlink or rename
//     that dooms the file, a create or an open for writing, and a truncate, fallocate, copy or
//     (fallback path) write that failed with ENOSPC, which is retried once if a doomed file
//     was freed meanwhile. The wait ends when the files are freed; it gives up after
//     releaseGrace if no RELEASE is running (the files are really open; later waits give such
//     files releaseGraceOpen, but the first request that failed with ENOSPC after a file was
//     found open releaseGraceFailed) and never lasts longer than releaseWaitMax.
//
// The agent reads spool files itself too (the early hash and push of a closed file, in package
// tiers) on descriptors of its own, which keep the bytes like a handle. Such a read is a hold
// (fileNode.hold, Namespace.HoldSpoolFile): losing the last name cancels it, dooms the file like
// a handle would, and counts the cancelled hold as a RELEASE running until the reader lets go
// (a black-box run: a job that filled its budget, closed and deleted the file and wrote again at
// once got ENOSPC while the hash of the file it closed still read it).
//
// The normal path pays almost nothing: no wait while there is space or no file is doomed, and
// a RELEASE costs two atomic adds and a map entry more. Not covered: with passthrough, the
// writes of an already open descriptor never reach the agent, so after a file is deleted first
// and closed second, such a write can still see ENOSPC for the moment the release takes (a
// create or an open for writing does wait).
const (
	// shortOfSpace: with more free space than this, a job must write that much before it needs
	// a deleted file's bytes, which takes far longer than a release.
	shortOfSpace = 1 << 30
	// releaseGrace covers the moment between the agent reading a RELEASE and starting it.
	releaseGrace = 50 * time.Millisecond
	// releaseGraceOpen replaces it for files a wait already found really open, so that a job
	// holding one pays little on its next creates: the RELEASE of a close(2) made since was
	// read before the request that waits, and starts within this time but for bad luck.
	// (2 ms let 1 of 50 writes through with ENOSPC in a CI run on a heavily loaded machine.)
	releaseGraceOpen = 10 * time.Millisecond
	// releaseGraceFailed replaces both for a request that failed with ENOSPC (retryNoSpace): it
	// fails for good when the wait gives up, so a RELEASE that go-fuse has read but a loaded
	// machine has not run yet gets time to start. 10 ms let 1 of 50 writes through an old
	// descriptor fail with ENOSPC right after the job deleted and closed its partial file, in a
	// clean-clone CI run (make test runs the packages side by side, under -race). Once per
	// doomed file: a job that really holds one open and writes on past the budget pays it on
	// its first failed write only (found by a review: 250 ms for each).
	releaseGraceFailed = 250 * time.Millisecond
	// releaseWaitMax bounds every wait: a release that takes longer is stuck elsewhere.
	releaseWaitMax = 2 * time.Second
)

// doomState is what the waits found of a doomed file.
type doomState struct {
	reallyOpen bool // a wait gave up on it: the job holds it open
	longWaited bool // a request that failed with ENOSPC waited releaseGraceFailed for it
}

// doom records that f lost its last name while handles remain or are being released. Caller
// holds f.mu.
func (m *mtfs) doom(f *fileNode) {
	m.relMu.Lock()
	if _, ok := m.doomed[f]; !ok {
		m.doomed[f] = doomState{}
		m.ndoomed.Add(1)
	}
	m.relMu.Unlock()
}

// undoom is called once doomed f's last RELEASE is done, and wakes the waiters.
func (m *mtfs) undoom(f *fileNode) {
	m.relMu.Lock()
	defer m.relMu.Unlock()
	if _, ok := m.doomed[f]; !ok {
		return
	}
	delete(m.doomed, f)
	m.ndoomed.Add(-1)
	m.freedGen.Add(1)
	close(m.relCh)
	m.relCh = make(chan struct{})
}

// afterRelease runs done once the RELEASE request on ctx is done: go-fuse unregisters the
// passthrough backing file after our Release method returns, and until then the kernel still
// holds the bytes.
func (m *mtfs) afterRelease(ctx context.Context, done func()) {
	if c, ok := ctx.(*fuse.Context); ok && c.Cancel != nil {
		m.parkedRelease.Store(c.Cancel, done)
		return
	}
	done()
}

// release runs one RELEASE request (eventFS.Release): counted while it runs, so that a waiter
// knows one is under way, and followed by what it parked (afterRelease).
func (m *mtfs) release(cancel <-chan struct{}, do func()) {
	m.releasing.Add(1)
	defer m.releasing.Add(-1)
	do()
	if cancel == nil {
		return
	}
	if done, ok := m.parkedRelease.LoadAndDelete(cancel); ok {
		done.(func())()
	}
}

// spaceShort reports whether the spool has less than shortOfSpace free.
func (m *mtfs) spaceShort() bool {
	total, used := m.spool.Usage()
	return total-used < shortOfSpace
}

// holdsBytes reports whether doomed f's spool file has blocks allocated (or charged to the
// budget). A file freed by a RELEASE that is still running counts: the kernel may hold its bytes
// until the backing file is unregistered.
func (f *fileNode) holdsBytes() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.backing == "" || f.accounted > 0 {
		return true
	}
	var st unix.Stat_t
	return unix.Stat(f.backing, &st) == nil && st.Blocks > 0
}

// awaitReleases waits, when space is short, until the doomed files that hold bytes (only: just
// that one, nil: all) are freed, within the bounds explained above.
//
// An interrupt of the waiting request (a signal to the job, such as the Go runtime's preemption
// signals) does not end the wait: the request would fail with ENOSPC, or with EINTR that few
// callers retry. The kernel abandons the request by itself if the job is being killed.
func (m *mtfs) awaitReleases(only *fileNode) {
	m.awaitReleasesFor(only, 0)
}

// awaitReleasesFor is awaitReleases giving a RELEASE at least minGrace to start, once per doomed
// file.
func (m *mtfs) awaitReleasesFor(only *fileNode, minGrace time.Duration) {
	if m.ndoomed.Load() == 0 || !m.spaceShort() {
		return
	}
	m.relMu.Lock()
	var files []*fileNode
	for f := range m.doomed {
		if only == nil || f == only {
			files = append(files, f)
		}
	}
	m.relMu.Unlock()
	kept := files[:0]
	for _, f := range files {
		if f.holdsBytes() {
			kept = append(kept, f)
		}
	}
	if len(kept) == 0 {
		return
	}
	start := time.Now()
	grace := time.Duration(0)
	timer := time.NewTimer(releaseGrace)
	defer timer.Stop()
	for {
		m.relMu.Lock()
		var pending []*fileNode
		long := false
		for _, f := range kept {
			if st, ok := m.doomed[f]; ok {
				pending = append(pending, f)
				if grace == 0 && !st.reallyOpen {
					grace = releaseGrace
				}
				long = long || !st.longWaited
			}
		}
		if grace == 0 {
			grace = releaseGraceOpen
		}
		if long {
			grace = max(grace, minGrace)
		}
		elapsed := time.Since(start)
		giveUp := elapsed >= releaseWaitMax || (elapsed >= grace && m.releasing.Load() == 0)
		if giveUp {
			for _, f := range pending {
				m.doomed[f] = doomState{reallyOpen: true, longWaited: m.doomed[f].longWaited || minGrace > 0}
			}
		}
		wake := m.relCh
		m.relMu.Unlock()
		if len(pending) == 0 || giveUp {
			return
		}
		// Look again at the end of the grace, and every grace after it, whether a RELEASE is
		// still running.
		timer.Reset(min(grace-elapsed%grace, releaseWaitMax-elapsed))
		select {
		case <-wake:
		case <-timer.C:
		}
	}
}

// settle waits until done() holds, a handle's RELEASE permitting: it stops at once if done()
// holds, after releaseGrace if no RELEASE is running, and after releaseWaitMax in any case.
// It looks every millisecond: it is only used for a commit of a file with writers.
func (m *mtfs) settle(done func() bool) {
	start := time.Now()
	for !done() {
		elapsed := time.Since(start)
		if elapsed >= releaseWaitMax || (elapsed >= releaseGrace && m.releasing.Load() == 0) {
			return
		}
		time.Sleep(time.Millisecond)
	}
}
