package fs

import (
	"context"
	"errors"
	"io/fs"
	"syscall"

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
