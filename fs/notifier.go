package fs

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/internal/fusectl"
)

// The entry invalidations (FUSE_NOTIFY_INVAL_ENTRY) are written by a helper process, not by
// the agent. The kernel takes the lock of the entry's directory before it drops the entry, and
// a job's lookup or create in that directory holds the same lock while it waits for the agent's
// answer. That wait is harmless while the agent runs (its other threads answer), but a SIGKILL
// that lands meanwhile left the agent's writing thread waiting for the lock, uninterruptibly,
// and the job's request waiting for an answer no thread would give any more: neither process
// could exit, and the mount hung (1 kill in 27 in a stress test). With the helper, no thread of
// the agent waits on a lock of its mount: a killed agent exits, the kernel ends the requests it
// had read and not answered (those of the device descriptor it closed), which frees the lock,
// and the helper, which writes on a descriptor of its own (FUSE_DEV_IOC_CLONE, so that the
// agent's descriptor is the one whose requests end), finishes its write, sees the agent gone
// and exits; the last descriptor closed, the kernel aborts the connection and the mount answers
// ENOTCONN as after any kill. If a job's request still waited unread when the agent died (all
// its reading threads busy), the helper's write would wait for it: the helper then aborts the
// connection itself (fusectl, as root; a user's helper tries too, untested) a second after the
// agent is gone, and again every second while that write waits.
//
// The helper is this same executable, started again with notifierEnv set (see init); it holds
// nothing but its socket to the agent, the cloned descriptor and the pipe (no stdout, stderr or
// working directory of the agent's), and ignores the job-control signals, so that a Ctrl-C to
// the agent's terminal leaves it to the agent to stop. It runs the agent's own executable as it
// was started (/proc/self/exe), even after an upgrade replaced the file. Where it
// cannot be started, the agent writes the notifications itself, as before.

const notifierEnv = "MTCFS_FUSE_NOTIFIER"

func init() {
	if os.Getenv(notifierEnv) == "1" {
		os.Exit(runNotifier())
	}
}

// fuseDevIocClone is FUSE_DEV_IOC_CLONE, _IOR(229, 0, uint32_t): attach a new /dev/fuse
// descriptor to the connection of another.
const fuseDevIocClone = 0x8004e500

// notifierHelper is the agent's end of a running helper.
type notifierHelper struct {
	conn *os.File // SOCK_SEQPACKET: one notification out, its errno (4 bytes) back
	life *os.File // the write end of a pipe the helper reads to see the agent gone
	cmd  *exec.Cmd
}

// startNotifier starts a helper that writes notifications on a clone of the mount's /dev/fuse
// descriptor fd, for the mount at dir; kind (entries, pages) names it in ps.
func startNotifier(fd int, dir, kind string) (*notifierHelper, error) {
	// The running executable itself, even if its file was replaced (an upgrade in place) or
	// removed since: a newer or older binary at its path might not be this helper.
	exe := "/proc/self/exe"
	if _, err := os.Stat(exe); err != nil {
		if exe, err = os.Executable(); err != nil {
			return nil, err
		}
	}
	// No mount may take the clone for its own device meanwhile (see newServer).
	deviceMu.Lock()
	defer deviceMu.Unlock()
	clone, err := unix.Open("/dev/fuse", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open /dev/fuse: %w", err)
	}
	cloneFile := os.NewFile(uintptr(clone), "/dev/fuse")
	defer cloneFile.Close()
	src := uint32(fd)
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(clone), fuseDevIocClone, uintptr(unsafe.Pointer(&src))); errno != 0 {
		return nil, fmt.Errorf("FUSE_DEV_IOC_CLONE: %w", errno)
	}
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	mine, theirs := os.NewFile(uintptr(pair[0]), "notifier"), os.NewFile(uintptr(pair[1]), "notifier")
	defer theirs.Close()
	lifeR, lifeW, err := os.Pipe() // close-on-exec, as every descriptor Go opens
	if err != nil {
		mine.Close()
		return nil, err
	}
	defer lifeR.Close()
	cmd := &exec.Cmd{
		Path:       exe,
		Args:       []string{"mtcfs-fuse-notifier", dir, kind},
		Env:        append(os.Environ(), notifierEnv+"=1"),
		ExtraFiles: []*os.File{theirs, cloneFile, lifeR}, // fds 3, 4 and 5
		Dir:        "/",
		// No stdout or stderr: a helper that outlives the agent for a moment must not hold a
		// supervisor's pipe open. (It prints nothing; the agent logs what goes wrong with it.)
		SysProcAttr: &syscall.SysProcAttr{Setpgid: true},
	}
	if err := cmd.Start(); err != nil {
		mine.Close()
		lifeW.Close()
		return nil, err
	}
	go cmd.Wait()
	return &notifierHelper{conn: mine, life: lifeW, cmd: cmd}, nil
}

// send has the helper write msg, and returns the write's error; ok is false if the helper is
// gone (nothing was written).
func (h *notifierHelper) send(msg []byte) (err error, ok bool) {
	if _, err := h.conn.Write(msg); err != nil {
		return nil, false
	}
	var reply [4]byte
	if n, err := h.conn.Read(reply[:]); err != nil || n != len(reply) {
		return nil, false
	}
	if e := binary.NativeEndian.Uint32(reply[:]); e != 0 {
		return syscall.Errno(e), true
	}
	return nil, true
}

// close stops the helper: it exits once it sees the end of its socket.
func (h *notifierHelper) close() {
	h.conn.Close()
	h.life.Close()
}

// runNotifier is the helper process: fd 3 its socket to the agent, fd 4 its /dev/fuse
// descriptor, fd 5 a pipe that ends when the agent is gone, os.Args[1] the mount's directory.
// It returns the exit code.
func runNotifier() int {
	signal.Ignore(syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGQUIT, syscall.SIGPIPE)
	// Its name in ps and top (it runs from init, on the main thread): "exe" otherwise, from
	// /proc/self/exe.
	name := []byte("mtcfs-notifier\x00")
	unix.Prctl(unix.PR_SET_NAME, uintptr(unsafe.Pointer(&name[0])), 0, 0, 0)
	conn, dev, life := os.NewFile(3, "notifier"), os.NewFile(4, "/dev/fuse"), os.NewFile(5, "life")
	if conn == nil || dev == nil || life == nil {
		return 2
	}
	var writing, agentGone atomic.Bool
	go func() {
		var b [1]byte
		life.Read(b[:]) // returns once the agent has closed its end: stopped, or gone
		agentGone.Store(true)
		for time.Sleep(time.Second); writing.Load(); time.Sleep(time.Second) {
			// A write still waits, for a request no one will read: abort the connection,
			// which ends it and the write. (A user's helper tries too: fusectl's files are
			// said to belong to the user who mounted; not tried here.)
			if len(os.Args) > 1 {
				fusectl.Abort(os.Args[1])
			}
		}
		os.Exit(0) // nothing waits any more; the socket may not have ended yet
	}()
	buf := make([]byte, 4096)
	for {
		n, err := conn.Read(buf)
		if err != nil || n == 0 || agentGone.Load() {
			return 0 // nobody needs a notification any more once the agent is gone
		}
		writing.Store(true)
		_, err = dev.Write(buf[:n])
		writing.Store(false)
		var reply [4]byte
		var errno syscall.Errno
		if errors.As(err, &errno) {
			binary.NativeEndian.PutUint32(reply[:], uint32(errno))
		} else if err != nil {
			binary.NativeEndian.PutUint32(reply[:], uint32(syscall.EIO))
		}
		if _, err := conn.Write(reply[:]); err != nil {
			return 0
		}
	}
}
