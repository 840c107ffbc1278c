package layout

import (
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"golang.org/x/sys/unix"
)

// withOpener runs f once with files opened one by one and once through rings, and fails if the
// ring run set up no ring (where the kernel or a seccomp profile refuses io_uring, the test says
// so and runs the plain half only).
func withOpener(t *testing.T, f func(t *testing.T, ring bool)) {
	t.Helper()
	from := ringFrom
	t.Cleanup(func() { ringFrom = from })
	ringFrom = math.MaxInt
	t.Run("plain", func(t *testing.T) { f(t, false) })
	ringFrom = from
	if r, err := newRing(2); err != nil {
		if errors.Is(err, unix.EPERM) || errors.Is(err, unix.ENOSYS) {
			t.Logf("io_uring unavailable here (%v): only plain opens tested", err)
			return
		}
		t.Fatalf("newRing: %v", err)
	} else {
		r.release()
	}
	t.Run("ring", func(t *testing.T) {
		made := ringsMade.Load()
		f(t, true)
		if ringsMade.Load() == made {
			t.Fatal("no ring was set up")
		}
	})
}

// openFDs counts this process's open descriptors.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// ringTree lowers ringFrom for the test, writes a tree of more files than that (sizes around the
// read buffer, some empty, one below a path longer than PATH_MAX) and returns its root and its
// hash.
func ringTree(t *testing.T) (string, string) {
	t.Helper()
	from := ringFrom
	ringFrom = 64
	t.Cleanup(func() { ringFrom = from })
	root := t.TempDir()
	sizes := []int64{0, 1, 4096, hashBufSize - 1, hashBufSize, hashBufSize + 1, 3*hashBufSize + 5}
	for i := range 3 * ringFrom {
		dir := filepath.Join(root, fmt.Sprintf("d%d", i%7))
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		size := int64(i % 5000)
		if i < len(sizes) {
			size = sizes[i]
		}
		if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("f%d", i)), randomBytes(uint64(i), size), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	d, err := OpenDir(root)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	var rel string
	for i := 0; len(rel) < unix.PathMax+100; i++ {
		if rel != "" {
			rel += "/"
		}
		rel += strings.Repeat(string(rune('a'+i%26)), 200)
	}
	if err := d.MkdirAll(rel, 0o755); err != nil {
		t.Fatal(err)
	}
	f, err := d.Open(rel+"/deep", os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString("below PATH_MAX's reach")
	f.Close()
	hash, _, err := HashData(t.Context(), root)
	if err != nil {
		t.Fatal(err)
	}
	return root, hash
}

// hashedTree is root's listing with its digests (HashEntries of ListTree).
func hashedTree(t *testing.T, root string) []TreeEntry {
	t.Helper()
	entries, err := ListTree(root)
	if err != nil {
		t.Fatal(err)
	}
	if err := HashEntries(t.Context(), root, entries, nil); err != nil {
		t.Fatal(err)
	}
	return entries
}

// Files opened through rings hash exactly as files opened one by one, for a sized listing
// (HashEntries) and for a restart's unsized one (VerifyListed), and no descriptor stays open.
func TestRingHashesAsPlainOpens(t *testing.T) {
	root, hash := ringTree(t)
	want := hashedTree(t, root)
	withOpener(t, func(t *testing.T, ring bool) {
		fds := openFDs(t)
		sized := hashedTree(t, root)
		unsized, err := ListTreeUnsized(root)
		if err != nil {
			t.Fatal(err)
		}
		if err := VerifyListed(t.Context(), root, unsized, hash, true); err != nil {
			t.Fatalf("VerifyListed: %v", err)
		}
		for i := range want {
			if sized[i] != want[i] || unsized[i] != want[i] {
				t.Fatalf("entry %d: sized %+v, unsized %+v, want %+v", i, sized[i], unsized[i], want[i])
			}
		}
		if got := openFDs(t); got != fds {
			t.Fatalf("%d descriptors open after hashing, %d before", got, fds)
		}
	})
}

// A restart's statless hashing (hashEntries of an unsized listing, no second pass) gives through
// rings the digests and sizes a sized listing's hashing gives.
func TestRingStatlessDigests(t *testing.T) {
	root, _ := ringTree(t)
	want := hashedTree(t, root)
	withOpener(t, func(t *testing.T, ring bool) {
		d, err := OpenDir(root)
		if err != nil {
			t.Fatal(err)
		}
		defer d.Close()
		got, err := d.ListUnsized()
		if err != nil {
			t.Fatal(err)
		}
		if err := d.hashEntries(t.Context(), got, nil, nil, true); err != nil {
			t.Fatal(err)
		}
		for i := range want {
			if got[i] != want[i] {
				t.Fatalf("entry %d: statless %+v, want %+v", i, got[i], want[i])
			}
		}
	})
}

// A ring that refuses its closes (as a kernel without IORING_OP_CLOSE would) or whose
// io_uring_enter starts failing leaks no descriptor and hashes every file right: refused closes
// are done with close(2), and after a failed enter the worker opens and closes files itself.
func TestRingFailuresLeakNothing(t *testing.T) {
	root, _ := ringTree(t)
	want := hashedTree(t, root)
	var enters atomic.Int64
	for _, c := range []struct {
		name  string
		setup func()
	}{
		{"closes refused", func() { closeOp = 250 }},
		{"first enter fails", func() { enterErr = func() unix.Errno { return unix.EPERM } }},
		{"later enters fail", func() {
			enters.Store(0)
			enterErr = func() unix.Errno {
				if enters.Add(1) > 5 {
					return unix.EPERM
				}
				return 0
			}
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Cleanup(func() { closeOp, enterErr = uringOpClose, nil })
			c.setup()
			made := ringsMade.Load()
			fds := openFDs(t)
			got := hashedTree(t, root)
			if ringsMade.Load() == made {
				t.Fatal("no ring was set up")
			}
			for i := range want {
				if got[i] != want[i] {
					t.Fatalf("entry %d: %+v, want %+v", i, got[i], want[i])
				}
			}
			if n := openFDs(t); n != fds {
				t.Fatalf("%d descriptors open after hashing, %d before", n, fds)
			}
		})
	}
}

// A file that is not what the listing says fails the same way through rings as through plain
// opens (the ring's failed open is redone by the plain call, whose error is reported), and the
// descriptors of the rest of the batch are closed.
func TestRingErrorsAsPlainOpens(t *testing.T) {
	root, _ := ringTree(t)
	entries, err := ListTree(root)
	if err != nil {
		t.Fatal(err)
	}
	victim := filepath.Join(root, "d3", fmt.Sprintf("f%d", 3+7*20))
	for _, c := range []struct {
		name   string
		change func() error
	}{
		{"missing", func() error { return os.Remove(victim) }},
		{"symlink", func() error { return os.Symlink("f3", victim) }},
		{"fifo", func() error { return unix.Mkfifo(victim, 0o644) }},
		{"directory", func() error { return os.Mkdir(victim, 0o755) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			orig, err := os.ReadFile(victim)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.Remove(victim); err != nil {
				t.Fatal(err)
			}
			if err := c.change(); err != nil && !errors.Is(err, os.ErrNotExist) {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				os.Remove(victim)
				if err := os.WriteFile(victim, orig, 0o644); err != nil {
					t.Fatal(err)
				}
			})
			var msgs [2]string
			withOpener(t, func(t *testing.T, ring bool) {
				fds := openFDs(t)
				listing := append([]TreeEntry(nil), entries...)
				err := HashEntries(t.Context(), root, listing, nil)
				if err == nil {
					t.Fatalf("HashEntries of a tree with a %s where a file was listed: no error", c.name)
				}
				if !strings.Contains(err.Error(), "d3/f143") {
					t.Errorf("the error does not name the file: %v", err)
				}
				msgs[map[bool]int{false: 0, true: 1}[ring]] = err.Error()
				if got := openFDs(t); got != fds {
					t.Fatalf("%d descriptors open after a failed hashing, %d before", got, fds)
				}
			})
			if msgs[1] != "" && msgs[0] != msgs[1] {
				t.Fatalf("plain opens fail with %q, rings with %q", msgs[0], msgs[1])
			}
		})
	}
}

// Where no ring can be set up (a seccomp profile refusing io_uring_setup, as container runtimes'
// default profiles do), files are opened one by one.
func TestNoRingFallsBack(t *testing.T) {
	root, hash := ringTree(t)
	var asked atomic.Int32
	newRingHook = func(uint32) (*ring, error) { asked.Add(1); return nil, unix.EPERM }
	t.Cleanup(func() { newRingHook = nil })
	listing, err := ListTreeUnsized(root)
	if err != nil {
		t.Fatal(err)
	}
	if err := VerifyListed(t.Context(), root, listing, hash, true); err != nil {
		t.Fatal(err)
	}
	if asked.Load() == 0 {
		t.Fatal("no ring was asked for: the fallback was not exercised")
	}
}
