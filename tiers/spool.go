package tiers

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/mtcfs/mtcfs/layout"
	"golang.org/x/sys/unix"
)

// ErrNoSpace is returned when a write would take the spool past its memory budget.
var ErrNoSpace = errors.New("spool memory budget exhausted")

// MinBudget is the smallest --memory the spool accepts: below it even the control files and a
// small checkpoint would not fit, and the user most likely typed a unit wrong.
const MinBudget = 16 << 20

// Spool is the RAM tier: checkpoint bytes live in files on tmpfs, off the Go heap, bounded by a
// byte budget.
//
// When the agent may mount (root), the spool directory is a dedicated tmpfs mount whose size is
// the budget: the kernel then enforces the budget for every write, also for writes that FUSE
// passthrough sends straight to the backing file without asking the agent, and statfs of the
// spool is exact. Otherwise the spool is a plain directory on /dev/shm and the agent accounts
// for every byte it writes itself (passthrough is unavailable without privileges anyway).
//
// Files are named by a number in Spool.FilesDir; the namespace the user sees lives in the fs
// layer, which maps its inodes to these names.
type Spool struct {
	dir    string
	budget int64
	// ownMount is true when dir is a tmpfs mount made for (or adopted by) this spool.
	ownMount bool

	nextID atomic.Uint64
	// used counts accounted bytes when !ownMount (see Reserve).
	used atomic.Int64

	closeOnce sync.Once
}

// SpoolConfig says where the spool lives and how large it may grow.
type SpoolConfig struct {
	Dir    string // created if missing
	Budget int64  // bytes
	// MountTmpfs asks for a dedicated tmpfs of Budget bytes at Dir (needs CAP_SYS_ADMIN).
	MountTmpfs bool
}

// DefaultSpoolDir derives a spool directory from the mount path, so that several agents on one
// machine never share a spool and a restarted agent finds its predecessor's data.
func DefaultSpoolDir(mountPath string) string {
	abs, err := filepath.Abs(mountPath)
	if err != nil {
		abs = mountPath
	}
	sum := sha256.Sum256([]byte(abs))
	base := filepath.Base(abs)
	if base == "/" || base == "." {
		base = "root"
	}
	return filepath.Join("/dev/shm", "mtcfs", base+"-"+hex.EncodeToString(sum[:6]))
}

// OpenSpool prepares the spool directory. An existing tmpfs mount at Dir (left by an agent that
// was killed) is adopted and resized to the new budget, keeping its content.
func OpenSpool(cfg SpoolConfig) (*Spool, error) {
	if cfg.Budget < MinBudget {
		return nil, fmt.Errorf("memory budget %s is below the minimum %s", FormatSize(cfg.Budget), FormatSize(MinBudget))
	}
	if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("create spool directory: %w", err)
	}
	s := &Spool{dir: cfg.Dir, budget: cfg.Budget}
	if cfg.MountTmpfs {
		opts := "size=" + strconv.FormatInt(cfg.Budget, 10) + ",mode=0700"
		if isTmpfsMount(cfg.Dir) {
			if err := unix.Mount("", cfg.Dir, "", unix.MS_REMOUNT, opts); err != nil {
				return nil, fmt.Errorf("resize spool tmpfs at %s to %s: %w (is more already in use?)", cfg.Dir, FormatSize(cfg.Budget), err)
			}
		} else if err := unix.Mount("mtcfs-spool", cfg.Dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, opts); err != nil {
			return nil, fmt.Errorf("mount spool tmpfs at %s: %w", cfg.Dir, err)
		}
		s.ownMount = true
	}
	if err := os.MkdirAll(s.FilesDir(), 0o700); err != nil {
		s.Close()
		return nil, fmt.Errorf("create spool files directory: %w", err)
	}
	// Open-ended files of a previous agent are garbage: the namespace that named them died with
	// that agent. (Committed data is kept elsewhere in the spool and adopted by package tiers.)
	if err := clearDir(s.FilesDir()); err != nil {
		s.Close()
		return nil, fmt.Errorf("clear stale spool files: %w", err)
	}
	if !s.ownMount {
		s.used.Store(dirUsage(s.dir))
	}
	return s, nil
}

// Dir is the spool's root directory.
func (s *Spool) Dir() string { return s.dir }

// FilesDir holds the backing files of open-ended (not yet sealed) files.
func (s *Spool) FilesDir() string { return filepath.Join(s.dir, "files") }

// Budget is the configured size in bytes.
func (s *Spool) Budget() int64 { return s.budget }

// KernelEnforced reports whether the budget is enforced by a dedicated tmpfs (true) or by the
// agent's own accounting (false).
func (s *Spool) KernelEnforced() bool { return s.ownMount }

// NewFile creates an empty backing file and returns its path and a read-write descriptor
// (close-on-exec) that the caller owns.
func (s *Spool) NewFile() (string, int, error) {
	for {
		p := filepath.Join(s.FilesDir(), strconv.FormatUint(s.nextID.Add(1), 10))
		fd, err := unix.Open(p, unix.O_CREAT|unix.O_EXCL|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
		if errors.Is(err, unix.EEXIST) {
			continue
		}
		if err != nil {
			return "", -1, fmt.Errorf("create spool file: %w", err)
		}
		return p, fd, nil
	}
}

// LinkFile gives the existing spool file src a new backing-file name (a hard link: no bytes
// are copied) and returns it.
func (s *Spool) LinkFile(src string) (string, error) {
	for {
		p := filepath.Join(s.FilesDir(), strconv.FormatUint(s.nextID.Add(1), 10))
		err := os.Link(src, p)
		if errors.Is(err, os.ErrExist) {
			continue
		}
		if err != nil {
			return "", fmt.Errorf("link spool file: %w", err)
		}
		return p, nil
	}
}

// LinkFileAt is LinkFile for the file rel of the tree d (paths of any length).
func (s *Spool) LinkFileAt(d *layout.Dir, rel string) (string, error) {
	for {
		p := filepath.Join(s.FilesDir(), strconv.FormatUint(s.nextID.Add(1), 10))
		err := d.LinkTo(rel, p)
		if errors.Is(err, os.ErrExist) {
			continue
		}
		if err != nil {
			return "", fmt.Errorf("link spool file: %w", err)
		}
		return p, nil
	}
}

// Reserve accounts for delta more (or, negative, fewer) bytes. With a kernel-enforced budget it
// never fails: tmpfs itself answers ENOSPC.
func (s *Spool) Reserve(delta int64) error {
	if s.ownMount || delta == 0 {
		return nil
	}
	for {
		cur := s.used.Load()
		next := cur + delta
		if delta > 0 && next > s.budget {
			return ErrNoSpace
		}
		if next < 0 {
			next = 0
		}
		if s.used.CompareAndSwap(cur, next) {
			return nil
		}
	}
}

// Usage returns the budget and the bytes in use.
func (s *Spool) Usage() (total, used int64) {
	if s.ownMount {
		var st unix.Statfs_t
		if err := unix.Statfs(s.dir, &st); err == nil {
			total = int64(st.Blocks) * st.Bsize
			return total, total - int64(st.Bfree)*st.Bsize
		}
	}
	return s.budget, s.used.Load()
}

// Close releases the spool. With discard, a dedicated tmpfs is unmounted (its content is lost)
// and the directory removed; otherwise the content stays for the next agent to adopt.
func (s *Spool) Close() error { return s.close(true) }

// Detach releases the spool but keeps its content (and its tmpfs mount) for a later agent.
func (s *Spool) Detach() error { return s.close(false) }

func (s *Spool) close(discard bool) error {
	var err error
	s.closeOnce.Do(func() {
		if !discard {
			return
		}
		if s.ownMount {
			if e := unix.Unmount(s.dir, unix.MNT_DETACH); e != nil {
				err = fmt.Errorf("unmount spool %s: %w", s.dir, e)
				return
			}
		}
		if e := os.RemoveAll(s.dir); e != nil {
			err = fmt.Errorf("remove spool %s: %w", s.dir, e)
		}
	})
	return err
}

func clearDir(dir string) error {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range ents {
		if err := os.RemoveAll(filepath.Join(dir, e.Name())); err != nil {
			return err
		}
	}
	return nil
}

// isTmpfsMount reports whether dir is itself the root of a tmpfs mount.
func isTmpfsMount(dir string) bool {
	var st, parent unix.Stat_t
	if unix.Stat(dir, &st) != nil || unix.Stat(filepath.Dir(dir), &parent) != nil {
		return false
	}
	var fs unix.Statfs_t
	if unix.Statfs(dir, &fs) != nil || fs.Type != unix.TMPFS_MAGIC {
		return false
	}
	return st.Dev != parent.Dev
}

// dirUsage sums the allocated bytes below dir.
func dirUsage(dir string) int64 {
	var total int64
	filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return nil
		}
		if fi, err := d.Info(); err == nil {
			total += fi.Size()
		}
		return nil
	})
	return total
}
