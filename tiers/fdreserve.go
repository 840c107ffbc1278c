package tiers

import (
	"errors"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// fdReserve holds a few spare descriptors for the agent's own records. The agent holds a
// descriptor for each file open in the mount, so a job that holds many meets the agent's limit:
// its own opens then fail with EMFILE, as they should, but so did the record of the commit it
// had just made (the rename had returned), and the line telling the job so; a kill of the agent
// then lost the step (found by black-box runs with a lowered limit). Released, the reserve gives
// such a write its descriptors back once.
type fdReserve struct {
	// use is held by the retry whose op runs on the released reserve: retries take turns, and
	// no refill takes the released descriptors back under it (a review: another caller's
	// refill before use did, and the record fell into its 2-minute tries).
	use    sync.Mutex
	mu     sync.Mutex
	fds    []int // GUARDED_BY(mu)
	closed bool  // GUARDED_BY(mu); close ran: fill opens nothing more (a review: a retry in flight leaked)
}

// fdReserveSize is how many descriptors the reserve holds: a commit's record needs two at a time
// (a file copied into it), its notes one each, a line for the job one.
const fdReserveSize = 8

// fill opens what the reserve lacks, as far as the limit lets it.
func (r *fdReserve) fill() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for !r.closed && len(r.fds) < fdReserveSize {
		fd, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return
		}
		r.fds = append(r.fds, fd)
	}
}

// release closes the reserve's descriptors; it reports whether it held any.
func (r *fdReserve) release() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, fd := range r.fds {
		unix.Close(fd)
	}
	held := len(r.fds) > 0
	r.fds = nil
	return held
}

// retry runs op, and once more with the reserve released if it failed for lack of descriptors;
// the reserve is then filled again, as far as it can be. It waits for another write's turn on
// the reserve: never on a FUSE request's goroutine (tryRetry).
func (r *fdReserve) retry(op func() error) error { return r.retryWith(op, true) }

// tryRetry is retry for a FUSE request (the record of a job's rename): it does not wait for
// another write's turn on the reserve, and returns op's error instead. That write may be
// waiting for the kernel's lock of the mount's root, which the job's rename holds until the
// request returns (a notification of a name at the root): waiting for it hung the mount (a
// review). The sealer tries such a record again.
func (r *fdReserve) tryRetry(op func() error) error { return r.retryWith(op, false) }

func (r *fdReserve) retryWith(op func() error, wait bool) error {
	if r != nil && r.short() && r.use.TryLock() {
		r.fill() // used before, and the job's opens took the descriptors it freed: take them back
		r.use.Unlock()
	}
	err := op()
	if r == nil || !errors.Is(err, syscall.EMFILE) {
		return err
	}
	if wait {
		r.use.Lock()
	} else if !r.use.TryLock() {
		return err
	}
	defer r.use.Unlock()
	if r.short() {
		r.fill() // an earlier turn used them: refilled as far as the limit lets it
	}
	if !r.release() {
		return err
	}
	err = op()
	r.fill()
	return err
}

// short reports whether the reserve lacks descriptors.
func (r *fdReserve) short() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return !r.closed && len(r.fds) < fdReserveSize
}

// close releases the reserve for good.
func (r *fdReserve) close() {
	if r == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.closed = true // in the same hold as the release: a fill in between leaked (a review)
	for _, fd := range r.fds {
		unix.Close(fd)
	}
	r.fds = nil
}
