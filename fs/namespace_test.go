package fs

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/tiers"
)

// recorder is a tiers.Events that remembers what happened, and checks on every rename that
// the namespace already shows the new name (events come after the change, not before).
type recorder struct {
	mu     sync.Mutex
	ns     tiers.Namespace
	events []string
	early  []string
	opened atomic.Int64 // Opened calls for writing
	reads  atomic.Int64 // Opened calls for reading only
}

func (r *recorder) add(s string) {
	r.mu.Lock()
	r.events = append(r.events, s)
	r.mu.Unlock()
}
func (r *recorder) Closed(path string)         { r.add("closed " + path) }
func (r *recorder) TooLarge(path string)       { r.add("toolarge " + path) }
func (r *recorder) Abandoned(path, why string) { r.add("abandoned " + path) }
func (r *recorder) Opened(writing bool) {
	if writing {
		r.opened.Add(1)
	} else {
		r.reads.Add(1)
	}
}
func (r *recorder) Flushed(path string) { r.add("flushed " + path) }
func (r *recorder) Created(path string, typ layout.EntryType) {
	r.add("created " + path + " " + typ.String())
	r.checkListed(path)
}
func (r *recorder) Renamed(oldPath, newPath string, typ layout.EntryType) {
	r.add("renamed " + oldPath + " " + newPath + " " + typ.String())
	r.checkListed(newPath)
}

// checkListed remembers a top-level name that the namespace does not list yet.
func (r *recorder) checkListed(name string) {
	r.mu.Lock()
	ns := r.ns
	r.mu.Unlock()
	if ns == nil || filepathHasDir(name) {
		return
	}
	ents, _ := ns.List()
	for _, e := range ents {
		if e.Name == name {
			return
		}
	}
	r.mu.Lock()
	r.early = append(r.early, name)
	r.mu.Unlock()
}

// earlyNames returns the names reported before the namespace held them.
func (r *recorder) earlyNames() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.early...)
}

func filepathHasDir(p string) bool { return filepath.Dir(p) != "." }

func (r *recorder) has(s string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, e := range r.events {
		if e == s {
			return true
		}
	}
	return false
}

func (r *recorder) count(s string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, e := range r.events {
		if e == s {
			n++
		}
	}
	return n
}

func (r *recorder) waitFor(t *testing.T, s string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !r.has(s) {
		if time.Now().After(deadline) {
			r.mu.Lock()
			defer r.mu.Unlock()
			t.Fatalf("event %q never came; got %q", s, r.events)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func mountWithEvents(t *testing.T, mode PassthroughMode) (string, *Server, *recorder, *tiers.Spool) {
	t.Helper()
	return mountWithEventsBudget(t, mode, 64<<20)
}

// mountWithEventsBudget is mountWithEvents with a spool of budget bytes.
func mountWithEventsBudget(t *testing.T, mode PassthroughMode, budget int64) (string, *Server, *recorder, *tiers.Spool) {
	t.Helper()
	return mountWithEventsWrapped(t, mode, budget, nil)
}

// mountWithEventsWrapped is mountWithEventsBudget whose mount gets wrap(recorder) as its Events
// (nil: the recorder).
func mountWithEventsWrapped(t *testing.T, mode PassthroughMode, budget int64, wrap func(*recorder) tiers.Events) (string, *Server, *recorder, *tiers.Spool) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("mount tests need root")
	}
	base := t.TempDir()
	dir := filepath.Join(base, "mnt")
	require.NoError(t, os.Mkdir(dir, 0o755))
	spool, err := tiers.OpenSpool(tiers.SpoolConfig{Dir: filepath.Join(base, "spool"), Budget: budget, MountTmpfs: true})
	require.NoError(t, err)
	rec := &recorder{}
	var events tiers.Events = rec
	if wrap != nil {
		events = wrap(rec)
	}
	srv, err := Mount(dir, Options{Spool: spool, Passthrough: mode, Events: events, InProcess: true})
	if err != nil {
		spool.Close()
		t.Fatal(err)
	}
	rec.mu.Lock()
	rec.ns = srv.Namespace() // a probe at mount can already report events
	rec.mu.Unlock()
	t.Cleanup(func() {
		if err := srv.Unmount(); err != nil {
			t.Errorf("unmount: %v", err)
		}
		spool.Close()
	})
	return dir, srv, rec, spool
}

func TestEvents(t *testing.T) {
	for _, mode := range modes {
		t.Run(string(mode), func(t *testing.T) {
			dir, _, rec, _ := mountWithEvents(t, mode)
			tmp := filepath.Join(dir, "7.orbax-checkpoint-tmp")
			require.NoError(t, os.MkdirAll(filepath.Join(tmp, "state"), 0o755))
			require.NoError(t, os.WriteFile(filepath.Join(tmp, "state", "a"), []byte("x"), 0o644))
			rec.waitFor(t, "closed 7.orbax-checkpoint-tmp/state/a")
			require.NoError(t, os.Rename(tmp, filepath.Join(dir, "7")))
			rec.waitFor(t, "renamed 7.orbax-checkpoint-tmp 7 directory")

			// A read-only open is not a close-after-write.
			f, err := os.Open(filepath.Join(dir, "7", "state", "a"))
			require.NoError(t, err)
			f.Close()
			require.False(t, rec.has("closed 7/state/a"))

			// replicator.yaml has a size limit: EFBIG past 64 KiB, and the listener hears of it.
			big := bytes.Repeat([]byte("k"), tiers.MaxConfigSize+1)
			err = os.WriteFile(filepath.Join(dir, "replicator.yaml"), big, 0o644)
			require.True(t, errors.Is(err, syscall.EFBIG), "want EFBIG, got %v", err)
			rec.waitFor(t, "toolarge replicator.yaml")
			// Every way of growing it is held to the limit: fallocate and copy_file_range too.
			yf, err := os.OpenFile(filepath.Join(dir, "replicator.yaml"), os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o644)
			require.NoError(t, err)
			defer yf.Close()
			err = unix.Fallocate(int(yf.Fd()), 0, 0, tiers.MaxConfigSize+1)
			require.True(t, errors.Is(err, syscall.EFBIG), "fallocate past the limit: want EFBIG, got %v", err)
			src, err := os.Create(filepath.Join(dir, "big-source"))
			require.NoError(t, err)
			defer src.Close()
			_, err = src.Write(big)
			require.NoError(t, err)
			var offIn, offOut int64
			_, err = unix.CopyFileRange(int(src.Fd()), &offIn, int(yf.Fd()), &offOut, len(big), 0)
			require.True(t, errors.Is(err, syscall.EFBIG), "copy_file_range past the limit: want EFBIG, got %v", err)
			fi, err := yf.Stat()
			require.NoError(t, err)
			require.LessOrEqual(t, fi.Size(), int64(tiers.MaxConfigSize))
			require.Empty(t, rec.earlyNames(), "rename events must come after the namespace changed")
		})
	}
}

func TestNamespace(t *testing.T) {
	for _, mode := range modes {
		t.Run(string(mode), func(t *testing.T) {
			dir, srv, _, spool := mountWithEvents(t, mode)
			ns := srv.Namespace()
			p := func(n string) string { return filepath.Join(dir, n) }

			// A lookup of a missing name is cached by the kernel; WriteFile must still show up.
			_, err := os.Stat(p("status.txt"))
			require.True(t, errors.Is(err, os.ErrNotExist))
			require.NoError(t, ns.WriteFile("status.txt", []byte("one")))
			got, err := os.ReadFile(p("status.txt"))
			require.NoError(t, err)
			require.Equal(t, "one", string(got))
			require.NoError(t, ns.WriteFile("status.txt", []byte("two!")))
			got, err = os.ReadFile(p("status.txt"))
			require.NoError(t, err)
			require.Equal(t, "two!", string(got), "replaced content (and size) must be visible at once")

			data, err := ns.ReadFile("status.txt", 100)
			require.NoError(t, err)
			require.Equal(t, "two!", string(data))
			_, err = ns.ReadFile("status.txt", 2)
			require.True(t, errors.Is(err, syscall.EFBIG))

			// Seal a tree written through the mount, import it under another name.
			require.NoError(t, os.MkdirAll(p("5/state/sub"), 0o755))
			require.NoError(t, os.WriteFile(p("5/state/sub/w"), []byte("weights"), 0o644))
			require.NoError(t, os.Symlink("sub/w", p("5/state/link")))
			require.NoError(t, os.Mkdir(p("5/empty"), 0o755))
			sealed := filepath.Join(spool.Dir(), "sealed") // hard links stay inside the spool
			info, err := ns.Seal("5", sealed)
			require.NoError(t, err)
			require.Zero(t, info.Copied, "nothing was open for writing")
			ents, err := layout.ListTree(sealed)
			require.NoError(t, err)
			var paths []string
			for _, e := range ents {
				paths = append(paths, e.Path+":"+e.Type.String())
			}
			sort.Strings(paths)
			require.Equal(t, []string{"empty:directory", "state/link:symlink", "state/sub/w:file", "state/sub:directory", "state:directory"}, paths)
			w, err := os.ReadFile(filepath.Join(sealed, "state/sub/w"))
			require.NoError(t, err)
			require.Equal(t, "weights", string(w))

			require.NoError(t, ns.Rename("5", "Dabc.data"))
			_, err = os.Stat(p("5"))
			require.True(t, errors.Is(err, os.ErrNotExist))
			w, err = os.ReadFile(p("Dabc.data/state/link"))
			require.NoError(t, err)
			require.Equal(t, "weights", string(w))

			require.NoError(t, ns.Import(sealed, "copy"))
			w, err = os.ReadFile(p("copy/state/sub/w"))
			require.NoError(t, err)
			require.Equal(t, "weights", string(w))
			require.Error(t, ns.Import(sealed, "copy"), "import over an existing name must fail")
			nlink := func(p string) uint64 {
				var st syscall.Stat_t
				require.NoError(t, syscall.Stat(p, &st))
				return uint64(st.Nlink)
			}
			require.Equal(t, uint64(4), nlink(p("copy")), "copy holds empty/ and state/")
			require.Equal(t, uint64(3), nlink(p("copy/state")), "state holds sub/")
			require.Equal(t, uint64(4), nlink(dir), "the root holds Dabc.data/ and copy/")

			require.NoError(t, ns.Symlink("Dabc.data", "job-s5-n0-w0.restore"))
			tgt, err := os.Readlink(p("job-s5-n0-w0.restore"))
			require.NoError(t, err)
			require.Equal(t, "Dabc.data", tgt)
			w, err = os.ReadFile(p("job-s5-n0-w0.restore/state/sub/w"))
			require.NoError(t, err)
			require.Equal(t, "weights", string(w))

			require.NoError(t, ns.Remove("copy"))
			require.NoError(t, ns.Remove("missing"))
			_, err = os.Stat(p("copy"))
			require.True(t, errors.Is(err, os.ErrNotExist))

			ents2, err := ns.List()
			require.NoError(t, err)
			var names []string
			for _, e := range ents2 {
				names = append(names, e.Name)
			}
			sort.Strings(names)
			require.Equal(t, []string{"Dabc.data", "job-s5-n0-w0.restore", "status.txt"}, names)
		})
	}
}

// A name the agent replaces (WriteFile over an existing file, as a .meta or replicator.errors is
// rewritten) always resolves for a reader racing the replacement: it reads the old content or
// the new one, never ENOENT.
func TestReplacedNameNeverVanishes(t *testing.T) {
	for _, mode := range modes {
		t.Run(string(mode), func(t *testing.T) {
			dir, srv, _, _ := mountWithEvents(t, mode)
			ns := srv.Namespace()
			require.NoError(t, ns.WriteFile("x.meta", []byte("v0")))
			stop := make(chan struct{})
			var misses, reads atomic.Int64
			var wg sync.WaitGroup
			for range 2 {
				wg.Go(func() {
					for {
						select {
						case <-stop:
							return
						default:
						}
						if _, err := os.ReadFile(filepath.Join(dir, "x.meta")); err != nil {
							if misses.Add(1) == 1 {
								t.Logf("first miss: %v", err)
							}
						}
						reads.Add(1)
					}
				})
			}
			for i := range 2000 {
				require.NoError(t, ns.WriteFile("x.meta", []byte(fmt.Sprintf("v%d", i))))
			}
			close(stop)
			wg.Wait()
			require.Zero(t, misses.Load(), "of %d reads racing 2000 replacements", reads.Load())
		})
	}
}

// TestImportVerifiedShowsNothingUntilVerified: adoption builds a tree while its data is
// verified; the name is invisible meanwhile, never appears if verification fails (nothing of
// it stays in the spool), and appears with its bytes once it passed.
func TestImportVerifiedShowsNothingUntilVerified(t *testing.T) {
	dir, srv, _, spool := mountWithEvents(t, PassthroughOff)
	ns := srv.Namespace()
	src := filepath.Join(spool.Dir(), "sealed-test") // hard links stay inside the spool
	require.NoError(t, os.MkdirAll(filepath.Join(src, "state"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(src, "state", "w"), []byte("weights"), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(src, "meta"), []byte("{}"), 0o644))
	spoolFiles := func() int {
		ents, err := os.ReadDir(spool.FilesDir())
		require.NoError(t, err)
		return len(ents)
	}
	before := spoolFiles()
	invisible := func(name string) {
		_, err := os.Lstat(filepath.Join(dir, name))
		assert.ErrorIs(t, err, os.ErrNotExist, "%s visible before it verified", name)
	}

	bad := errors.New("content hashes to Dxyz, want Dabc")
	err := ns.ImportVerified(src, "Dabc.data", func(listing []layout.TreeEntry) error {
		invisible("Dabc.data")
		var paths []string
		for _, e := range listing {
			paths = append(paths, e.Path)
		}
		sort.Strings(paths)
		assert.Equal(t, []string{"meta", "state", "state/w"}, paths, "verify gets the listing the tree is built from")
		return bad
	})
	require.ErrorIs(t, err, bad, "the verification's own error")
	invisible("Dabc.data")
	require.Equal(t, before, spoolFiles(), "a tree that failed verification leaves no file in the spool")
	w, err := os.ReadFile(filepath.Join(src, "state", "w"))
	require.NoError(t, err, "the record's own files stay: the nodes dropped only borrowed them")
	require.Equal(t, "weights", string(w))
	// A verify that passes without hashing the listing leaves the files' sizes unknown (the
	// listing of a verified import stats no file): refused, not published.
	err = ns.ImportVerified(src, "Dabc.data", func([]layout.TreeEntry) error { return nil })
	require.ErrorContains(t, err, "verified without its size")
	invisible("Dabc.data")
	require.Equal(t, before, spoolFiles())

	ran := false
	require.NoError(t, ns.ImportVerified(src, "Dabc.data", func(listing []layout.TreeEntry) error {
		time.Sleep(50 * time.Millisecond) // the tree is built meanwhile
		invisible("Dabc.data")
		ran = true
		return layout.HashEntries(t.Context(), src, listing, nil) // as the real verification, it fills in the sizes
	}))
	require.True(t, ran)
	w, err = os.ReadFile(filepath.Join(dir, "Dabc.data", "state", "w"))
	require.NoError(t, err)
	require.Equal(t, "weights", string(w))
	require.Equal(t, before, spoolFiles(), "the published tree's files borrow the record's names: no link in the spool")

	err = ns.ImportVerified(src, "Dabc.data", func([]layout.TreeEntry) error { return nil })
	require.ErrorIs(t, err, os.ErrExist, "a name already there")
	require.Equal(t, before, spoolFiles())
}

// An imported step's files borrow the sealed record's names: removing the step from the
// namespace leaves the record whole, and a hard link the job made to one of its files (a later
// step reusing an unchanged shard) keeps its bytes after the record is gone.
func TestImportedFilesBorrowTheRecordsNames(t *testing.T) {
	for _, mode := range []PassthroughMode{PassthroughOff, PassthroughAuto} {
		t.Run(string(mode), func(t *testing.T) {
			dir, srv, _, spool := mountWithEvents(t, mode)
			ns := srv.Namespace()
			src := filepath.Join(spool.Dir(), "sealed-test")
			require.NoError(t, os.MkdirAll(filepath.Join(src, "state"), 0o755))
			require.NoError(t, os.WriteFile(filepath.Join(src, "state", "w"), []byte("weights"), 0o644))
			require.NoError(t, os.WriteFile(filepath.Join(src, "state", "v"), []byte("values"), 0o644))
			single := filepath.Join(spool.Dir(), "sealed-single")
			require.NoError(t, os.WriteFile(single, []byte("one file"), 0o644))
			// A path too long to borrow (PATH_MAX once prefixed with the record) gets a
			// spool file name of its own.
			deep := "deep"
			for len(src)+len(deep) < unix.PathMax {
				deep += "/" + strings.Repeat("d", 200)
			}
			sd, err := layout.OpenDir(src)
			require.NoError(t, err)
			defer sd.Close()
			require.NoError(t, sd.MkdirAll(deep, 0o755))
			df, err := sd.Open(deep+"/f", os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o644)
			require.NoError(t, err)
			_, err = df.WriteString("deep file")
			require.NoError(t, err)
			require.NoError(t, df.Close())
			filesBefore, err := os.ReadDir(spool.FilesDir())
			require.NoError(t, err)
			require.NoError(t, ns.Import(src, "Dabc.data"))
			require.NoError(t, ns.Import(single, "Fdef.data"))
			filesAfter, err := os.ReadDir(spool.FilesDir())
			require.NoError(t, err)
			require.Len(t, filesAfter, len(filesBefore)+1, "one link: the file whose path is too long to borrow")
			md, err := layout.OpenDir(filepath.Join(dir, "Dabc.data"))
			require.NoError(t, err)
			defer md.Close()
			mf, err := md.Open(deep+"/f", os.O_RDONLY, 0)
			require.NoError(t, err)
			got, err := io.ReadAll(mf)
			mf.Close()
			require.NoError(t, err)
			require.Equal(t, "deep file", string(got))

			// The job reuses a shard of the imported step in a new step, and reads it.
			require.NoError(t, os.Mkdir(filepath.Join(dir, "2.orbax-checkpoint-tmp"), 0o755))
			reused := filepath.Join(dir, "2.orbax-checkpoint-tmp", "w")
			require.NoError(t, os.Link(filepath.Join(dir, "Dabc.data", "state", "w"), reused))
			f, err := os.Open(filepath.Join(dir, "Dabc.data", "state", "v"))
			require.NoError(t, err)
			defer f.Close()

			// Retention drops the step: the namespace's name first, then the record.
			require.NoError(t, ns.Remove("Dabc.data"))
			require.NoError(t, ns.Remove("Fdef.data"))
			for _, p := range []string{filepath.Join(src, "state", "w"), filepath.Join(src, "state", "v"), single} {
				_, err := os.Stat(p)
				require.NoError(t, err, "the namespace removed %s, which the record owns", p)
			}
			require.NoError(t, os.RemoveAll(src))
			require.NoError(t, os.Remove(single))

			w, err := os.ReadFile(reused)
			require.NoError(t, err, "a name the job gave an imported file outlives the record")
			require.Equal(t, "weights", string(w))
			v, err := io.ReadAll(f)
			require.NoError(t, err, "a descriptor open before the record went")
			require.Equal(t, "values", string(v))
		})
	}
}

// When the agent renames a step (a seal gives it its data name), the kernel keeps what it
// cached below it: on a kernel that can expire an entry only, the new name's first lookup moves
// the cached directory there and its files need no lookup again; the old name is gone at once.
// Without that capability every file is looked up again (the kernel dropped them all).
func TestRenameKeepsTheKernelCacheBelow(t *testing.T) {
	dir, srv, _, _ := mountWithEvents(t, PassthroughAuto)
	ns := srv.Namespace()
	p := func(n string) string { return filepath.Join(dir, n) }
	const files = 200
	require.NoError(t, os.Mkdir(p("7"), 0o755))
	for i := range files {
		require.NoError(t, os.WriteFile(p(fmt.Sprintf("7/f%d", i)), []byte{byte(i)}, 0o644))
	}
	for i := range files { // every entry in the kernel's cache (5 s)
		_, err := os.Stat(p(fmt.Sprintf("7/f%d", i)))
		require.NoError(t, err)
	}
	expireOnly := srv.fuse.KernelSettings().Flags64()&fuse.CAP_HAS_EXPIRE_ONLY != 0
	require.NotNil(t, srv.ns.m.notifier.Load(), "the mount's /dev/fuse descriptor was found")
	require.Equal(t, expireOnly, srv.ns.m.notifier.Load().expireOnly, "entries expire exactly when the kernel offers it")
	require.True(t, srv.ns.m.notifier.Load().usesHelper(), "the notifications go through the helper process")
	t.Logf("kernel can expire entries only: %v", expireOnly)

	lookups := srv.Requests()["lookup"]
	require.NoError(t, ns.Rename("7", "D7.data"))
	for i := range files {
		b, err := os.ReadFile(p(fmt.Sprintf("D7.data/f%d", i)))
		require.NoError(t, err)
		require.Equal(t, []byte{byte(i)}, b)
	}
	looked := srv.Requests()["lookup"] - lookups
	if expireOnly {
		require.LessOrEqual(t, looked, uint64(2), "the files' entries must survive the rename in the kernel's cache")
	} else {
		require.GreaterOrEqual(t, looked, uint64(files), "without FUSE_EXPIRE_ONLY the kernel drops the files' entries")
	}
	_, err := os.Stat(p("7"))
	require.ErrorIs(t, err, os.ErrNotExist, "the old name must be gone through the mount")
	names, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Len(t, names, 1)
	require.Equal(t, "D7.data", names[0].Name())

	// The old name asked for first, then the new: the kernel drops the stale subtree on the
	// old name's lookup, and the new name's files are found again.
	require.NoError(t, os.Mkdir(p("8"), 0o755))
	require.NoError(t, os.WriteFile(p("8/x"), []byte("x"), 0o644))
	_, err = os.Stat(p("8/x"))
	require.NoError(t, err)
	require.NoError(t, ns.Rename("8", "D8.data"))
	_, err = os.Stat(p("8/x"))
	require.ErrorIs(t, err, os.ErrNotExist)
	b, err := os.ReadFile(p("D8.data/x"))
	require.NoError(t, err)
	require.Equal(t, "x", string(b))
}

// mountExpiring mounts like mountWithEvents, for a test of what the kernel keeps when the agent
// only expires its entries; it skips where the kernel cannot (FUSE_EXPIRE_ONLY, Linux 6.2+).
func mountExpiring(t *testing.T) (string, *Server) {
	dir, srv, _, _ := mountWithEvents(t, PassthroughAuto)
	if srv.ns.m.notifier.Load() == nil || !srv.ns.m.notifier.Load().expireOnly {
		t.Skip("the kernel cannot expire entries only (FUSE_EXPIRE_ONLY, Linux 6.2+): names are invalidated at once")
	}
	return dir, srv
}

// A step the agent renamed and later removes without anybody having looked up its new name:
// the kernel still holds its tree under the old, expired name. Remove makes the kernel drop it
// (it forgets the files), so a removed step's entries do not stay cached until memory pressure.
func TestRemoveDropsTheTreeKeptUnderAnOldName(t *testing.T) {
	dir, srv := mountExpiring(t)
	ns := srv.Namespace()
	p := func(n string) string { return filepath.Join(dir, n) }
	const files = 100
	require.NoError(t, os.Mkdir(p("9"), 0o755))
	for i := range files {
		require.NoError(t, os.WriteFile(p(fmt.Sprintf("9/f%d", i)), nil, 0o644))
	}
	forgets := srv.Requests()["forget"]
	require.NoError(t, ns.Rename("9", "a9.data"))
	require.NoError(t, ns.Rename("a9.data", "b9.data")) // renamed twice: both old names tracked
	require.NoError(t, ns.Remove("b9.data"))
	deadline := time.Now().Add(10 * time.Second)
	for srv.Requests()["forget"]-forgets < files && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	require.GreaterOrEqual(t, srv.Requests()["forget"]-forgets, uint64(files), "the kernel must forget the removed step's files")
	srv.ns.staleMu.Lock()
	require.Empty(t, srv.ns.stale, "nothing left to invalidate")
	srv.ns.staleMu.Unlock()
	_, err := os.Stat(p("9"))
	require.ErrorIs(t, err, os.ErrNotExist)
}

// Adoption's own verification (layout.VerifyListed, filling in the digests of the listing the
// tree is built from) runs while the tree is built; under -race this also checks that building
// the tree does not read what the verification writes.
func TestImportVerifiedWithTheListingsVerification(t *testing.T) {
	dir, srv, _, spool := mountWithEvents(t, PassthroughAuto)
	ns := srv.Namespace()
	src := filepath.Join(spool.Dir(), "sealed-listed")
	for i := range 300 {
		p := filepath.Join(src, fmt.Sprintf("d%d", i%5), fmt.Sprintf("f%03d", i))
		require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
		require.NoError(t, os.WriteFile(p, bytes.Repeat([]byte{byte(i)}, 1+i*37), 0o644))
	}
	hash, isDir, err := layout.HashData(t.Context(), src)
	require.NoError(t, err)
	require.True(t, isDir)
	verify := func(want string) func([]layout.TreeEntry) error {
		return func(listing []layout.TreeEntry) error {
			if len(listing) != 305 { // runs on another goroutine: no require here
				return fmt.Errorf("a listing of %d entries, want 5 directories and 300 files", len(listing))
			}
			return layout.VerifyListed(t.Context(), src, listing, want, true)
		}
	}
	var mismatch *layout.HashMismatchError
	require.ErrorAs(t, ns.ImportVerified(src, "Dbad.data", verify(strings.Repeat("0", 64))), &mismatch)
	_, err = os.Lstat(filepath.Join(dir, "Dbad.data"))
	require.ErrorIs(t, err, os.ErrNotExist)

	require.NoError(t, ns.ImportVerified(src, "D"+hash+".data", verify(hash)))
	for _, i := range []int{0, 151, 299} {
		b, err := os.ReadFile(filepath.Join(dir, "D"+hash+".data", fmt.Sprintf("d%d", i%5), fmt.Sprintf("f%03d", i)))
		require.NoError(t, err)
		require.Equal(t, bytes.Repeat([]byte{byte(i)}, 1+i*37), b)
	}
}

// Removing a renamed step does not make the kernel drop a new entry that took the step's old
// name since (the job saved a step of that name again): its cached files are not looked up
// again.
func TestRemoveLeavesANewEntryOfTheOldName(t *testing.T) {
	dir, srv := mountExpiring(t)
	ns := srv.Namespace()
	p := func(n string) string { return filepath.Join(dir, n) }
	require.NoError(t, os.Mkdir(p("9"), 0o755))
	require.NoError(t, os.WriteFile(p("9/old"), nil, 0o644))
	require.NoError(t, ns.Rename("9", "a9.data"))
	const files = 50
	require.NoError(t, os.Mkdir(p("9"), 0o755)) // the job's new entry of the old name
	for i := range files {
		require.NoError(t, os.WriteFile(p(fmt.Sprintf("9/f%d", i)), nil, 0o644))
	}
	stat := func() {
		for i := range files {
			_, err := os.Stat(p(fmt.Sprintf("9/f%d", i)))
			require.NoError(t, err)
		}
	}
	stat()
	require.NoError(t, ns.Remove("a9.data"))
	lookups := srv.Requests()["lookup"]
	stat()
	require.Zero(t, srv.Requests()["lookup"]-lookups, "the new 9's entries stay cached")
}

// The descriptor the notifier writes on is the FUSE device's, never another file's.
func TestDupFUSEDeviceTakesOnlyTheDevice(t *testing.T) {
	require.Equal(t, -1, dupFUSEDevice(-1))
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer r.Close()
	defer w.Close()
	require.Equal(t, -1, dupFUSEDevice(int(w.Fd())), "a pipe is not the FUSE device")
	null, err := os.OpenFile("/dev/null", os.O_RDWR, 0)
	require.NoError(t, err)
	defer null.Close()
	require.Equal(t, -1, dupFUSEDevice(int(null.Fd())), "nor another character device")
	dev, err := os.OpenFile("/dev/fuse", os.O_RDWR, 0)
	if err != nil {
		t.Skipf("cannot open /dev/fuse: %v", err)
	}
	defer dev.Close()
	dup := dupFUSEDevice(int(dev.Fd()))
	require.GreaterOrEqual(t, dup, 0)
	require.NotEqual(t, int(dev.Fd()), dup)
	flags, err := unix.FcntlInt(uintptr(dup), unix.F_GETFD, 0)
	require.NoError(t, err)
	require.NotZero(t, flags&unix.FD_CLOEXEC, "close-on-exec")
	unix.Close(dup)

	require.Equal(t, 7, newDescriptor(map[int]bool{3: true}, map[int]bool{3: true, 7: true}))
	require.Equal(t, -1, newDescriptor(map[int]bool{3: true}, map[int]bool{3: true}), "none appeared")
	require.Equal(t, -1, newDescriptor(nil, map[int]bool{5: true, 7: true}), "two appeared: which is it?")
}

// Names as long as a name may be (255 bytes) go through the expiry the agent writes itself: a
// step of such a name renamed by the agent is gone under it at once, found under the new one,
// and a removal after that leaves nothing of it; a 256-byte name never gets that far.
func TestExpiryOfTheLongestNames(t *testing.T) {
	dir, srv := mountExpiring(t)
	ns := srv.Namespace()
	long := strings.Repeat("s", 255)
	require.NoError(t, os.Mkdir(filepath.Join(dir, long), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, long, "f"), []byte("x"), 0o644))
	_, err := os.Stat(filepath.Join(dir, long, "f"))
	require.NoError(t, err)
	newName := strings.Repeat("d", 250) + ".data"
	require.NoError(t, srv.ns.m.notifier.Load().expire(fuse.FUSE_ROOT_ID, long), "the kernel takes a 255-byte name")
	require.NoError(t, ns.Rename(long, newName))
	_, err = os.Stat(filepath.Join(dir, long))
	require.ErrorIs(t, err, os.ErrNotExist)
	b, err := os.ReadFile(filepath.Join(dir, newName, "f"))
	require.NoError(t, err)
	require.Equal(t, "x", string(b))
	require.NoError(t, ns.Remove(newName))
	_, err = os.Stat(filepath.Join(dir, newName))
	require.ErrorIs(t, err, os.ErrNotExist)
	err = os.Mkdir(filepath.Join(dir, long+"s"), 0o755)
	require.ErrorIs(t, err, syscall.ENAMETOOLONG)
}

// On a spool whose budget the agent accounts for (a user's agent: no tmpfs of its own), the
// committed data a predecessor left is counted once: by the nodes that import it, not also by
// the starting spool's scan (a restart counted 19 MiB of checkpoints as 38 MiB used, for good).
// Its bytes are counted even past the budget (they are in the spool already), and go with the
// step's removal.
func TestImportedDataIsChargedOnce(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mount tests need root")
	}
	base := t.TempDir()
	dir := filepath.Join(base, "mnt")
	require.NoError(t, os.Mkdir(dir, 0o755))
	spoolDir := filepath.Join(base, "spool")
	const budget = 16 << 20
	rec := filepath.Join(spoolDir, "sealed", "Dabc.data")
	require.NoError(t, os.MkdirAll(filepath.Join(rec, "state"), 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(rec, "state", "w"), make([]byte, 12<<20), 0o600))
	require.NoError(t, os.WriteFile(filepath.Join(rec, "meta"), make([]byte, 6<<20), 0o600)) // 18 MiB: past the budget
	commit := filepath.Join(spoolDir, "commits", "c1", "data")
	require.NoError(t, os.MkdirAll(commit, 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(commit, "f"), make([]byte, 1<<20), 0o600))
	for _, d := range []string{"staging", "incoming", "peer-incoming"} { // a killed agent's leftovers, removed at the start
		require.NoError(t, os.MkdirAll(filepath.Join(spoolDir, d, "x"), 0o700))
		require.NoError(t, os.WriteFile(filepath.Join(spoolDir, d, "x", "part"), make([]byte, 1<<20), 0o600))
	}
	require.NoError(t, os.MkdirAll(filepath.Join(spoolDir, "meta"), 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(spoolDir, "meta", "x.meta"), []byte("Dabc"), 0o600))

	spool, err := tiers.OpenSpool(tiers.SpoolConfig{Dir: spoolDir, Budget: budget, MountTmpfs: false})
	require.NoError(t, err)
	require.False(t, spool.KernelEnforced())
	_, used := spool.Usage()
	require.Less(t, used, int64(4096), "the records a restart adopts are left to the namespace to charge, and the leftovers it removes are not counted")
	srv, err := Mount(dir, Options{Spool: spool, Passthrough: PassthroughOff, InProcess: true})
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, srv.Unmount())
		spool.Close()
	})
	ns := srv.Namespace()
	require.NoError(t, ns.ImportVerified(rec, "Dabc.data", func(listing []layout.TreeEntry) error {
		return layout.HashEntries(t.Context(), rec, listing, nil) // fills in the sizes, as the verification does
	}))
	_, used = spool.Usage()
	require.InDelta(t, float64(18<<20), float64(used), 4096, "the imported step, counted once and past the budget")
	err = os.WriteFile(filepath.Join(dir, "new"), []byte("x"), 0o644)
	require.ErrorIs(t, err, syscall.ENOSPC, "a write with the budget taken by imported data")
	require.NoError(t, ns.Remove("Dabc.data"))
	_, used = spool.Usage()
	require.Less(t, used, int64(4096), "the step's removal refunds what its import charged")
}

// TestImportKeepsOwnersAndModes: Seal records the owners and modes of the job's entries (the
// sealed copy's own are the agent's), and Import gives them back. Before, an imported step (an
// agent restart, a replica, a restore from a backup) was root's, 0644 and 0755 whatever the job
// saved: a job that kept its checkpoint private (0600 as uid 1000) had it readable by all.
func TestImportKeepsOwnersAndModes(t *testing.T) {
	dir, srv, _, spool := mountWithEvents(t, PassthroughOff)
	ns := srv.Namespace()
	p := func(n string) string { return filepath.Join(dir, n) }
	type want struct {
		mode     os.FileMode
		uid, gid uint32
	}
	entries := map[string]want{
		"7":                 {os.ModeDir | 0o700, 1000, 1000},
		"7/state":           {os.ModeDir | 0o750, 1000, 1000},
		"7/state/a":         {0o600, 1000, 1000},
		"7/state/b":         {0o600, 1000, 1000},
		"7/state/shared":    {0o644, 1000, 1000},
		"7/state/setuid":    {os.ModeSetuid | 0o755, 1000, 1000},
		"7/root-owned":      {0o640, 0, 0},
		"7/other-group":     {0o600, 1000, 2000},
		"7/fifo":            {os.ModeNamedPipe | 0o620, 1000, 1000},
		"7/state/link":      {os.ModeSymlink | 0o777, 1000, 1000},
		"7/caf\xe9/sub\xff": {os.ModeDir | 0o711, 1000, 1000},
	}
	require.NoError(t, os.MkdirAll(p("7/state"), 0o755))
	require.NoError(t, os.MkdirAll(p("7/caf\xe9/sub\xff"), 0o755))
	for _, f := range []string{"7/state/a", "7/state/b", "7/state/shared", "7/state/setuid", "7/root-owned", "7/other-group"} {
		require.NoError(t, os.WriteFile(p(f), []byte(f), 0o644))
	}
	require.NoError(t, unix.Mkfifo(p("7/fifo"), 0o644))
	require.NoError(t, os.Symlink("a", p("7/state/link")))
	// Deepest first: chown clears the set-user-ID bit, so the modes go last.
	for _, n := range []string{"7/state/link", "7/fifo", "7/other-group", "7/root-owned", "7/state/setuid", "7/state/shared", "7/state/b", "7/state/a", "7/caf\xe9/sub\xff", "7/caf\xe9", "7/state", "7"} {
		w, ok := entries[n]
		if !ok {
			w = want{os.ModeDir | 0o755, 1000, 1000}
		}
		require.NoError(t, os.Lchown(p(n), int(w.uid), int(w.gid)), n)
		if w.mode&os.ModeSymlink == 0 {
			require.NoError(t, os.Chmod(p(n), w.mode), n)
		}
	}
	check := func(top string, defaults bool) {
		t.Helper()
		for n, w := range entries {
			n = top + strings.TrimPrefix(n, "7")
			fi, err := os.Lstat(p(n))
			require.NoError(t, err, n)
			st := fi.Sys().(*syscall.Stat_t)
			if defaults {
				w.uid, w.gid = 0, 0
				switch {
				case fi.IsDir():
					w.mode = os.ModeDir | 0o755
				case fi.Mode()&os.ModeSymlink != 0:
				default:
					w.mode = w.mode&os.ModeType | 0o644
				}
			}
			assert.Equal(t, w.mode.String(), fi.Mode().String(), n)
			assert.Equal(t, []uint32{w.uid, w.gid}, []uint32{st.Uid, st.Gid}, n)
		}
	}
	check("7", false)
	// The set-user-ID bit is kept and shown, never honoured: the mount is nosuid and nodev, so a
	// peer or a backup naming a root-owned setuid file grants nothing.
	var sfs unix.Statfs_t
	require.NoError(t, unix.Statfs(dir, &sfs))
	assert.NotZero(t, sfs.Flags&unix.ST_NOSUID, "mount flags %#x: want nosuid", sfs.Flags)
	assert.NotZero(t, sfs.Flags&unix.ST_NODEV, "mount flags %#x: want nodev", sfs.Flags)

	sealed := filepath.Join(spool.Dir(), "sealed")
	info, err := ns.Seal("7", sealed)
	require.NoError(t, err)
	require.NotNil(t, info.Attrs)
	assert.Equal(t, "mtcfs attrs v1\ndefault 1000 1000 0600 0700\n"+
		"0755 1000 1000 \"caf\\xe9\"\n0711 1000 1000 \"caf\\xe9/sub\\xff\"\n"+
		"0620 1000 1000 \"fifo\"\n0600 1000 2000 \"other-group\"\n0640 0 0 \"root-owned\"\n"+
		"0750 1000 1000 \"state\"\n4755 1000 1000 \"state/setuid\"\n0644 1000 1000 \"state/shared\"\n",
		string(info.Attrs.Encode()), "listed: what differs from the top's owner and mode (files: without x)")

	// Without the record, the agent's defaults (what an earlier agent's data restores with).
	require.NoError(t, ns.Import(sealed, "plain"))
	check("plain", true)
	// With it, what the job saved.
	require.NoError(t, layout.WriteAttrs(sealed, info.Attrs))
	require.NoError(t, ns.Import(sealed, "kept"))
	check("kept", false)

	// Given to a job running as another user: what the saved top's owner owned is theirs;
	// other owners, every group and every mode stay.
	uid, gid, err := ns.Owner("kept")
	require.NoError(t, err)
	assert.Equal(t, []uint32{1000, 1000}, []uint32{uid, gid})
	saved := maps.Clone(entries)
	given := func(to uint32) {
		t.Helper()
		for n, w := range saved {
			if w.uid == 1000 {
				w.uid = to
			}
			entries[n] = w
		}
	}
	n, err := ns.Reown("kept", info.Attrs, 3000)
	require.NoError(t, err)
	assert.Equal(t, 11, n, "every entry but the root-owned one (caf\\xe9 included)")
	given(3000)
	check("kept", false)
	assert.Equal(t, want{0o600, 3000, 2000}, entries["7/other-group"])
	assert.Equal(t, want{0o640, 0, 0}, entries["7/root-owned"])
	// Given to root, then back to the saving user: each time from what was saved, not from the
	// owners the last job had (root's own file stays root's, the others come back to 1000).
	_, err = ns.Reown("kept", info.Attrs, 0)
	require.NoError(t, err)
	given(0)
	check("kept", false)
	n, err = ns.Reown("kept", info.Attrs, 1000)
	require.NoError(t, err)
	assert.Equal(t, 11, n)
	given(1000)
	check("kept", false)
	assert.Equal(t, want{0o640, 0, 0}, entries["7/root-owned"])

	// A single-file checkpoint.
	require.NoError(t, os.WriteFile(p("single"), []byte("x"), 0o600))
	require.NoError(t, os.Chown(p("single"), 1000, 1001))
	file := filepath.Join(spool.Dir(), "single.data")
	info, err = ns.Seal("single", file)
	require.NoError(t, err)
	require.NoError(t, layout.WriteAttrs(file, info.Attrs))
	require.NoError(t, ns.Import(file, "single-kept"))
	fi, err := os.Stat(p("single-kept"))
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o600), fi.Mode())
	assert.Equal(t, []uint32{1000, 1001}, []uint32{fi.Sys().(*syscall.Stat_t).Uid, fi.Sys().(*syscall.Stat_t).Gid})
}
