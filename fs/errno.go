package fs

import (
	"context"
	"errors"
	"io/fs"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/tiers"
)

// toErrno is the one place where errors become errno values for the kernel. Unknown errors are
// logged (through the mount's logger) and reported as EIO: a client must never see ENOSYS for
// something we implement.
func (m *mtfs) toErrno(op string, err error) syscall.Errno {
	if err == nil {
		return 0
	}
	var errno syscall.Errno
	switch {
	case errors.As(err, &errno):
		if errno == syscall.ENOSYS {
			break
		}
		if errno == syscall.EMFILE || errno == syscall.ENFILE {
			m.reportOutOfFDs(op, errno)
		}
		return errno
	case errors.Is(err, tiers.ErrNoSpace):
		return syscall.ENOSPC
	case errors.Is(err, fs.ErrNotExist):
		return syscall.ENOENT
	case errors.Is(err, fs.ErrExist):
		return syscall.EEXIST
	case errors.Is(err, fs.ErrPermission):
		return syscall.EACCES
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return syscall.EINTR
	}
	m.log.Error("unexpected error, reporting EIO", "op", op, "err", err)
	return syscall.EIO
}

// outOfFDsEvery is how often reportOutOfFDs logs at most.
const outOfFDsEvery = 10 * time.Second

// reportOutOfFDs logs (at most every outOfFDsEvery) that the agent could not open a file for
// want of descriptors. The agent holds one for every file open in the mount, so the job sees
// "Too many open files" for the agent's limit, not its own: only the agent's log can say so.
func (m *mtfs) reportOutOfFDs(op string, errno syscall.Errno) {
	now, last := time.Now().UnixNano(), m.fdsReported.Load()
	if (last != 0 && now-last < int64(outOfFDsEvery)) || !m.fdsReported.CompareAndSwap(last, now) {
		return
	}
	if errno == syscall.ENFILE {
		m.log.Error("the system is out of file descriptors (fs.file-max): the job sees \"Too many open files in system\"", "op", op)
		return
	}
	var rl unix.Rlimit
	_ = unix.Getrlimit(unix.RLIMIT_NOFILE, &rl)
	m.log.Error("the agent is out of file descriptors: it holds one for each file open in the mount, so the job sees \"Too many open files\" at the agent's limit; raise it (ulimit -n, systemd LimitNOFILE, the container's nofile limit)",
		"op", op, "limit", rl.Cur)
}
