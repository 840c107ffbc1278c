package tiers_test

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"
	"unicode/utf8"

	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/tiers"
)

// TestSpoolOwnerRecorded: a spool opened for a mount path records it (resolved), the agent's
// pid and when it was used; SetRunning records the job; a later agent sees the previous job.
func TestSpoolOwnerRecorded(t *testing.T) {
	for _, tmpfs := range []bool{false, true} {
		name := "plain"
		if tmpfs {
			name = "tmpfs"
		}
		t.Run(name, func(t *testing.T) {
			if tmpfs && os.Geteuid() != 0 {
				t.Skip("needs root to mount a tmpfs")
			}
			base := t.TempDir()
			mnt, link, dir := filepath.Join(base, "mnt"), filepath.Join(base, "link"), filepath.Join(base, "spool")
			mustMkdir(t, mnt)
			mustSymlink(t, "mnt", link)
			t.Cleanup(func() { unmountAll(dir) })

			before := time.Now().Add(-time.Second)
			s := openOwned(t, dir, link, tmpfs)
			o, err := tiers.ReadOwner(dir)
			if err != nil {
				t.Fatalf("ReadOwner: %v", err)
			}
			if o.MountPath != mnt || o.Job != "" || o.PID != os.Getpid() || o.LastUsed.Before(before) {
				t.Fatalf("owner after open = %+v, want mount %s, no job, pid %d, used after %v", o, mnt, os.Getpid(), before)
			}
			if got := s.Owner(); !reflect.DeepEqual(got, o) {
				t.Fatalf("Owner() = %+v, file says %+v", got, o)
			}
			if err := s.SetRunning("llama", tiers.Running{Incarnation: "first"}); err != nil {
				t.Fatalf("SetRunning: %v", err)
			}
			o2, err := tiers.ReadOwner(dir)
			if err != nil || o2.Job != "llama" || o2.MountPath != mnt || o2.LastUsed.Before(o.LastUsed) {
				t.Fatalf("owner after SetRunning = %+v, %v; want job llama, mount %s", o2, err, mnt)
			}
			// The job's shape at its restore plan: what a job of another shape passes over.
			shape := tiers.Shape{Nodes: 3, Workers: 1, DataParallelism: 3}
			if err := s.SetShape(shape); err != nil {
				t.Fatalf("SetShape: %v", err)
			}
			if got := s.SavedShape(); got != shape {
				t.Fatalf("SavedShape after SetShape = %v, want %v", got, shape)
			}
			// The incarnation the agent answers: the next agent knows it stopped under it.
			run := tiers.Running{Incarnation: "abc", Rank: 2, Nodes: 3, Since: time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)}
			if err := s.SetRunning("llama", run); err != nil {
				t.Fatalf("SetRunning: %v", err)
			}
			noTempFiles(t, dir)
			if err := s.Detach(); err != nil {
				t.Fatalf("Detach: %v", err)
			}

			// The next agent on the mount sees which job the data belongs to, and which of its
			// incarnations the agent before answered.
			s2 := openOwned(t, dir, mnt, tmpfs)
			if got := s2.Owner(); got.Job != "llama" || got.MountPath != mnt || s2.SavedShape() != shape || got.Running == nil || *got.Running != run {
				t.Fatalf("reopened spool's owner = %+v, shape %v; want the previous job llama on %s, of shape %v, running %+v", got, s2.SavedShape(), mnt, shape, run)
			}
			if o, _ := tiers.ReadOwner(dir); o.Running == nil || *o.Running != run {
				t.Fatalf("the reopened spool's record lost the running incarnation: %+v", o)
			}
			// Its restore markers published: recorded, for that incarnation only.
			if err := s2.MarkRestored("not-abc"); err != nil || s2.Owner().Running.Restored {
				t.Fatalf("MarkRestored of another incarnation: %v, owner %+v; want nothing recorded", err, s2.Owner().Running)
			}
			if err := s2.MarkRestored("abc"); err != nil {
				t.Fatal(err)
			}
			if o, _ := tiers.ReadOwner(dir); o.Running == nil || !o.Running.Restored || o.Running.Incarnation != "abc" {
				t.Fatalf("after MarkRestored the record says %+v, want abc restored", o.Running)
			}
			if err := s2.SetRunning("llama", run); err != nil || s2.SavedShape() != shape {
				t.Fatalf("SetRunning of the same job: %v; shape %v, want it kept", err, s2.SavedShape())
			}
			if o, _ := tiers.ReadOwner(dir); o.Running == nil || o.Running.Restored {
				t.Fatalf("a new incarnation is not restored yet: %+v", o.Running)
			}
			if err := s2.SetRunning("other", run); err != nil {
				t.Fatal(err)
			}
			if o3, _ := tiers.ReadOwner(dir); o3.Job != "other" || s2.SavedShape() != (tiers.Shape{}) {
				t.Fatalf("owner after the second SetRunning = %+v, shape %v; want job other and no shape (llama's says nothing of it)", o3, s2.SavedShape())
			}
			// Until other's shape replaces it (its negotiation succeeded), llama's record stays
			// for llama: a rank started once with a mistyped job-name forgot it.
			if !fileThere(filepath.Join(dir, tiers.ShapeFile)) {
				t.Fatal("llama's shape record was removed by another job's handshake")
			}
			if err := s2.SetRunning("llama", run); err != nil || s2.SavedShape() != shape {
				t.Fatalf("llama back: %v; shape %v, want %v", err, s2.SavedShape(), shape)
			}
			if err := s2.SetRunning("other", run); err != nil {
				t.Fatal(err)
			}
			other := tiers.Shape{Nodes: 4, Workers: 1}
			if err := s2.SetShape(shape); err != nil || s2.SavedShape() != shape {
				t.Fatalf("other's shape, the same as llama's: %v; shape %v", err, s2.SavedShape())
			}
			if err := s2.SetShape(other); err != nil || s2.SavedShape() != other {
				t.Fatalf("other's shape: %v; shape %v", err, s2.SavedShape())
			}
			if err := s2.SetRunning("llama", run); err != nil || s2.SavedShape() != (tiers.Shape{}) {
				t.Fatalf("llama after other's shape replaced its own: %v; shape %v, want none", err, s2.SavedShape())
			}
			noTempFiles(t, dir)
			if err := s2.Close(); err != nil {
				t.Fatal(err)
			}
			if _, err := tiers.ReadOwner(dir); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("ReadOwner of a discarded spool: %v, want not-exist", err)
			}
		})
	}
}

// TestSpoolLockedWhileOpen: an owned spool is locked while open, so a second agent and mtcfs
// spool commands see it in use; Detach and Close release it.
func TestSpoolLockedWhileOpen(t *testing.T) {
	mnt, dir := spoolDirs(t, false)
	s := openOwned(t, dir, mnt, false)
	if f, err := tiers.LockSpool(dir); !errors.Is(err, tiers.ErrSpoolInUse) {
		if f != nil {
			f.Close()
		}
		t.Fatalf("LockSpool of an open spool: %v, want ErrSpoolInUse", err)
	}
	_, err := tiers.OpenSpool(tiers.SpoolConfig{Dir: dir, Budget: 64 << 20, MountPath: mnt})
	if err == nil || !strings.Contains(err.Error(), "in use") || !strings.Contains(err.Error(), mnt) {
		t.Fatalf("second OpenSpool of an open spool: %v, want an in-use error naming %s", err, mnt)
	}
	if err := s.Detach(); err != nil {
		t.Fatal(err)
	}
	f, err := tiers.LockSpool(dir)
	if err != nil {
		t.Fatalf("LockSpool after Detach: %v", err)
	}
	f.Close()
	s2 := openOwned(t, dir, mnt, false)
	if err := s2.Close(); err != nil {
		t.Fatal(err)
	}
}

// TestSpoolWithoutMountPath: an anonymous spool (tests, tools) records nothing and locks
// nothing.
func TestSpoolWithoutMountPath(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "spool")
	s, err := tiers.OpenSpool(tiers.SpoolConfig{Dir: dir, Budget: 64 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, err := tiers.ReadOwner(dir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("ReadOwner of an anonymous spool: %v, want not-exist", err)
	}
	if err := s.SetRunning("j", tiers.Running{}); err == nil {
		t.Fatal("SetRunning on an anonymous spool succeeded")
	}
	f, err := tiers.LockSpool(dir)
	if err != nil {
		t.Fatalf("LockSpool of an anonymous spool: %v", err)
	}
	f.Close()
}

// TestResolveMountPath: symlinks anywhere in the path are resolved; paths that do not exist
// come back absolute.
func TestResolveMountPath(t *testing.T) {
	base, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	real := filepath.Join(base, "a", "mnt")
	mustMkdir(t, real)
	mustSymlink(t, real, filepath.Join(base, "abs"))           // absolute target
	mustSymlink(t, "a/mnt", filepath.Join(base, "rel"))        // relative target
	mustSymlink(t, "rel", filepath.Join(base, "chain"))        // a link to a link
	mustSymlink(t, "a", filepath.Join(base, "dirlink"))        // a link in the parent
	mustSymlink(t, "../a/mnt", filepath.Join(base, "a", "up")) // ".." in the target
	mustSymlink(t, "nowhere", filepath.Join(base, "dangling")) // target missing
	mustSymlink(t, "a/mnt", filepath.Join(base, "mntlink"))
	mustSymlink(t, "mntlink/../mnt", filepath.Join(base, "dotdot")) // ".." after a link: base/a/mnt, not base/mnt
	mustSymlink(t, "loop", filepath.Join(base, "loop"))
	t.Chdir(base)
	cases := map[string]string{
		real:                                  real,
		"a/mnt":                               real,
		filepath.Join(base, "abs"):            real,
		filepath.Join(base, "rel"):            real,
		filepath.Join(base, "chain"):          real,
		filepath.Join(base, "dirlink", "mnt"): real,
		"dirlink/mnt/":                        real,
		filepath.Join(base, "a", "up"):        real,
		filepath.Join(base, "dotdot"):         real,
		filepath.Join(base, "missing"):        filepath.Join(base, "missing"),
		"missing/deeper":                      filepath.Join(base, "missing", "deeper"),
		filepath.Join(base, "dangling"):       filepath.Join(base, "nowhere"),
		filepath.Join(base, "loop"):           filepath.Join(base, "loop"),
		"/":                                   "/",
	}
	for in, want := range cases {
		if got := tiers.ResolveMountPath(in); got != want {
			t.Errorf("ResolveMountPath(%q) = %q, want %q", in, got, want)
		}
	}
	if a, b := tiers.DefaultSpoolDir(filepath.Join(base, "abs")), tiers.DefaultSpoolDir(real); a != b {
		t.Errorf("default spool through a symlink %s differs from the real directory's %s", a, b)
	}
	if a, b := tiers.DefaultSpoolDir(real), tiers.DefaultSpoolDir(filepath.Join(base, "a")); a == b {
		t.Errorf("two mount paths share the default spool %s", a)
	}
	if d := tiers.DefaultSpoolDir(real); filepath.Dir(d) != tiers.DefaultSpoolRoot() || !strings.HasPrefix(filepath.Base(d), "mnt-") {
		t.Errorf("DefaultSpoolDir(%s) = %s, want %s/mnt-<hash>", real, d, tiers.DefaultSpoolRoot())
	}
	// A mount directory with a 255-byte name: the spool's name stays within NAME_MAX, and two
	// such directories that differ past the kept part still differ.
	long1, long2 := filepath.Join(base, strings.Repeat("x", 254)+"1"), filepath.Join(base, strings.Repeat("x", 254)+"2")
	d1, d2 := tiers.DefaultSpoolDir(long1), tiers.DefaultSpoolDir(long2)
	if len(filepath.Base(d1)) > 255 || d1 == d2 {
		t.Errorf("DefaultSpoolDir of 255-byte names: %s (%d bytes), %s", filepath.Base(d1), len(filepath.Base(d1)), filepath.Base(d2))
	}
	// A 242-byte name, which worked before the cut, keeps its spool's name; a cut never splits a
	// character.
	if d := filepath.Base(tiers.DefaultSpoolDir(filepath.Join(base, strings.Repeat("y", 242)))); !strings.HasPrefix(d, strings.Repeat("y", 242)+"-") || len(d) != 255 {
		t.Errorf("DefaultSpoolDir of a 242-byte name: %s", d)
	}
	if d := filepath.Base(tiers.DefaultSpoolDir(filepath.Join(base, strings.Repeat("é", 127)))); !utf8.ValidString(d) || len(d) > 255 {
		t.Errorf("DefaultSpoolDir of a 254-byte UTF-8 name: %q (%d bytes)", d, len(d))
	}
}

func openOwned(t *testing.T, dir, mountPath string, tmpfs bool) *tiers.Spool {
	t.Helper()
	s, err := tiers.OpenSpool(tiers.SpoolConfig{Dir: dir, Budget: 64 << 20, MountTmpfs: tmpfs, MountPath: mountPath})
	if err != nil {
		t.Fatalf("OpenSpool: %v", err)
	}
	return s
}

func fileThere(p string) bool {
	_, err := os.Lstat(p)
	return err == nil
}

// TestSpoolShapeRecordOnAFullSpool: a job that filled its spool (ENOSPC) restarts in another
// shape. The new shape cannot be written there; the old record must not stay, or the agent's
// next start would take every step of the new shape for one of the old and pass it over.
func TestSpoolShapeRecordOnAFullSpool(t *testing.T) {
	mnt, dir := spoolDirs(t, true)
	s := openOwned(t, dir, mnt, true)
	old := tiers.Shape{Nodes: 4, Workers: 1}
	if err := s.SetShape(old); err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(filepath.Join(s.FilesDir(), "fill"))
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1<<20)
	for err == nil {
		_, err = f.Write(buf)
	}
	f.Close()
	if !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("filling the spool: %v, want ENOSPC", err)
	}
	if err := s.SetShape(tiers.Shape{Nodes: 2, Workers: 1}); err == nil {
		t.Fatal("SetShape on a full spool succeeded")
	}
	if got := s.SavedShape(); got != (tiers.Shape{}) {
		t.Errorf("SavedShape after a failed SetShape = %v, want none", got)
	}
	if fileThere(filepath.Join(dir, tiers.ShapeFile)) {
		t.Errorf("the old shape record %v stayed after a failed SetShape", old)
	}
	if err := s.Detach(); err != nil {
		t.Fatal(err)
	}
	if s2 := openOwned(t, dir, mnt, true); s2.SavedShape() != (tiers.Shape{}) {
		t.Errorf("the next agent reads shape %v, want none", s2.SavedShape())
	} else {
		s2.Close()
	}
}

func noTempFiles(t *testing.T, dir string) {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if strings.Contains(e.Name(), tiers.OwnerFile) && e.Name() != tiers.OwnerFile {
			t.Errorf("temporary file %s left in the spool", e.Name())
		}
	}
}

// spoolDirs returns a new mount directory and the path of a spool for it, not made yet; with
// tmpfs the test needs root (it is skipped otherwise), and the spool's tmpfs is unmounted when it
// ends.
func spoolDirs(t *testing.T, tmpfs bool) (mnt, dir string) {
	t.Helper()
	if tmpfs && os.Geteuid() != 0 {
		t.Skip("needs root to mount a tmpfs")
	}
	base := t.TempDir()
	mnt, dir = filepath.Join(base, "mnt"), filepath.Join(base, "spool")
	mustMkdir(t, mnt)
	if tmpfs {
		t.Cleanup(func() { unmountAll(dir) })
	}
	return mnt, dir
}

func mustMkdir(t *testing.T, p string) {
	t.Helper()
	if err := os.MkdirAll(p, 0o755); err != nil {
		t.Fatal(err)
	}
}

func mustSymlink(t *testing.T, target, link string) {
	t.Helper()
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
}

// unmountAll detaches every mount at p (a test's spool tmpfs), also after a failure.
func unmountAll(p string) {
	for i := 0; i < 8; i++ {
		if unix.Unmount(p, unix.MNT_DETACH) != nil {
			return
		}
	}
}

// TestSpoolTrashWaitsForAdoption: a predecessor's open-ended files are moved aside when the
// spool opens and stay until RemoveTrash (the replicator calls it after adopting); an agent
// that stops before that (a failed start) removes them when it detaches the spool, so that a
// kept spool holds no garbage in RAM.
func TestSpoolTrashWaitsForAdoption(t *testing.T) {
	mnt, dir := spoolDirs(t, true)
	trash := func() int {
		m, err := filepath.Glob(filepath.Join(dir, ".files-trash-*"))
		if err != nil {
			t.Fatal(err)
		}
		return len(m)
	}
	leave := func(s *tiers.Spool) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(s.FilesDir(), "open-ended"), []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := s.Detach(); err != nil {
			t.Fatalf("Detach: %v", err)
		}
	}

	leave(openOwned(t, dir, mnt, true))
	s := openOwned(t, dir, mnt, true)
	if ents, _ := os.ReadDir(s.FilesDir()); len(ents) != 0 {
		t.Fatalf("files dir after open holds %d entries, want none", len(ents))
	}
	time.Sleep(50 * time.Millisecond)
	if n := trash(); n != 1 {
		t.Fatalf("%d trash directories before RemoveTrash, want 1 (removed during the adoption?)", n)
	}
	if err := s.Detach(); err != nil { // an agent that failed to start
		t.Fatalf("Detach: %v", err)
	}
	if n := trash(); n != 0 {
		t.Fatalf("%d trash directories left in a kept spool after Detach", n)
	}

	leave(openOwned(t, dir, mnt, true))
	s = openOwned(t, dir, mnt, true)
	s.RemoveTrash()
	deadline := time.Now().Add(10 * time.Second)
	for trash() != 0 {
		if time.Now().After(deadline) {
			t.Fatal("RemoveTrash left the predecessor's files")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
}

// TestRoundUpBudget: the --memory a refused restart advises is one to type: whole MiB, and from
// 1 GiB on whole GiB (before, 2 × 3.3 GiB held read "--memory 6.6005859375GiB or more").
func TestRoundUpBudget(t *testing.T) {
	for _, c := range []struct{ n, want int64 }{
		{1, 1 << 20}, {81 << 20, 81 << 20}, {80<<20 + 1, 81 << 20},
		{1 << 30, 1 << 30}, {1<<30 + 1, 2 << 30}, {6759 << 20, 7 << 30},
	} {
		if got := tiers.RoundUpBudget(c.n); got != c.want {
			t.Errorf("RoundUpBudget(%d) = %s, want %s", c.n, tiers.FormatSize(got), tiers.FormatSize(c.want))
		}
	}
}

// TestShapeRecordOutdated: the shape record is of the job that wrote it, and says nothing once
// an agent that keeps no shape records (one before them, which also drops the owner record's
// running incarnation) answered on the spool. A job that changed its shape under such an agent
// had its new steps freed by the next agent, as of the old shape; a job of another name was
// given the record (found by a black-box run of mixed versions).
func TestShapeRecordOutdated(t *testing.T) {
	base := t.TempDir()
	mnt, dir := filepath.Join(base, "mnt"), filepath.Join(base, "spool")
	mustMkdir(t, mnt)
	shape := tiers.Shape{Nodes: 2, Workers: 1}
	s := openOwned(t, dir, mnt, false)
	if err := s.SetRunning("llama", tiers.Running{Incarnation: "first"}); err != nil {
		t.Fatal(err)
	}
	if err := s.SetShape(shape); err != nil {
		t.Fatal(err)
	}
	// The job restarts under another name (one rank's typo): the record stays for llama.
	if err := s.SetRunning("other", tiers.Running{Incarnation: "second"}); err != nil {
		t.Fatal(err)
	}
	if err := s.Detach(); err != nil {
		t.Fatal(err)
	}
	s = openOwned(t, dir, mnt, false)
	if got := s.SavedShape(); got != (tiers.Shape{}) {
		t.Fatalf("reopened with job other recorded: shape %v, want none (llama's)", got)
	}
	if err := s.SetRunning("llama", tiers.Running{Incarnation: "third"}); err != nil || s.SavedShape() != shape {
		t.Fatalf("llama back: %v, shape %v, want %v", err, s.SavedShape(), shape)
	}
	if err := s.Detach(); err != nil {
		t.Fatal(err)
	}

	// An earlier agent answers llama (of one node now): it rewrites the owner record without
	// the running incarnation, and leaves the shape record as it was.
	var o map[string]any
	data, err := os.ReadFile(filepath.Join(dir, tiers.OwnerFile))
	if err == nil {
		err = json.Unmarshal(data, &o)
	}
	if err != nil {
		t.Fatal(err)
	}
	delete(o, "running")
	data, _ = json.Marshal(o)
	if err := os.WriteFile(filepath.Join(dir, tiers.OwnerFile), data, 0o600); err != nil {
		t.Fatal(err)
	}
	s = openOwned(t, dir, mnt, false)
	defer s.Detach()
	if got := s.SavedShape(); got != (tiers.Shape{}) {
		t.Fatalf("after an earlier agent answered: shape %v, want none (outdated)", got)
	}
}
