package fs

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/internal/fusectl"
	"github.com/mtcfs/mtcfs/tiers"
)

// PassthroughMode selects how regular files' bytes reach the spool.
type PassthroughMode string

const (
	PassthroughAuto PassthroughMode = "auto" // passthrough when the kernel and privileges allow
	PassthroughOn   PassthroughMode = "on"   // passthrough or fail to mount
	PassthroughOff  PassthroughMode = "off"  // every read and write goes through the agent
)

// ParsePassthroughMode validates a --passthrough value.
func ParsePassthroughMode(s string) (PassthroughMode, error) {
	switch m := PassthroughMode(s); m {
	case PassthroughAuto, PassthroughOn, PassthroughOff:
		return m, nil
	}
	return "", fmt.Errorf("invalid passthrough mode %q: want auto, on or off", s)
}

// Options configure a mount.
type Options struct {
	Spool       *tiers.Spool
	Passthrough PassthroughMode
	// CacheTimeout is how long the kernel may cache entries and attributes (default 5s).
	// Every change the agent makes itself invalidates the kernel's copy, so it can be long.
	CacheTimeout time.Duration
	// Xattrs enables extended attributes. Off by default: with them on, the kernel asks the
	// agent for security.capability before every write(2), one round trip per write even with
	// passthrough; checkpoint writers do not use xattrs.
	Xattrs bool
	// Events receives the job's changes (commits, closes); nil for a plain filesystem.
	Events tiers.Events
	Debug  bool
	// Logger receives the filesystem's log lines and go-fuse's own (default slog.Default()).
	Logger *slog.Logger
	// Owner sets the owner, group and permission bits of the mount's root; each nil field
	// takes the mount point directory's own (SPEC §10), so a job running as the directory's
	// owner can write into a mount a root agent serves.
	Owner RootOwner
	// InProcess is set when the process that mounts also opens files on the mount (tests;
	// the agent never does, see Mount): Mount then runs go-fuse's poll hack before it
	// returns.
	InProcess bool
}

// RootOwner overrides the mount root's attributes (nil: the mount point's).
type RootOwner struct {
	UID, GID *uint32
	Mode     *uint32 // permission bits, e.g. 0o755
}

// Server is a mounted mtcfs filesystem.
type Server struct {
	dir         string
	fuse        *fuse.Server
	passthrough bool
	ns          *namespace
	requests    *requestCounts
	log         *slog.Logger
	// mountID is the mount's ID in the mount table: it names the mount where it is now, also
	// after a directory above it was renamed; a bind mount or a propagated copy of it has the
	// same device but an ID of its own ("": unknown).
	mountID, device string
	// closed is closed once the serve loop has ended and this process's descriptors of the
	// mount's /dev/fuse (go-fuse's, the notifier's duplicate) are closed. Unmount waits for it:
	// a mount started next in this process must not see them close meanwhile (newServer tells
	// the new mount's descriptor by the numbers that appeared).
	closed chan struct{}
}

// Requests returns how many FUSE requests of each operation ("lookup", "create", …) the mount
// has served (also exported as mtcfs_fuse_requests_total when the Events accept it).
func (s *Server) Requests() map[string]uint64 { return s.requests.snapshot() }

// Namespace lets the replicator manage the top-level names of the mount.
func (s *Server) Namespace() tiers.Namespace { return s.ns }

// Dir is the mount point.
func (s *Server) Dir() string { return s.dir }

// Passthrough reports whether regular files use FUSE passthrough.
func (s *Server) Passthrough() bool { return s.passthrough }

// Wait blocks until the filesystem is unmounted.
func (s *Server) Wait() { s.fuse.Wait() }

// ErrLeftInPlace is returned by Stop when the mount was still in use when it had to give up: its
// connection was ended, and the mount stays at its directory, unserved.
var ErrLeftInPlace = errors.New("the mount is still in use: it is left in place, unserved")

// busyRetry is how often Stop tries the unmount again while the mount is in use.
const busyRetry = 200 * time.Millisecond

// StopQuiet is how long the mount must have seen no request that changes or opens anything
// before Stop unmounts it: a save is a series of opens and closes, and an unmount between two of
// its files sent the rest of it into the directory below (a black-box run: a save in progress
// at the SIGTERM, cut in two, committed below the mount and lost; also a job's own save right
// after the signal, on an idle mount). A variable for tests.
var StopQuiet = time.Second

// StopChangingTold is how long Stop waits for a quiet moment before it logs that the job keeps
// changing the mount (it saves on): the busy line comes only once the mount is quiet and its
// unmount fails, and a job saving on got none, only the give-up 30 s later (a black-box run). A
// variable for tests.
var StopChangingTold = 5 * time.Second

// Stop unmounts the filesystem for an agent that stops, once the job has left it alone for
// StopQuiet: no request that changes or opens anything (looks, listings and stats do not count:
// a job polling for its restore markers does them). While it is in use (a process has a file
// open or its working directory inside) it stays mounted and served, and the unmount is tried
// again until those processes leave or giveUp is closed. Then its connection is ended (as root)
// and the mount is left at its directory, unserved, and Stop returns ErrLeftInPlace: its users
// get "Transport endpoint is not connected", as after a kill -9, and the next agent started on
// the directory detaches it and serves. Before, a busy mount was detached at once and served
// detached: the job's next save, made by its path as Orbax makes it, went into the plain
// directory below, on the node's disk, for as long as the stop took (30 s and more under a
// Kubernetes node agent whose pod was deleted: a black-box run), was told to have succeeded,
// and was lost, hidden by the next mount. A save that starts after the unmount still lands
// below, and the next agent tells the job ("the mount directory held N entries …").
func (s *Server) Stop(giveUp <-chan struct{}) error {
	if where := s.Where(); where != s.dir {
		return s.unmountMoved(where)
	}
	detached := !s.ownsDir() // detached from outside (umount -l): its users still hold it
	if detached {
		s.log.Warn("the mount was detached from outside (umount -l) and is still in use: the stop waits for its users, and leaves what is at the directory now alone", "dir", s.dir)
	}
	busyTold, changingTold := false, false
	start := time.Now()
	last, quietSince := s.requests.changes(), start
	first := last
	var lastTry time.Time
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-s.closed:
			return nil // detached from outside, and its last user left: the connection ended
		case <-giveUp:
			select {
			case <-s.closed:
				return nil
			default:
			}
			if _, minor, ok := strings.Cut(s.device, ":"); ok && os.Geteuid() == 0 {
				// By its own connection, not by the directory: the mount there may be another's.
				if err := fusectl.AbortConnection(minor); err != nil {
					s.log.Warn("could not end the mount's connection; it ends when the agent exits", "dir", s.dir, "err", err)
				} else {
					select {
					case <-s.closed:
					case <-time.After(5 * time.Second):
					}
				}
			}
			if detached {
				return ErrDetachedOutside
			}
			return ErrLeftInPlace
		case <-tick.C:
		}
		if n := s.requests.changes(); n != last {
			last, quietSince = n, time.Now()
		}
		if !changingTold && !detached && time.Since(quietSince) < StopQuiet && time.Since(start) >= StopChangingTold {
			changingTold = true
			list, n := usersLine(s.dir)
			if n == 0 {
				list = "none holds it open now"
			}
			s.log.Warn(fmt.Sprintf("the job keeps changing the mount (it saves on): the stop unmounts once it has left the mount alone for %v; meanwhile the mount stays served, and steps it commits are sealed by the next agent (stop the job first, or let it finish its save)", StopQuiet),
				"dir", s.dir, "changes", last-first, "in", time.Since(start).Round(time.Millisecond).String(), "processes", list)
		}
		if detached || time.Since(quietSince) < StopQuiet || time.Since(lastTry) < busyRetry {
			continue
		}
		// Only this mount is unmounted, never what another mounted at the directory since (a
		// review: the mount table's numbers are reused, and a mount made after this one was
		// detached from outside looked like this one moved, and was detached).
		if !s.ownsDir() {
			s.log.Warn("the mount was detached from outside while the stop waited (umount -l); its users still hold it", "dir", s.dir)
			detached = true
			continue
		}
		err := s.fuse.Unmount()
		lastTry = time.Now()
		if err == nil {
			<-s.closed
			return nil
		}
		if !busyTold {
			busyTold = true
			list, n := usersLine(s.dir)
			if n == 0 {
				list = "none seen in this PID namespace"
			}
			s.log.Warn("the mount is busy: it stays mounted and served while these processes use it; if they are still there when the stop gives up, it is left in place unserved (not detached: a save made meanwhile would land in the directory below it)", "dir", s.dir, "processes", list, "unmount", err)
		}
	}
}

// ErrDetachedOutside is returned by Stop when the mount was detached from outside (umount -l)
// while the stop waited, and was still in use when it gave up: its connection was ended.
var ErrDetachedOutside = errors.New("the mount was detached from outside (umount -l) and still in use: its connection is ended")

// ownsDir reports whether the mount at the directory is this one: the top FUSE mount there has
// this server's device (unique while the server's connection lives; true when not known).
func (s *Server) ownsDir() bool {
	if s.device == "" {
		return true
	}
	mounts, err := fusectl.Mounts()
	if err != nil {
		return true
	}
	top := ""
	for _, m := range mounts { // of mounts stacked on the directory, the last is on top
		if m.Point == s.dir {
			top = m.Device
		}
	}
	return top == s.device
}

// Unmount detaches the filesystem. If it is busy (a process has a file open or its working
// directory inside), it is detached lazily: new accesses fail and it goes away when the last
// user leaves.
func (s *Server) Unmount() error {
	if where := s.Where(); where != s.dir {
		return s.unmountMoved(where)
	}
	err := s.fuse.Unmount()
	if err == nil {
		<-s.closed // the serve loop has ended (go-fuse's Unmount waited for its readers)
		return nil
	}
	// Who holds it, looked up while the paths still show it (after the detach /proc shows them
	// relative to nothing), told once it is detached: the stop otherwise waits with no word.
	list, n := usersLine(s.dir)
	if os.Geteuid() == 0 {
		if e := unix.Unmount(s.dir, unix.MNT_DETACH); e != nil && !errors.Is(e, unix.EINVAL) {
			return fmt.Errorf("unmount %s: %v; lazy detach: %w", s.dir, err, e)
		}
	} else if out, e := exec.Command("fusermount3", "-u", "-z", s.dir).CombinedOutput(); e != nil {
		return fmt.Errorf("unmount %s: %v; fusermount3 -uz: %s", s.dir, err, strings.TrimSpace(string(out)))
	}
	switch {
	case n > 0:
		s.log.Warn("the mount is busy: it is detached, and goes away once these processes leave it", "dir", s.dir, "processes", list, "unmount", err)
	default:
		s.log.Warn("the unmount did not go through: the mount is detached, and goes away once whatever uses it leaves it (no process in this PID namespace is seen using it)", "dir", s.dir, "unmount", err)
	}
	s.fuse.Wait()
	<-s.closed
	return nil
}

// Attached reports whether the mount is still in the mount table (true when that cannot be
// told). A mount detached lazily (umount -l) while a process holds it stays served, but the
// directory no longer leads to it: a job that restarts writes its replicator.yaml into the
// directory below, and no agent answers (a black-box run: /readyz and status said ready).
func (s *Server) Attached() bool {
	if s.mountID == "" {
		return true
	}
	mounts, err := fusectl.Mounts()
	if err != nil {
		return true
	}
	for _, m := range mounts {
		if m.ID == s.mountID && m.Device == s.device {
			return true
		}
	}
	return false
}

// Where is the mount point now: Dir, unless a directory above it was renamed while it was
// mounted (the kernel moves the mount with it).
func (s *Server) Where() string {
	if s.mountID == "" {
		return s.dir
	}
	mounts, err := fusectl.Mounts()
	if err != nil {
		return s.dir
	}
	where := ""
	for _, m := range mounts {
		if m.ID == s.mountID && m.Device == s.device { // an ID reused after an unmount from outside: another device
			where = m.Point
		}
	}
	if where == "" {
		return s.dir // unmounted already (from outside)
	}
	return where
}

// unmountMoved unmounts the mount where it is now: go-fuse's unmount names the mount point it
// was given, which no longer leads to it. Before, the stop failed ("unmount …: no such file or
// directory"), left the moved mount dead, and freed the spool as orphaned (found by a
// black-box run).
func (s *Server) unmountMoved(where string) error {
	s.log.Warn("the mount was moved while the agent served it (a directory above it was renamed): it is unmounted where it is now", "dir", s.dir, "now", where)
	// Who holds it, looked up while /proc still shows the paths (as Unmount does): the stop
	// otherwise waits with no word (found by a review).
	if list, n := usersLine(where); n > 0 {
		s.log.Warn("the moved mount is busy: it is detached, and goes away once these processes leave it", "dir", where, "processes", list)
	}
	var err error
	if os.Geteuid() == 0 {
		if err = unix.Unmount(where, 0); errors.Is(err, unix.EBUSY) {
			err = unix.Unmount(where, unix.MNT_DETACH)
		}
	} else if out, e := exec.Command("fusermount3", "-u", "-z", where).CombinedOutput(); e != nil {
		err = fmt.Errorf("fusermount3 -uz: %s", strings.TrimSpace(string(out)))
	}
	if err != nil {
		return fmt.Errorf("unmount %s (moved from %s): %w", where, s.dir, err)
	}
	s.fuse.Wait()
	<-s.closed
	return nil
}

// CheckMountable explains, in words a user can act on, why dir cannot be mounted. Symlinks are
// followed: the directory they lead to is what would be mounted on.
func CheckMountable(dir string) error {
	if real := tiers.ResolveMountPath(dir); real != dir {
		if a, _ := filepath.Abs(dir); a != real { // reached through a symlink
			if _, err := os.Lstat(real); errors.Is(err, os.ErrNotExist) {
				return fmt.Errorf("mount point %s leads to %s, which does not exist; create it first (mkdir -p %s)", dir, real, real)
			}
			dir = real
		}
	}
	if abs, _ := filepath.Abs(dir); abs == "/" {
		return errors.New("mount point /: a mount there would hide the whole file system; give the checkpoints a directory of their own")
	}
	fi, err := os.Stat(dir)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return fmt.Errorf("mount point %s does not exist; create it first (mkdir -p %s)", dir, dir)
	case errors.Is(err, syscall.ENOTCONN):
		return fmt.Errorf("mount point %s is a stale FUSE mount; detach it with umount -l %s", dir, dir)
	case err != nil:
		return fmt.Errorf("mount point %s: %w", dir, err)
	case !fi.IsDir():
		return fmt.Errorf("mount point %s is not a directory", dir)
	}
	deviceMu.Lock() // a mount running meanwhile must not take this descriptor for its own
	f, err := os.OpenFile("/dev/fuse", os.O_RDWR, 0)
	if err == nil {
		f.Close()
	}
	deviceMu.Unlock()
	switch {
	case errors.Is(err, os.ErrPermission):
		mode := ""
		if fi, err := os.Stat("/dev/fuse"); err == nil {
			mode = fmt.Sprintf(" (mode %04o)", fi.Mode().Perm())
		}
		return fmt.Errorf("cannot open /dev/fuse%s: your user may not use FUSE here; run as root, or have an administrator allow it (chmod 0666 /dev/fuse, the default on most distributions, or a udev rule)", mode)
	case err != nil:
		return fmt.Errorf("cannot open /dev/fuse (%w): load the fuse kernel module (modprobe fuse), or in a container pass the device (/dev/fuse) and run privileged", err)
	}
	if os.Geteuid() != 0 {
		if _, err := exec.LookPath("fusermount3"); err != nil {
			return errors.New("not running as root and fusermount3 is not installed: run as root, or install it (apt-get install fuse3)")
		}
	}
	return nil
}

// DetachStale removes a FUSE mount left at dir by an agent that died: such a mount answers
// every access with ENOTCONN. A live mount at dir is an error: another agent serves it. A
// symlink is resolved first (without touching a stale mount at its end), so a mount reached
// through a link counts as the mount itself.
//
// A mount can also hang rather than answer ENOTCONN: an agent killed while one of its threads
// waited in the kernel on its own mount never finishes exiting (the notification helper,
// notifier.go, keeps the agent's own threads out of such waits; an agent that wrote its
// notifications itself, or an older version, could be caught), so the kernel keeps the
// connection open, and every access waits, the job's included. When the mount leaves a statfs
// unanswered for takeoverAfter and no "mtcfs mount" process for dir runs any more, its
// connection is aborted (fusectl), which frees every waiter and lets the killed agent exit, and
// the mount is detached. If such a process still runs (stopped, or too busy to answer),
// DetachStale names it and touches nothing. (An agent in another PID namespace is not seen:
// takeoverAfter, 30 s by default, is what keeps a live but stalled one from being taken over.)
func DetachStale(dir string, takeoverAfter time.Duration) (bool, error) {
	abs := tiers.ResolveMountPath(dir)
	fstype := fuseMountType(abs)
	if fstype == "" {
		return false, nil
	}
	// statfs always reaches the FUSE server (stat of the root may be answered from the kernel's
	// attribute cache for a while after the agent died).
	err := statfsWithin(abs, takeoverAfter, func() {
		slog.Warn("a FUSE mount already at the directory does not answer yet; waiting for it before looking for its agent", "dir", abs, "up_to", takeoverAfter.String())
	})
	switch {
	case err == nil:
		what := abs
		if a, _ := filepath.Abs(dir); a != abs {
			what = fmt.Sprintf("%s (the target of %s)", abs, dir)
		}
		if pid := tiers.MountProcessFor(abs); pid > 0 {
			return false, fmt.Errorf("%s is already a live FUSE mount, served by the mtcfs agent pid %d: stop it first (a stopping agent first lets a running backup finish, up to its --drain-timeout, then waits up to 30 s for the processes that use its mount; its log names them)", what, pid)
		}
		if uid, others, ok := fuseMountOwner(abs); ok && !others && uid != uint32(os.Geteuid()) {
			// Its statfs is answered by the kernel, not its agent: another user's mount without
			// allow_other tells nothing to this user, root included. A killed non-root agent's
			// was called live, with no way out named (black-box h57).
			return false, fmt.Errorf("%s is a FUSE mount of uid %d, which this user may not look into (it was mounted without allow_other), and no mtcfs agent process for it runs here: if its agent was killed, detach it (umount -l %s as root, or fusermount3 -u -z %s as uid %d) and start again; if its agent runs (in another PID namespace), stop it first", what, uid, abs, abs, uid)
		}
		return false, fmt.Errorf("%s is already a live FUSE mount (another mtcfs agent?); stop it or unmount it first", what)
	case errors.Is(err, errNoAnswer):
		if fstype != mountType {
			// Another file system's mount, perhaps waiting on its network (gcsfuse, sshfs):
			// aborting its connection would lose what it has not written yet.
			return false, fmt.Errorf("%s is a %s mount that does not answer (nothing within %v); it is not an mtcfs mount, so it is left alone: unmount it first", abs, fstype, takeoverAfter)
		}
		if pid := tiers.MountProcessFor(abs); pid > 0 {
			return false, fmt.Errorf("%s is a FUSE mount that does not answer (nothing within %v), and the agent process %d that mounted it still runs (stopped? see its state in /proc/%d/status); stop it first", abs, takeoverAfter, pid, pid)
		}
		if err := fusectl.Abort(abs); err != nil {
			return false, fmt.Errorf("%s is a FUSE mount that does not answer and whose agent is gone; aborting its connection failed: %w (as root: %s)", abs, err, fusectl.ByHand(abs))
		}
		slog.Warn("aborted the connection of a mount that did not answer: its agent is gone and a thread of it (or of a job) waited on the mount", "dir", abs, "waited", takeoverAfter)
	case !errors.Is(err, unix.ENOTCONN) && !errors.Is(err, unix.ECONNABORTED):
		return false, fmt.Errorf("check mount %s: %w", abs, err)
	}
	if os.Geteuid() == 0 {
		if err := unix.Unmount(abs, unix.MNT_DETACH); err != nil {
			return false, fmt.Errorf("detach stale mount %s: %w", abs, err)
		}
		return true, nil
	}
	if out, err := exec.Command("fusermount3", "-u", "-z", abs).CombinedOutput(); err != nil {
		// fusermount3 detaches only its user's own mounts: a root agent's that died left this
		// one, and its words ("entry for … not found in /etc/mtab") said nothing of that.
		return false, fmt.Errorf("detach stale mount %s: %s: it is not your user's mount (a root agent's that died?); have root detach it (umount -l %s)", abs, strings.TrimSpace(string(out)), abs)
	}
	return true, nil
}

// DefaultTakeoverAfter is how long DetachStale lets a mount leave a request unanswered before
// it looks for the agent that should answer (mtcfs mount --takeover-after).
const DefaultTakeoverAfter = 30 * time.Second

// errNoAnswer: the mount did not answer in time.
var errNoAnswer = errors.New("the mount did not answer")

// statfsWithin runs statfs on p, giving up after d with errNoAnswer (the call itself goes on in
// the background until the mount answers or its connection is aborted). slow (nil: none) is
// called once the call has waited a tenth of d, at most a second, so that a long wait is seen.
func statfsWithin(p string, d time.Duration, slow func()) error {
	done := make(chan error, 1)
	go func() {
		var st unix.Statfs_t
		done <- unix.Statfs(p, &st)
	}()
	t := time.NewTimer(d)
	defer t.Stop()
	notice := time.NewTimer(min(d/10, time.Second))
	defer notice.Stop()
	for {
		select {
		case err := <-done:
			return err
		case <-t.C:
			return errNoAnswer
		case <-notice.C:
			if slow != nil {
				slow()
			}
		}
	}
}

// mountType is the file system type of mtcfs's mounts in /proc/self/mountinfo (Name "mtcfs").
const mountType = "fuse.mtcfs"

// fuseMountType returns the file system type ("fuse.mtcfs", "fuse.sshfs", "fuse") of the FUSE
// mount exactly at abs, or "" if there is none (the top one, if several are stacked).
// fuseMountOwner returns the uid the FUSE mount at abs was made for and whether it allows
// other users (ok: it is one, and its options say).
func fuseMountOwner(abs string) (uid uint32, allowOther, ok bool) {
	mounts, _ := fusectl.Mounts()
	for _, m := range mounts {
		if m.Point == abs && m.IsFUSE() {
			uid, allowOther, ok = m.Owner() // the last: of mounts stacked on one point, the top one
		}
	}
	return uid, allowOther, ok
}

func fuseMountType(abs string) string {
	mounts, _ := fusectl.Mounts()
	fstype := ""
	for _, m := range mounts {
		if m.Point == abs && m.IsFUSE() {
			fstype = m.FSType
		}
	}
	return fstype
}

// Mount serves an empty mtcfs filesystem at dir until Unmount. A symlink is resolved: the
// filesystem is mounted on the directory it leads to, and Server.Dir names that directory.
func Mount(dir string, opts Options) (*Server, error) {
	abs := tiers.ResolveMountPath(dir)
	if err := CheckMountable(abs); err != nil {
		return nil, err
	}
	if opts.CacheTimeout == 0 {
		opts.CacheTimeout = 5 * time.Second
	}
	root := os.Geteuid() == 0
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	m := &mtfs{spool: opts.Spool, events: opts.Events, doomed: map[*fileNode]doomState{}, relCh: make(chan struct{}), log: opts.Logger, xattrs: opts.Xattrs, mountDir: abs}
	m.nextIno.Store(1)
	rootNode := &dirNode{fs: m}
	rootNode.init(context.Background(), 0o755)
	if err := rootNode.takeOwner(abs, opts.Owner); err != nil {
		return nil, err
	}

	timeout := opts.CacheTimeout
	fsOpts := &gofs.Options{
		EntryTimeout:    &timeout,
		AttrTimeout:     &timeout,
		NegativeTimeout: &timeout,
		RootStableAttr:  &gofs.StableAttr{Ino: 1},
		NullPermissions: true, // a mode of 0 is 0, as on tmpfs
		// The tree is the agent's: go-fuse linking a looked-up node again after the LOOKUP
		// (or removing the name after an UNLINK) undid the agent's replacement of that name
		// meanwhile: a .meta replaced by a save of the same step came back as the replaced
		// node, bytes gone, and stayed (a clean-clone CI run and a stress run).
		TreeKeptByFS: true,
		// go-fuse's own lines go through the mount's logger, in its format (--log-format json).
		Logger: slog.NewLogLogger(m.log.With("component", "go-fuse").Handler(), slog.LevelWarn),
		MountOptions: fuse.MountOptions{
			FsName:       "mtcfs",
			Name:         "mtcfs",
			DirectMount:  root,
			AllowOther:   root,
			MaxWrite:     1 << 20,
			MaxReadAhead: 1 << 20,
			// The kernel checks permission bits, as on tmpfs.
			Options:       []string{"default_permissions"},
			DisableXAttrs: !opts.Xattrs,
			// Only the kernel changes file bytes, so it need not drop its page cache when it
			// sees a new mtime (which it would after every write of the fallback path).
			ExplicitDataCacheControl: true,
			Debug:                    opts.Debug,
		},
	}
	counts := &requestCounts{}
	raw := &countingFS{RawFileSystem: &eventFS{RawFileSystem: gofs.NewNodeFS(rootNode, fsOpts), m: m}, n: counts}
	srv, fd, err := newServer(raw, abs, &fsOpts.MountOptions)
	if err != nil {
		return nil, fmt.Errorf("mount %s: %w", abs, err)
	}
	served := make(chan struct{})
	go func() {
		srv.Serve()
		close(served)
	}()
	// NewServer returns once the mount is live and INIT answered. go-fuse's WaitMount adds its
	// poll hack: this process opens a file on the mount so that the kernel learns, before any
	// file of the mount is opened in this process, that the filesystem does not poll (Go's
	// runtime would otherwise block its only P in an epoll_ctl that waits for the mount). The
	// agent never opens its own mount, and for it that open is a hazard: a SIGKILL that lands
	// while the open's request is read but not answered leaves the thread waiting for an
	// answer no thread of the dying process will give, in uninterruptible sleep, and the
	// process never exits nor releases the mount (seen in TestKillDuringAdoption). Only a
	// process that opens files on its own mount (tests) asks for the hack.
	if opts.InProcess {
		if err := srv.WaitMount(); err != nil {
			srv.Unmount()
			if fd >= 0 {
				unix.Close(fd)
			}
			return nil, fmt.Errorf("mount %s: %w", abs, err)
		}
	}
	e := newKernelNotifier(srv, fd, abs, m.log)
	if e != nil {
		m.notifier.Store(e)
	}
	closed := make(chan struct{})
	go func() {
		<-served
		if e != nil {
			e.close()
		}
		close(closed)
	}()
	s := &Server{dir: abs, fuse: srv, ns: &namespace{m: m, root: rootNode}, requests: counts, closed: closed, log: m.log}
	if mounts, err := fusectl.Mounts(); err == nil {
		for _, mt := range mounts { // of mounts stacked on abs, the last is this one
			if mt.Point == abs && mt.IsFUSE() {
				s.mountID, s.device = mt.ID, mt.Device
			}
		}
	}
	if o, ok := opts.Events.(interface {
		ObserveFUSERequests(func() map[string]uint64)
	}); ok {
		o.ObserveFUSERequests(counts.snapshot)
	}
	if opts.Passthrough != PassthroughOff && root {
		m.passthrough.Store(probePassthrough(srv, opts.Spool))
	}
	if opts.Passthrough == PassthroughOn && !m.passthrough.Load() {
		s.Unmount()
		return nil, errors.New("--passthrough=on: the kernel refused FUSE passthrough (needs Linux ≥ 6.9 and CAP_SYS_ADMIN); use --passthrough=auto or off")
	}
	s.passthrough = m.passthrough.Load()
	m.log.Info("mounted", "dir", abs, "passthrough", s.passthrough, "expire_only", e != nil && e.expireOnly, "notification_helper", e != nil && e.usesHelper(), "spool", opts.Spool.Dir(),
		"budget", tiers.FormatSize(opts.Spool.Budget()), "budget_enforced_by", map[bool]string{true: "tmpfs", false: "agent"}[opts.Spool.KernelEnforced()])
	return s, nil
}

// takeOwner gives the root the owner, group and permission bits of the mount point dir, or those
// o sets.
func (d *dirNode) takeOwner(dir string, o RootOwner) error {
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return fmt.Errorf("mount point %s: %w", dir, err)
	}
	d.uid, d.gid, d.mode = st.Uid, st.Gid, st.Mode&07777
	if o.UID != nil {
		d.uid = *o.UID
	}
	if o.GID != nil {
		d.gid = *o.GID
	}
	if o.Mode != nil {
		d.mode = *o.Mode & 07777
	}
	return nil
}

// probePassthrough asks the kernel to register a spool file as a passthrough backing file, the
// same call go-fuse makes on open, so that the mode we log is the mode we get.
func probePassthrough(srv *fuse.Server, spool *tiers.Spool) bool {
	if srv.KernelSettings().Flags64()&fuse.CAP_PASSTHROUGH == 0 {
		return false
	}
	p, fd, err := spool.NewFile()
	if err != nil {
		return false
	}
	defer os.Remove(p)
	defer unix.Close(fd)
	id, errno := srv.RegisterBackingFd(&fuse.BackingMap{Fd: int32(fd)})
	if errno != 0 {
		return false
	}
	srv.UnregisterBackingFd(id)
	return true
}

// newServer mounts like fuse.NewServer, and keeps the FUSE device out of every process this one
// starts. go-fuse's direct mount (v2.12) leaves its /dev/fuse descriptor without close-on-exec:
// a child started later (a hook, a test's tool) inherits it, and when the agent dies the kernel
// keeps the connection open for that child, whose own requests then wait forever (D state,
// unkillable) instead of failing with ENOTCONN. The direct mount runs under syscall.ForkLock, as
// os.Open does, so no fork in another goroutine copies the descriptor before it is marked; if
// the direct mount fails, the fusermount path (which forks, and marks its descriptor itself)
// runs outside the lock, as go-fuse's own fallback would. It also returns a duplicate of the
// mount's /dev/fuse descriptor (close-on-exec; the caller closes it), taken while mounts and
// CheckMountable's probe are serialized, so that the one descriptor that appeared is the
// mount's; -1 if it cannot tell which it is.
func newServer(raw fuse.RawFileSystem, dir string, opts *fuse.MountOptions) (*fuse.Server, int, error) {
	deviceMu.Lock()
	defer deviceMu.Unlock()
	before := fuseDescriptors()
	found := func() int {
		after := fuseDescriptors()
		closeFUSEOnExec(after)
		return dupFUSEDevice(newDescriptor(before, after))
	}
	if !opts.DirectMount {
		srv, err := fuse.NewServer(raw, dir, opts)
		if err != nil {
			return nil, -1, err
		}
		return srv, found(), nil
	}
	strict := *opts
	strict.DirectMountStrict = true
	syscall.ForkLock.RLock()
	srv, err := fuse.NewServer(raw, dir, &strict)
	fd := -1
	if err == nil {
		fd = found()
	}
	syscall.ForkLock.RUnlock()
	if err == nil {
		return srv, fd, nil
	}
	fallback := *opts
	fallback.DirectMount = false
	srv, err2 := fuse.NewServer(raw, dir, &fallback)
	if err2 != nil {
		return nil, -1, fmt.Errorf("%w (and through fusermount3: %v)", err, err2)
	}
	return srv, found(), nil
}

// closeFUSEOnExec sets close-on-exec on the given descriptors (those of this process open on
// /dev/fuse).
func closeFUSEOnExec(fds map[int]bool) {
	for fd := range fds {
		syscall.CloseOnExec(fd)
	}
}
