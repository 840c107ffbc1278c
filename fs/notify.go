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

// entryNotifier tells the kernel that a name of the mount has changed, with
// FUSE_NOTIFY_INVAL_ENTRY, which it writes itself (go-fuse v2.12 cannot set the notification's
// flags), through a helper process where it can (notifier.go explains why).
//
// Where the kernel can (FUSE_EXPIRE_ONLY, protocol 7.38, Linux 6.2+), a name's entry only
// expires, without the kernel dropping what it cached below that name. A plain invalidation of
// a step's directory makes the kernel drop every dentry and inode below it before it answers,
// holding the lock of the mount's root: 0.4 s for a step of 100,000 files, during which the
// job's own lookups and creates at the root wait, and the seal with them. Expired, the entry is
// looked up again the next time a path walk reaches it, which is all the correctness needs; if
// the directory it led to now has another name (a seal renames the step to its data name), the
// kernel moves the cached dentry there on that lookup, and drops the subtree only if the old
// name is asked for again.
//
// A notification is one write(2) of a header and its arguments; the kernel takes it from any
// descriptor of the connection, beside go-fuse's own writes.
type entryNotifier struct {
	f          *os.File // a duplicate of the mount's /dev/fuse descriptor, close-on-exec
	expireOnly bool     // the kernel can expire an entry only
	mu         sync.Mutex
	helper     *notifierHelper // GUARDED_BY(mu); nil: the notifications are written here
}

// expire sends the notification that expires name in the directory of node id parent (only
// when expireOnly).
func (e *entryNotifier) expire(parent uint64, name string) error {
	return e.send(parent, name, fuse.EXPIRE_ONLY)
}

// invalidate makes the kernel drop name in the directory of node id parent, and everything it
// cached below it.
func (e *entryNotifier) invalidate(parent uint64, name string) error {
	return e.send(parent, name, 0)
}

func (e *entryNotifier) send(parent uint64, name string, flags uint32) error {
	const header = 16 // struct fuse_out_header: len, error (the notify code), unique (0)
	msg := make([]byte, header+16+len(name)+1)
	binary.NativeEndian.PutUint32(msg[0:], uint32(len(msg)))
	binary.NativeEndian.PutUint32(msg[4:], uint32(-fuse.NOTIFY_INVAL_ENTRY))
	// struct fuse_notify_inval_entry_out: parent, namelen, flags; then the name and a NUL.
	binary.NativeEndian.PutUint64(msg[header:], parent)
	binary.NativeEndian.PutUint32(msg[header+8:], uint32(len(name)))
	binary.NativeEndian.PutUint32(msg[header+12:], flags)
	copy(msg[header+16:], name)
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.helper != nil {
		err, ok := e.helper.send(msg)
		if ok {
			return err
		}
		e.helper.close()
		e.helper = nil
		slog.Warn("the FUSE notification helper is gone; the agent writes its notifications itself from now on (a kill -9 of the agent may then leave its mount hung, see mtcfs mount's takeover of such a mount)")
	}
	_, err := e.f.Write(msg)
	return err
}

// usesHelper reports whether the notifications go through the helper process.
func (e *entryNotifier) usesHelper() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.helper != nil
}

// notifyFailed reports whether err, from expire or invalidate, leaves the entry to invalidate
// another way (ENOENT: the kernel has no entry for the name, nothing to do).
func notifyFailed(err error) bool { return err != nil && !errors.Is(err, unix.ENOENT) }

// close stops the helper and releases the duplicate; then every notification fails with
// os.ErrClosed.
func (e *entryNotifier) close() {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.helper != nil {
		e.helper.close()
		e.helper = nil
	}
	e.f.Close()
}

// newEntryNotifier returns the notifier for srv's connection mounted at dir, given dup, a
// duplicate of its /dev/fuse descriptor (newServer's; -1 if none), or nil without one (the
// caller then invalidates entries as go-fuse does). It owns dup either way.
func newEntryNotifier(srv *fuse.Server, dup int, dir string, log *slog.Logger) *entryNotifier {
	if dup < 0 {
		return nil
	}
	e := &entryNotifier{f: os.NewFile(uintptr(dup), "/dev/fuse"), expireOnly: srv.KernelSettings().Flags64()&fuse.CAP_HAS_EXPIRE_ONLY != 0}
	h, err := startNotifier(dup, dir)
	if err != nil {
		log.Warn("no FUSE notification helper; the agent writes its notifications itself (a kill -9 of the agent may then leave its mount hung, see mtcfs mount's takeover of such a mount)", "err", err)
	}
	e.helper = h
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
