package jobsim

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"golang.org/x/sys/unix"
)

// ioChunk is the size of each pwrite when saving and of each read when verifying sequentially.
const ioChunk = 1 << 20

// writeExclusive writes f the way tensorstore and Orbax write checkpoint files: a temporary
// name created with O_EXCL, the bytes written with pwrite in chunks at their offsets, fsync,
// close, then rename onto the final name.
func writeExclusive(path string, f File) error {
	tmp := path + ".__lock"
	fd, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return err
	}
	if err := writeBody(fd, f, true); err != nil {
		fd.Close()
		return fmt.Errorf("write %s: %w", filepath.Base(tmp), err)
	}
	if err := fd.Close(); err != nil {
		return fmt.Errorf("close %s: %w", filepath.Base(tmp), err)
	}
	return os.Rename(tmp, path)
}

// writeDirect writes f in place: open with O_TRUNC, sequential writes, optional fsync, close —
// Python's open(path, "w").write(...), torch.save and the .distcp writer.
func writeDirect(path string, f File, fsync bool) error {
	fd, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return err
	}
	if err := writeBody(fd, f, fsync); err != nil {
		fd.Close()
		return fmt.Errorf("write %s: %w", filepath.Base(path), err)
	}
	return fd.Close()
}

// writeBody writes f's bytes in chunks (pwrite at each chunk's offset) and optionally fsyncs.
func writeBody(fd *os.File, f File, fsync bool) error {
	buf := make([]byte, min(f.Size, ioChunk))
	for off := int64(0); off < f.Size; off += int64(len(buf)) {
		p := buf[:min(int64(len(buf)), f.Size-off)]
		f.fill(p, off)
		if _, err := fd.WriteAt(p, off); err != nil {
			return err
		}
	}
	if fsync {
		return fd.Sync()
	}
	return nil
}

// MismatchError reports the first wrong byte a verification found.
type MismatchError struct {
	File   string // the file, relative to the checkpoint directory (e.g. "20/state/...")
	Offset int64
	Got    byte
	Want   byte
	Read   string // the read that saw it: "sequential read", "pread", "mmap", "read"
}

func (e *MismatchError) Error() string {
	return fmt.Sprintf("%s: byte at offset %d is 0x%02x, want 0x%02x (%s)", e.File, e.Offset, e.Got, e.Want, e.Read)
}

// compareBytes returns a *MismatchError for the first byte where got differs from want; the
// slices start at offset off of the file named label.
func compareBytes(label, read string, off int64, got, want []byte) error {
	if bytes.Equal(got, want) {
		return nil
	}
	for i := range got {
		if got[i] != want[i] {
			return &MismatchError{File: label, Offset: off + int64(i), Got: got[i], Want: want[i], Read: read}
		}
	}
	return nil // unreachable for equal lengths
}

// verifyTree checks that the tree at root (a directory or a symlink to one) holds exactly the
// regular files of want with their sizes, then reads every file back in want's order and
// compares every byte: small fixed files with one read, generated files with large sequential
// reads, then a few preads at pseudo-random offsets; the first of the largest files is also
// read through a shared read-only mmap. label names root in errors, relative to the checkpoint
// directory.
func verifyTree(ctx context.Context, root, label string, want []File) error {
	got, err := listTree(root)
	if err != nil {
		return fmt.Errorf("list %s: %w", label, err)
	}
	var missing, unexpected []string
	wantSet := make(map[string]bool, len(want))
	for _, f := range want {
		wantSet[f.Path] = true
		if _, ok := got[f.Path]; !ok {
			missing = append(missing, f.Path)
		}
	}
	for p := range got {
		if !wantSet[p] {
			unexpected = append(unexpected, p)
		}
	}
	if len(missing) > 0 || len(unexpected) > 0 {
		sort.Strings(unexpected)
		return fmt.Errorf("%s does not hold the expected tree: missing %s; unexpected %s",
			label, summarize(missing), summarize(unexpected))
	}
	mmapIndex := -1 // the first of the largest generated files
	for i, f := range want {
		if f.data == nil && f.Size > 0 && (mmapIndex < 0 || f.Size > want[mmapIndex].Size) {
			mmapIndex = i
		}
	}
	for i, f := range want {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("verify %s: %w", label, err)
		}
		fl := label + "/" + f.Path
		if got[f.Path] != f.Size {
			return fmt.Errorf("%s: size %d, want %d", fl, got[f.Path], f.Size)
		}
		if err := verifyFile(filepath.Join(root, filepath.FromSlash(f.Path)), fl, f, i == mmapIndex); err != nil {
			return err
		}
	}
	return nil
}

func summarize(names []string) string {
	const show = 5
	switch {
	case len(names) == 0:
		return "none"
	case len(names) <= show:
		return strings.Join(names, ", ")
	default:
		return fmt.Sprintf("%s and %d more", strings.Join(names[:show], ", "), len(names)-show)
	}
}

// listTree maps the slash-separated path of every regular file under root to its size. Any
// other kind of entry below root (symlink, device, ...) is an error: checkpoints hold only
// directories and regular files.
func listTree(root string) (map[string]int64, error) {
	out := map[string]int64{}
	var walk func(dir, rel string) error
	walk = func(dir, rel string) error {
		entries, err := os.ReadDir(dir) // follows root if it is a symlink
		if err != nil {
			return err
		}
		for _, e := range entries {
			p := e.Name()
			if rel != "" {
				p = rel + "/" + p
			}
			switch t := e.Type(); {
			case t.IsDir():
				if err := walk(filepath.Join(dir, e.Name()), p); err != nil {
					return err
				}
			case t.IsRegular():
				fi, err := e.Info()
				if err != nil {
					return err
				}
				out[p] = fi.Size()
			default:
				return fmt.Errorf("%s is a %v, want a regular file or directory", p, t)
			}
		}
		return nil
	}
	return out, walk(root, "")
}

// verifyFile reads one file back as a restoring client does and compares every byte.
func verifyFile(path, label string, f File, useMmap bool) error {
	fd, err := os.Open(path)
	if err != nil {
		return err
	}
	defer fd.Close()
	if f.data != nil {
		got, err := io.ReadAll(fd)
		if err != nil {
			return fmt.Errorf("read %s: %w", label, err)
		}
		if int64(len(got)) != f.Size {
			return fmt.Errorf("%s: read %d bytes, want %d", label, len(got), f.Size)
		}
		return compareBytes(label, "read", 0, got, f.data)
	}

	// Large sequential reads, as tensorstore and torch.load stream a file.
	buf := make([]byte, min(max(f.Size, 1), ioChunk))
	want := make([]byte, len(buf))
	for off := int64(0); off < f.Size; {
		n, err := io.ReadFull(fd, buf[:min(int64(len(buf)), f.Size-off)])
		if err != nil {
			return fmt.Errorf("%s: sequential read at offset %d: %w", label, off+int64(n), err)
		}
		f.fill(want[:n], off)
		if err := compareBytes(label, "sequential read", off, buf[:n], want[:n]); err != nil {
			return err
		}
		off += int64(n)
	}
	if n, err := fd.Read(buf[:1]); n != 0 || err != io.EOF {
		return fmt.Errorf("%s: read past the expected size %d returned %d bytes (err %v)", label, f.Size, n, err)
	}

	// Random preads, as a sharded restore reads the pieces it needs.
	rnd := f.gen.seed
	for i := 0; i < 8 && f.Size > 0; i++ {
		rnd = rnd*6364136223846793005 + 1442695040888963407
		off := int64((rnd >> 11) % uint64(f.Size))
		n := min(f.Size-off, int64(1+(rnd>>3)%(64<<10)))
		got, exp := buf[:n], want[:n]
		if _, err := fd.ReadAt(got, off); err != nil {
			return fmt.Errorf("%s: pread of %d bytes at offset %d: %w", label, n, off, err)
		}
		f.fill(exp, off)
		if err := compareBytes(label, "pread", off, got, exp); err != nil {
			return err
		}
	}

	if useMmap {
		return verifyMmap(fd, label, f)
	}
	return nil
}

// verifyMmap maps the whole file read-only and shared (numpy.memmap's mode) and compares it.
func verifyMmap(fd *os.File, label string, f File) error {
	m, err := unix.Mmap(int(fd.Fd()), 0, int(f.Size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return fmt.Errorf("%s: mmap: %w", label, err)
	}
	defer unix.Munmap(m)
	want := make([]byte, min(f.Size, ioChunk))
	for off := int64(0); off < f.Size; off += int64(len(want)) {
		n := min(int64(len(want)), f.Size-off)
		f.fill(want[:n], off)
		if err := compareBytes(label, "mmap", off, m[off:off+n], want[:n]); err != nil {
			return err
		}
	}
	return nil
}
