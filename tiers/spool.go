package tiers

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unicode/utf8"

	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/layout"
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
// the budget plus HeadroomSize, which a file of the agent holds: the kernel then enforces the
// budget for every write, also for writes that FUSE
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

	// lock is the spool's root directory, opened and flock'ed while a mount path owns the spool
	// (nil otherwise); ownerMu guards owner, the record last written to owner.json, and shape,
	// the one in ShapeFile.
	lock    *os.File
	ownerMu sync.Mutex
	owner   Owner
	shape   Shape // the zero Shape: none
	// shapeJob is the job shape is of: another job answered meanwhile (a rank started with a
	// mistyped job-name) sees no shape, and the record stays for its job (SavedShape).
	shapeJob string
	// timeline is the restores of shapeJob this node took part in (SetShapeRestored), kept in
	// ShapeFile with the shape.
	timeline Timeline
	// recorded is the newest trusted timeline of recordedJob, recorded or read: a record
	// written again after no room (withRoom) merges the earlier restores from it, where the
	// failed write had forgotten them (a review: history {1, 2, 3} became {4}).
	recorded    Timeline
	recordedJob string

	closeOnce sync.Once
	// trash is set while a predecessor's files, moved aside by clearFiles, wait for RemoveTrash.
	trash atomic.Bool

	// headroomMu guards the headroom file; headroom is what it holds (see HeadroomSize).
	headroomMu sync.Mutex
	headroom   atomic.Int64
	// headroomSize is what the headroom holds when full: HeadroomSize, or more in a tmpfs made
	// larger for the records of a step that filled the budget (sizeForRecords).
	headroomSize int64
}

// HeadroomSize is room in a spool tmpfs kept from the job: the tmpfs is that much larger than
// the budget, and the file HeadroomFile holds the room until the agent's own records need it.
// A job that fills its budget to the last byte and then commits would otherwise leave no room
// for the commit record, the .meta or the line in replicator.errors: its commit returned, and
// was lost. A record that finds no room frees HeadroomChunk of it at a time (the job could take
// what is freed before the record does, and never more), and the agent takes it back before
// its next record, once there is room. Without a tmpfs of its own the agent counts the job's
// bytes only, and its records always have room.
const HeadroomSize = 1 << 20

// HeadroomChunk is how much of the headroom a record that found no room frees at a time.
const HeadroomChunk = 64 << 10

// HeadroomFile is the file at the spool's root that holds the headroom.
const HeadroomFile = "headroom"

// SpoolConfig says where the spool lives and how large it may grow.
type SpoolConfig struct {
	Dir    string // created if missing
	Budget int64  // bytes
	// MountTmpfs asks for a dedicated tmpfs of Budget bytes at Dir (needs CAP_SYS_ADMIN).
	MountTmpfs bool
	// MountPath is the directory the spool serves. When set, the spool records it (resolved,
	// see ResolveMountPath) in owner.json and is locked for as long as it is open, so that
	// `mtcfs spool` and other agents see that it is in use. Empty: an anonymous spool (tests).
	MountPath string
}

// OwnerFile is the name, in the spool's root, of the record saying whom the spool belongs to.
const OwnerFile = "owner.json"

// ShapeFile records the shape of the job whose steps a spool holds (see Spool.SetShapeRestored). It is
// apart from OwnerFile so that it can always be removed, even from a full spool.
const ShapeFile = "shape.json"

// Owner is what a spool records about the mount it belongs to (OwnerFile).
type Owner struct {
	MountPath string    `json:"mount_path"`    // absolute, symlinks resolved
	Job       string    `json:"job,omitempty"` // the job whose data it holds, once known
	PID       int       `json:"pid"`           // the agent that last opened it
	LastUsed  time.Time `json:"last_used"`     // last open, job change or release
	// Running is the incarnation of Job an agent last answered here. An agent that finds one
	// when it starts was preceded by one stopped while the job may still be running: the job's
	// saves since are not checkpointed until it restarts (a new replicator.yaml replaces it).
	Running *Running `json:"running,omitempty"`
	// Freed records, by job, the steps of that job this spool held and freed for another job
	// (a job-name changed on the mount): the job, back under its name, is told (TakeFreed).
	Freed map[string]Freed `json:"freed,omitempty"`
	// Stopping: the agent holding the spool is stopping (MarkStopping); an agent started for
	// the same mount path meanwhile, in another mount namespace (a Kubernetes pod replacing
	// one that still terminates), waits for it instead of failing.
	Stopping bool `json:"stopping,omitempty"`
}

// Freed is what another job's negotiation freed of a job (Owner.Freed).
type Freed struct {
	Steps []int64   `json:"steps"`
	By    string    `json:"by"` // the job that took the spool
	At    time.Time `json:"at"`
}

// maxFreedJobs bounds Owner.Freed: the oldest records go first.
const maxFreedJobs = 8

// Running is an incarnation of the job, as the spool's owner record keeps it (Owner.Running).
type Running struct {
	Incarnation string    `json:"incarnation"`
	Framework   string    `json:"framework,omitempty"`
	Rank        int       `json:"rank"`
	Nodes       int       `json:"nodes"`
	Since       time.Time `json:"since"` // the handshake: the job then waits for its restore markers
	// Restored: the restore markers were published (MarkRestored). An Orbax job under an
	// agent restarted before that waits for markers that will not come.
	Restored bool `json:"restored,omitempty"`
	// TracksRestore: the agent that wrote the record sets Restored (an agent of an earlier
	// version does not: its record says nothing of the markers, and a restarted agent read
	// the missing field as "not published", and told a job that had restored long before that
	// its markers would not come; found by a black-box run of a rolling upgrade).
	TracksRestore bool `json:"tracks_restore,omitempty"`
	// UID and GID are the owner of the job's replicator.yaml, whom the agent's files at the top
	// belong to (AgentFilesOwner): a restarted agent writes its notices for the job before the
	// job's next handshake, and they were root's, which a job in a sticky mount root could not
	// remove (black-box h60).
	UID uint32 `json:"job_uid,omitempty"`
	GID uint32 `json:"job_gid,omitempty"`
	// Continues is the incarnation whose recorded timeline the agent trusted when it wrote the
	// record ("": none): a restart before this incarnation records its restore trusts that
	// timeline still. Before, such a restart (a crash during the restore negotiation) found
	// another incarnation than the one that recorded it and forgot it (a review).
	Continues string `json:"continues,omitempty"`
}

// DefaultSpoolRoot is the directory that holds the default spools of this user: shared by root
// agents, per user otherwise (SPEC §10), so that users never collide.
func DefaultSpoolRoot() string {
	if os.Geteuid() == 0 {
		return filepath.Join("/dev/shm", "mtcfs")
	}
	return filepath.Join("/dev/shm", "mtcfs-"+strconv.Itoa(os.Geteuid()))
}

// maxSpoolBase is the most of the mount directory's name a default spool's name keeps, so that
// with "-" and 12 hex digits it stays within NAME_MAX (255): every name that worked before keeps
// its spool.
const maxSpoolBase = 255 - 13

// DefaultSpoolDir derives a spool directory from the mount path, so that several agents on one
// machine never share a spool and a restarted agent finds its predecessor's data. The path is
// resolved first (ResolveMountPath): a mount reached through a symlink has the same spool.
func DefaultSpoolDir(mountPath string) string {
	abs := ResolveMountPath(mountPath)
	sum := sha256.Sum256([]byte(abs))
	base := filepath.Base(abs)
	if base == "/" || base == "." {
		base = "root"
	}
	// The hash names the spool; the base only helps a reader. A mount directory named with
	// 243 bytes or more made a spool name past NAME_MAX, and the agent could not start (found
	// by a black-box run).
	if len(base) > maxSpoolBase {
		cut := maxSpoolBase
		for cut > maxSpoolBase-utf8.UTFMax && !utf8.RuneStart(base[cut]) {
			cut-- // not inside a character: spool list prints the name
		}
		base = base[:cut]
	}
	return filepath.Join(DefaultSpoolRoot(), base+"-"+hex.EncodeToString(sum[:6]))
}

// ResolveMountPath returns the absolute path of p with every symlink resolved, as the kernel
// would follow it to mount on p. Unlike filepath.EvalSymlinks it never stats the last
// component, which may be a stale FUSE mount answering ENOTCONN: it resolves the parent and
// reads the last component as a link itself. A path that does not exist (or whose parent does
// not) is returned absolute and cleaned, for the caller's own checks to report.
func ResolveMountPath(p string) string {
	abs, err := filepath.Abs(p)
	if err != nil {
		return filepath.Clean(p)
	}
	cur := abs
	for hops := 0; hops < 40; hops++ {
		dir, last := filepath.Split(strings.TrimRight(cur, "/"))
		switch last {
		case "":
			return "/"
		case ".", "..":
			if r, err := filepath.EvalSymlinks(cur); err == nil {
				return r
			}
			return filepath.Clean(cur)
		}
		if dir == "" {
			dir = "/"
		}
		parent, err := filepath.EvalSymlinks(dir)
		if err != nil {
			return filepath.Clean(cur)
		}
		resolved := filepath.Join(parent, last)
		target, err := os.Readlink(resolved)
		if err != nil {
			// EINVAL: not a symlink. ENOENT: not there (yet). ENOTCONN: a stale mount.
			return resolved
		}
		if filepath.IsAbs(target) {
			cur = target
		} else {
			cur = parent + "/" + target // not cleaned: ".." must apply after resolving
		}
	}
	return filepath.Clean(cur) // a symlink loop: mounting on it will report ELOOP
}

// ReadOwner reads the owner record of the spool at spoolDir. A spool made before spools
// recorded their owner has none: the error then wraps os.ErrNotExist.
func ReadOwner(spoolDir string) (Owner, error) {
	var o Owner
	data, err := os.ReadFile(filepath.Join(spoolDir, OwnerFile))
	if err != nil {
		return o, err
	}
	if err := json.Unmarshal(data, &o); err != nil {
		return o, fmt.Errorf("spool owner record %s: %w", filepath.Join(spoolDir, OwnerFile), err)
	}
	return o, nil
}

// errNoOwnerRecord: the spool was opened without a MountPath (tests), and keeps no owner record.
var errNoOwnerRecord = errors.New("spool has no owner record (opened without a mount path)")

// ErrSpoolInUse is returned when another process holds a spool's lock (LockSpool).
var ErrSpoolInUse = errors.New("spool is in use by a running mtcfs agent")

// LockSpool takes the lock a running agent holds on its spool (an exclusive flock on the
// spool's root directory), without waiting: ErrSpoolInUse when an agent (or another mtcfs
// command) holds it. The lock goes away when the returned file is closed or its process dies.
func LockSpool(dir string) (*os.File, error) {
	f, err := os.OpenFile(dir, os.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, ErrSpoolInUse
		}
		return nil, fmt.Errorf("lock spool %s: %w", dir, err)
	}
	// A lock taken on a directory that was replaced meanwhile (freed, or a tmpfs mounted over
	// it) locks nothing anyone else looks at.
	var a, b unix.Stat_t
	if unix.Fstat(int(f.Fd()), &a) != nil || unix.Stat(dir, &b) != nil || a.Dev != b.Dev || a.Ino != b.Ino {
		f.Close()
		return nil, fmt.Errorf("lock spool %s: %w", dir, errSpoolReplaced)
	}
	return f, nil
}

var errSpoolReplaced = errors.New("the directory changed while it was being locked")

// lockOwned locks dir for a spool that a mount path owns, waiting a little for a command that
// holds the lock briefly (mtcfs spool free, or a starting agent reaping spools).
func lockOwned(dir, mountPath string) (*os.File, error) {
	deadline := time.Now().Add(3 * time.Second)
	for {
		f, err := LockSpool(dir)
		if err == nil {
			return f, nil
		}
		if !errors.Is(err, ErrSpoolInUse) && !errors.Is(err, errSpoolReplaced) {
			return nil, err
		}
		if time.Now().After(deadline) {
			if errors.Is(err, ErrSpoolInUse) {
				who := "another process"
				if o, e := ReadOwner(dir); e == nil {
					who = fmt.Sprintf("the agent of %s (pid %d)", o.MountPath, o.PID)
					if o.MountPath == mountPath {
						// Not this machine's registry of agents (which stops a second agent on
						// the directory before): another mount namespace, another pod.
						who += ", the same mount directory in another mount namespace (another pod on this node?)"
					}
				}
				return nil, fmt.Errorf("spool %s is in use by %s: stop that agent, or give this mount its own --spool DIR (a stopping agent keeps its spool while a running backup finishes, up to its --drain-timeout, and then while processes use its mount, up to 30 s; its log names them)", dir, who)
			}
			return nil, err
		}
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return nil, err
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// resizeError explains why an adopted spool tmpfs could not be given the new budget. The usual
// cause is an agent restarted with a smaller --memory than what the kept spool holds: the kernel
// refuses to shrink a tmpfs below its content. Starting anyway would leave no room for the job's
// next save (the restored step stays in RAM until a newer one is complete), so the start is
// refused, with the two ways on.
func resizeError(cfg SpoolConfig, err error) error {
	var st unix.Statfs_t
	if serr := unix.Statfs(cfg.Dir, &st); err == unix.EINVAL && serr == nil {
		held := (int64(st.Blocks) - int64(st.Bfree)) * st.Bsize
		if fi, err := os.Stat(filepath.Join(cfg.Dir, HeadroomFile)); err == nil {
			held -= fi.Size() // a killed agent's headroom: not checkpoints
		}
		if held > cfg.Budget {
			free := cfg.Dir
			if cfg.MountPath != "" {
				free = cfg.MountPath
			}
			return fmt.Errorf("the kept spool at %s holds %s of checkpoints, more than the memory budget (--memory) of %s: "+
				"start with --memory %s or more (twice what it holds: the restored step stays in RAM until the job's next save is complete) "+
				"to restore them from RAM, or free the spool first (mtcfs spool free %s; its checkpoints are then lost unless a peer or a backup holds them)",
				cfg.Dir, FormatSize(held), FormatSize(cfg.Budget), FormatSize(roundUpBudget(2*held)), free)
		}
	}
	return fmt.Errorf("resize spool tmpfs at %s to %s: %w", cfg.Dir, FormatSize(cfg.Budget), err)
}

// roundUpBudget rounds a --memory to advise up to a whole MiB, or from 1 GiB on to a whole
// GiB (FormatSize writes GiB exactly: 6.6005859375GiB is no advice to type).
func roundUpBudget(n int64) int64 {
	unit := int64(1 << 20)
	if n >= 1<<30 {
		unit = 1 << 30
	}
	return (n + unit - 1) / unit * unit
}

// OpenSpool prepares the spool directory. An existing tmpfs mount at Dir (left by an agent that
// was killed) is adopted and resized to the new budget, keeping its content. An agent's spool
// (MountPath set) is refused in a Dir that is neither new, empty nor a spool, or that is a tmpfs
// mounted by someone else (checkSpoolDir); an anonymous one (tests) is not checked.
func OpenSpool(cfg SpoolConfig) (*Spool, error) {
	if cfg.Budget < MinBudget {
		hint := ""
		if cfg.Budget < 1<<20 {
			hint = " (a number without a unit is bytes: give --memory a unit, such as --memory 2GiB)"
		}
		return nil, fmt.Errorf("memory budget %s is below the minimum %s%s", FormatSize(cfg.Budget), FormatSize(MinBudget), hint)
	}
	if cfg.MountPath != "" {
		if err := checkSpoolDir(cfg.Dir); err != nil {
			return nil, err
		}
		// Before anything is made through a planted symlink, and again once made.
		if err := checkSpoolOwnership(cfg.Dir, DefaultSpoolRoot(), !cfg.MountTmpfs); err != nil {
			return nil, err
		}
	}
	if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("create spool directory: %w", err)
	}
	if cfg.MountPath != "" {
		if err := checkSpoolOwnership(cfg.Dir, DefaultSpoolRoot(), !cfg.MountTmpfs); err != nil {
			return nil, err
		}
	}
	s := &Spool{dir: cfg.Dir, budget: cfg.Budget}
	owned := cfg.MountPath != ""
	if owned {
		// Before anything changes: an agent still using the spool must not see its tmpfs
		// resized or its files cleared under it, and two starting agents must not both mount.
		lock, err := lockOwned(cfg.Dir, cfg.MountPath)
		if err != nil {
			return nil, err
		}
		s.lock = lock
	}
	if cfg.MountTmpfs {
		size := cfg.Budget + HeadroomSize
		if isTmpfsMount(cfg.Dir) {
			// The predecessor's headroom is this agent's to make again: held, it could fail the
			// resize below.
			os.Remove(filepath.Join(cfg.Dir, HeadroomFile))
			if held, ok := spoolHeld(cfg.Dir); owned && ok && held > cfg.Budget {
				// Beyond the budget: the predecessor's open-ended files (garbage, see
				// clearFiles) go first, so that only records count (a review: they made the
				// size creep from start to start). Whatever they hold: held past the bound of
				// sizeForRecords by garbage, the spool was refused (a review).
				removeTrash(cfg.Dir)
				clearDir(s.FilesDir())
			}
			size = max(size, sizeForRecords(cfg))
		}
		opts := "size=" + strconv.FormatInt(size, 10) + ",mode=0700"
		s.headroomSize = size - cfg.Budget
		if isTmpfsMount(cfg.Dir) {
			readOnly := readOnlyFS(cfg.Dir)
			// A remount sets the mount's flags anew: without these, nosuid and nodev went.
			if err := unix.Mount("", cfg.Dir, "", unix.MS_REMOUNT|unix.MS_NOSUID|unix.MS_NODEV, opts); err != nil {
				s.unlock()
				return nil, resizeError(cfg, err)
			}
			if readOnly {
				// Said, not done silently (black-box h60): someone made it read-only.
				slog.Warn("the kept spool's tmpfs was read-only (remounted so under the previous agent?): remounted read-write", "spool", cfg.Dir)
			}
		} else {
			if err := unix.Mount(spoolTmpfsSource, cfg.Dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, opts); err != nil {
				s.unlock()
				return nil, fmt.Errorf("mount spool tmpfs at %s: %w", cfg.Dir, err)
			}
			if owned {
				// What others open at cfg.Dir is now the new tmpfs: hold the lock there.
				lock, err := LockSpool(cfg.Dir)
				if err != nil {
					unix.Unmount(cfg.Dir, unix.MNT_DETACH)
					s.unlock()
					return nil, fmt.Errorf("lock the new spool tmpfs at %s: %w", cfg.Dir, err)
				}
				s.unlock()
				s.lock = lock
			}
		}
		s.ownMount = true
	}
	if owned && shortOfRoom(cfg.Dir) {
		// The predecessor's open-ended files (below) filled the spool: a save cut short by
		// ENOSPC, a scratch file. They are removed now, before this agent writes anything: its
		// owner record and the .meta files of its adoption failed with ENOSPC at every start,
		// and the committed step in the spool could not be restored until an operator freed
		// the spool, and the step with it (found by a black-box run).
		removeTrash(cfg.Dir)
		if err := clearDir(s.FilesDir()); err != nil && !errors.Is(err, os.ErrNotExist) {
			s.unlock()
			return nil, fmt.Errorf("clear stale spool files of a full spool: %w", err)
		}
	}
	if owned {
		if err := s.recordOwner(ResolveMountPath(cfg.MountPath)); err != nil {
			// Keep whatever the spool holds: it may be a predecessor's checkpoints.
			s.unlock()
			if errors.Is(err, os.ErrPermission) || errors.Is(err, syscall.EROFS) {
				// It said "is the spool full?" of a spool its user may not write to (black-box h57).
				return nil, fmt.Errorf("%w (the agent's user, uid %d, may not write to the spool %s: give it a spool of its own, --spool)", err, os.Geteuid(), cfg.Dir)
			}
			return nil, fmt.Errorf("%w (is the spool %s full? mtcfs spool list shows it)", err, cfg.Dir)
		}
	}
	if err := os.MkdirAll(s.FilesDir(), 0o700); err != nil {
		s.Close()
		return nil, fmt.Errorf("create spool files directory: %w", err)
	}
	s.readShape()
	// Open-ended files of a previous agent are garbage: the namespace that named them died with
	// that agent. (Committed data is kept elsewhere in the spool and adopted by package tiers.)
	if err := s.clearFiles(); err != nil {
		s.Close()
		return nil, fmt.Errorf("clear stale spool files: %w", err)
	}
	if !s.ownMount {
		// The committed data a predecessor left is not counted here: the namespace charges
		// each file of it when the replicator adopts it (counted here too, a restart doubled
		// it, for good: 19 MiB of checkpoints showed as 38 MiB used). Nor is what the start
		// removes without a refund (adoptedDirs).
		s.used.Store(dirUsage(s.dir, adoptedDirs...))
	}
	s.FillHeadroom()
	return s, nil
}

// Dir is the spool's root directory.
func (s *Spool) Dir() string { return s.dir }

// Grown is how much larger than the budget and its headroom the spool's tmpfs was made at start
// (sizeForRecords); 0 normally. The job's part stays the budget: the rest is headroom.
func (s *Spool) Grown() int64 { return max(s.headroomSize-HeadroomSize, 0) }

// maxRecordsOver bounds what a kept spool may hold beyond the budget and still be taken as the
// agent's records in its headroom (sizeForRecords) rather than checkpoints of a larger budget
// (refused: resizeError).
const maxRecordsOver = 4 * HeadroomSize

// sizeForRecords is the size an adopted spool tmpfs needs when it holds more than the budget
// (headroom file removed), at most maxRecordsOver more: what it holds, a full headroom, and room
// for what the start writes before it fills the headroom (owner.json through a temporary name).
// A step committed with the budget full to the last byte has its records in the headroom: with
// the same --memory the next agent had no room for the .meta files of its adoption and failed at
// every start (found by a black-box run). The extra size is headroom (Spool.headroomSize), not
// the job's, so that the budget does not creep up from start to start (found by a review).
// 0: no need.
func sizeForRecords(cfg SpoolConfig) int64 {
	held, ok := spoolHeld(cfg.Dir)
	if !ok || held <= cfg.Budget || held > cfg.Budget+maxRecordsOver {
		return 0
	}
	return min((held+HeadroomSize+256<<10+4095)&^4095, cfg.Budget+maxRecordsOver+HeadroomSize)
}

// spoolHeld is what the file system at dir holds, in bytes.
func spoolHeld(dir string) (int64, bool) {
	var st unix.Statfs_t
	if unix.Statfs(dir, &st) != nil {
		return 0, false
	}
	return (int64(st.Blocks) - int64(st.Bfree)) * st.Bsize, true
}

// recordOwner writes owner.json for mountPath. The job recorded by a previous agent stays (the
// replicator compares it with its own job before adopting anything, see Owner and SetRunning).
func (s *Spool) recordOwner(mountPath string) error {
	prev, err := ReadOwner(s.dir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		// A torn or foreign record says nothing: start a new one.
		prev = Owner{}
	}
	s.ownerMu.Lock()
	defer s.ownerMu.Unlock()
	s.owner = Owner{MountPath: mountPath, Job: prev.Job, Running: prev.Running, Freed: prev.Freed, PID: os.Getpid()}
	return s.writeOwnerLocked()
}

// Owner returns the spool's owner record. Right after OpenSpool, Job is the job recorded by the
// agent that used the spool before (empty for a new spool or one that never saw a job).
func (s *Spool) Owner() Owner {
	s.ownerMu.Lock()
	defer s.ownerMu.Unlock()
	return s.owner
}

// SetRunning records the job whose data the spool holds from now on and the incarnation of it
// the agent answers (see Owner.Running), in one write. Another job's shape is not shown to this
// one (SavedShape), and is kept until this job's shape replaces it (SetShapeRestored, once its restore
// negotiation succeeded): a rank started with a mistyped job-name forgot it, and the job, back
// under its name, dropped steps it kept for a node's loss as of an unknown shape (found by a
// review). It is an error on a spool opened without a MountPath (nothing is recorded there).
func (s *Spool) SetRunning(job string, run Running) error {
	return s.updateOwner(func(o *Owner) bool {
		run.Continues = ""
		if s.shapeJob == job && s.timeline.Generation > 0 {
			run.Continues = s.timeline.of
		}
		o.Job, o.Running = job, &run
		return true
	})
}

// updateOwner changes the owner record with change, under ownerMu, and writes it when change
// says it changed it. It is errNoOwnerRecord on a spool opened without a MountPath (the change
// is kept in memory only).
func (s *Spool) updateOwner(change func(o *Owner) bool) error {
	s.ownerMu.Lock()
	defer s.ownerMu.Unlock()
	if !change(&s.owner) {
		return nil
	}
	if s.lock == nil {
		return errNoOwnerRecord
	}
	return s.writeOwnerLocked()
}

// MarkStopping records that the agent holding the spool is stopping (Owner.Stopping). The next
// agent's open writes a new record, without it.
func (s *Spool) MarkStopping() error {
	return s.updateOwner(func(o *Owner) bool {
		o.Stopping = true
		return true
	})
}

// RecordFreed records that steps of job were freed for job by (see Owner.Freed).
func (s *Spool) RecordFreed(job string, steps []int64, by string) error {
	return s.updateOwner(func(o *Owner) bool {
		if o.Freed == nil {
			o.Freed = map[string]Freed{}
		}
		for len(o.Freed) >= maxFreedJobs {
			oldest := ""
			for j, f := range o.Freed {
				if oldest == "" || f.At.Before(o.Freed[oldest].At) {
					oldest = j
				}
			}
			delete(o.Freed, oldest)
		}
		o.Freed[job] = Freed{Steps: steps, By: by, At: time.Now().UTC().Truncate(time.Second)}
		return true
	})
}

// TakeFreed returns and forgets what another job freed of job (ok false: nothing). A record
// that cannot be written back tells the job again at its next start.
func (s *Spool) TakeFreed(job string) (f Freed, ok bool) {
	s.updateOwner(func(o *Owner) bool {
		if f, ok = o.Freed[job]; ok {
			delete(o.Freed, job)
		}
		return ok
	})
	return f, ok
}

// MountMoved records that the spool's mount directory is now mountPath: a directory above it
// was renamed while the agent served it. The spool is then kept for the next agent there
// (Release), who finds it by that record (Spools.KeptFor).
func (s *Spool) MountMoved(mountPath string) error {
	return s.updateOwner(func(o *Owner) bool {
		o.MountPath = ResolveMountPath(mountPath)
		return true
	})
}

// MarkRestored records that the restore markers of incarnation were published, if the owner
// record still names it. It is an error on a spool opened without a MountPath.
func (s *Spool) MarkRestored(incarnation string) error {
	return s.updateOwner(func(o *Owner) bool {
		if o.Running == nil || o.Running.Incarnation != incarnation || o.Running.Restored {
			return false
		}
		run := *o.Running
		run.Restored = true
		o.Running = &run
		return true
	})
}

// writeShapeLocked writes ShapeFile for the owner's job; it removes it when it cannot. Called
// with ownerMu held.
func (s *Spool) writeShapeLocked(shape Shape, tl Timeline) error {
	data, _ := json.Marshal(shapeRecord{Shape: shape, Job: s.owner.Job, Generation: tl.Generation, Restores: tl.Restores, TimelineOf: tl.of, Floor: tl.Floor})
	if err := layout.WriteFileAtomic(filepath.Join(s.dir, ShapeFile), data); err != nil {
		s.forgetShapeLocked(max(tl.Floor, tl.Generation))
		return err
	}
	s.shape, s.shapeJob, s.timeline = shape, s.owner.Job, tl
	s.recorded, s.recordedJob = tl, s.owner.Job
	return nil
}

// Timeline is the restores of a job a node took part in: Generation, the newest one's (0: none
// known), and Restores, the step each restore it remembers restored (-1: none), by generation.
// Every restore is where the job's timeline may fork: the steps above the one restored are
// dropped on every node that takes part, and saved again. A node that missed restores (its
// agent away meanwhile, its spool kept) still holds those steps of the timeline the job left,
// which must not combine with the other nodes' (CutStaleTimelines).
type Timeline struct {
	Generation int64
	Restores   map[int64]int64
	// Floor is the highest generation the spool knew of the job, kept when its timeline is
	// not trusted or was cleared: the coordinator numbers a restore above every node's, so that
	// numbers never go back. Before, nodes whose numbers were all cleared numbered the next
	// restore 1 again, and a node away at a higher number then looked current, or made them
	// look stale (a review).
	Floor int64
	// of is the incarnation whose restore recorded it: the timeline is trusted at the next
	// start only while the owner record still names that incarnation. An agent of an earlier
	// release answering a job in between keeps no timeline, and rewrites no shape record of an
	// unchanged shape: the numbers it left were stale, and cut a node's good steps (a review).
	of string
}

// maxTimelineRestores bounds the restores a Timeline remembers.
const maxTimelineRestores = 64

// Timeline returns the recorded restores of job (none: the zero Timeline).
func (s *Spool) Timeline(job string) Timeline {
	s.ownerMu.Lock()
	defer s.ownerMu.Unlock()
	if s.shapeJob != job {
		return Timeline{}
	}
	if s.shape == (Shape{}) {
		// The record could not be written (and was removed): no timeline is trusted, but the
		// numbers known are never given again (a review: the floor was not reported).
		return Timeline{Floor: max(s.timeline.Floor, s.timeline.Generation)}
	}
	return Timeline{Generation: s.timeline.Generation, Restores: maps.Clone(s.timeline.Restores), Floor: max(s.timeline.Floor, s.timeline.Generation)}
}

// RestoreGeneration is the generation of the restore incarnation inc of job took part in, as
// recorded (0: none recorded for that incarnation).
func (s *Spool) RestoreGeneration(job, inc string) int64 {
	s.ownerMu.Lock()
	defer s.ownerMu.Unlock()
	if s.shapeJob != job || s.timeline.of != inc || inc == "" {
		return 0
	}
	return s.timeline.Generation
}

// errOtherJob refuses to record a restore of a job the spool no longer serves.
var errOtherJob = errors.New("the spool serves another job now")

// SetShapeRestored records (in ShapeFile), at the restore of incarnation inc of job, the shape
// of the job whose steps the spool holds from now on (a job restarted in a shape that cannot
// restore them passes them over), and with it, in one write, that the node took part in the restore of generation gen, which
// restored step (-1: none); gen 0 (a coordinator before timelines numbers no restore) forgets
// the timeline: the node missed no restore it knows of, and may have missed one since. It
// refuses when the spool serves another job now (a restore superseded by its handshake). The
// shape is given, so that a try again after no room (withRoom) writes the whole record.
func (s *Spool) SetShapeRestored(job, inc string, shape Shape, gen, step int64) error {
	s.ownerMu.Lock()
	defer s.ownerMu.Unlock()
	if s.owner.Job != job {
		return errOtherJob
	}
	var before Timeline // the restores to keep
	if s.recordedJob == job {
		before = s.recorded
	}
	tl := Timeline{Floor: max(gen, before.Floor, before.Generation)}
	if s.shapeJob == job {
		tl.Floor = max(tl.Floor, s.timeline.Floor, s.timeline.Generation)
	}
	if gen > 0 {
		tl.Generation, tl.Restores, tl.of = gen, map[int64]int64{gen: step}, inc
		for g, st := range before.Restores {
			if g < gen && g > gen-maxTimelineRestores {
				tl.Restores[g] = st
			}
		}
	}
	if err := s.writeShapeLocked(shape, tl); err != nil {
		return fmt.Errorf("record the job's shape and restore: %w", err)
	}
	return nil
}

// forgetShapeLocked removes the shape record; the highest generation known (floor, or the
// timeline's) stays as the Floor the next inventory reports. Called with ownerMu held.
func (s *Spool) forgetShapeLocked(floor int64) {
	s.shape, s.timeline = Shape{}, Timeline{Floor: max(floor, s.timeline.Floor, s.timeline.Generation)}
	os.Remove(filepath.Join(s.dir, ShapeFile))
}

// shapeRecord is ShapeFile's content: the Shape's fields, and the job it is of (an agent before
// this one wrote no job: the owner record's is meant).
type shapeRecord struct {
	Shape
	Job string `json:"job,omitempty"`
	// The job's Timeline (absent: an agent before timelines wrote it; an older agent that
	// rewrites the record drops them, and one that answers a job without rewriting it changes
	// the owner record's incarnation: unknown, never a stale timeline).
	Generation int64           `json:"generation,omitempty"`
	Restores   map[int64]int64 `json:"restores,omitempty"`
	TimelineOf string          `json:"timeline_of,omitempty"` // Timeline.of
	Floor      int64           `json:"floor,omitempty"`       // Timeline.Floor
}

// readShape loads ShapeFile; an unreadable or invalid record is no record. So is one that an
// agent which keeps no shape records may have outdated: such an agent also keeps no Running
// incarnation in the owner record, and drops it when it rewrites the record, so a record
// without one says that such an agent may have answered the job since. One did: the job changed
// its shape (or its name) there, and the next agent freed the new shape's steps as of the old
// one (found by a black-box run of mixed versions). Builds that kept shape records but no
// Running incarnation are distrusted too: the safe direction (an unknown shape drops nothing
// the plan restores).
func (s *Spool) readShape() {
	data, err := os.ReadFile(filepath.Join(s.dir, ShapeFile))
	var rec shapeRecord
	if err != nil || json.Unmarshal(data, &rec) != nil || !rec.Shape.valid() {
		return
	}
	s.ownerMu.Lock()
	defer s.ownerMu.Unlock()
	if s.owner.Running == nil {
		return
	}
	job := rec.Job
	if job == "" {
		job = s.owner.Job // the job that held the spool wrote it
	}
	s.shape, s.shapeJob = rec.Shape, job
	floor := max(rec.Floor, rec.Generation)
	run := s.owner.Running
	if rec.Generation > 0 && rec.TimelineOf != "" && (rec.TimelineOf == run.Incarnation || rec.TimelineOf == run.Continues) {
		s.timeline = Timeline{Generation: rec.Generation, Restores: rec.Restores, of: rec.TimelineOf, Floor: floor}
		s.recorded, s.recordedJob = s.timeline, job
	} else {
		s.timeline = Timeline{Floor: floor}
	}
}

// SavedShape is the recorded shape of the job's steps (the zero Shape: none recorded).
func (s *Spool) SavedShape() Shape {
	s.ownerMu.Lock()
	defer s.ownerMu.Unlock()
	if s.shapeJob != s.owner.Job {
		return Shape{} // another job's
	}
	return s.shape
}

func (s *Spool) writeOwnerLocked() error {
	s.owner.LastUsed = time.Now().UTC().Truncate(time.Millisecond)
	data, err := json.MarshalIndent(s.owner, "", "  ")
	if err != nil {
		return err
	}
	var rnd [6]byte
	rand.Read(rnd[:])
	tmp := filepath.Join(s.dir, "."+OwnerFile+".tmp-"+hex.EncodeToString(rnd[:]))
	if err := os.WriteFile(tmp, append(data, '\n'), 0o600); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("record spool owner: %w", err)
	}
	if err := os.Rename(tmp, filepath.Join(s.dir, OwnerFile)); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("record spool owner: %w", err)
	}
	return nil
}

func (s *Spool) unlock() {
	if s.lock != nil {
		s.lock.Close()
	}
}

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

// LinkFileWith is LinkFile for a caller that makes the link itself: link gives the file the
// name (one path element) in FilesDir, and fails with EEXIST for a name in use.
func (s *Spool) LinkFileWith(link func(name string) error) (string, error) {
	for {
		name := strconv.FormatUint(s.nextID.Add(1), 10)
		err := link(name)
		if errors.Is(err, os.ErrExist) {
			continue
		}
		if err != nil {
			return "", fmt.Errorf("link spool file: %w", err)
		}
		return filepath.Join(s.FilesDir(), name), nil
	}
}

// adoptedDirs are the spool directories a starting agent adopts into its namespace (commit and
// sealed records: the namespace's nodes charge their files) or empties (staging, incoming; the
// peer receiver's peer-incoming): the starting count leaves them out.
var adoptedDirs = []string{"commits", "sealed", "staging", "incoming", "peer-incoming"}

// Charge accounts for delta more bytes whatever the budget: bytes that are in the spool already
// (data imported into the namespace) are counted even past it, so that new writes fail instead.
func (s *Spool) Charge(delta int64) {
	if !s.ownMount {
		s.used.Add(delta)
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

// Usage returns the budget and the bytes in use (the headroom counts in neither).
func (s *Spool) Usage() (total, used int64) {
	if s.ownMount {
		var st unix.Statfs_t
		if err := unix.Statfs(s.dir, &st); err == nil {
			size := int64(st.Blocks) * st.Bsize
			total = max(size-s.headroomSize, 0)
			used = size - int64(st.Bfree)*st.Bsize - s.headroom.Load()
			return total, min(max(used, 0), total)
		}
	}
	return s.budget, s.used.Load()
}

// FillHeadroom makes the headroom file hold HeadroomSize again, if there is room for it. The
// agent calls it before it writes a commit record and after it frees data.
func (s *Spool) FillHeadroom() {
	if !s.ownMount || s.headroom.Load() == s.headroomSize {
		return
	}
	s.headroomMu.Lock()
	defer s.headroomMu.Unlock()
	if s.headroom.Load() == s.headroomSize {
		return
	}
	f, err := os.OpenFile(filepath.Join(s.dir, HeadroomFile), os.O_RDWR|os.O_CREATE|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return
	}
	defer f.Close()
	// A tmpfs fallocate that runs out of room gives back what it took.
	if unix.Fallocate(int(f.Fd()), 0, 0, s.headroomSize) == nil {
		s.headroom.Store(s.headroomSize)
		return
	}
	if s.headroomSize == HeadroomSize {
		return // taken back whole, once there is room (the job meanwhile has none)
	}
	// A tmpfs made larger for a kept step's records holds more than the budget: the headroom
	// takes what is free, and the rest as steps are freed (the job has no room until then).
	var st unix.Statfs_t
	if unix.Statfs(s.dir, &st) != nil {
		return
	}
	want := min((s.headroom.Load()+int64(st.Bavail)*st.Bsize)&^4095, s.headroomSize)
	if want > s.headroom.Load() && unix.Fallocate(int(f.Fd()), 0, 0, want) == nil {
		s.headroom.Store(want)
	}
}

// UseHeadroom frees HeadroomChunk of the headroom for the agent's own records when err says
// the spool is out of room, and reports whether it did: the write that failed is then worth
// once more (and UseHeadroom again if it fails again, until the headroom is used up).
func (s *Spool) UseHeadroom(err error) bool {
	if err == nil || !errors.Is(err, unix.ENOSPC) || !s.ownMount || s.headroom.Load() == 0 {
		return false
	}
	s.headroomMu.Lock()
	defer s.headroomMu.Unlock()
	held := s.headroom.Load()
	if held == 0 {
		return false
	}
	left := max(held-HeadroomChunk, 0)
	if os.Truncate(filepath.Join(s.dir, HeadroomFile), left) != nil {
		return false
	}
	s.headroom.Store(left)
	return true
}

// Close releases the spool. With discard, a dedicated tmpfs is unmounted (its content is lost)
// and the directory removed; otherwise the content stays for the next agent to adopt.
func (s *Spool) Close() error { return s.close(true) }

// Detach releases the spool but keeps its content (and its tmpfs mount) for a later agent.
func (s *Spool) Detach() error { return s.close(false) }

func (s *Spool) close(discard bool) error {
	var err error
	s.closeOnce.Do(func() {
		defer s.unlock() // last: nobody may take the spool before it is gone or recorded
		if !discard {
			if s.trash.Load() {
				removeTrash(s.dir) // a kept spool keeps no garbage in RAM
			}
			if s.ownMount {
				os.Remove(filepath.Join(s.dir, HeadroomFile)) // the next agent makes its own
			}
			if s.lock != nil {
				s.ownerMu.Lock()
				err = s.writeOwnerLocked() // the time it was last used
				s.ownerMu.Unlock()
			}
			return
		}
		if s.ownMount {
			if e := unix.Unmount(s.dir, unix.MNT_DETACH); e != nil {
				err = fmt.Errorf("unmount spool %s: %w", s.dir, e)
				return
			}
		}
		err = removeSpoolDir(s.dir, s.ownMount)
	})
	return err
}

// isSpoolEntry tells whether name is an entry a spool's root holds.
func isSpoolEntry(name string) bool {
	switch name {
	case "files", "meta", "sealed", "staging", "incoming", commitsDir, "peer-incoming", OwnerFile, ShapeFile, "." + ShapeFile + ".tmp", HeadroomFile:
		return true
	}
	return strings.HasPrefix(name, filesTrashPrefix) || strings.HasPrefix(name, "."+OwnerFile+".tmp-")
}

// entryNames lists the names in the directory dir that keep (nil: all) takes.
func entryNames(dir string, keep func(name string) bool) ([]string, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range ents {
		if keep == nil || keep(e.Name()) {
			out = append(out, e.Name())
		}
	}
	return out, nil
}

// listSome joins the first show of names, and says how many more there are.
func listSome(names []string, show int) string {
	if len(names) <= show {
		return strings.Join(names, ", ")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(names[:show], ", "), len(names)-show)
}

// checkSpoolDir refuses a spool directory the agent must not take: an existing directory that is
// not empty and not a spool, and a tmpfs mounted by someone else. Before, the agent took either:
// it mounted its tmpfs over the directory (or resized the foreign tmpfs), and a stop that freed
// the spool unmounted it and removed the directory, so a mistyped --spool /data deleted /data,
// and --spool /dev/shm would have unmounted the machine's /dev/shm. Taken are: a directory that
// does not exist, an empty one, a spool tmpfs (source mtcfs-spool), and a directory with an
// agent's owner record (OwnerFile, naming a mount path), which an agent writes before anything
// else into a spool; also one holding nothing but a torn first write of that record. Entry names
// alone prove nothing: a user's directory may well hold just "files".
func checkSpoolDir(dir string) error {
	real, err := filepath.EvalSymlinks(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil // made by OpenSpool
	}
	if err != nil {
		return fmt.Errorf("spool %s: %w", dir, err)
	}
	fi, err := os.Stat(real)
	if err != nil {
		return fmt.Errorf("spool %s: %w", dir, err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("spool %s is not a directory", dir)
	}
	if isSpoolTmpfs(real) {
		return nil
	}
	if isTmpfsMount(real) {
		return fmt.Errorf("spool %s is a tmpfs mounted by someone else, not an mtcfs spool: the agent mounts the spool's tmpfs itself, and unmounts and removes it once the spool is freed; give a new directory, such as %s", dir, filepath.Join(dir, "mtcfs-spool"))
	}
	if o, err := ReadOwner(real); err == nil && o.MountPath != "" {
		return nil
	}
	names, err := entryNames(real, func(name string) bool { return !strings.HasPrefix(name, "."+OwnerFile+".tmp-") })
	if err != nil {
		return fmt.Errorf("spool %s: %w", dir, err)
	}
	if len(names) > 0 {
		return fmt.Errorf("spool %s is not empty and not an mtcfs spool (no %s of an agent; it holds %s): the agent would hide it under its tmpfs and remove it once the spool is freed; give a new or empty directory", dir, OwnerFile, listSome(names, 5))
	}
	return nil
}

// checkSpoolOwnership refuses a spool that another user made or can change. Another local user
// who made /dev/shm/mtcfs-UID (0777) before the victim's first agent could swap a kept spool
// for one of theirs, and the victim's next agent adopted it and restored the other user's bytes
// as its job's step (found by a black-box run). The default root above the spool (defaultRoot)
// must be this user's and writable by no one else, also for root, who first takes it back
// (takeRoot): a user who made /dev/shm/mtcfs could later rename what is below it and plant
// symlinks that root's clearing, unmounting and removal follow (found by a review). The spool
// directory itself must be this user's for a plain spool (no tmpfs of its own: an agent without
// root); a tmpfs spool is a fresh root-owned 0700 tmpfs mounted over it, which hides whatever
// was planted there, so a --spool directory a user made first is taken by root. What does not
// exist yet is made by the agent (0700).
func checkSpoolOwnership(dir, defaultRoot string, plain bool) error {
	euid := os.Geteuid()
	inRoot := filepath.Dir(dir) == defaultRoot
	check := func(path, what string, root bool) error {
		stat := os.Stat // a --spool of the user's choosing may be a symlink
		if inRoot {
			stat = os.Lstat // below the default root, one is planted
		}
		fi, err := stat(path)
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("spool %s: %w", dir, err)
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		switch {
		case !fi.IsDir():
			return fmt.Errorf("%s %s is not a directory (a symlink?): another user may have made it; remove it, or give --spool in a directory of yours", what, path)
		case !ok || (!plain && !root):
		case int(st.Uid) != euid:
			return fmt.Errorf("%s %s belongs to uid %d, not to this agent's user (uid %d): another user may have made it to plant checkpoints; remove it (as root), or give --spool in a directory of yours", what, path, st.Uid, euid)
		case root && fi.Mode().Perm()&0o022 != 0:
			return fmt.Errorf("%s %s is writable by others (mode %04o): another user could swap a kept spool in it; chmod go-w it, or give --spool in a directory of yours", what, path, fi.Mode().Perm())
		}
		return nil
	}
	if inRoot && !plain && euid == 0 {
		if err := takeRoot(defaultRoot); err != nil {
			return err
		}
	}
	if inRoot {
		if err := check(defaultRoot, "the spool root", true); err != nil {
			return err
		}
	}
	return check(dir, "the spool", false)
}

// takeRoot gives root's default spool root to root, mode 0700, when someone else owns it or may
// write to it: mtcfs run without root once used /dev/shm/mtcfs too, which left it a user's, and
// refusing it (or removing it, with root's kept spool tmpfs below) stopped root agents there
// (found by a review). Once root's, no one else can plant anything more in it; what is there
// already is checked entry by entry (a symlink is refused, a directory hidden under a tmpfs).
func takeRoot(path string) error {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) {
		return nil // made by the agent
	}
	if err != nil {
		return fmt.Errorf("the spool root %s: %w (a symlink? remove it)", path, err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("the spool root %s: %w", path, err)
	}
	if st.Uid == 0 && st.Mode&0o022 == 0 {
		return nil
	}
	if err := unix.Fchown(fd, 0, 0); err != nil {
		return fmt.Errorf("the spool root %s belongs to uid %d: %w", path, st.Uid, err)
	}
	if err := unix.Fchmod(fd, 0o700); err != nil {
		return fmt.Errorf("the spool root %s: %w", path, err)
	}
	slog.Warn("the spool root belonged to another user or was writable by others (an agent run without root by an earlier version makes it a user's): it is root's now, mode 0700", "dir", path, "uid_was", st.Uid, "mode_was", fmt.Sprintf("%04o", st.Mode&0o7777))
	return nil
}

// removeSpoolDir removes a spool directory no tmpfs is mounted on any more. unmounted says the
// spool was such a tmpfs, just unmounted: its content went with it, and the directory below is
// only removed if empty (whatever it holds was there before a tmpfs hid it). Otherwise the spool
// was the directory itself: its spool entries go, then the directory. Anything else stays, and so
// does the directory: those are not the agent's to remove (see checkSpoolDir). A --spool given as
// a symlink stays, and so does the directory it names: the user's (the link was removed, and
// the next start made a plain directory in its place, found by a review).
func removeSpoolDir(dir string, unmounted bool) error {
	fi, err := os.Lstat(dir)
	link := err == nil && fi.Mode()&os.ModeSymlink != 0
	if unmounted {
		if link {
			return nil
		}
		err := os.Remove(dir)
		if err == nil || errors.Is(err, os.ErrNotExist) {
			return nil
		}
		if errors.Is(err, unix.ENOTEMPTY) || errors.Is(err, unix.EEXIST) {
			names, _ := entryNames(dir, nil)
			return fmt.Errorf("spool %s: its tmpfs is unmounted; the directory below stays, it holds what was there before (%s)", dir, listSome(names, 5))
		}
		return fmt.Errorf("remove spool %s: %w", dir, err)
	}
	names, err := entryNames(dir, nil)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("remove spool %s: %w", dir, err)
	}
	var foreign []string
	for _, name := range names {
		if !isSpoolEntry(name) {
			foreign = append(foreign, name)
		} else if err := os.RemoveAll(filepath.Join(dir, name)); err != nil {
			return fmt.Errorf("remove spool %s: %w", dir, err)
		}
	}
	if len(foreign) > 0 {
		return fmt.Errorf("spool %s: its own entries removed; the directory stays, it holds entries that are not a spool's (%s)", dir, listSome(foreign, 5))
	}
	if link {
		return nil
	}
	if err := os.Remove(dir); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove spool %s: %w", dir, err)
	}
	return nil
}

// filesTrashPrefix names the directories that clearFiles moves a previous agent's files into.
const filesTrashPrefix = ".files-trash-"

// clearFiles empties FilesDir of what a previous agent left. On a spool of its own (the budget is
// the tmpfs's) the directory is moved aside in one rename and removed later (RemoveTrash): a
// restarted agent need not unlink a file for every file of its predecessor's checkpoints before
// it serves (the committed data has names of its own elsewhere in the spool). An agent-accounted
// budget is computed from what is left, so there the files are removed first.
func (s *Spool) clearFiles() error {
	if !s.ownMount {
		return clearDir(s.FilesDir())
	}
	var rnd [6]byte
	rand.Read(rnd[:])
	trash := filepath.Join(s.dir, filesTrashPrefix+hex.EncodeToString(rnd[:]))
	if err := os.Rename(s.FilesDir(), trash); err != nil {
		return clearDir(s.FilesDir())
	}
	s.trash.Store(true)
	return os.Mkdir(s.FilesDir(), 0o700)
}

// RemoveTrash removes in the background the files clearFiles moved aside, and what an agent
// killed before it got there left. The replicator calls it once it has adopted the committed
// data, so that a restart's adoption (a read and a link per file) does not share the CPUs with
// an unlink per file of the predecessor's checkpoints. Detach removes what is left of them, also
// for an agent that fails before it adopted anything.
func (s *Spool) RemoveTrash() {
	go func() {
		removeTrash(s.dir)
		s.trash.Store(false)
	}()
}

// removeTrash removes the directories clearFiles moved aside in the spool at dir.
func removeTrash(dir string) {
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), filesTrashPrefix) {
			os.RemoveAll(filepath.Join(dir, e.Name()))
		}
	}
}

// shortOfRoom reports whether the file system of dir has less room than the agent's start
// writes (its records and the headroom for them).
func shortOfRoom(dir string) bool {
	var st unix.Statfs_t
	if unix.Statfs(dir, &st) != nil {
		return false
	}
	return int64(st.Bavail)*st.Bsize < 2*HeadroomSize
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

// Detached reports whether the tmpfs this spool mounted is no longer at its directory (unmounted
// or detached from under the agent, umount -l): the checkpoints it held are out of reach, and
// what the agent writes next lands on the disk below (a black-box run: status and the probes
// said nothing). A spool without a tmpfs of its own is never detached.
func (s *Spool) Detached() bool {
	return s.ownMount && !isTmpfsMount(s.dir)
}

// ReadOnly reports whether the spool's file system is mounted read-only (a `mount -o
// remount,ro` under the agent): commits cannot be recorded or sealed meanwhile; they are tried
// again until it is writable again, for up to 2 minutes after each commit.
func (s *Spool) ReadOnly() bool { return readOnlyFS(s.dir) }

// readOnlyFS reports whether the file system of dir is mounted read-only.
func readOnlyFS(dir string) bool {
	var fs unix.Statfs_t
	return unix.Statfs(dir, &fs) == nil && fs.Flags&unix.ST_RDONLY != 0
}

// isTmpfsMount reports whether dir is itself the root of a tmpfs mount.
func isTmpfsMount(dir string) bool {
	// A --spool given as a symlink: its target's parent, not the link's (a link on a disk to a
	// new directory on /dev/shm looked like a tmpfs of its own: a review).
	if r, err := filepath.EvalSymlinks(dir); err == nil {
		dir = r
	}
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

// dirUsage sums the sizes of the regular files below dir, but for its subdirectories named in
// skip.
func dirUsage(dir string, skip ...string) int64 {
	var total int64
	filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() && filepath.Dir(p) == dir && slices.Contains(skip, d.Name()) {
			return filepath.SkipDir
		}
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
