package fs

import (
	"encoding/binary"
	"errors"
	"log/slog"
	"os"
	"strconv"
	"sync"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// kernelNotifier writes the notifications whose write(2) can wait for the kernel: through a
// helper process where it can (notifier.go explains why), each kind through a helper of its
// own, so that neither waits behind the other.
//
// Entry invalidations (FUSE_NOTIFY_INVAL_ENTRY, written here: go-fuse v2.12 cannot set the
// notification's flags) tell the kernel that a name of the mount has changed. Where the kernel
// can (FUSE_EXPIRE_ONLY, protocol 7.38, Linux 6.2+), a name's entry only expires, without the
// kernel dropping what it cached below that name. A plain invalidation of a step's directory
// makes the kernel drop every dentry and inode below it before it answers, holding the lock of
// the mount's root: 0.4 s for a step of 100,000 files, during which the job's own lookups and
// creates at the root wait, and the seal with them. Expired, the entry is looked up again the
// next time a path walk reaches it, which is all the correctness needs; if the directory it led
// to now has another name (a seal renames the step to its data name), the kernel moves the
// cached dentry there on that lookup, and drops the subtree only if the old name is asked for
// again.
//
// Page invalidations (FUSE_NOTIFY_INVAL_INODE from offset 0) have the kernel write back the
// pages a job dirtied through a mapping before a commit (writeback.go); the kernel sends a WRITE
// for each dirty page, which the agent's readers answer, before the write(2) returns. They must
// not wait behind an entry invalidation: that one may wait for the root's lock, which the job's
// rename holds while it waits for the very write-back (found by a review).
//
// A notification is one write(2) of a header and its arguments; the kernel takes it from any
// descriptor of the connection, beside go-fuse's own writes.
type kernelNotifier struct {
	f          *os.File // a duplicate of the mount's /dev/fuse descriptor, close-on-exec
	expireOnly bool     // the kernel can expire an entry only
	entries    notifyChannel
	pages      notifyChannel
}

// notifyChannel is one helper process, or, without one, the agent writing itself.
type notifyChannel struct {
	mu     sync.Mutex
	helper *notifierHelper // GUARDED_BY(mu); nil: the notifications are written here
}

// expire sends the notification that expires name in the directory of node id parent (only
// when expireOnly).
func (e *kernelNotifier) expire(parent uint64, name string) error {
	return e.sendEntry(parent, name, fuse.EXPIRE_ONLY)
}

// invalidate makes the kernel drop name in the directory of node id parent, and everything it
// cached below it.
func (e *kernelNotifier) invalidate(parent uint64, name string) error {
	return e.sendEntry(parent, name, 0)
}

// notifyHeader is struct fuse_out_header: len, error (the notify code), unique (0).
const notifyHeader = 16

func (e *kernelNotifier) sendEntry(parent uint64, name string, flags uint32) error {
	msg := make([]byte, notifyHeader+16+len(name)+1)
	binary.NativeEndian.PutUint32(msg[0:], uint32(len(msg)))
	binary.NativeEndian.PutUint32(msg[4:], uint32(-fuse.NOTIFY_INVAL_ENTRY))
	// struct fuse_notify_inval_entry_out: parent, namelen, flags; then the name and a NUL.
	binary.NativeEndian.PutUint64(msg[notifyHeader:], parent)
	binary.NativeEndian.PutUint32(msg[notifyHeader+8:], uint32(len(name)))
	binary.NativeEndian.PutUint32(msg[notifyHeader+12:], flags)
	copy(msg[notifyHeader+16:], name)
	return e.entries.send(e.f, msg)
}

// writeBackPages has the kernel write back the dirty pages of the file of node id node and drop
// its cached pages and attributes (FUSE_NOTIFY_INVAL_INODE from offset 0 to the end).
func (e *kernelNotifier) writeBackPages(node uint64) error {
	msg := make([]byte, notifyHeader+24)
	binary.NativeEndian.PutUint32(msg[0:], uint32(len(msg)))
	binary.NativeEndian.PutUint32(msg[4:], uint32(-fuse.NOTIFY_INVAL_INODE))
	// struct fuse_notify_inval_inode_out: ino, off, len (0: to the end).
	binary.NativeEndian.PutUint64(msg[notifyHeader:], node)
	return e.pages.send(e.f, msg)
}

func (c *notifyChannel) send(f *os.File, msg []byte) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.helper != nil {
		err, ok := c.helper.send(msg)
		if ok {
			return err
		}
		c.helper.close()
		c.helper = nil
		slog.Warn("a FUSE notification helper is gone; the agent writes its notifications itself from now on (a kill -9 of the agent may then leave its mount hung, see mtcfs mount's takeover of such a mount)")
	}
	_, err := f.Write(msg)
	return err
}

func (c *notifyChannel) usesHelper() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.helper != nil
}

func (c *notifyChannel) close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.helper != nil {
		c.helper.close()
		c.helper = nil
	}
}

// usesHelper reports whether the notifications go through helper processes.
func (e *kernelNotifier) usesHelper() bool {
	return e.entries.usesHelper() && e.pages.usesHelper()
}

// notifyFailed reports whether err, from expire or invalidate, leaves the entry to invalidate
// another way (ENOENT: the kernel has no entry for the name, nothing to do).
func notifyFailed(err error) bool { return err != nil && !errors.Is(err, unix.ENOENT) }

// close stops the helpers and releases the duplicate; then every notification fails with
// os.ErrClosed.
func (e *kernelNotifier) close() {
	e.entries.close()
	e.pages.close()
	e.f.Close()
}

// newKernelNotifier returns the notifier for srv's connection mounted at dir, given dup, a
// duplicate of its /dev/fuse descriptor (newServer's; -1 if none), or nil without one (the
// caller then notifies as go-fuse does). It owns dup either way.
func newKernelNotifier(srv *fuse.Server, dup int, dir string, log *slog.Logger) *kernelNotifier {
	if dup < 0 {
		return nil
	}
	e := &kernelNotifier{f: os.NewFile(uintptr(dup), "/dev/fuse"), expireOnly: srv.KernelSettings().Flags64()&fuse.CAP_HAS_EXPIRE_ONLY != 0}
	for kind, c := range map[string]*notifyChannel{"entries": &e.entries, "pages": &e.pages} {
		h, err := startNotifier(dup, dir, kind)
		if err != nil {
			log.Warn("no FUSE notification helper; the agent writes these notifications itself (a kill -9 of the agent may then leave its mount hung, see mtcfs mount's takeover of such a mount)", "helper", kind, "err", err)
		}
		c.helper = h
	}
	return e
}

// dupFUSEDevice duplicates fd (close-on-exec) if it is open on the FUSE device (character
// device 10:229), and returns -1 otherwise or for fd < 0.
func dupFUSEDevice(fd int) int {
	if fd < 0 {
		return -1
	}
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return -1
	}
	var st unix.Stat_t
	if unix.Fstat(dup, &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFCHR || unix.Major(st.Rdev) != 10 || unix.Minor(st.Rdev) != 229 {
		unix.Close(dup)
		return -1
	}
	return dup
}

// deviceMu serializes mounts within the process (and CheckMountable's probe of /dev/fuse), so
// that the /dev/fuse descriptor that appears during one is that mount's.
var deviceMu sync.Mutex

// fuseDescriptors lists the descriptors of this process open on /dev/fuse.
func fuseDescriptors() map[int]bool {
	fds := map[int]bool{}
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return fds
	}
	for _, e := range ents {
		if target, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && target == "/dev/fuse" {
			if fd, err := strconv.Atoi(e.Name()); err == nil {
				fds[fd] = true
			}
		}
	}
	return fds
}

// newDescriptor returns the one descriptor of after that is not in before, or -1 if there is
// not exactly one (another descriptor closed and its number reused meanwhile: the caller does
// without).
func newDescriptor(before, after map[int]bool) int {
	fd := -1
	for n := range after {
		if !before[n] {
			if fd >= 0 {
				return -1
			}
			fd = n
		}
	}
	return fd
}
