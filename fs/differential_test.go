package fs

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The differential test replays one seeded random sequence of file system calls on an mtcfs
// mount and on a tmpfs directory and requires the same outcome from both, call by call: return
// values, bytes read and errno. Every few calls it also compares the whole trees. tmpfs is the
// reference because the spool lives on it and because mtcfs promises tmpfs semantics.
//
// A failure names the seed; rerun it alone with
//
//	MTCFS_SEED=<seed> go test -run TestDifferential ./fs/   (or -args -seed=<seed>)
var diffSeedFlag = flag.Uint64("seed", 0, "run TestDifferential with only this seed (also MTCFS_SEED)")

// diffFixedSeeds always run, so a failure found once stays reproducible in CI; one more seed
// from the clock explores new sequences on every run.
var diffFixedSeeds = []uint64{1, 2, 3}

const (
	diffOps          = 2000 // per seed and data path
	diffOpsShort     = 300
	diffCompareEvery = 50  // calls between whole-tree comparisons
	diffMaxOpen      = 8   // open-file pool size
	diffRecent       = 4000  // calls shown when a comparison fails
	diffMaxFileSize  = 96 << 10
)

func TestDifferential(t *testing.T) {
	seeds := diffSeeds(t)
	ops := diffOps
	if testing.Short() {
		ops = diffOpsShort
	}
	for _, mode := range modes {
		t.Run(string(mode), func(t *testing.T) {
			for _, seed := range seeds {
				t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) {
					runDifferential(t, mode, seed, ops)
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

// referenceDir returns an empty directory on tmpfs (/dev/shm), or on the test's temp dir if
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

func runDifferential(t *testing.T, mode PassthroughMode, seed uint64, ops int) {
	t.Logf("seed %d", seed)
	mnt, _ := testMount(t, mode, 256<<20)
	d := &differential{
		t:     t,
		seed:  seed,
		rng:   rand.New(rand.NewPCG(seed, seed^0x6d74636673)),
		roots: [2]string{mnt, referenceDir(t)},
	}
	// Registered after testMount, so it runs before the unmount: an fd left open on the mount
	// would make the unmount wait forever.
	t.Cleanup(d.closeAll)

	type op struct {
		weight int
		run    func()
	}
	table := []op{
		{8, d.opCreate}, {8, d.opOpen}, {4, d.opClose},
		{10, d.opPwrite}, {5, d.opWrite}, {8, d.opPread}, {3, d.opRead}, {3, d.opLseek},
		{4, d.opFtruncate}, {3, d.opTruncate}, {3, d.opFsync}, {4, d.opFstat},
		{8, d.opMkdir}, {5, d.opRmdir}, {6, d.opUnlink},
		{10, d.opRename}, {5, d.opSymlink}, {3, d.opReadlink}, {4, d.opLink},
		{4, d.opLstat}, {4, d.opStat}, {3, d.opChmod}, {3, d.opUtimens},
		{4, d.opReaddir}, {1, d.opStatfs}, {2, d.opMmapWrite}, {2, d.opMmapRead},
	}
	total := 0
	for _, o := range table {
		total += o.weight
	}
	for d.step = 1; d.step <= ops; d.step++ {
		w := d.rng.IntN(total)
		for _, o := range table {
			if w < o.weight {
				o.run()
				break
			}
			w -= o.weight
		}
		if d.step%diffCompareEvery == 0 {
			d.compareTrees()
		}
	}
	d.closeAll()
	d.compareTrees()
}

// differential drives the same calls on both trees. Index 0 is mtcfs, 1 the tmpfs reference.
type differential struct {
	t      *testing.T
	seed   uint64
	rng    *rand.Rand
	roots  [2]string
	files  []*diffFile // the pool of open files, used on after unlink and rename
	step   int
	recent []string
}

var diffSideNames = [2]string{"mtcfs", "tmpfs"}

// diffFile is one open(2) done on both trees.
type diffFile struct {
	fd   [2]int
	desc string
	dir  bool // a directory: its offsets mean different things on FUSE and tmpfs
}

func (d *differential) path(side int, rel string) string { return filepath.Join(d.roots[side], rel) }

// both runs f on each tree and fails the test unless value and errno agree. It returns them.
func (d *differential) both(desc string, f func(side int) (string, error)) (string, syscall.Errno) {
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
		d.fatalf("%s: mtcfs and tmpfs disagree: %s", desc, describeDiff(vals[0], vals[1]))
	}
	return vals[1], errs[1]
}

func (d *differential) errno(err error) syscall.Errno {
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
	d.t.Fatalf("seed %d, call %d: %s\nlast calls:\n%s\nrerun: MTCFS_SEED=%d go test -run 'TestDifferential' ./fs/",
		d.seed, d.step, fmt.Sprintf(format, args...), strings.Join(d.recent, "\n"), d.seed)
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

func describeDiff(a, b string) string {
	i := 0
	for i < len(a) && i < len(b) && a[i] == b[i] {
		i++
	}
	return fmt.Sprintf("mtcfs %s, tmpfs %s (lengths %d/%d, first difference at byte %d)", short(a), short(b), len(a), len(b), i)
}

// ---------------------------------------------------------------------------------------------
// Random arguments

// diffNames is small so that calls collide: the same name is created, renamed over, linked and
// removed again and again, as files and as directories.
var diffNames = []string{"a", "b", "c", "d"}

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
		parts[i] = diffNames[d.rng.IntN(len(diffNames))]
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
	return []uint32{0o644, 0o644, 0o600, 0o755, 0o444, 0o644, 0o4755, 0o2755}[d.rng.IntN(8)] /*DEVTMP*/
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

// pickFile returns a slot of the open-file pool, or nil when nothing is open.
func (d *differential) pickFile() *diffFile {
	if len(d.files) == 0 {
		return nil
	}
	return d.files[d.rng.IntN(len(d.files))]
}

func (d *differential) closeFile(i int) {
	f := d.files[i]
	d.files = append(d.files[:i], d.files[i+1:]...)
	d.both("close "+f.desc, func(side int) (string, error) {
		fd := f.fd[side]
		f.fd[side] = -1
		if fd < 0 {
			return "", nil
		}
		return "", unix.Close(fd)
	})
}

func (d *differential) closeAll() {
	for _, f := range d.files {
		for _, fd := range f.fd {
			if fd >= 0 {
				unix.Close(fd)
			}
		}
	}
	d.files = nil
}

// ---------------------------------------------------------------------------------------------
// Calls

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

// open opens p on both trees and keeps the fds in the pool.
func (d *differential) open(p string, flags int, flagName string, mode uint32) {
	if len(d.files) == diffMaxOpen {
		d.closeFile(d.rng.IntN(len(d.files)))
	}
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
		return
	}
	var st unix.Stat_t
	if err := unix.Fstat(f.fd[1], &st); err != nil {
		d.fatalf("fstat after open %s: %v", f.desc, err)
	}
	f.dir = st.Mode&unix.S_IFMT == unix.S_IFDIR
}

func (d *differential) opCreate() {
	d.open(d.pickPath(), unix.O_CREAT|unix.O_EXCL|unix.O_RDWR, "O_CREAT|O_EXCL|O_RDWR", d.pickMode(false))
}

func (d *differential) opOpen() {
	fl := diffOpenFlags[d.rng.IntN(len(diffOpenFlags))]
	d.open(d.pickPath(), fl.flags, fl.name, d.pickMode(false))
}

func (d *differential) opClose() {
	if len(d.files) > 0 {
		d.closeFile(d.rng.IntN(len(d.files)))
	}
}

func (d *differential) opPwrite() {
	f := d.pickFile()
	if f == nil {
		return
	}
	off, data := d.pickSize(), d.pickData()
	d.both(fmt.Sprintf("pwrite %s off=%d len=%d", f.desc, off, len(data)), func(side int) (string, error) {
		n, err := unix.Pwrite(f.fd[side], data, off)
		return strconv.Itoa(n), err
	})
}

// opWrite writes at the file position: at the end for O_APPEND opens.
func (d *differential) opWrite() {
	f := d.pickFile()
	if f == nil {
		return
	}
	data := d.pickData()
	d.both(fmt.Sprintf("write %s len=%d", f.desc, len(data)), func(side int) (string, error) {
		n, err := unix.Write(f.fd[side], data)
		if err != nil {
			return "", err
		}
		pos, err := unix.Seek(f.fd[side], 0, unix.SEEK_CUR)
		return fmt.Sprintf("n=%d pos=%d", n, pos), err
	})
}

func (d *differential) opPread() {
	f := d.pickFile()
	if f == nil {
		return
	}
	off, n := d.pickSize(), d.rng.IntN(32<<10)
	d.both(fmt.Sprintf("pread %s off=%d len=%d", f.desc, off, n), func(side int) (string, error) {
		buf := make([]byte, n)
		got, err := unix.Pread(f.fd[side], buf, off)
		if err != nil {
			return "", err
		}
		return string(buf[:got]), nil
	})
}

func (d *differential) opRead() {
	f := d.pickFile()
	if f == nil {
		return
	}
	n := d.rng.IntN(16 << 10)
	d.both(fmt.Sprintf("read %s len=%d", f.desc, n), func(side int) (string, error) {
		buf := make([]byte, n)
		got, err := unix.Read(f.fd[side], buf)
		if err != nil {
			return "", err
		}
		return string(buf[:got]), nil
	})
}

// opLseek moves the file position, also to data and holes. Directory offsets are cookies
// whose meaning (and lseek's errors) the file system chooses, so directories are left out.
func (d *differential) opLseek() {
	f := d.pickFile()
	if f == nil || f.dir {
		return
	}
	whence := []int{unix.SEEK_SET, unix.SEEK_CUR, unix.SEEK_END, unix.SEEK_DATA, unix.SEEK_HOLE}[d.rng.IntN(5)]
	off := d.pickSize()
	if whence == unix.SEEK_CUR || whence == unix.SEEK_END {
		off -= diffMaxFileSize / 2
	}
	d.both(fmt.Sprintf("lseek %s off=%d whence=%d", f.desc, off, whence), func(side int) (string, error) {
		pos, err := unix.Seek(f.fd[side], off, whence)
		return strconv.FormatInt(pos, 10), err
	})
}

func (d *differential) opFtruncate() {
	f := d.pickFile()
	if f == nil {
		return
	}
	size := d.pickSize()
	d.both(fmt.Sprintf("ftruncate %s %d", f.desc, size), func(side int) (string, error) {
		return "", unix.Ftruncate(f.fd[side], size)
	})
}

func (d *differential) opTruncate() {
	p, size := d.pickPath(), d.pickSize()
	d.both(fmt.Sprintf("truncate %s %d", p, size), func(side int) (string, error) {
		return "", unix.Truncate(d.path(side, p), size)
	})
}

func (d *differential) opFsync() {
	f := d.pickFile()
	if f == nil {
		return
	}
	data := d.rng.IntN(2) == 0
	if f.dir { return } /*DEVTMP*/
	d.both(fmt.Sprintf("fsync %s datasync=%v", f.desc, data), func(side int) (string, error) {
		if data {
			return "", unix.Fdatasync(f.fd[side])
		}
		return "", unix.Fsync(f.fd[side])
	})
}

func (d *differential) opFstat() {
	f := d.pickFile()
	if f == nil {
		return
	}
	d.both("fstat "+f.desc, func(side int) (string, error) {
		var st unix.Stat_t
		if err := unix.Fstat(f.fd[side], &st); err != nil {
			return "", err
		}
		return formatStat(&st), nil
	})
}

func (d *differential) opMkdir() {
	p, mode := d.pickPath(), d.pickMode(true)
	d.both(fmt.Sprintf("mkdir %s %#o", p, mode), func(side int) (string, error) {
		return "", unix.Mkdir(d.path(side, p), mode)
	})
}

func (d *differential) opRmdir() {
	p := d.pickPath()
	d.both("rmdir "+p, func(side int) (string, error) {
		return "", unix.Rmdir(d.path(side, p))
	})
}

func (d *differential) opUnlink() {
	p := d.pickPath()
	d.both("unlink "+p, func(side int) (string, error) {
		return "", unix.Unlink(d.path(side, p))
	})
}

// opRename renames files, symlinks and (non-empty) directories, over existing targets and
// into their own subdirectories, with renameat2 flags.
func (d *differential) opRename() {
	from, to := d.pickPath(), d.pickPath()
	if d.rng.IntN(8) == 0 {
		to = from + "/" + diffNames[d.rng.IntN(len(diffNames))] // into itself: EINVAL for a directory
	}
	flags, name := uint(0), "rename"
	switch d.rng.IntN(8) {
	case 0:
		flags, name = unix.RENAME_NOREPLACE, "rename NOREPLACE"
	case 1:
		flags, name = unix.RENAME_EXCHANGE, "rename EXCHANGE"
	}
	d.both(fmt.Sprintf("%s %s %s", name, from, to), func(side int) (string, error) {
		return "", unix.Renameat2(unix.AT_FDCWD, d.path(side, from), unix.AT_FDCWD, d.path(side, to), flags)
	})
}

func (d *differential) opSymlink() {
	target, p := d.pickTarget(), d.pickPath()
	d.both(fmt.Sprintf("symlink %s -> %s", p, target), func(side int) (string, error) {
		return "", unix.Symlink(target, d.path(side, p))
	})
}

func (d *differential) opReadlink() {
	p := d.pickPath()
	d.both("readlink "+p, func(side int) (string, error) {
		buf := make([]byte, 256)
		n, err := unix.Readlink(d.path(side, p), buf)
		if err != nil {
			return "", err
		}
		return string(buf[:n]), nil
	})
}

// opLink makes hard links: to files, to symlinks (flag 0) or through them (AT_SYMLINK_FOLLOW),
// and refused ones to directories.
func (d *differential) opLink() {
	from, to := d.pickPath(), d.pickPath()
	flags := 0
	if d.rng.IntN(3) == 0 {
		flags = unix.AT_SYMLINK_FOLLOW
	}
	d.both(fmt.Sprintf("link %s %s flags=%#x", from, to, flags), func(side int) (string, error) {
		return "", unix.Linkat(unix.AT_FDCWD, d.path(side, from), unix.AT_FDCWD, d.path(side, to), flags)
	})
}

func (d *differential) opLstat() {
	p := d.pickPath()
	d.both("lstat "+p, func(side int) (string, error) {
		var st unix.Stat_t
		if err := unix.Lstat(d.path(side, p), &st); err != nil {
			return "", err
		}
		return formatStat(&st), nil
	})
}

// opStat follows symlinks, dangling and looping ones included.
func (d *differential) opStat() {
	p := d.pickPath()
	d.both("stat "+p, func(side int) (string, error) {
		var st unix.Stat_t
		if err := unix.Stat(d.path(side, p), &st); err != nil {
			return "", err
		}
		return formatStat(&st), nil
	})
}

func (d *differential) opChmod() {
	p, mode := d.pickPath(), d.pickMode(d.rng.IntN(2) == 0)
	d.both(fmt.Sprintf("chmod %s %#o", p, mode), func(side int) (string, error) {
		return "", unix.Chmod(d.path(side, p), mode)
	})
}

// opUtimens sets mtime (and maybe atime) and reads mtime back: the one time stamp compared,
// because it was set explicitly.
func (d *differential) opUtimens() {
	p := d.pickPath()
	mtime := unix.NsecToTimespec(1_600_000_000_000_000_000 + d.rng.Int64N(100_000_000_000_000_000))
	atime := unix.Timespec{Nsec: unix.UTIME_OMIT}
	if d.rng.IntN(2) == 0 {
		atime = unix.NsecToTimespec(1_500_000_000_000_000_000 + d.rng.Int64N(100_000_000_000_000_000))
	}
	flags := 0
	if d.rng.IntN(3) == 0 {
		flags = unix.AT_SYMLINK_NOFOLLOW
	}
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
}

func (d *differential) opReaddir() {
	p := d.pickPath()
	if d.rng.IntN(4) == 0 {
		p = "."
	}
	d.both("readdir "+p, func(side int) (string, error) {
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

// opStatfs only requires statfs to answer like tmpfs does: the numbers are the spool's.
func (d *differential) opStatfs() {
	p := d.pickPath()
	if d.rng.IntN(2) == 0 {
		p = "."
	}
	d.both("statfs "+p, func(side int) (string, error) {
		var st unix.Statfs_t
		return "", unix.Statfs(d.path(side, p), &st)
	})
}

// opMmapWrite writes through a shared mapping, unmaps, and reads the range back with pread.
func (d *differential) opMmapWrite() {
	p, u, data, sync := d.pickPath(), d.rng.Uint64(), d.pickData(), d.rng.IntN(2) == 0
	d.both(fmt.Sprintf("mmap-write %s len=%d msync=%v", p, len(data), sync), func(side int) (string, error) {
		return mmapFile(d.path(side, p), func(fd int, m []byte) (string, error) {
			off := int(u % uint64(len(m)))
			n := copy(m[off:], data)
			if sync {
				if err := unix.Msync(m, unix.MS_SYNC); err != nil {
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
			if !bytes.Equal(buf[:got], data[:n]) {
				return fmt.Sprintf("pread after mmap write at %d returned other bytes", off), nil
			}
			return fmt.Sprintf("off=%d n=%d", off, n), nil
		})
	})
}

// opMmapRead writes with pwrite and reads the whole file through a new shared mapping.
func (d *differential) opMmapRead() {
	p, u, data := d.pickPath(), d.rng.Uint64(), d.pickData()
	d.both(fmt.Sprintf("mmap-read %s len=%d", p, len(data)), func(side int) (string, error) {
		return mmapFile(d.path(side, p), func(fd int, m []byte) (string, error) {
			if err := unix.Munmap(m); err != nil {
				return "", err
			}
			off := int64(u % uint64(len(m)))
			n := min(len(data), len(m)-int(off))
			if _, err := unix.Pwrite(fd, data[:n], off); err != nil {
				return "", err
			}
			m, err := unix.Mmap(fd, 0, len(m), unix.PROT_READ, unix.MAP_SHARED)
			if err != nil {
				return "", err
			}
			defer unix.Munmap(m)
			return string(m), nil
		})
	})
}

// mmapFile opens path read-write, maps all of it shared and calls f, which must unmap m.
// Empty files and non-files are not mapped; what happened instead is the result.
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
			name := n[:strings.LastIndexByte(n, ':')]
			p := filepath.Join(rel, name)
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
			diffs = append(diffs, fmt.Sprintf("%s: content: %s", p, describeDiff(string(m.content), string(r.content))))
		}
	}
	if len(diffs) > 0 {
		d.fatalf("trees differ (%d paths compared):\n  %s", len(sorted), strings.Join(diffs, "\n  "))
	}
}
