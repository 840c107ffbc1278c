package layout

import (
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// An io_uring instance, just enough of it to open and close many files with few system calls:
// a restart verifies every file of every step still in the spool, and on a machine whose system
// calls are expensive (a VM with page-table isolation: 1 µs for getppid on the one of issue 12)
// the openat2 and the close of a small file cost more than reading and hashing it. Submitted in
// batches, opens complete inline in io_uring_enter (a cached lookup on tmpfs), and closes do not
// return to user space one by one. Reads are not done through the ring: tmpfs cannot read
// without blocking as io_uring asks, so a read would go to an io_uring worker thread, which cost
// more than a pread here.
//
// No library: the Go module proxy serves none of the Go io_uring packages (checked 2026-12-04),
// and this uses two operations and the probe of the kernel's stable ABI (linux/io_uring.h).

// uringParams is struct io_uring_params.
type uringParams struct {
	sqEntries, cqEntries, flags, sqThreadCPU, sqThreadIdle, features, wqFd uint32
	resv                                                                   [3]uint32
	sqOff                                                                  struct {
		head, tail, ringMask, ringEntries, flags, dropped, array, resv1 uint32
		userAddr                                                        uint64
	}
	cqOff struct {
		head, tail, ringMask, ringEntries, overflow, cqes, flags, resv1 uint32
		userAddr                                                        uint64
	}
}

// uringSQE is struct io_uring_sqe (64 bytes).
type uringSQE struct {
	opcode      uint8
	flags       uint8
	ioprio      uint16
	fd          int32
	off         uint64 // addr2: open_how for OPENAT2
	addr        uint64 // the path for OPENAT2
	len         uint32 // sizeof(open_how) for OPENAT2
	opFlags     uint32
	userData    uint64
	bufIndex    uint16
	personality uint16
	fileIndex   uint32
	addr3       uint64
	_           uint64
}

// uringCQE is struct io_uring_cqe.
type uringCQE struct {
	userData uint64
	res      int32
	flags    uint32
}

const (
	uringOpClose   = 19
	uringOpOpenat2 = 28

	uringEnterGetevents = 1 << 0
	uringFeatSingleMmap = 1 << 0
	uringOffSQEs        = 0x10000000
	uringRegisterProbe  = 8
	uringOpSupported    = 1 << 0
)

// uringProbe is struct io_uring_probe with room for 256 struct io_uring_probe_op.
type uringProbe struct {
	lastOp, opsLen uint8
	_              uint16
	_              [3]uint32
	ops            [256]struct {
		op    uint8
		_     uint8
		flags uint16
		_     uint32
	}
}

// Test hooks: closeOp is the opcode queued for a close (a test makes it one the kernel refuses,
// as a kernel without IORING_OP_CLOSE would), enterErr fails an io_uring_enter.
var (
	closeOp  uint8 = uringOpClose
	enterErr func() unix.Errno
)

// ring is one io_uring; it is not safe for concurrent use (each hashing worker has its own).
type ring struct {
	fd             int
	mem, sqeMem    []byte
	sqes           []uringSQE
	sqTail, cqHead *uint32
	cqTail         *uint32
	sqMask, cqMask uint32
	sqArray        []uint32
	cqes           []uringCQE
	unsubmitted    uint32 // SQEs queued since the last enter
	inflight       int    // submitted, completion not yet reaped
}

// ringsMade counts rings set up (a test's proof that the ring path ran).
var ringsMade atomic.Int64

// newRingHook, when set, replaces newRing (a test makes rings unavailable).
var newRingHook func(entries uint32) (*ring, error)

// newRing sets up a ring of entries submission slots. It fails where io_uring is unavailable or
// lacks OPENAT2 or CLOSE: a kernel before 5.6 (its probe fails), a kernel.io_uring_disabled
// sysctl, or a seccomp profile that refuses io_uring_setup (containerd's RuntimeDefault and
// Docker's default do); callers then use plain system calls.
func newRing(entries uint32) (*ring, error) {
	if newRingHook != nil {
		return newRingHook(entries)
	}
	var p uringParams
	fd, _, errno := unix.Syscall(unix.SYS_IO_URING_SETUP, uintptr(entries), uintptr(unsafe.Pointer(&p)), 0)
	if errno != 0 {
		return nil, errno
	}
	r := &ring{fd: int(fd)}
	if p.features&uringFeatSingleMmap == 0 { // before 5.4
		unix.Close(r.fd)
		return nil, errors.New("io_uring without IORING_FEAT_SINGLE_MMAP")
	}
	size := max(p.sqOff.array+p.sqEntries*4, p.cqOff.cqes+p.cqEntries*uint32(unsafe.Sizeof(uringCQE{})))
	var err error
	if r.mem, err = unix.Mmap(r.fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE); err != nil {
		unix.Close(r.fd)
		return nil, err
	}
	if r.sqeMem, err = unix.Mmap(r.fd, uringOffSQEs, int(p.sqEntries)*int(unsafe.Sizeof(uringSQE{})), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE); err != nil {
		unix.Munmap(r.mem)
		unix.Close(r.fd)
		return nil, err
	}
	m := r.mem
	r.sqes = unsafe.Slice((*uringSQE)(unsafe.Pointer(&r.sqeMem[0])), p.sqEntries)
	r.sqTail = (*uint32)(unsafe.Pointer(&m[p.sqOff.tail]))
	r.sqMask = *(*uint32)(unsafe.Pointer(&m[p.sqOff.ringMask]))
	r.sqArray = unsafe.Slice((*uint32)(unsafe.Pointer(&m[p.sqOff.array])), p.sqEntries)
	r.cqHead = (*uint32)(unsafe.Pointer(&m[p.cqOff.head]))
	r.cqTail = (*uint32)(unsafe.Pointer(&m[p.cqOff.tail]))
	r.cqMask = *(*uint32)(unsafe.Pointer(&m[p.cqOff.ringMask]))
	r.cqes = unsafe.Slice((*uringCQE)(unsafe.Pointer(&m[p.cqOff.cqes])), p.cqEntries)
	var probe uringProbe
	if _, _, errno := unix.Syscall6(unix.SYS_IO_URING_REGISTER, uintptr(r.fd), uringRegisterProbe, uintptr(unsafe.Pointer(&probe)), uintptr(len(probe.ops)), 0, 0); errno != 0 {
		r.release()
		return nil, fmt.Errorf("io_uring probe: %w", errno) // before 5.6
	}
	for _, op := range []uint8{uringOpOpenat2, uringOpClose} {
		if op > probe.lastOp || probe.ops[op].flags&uringOpSupported == 0 {
			r.release()
			return nil, fmt.Errorf("io_uring without operation %d", op)
		}
	}
	ringsMade.Add(1)
	return r, nil
}

// release unmaps and closes the ring; the caller has reaped what was in flight.
func (r *ring) release() {
	unix.Munmap(r.sqeMem)
	unix.Munmap(r.mem)
	unix.Close(r.fd)
}

// next queues a zeroed SQE. Callers queue at most len(sqes) between two waits (a batch's opens
// and the previous batch's closes).
func (r *ring) next() *uringSQE {
	tail := *r.sqTail
	i := tail & r.sqMask
	s := &r.sqes[i]
	*s = uringSQE{}
	r.sqArray[i] = i
	atomic.StoreUint32(r.sqTail, tail+1)
	r.unsubmitted++
	r.inflight++
	return s
}

// openat2 queues openat2(dirfd, path, how); path is NUL-terminated, and it and how must stay
// alive until the next wait returns (the kernel copies both when it takes the SQE).
func (r *ring) openat2(dirfd int, path []byte, how *unix.OpenHow, user uint64) {
	s := r.next()
	s.opcode, s.fd = uringOpOpenat2, int32(dirfd)
	s.addr = uint64(uintptr(unsafe.Pointer(&path[0])))
	s.off, s.len = uint64(uintptr(unsafe.Pointer(how))), uint32(unsafe.Sizeof(*how))
	s.userData = user
}

// closeTag marks a close's user data (the rest is the descriptor); an open's is its index in
// the batch.
const closeTag = uint64(1) << 63

// close queues close(fd).
func (r *ring) close(fd int) {
	s := r.next()
	s.opcode, s.fd, s.userData = closeOp, int32(fd), closeTag|uint64(uint32(fd))
}

// wait submits what is queued and hands done every completion until n have been reaped
// (n ≤ inflight). A close the kernel refused as invalid (the descriptor is still open then) is
// done with close(2). io_uring_enter fails only without taking any SQE: on a lack of memory or
// a full completion queue it is tried again (this loop reaps in between). Any other failure
// (none is known once a ring works: a policy would refuse io_uring_setup already) takes the
// SQEs not yet submitted back, does their closes with close(2), reaps the completions already
// there and returns the error; the ring must not be used again. An operation still running in
// the kernel then (none of the ones used here is handed to a worker thread on tmpfs) is
// finished by the kernel when the ring is released.
func (r *ring) wait(n int, done func(user uint64, res int32)) error {
	reap := func() {
		head, tail := *r.cqHead, atomic.LoadUint32(r.cqTail)
		for ; head != tail; head++ {
			c := r.cqes[head&r.cqMask]
			if c.userData&closeTag != 0 && c.res == -int32(unix.EINVAL) {
				unix.Close(int(int32(uint32(c.userData))))
			}
			done(c.userData, c.res)
			r.inflight--
			n--
		}
		atomic.StoreUint32(r.cqHead, head)
	}
	for n > 0 || r.unsubmitted > 0 {
		var took uintptr
		var errno unix.Errno
		if enterErr != nil {
			errno = enterErr()
		}
		if errno == 0 {
			took, _, errno = unix.Syscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), uintptr(r.unsubmitted), uintptr(max(n, 0)), uringEnterGetevents, 0, 0)
		}
		switch errno {
		case 0:
			r.unsubmitted -= uint32(took)
		case unix.EINTR, unix.EAGAIN, unix.EBUSY, unix.ENOMEM:
			runtime.Gosched()
		default:
			r.retract()
			reap()
			return fmt.Errorf("io_uring_enter: %w", errno)
		}
		reap()
	}
	return nil
}

// retract takes back the SQEs queued since the last submission (the kernel reads SQEs only in
// io_uring_enter) and does their closes with close(2).
func (r *ring) retract() {
	tail := *r.sqTail
	for i := uint32(1); i <= r.unsubmitted; i++ {
		if s := &r.sqes[(tail-i)&r.sqMask]; s.opcode == closeOp {
			unix.Close(int(s.fd))
		}
	}
	atomic.StoreUint32(r.sqTail, tail-r.unsubmitted)
	r.inflight -= int(r.unsubmitted)
	r.unsubmitted = 0
}

// ringBatch is how many files a hashing worker opens with one io_uring_enter (the closes of
// the batch before go with it).
const ringBatch = 32

// ringFrom is the number of files from which hashEntries opens them through rings (a ring per
// worker). Setting up and releasing a ring took 46 µs on the VM of issue 12 (107 µs while other
// benchmarks ran), what opening and closing 15 to 35 files through it saves; below, the plain
// calls cost a tree of a few hundred files well under a millisecond more.
var ringFrom = 512

// batchOpener opens files of a Dir for one hashing worker, ringBatch at a time, and closes
// them; it is not safe for concurrent use. Without a ring (plainOpener, or after a failure of
// its ring) it opens nothing (the caller opens each file itself) and closes with close(2).
type batchOpener struct {
	d     *Dir
	r     *ring // nil once it failed
	how   unix.OpenHow
	paths [ringBatch][]byte // NUL-terminated; the kernel reads them during wait
	fds   [ringBatch]int
}

// newBatchOpener returns a batchOpener for d, or nil where no ring can be set up (the caller
// opens files one by one).
func newBatchOpener(d *Dir) *batchOpener {
	r, err := newRing(2 * ringBatch) // a batch's opens and the closes of the one before
	if err != nil {
		return nil
	}
	// As Dir.openAt: nothing outside the tree, no symlink followed, and a FIFO does not block.
	return &batchOpener{d: d, r: r, how: unix.OpenHow{Flags: unix.O_RDONLY | unix.O_NONBLOCK | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS}}
}

// plainOpener is a batchOpener without a ring.
func plainOpener(d *Dir) *batchOpener { return &batchOpener{d: d} }

// ringFDsFit says whether workers hashing workers may each hold a batch of descriptors (and a
// batch waiting to be closed) well within the process's limit; the plain path holds one each.
func ringFDsFit(workers int) bool {
	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &rl); err != nil {
		return false
	}
	return rl.Cur == unix.RLIM_INFINITY || rl.Cur >= uint64(4*ringBatch*workers+1024)
}

// open opens the n (≤ ringBatch) files path(0..n-1), relative to the Dir, and submits the
// closes queued since the last call. An entry of the result is a descriptor for the caller to
// close (through close), or -1 where the ring did not open the file: the caller opens it with
// Dir.openRaw, whose error is the one to report (and which walks paths too long for one call).
func (b *batchOpener) open(n int, path func(k int) string) []int {
	for k := range n {
		b.fds[k] = -1
	}
	if b.r == nil {
		return b.fds[:n]
	}
	for k := range n {
		p := path(k)
		if p == "" || len(p) >= unix.PathMax || strings.IndexByte(p, 0) >= 0 {
			continue
		}
		b.paths[k] = append(append(b.paths[k][:0], p...), 0)
		b.r.openat2(b.d.fd, b.paths[k], &b.how, uint64(k))
	}
	if err := b.r.wait(b.r.inflight, func(user uint64, res int32) {
		if user&closeTag == 0 && res >= 0 {
			b.fds[user] = int(res)
		}
	}); err != nil {
		b.r.release()
		b.r = nil
	}
	return b.fds[:n]
}

// close queues the close of fd, a descriptor open returned or any other the caller hands over.
func (b *batchOpener) close(fd int) {
	if b.r == nil {
		unix.Close(fd)
		return
	}
	b.r.close(fd)
}

// free closes what is queued and releases the ring.
func (b *batchOpener) free() {
	if b.r == nil {
		return
	}
	b.r.wait(b.r.inflight, func(uint64, int32) {})
	b.r.release()
}
