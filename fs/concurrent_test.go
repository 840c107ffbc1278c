package fs

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestConcurrent runs, against one mount and at the same time: writers that pwrite, truncate,
// append to and reopen their own files and read every write back through a second handle
// (also into their own region of one file they all share); renamers that move a directory
// full of files back and forth between parents and write through a handle that stays open
// across the moves; churners that create, rename and unlink files in one shared directory,
// partly under the same names; and observers that readdir, stat and statfs all of it. When
// the workers are done, every file is read back and compared byte for byte with the content
// kept in memory (a few MiB in all).
//
// make test runs it under -race and a second time with GOMAXPROCS=1, where the FUSE server
// and the clients share one P, so that a server path that waits for a client (or holds a lock
// while it blocks) shows up as a hang. mmap is left out: a page fault on the mount in this
// process can deadlock with the Go runtime (see mmapCall), and the differential tests cover it.
func TestConcurrent(t *testing.T) {
	for _, mode := range modes {
		t.Run(string(mode), func(t *testing.T) {
			seed := uint64(time.Now().UnixNano())
			t.Logf("seed %d", seed)
			dir, _ := testMount(t, mode, 256<<20)
			c := &concurrentRun{t: t, dir: dir, seed: seed}
			c.iters = 400
			if testing.Short() {
				c.iters = 100
			}
			c.run()
		})
	}
}

const (
	concWriters       = 8
	concFilesPerW     = 3
	concMaxFile       = 128 << 10 // a writer's file never grows past this
	concRegion        = 64 << 10  // each writer's part of the shared file
	concRenamers      = 2
	concRenamedFiles  = 4
	concChurners      = 2
	concObservers     = 2
	concContendedName = 4 // names x0.. that all churners create and unlink
)

type concurrentRun struct {
	t     *testing.T
	dir   string
	seed  uint64
	iters int

	failed  atomic.Bool // the first failure stops every worker
	workers sync.WaitGroup
	done    atomic.Bool // workers finished: observers stop

	// files is the expected content by path relative to dir. Each worker publishes its files
	// when it stops; verifyAll reads them after all have stopped.
	mu    sync.Mutex
	files map[string][]byte // GUARDED_BY(mu)
}

func (c *concurrentRun) path(rel string) string { return filepath.Join(c.dir, rel) }

// errorf records a failure and stops all workers; it returns false so callers can
// `return c.errorf(...)`.
func (c *concurrentRun) errorf(format string, args ...any) bool {
	c.t.Helper()
	if !c.failed.Swap(true) {
		c.t.Errorf("seed %d: "+format, append([]any{c.seed}, args...)...)
	} else {
		c.t.Logf("also: "+format, args...)
	}
	return false
}

func (c *concurrentRun) publish(rel string, content []byte) {
	c.mu.Lock()
	c.files[rel] = content
	c.mu.Unlock()
}

func (c *concurrentRun) rng(worker int) *rand.Rand {
	return rand.New(rand.NewPCG(c.seed, uint64(worker)))
}

func randomBytes(r *rand.Rand, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

func (c *concurrentRun) run() {
	c.files = map[string][]byte{"common": make([]byte, concWriters*concRegion)}
	c.mustMkdir("shared")
	common, err := os.Create(c.path("common"))
	if err != nil {
		c.t.Fatal(err)
	}
	if err := common.Truncate(concWriters * concRegion); err != nil {
		c.t.Fatal(err)
	}
	common.Close()

	start := time.Now()
	var observers sync.WaitGroup
	for i := range concObservers {
		observers.Go(func() { c.observe(i) })
	}
	for i := range concWriters {
		c.workers.Go(func() { c.writer(i) })
	}
	for i := range concRenamers {
		c.workers.Go(func() { c.renamer(i) })
	}
	for i := range concChurners {
		c.workers.Go(func() { c.churner(i) })
	}
	c.workers.Wait()
	c.done.Store(true)
	observers.Wait()
	c.t.Logf("workers done in %v", time.Since(start).Round(time.Millisecond))
	if c.t.Failed() {
		return
	}
	c.verifyAll()
}

func (c *concurrentRun) mustMkdir(rel string) {
	c.t.Helper()
	if err := os.MkdirAll(c.path(rel), 0o755); err != nil {
		c.t.Fatal(err)
	}
}

// verifyAll reads every file back and compares it with what its worker wrote, and checks
// that the directories hold exactly the expected names.
func (c *concurrentRun) verifyAll() {
	c.t.Helper()
	var total int
	for rel, want := range c.files {
		total += len(want)
		got, err := os.ReadFile(c.path(rel))
		if err != nil {
			c.t.Errorf("read %s: %v", rel, err)
			continue
		}
		if !bytes.Equal(got, want) {
			c.t.Errorf("%s: content differs: %s", rel, describeDiff("got", string(got), "want", string(want)))
		}
	}
	c.t.Logf("verified %d files, %d KiB", len(c.files), total>>10)

	// Every directory holds exactly the files expected there (and the renamers' "sub"); in
	// shared/, the names the churners fight over may or may not be left.
	want := map[string][]string{}
	for rel := range c.files {
		if dir := filepath.Dir(rel); dir != "." {
			want[dir] = append(want[dir], filepath.Base(rel))
		}
	}
	for dir, names := range want {
		if strings.HasPrefix(dir, "mv") {
			names = append(names, "sub")
		}
		slices.Sort(names)
		got, err := readdirNames(c.path(dir))
		if err != nil {
			c.t.Errorf("readdir %s: %v", dir, err)
			continue
		}
		if dir == "shared" {
			got = slices.DeleteFunc(got, func(n string) bool { return strings.HasPrefix(n, "x") })
		}
		if !slices.Equal(got, names) {
			c.t.Errorf("readdir %s: got %v, want %v", dir, got, names)
		}
	}
}

func readdirNames(dir string) ([]string, error) {
	f, err := os.Open(dir)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	names, err := f.Readdirnames(-1)
	slices.Sort(names)
	return names, err
}

// ---------------------------------------------------------------------------------------------
// Writers

// writerFile is one file of a writer: a read-write handle, a read-only handle to read writes
// back through, and the content it must have.
type writerFile struct {
	rel    string
	rw, ro *os.File
	want   []byte
}

func (c *concurrentRun) writer(id int) {
	r := c.rng(id)
	dir := fmt.Sprintf("w%d", id)
	if err := os.Mkdir(c.path(dir), 0o755); err != nil {
		c.errorf("writer %d: %v", id, err)
		return
	}
	files := make([]*writerFile, concFilesPerW)
	defer func() {
		for _, f := range files {
			if f != nil {
				f.rw.Close()
				f.ro.Close()
				c.publish(f.rel, f.want)
			}
		}
	}()
	for i := range files {
		f := &writerFile{rel: fmt.Sprintf("%s/f%d", dir, i)}
		var err error
		if f.rw, err = os.OpenFile(c.path(f.rel), os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o644); err != nil {
			c.errorf("writer %d: %v", id, err)
			return
		}
		if f.ro, err = os.Open(c.path(f.rel)); err != nil {
			f.rw.Close()
			c.errorf("writer %d: %v", id, err)
			return
		}
		files[i] = f
	}
	common, err := os.OpenFile(c.path("common"), os.O_RDWR, 0)
	if err != nil {
		c.errorf("writer %d: %v", id, err)
		return
	}
	defer common.Close()
	region := make([]byte, concRegion) // this writer's part of common: zeros so far
	defer func() { c.publishRegion(id, region) }()

	for it := 0; it < c.iters && !c.failed.Load(); it++ {
		f := files[r.IntN(len(files))]
		var ok bool
		switch op := r.IntN(100); {
		case op < 40:
			ok = c.writerPwrite(id, r, f)
		case op < 50:
			ok = c.writerTruncate(id, r, f)
		case op < 60:
			ok = c.writerAppend(id, r, f)
		case op < 70:
			ok = c.writerReopen(id, r, f)
		case op < 75:
			ok = f.rw.Sync() == nil || c.errorf("writer %d: fsync %s", id, f.rel)
		case op < 85:
			ok = c.writerVerify(id, f)
		default:
			ok = c.writerCommon(id, r, common, region)
		}
		if !ok {
			return
		}
	}
	for _, f := range files {
		if !c.writerVerify(id, f) {
			return
		}
	}
}

// publishRegion fills in a writer's part of the shared file's expected content.
func (c *concurrentRun) publishRegion(id int, region []byte) {
	c.mu.Lock()
	copy(c.files["common"][id*concRegion:], region)
	c.mu.Unlock()
}

func (c *concurrentRun) writerPwrite(id int, r *rand.Rand, f *writerFile) bool {
	data := randomBytes(r, 1+r.IntN(16<<10))
	off := r.IntN(concMaxFile - len(data))
	if _, err := f.rw.WriteAt(data, int64(off)); err != nil {
		return c.errorf("writer %d: pwrite %s at %d: %v", id, f.rel, off, err)
	}
	if end := off + len(data); end > len(f.want) {
		f.want = append(f.want, make([]byte, end-len(f.want))...)
	}
	copy(f.want[off:], data)
	got := make([]byte, len(data))
	if _, err := f.ro.ReadAt(got, int64(off)); err != nil {
		return c.errorf("writer %d: read back %s at %d: %v", id, f.rel, off, err)
	}
	if !bytes.Equal(got, data) {
		return c.errorf("writer %d: %s at %d, read through another handle: %s", id, f.rel, off, describeDiff("got", string(got), "want", string(data)))
	}
	return true
}

func (c *concurrentRun) writerTruncate(id int, r *rand.Rand, f *writerFile) bool {
	size := r.IntN(concMaxFile)
	if err := f.rw.Truncate(int64(size)); err != nil {
		return c.errorf("writer %d: ftruncate %s to %d: %v", id, f.rel, size, err)
	}
	if size <= len(f.want) {
		f.want = f.want[:size]
	} else {
		f.want = append(f.want, make([]byte, size-len(f.want))...)
	}
	return c.writerStat(id, f)
}

func (c *concurrentRun) writerAppend(id int, r *rand.Rand, f *writerFile) bool {
	data := randomBytes(r, 1+r.IntN(8<<10))
	if len(f.want)+len(data) > concMaxFile {
		return true
	}
	a, err := os.OpenFile(c.path(f.rel), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		return c.errorf("writer %d: open %s O_APPEND: %v", id, f.rel, err)
	}
	defer a.Close()
	if _, err := a.Write(data); err != nil {
		return c.errorf("writer %d: append to %s: %v", id, f.rel, err)
	}
	f.want = append(f.want, data...)
	return c.writerStat(id, f)
}

// writerReopen closes the read-write handle and opens the file again by name, sometimes
// with O_TRUNC.
func (c *concurrentRun) writerReopen(id int, r *rand.Rand, f *writerFile) bool {
	if err := f.rw.Close(); err != nil {
		return c.errorf("writer %d: close %s: %v", id, f.rel, err)
	}
	flags := os.O_RDWR
	if r.IntN(4) == 0 {
		flags |= os.O_TRUNC
		f.want = f.want[:0]
	}
	var err error
	if f.rw, err = os.OpenFile(c.path(f.rel), flags, 0); err != nil {
		f.rw, _ = os.Open(os.DevNull) // keep the deferred Close harmless
		return c.errorf("writer %d: reopen %s: %v", id, f.rel, err)
	}
	return c.writerStat(id, f)
}

func (c *concurrentRun) writerStat(id int, f *writerFile) bool {
	for _, h := range []*os.File{f.rw, f.ro} {
		fi, err := h.Stat()
		if err != nil {
			return c.errorf("writer %d: fstat %s: %v", id, f.rel, err)
		}
		if fi.Size() != int64(len(f.want)) {
			return c.errorf("writer %d: fstat %s: size %d, want %d", id, f.rel, fi.Size(), len(f.want))
		}
	}
	fi, err := os.Stat(c.path(f.rel))
	if err != nil {
		return c.errorf("writer %d: stat %s: %v", id, f.rel, err)
	}
	if fi.Size() != int64(len(f.want)) {
		return c.errorf("writer %d: stat %s: size %d, want %d", id, f.rel, fi.Size(), len(f.want))
	}
	return true
}

func (c *concurrentRun) writerVerify(id int, f *writerFile) bool {
	got := make([]byte, concMaxFile+1)
	n, err := f.ro.ReadAt(got, 0)
	if err != nil && !errors.Is(err, io.EOF) {
		return c.errorf("writer %d: read %s: %v", id, f.rel, err)
	}
	if !bytes.Equal(got[:n], f.want) {
		return c.errorf("writer %d: %s: %s", id, f.rel, describeDiff("got", string(got[:n]), "want", string(f.want)))
	}
	return c.writerStat(id, f)
}

// writerCommon writes into this writer's region of the shared file and reads it back.
func (c *concurrentRun) writerCommon(id int, r *rand.Rand, common *os.File, region []byte) bool {
	data := randomBytes(r, 1+r.IntN(concRegion/4))
	off := r.IntN(concRegion - len(data))
	abs := int64(id*concRegion + off)
	if _, err := common.WriteAt(data, abs); err != nil {
		return c.errorf("writer %d: pwrite common at %d: %v", id, abs, err)
	}
	copy(region[off:], data)
	got := make([]byte, concRegion)
	if _, err := common.ReadAt(got, int64(id*concRegion)); err != nil {
		return c.errorf("writer %d: read common region: %v", id, err)
	}
	if !bytes.Equal(got, region) {
		return c.errorf("writer %d: common region: %s", id, describeDiff("got", string(got), "want", string(region)))
	}
	return true
}

// ---------------------------------------------------------------------------------------------
// Renamers

// renamerSpots are where a renamer's directory goes, relative to mv<k>: across parents and
// within one.
var renamerSpots = []string{"left/d", "right/d", "right/e", "left/e"}

func (c *concurrentRun) renamer(id int) {
	r := c.rng(100 + id)
	base := fmt.Sprintf("mv%d", id)
	for _, d := range []string{"left/d/sub", "right"} {
		if err := os.MkdirAll(c.path(filepath.Join(base, d)), 0o755); err != nil {
			c.errorf("renamer %d: %v", id, err)
			return
		}
	}
	want := make([][]byte, concRenamedFiles)
	for i := range want {
		want[i] = randomBytes(r, 1+r.IntN(48<<10))
		if err := os.WriteFile(c.path(fmt.Sprintf("%s/left/d/x%d", base, i)), want[i], 0o644); err != nil {
			c.errorf("renamer %d: %v", id, err)
			return
		}
	}
	// x0 stays open across every move and is written through this handle.
	held, err := os.OpenFile(c.path(base+"/left/d/x0"), os.O_RDWR, 0)
	if err != nil {
		c.errorf("renamer %d: %v", id, err)
		return
	}
	defer held.Close()

	spot := 0 // index into renamerSpots
	defer func() {
		for i, content := range want {
			c.publish(fmt.Sprintf("%s/%s/x%d", base, renamerSpots[spot], i), content)
		}
	}()
	for it := 0; it < c.iters && !c.failed.Load(); it++ {
		from := renamerSpots[spot]
		next := (spot + 1 + r.IntN(len(renamerSpots)-1)) % len(renamerSpots)
		to := renamerSpots[next]
		if r.IntN(5) == 0 {
			// Swap the two parents: the directory moves without its own rename.
			if err := unix.Renameat2(unix.AT_FDCWD, c.path(base+"/left"), unix.AT_FDCWD, c.path(base+"/right"), unix.RENAME_EXCHANGE); err != nil {
				c.errorf("renamer %d: exchange left and right: %v", id, err)
				return
			}
			to = strings.NewReplacer("left", "right", "right", "left").Replace(from)
			next = slices.Index(renamerSpots, to)
		} else if err := os.Rename(c.path(base+"/"+from), c.path(base+"/"+to)); err != nil {
			c.errorf("renamer %d: rename %s -> %s: %v", id, from, to, err)
			return
		}
		spot = next
		if _, err := os.Lstat(c.path(base + "/" + from)); !errors.Is(err, os.ErrNotExist) {
			c.errorf("renamer %d: %s still there after moving it to %s (%v)", id, from, to, err)
			return
		}
		if fi, err := os.Lstat(c.path(base + "/" + to)); err != nil || !fi.IsDir() {
			c.errorf("renamer %d: %s after the move: %v", id, to, err)
			return
		}
		data := randomBytes(r, 1+r.IntN(4<<10))
		off := r.IntN(len(want[0]))
		if _, err := held.WriteAt(data, int64(off)); err != nil {
			c.errorf("renamer %d: write through held handle: %v", id, err)
			return
		}
		if end := off + len(data); end > len(want[0]) {
			want[0] = append(want[0], make([]byte, end-len(want[0]))...)
		}
		copy(want[0][off:], data)
		i := r.IntN(len(want))
		if it%10 == 0 {
			i = -1 // all of them
		}
		for j := range want {
			if i >= 0 && j != i {
				continue
			}
			rel := fmt.Sprintf("%s/%s/x%d", base, to, j)
			got, err := os.ReadFile(c.path(rel))
			if err != nil {
				c.errorf("renamer %d: read %s: %v", id, rel, err)
				return
			}
			if !bytes.Equal(got, want[j]) {
				c.errorf("renamer %d: %s: %s", id, rel, describeDiff("got", string(got), "want", string(want[j])))
				return
			}
		}
	}
}

// ---------------------------------------------------------------------------------------------
// Churners

func (c *concurrentRun) churner(id int) {
	r := c.rng(200 + id)
	live := map[string][]byte{} // own names in shared/ and their content
	defer func() {
		for name, content := range live {
			c.publish("shared/"+name, content)
		}
	}()
	next := 0
	newName := func() string {
		next++
		return fmt.Sprintf("c%d-%d", id, next)
	}
	pickLive := func() string {
		if len(live) == 0 {
			return ""
		}
		names := make([]string, 0, len(live))
		for n := range live {
			names = append(names, n)
		}
		slices.Sort(names)
		return names[r.IntN(len(names))]
	}
	for it := 0; it < c.iters && !c.failed.Load(); it++ {
		switch op := r.IntN(100); {
		case op < 30 || len(live) == 0:
			name, data := newName(), randomBytes(r, r.IntN(8<<10))
			f, err := os.OpenFile(c.path("shared/"+name), os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
			if err != nil {
				c.errorf("churner %d: create %s: %v", id, name, err)
				return
			}
			_, err = f.Write(data)
			if cerr := f.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				c.errorf("churner %d: write %s: %v", id, name, err)
				return
			}
			live[name] = data
		case op < 50:
			name := pickLive()
			if err := os.Remove(c.path("shared/" + name)); err != nil {
				c.errorf("churner %d: unlink %s: %v", id, name, err)
				return
			}
			delete(live, name)
		case op < 65:
			from, to := pickLive(), newName()
			if err := os.Rename(c.path("shared/"+from), c.path("shared/"+to)); err != nil {
				c.errorf("churner %d: rename %s -> %s: %v", id, from, to, err)
				return
			}
			live[to] = live[from]
			delete(live, from)
		case op < 80:
			name := pickLive()
			got, err := os.ReadFile(c.path("shared/" + name))
			if err != nil {
				c.errorf("churner %d: read %s: %v", id, name, err)
				return
			}
			if !bytes.Equal(got, live[name]) {
				c.errorf("churner %d: %s: %s", id, name, describeDiff("got", string(got), "want", string(live[name])))
				return
			}
		case op < 90:
			// A name every churner fights over: either outcome is fine, other errors are not.
			name := fmt.Sprintf("shared/x%d", r.IntN(concContendedName))
			f, err := os.OpenFile(c.path(name), os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
			if err == nil {
				err = f.Close()
			} else if errors.Is(err, os.ErrExist) {
				err = nil
			}
			if err != nil {
				c.errorf("churner %d: create %s: %v", id, name, err)
				return
			}
		default:
			name := fmt.Sprintf("shared/x%d", r.IntN(concContendedName))
			if err := os.Remove(c.path(name)); err != nil && !errors.Is(err, os.ErrNotExist) {
				c.errorf("churner %d: unlink %s: %v", id, name, err)
				return
			}
		}
	}
}

// ---------------------------------------------------------------------------------------------
// Observers

// observe lists and stats everything until the workers are done. Names may vanish between
// readdir and stat (ENOENT is fine); what must never happen is a name nobody made, a size
// out of bounds or any other error.
func (c *concurrentRun) observe(id int) {
	r := c.rng(300 + id)
	dirs := []string{".", "shared"}
	for i := range concWriters {
		dirs = append(dirs, fmt.Sprintf("w%d", i))
	}
	for i := range concRenamers {
		for _, s := range []string{"", "/left", "/right", "/left/d", "/left/e", "/right/d", "/right/e"} {
			dirs = append(dirs, fmt.Sprintf("mv%d%s", i, s))
		}
	}
	for rounds := 0; !c.done.Load() && !c.failed.Load(); rounds++ {
		dir := dirs[r.IntN(len(dirs))]
		names, err := readdirNames(c.path(dir))
		if errors.Is(err, os.ErrNotExist) {
			continue // not made yet, or a renamer's directory elsewhere just now
		}
		if err != nil {
			c.errorf("observer %d: readdir %s: %v", id, dir, err)
			return
		}
		for _, name := range names {
			if !c.expectedName(dir, name) {
				c.errorf("observer %d: unexpected name %s in %s (all: %v)", id, name, dir, names)
				return
			}
			var st unix.Stat_t
			if err := unix.Lstat(c.path(filepath.Join(dir, name)), &st); err != nil {
				if errors.Is(err, unix.ENOENT) {
					continue
				}
				c.errorf("observer %d: lstat %s/%s: %v", id, dir, name, err)
				return
			}
			if st.Mode&unix.S_IFMT == unix.S_IFREG && st.Size > concWriters*concRegion {
				c.errorf("observer %d: %s/%s has size %d, more than anyone wrote", id, dir, name, st.Size)
				return
			}
		}
		if rounds%16 == 0 {
			var st unix.Statfs_t
			if err := unix.Statfs(c.dir, &st); err != nil {
				c.errorf("observer %d: statfs: %v", id, err)
				return
			}
		}
	}
}

func (c *concurrentRun) expectedName(dir, name string) bool {
	switch {
	case dir == ".":
		return name == "shared" || name == "common" || strings.HasPrefix(name, "w") || strings.HasPrefix(name, "mv")
	case dir == "shared":
		return strings.HasPrefix(name, "c") || strings.HasPrefix(name, "x")
	case strings.HasPrefix(dir, "w"):
		return len(name) == 2 && name[0] == 'f'
	case strings.Count(dir, "/") == 0: // mv<k>
		return name == "left" || name == "right"
	case strings.Count(dir, "/") == 1: // mv<k>/left, mv<k>/right
		return name == "d" || name == "e"
	default: // the moving directory
		return name == "sub" || (len(name) == 2 && name[0] == 'x')
	}
}
