package fs

import (
	"encoding/binary"
	"errors"
	"os"
	"strconv"
	"sync"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// entryExpirer tells the kernel that a name of the mount has changed without making it drop
// what it cached below that name: FUSE_NOTIFY_INVAL_ENTRY with FUSE_EXPIRE_ONLY (protocol 7.38,
// Linux 6.2+). go-fuse v2.12 sends this notification with its flags at 0 and has no way to set
// them, and a plain invalidation of a step's directory makes the kernel drop every dentry and
// inode below it before it answers, holding the lock of the mount's root: 0.4 s for a step of
// 100,000 files, during which the job's own lookups and creates at the root wait, and the seal
// with them. Expired, the entry is looked up again the next time a path walk reaches it, which
// is all the correctness needs; if the directory it led to now has another name (a seal renames
// the step to its data name), the kernel moves the cached dentry there on that lookup, and drops
// the subtree only if the old name is asked for again.
//
// The expirer writes the notification itself on a duplicate of the mount's /dev/fuse
// descriptor (a notification is one write(2) of a header and its arguments; the kernel takes
// it from any descriptor of the connection, beside go-fuse's own writes).
type entryExpirer struct {
	f *os.File // a duplicate of the mount's /dev/fuse descriptor, close-on-exec
}

// expire sends the notification for name in the directory of node id parent.
func (e *entryExpirer) expire(parent uint64, name string) error {
	const header = 16 // struct fuse_out_header: len, error (the notify code), unique (0)
	msg := make([]byte, header+16+len(name)+1)
	binary.NativeEndian.PutUint32(msg[0:], uint32(len(msg)))
	binary.NativeEndian.PutUint32(msg[4:], uint32(-fuse.NOTIFY_INVAL_ENTRY))
	// struct fuse_notify_inval_entry_out: parent, namelen, flags; then the name and a NUL.
	binary.NativeEndian.PutUint64(msg[header:], parent)
	binary.NativeEndian.PutUint32(msg[header+8:], uint32(len(name)))
	binary.NativeEndian.PutUint32(msg[header+12:], fuse.EXPIRE_ONLY)
	copy(msg[header+16:], name)
	_, err := e.f.Write(msg)
	return err
}

// expireFailed reports whether err, from expire, leaves the entry to invalidate another way.
func expireFailed(err error) bool { return err != nil && !errors.Is(err, unix.ENOENT) }

// close releases the duplicate; once it is closed, expire fails with os.ErrClosed.
func (e *entryExpirer) close() { e.f.Close() }

// newEntryExpirer returns an expirer for srv's connection, given dup, a duplicate of its
// /dev/fuse descriptor (newServer's; -1 if none), or nil if the kernel cannot expire an entry
// only (the caller then invalidates entries as go-fuse does). It owns dup either way.
func newEntryExpirer(srv *fuse.Server, dup int) *entryExpirer {
	if dup < 0 {
		return nil
	}
	if srv.KernelSettings().Flags64()&fuse.CAP_HAS_EXPIRE_ONLY == 0 {
		unix.Close(dup)
		return nil
	}
	return &entryExpirer{f: os.NewFile(uintptr(dup), "/dev/fuse")}
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
