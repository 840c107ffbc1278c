package fs

import (
	"bufio"
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
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
//     free, and but for a write that failed with ENOSPC less than twice the doomed bytes), the
//     requests that would need them wait for the releases: the unlink or rename
//     that dooms the file, a create or an open for writing, and a truncate, fallocate, copy or
//     (fallback path) write that failed with ENOSPC, which is retried once if a doomed file
//     was freed meanwhile. The wait ends when the files are freed; it gives up after
//     releaseGrace if no RELEASE is running (the files are really open; later waits give such
//     files releaseGraceOpen, but the first request that failed with ENOSPC after a file was
//     found open releaseGraceFailed) and never lasts longer than releaseWaitMax.
//
// A file the job removes itself (unlink, a rename over it) keeps its bytes until the kernel
// forgets the node (fileNode.kernelHeld): an open(2) that resolved the name before still opens
// the old content, as on tmpfs. The kernel queues that FORGET before unlink(2) or rename(2)
// returns unless such an open holds the node, and reads FORGETs before requests, so the file is
// doomed until then too and the requests short of space wait for it as for a RELEASE (within
// releaseGrace, no RELEASE running); the unlink or rename itself waits for the handles only, as
// its FORGET comes after its answer. But a write through a descriptor opened before, with
// passthrough, never reaches the agent and cannot wait: a job that filled the spool, deleted
// its partial file and wrote on through another descriptor got ENOSPC in 46 of 50 loops; and
// freeing a large file's pages takes a while (0.3 s for 1.5 GiB), which the unlink paid before
// it returned and the FORGET now paid after, so that a write of 2 GiB through a descriptor
// opened before, right after the job deleted 1.5 GiB with 2 GiB free, failed with ENOSPC in 7 of
// 9 runs (black-box h54). So only files up to keepMaxFile are kept, and only while all the
// bytes so kept stay within half the free room (roomToKeep): the state and metadata files that
// are replaced by rename while others read them, whose pages go in microseconds, in a spool that
// has room for them. A larger file, or one past that, goes at once, as before (an open racing
// its removal then fails with ENOENT, an O_PATH descriptor cannot reopen it). A statfs waits for such FORGETs too (awaitForgets), so that df
// right after rm shows the room. A file the kernel really holds (an O_PATH descriptor, a stale
// entry) keeps its bytes at most kernelHeldMax, and a wait that gave up on it once does not wait
// for it again.
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
	// keepMaxFile: the largest file whose bytes the job's removal keeps until the kernel's
	// FORGET (see above). The first version kept any file when 256 MiB were free: below that,
	// the usual state of a job whose checkpoints fill its budget, every second open racing a
	// rename failed with ENOENT again (black-box h54).
	keepMaxFile = 8 << 20
)

// roomToKeep reports whether the job's removal of a file of bytes keeps them until the kernel's
// FORGET: bytes at most keepMaxFile, and all the bytes so kept, these included, at most half the
// spool's free room (see above).
func (m *mtfs) roomToKeep(bytes int64) bool {
	if bytes > keepMaxFile {
		return false
	}
	total, used := m.spool.Usage()
	return 2*(m.heldBytes.Load()+bytes) <= total-used
}

// doomState is what the waits found of a doomed file.
type doomState struct {
	reallyOpen bool // a wait gave up on it: the job holds it open
	longWaited bool // a request that failed with ENOSPC waited releaseGraceFailed for it
	since      time.Time
	bytes      int64 // its spool file's blocks when it was doomed
}

// doom records that f lost its last name while handles remain or are being released. Caller
// holds f.mu.
func (m *mtfs) doom(f *fileNode) {
	bytes := f.accounted
	var st unix.Stat_t
	if f.backing != "" && unix.Stat(f.backing, &st) == nil {
		bytes = st.Blocks * 512
	}
	m.doomWith(f, bytes)
}

// doomWith is doom, given the bytes of f's spool file. Caller holds f.mu.
func (m *mtfs) doomWith(f *fileNode, bytes int64) {
	m.relMu.Lock()
	if _, ok := m.doomed[f]; !ok {
		m.doomed[f] = doomState{since: time.Now(), bytes: bytes}
		m.ndoomed.Add(1)
	}
	m.relMu.Unlock()
}

// freedButOpen counts the files that lost their last name (at least minAge ago, where the agent
// knows when) and that a process still holds open or mapped (torch.load(mmap=True) keeps every
// file it loaded mapped), and the bytes they keep in the spool: the RAM of a step the agent
// freed comes back only when they are closed, and meanwhile the job's saves have that much less
// room. Two kinds: doomed files whose handles the job holds (a descriptor; without passthrough,
// a mapping too), and deleted spool files that processes map (with passthrough a mapping maps
// the spool file itself, and the kernel releases the handle when its descriptor is closed: only
// the processes' maps tell). The agent's own reads (holds) do not count: a freed file's are
// cancelled.
func (m *mtfs) freedButOpen(minAge time.Duration, live func(name string) bool) (files int, bytes int64) {
	held := m.mappedFreed(live)  // by inode: a file both mapped and open counts once
	old := map[*fileNode]int64{} // doomed long enough, and its bytes
	m.relMu.Lock()
	for f, st := range m.doomed {
		if time.Since(st.since) >= minAge {
			old[f] = st.bytes
		}
	}
	m.relMu.Unlock()
	for f, b := range old { // f.mu after relMu, not inside it (doom takes them the other way)
		f.mu.Lock()
		open := f.opens > 0
		if open && f.backing != "" {
			// Its bytes now: a file doomed with no handle (its bytes waiting for the kernel's
			// FORGET) may since have been opened by an open that raced its removal, and grown.
			var st unix.Stat_t
			if unix.Stat(f.backing, &st) == nil {
				b = st.Blocks * 512
			}
		}
		f.mu.Unlock()
		if b == 0 {
			continue
		}
		if ino := f.StableAttr().Ino; open {
			held[ino] = max(held[ino], b)
		}
	}
	for _, b := range held {
		files++
		bytes += b
	}
	return files, bytes
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
	m.awaitDoomed(only, minGrace, false)
}

// awaitForgets waits, whatever the space, for the files the job removed whose bytes wait for
// the kernel's FORGET (fileNode.kernelHeld), which the kernel sends once the unlink(2) and the
// RELEASE of a close(2) made before it are answered: a statfs right after `rm` reported the
// bytes still used (6 of 10 runs, a review; all, after a close), where tmpfs reports them free.
// Within the bounds of awaitReleases; a file a wait gave up on (held for real) is not waited for
// again.
func (m *mtfs) awaitForgets() {
	if m.nheld.Load() == 0 {
		return
	}
	m.awaitDoomed(nil, 0, true)
}

// awaitDoomed is awaitReleasesFor's wait; forgetsOnly limits it to awaitForgets' files.
func (m *mtfs) awaitDoomed(only *fileNode, minGrace time.Duration, forgetsOnly bool) {
	type candidate struct {
		f        *fileNode
		gaveUpOn bool
	}
	m.relMu.Lock()
	var files []candidate
	var doomedBytes int64
	for f, st := range m.doomed {
		if only == nil || f == only {
			files = append(files, candidate{f, st.reallyOpen})
			doomedBytes += st.bytes
		}
	}
	m.relMu.Unlock()
	if minGrace == 0 && !forgetsOnly {
		// An unlink or rename, a create or an open for writing waits only for bytes that
		// matter: with twice the doomed files' bytes free, a job must write past the free
		// room before it needs them. A 64 MiB spool is always short of space (shortOfSpace),
		// and a job replacing a small file by rename while three processes read it waited
		// 29 ms at each rename and create for the version a reader still held (black-box
		// h54's race.py: 18 saves a second, 46 before readers stopped failing with ENOENT,
		// 650 without the waits). A write that failed with ENOSPC (minGrace) still waits.
		if total, used := m.spool.Usage(); total-used >= 2*doomedBytes {
			return
		}
	}
	var kept []*fileNode
	for _, c := range files {
		// A file held by the kernel alone that a wait gave up on is held for real (an O_PATH
		// descriptor, a stale entry): waiting for it again cost each create 10 ms for as long as
		// it was held, where its bytes are never needed but at kernelHeldMax (a review). And a
		// create or an open for writing does not wait for such files at all: they are kept
		// only while twice their bytes are free (roomToKeep). A write that failed with ENOSPC
		// (minGrace) still waits for them.
		kernel, handles := c.f.heldBy()
		kernelOnly := kernel && !handles
		if (kernelOnly && (c.gaveUpOn || (only == nil && minGrace == 0 && !forgetsOnly))) || (forgetsOnly && (!kernel || c.gaveUpOn)) {
			continue
		}
		if c.f.holdsBytes() {
			kept = append(kept, c.f)
		}
	}
	if len(kept) == 0 {
		return
	}
	m.waits.Add(1)
	start := time.Now()
	grace := time.Duration(0)
	timer := time.NewTimer(releaseGrace)
	defer timer.Stop()
	for {
		if only != nil {
			if _, handles := only.heldBy(); !handles {
				// The unlink or rename that doomed it waits for its handles only: when the job
				// removed it, the kernel's FORGET that frees it comes after the request's answer
				// (fileNode.kernelHeld), and the job's next requests wait for that.
				return
			}
		}
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
				st := m.doomed[f]
				st.reallyOpen, st.longWaited = true, st.longWaited || minGrace > 0
				m.doomed[f] = st
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

// freedDataKept is how long a freed data name is remembered for mappedFreed.
const freedDataKept = 10 * time.Minute

// noteFreed remembers that the agent removed the data name (a step it freed) from the top.
func (m *mtfs) noteFreed(name string) {
	m.freedMu.Lock()
	defer m.freedMu.Unlock()
	if m.freedData == nil {
		m.freedData = map[string]time.Time{}
	}
	now := time.Now()
	for n, at := range m.freedData {
		if now.Sub(at) > freedDataKept {
			delete(m.freedData, n)
		}
	}
	m.freedData[name] = now
}

// mappedFreed counts the files of data the agent freed in the last freedDataKept that the
// processes this agent can see still map through the mount, and their mapped extent (an
// estimate of the bytes they keep: the furthest byte mapped). With passthrough a mapping maps
// the spool file itself, and the kernel releases the FUSE handle once the descriptor is
// closed: the agent no longer sees the file open, only the processes' maps tell (they name
// the mount's path, <mount>/<hash>.data/...).
func (m *mtfs) mappedFreed(live func(name string) bool) (extent map[uint64]int64) {
	extent = map[uint64]int64{} // inode → furthest byte mapped
	m.freedMu.Lock()
	freed := make(map[string]bool, len(m.freedData))
	for n := range m.freedData {
		if !live(n) { // data freed, then back (a restore, a replica) is not freed
			freed[n] = true
		}
	}
	m.freedMu.Unlock()
	if len(freed) == 0 || m.mountDir == "" {
		return extent
	}
	procs, err := os.ReadDir("/proc")
	if err != nil {
		return extent
	}
	prefix := m.mountDir + "/"
	for _, p := range procs {
		if c := p.Name()[0]; c < '0' || c > '9' {
			continue
		}
		f, err := os.Open(filepath.Join("/proc", p.Name(), "maps"))
		if err != nil {
			continue // gone, or not ours to read
		}
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			line := sc.Text()
			at := strings.Index(line, prefix)
			if at < 0 {
				continue
			}
			// start-end perms offset dev inode path: the path must be the mount's, not one
			// that holds the mount's path further in.
			fields := strings.Fields(line[:at])
			rel := strings.TrimSuffix(line[at+len(prefix):], " (deleted)")
			top, _, _ := strings.Cut(rel, "/")
			if len(fields) != 5 || !freed[top] {
				continue
			}
			start, end, ok := strings.Cut(fields[0], "-")
			lo, err1 := strconv.ParseUint(start, 16, 64)
			hi, err2 := strconv.ParseUint(end, 16, 64)
			off, err3 := strconv.ParseUint(fields[2], 16, 64)
			ino, err4 := strconv.ParseUint(fields[4], 10, 64)
			if !ok || err1 != nil || err2 != nil || err3 != nil || err4 != nil || hi < lo {
				continue
			}
			extent[ino] = max(extent[ino], int64(off+hi-lo))
		}
		f.Close()
	}
	return extent
}
