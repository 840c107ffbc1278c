package fs

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The differential tests make the same file system calls on an mtcfs mount and on a tmpfs
// directory and require the same outcome from both, call by call: return values, bytes read
// and errno. Every few calls they also compare the whole trees. tmpfs is the reference because
// the spool lives on it and because mtcfs promises tmpfs semantics.
//
// TestDifferential replays seeded random call sequences. A failure names the seed; rerun it
// alone with
//
//	MTCFS_SEED=<seed> go test -run 'TestDifferential$' ./fs/      (or: -args -seed=<seed>)
//
// and add MTCFS_DIFF_COMPARE_EVERY=1 to find the first call after which the trees differ.
// TestDifferentialCases replays fixed sequences for the cases a random run may hit rarely.
var diffSeedFlag = flag.Uint64("seed", 0, "run TestDifferential with only this seed (also MTCFS_SEED)")

// diffFixedSeeds always run, so that what they found once stays found; one more seed from the
// clock explores a new sequence on every run.
var diffFixedSeeds = []uint64{1, 2, 3}

const (
	diffOps          = 2000 // per seed and data path
	diffOpsShort     = 300
	diffCompareEvery = 50 // calls between whole-tree comparisons
	diffMaxOpen      = 8  // open-file pool size
	diffRecent       = 40 // calls shown when a comparison fails
	diffMaxFileSize  = 96 << 10
)

func TestDifferential(t *testing.T) {
	seeds := diffSeeds(t)
	mmap := startMmapHelper(t)
	ops := diffOps
	if testing.Short() {
		ops = diffOpsShort
	}
	for _, mode := range modes {
		t.Run(string(mode), func(t *testing.T) {
			for _, seed := range seeds {
				t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) {
					newDifferential(t, mode, seed, mmap).runRandom(ops)
				})
			}
		})
	}
}

// diffSeeds returns the seed from -seed or MTCFS_SEED if one is given, otherwise the fixed
// seeds plus one from the clock.
func diffSeeds(t *testing.T) []uint64 {
	if *diffSeedFlag != 0 {
		return []uint64{*diffSeedFlag}
	}
	if s := os.Getenv("MTCFS_SEED"); s != "" {
		seed, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("MTCFS_SEED=%q: %v", s, err)
		}
		return []uint64{seed}
	}
	return append(append([]uint64(nil), diffFixedSeeds...), uint64(time.Now().UnixNano())%1_000_000_000+1000)
}

// differential drives the same calls on both trees. Index 0 is mtcfs, 1 the tmpfs reference.
type differential struct {
	t       *testing.T
	seed    uint64 // 0 for the fixed sequences
	rng     *rand.Rand
	roots   [2]string
	mmapper *mmapHelper
	files   []*diffFile // open files, used on after unlink and rename
	step    int
	recent  []string
}

var diffSideNames = [2]string{"mtcfs", "tmpfs"}

// diffFile is one open(2) done on both trees.
type diffFile struct {
	fd   [2]int
	desc string
	dir  bool // a directory: its offsets mean different things on FUSE and tmpfs
}

func newDifferential(t *testing.T, mode PassthroughMode, seed uint64, mmap *mmapHelper) *differential {
	if seed != 0 {
		t.Logf("seed %d", seed)
	}
	mnt, _ := testMount(t, mode, 256<<20)
	d := &differential{
		t:       t,
		seed:    seed,
		rng:     rand.New(rand.NewPCG(seed, seed^0x6d74636673)),
		roots:   [2]string{mnt, referenceDir(t)},
		mmapper: mmap,
	}
	// Both roots start alike (MkdirTemp makes the reference 0700).
	for _, root := range d.roots {
		if err := os.Chmod(root, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// Registered after testMount, so it runs before the unmount: an fd left open on the mount
	// would make the unmount wait forever.
	t.Cleanup(d.closeAll)
	return d
}

// referenceDir returns an empty directory on tmpfs (/dev/shm), or in the test's temp dir if
// /dev/shm is not tmpfs.
func referenceDir(t *testing.T) string {
	var st unix.Statfs_t
	if unix.Statfs("/dev/shm", &st) != nil || st.Type != unix.TMPFS_MAGIC {
		t.Logf("/dev/shm is not tmpfs; the reference tree lives in %s", os.TempDir())
		return t.TempDir()
	}
	dir, err := os.MkdirTemp("/dev/shm", "mtcfs-diff-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

func (d *differential) runRandom(ops int) {
	type op struct {
		weight int
		run    func()
	}
	table := []op{
		{8, d.randCreate}, {8, d.randOpen}, {4, d.randClose},
		{10, d.randPwrite}, {5, d.randWrite}, {8, d.randPread}, {3, d.randRead}, {3, d.randLseek},
		{4, d.randFtruncate}, {3, d.randTruncate}, {3, d.randFsync}, {4, d.randFstat},
		{8, d.randMkdir}, {5, d.randRmdir}, {6, d.randUnlink},
		{10, d.randRename}, {5, d.randSymlink}, {3, d.randReadlink}, {4, d.randLink},
		{4, d.randLstat}, {4, d.randStat}, {3, d.randChmod}, {3, d.randUtimens},
		{4, d.randReaddir}, {1, d.randStatfs}, {2, d.randMmapWrite}, {2, d.randMmapRead},
	}
	compareEvery := diffCompareEvery
	if n, err := strconv.Atoi(os.Getenv("MTCFS_DIFF_COMPARE_EVERY")); err == nil && n > 0 {
		compareEvery = n
	}
	total := 0
	for _, o := range table {
		total += o.weight
	}
	for i := 1; i <= ops; i++ {
		w := d.rng.IntN(total)
		for _, o := range table {
			if w < o.weight {
				o.run()
				break
			}
			w -= o.weight
		}
		if i%compareEvery == 0 {
			d.compareTrees()
		}
	}
	d.closeAll()
	d.compareTrees()
}

func (d *differential) path(side int, rel string) string { return filepath.Join(d.roots[side], rel) }

// both runs f on each tree and fails the test unless value and errno agree. It returns them.
func (d *differential) both(desc string, f func(side int) (string, error)) (string, syscall.Errno) {
	d.t.Helper()
	d.step++
	d.recent = append(d.recent, fmt.Sprintf("%5d %s", d.step, desc))
	if len(d.recent) > diffRecent {
		d.recent = d.recent[1:]
	}
	var vals [2]string
	var errs [2]syscall.Errno
	for side := range 2 {
		v, err := f(side)
		vals[side], errs[side] = v, d.errno(err)
	}
	if errs[0] != errs[1] {
		d.fatalf("%s: mtcfs errno %s, tmpfs errno %s (mtcfs value %s)", desc, errnoName(errs[0]), errnoName(errs[1]), short(vals[0]))
	}
	if vals[0] != vals[1] {
		d.fatalf("%s: mtcfs and tmpfs disagree: %s", desc, describeDiff("mtcfs", vals[0], "tmpfs", vals[1]))
	}
	return vals[1], errs[1]
}

func (d *differential) errno(err error) syscall.Errno {
	d.t.Helper()
	if err == nil {
		return 0
	}
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		d.fatalf("error without errno: %v", err)
	}
	return errno
}

func (d *differential) fatalf(format string, args ...any) {
	d.t.Helper()
	msg := fmt.Sprintf("call %d: %s\nlast calls:\n%s", d.step, fmt.Sprintf(format, args...), strings.Join(d.recent, "\n"))
	if d.seed == 0 {
		d.t.Fatal(msg)
	}
	d.t.Fatalf("seed %d, %s\nrerun: MTCFS_SEED=%d go test -run '%s' ./fs/", d.seed, msg, d.seed, d.t.Name())
}

func errnoName(e syscall.Errno) string {
	if e == 0 {
		return "0 (success)"
	}
	return fmt.Sprintf("%d %s (%v)", int(e), unix.ErrnoName(e), e)
}

// short abbreviates a long value (file contents) for messages.
func short(v string) string {
	if len(v) <= 80 {
		return strconv.Quote(v)
	}
	return fmt.Sprintf("%q… (%d bytes)", v[:60], len(v))
}

// describeDiff says where two values (file contents, mostly) part.
func describeDiff(aName, a, bName, b string) string {
	i := 0
	for i < len(a) && i < len(b) && a[i] == b[i] {
		i++
	}
	return fmt.Sprintf("%s %s, %s %s (lengths %d/%d, first difference at byte %d)", aName, short(a), bName, short(b), len(a), len(b), i)
}

func (d *differential) closeAll() {
	for _, f := range d.files {
		for side, fd := range f.fd {
			if fd >= 0 {
				unix.Close(fd)
				f.fd[side] = -1
			}
		}
	}
	d.files = nil
}

// ---------------------------------------------------------------------------------------------
// Calls. Each makes one system call on both trees and returns the (common) errno.

// open opens p on both trees and adds the fds to the pool; nil if the open failed.
func (d *differential) open(p string, flags int, flagName string, mode uint32) (*diffFile, syscall.Errno) {
	d.t.Helper()
	f := &diffFile{fd: [2]int{-1, -1}, desc: fmt.Sprintf("%s %s %#o", p, flagName, mode)}
	d.files = append(d.files, f) // before the calls, so closeAll sees an fd opened on one side only
	_, errno := d.both("open "+f.desc, func(side int) (string, error) {
		fd, err := unix.Open(d.path(side, p), flags|unix.O_CLOEXEC, mode)
		if err == nil {
			f.fd[side] = fd
		}
		return "", err
	})
	if errno != 0 {
		d.files = d.files[:len(d.files)-1]
		return nil, errno
	}
	var st unix.Stat_t
	if err := unix.Fstat(f.fd[1], &st); err != nil {
		d.fatalf("fstat after open %s: %v", f.desc, err)
	}
	f.dir = st.Mode&unix.S_IFMT == unix.S_IFDIR
	return f, 0
}

func (d *differential) create(p string, mode uint32) (*diffFile, syscall.Errno) {
	d.t.Helper()
	return d.open(p, unix.O_CREAT|unix.O_EXCL|unix.O_RDWR, "O_CREAT|O_EXCL|O_RDWR", mode)
}

// mustOpen is open for the fixed sequences, where the open has to succeed.
func (d *differential) mustOpen(p string, flags int, flagName string) *diffFile {
	d.t.Helper()
	f, errno := d.open(p, flags, flagName, 0)
	if errno != 0 {
		d.fatalf("open %s %s: %s", p, flagName, errnoName(errno))
	}
	return f
}

func (d *differential) mustCreate(p string, mode uint32) *diffFile {
	d.t.Helper()
	f, errno := d.create(p, mode)
	if errno != 0 {
		d.fatalf("create %s: %s", p, errnoName(errno))
	}
	return f
}

func (d *differential) close(f *diffFile) syscall.Errno {
	d.t.Helper()
	for i, g := range d.files {
		if g == f {
			d.files = append(d.files[:i], d.files[i+1:]...)
			break
		}
	}
	_, errno := d.both("close "+f.desc, func(side int) (string, error) {
		fd := f.fd[side]
		f.fd[side] = -1
		return "", unix.Close(fd)
	})
	return errno
}

func (d *differential) pwrite(f *diffFile, off int64, data []byte) syscall.Errno {
	d.t.Helper()
	_, errno := d.both(fmt.Sprintf("pwrite %s off=%d len=%d", f.desc, off, len(data)), func(side int) (string, error) {
		n, err := unix.Pwrite(f.fd[side], data, off)
		return strconv.Itoa(n), err
	})
	return errno
}

// write writes at the file position: at the end for O_APPEND opens.
func (d *differential) write(f *diffFile, data []byte) syscall.Errno {
	d.t.Helper()
	_, errno := d.both(fmt.Sprintf("write %s len=%d", f.desc, len(data)), func(side int) (string, error) {
		n, err := unix.Write(f.fd[side], data)
		if err != nil {
			return "", err
		}
		pos, err := unix.Seek(f.fd[side], 0, unix.SEEK_CUR)
		return fmt.Sprintf("n=%d pos=%d", n, pos), err
	})
	return errno
}

func (d *differential) pread(f *diffFile, off int64, n int) (string, syscall.Errno) {
	d.t.Helper()
	return d.both(fmt.Sprintf("pread %s off=%d len=%d", f.desc, off, n), func(side int) (string, error) {
		buf := make([]byte, n)
		got, err := unix.Pread(f.fd[side], buf, off)
		if err != nil {
			return "", err
		}
		return string(buf[:got]), nil
	})
}

func (d *differential) read(f *diffFile, n int) syscall.Errno {
	d.t.Helper()
	_, errno := d.both(fmt.Sprintf("read %s len=%d", f.desc, n), func(side int) (string, error) {
		buf := make([]byte, n)
		got, err := unix.Read(f.fd[side], buf)
		if err != nil {
			return "", err
		}
		return string(buf[:got]), nil
	})
	return errno
}

func (d *differential) lseek(f *diffFile, off int64, whence int) syscall.Errno {
	d.t.Helper()
	desc := fmt.Sprintf("lseek %s off=%d whence=%d", f.desc, off, whence)
	if whence == unix.SEEK_DATA || whence == unix.SEEK_HOLE {
		_, errno := d.both(desc, func(side int) (string, error) { return seekDataHole(f.fd[side], off, whence) })
		return errno
	}
	_, errno := d.both(desc, func(side int) (string, error) {
		pos, err := unix.Seek(f.fd[side], off, whence)
		return strconv.FormatInt(pos, 10), err
	})
	return errno
}

// seekDataHole checks SEEK_DATA and SEEK_HOLE against what they promise rather than against
// tmpfs: where holes are is up to the file system (tmpfs fills a hole when it is read through a
// mapping; mtcfs without passthrough reads the spool file with read(2), which does not), and
// any hole may be reported as data. What must hold: ENXIO when off is at or past EOF
// (SEEK_DATA may also say ENXIO for a hole that runs to EOF), a result in [off, EOF], and
// zeros wherever a hole is reported. The position is then set to off on both trees.
func seekDataHole(fd int, off int64, whence int) (string, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return "", err
	}
	pos, err := unix.Seek(fd, off, whence)
	if errors.Is(err, unix.ENXIO) && whence == unix.SEEK_DATA && off >= 0 && off < st.Size {
		pos, err = st.Size, nil // a hole up to EOF
	}
	if err != nil {
		return "", err
	}
	if pos < off || pos > st.Size {
		return fmt.Sprintf("result %d outside [%d, %d]", pos, off, st.Size), nil
	}
	holeStart, holeEnd := off, pos // SEEK_DATA: [off, pos) is a hole
	if whence == unix.SEEK_HOLE {
		holeStart, holeEnd = pos, min(pos+1, st.Size)
	}
	if holeEnd > holeStart {
		buf := make([]byte, holeEnd-holeStart)
		n, err := unix.Pread(fd, buf, holeStart) // EBADF for write-only opens: nothing to check
		if err == nil && !bytes.Equal(buf[:n], make([]byte, n)) {
			return fmt.Sprintf("reported a hole at [%d, %d) that holds data", holeStart, holeEnd), nil
		}
	}
	if _, err := unix.Seek(fd, off, unix.SEEK_SET); err != nil {
		return "", err
	}
	return "ok", nil
}

func (d *differential) ftruncate(f *diffFile, size int64) syscall.Errno {
	d.t.Helper()
	_, errno := d.both(fmt.Sprintf("ftruncate %s %d", f.desc, size), func(side int) (string, error) {
		return "", unix.Ftruncate(f.fd[side], size)
	})
	return errno
}

func (d *differential) truncate(p string, size int64) syscall.Errno {
	d.t.Helper()
	_, errno := d.both(fmt.Sprintf("truncate %s %d", p, size), func(side int) (string, error) {
		return "", unix.Truncate(d.path(side, p), size)
	})
	return errno
}

func (d *differential) fsync(f *diffFile, datasync bool) syscall.Errno {
	d.t.Helper()
	_, errno := d.both(fmt.Sprintf("fsync %s datasync=%v", f.desc, datasync), func(side int) (string, error) {
		if datasync {
			return "", unix.Fdatasync(f.fd[side])
		}
		return "", unix.Fsync(f.fd[side])
	})
	return errno
}

func (d *differential) fstat(f *diffFile) (string, syscall.Errno) {
	d.t.Helper()
	return d.both("fstat "+f.desc, func(side int) (string, error) {
		var st unix.Stat_t
		if err := unix.Fstat(f.fd[side], &st); err != nil {
			return "", err
		}
		return formatStat(&st), nil
	})
}

func (d *differential) mkdir(p string, mode uint32) syscall.Errno {
	d.t.Helper()
	_, errno := d.both(fmt.Sprintf("mkdir %s %#o", p, mode), func(side int) (string, error) {
		return "", unix.Mkdir(d.path(side, p), mode)
	})
	return errno
}

func (d *differential) rmdir(p string) syscall.Errno {
	d.t.Helper()
	_, errno := d.both("rmdir "+p, func(side int) (string, error) {
		return "", unix.Rmdir(d.path(side, p))
	})
	return errno
}

func (d *differential) unlink(p string) syscall.Errno {
	d.t.Helper()
	_, errno := d.both("unlink "+p, func(side int) (string, error) {
		return "", unix.Unlink(d.path(side, p))
	})
	return errno
}

var renameFlagNames = map[uint]string{0: "rename", unix.RENAME_NOREPLACE: "rename NOREPLACE", unix.RENAME_EXCHANGE: "rename EXCHANGE"}

func (d *differential) rename(from, to string, flags uint) syscall.Errno {
	d.t.Helper()
	_, errno := d.both(fmt.Sprintf("%s %s %s", renameFlagNames[flags], from, to), func(side int) (string, error) {
		return "", unix.Renameat2(unix.AT_FDCWD, d.path(side, from), unix.AT_FDCWD, d.path(side, to), flags)
	})
	return errno
}

func (d *differential) symlink(target, p string) syscall.Errno {
	d.t.Helper()
	_, errno := d.both(fmt.Sprintf("symlink %s -> %s", p, target), func(side int) (string, error) {
		return "", unix.Symlink(target, d.path(side, p))
	})
	return errno
}

func (d *differential) readlink(p string) (string, syscall.Errno) {
	d.t.Helper()
	return d.both("readlink "+p, func(side int) (string, error) {
		buf := make([]byte, 256)
		n, err := unix.Readlink(d.path(side, p), buf)
		if err != nil {
			return "", err
		}
		return string(buf[:n]), nil
	})
}

// link makes a hard link; flags 0 links a symlink itself, AT_SYMLINK_FOLLOW what it points to.
func (d *differential) link(from, to string, flags int) syscall.Errno {
	d.t.Helper()
	_, errno := d.both(fmt.Sprintf("link %s %s flags=%#x", from, to, flags), func(side int) (string, error) {
		return "", unix.Linkat(unix.AT_FDCWD, d.path(side, from), unix.AT_FDCWD, d.path(side, to), flags)
	})
	return errno
}

func (d *differential) lstat(p string) (string, syscall.Errno) {
	d.t.Helper()
	return d.both("lstat "+p, func(side int) (string, error) {
		var st unix.Stat_t
		if err := unix.Lstat(d.path(side, p), &st); err != nil {
			return "", err
		}
		return formatStat(&st), nil
	})
}

// stat follows symlinks, dangling and looping ones included.
func (d *differential) stat(p string) (string, syscall.Errno) {
	d.t.Helper()
	return d.both("stat "+p, func(side int) (string, error) {
		var st unix.Stat_t
		if err := unix.Stat(d.path(side, p), &st); err != nil {
			return "", err
		}
		return formatStat(&st), nil
	})
}

func (d *differential) chmod(p string, mode uint32) syscall.Errno {
	d.t.Helper()
	_, errno := d.both(fmt.Sprintf("chmod %s %#o", p, mode), func(side int) (string, error) {
		return "", unix.Chmod(d.path(side, p), mode)
	})
	return errno
}

// utimens sets mtime (and atime unless it is UTIME_OMIT) and reads mtime back: the one time
// stamp compared, because it was set explicitly.
func (d *differential) utimens(p string, atime, mtime unix.Timespec, flags int) syscall.Errno {
	d.t.Helper()
	want := fmt.Sprintf("mtime=%d.%09d", mtime.Sec, mtime.Nsec)
	got, errno := d.both(fmt.Sprintf("utimensat %s %s flags=%#x", p, want, flags), func(side int) (string, error) {
		path := d.path(side, p)
		if err := unix.UtimesNanoAt(unix.AT_FDCWD, path, []unix.Timespec{atime, mtime}, flags); err != nil {
			return "", err
		}
		var st unix.Stat_t
		if err := unix.Fstatat(unix.AT_FDCWD, path, &st, flags); err != nil {
			return "", err
		}
		return fmt.Sprintf("mtime=%d.%09d", st.Mtim.Sec, st.Mtim.Nsec), nil
	})
	if errno == 0 && got != want {
		d.fatalf("utimensat %s: read back %s, set %s", p, got, want)
	}
	return errno
}

func (d *differential) readdir(p string) (string, syscall.Errno) {
	d.t.Helper()
	return d.both("readdir "+p, func(side int) (string, error) {
		names, err := readdirTyped(d.path(side, p))
		return strings.Join(names, " "), err
	})
}

// readdirTyped lists dir as sorted "name:type" strings.
func readdirTyped(dir string) ([]string, error) {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(fd), dir)
	defer f.Close()
	ents, err := f.ReadDir(-1)
	if err != nil {
		return nil, err
	}
	names := make([]string, 0, len(ents))
	for _, e := range ents {
		names = append(names, e.Name()+":"+e.Type().Type().String())
	}
	sort.Strings(names)
	return names, nil
}

// statfs only has to answer like tmpfs does: the numbers are the spool's.
func (d *differential) statfs(p string) syscall.Errno {
	d.t.Helper()
	_, errno := d.both("statfs "+p, func(side int) (string, error) {
		var st unix.Statfs_t
		return "", unix.Statfs(d.path(side, p), &st)
	})
	return errno
}

// mmap runs c on p in both trees: "write" writes through a shared mapping, unmaps and reads
// the range back with pread; "read" writes with pwrite and reads the whole file through a new
// shared mapping.
func (d *differential) mmap(p string, c mmapCall) (string, syscall.Errno) {
	d.t.Helper()
	return d.both(fmt.Sprintf("mmap-%s %s len=%d msync=%v", c.Op, p, len(c.Data), c.Sync), func(side int) (string, error) {
		c.Path = d.path(side, p)
		if side == 0 {
			return d.mmapper.call(d, c)
		}
		return c.run()
	})
}

// mmapCall is one mmap operation.
type mmapCall struct {
	Op   string // "write" or "read"
	Path string
	U    uint64 // picks the offset once the file size is known
	Data []byte
	Sync bool // msync before munmap
}

// mmapResult is the helper's answer.
type mmapResult struct {
	Val   []byte // []byte: JSON would mangle binary strings
	Errno int
	Err   string // an error without errno
}

// mmapHelper is a child process, this test binary again, that makes the mmap calls on the
// mount. A page fault on a FUSE file blocks its thread outside any system call, where the Go
// runtime cannot stop it for garbage collection; if the faulting process is also the FUSE
// server, the two can wait for each other forever. One child serves a whole test: starting a
// race-enabled binary costs more than all its calls.
type mmapHelper struct {
	cmd    *exec.Cmd
	req    *json.Encoder
	resp   *os.File
	dec    *json.Decoder
	stderr bytes.Buffer // read only after the child exited
	broken bool
}

const mmapChildEnv = "MTCFS_MMAP_HELPER"

func startMmapHelper(t *testing.T) *mmapHelper {
	reqR, reqW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	respR, respW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	h := &mmapHelper{req: json.NewEncoder(reqW), resp: respR, dec: json.NewDecoder(respR)}
	h.cmd = exec.Command(os.Args[0], "-test.run=^TestDifferentialMmapChild$", "-test.count=1")
	// The race detector sleeps a second at exit unless told not to.
	h.cmd.Env = append(os.Environ(), mmapChildEnv+"=1", "GORACE=atexit_sleep_ms=0 "+os.Getenv("GORACE"))
	h.cmd.ExtraFiles = []*os.File{reqR, respW} // fds 3 and 4 in the child
	h.cmd.Stdout, h.cmd.Stderr = &h.stderr, &h.stderr
	if err := h.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	reqR.Close()
	respW.Close()
	t.Cleanup(func() {
		reqW.Close() // the child's loop ends at EOF
		exited := make(chan error, 1)
		go func() { exited <- h.cmd.Wait() }()
		select {
		case err := <-exited:
			if err != nil && !h.broken {
				t.Errorf("mmap helper: %v\n%s", err, h.stderr.String())
			}
		case <-time.After(30 * time.Second):
			h.cmd.Process.Kill()
			t.Errorf("mmap helper did not exit")
			<-exited
		}
		respR.Close()
	})
	return h
}

func (h *mmapHelper) call(d *differential, c mmapCall) (string, error) {
	d.t.Helper()
	if h.broken {
		d.fatalf("the mmap helper failed earlier")
	}
	h.broken = true // until the answer is in
	if err := h.req.Encode(c); err != nil {
		d.fatalf("mmap helper: send: %v", err)
	}
	h.resp.SetReadDeadline(time.Now().Add(30 * time.Second))
	var res mmapResult
	if err := h.dec.Decode(&res); err != nil {
		h.cmd.Process.Kill()
		d.fatalf("mmap helper: no answer for %s of %s: %v", c.Op, c.Path, err)
	}
	if res.Err != "" {
		d.fatalf("mmap helper: %s", res.Err)
	}
	h.broken = false
	if res.Errno != 0 {
		return string(res.Val), syscall.Errno(res.Errno)
	}
	return string(res.Val), nil
}

// TestDifferentialMmapChild is the mmap helper's loop; run directly it does nothing.
func TestDifferentialMmapChild(t *testing.T) {
	if os.Getenv(mmapChildEnv) == "" {
		t.Skip("only runs as the mmap helper of the differential tests")
	}
	dec := json.NewDecoder(os.NewFile(3, "requests"))
	enc := json.NewEncoder(os.NewFile(4, "responses"))
	for {
		var c mmapCall
		if err := dec.Decode(&c); errors.Is(err, io.EOF) {
			return
		} else if err != nil {
			t.Fatal(err)
		}
		val, err := c.run()
		res := mmapResult{Val: []byte(val)}
		var errno syscall.Errno
		switch {
		case errors.As(err, &errno):
			res.Errno = int(errno)
		case err != nil:
			res.Err = err.Error()
		}
		if err := enc.Encode(res); err != nil {
			t.Fatal(err)
		}
	}
}

func (c mmapCall) run() (string, error) {
	return mmapFile(c.Path, func(fd int, m []byte) (string, error) {
		off := int(c.U % uint64(len(m)))
		if c.Op == "read" {
			if err := unix.Munmap(m); err != nil {
				return "", err
			}
			n := min(len(c.Data), len(m)-off)
			if _, err := unix.Pwrite(fd, c.Data[:n], int64(off)); err != nil {
				return "", err
			}
			m, err := unix.Mmap(fd, 0, len(m), unix.PROT_READ, unix.MAP_SHARED)
			if err != nil {
				return "", err
			}
			defer unix.Munmap(m)
			return string(m), nil
		}
		n := copy(m[off:], c.Data)
		if c.Sync {
			if err := unix.Msync(m, unix.MS_SYNC); err != nil {
				unix.Munmap(m)
				return "", err
			}
		}
		if err := unix.Munmap(m); err != nil {
			return "", err
		}
		buf := make([]byte, n)
		got, err := unix.Pread(fd, buf, int64(off))
		if err != nil {
			return "", err
		}
		if !bytes.Equal(buf[:got], c.Data[:n]) {
			return fmt.Sprintf("pread after mmap write at %d returned other bytes", off), nil
		}
		return fmt.Sprintf("off=%d n=%d", off, n), nil
	})
}

// mmapFile opens path read-write, maps all of it shared and calls f, which must unmap m.
// Empty files are not mapped; the result says so.
func mmapFile(path string, f func(fd int, m []byte) (string, error)) (string, error) {
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", err
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return "", err
	}
	if st.Size == 0 {
		return "empty", nil
	}
	m, err := unix.Mmap(fd, 0, int(st.Size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return "", err
	}
	return f(fd, m)
}

// formatStat keeps what must match tmpfs: type, permission bits, link count and, except for
// directories (whose size is file system specific), the size. Device, inode numbers, blocks
// and times legitimately differ.
func formatStat(st *unix.Stat_t) string {
	s := fmt.Sprintf("%s mode=%#o nlink=%d", fileType(st.Mode), st.Mode&0o7777, st.Nlink)
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		s += fmt.Sprintf(" size=%d", st.Size)
	}
	return s
}

func fileType(mode uint32) string {
	switch mode & unix.S_IFMT {
	case unix.S_IFREG:
		return "file"
	case unix.S_IFDIR:
		return "dir"
	case unix.S_IFLNK:
		return "symlink"
	}
	return fmt.Sprintf("type%#o", mode&unix.S_IFMT)
}

// ---------------------------------------------------------------------------------------------
// Random calls

// diffNames is small so that calls collide: the same name is created, renamed over, linked and
// removed again and again, as a file, a directory and a symlink.
var diffNames = []string{"a", "b", "c", "d"}

func (d *differential) pickName() string { return diffNames[d.rng.IntN(len(diffNames))] }

func (d *differential) pickPath() string {
	depth := 1
	switch r := d.rng.IntN(100); {
	case r >= 85:
		depth = 3
	case r >= 50:
		depth = 2
	}
	parts := make([]string, depth)
	for i := range parts {
		parts[i] = d.pickName()
	}
	return strings.Join(parts, "/")
}

// pickTarget returns a symlink target. Targets are relative and never contain "..", so that
// resolving them stays inside each tree whichever directory the link ends up in.
func (d *differential) pickTarget() string {
	switch d.rng.IntN(10) {
	case 0:
		return "missing"
	case 1:
		return "."
	}
	return d.pickPath()
}

func (d *differential) pickMode(dir bool) uint32 {
	if dir {
		return []uint32{0o755, 0o755, 0o700, 0o777, 0o555, 0o1777, 0o2775}[d.rng.IntN(7)]
	}
	return []uint32{0o644, 0o644, 0o600, 0o755, 0o444, 0o000, 0o4755, 0o2755}[d.rng.IntN(8)]
}

func (d *differential) pickSize() int64 {
	if d.rng.IntN(20) == 0 {
		return d.rng.Int64N(1 << 20) // a large hole now and then
	}
	return d.rng.Int64N(diffMaxFileSize)
}

func (d *differential) pickData() []byte {
	n := d.rng.IntN(12 << 10)
	if d.rng.IntN(8) == 0 {
		n = d.rng.IntN(16)
	}
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(d.rng.Uint32())
	}
	return b
}

func (d *differential) pickTime() unix.Timespec {
	return unix.NsecToTimespec(1_500_000_000_000_000_000 + d.rng.Int64N(200_000_000_000_000_000))
}

// pickFile returns an open file of the pool, or nil when nothing is open.
func (d *differential) pickFile() *diffFile {
	if len(d.files) == 0 {
		return nil
	}
	return d.files[d.rng.IntN(len(d.files))]
}

var diffOpenFlags = []struct {
	flags int
	name  string
}{
	{unix.O_RDONLY, "O_RDONLY"},
	{unix.O_WRONLY, "O_WRONLY"},
	{unix.O_RDWR, "O_RDWR"},
	{unix.O_RDWR | unix.O_TRUNC, "O_RDWR|O_TRUNC"},
	{unix.O_WRONLY | unix.O_TRUNC, "O_WRONLY|O_TRUNC"},
	{unix.O_RDONLY | unix.O_TRUNC, "O_RDONLY|O_TRUNC"},
	{unix.O_WRONLY | unix.O_APPEND, "O_WRONLY|O_APPEND"},
	{unix.O_RDWR | unix.O_APPEND, "O_RDWR|O_APPEND"},
	{unix.O_RDWR | unix.O_CREAT, "O_RDWR|O_CREAT"},
	{unix.O_WRONLY | unix.O_CREAT | unix.O_TRUNC, "O_WRONLY|O_CREAT|O_TRUNC"},
	{unix.O_RDWR | unix.O_CREAT | unix.O_APPEND, "O_RDWR|O_CREAT|O_APPEND"},
	{unix.O_RDONLY | unix.O_DIRECTORY, "O_RDONLY|O_DIRECTORY"},
	{unix.O_RDWR | unix.O_NOFOLLOW, "O_RDWR|O_NOFOLLOW"},
}

func (d *differential) makeRoom() {
	if len(d.files) == diffMaxOpen {
		d.close(d.pickFile())
	}
}

func (d *differential) randCreate() {
	d.makeRoom()
	d.create(d.pickPath(), d.pickMode(false))
}

func (d *differential) randOpen() {
	d.makeRoom()
	fl := diffOpenFlags[d.rng.IntN(len(diffOpenFlags))]
	d.open(d.pickPath(), fl.flags, fl.name, d.pickMode(false))
}

func (d *differential) randClose() {
	if f := d.pickFile(); f != nil {
		d.close(f)
	}
}

func (d *differential) randPwrite() {
	if f := d.pickFile(); f != nil {
		d.pwrite(f, d.pickSize(), d.pickData())
	}
}

func (d *differential) randWrite() {
	if f := d.pickFile(); f != nil {
		d.write(f, d.pickData())
	}
}

func (d *differential) randPread() {
	if f := d.pickFile(); f != nil {
		d.pread(f, d.pickSize(), d.rng.IntN(32<<10))
	}
}

func (d *differential) randRead() {
	if f := d.pickFile(); f != nil {
		d.read(f, d.rng.IntN(16<<10))
	}
}

// randLseek moves the file position, also to data and holes. Directory offsets are cookies
// whose meaning (and lseek's errors) the file system chooses, so directories are left out.
func (d *differential) randLseek() {
	f := d.pickFile()
	if f == nil || f.dir {
		return
	}
	whence := []int{unix.SEEK_SET, unix.SEEK_CUR, unix.SEEK_END, unix.SEEK_DATA, unix.SEEK_HOLE}[d.rng.IntN(5)]
	off := d.pickSize()
	if whence == unix.SEEK_CUR || whence == unix.SEEK_END {
		off -= diffMaxFileSize / 2
	}
	d.lseek(f, off, whence)
}

func (d *differential) randFtruncate() {
	if f := d.pickFile(); f != nil {
		d.ftruncate(f, d.pickSize())
	}
}

func (d *differential) randTruncate() { d.truncate(d.pickPath(), d.pickSize()) }

func (d *differential) randFsync() {
	if f := d.pickFile(); f != nil {
		d.fsync(f, d.rng.IntN(2) == 0)
	}
}

func (d *differential) randFstat() {
	if f := d.pickFile(); f != nil {
		d.fstat(f)
	}
}

func (d *differential) randMkdir()  { d.mkdir(d.pickPath(), d.pickMode(true)) }
func (d *differential) randRmdir()  { d.rmdir(d.pickPath()) }
func (d *differential) randUnlink() { d.unlink(d.pickPath()) }

// randRename renames files, symlinks and (non-empty) directories, over existing targets and
// into their own subdirectories, with renameat2 flags.
func (d *differential) randRename() {
	from, to := d.pickPath(), d.pickPath()
	if d.rng.IntN(8) == 0 {
		to = from + "/" + d.pickName() // into itself: EINVAL for a directory
	}
	flags := uint(0)
	switch d.rng.IntN(8) {
	case 0:
		flags = unix.RENAME_NOREPLACE
	case 1:
		flags = unix.RENAME_EXCHANGE
	}
	d.rename(from, to, flags)
}

func (d *differential) randSymlink()  { d.symlink(d.pickTarget(), d.pickPath()) }
func (d *differential) randReadlink() { d.readlink(d.pickPath()) }

func (d *differential) randLink() {
	flags := 0
	if d.rng.IntN(3) == 0 {
		flags = unix.AT_SYMLINK_FOLLOW
	}
	d.link(d.pickPath(), d.pickPath(), flags)
}

func (d *differential) randLstat() { d.lstat(d.pickPath()) }
func (d *differential) randStat()  { d.stat(d.pickPath()) }
func (d *differential) randChmod() { d.chmod(d.pickPath(), d.pickMode(d.rng.IntN(2) == 0)) }

func (d *differential) randUtimens() {
	p, mtime := d.pickPath(), d.pickTime()
	atime := unix.Timespec{Nsec: unix.UTIME_OMIT}
	if d.rng.IntN(2) == 0 {
		atime = d.pickTime()
	}
	flags := 0
	if d.rng.IntN(3) == 0 {
		flags = unix.AT_SYMLINK_NOFOLLOW
	}
	d.utimens(p, atime, mtime, flags)
}

func (d *differential) randReaddir() {
	p := d.pickPath()
	if d.rng.IntN(4) == 0 {
		p = "."
	}
	d.readdir(p)
}

func (d *differential) randStatfs() {
	p := d.pickPath()
	if d.rng.IntN(2) == 0 {
		p = "."
	}
	d.statfs(p)
}

func (d *differential) randMmapWrite() { d.randMmap("write") }
func (d *differential) randMmapRead()  { d.randMmap("read") }

func (d *differential) randMmap(op string) {
	p := d.pickPath()
	d.mmap(p, mmapCall{Op: op, U: d.rng.Uint64(), Data: d.pickData(), Sync: d.rng.IntN(2) == 0})
}

// ---------------------------------------------------------------------------------------------
// Whole-tree comparison

// diffEntry is what a tree walk records for one path.
type diffEntry struct {
	stat    string // formatStat
	target  string // symlinks
	content []byte // regular files
}

func (e diffEntry) String() string {
	switch {
	case e.target != "":
		return e.stat + " -> " + e.target
	case e.content != nil:
		return fmt.Sprintf("%s content=%s", e.stat, short(string(e.content)))
	}
	return e.stat
}

// snapshot walks the tree under root without following symlinks.
func snapshot(root string) (map[string]diffEntry, error) {
	tree := map[string]diffEntry{}
	var walk func(rel string) error
	walk = func(rel string) error {
		names, err := readdirTyped(filepath.Join(root, rel))
		if err != nil {
			return fmt.Errorf("readdir %q: %w", rel, err)
		}
		for _, n := range names {
			p := filepath.Join(rel, n[:strings.LastIndexByte(n, ':')])
			abs := filepath.Join(root, p)
			var st unix.Stat_t
			if err := unix.Lstat(abs, &st); err != nil {
				return fmt.Errorf("lstat %q: %w", p, err)
			}
			e := diffEntry{stat: formatStat(&st)}
			switch st.Mode & unix.S_IFMT {
			case unix.S_IFLNK:
				if e.target, err = os.Readlink(abs); err != nil {
					return err
				}
			case unix.S_IFREG:
				if e.content, err = os.ReadFile(abs); err != nil {
					return err
				}
			case unix.S_IFDIR:
				if err := walk(p); err != nil {
					return err
				}
			}
			tree[p] = e
		}
		return nil
	}
	return tree, walk(".")
}

func (d *differential) compareTrees() {
	d.t.Helper()
	var trees [2]map[string]diffEntry
	for side := range 2 {
		var err error
		if trees[side], err = snapshot(d.roots[side]); err != nil {
			d.fatalf("walk %s tree: %v", diffSideNames[side], err)
		}
	}
	paths := map[string]bool{}
	for _, tree := range trees {
		for p := range tree {
			paths[p] = true
		}
	}
	sorted := make([]string, 0, len(paths))
	for p := range paths {
		sorted = append(sorted, p)
	}
	sort.Strings(sorted)
	var diffs []string
	for _, p := range sorted {
		m, inM := trees[0][p]
		r, inR := trees[1][p]
		switch {
		case !inM:
			diffs = append(diffs, fmt.Sprintf("%s: missing on mtcfs (tmpfs: %v)", p, r))
		case !inR:
			diffs = append(diffs, fmt.Sprintf("%s: only on mtcfs (%v)", p, m))
		case m.stat != r.stat || m.target != r.target:
			diffs = append(diffs, fmt.Sprintf("%s: mtcfs %v, tmpfs %v", p, m, r))
		case !bytes.Equal(m.content, r.content):
			diffs = append(diffs, fmt.Sprintf("%s: content: %s", p, describeDiff("mtcfs", string(m.content), "tmpfs", string(r.content))))
		}
	}
	if len(diffs) > 0 {
		d.fatalf("trees differ (%d paths compared):\n  %s", len(sorted), strings.Join(diffs, "\n  "))
	}
}

// ---------------------------------------------------------------------------------------------
// Fixed sequences

// TestDifferentialCases replays, on both trees, short fixed sequences for the cases that matter
// most to checkpoint writers or that a random run reaches only now and then. Each case also
// states the errno tmpfs gives, so a case that stops testing what it says fails.
func TestDifferentialCases(t *testing.T) {
	data := func(n int, seed byte) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = seed + byte(i*7)
		}
		return b
	}
	cases := []struct {
		name string
		run  func(d *differential, want func(syscall.Errno, syscall.Errno))
	}{
		{"RenameOverExisting", func(d *differential, want func(syscall.Errno, syscall.Errno)) {
			want(d.mkdir("d", 0o755), 0)
			want(d.mkdir("d/sub", 0o755), 0)
			want(d.mkdir("empty", 0o755), 0)
			want(d.mkdir("full", 0o755), 0)
			f := d.mustCreate("full/x", 0o644)
			d.pwrite(f, 0, data(5000, 1))
			g := d.mustCreate("file", 0o600)
			d.pwrite(g, 100, data(300, 2))
			h := d.mustCreate("file2", 0o644)
			want(d.rename("file", "file2", 0), 0)                  // file over file
			want(d.rename("d", "empty", 0), 0)                     // dir over empty dir
			want(d.rename("empty", "full", 0), unix.ENOTEMPTY)     // dir over non-empty dir
			want(d.rename("file2", "full", 0), unix.EISDIR)        // file over dir
			want(d.rename("full", "file2", 0), unix.ENOTDIR)       // dir over file
			want(d.rename("empty", "empty/sub/x", 0), unix.EINVAL) // into its own subdir
			want(d.rename("full", "empty/sub/full", 0), 0)         // non-empty dir, across parents
			d.fstat(h)                                             // renamed over: nlink 0, still open
			d.pread(h, 0, 100)
			d.pwrite(h, 10, data(10, 3))
			d.fstat(g)
		}},
		{"Renameat2", func(d *differential, want func(syscall.Errno, syscall.Errno)) {
			want(d.mkdir("a", 0o755), 0)
			want(d.mkdir("a/in", 0o700), 0)
			f := d.mustCreate("b", 0o644)
			d.pwrite(f, 0, data(77, 4))
			want(d.symlink("a/in", "l"), 0)
			want(d.rename("a", "b", unix.RENAME_NOREPLACE), unix.EEXIST)
			want(d.rename("a", "c", unix.RENAME_NOREPLACE), 0)
			want(d.rename("c", "b", unix.RENAME_EXCHANGE), 0) // dir <-> file
			want(d.rename("b", "missing", unix.RENAME_EXCHANGE), unix.ENOENT)
			want(d.rename("l", "c", unix.RENAME_EXCHANGE), 0) // symlink <-> file
			d.stat("l")
			d.stat("c/in")
			d.readlink("c")
		}},
		{"UnlinkWhileOpen", func(d *differential, want func(syscall.Errno, syscall.Errno)) {
			f := d.mustCreate("f", 0o644)
			d.pwrite(f, 0, data(9000, 5))
			want(d.unlink("f"), 0)
			d.fstat(f)
			d.pwrite(f, 20000, data(100, 6)) // grows with a hole
			d.pread(f, 0, 30000)
			d.ftruncate(f, 5)
			d.fsync(f, false)
			d.fstat(f)
			want(d.close(f), 0)
			_, errno := d.create("f", 0o644) // the name is free again
			want(errno, 0)
		}},
		{"HardLinks", func(d *differential, want func(syscall.Errno, syscall.Errno)) {
			want(d.mkdir("dir", 0o755), 0)
			f := d.mustCreate("f", 0o640)
			d.pwrite(f, 0, data(123, 7))
			want(d.link("f", "dir/g", 0), 0)
			want(d.link("f", "h", 0), 0)
			d.lstat("dir/g")
			want(d.link("dir", "dir2", 0), unix.EPERM)
			want(d.link("f", "h", 0), unix.EEXIST)
			want(d.rename("f", "h", 0), 0) // onto another name of itself: nothing happens
			d.lstat("f")
			want(d.unlink("h"), 0)
			d.fstat(f)
			d.chmod("dir/g", 0o600)
			d.fstat(f)
		}},
		{"HardLinkToSymlink", func(d *differential, want func(syscall.Errno, syscall.Errno)) {
			f := d.mustCreate("f", 0o644)
			d.pwrite(f, 0, data(10, 8))
			want(d.symlink("f", "l"), 0)
			want(d.symlink("missing", "dangling"), 0)
			want(d.link("l", "l2", unix.AT_SYMLINK_FOLLOW), 0) // links f
			d.lstat("l2")
			want(d.link("l", "l3", 0), 0) // links the symlink itself
			d.lstat("l3")
			want(d.link("dangling", "d2", 0), 0)
			d.readlink("d2")
		}},
		{"Symlinks", func(d *differential, want func(syscall.Errno, syscall.Errno)) {
			want(d.mkdir("dir", 0o755), 0)
			f := d.mustCreate("dir/f", 0o644)
			d.pwrite(f, 0, data(40, 9))
			want(d.symlink("dir/f", "l"), 0)
			want(d.symlink("nowhere", "dangling"), 0)
			want(d.symlink("loop2", "loop1"), 0)
			want(d.symlink("loop1", "loop2"), 0)
			d.stat("l")
			d.lstat("l")
			_, errno := d.stat("dangling")
			want(errno, unix.ENOENT)
			_, errno = d.stat("loop1")
			want(errno, unix.ELOOP)
			_, errno = d.open("l", unix.O_RDONLY|unix.O_NOFOLLOW, "O_RDONLY|O_NOFOLLOW", 0)
			want(errno, unix.ELOOP)
			want(d.rename("l", "dir/l", 0), 0) // now points to dir/dir/f: dangling
			_, errno = d.stat("dir/l")
			want(errno, unix.ENOENT)
			_, errno = d.open("dangling", unix.O_RDWR|unix.O_CREAT, "O_RDWR|O_CREAT", 0o600) // creates nowhere
			want(errno, 0)
			d.lstat("nowhere")
			d.utimens("dangling", unix.Timespec{Nsec: unix.UTIME_OMIT}, unix.NsecToTimespec(1_234_567_890_123_456_789), unix.AT_SYMLINK_NOFOLLOW)
			d.utimens("dangling", unix.Timespec{Nsec: unix.UTIME_OMIT}, unix.NsecToTimespec(1_334_567_890_987_654_321), 0)
			want(d.mkdir("dangling", 0o755), unix.EEXIST)
		}},
		{"RmdirNotEmpty", func(d *differential, want func(syscall.Errno, syscall.Errno)) {
			want(d.mkdir("a", 0o755), 0)
			want(d.mkdir("a/b", 0o755), 0)
			want(d.rmdir("a"), unix.ENOTEMPTY)
			want(d.rmdir("a/b/c"), unix.ENOENT)
			want(d.unlink("a"), unix.EISDIR)
			f := d.mustCreate("a/b/f", 0o644)
			want(d.rmdir("a/b/f"), unix.ENOTDIR)
			want(d.rmdir("a/b"), unix.ENOTEMPTY)
			want(d.close(f), 0)
			want(d.unlink("a/b/f"), 0)
			want(d.rmdir("a/b"), 0)
			d.lstat("a")
		}},
		{"RemovedDirOpen", func(d *differential, want func(syscall.Errno, syscall.Errno)) {
			want(d.mkdir("a", 0o755), 0)
			want(d.mkdir("b", 0o755), 0)
			fa := d.mustOpen("a", unix.O_RDONLY|unix.O_DIRECTORY, "O_RDONLY|O_DIRECTORY")
			fb := d.mustOpen("b", unix.O_RDONLY|unix.O_DIRECTORY, "O_RDONLY|O_DIRECTORY")
			want(d.rmdir("a"), 0)
			d.fstat(fa) // nlink 0 once removed
			want(d.mkdir("c", 0o755), 0)
			want(d.rename("c", "b", 0), 0) // b is replaced
			d.fstat(fb)
		}},
		{"FsyncDirectory", func(d *differential, want func(syscall.Errno, syscall.Errno)) {
			// What careful writers do after a rename: fsync the directory.
			want(d.mkdir("dir", 0o755), 0)
			f := d.mustCreate("dir/tmp", 0o644)
			d.pwrite(f, 0, data(64, 10))
			want(d.fsync(f, false), 0)
			want(d.rename("dir/tmp", "dir/final", 0), 0)
			dir := d.mustOpen("dir", unix.O_RDONLY|unix.O_DIRECTORY, "O_RDONLY|O_DIRECTORY")
			want(d.fsync(dir, false), 0)
			want(d.fsync(dir, true), 0)
		}},
		{"ZeroPermissions", func(d *differential, want func(syscall.Errno, syscall.Errno)) {
			f := d.mustCreate("f", 0)
			d.fstat(f)
			want(d.mkdir("dir", 0), 0)
			d.lstat("dir")
			g := d.mustCreate("g", 0o644)
			want(d.chmod("g", 0), 0)
			d.fstat(g)
		}},
		{"SetgidDirectory", func(d *differential, want func(syscall.Errno, syscall.Errno)) {
			// A set-group-ID directory hands its group, and to subdirectories the bit, down.
			want(d.mkdir("shared", 0o755), 0)
			want(d.chmod("shared", 0o2775), 0)
			want(d.mkdir("shared/sub", 0o755), 0)
			d.lstat("shared/sub")
			f := d.mustCreate("shared/f", 0o644)
			d.fstat(f)
		}},
		{"Truncate", func(d *differential, want func(syscall.Errno, syscall.Errno)) {
			f := d.mustCreate("f", 0o644)
			d.pwrite(f, 0, data(10000, 11))
			want(d.truncate("f", 3), 0)
			d.pread(f, 0, 10000)
			want(d.ftruncate(f, 70000), 0) // grows with zeros
			d.pread(f, 0, 80000)
			g := d.mustOpen("f", unix.O_RDWR|unix.O_TRUNC, "O_RDWR|O_TRUNC")
			d.fstat(g)
			d.pread(f, 0, 10)
			want(d.truncate("f", -1), unix.EINVAL)
			want(d.mkdir("dir", 0o755), 0)
			want(d.truncate("dir", 0), unix.EISDIR)
		}},
		{"AppendAndHoles", func(d *differential, want func(syscall.Errno, syscall.Errno)) {
			f := d.mustCreate("f", 0o644)
			a := d.mustOpen("f", unix.O_WRONLY|unix.O_APPEND, "O_WRONLY|O_APPEND")
			d.write(a, data(100, 12))
			d.pwrite(f, 1<<20, data(10, 13)) // a 1 MiB hole
			d.write(a, data(50, 14))         // appends after the hole
			d.pwrite(a, 0, data(5, 15))      // Linux: O_APPEND pwrite appends too
			d.pread(f, 0, 2<<20)
			d.lseek(f, 0, unix.SEEK_DATA)
			d.lseek(f, 0, unix.SEEK_HOLE)
			d.lseek(f, 200, unix.SEEK_DATA)
			d.lseek(f, 3<<20, unix.SEEK_DATA)
		}},
		{"Mmap", func(d *differential, want func(syscall.Errno, syscall.Errno)) {
			f := d.mustCreate("f", 0o644)
			d.pwrite(f, 0, data(3*4096+5, 16))
			d.mmap("f", mmapCall{Op: "write", U: 4090, Data: data(100, 17), Sync: false})
			d.pread(f, 4000, 300)
			d.mmap("f", mmapCall{Op: "write", U: 1, Data: data(9000, 18), Sync: true})
			d.mmap("f", mmapCall{Op: "read", U: 8000, Data: data(1000, 19)})
			d.pread(f, 0, 20000)
		}},
		{"ReaddirAndStatfs", func(d *differential, want func(syscall.Errno, syscall.Errno)) {
			want(d.mkdir("dir", 0o755), 0)
			d.mustCreate("dir/f", 0o644)
			d.symlink("f", "dir/l")
			d.mkdir("dir/sub", 0o755)
			d.readdir("dir")
			_, errno := d.readdir("dir/f")
			want(errno, unix.ENOTDIR)
			want(d.statfs("."), 0)
			want(d.statfs("dir/sub"), 0)
		}},
	}
	mmap := startMmapHelper(t)
	for _, mode := range modes {
		t.Run(string(mode), func(t *testing.T) {
			for _, tc := range cases {
				t.Run(tc.name, func(t *testing.T) {
					d := newDifferential(t, mode, 0, mmap)
					tc.run(d, func(got, want syscall.Errno) {
						t.Helper()
						if got != want {
							d.fatalf("tmpfs and mtcfs both said %s, the case expects %s", errnoName(got), errnoName(want))
						}
					})
					d.closeAll()
					d.compareTrees()
				})
			}
		})
	}
}
