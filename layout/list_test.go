package layout

import (
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The listing (several goroutines over subdirectories) gives what a walk on one thread gives:
// every entry once with its type, size and target, each directory right before its own
// entries, and the digest key of each file from its own stat.
func TestListMatchesAWalk(t *testing.T) {
	root := t.TempDir()
	rng := rand.New(rand.NewPCG(7, 7))
	var mk func(dir string, depth int)
	mk = func(dir string, depth int) {
		for i := range 2 + rng.IntN(6) {
			p := filepath.Join(dir, fmt.Sprintf("n%d", i))
			switch k := rng.IntN(5); {
			case k == 0 && depth < 4:
				if err := os.Mkdir(p, 0o755); err != nil {
					t.Fatal(err)
				}
				mk(p, depth+1)
			case k == 1:
				if err := os.Symlink(fmt.Sprintf("target-%d", rng.IntN(100)), p); err != nil {
					t.Fatal(err)
				}
			default:
				if err := os.WriteFile(p, make([]byte, rng.IntN(100)), 0o644); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	for i := range 30 {
		d := filepath.Join(root, fmt.Sprintf("d%d", i))
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
		mk(d, 0)
	}
	if err := os.WriteFile(filepath.Join(root, "top"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}

	var want []string
	wantKey := map[string]digestKey{}
	err := filepath.WalkDir(root, func(p string, de fs.DirEntry, err error) error {
		if err != nil || p == root {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		info, err := os.Lstat(p)
		if err != nil {
			return err
		}
		desc := rel + " " + info.Mode().Type().String()
		switch {
		case info.Mode().IsRegular():
			desc += fmt.Sprint(" ", info.Size())
			wantKey[rel], _ = digestKeyOf(info)
		case info.Mode().Type() == fs.ModeSymlink:
			tgt, _ := os.Readlink(p)
			desc += " " + tgt
		}
		want = append(want, desc)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}

	d, err := OpenDir(root)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	entries, keys, err := d.listKeyed()
	if err != nil {
		t.Fatal(err)
	}
	if len(keys) != len(entries) {
		t.Fatalf("%d keys for %d entries", len(keys), len(entries))
	}
	var got []string
	seen := map[string]int{} // directory -> index
	for i, e := range entries {
		desc := e.Path + " " + map[EntryType]os.FileMode{EntryFile: 0, EntryDir: fs.ModeDir, EntrySymlink: fs.ModeSymlink}[e.Type].String()
		switch e.Type {
		case EntryFile:
			desc += fmt.Sprint(" ", e.Size)
			if keys[i] != wantKey[e.Path] {
				t.Errorf("%s: key %+v, want %+v", e.Path, keys[i], wantKey[e.Path])
			}
		case EntrySymlink:
			desc += " " + e.Target
		}
		if e.Type != EntryFile && keys[i] != (digestKey{}) {
			t.Errorf("%s: a %v with a digest key", e.Path, e.Type)
		}
		got = append(got, desc)
		if parent := path.Dir(e.Path); parent != "." {
			j, ok := seen[parent]
			if !ok {
				t.Fatalf("%s listed before its directory", e.Path)
			}
			// Everything between the parent and this entry lies below the parent.
			for _, between := range entries[j+1 : i] {
				if !isBelow(between.Path, parent) {
					t.Fatalf("%s listed apart from its directory %s (%s between)", e.Path, parent, between.Path)
				}
			}
		}
		if e.Type == EntryDir {
			seen[e.Path] = i
		}
	}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("listing differs from the walk:\n got %q\nwant %q", got, want)
	}

}

func isBelow(p, dir string) bool {
	return len(p) > len(dir) && p[:len(dir)] == dir && p[len(dir)] == '/'
}

// VerifyListed, given the listing a caller built something from, decides as VerifyData does.
func TestVerifyListedAgreesWithVerifyData(t *testing.T) {
	root := t.TempDir()
	for i := range 40 {
		p := filepath.Join(root, fmt.Sprintf("d%d", i%4), fmt.Sprintf("f%d", i))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, randomBytes(uint64(i), int64(100+i*500)), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	hash, dir, err := HashData(t.Context(), root)
	if err != nil || !dir {
		t.Fatal(err, dir)
	}
	entries, err := ListTree(root)
	if err != nil {
		t.Fatal(err)
	}
	if err := VerifyListed(t.Context(), root, entries, hash, true); err != nil {
		t.Fatalf("a tree against its own hash: %v", err)
	}
	for _, e := range entries {
		if e.Type == EntryFile && e.Digest == (FileDigest{}) {
			t.Fatalf("%s: no digest filled in", e.Path)
		}
	}
	// One byte changed, size kept.
	p := filepath.Join(root, "d1", "f5")
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)/2] ^= 1
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	entries, err = ListTree(root)
	if err != nil {
		t.Fatal(err)
	}
	var listed, full *HashMismatchError
	if err := VerifyListed(t.Context(), root, entries, hash, true); !errors.As(err, &listed) {
		t.Fatalf("VerifyListed of a changed tree: %v, want a mismatch", err)
	}
	if err := VerifyData(t.Context(), root, hash, true); !errors.As(err, &full) {
		t.Fatalf("VerifyData of a changed tree: %v, want a mismatch", err)
	}
	if *listed != *full {
		t.Fatalf("VerifyListed says %+v, VerifyData %+v", *listed, *full)
	}
}

// TreeHash does not depend on the order of its entries, nor on which parents are listed: a
// tree of many entries, shuffled, with some levels of directories left out, hashes as the
// whole sorted listing does.
func TestTreeHashAnyOrderAndImpliedLevels(t *testing.T) {
	var full []TreeEntry
	for i := range 20 {
		a := fmt.Sprintf("a%02d", i)
		full = append(full, TreeEntry{Path: a, Type: EntryDir}, TreeEntry{Path: a + "/b", Type: EntryDir}, TreeEntry{Path: a + "/b/c", Type: EntryDir})
		for j := range 50 {
			full = append(full, TreeEntry{Path: fmt.Sprintf("%s/b/c/f%02d", a, j), Type: EntryFile, Size: int64(j), Digest: FileDigest{byte(i), byte(j)}})
		}
		full = append(full, TreeEntry{Path: a + "/l", Type: EntrySymlink, Target: "b/c/f00"})
	}
	want, err := TreeHash(full)
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(3, 4))
	for range 5 {
		var some []TreeEntry
		for _, e := range full {
			if e.Type != EntryDir || rng.IntN(2) == 0 { // every directory here holds something
				some = append(some, e)
			}
		}
		rng.Shuffle(len(some), func(i, j int) { some[i], some[j] = some[j], some[i] })
		if got, err := TreeHash(some); err != nil || got != want {
			t.Fatalf("shuffled, %d of %d entries: %s, %v; want %s", len(some), len(full), got, err, want)
		}
	}
}

// An unsized listing is the sized one with each regular file's Size left at -1 (no stat of it),
// in the same order; TreeHash refuses it until HashEntries has filled the sizes in from the
// files it hashed, and VerifyListed decides on it as on the sized listing, also for a file that
// grew or shrank since the tree's hash was taken.
func TestUnsizedListing(t *testing.T) {
	root := t.TempDir()
	for i := range 30 {
		p := filepath.Join(root, fmt.Sprintf("d%d", i%3), fmt.Sprintf("f%d", i))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, randomBytes(uint64(i), int64(i*300)), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink("d0/f0", filepath.Join(root, "link")); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mkfifo(filepath.Join(root, "d1", "fifo"), 0o644); err != nil {
		t.Fatal(err)
	}
	sized, err := ListTree(root)
	if err != nil {
		t.Fatal(err)
	}
	unsized, err := ListTreeUnsized(root)
	if err != nil {
		t.Fatal(err)
	}
	if len(unsized) != len(sized) {
		t.Fatalf("%d unsized entries, %d sized", len(unsized), len(sized))
	}
	files := 0
	for i, u := range unsized {
		want := sized[i]
		if want.Type == EntryFile {
			files++
			want.Size = -1
		}
		if u != want {
			t.Fatalf("entry %d: unsized %+v, sized %+v", i, u, sized[i])
		}
	}
	if files != 30 {
		t.Fatalf("%d files listed, want 30", files)
	}
	if _, err := TreeHash(unsized); err == nil {
		t.Fatal("TreeHash of a listing without sizes succeeded")
	}
	hash, dir, err := HashData(t.Context(), root)
	if err != nil || !dir {
		t.Fatal(err, dir)
	}
	if err := VerifyListed(t.Context(), root, unsized, hash, true); err != nil {
		t.Fatalf("VerifyListed of an unsized listing against the tree's own hash: %v", err)
	}
	for i, e := range unsized {
		if e.Size != sized[i].Size {
			t.Fatalf("%s: size %d filled in, want %d", e.Path, e.Size, sized[i].Size)
		}
	}
	for _, change := range []func(p string, b []byte) []byte{
		func(p string, b []byte) []byte { return append(b, 'x') }, // grew
		func(p string, b []byte) []byte { return b[:len(b)-1] },   // shrank
	} {
		p := filepath.Join(root, "d1", "f7")
		orig, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, change(p, orig), 0o644); err != nil {
			t.Fatal(err)
		}
		unsized, err := ListTreeUnsized(root)
		if err != nil {
			t.Fatal(err)
		}
		var mismatch *HashMismatchError
		if err := VerifyListed(t.Context(), root, unsized, hash, true); !errors.As(err, &mismatch) {
			t.Fatalf("VerifyListed of a tree with a file of another size: %v, want a mismatch", err)
		}
		if err := os.WriteFile(p, orig, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// hashStatlessFd gives the size and digest hashFile gives, for files below, at and above its one
// read, with the production segment size and with one smaller than the read buffer.
func TestStatlessHashIsHashFile(t *testing.T) {
	for _, seg := range []int64{segmentSize, 2 << 10} {
		t.Run(fmt.Sprintf("segment %d", seg), func(t *testing.T) {
			setSegmentSize(t, seg)
			limit := min(int64(hashBufSize), segmentSize)
			root := t.TempDir()
			for i, size := range []int64{0, 1, 1023, 1024, 1025, 4096, limit - 1, limit, limit + 1, 2 * limit, 2*limit + 1, 3*limit + 7, hashBufSize + 1} {
				p := filepath.Join(root, fmt.Sprintf("f%d", i))
				wantSize, want := writeHashed(t, p, randomBytes(uint64(i), size))
				gotSize, got, err := statlessOf(t, p)
				if err != nil || gotSize != wantSize || got != want {
					t.Errorf("%d bytes: hashStatlessFd = %d, %v, %v; hashFile = %d, %v", size, gotSize, got, err, wantSize, want)
				}
			}
		})
	}
}

// hashStatlessFd reads each byte of a file larger than its one read once: the bytes of that read
// are not read again by the hash of the rest (they were, until this test).
func TestStatlessReadsEachByteOnce(t *testing.T) {
	for _, seg := range []int64{segmentSize, 2 << 10} {
		t.Run(fmt.Sprintf("segment %d", seg), func(t *testing.T) {
			setSegmentSize(t, seg)
			var read atomic.Int64
			pread = func(fd int, p []byte, off int64) (int, error) {
				n, err := unix.Pread(fd, p, off)
				read.Add(int64(max(n, 0)))
				return n, err
			}
			t.Cleanup(func() { pread = unix.Pread })
			limit := min(int64(hashBufSize), segmentSize)
			for i, size := range []int64{limit, limit + 1, 3*limit + 7, 3*hashBufSize + 5} {
				p := filepath.Join(t.TempDir(), "f")
				_, want := writeHashed(t, p, randomBytes(uint64(i), size))
				read.Store(0)
				gotSize, got, err := statlessOf(t, p)
				if err != nil || gotSize != size || got != want {
					t.Fatalf("%d bytes: hashStatlessFd = %d, %v, %v; want %d, %v", size, gotSize, got, err, size, want)
				}
				if n := read.Load(); n != size {
					t.Errorf("%d bytes: hashStatlessFd read %d bytes", size, n)
				}
			}
		})
	}
}

// A read that stops short before a file's end makes hashStatlessFd hash a prefix. VerifyListed
// must not report that as a mismatch: it hashes the tree again with a stat of each file, and
// the listing ends up with the true sizes. A tree that really differs is still a mismatch.
func TestVerifyListedRetriesAShortRead(t *testing.T) {
	root := makeTree(t, []treeNode{{path: "d/a", content: "0123456789"}, {path: "d/b", content: "abcdefgh"}, {path: "e", content: "xyz"}})
	hash := hashDir(t, root)
	short := 0
	old := statlessRead
	statlessRead = func(fd int, p []byte) (int, error) {
		n, err := old(fd, p)
		if n == 10 { // d/a only: half of it
			short++
			return 5, err
		}
		return n, err
	}
	t.Cleanup(func() { statlessRead = old })

	listing, err := ListTreeUnsized(root)
	if err != nil {
		t.Fatal(err)
	}
	if err := VerifyListed(t.Context(), root, listing, hash, true); err != nil {
		t.Fatalf("VerifyListed with a read cut short = %v, want the tree verified on its second pass", err)
	}
	if short != 1 {
		t.Fatalf("the short read was taken %d times, want once (the first pass only)", short)
	}
	sizes := map[string]int64{}
	for _, e := range listing {
		sizes[e.Path] = e.Size
	}
	if sizes["d/a"] != 10 || sizes["d/b"] != 8 || sizes["e"] != 3 {
		t.Fatalf("sizes after the second pass: %v, want d/a 10, d/b 8, e 3", sizes)
	}

	if err := os.WriteFile(filepath.Join(root, "e"), []byte("xyZ"), 0o644); err != nil {
		t.Fatal(err)
	}
	listing, err = ListTreeUnsized(root)
	if err != nil {
		t.Fatal(err)
	}
	var mm *HashMismatchError
	if err := VerifyListed(t.Context(), root, listing, hash, true); !errors.As(err, &mm) {
		t.Fatalf("VerifyListed of a changed tree = %v, want a *HashMismatchError", err)
	}
}

// What is not a regular file where the unsized listing saw one (a FIFO, a directory) fails to
// hash by name, as hashFile's stat says, instead of hashing as empty or blocking.
func TestStatlessRefusesWhatIsNoFile(t *testing.T) {
	root := makeTree(t, []treeNode{{path: "a", content: "x"}, {path: "b", content: "y"}})
	hash := hashDir(t, root)
	for _, c := range []struct {
		name string
		make func(p string) error
	}{
		{"fifo", func(p string) error { return syscall.Mkfifo(p, 0o644) }},
		{"directory", func(p string) error { return os.Mkdir(p, 0o755) }},
	} {
		listing, err := ListTreeUnsized(root)
		if err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(root, "a")
		if err := os.Remove(p); err != nil {
			t.Fatal(err)
		}
		if err := c.make(p); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- VerifyListed(t.Context(), root, listing, hash, true) }()
		select {
		case err := <-done:
			if err == nil || !strings.Contains(err.Error(), "not a regular file") {
				t.Errorf("%s where a file was listed: VerifyListed = %v, want 'not a regular file'", c.name, err)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("%s where a file was listed: VerifyListed blocked for 10 s", c.name)
		}
		if err := os.Remove(p); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// writeHashed writes data to p and returns hashFile's size and digest of it.
func writeHashed(t *testing.T, p string, data []byte) (int64, FileDigest) {
	t.Helper()
	if err := os.WriteFile(p, data, 0o644); err != nil {
		t.Fatal(err)
	}
	size, d, err := hashPath(t.Context(), p, nil)
	if err != nil {
		t.Fatal(err)
	}
	return size, d
}

// statlessOf is hashStatlessFd of the file p.
func statlessOf(t *testing.T, p string) (int64, FileDigest, error) {
	t.Helper()
	fd, err := openRaw(p)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	return hashStatlessFd(t.Context(), p, fd)
}
