package gcsbackend

import (
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
)

// localDir is the file:// ObjectStore: object "a/b" is the regular file
// <root>/a/b. It keeps no state besides its root, so any number of goroutines
// and processes may share one directory.
//
// Atomicity: Put writes a temporary file (tempPrefix + random hex) in the
// object's directory, fsyncs it, and renames it onto the name — or, for
// IfAbsent, hard-links it, because link(2) fails atomically when the name
// exists, which is the create-if-absent primitive a rename lacks. The
// directory is fsynced afterwards so the new name survives a crash. Temporary
// files are never listed and their names are not valid object names; a crash
// can leave one behind, which is harmless and which CleanLeftovers removes
// (the name records its writer, see leftovers.go).
//
// CRC32C storage: Put records the CRC32C in the xattr crcXattr together with
// the size and mtime it describes, and Stat/List return it from there (a
// getxattr costs ~0.5 µs; recomputing reads the object, ~5.6 GiB/s from page
// cache on the dev VM and disk speed otherwise — too slow for listing a
// multi-GiB backup). When the xattr is missing (a filesystem without user
// xattrs, or files copied in by other tools) or stale (size or mtime differ:
// the file was rewritten in place), the CRC32C is computed by reading the
// file, and cached in the xattr when possible. A byte flipped on disk without
// touching the mtime (bit rot) is therefore only caught by reading the data:
// Verify with Deep, or Download.
//
// Files are created 0600 and directories 0700: a backup location also holds
// the job's peer secret (SPEC §4), so it is private to the user, like ~/.ssh.
//
// Limitation against GCS: an object and a "directory" prefix cannot share a
// name ("a" and "a/b"); the backup layout never needs that.
type localDir struct {
	root string
	// noXattr makes the store behave as on a filesystem without user xattrs
	// (tests run the conformance suite both ways).
	noXattr bool
}

// LocalRoot returns the directory of a file:// store (ok false for any other store).
func LocalRoot(s ObjectStore) (dir string, ok bool) {
	if l, isLocal := s.(*localDir); isLocal {
		return l.root, true
	}
	return "", false
}

var _ ObjectStore = (*localDir)(nil)

const (
	tempPrefix = ".mtcfs-tmp-"
	crcXattr   = "user.mtcfs.crc32c"
	filePerm   = 0o600
	dirPerm    = 0o700
)

// isTempName reports whether a path segment is a store's temporary file.
func isTempName(seg string) bool { return strings.HasPrefix(seg, tempPrefix) }

func newLocalDir(root string) (*localDir, error) {
	fi, err := os.Stat(root)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		// Created by the first Put, so that reading a mistyped location
		// does not litter the disk.
	case err != nil:
		return nil, fmt.Errorf("backup location %s: %w", root, err)
	case !fi.IsDir():
		return nil, fmt.Errorf("backup location %s: not a directory", root)
	}
	return &localDir{root: root}, nil
}

func (s *localDir) String() string { return fileURL(s.root) }

func (s *localDir) path(name string) string {
	return filepath.Join(s.root, filepath.FromSlash(name))
}

// notFound maps "no such file" (including a path component that is a file)
// to *NotFoundError and passes every other error through.
func notFound(name string, err error) error {
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) {
		return &NotFoundError{Name: name, Err: err}
	}
	return err
}

func (s *localDir) Put(ctx context.Context, req PutRequest) error {
	if err := ValidateName(req.Name); err != nil {
		return err
	}
	if req.Size < 0 {
		return fmt.Errorf("put %s: negative size %d", req.Name, req.Size)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	dst := s.path(req.Name)
	tmp, crc, err := s.writeTemp(ctx, dst, req)
	if err != nil {
		return fmt.Errorf("put %s: %w", req.Name, err)
	}
	if req.IfAbsent {
		err = os.Link(tmp, dst)
		os.Remove(tmp)
		if errors.Is(err, fs.ErrExist) {
			return s.sameOrConflict(ctx, req.Name, req.Size, crc)
		}
	} else if err = os.Rename(tmp, dst); err != nil {
		os.Remove(tmp)
	}
	if err != nil {
		return fmt.Errorf("put %s: %w", req.Name, err)
	}
	if err := syncDir(filepath.Dir(dst)); err != nil {
		return fmt.Errorf("put %s: %w", req.Name, err)
	}
	return nil
}

// PutFile stores t.File through Put, reading it once: the CRC32C it returns
// is the one of the bytes as they streamed to the store, which computes and
// keeps its own. A file longer than t.Size fails Put's size check.
func (s *localDir) PutFile(ctx context.Context, t FileTransfer) (uint32, error) {
	t = t.withRequests()
	h := crc32.New(crcTable)
	body := &countingReader{r: io.TeeReader(io.NewSectionReader(t.File, 0, t.Size+1), h), report: t.progressOf()}
	err := t.request(ctx, func() error { return s.Put(ctx, PutRequest{Name: t.Name, Body: body, Size: t.Size, IfAbsent: true}) })
	return h.Sum32(), err
}

// GetFile copies the object into t.File in one stream.
func (s *localDir) GetFile(ctx context.Context, t FileTransfer) (int64, uint32, error) {
	t = t.withRequests()
	var n int64
	var crc uint32
	err := t.request(ctx, func() error {
		a, err := s.Stat(ctx, t.Name)
		if err != nil {
			return err
		}
		if a.Size != t.Size {
			return fmt.Errorf("%s has %d bytes, want %d", t.Name, a.Size, t.Size)
		}
		r, err := s.Open(ctx, t.Name, 0, -1)
		if err != nil {
			return err
		}
		defer r.Close()
		// One byte more than expected shows a file that grew meanwhile.
		n, crc, err = copyCRC(ctx, io.NewOffsetWriter(t.File, 0), &countingReader{r: io.LimitReader(r, t.Size+1), report: t.progressOf()})
		return err
	})
	return n, crc, err
}

// writeTemp streams req.Body into a new temporary file beside dst, checks size
// and CRC32C, records the CRC32C and makes the file durable. On error the
// temporary file is gone.
func (s *localDir) writeTemp(ctx context.Context, dst string, req PutRequest) (tmp string, crc uint32, err error) {
	f, err := createTemp(filepath.Dir(dst))
	if err != nil {
		return "", 0, err
	}
	name := f.Name() // not tmp: error returns clear it before the defer runs
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(name)
		}
	}()
	n, crc, err := copyCRC(ctx, f, io.LimitReader(req.Body, req.Size))
	if err != nil {
		return "", 0, err
	}
	if n != req.Size {
		return "", 0, fmt.Errorf("body ended after %d of %d bytes", n, req.Size)
	}
	var extra [1]byte
	if m, _ := io.ReadFull(req.Body, extra[:]); m > 0 {
		return "", 0, fmt.Errorf("body is longer than the announced %d bytes", req.Size)
	}
	if req.CRC32C != nil && *req.CRC32C != crc {
		return "", 0, &ChecksumError{Name: req.Name, Want: *req.CRC32C, Got: crc}
	}
	fi, err := f.Stat()
	if err != nil {
		return "", 0, err
	}
	s.storeCRC(name, crc, fi) // the xattr follows the inode through rename/link
	if err := f.Sync(); err != nil {
		return "", 0, err
	}
	if err := f.Close(); err != nil {
		return "", 0, err
	}
	return name, crc, nil
}

// createTemp creates an unused temporary file in dir, creating dir if needed.
// It retries because a concurrent Delete may prune dir the moment it exists.
func createTemp(dir string) (*os.File, error) {
	for attempt := 0; ; attempt++ {
		f, err := os.OpenFile(filepath.Join(dir, newTempName()), os.O_RDWR|os.O_CREATE|os.O_EXCL, filePerm)
		if err == nil || attempt == 5 || !(errors.Is(err, fs.ErrNotExist) || errors.Is(err, fs.ErrExist)) {
			return f, err
		}
		if err := os.MkdirAll(dir, dirPerm); err != nil {
			return nil, err
		}
	}
}

// sameOrConflict decides an IfAbsent Put that found the name taken: the same
// bytes are a successful retry, anything else a precondition failure.
func (s *localDir) sameOrConflict(ctx context.Context, name string, size int64, crc uint32) error {
	have, err := s.Stat(ctx, name)
	if IsNotFound(err) { // a directory, or deleted since the link failed
		return &PreconditionError{Name: name, Err: fmt.Errorf("name is taken by something that is not an object: %w", fs.ErrExist)}
	}
	if err != nil {
		return fmt.Errorf("put %s: %w", name, err)
	}
	if have.Size == size && have.CRC32C == crc {
		return nil
	}
	return &PreconditionError{Name: name, Err: fmt.Errorf("exists with different content (size %d crc32c %08x, put size %d crc32c %08x): %w",
		have.Size, have.CRC32C, size, crc, fs.ErrExist)}
}

// syncDir makes renames and links in dir durable. Filesystems that cannot
// fsync a directory (EINVAL) give no stronger guarantee to ask for.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.Sync(); err != nil && !errors.Is(err, syscall.EINVAL) {
		return err
	}
	return nil
}

func (s *localDir) Open(ctx context.Context, name string, off, length int64) (io.ReadCloser, error) {
	if err := ValidateName(name); err != nil {
		return nil, err
	}
	if off < 0 {
		return nil, fmt.Errorf("open %s: negative offset %d", name, off)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	p := s.path(name)
	if fi, err := os.Lstat(p); err != nil {
		return nil, notFound(name, err)
	} else if !fi.Mode().IsRegular() {
		return nil, &NotFoundError{Name: name, Err: fs.ErrNotExist}
	}
	f, err := os.OpenFile(p, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return nil, notFound(name, err)
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	size := fi.Size()
	if off > size {
		f.Close()
		return nil, fmt.Errorf("open %s: offset %d is beyond the object's size %d", name, off, size)
	}
	if length < 0 || length > size-off {
		length = size - off
	}
	return &rangeReader{SectionReader: io.NewSectionReader(f, off, length), f: f}, nil
}

// rangeReader reads a section of a file and closes the file.
type rangeReader struct {
	*io.SectionReader
	f *os.File
}

func (r *rangeReader) Close() error { return r.f.Close() }

func (s *localDir) Stat(ctx context.Context, name string) (ObjectAttrs, error) {
	if err := ValidateName(name); err != nil {
		return ObjectAttrs{}, err
	}
	if err := ctx.Err(); err != nil {
		return ObjectAttrs{}, err
	}
	p := s.path(name)
	fi, err := os.Lstat(p)
	if err != nil {
		return ObjectAttrs{}, notFound(name, err)
	}
	if !fi.Mode().IsRegular() {
		return ObjectAttrs{}, &NotFoundError{Name: name, Err: fs.ErrNotExist}
	}
	return s.attrs(ctx, name, p, fi)
}

// attrs builds the ObjectAttrs of the regular file p (fi is its Lstat).
func (s *localDir) attrs(ctx context.Context, name, p string, fi fs.FileInfo) (ObjectAttrs, error) {
	a := ObjectAttrs{Name: name, Size: fi.Size(), Updated: fi.ModTime(), Generation: fi.ModTime().UnixNano()}
	if crc, ok := s.loadCRC(p, fi); ok {
		a.CRC32C = crc
		return a, nil
	}
	f, err := os.Open(p)
	if err != nil {
		return ObjectAttrs{}, notFound(name, err)
	}
	defer f.Close()
	n, crc, err := copyCRC(ctx, io.Discard, f)
	if err != nil {
		return ObjectAttrs{}, fmt.Errorf("checksum %s: %w", name, err)
	}
	if n != fi.Size() {
		return ObjectAttrs{}, fmt.Errorf("checksum %s: file changed size while being read (%d, then %d bytes)", name, fi.Size(), n)
	}
	s.storeCRC(p, crc, fi)
	a.CRC32C = crc
	return a, nil
}

// crcRecord is the xattr value: the CRC32C and the size and mtime of the
// content it was computed from, so a later in-place rewrite is noticed.
func crcRecord(crc uint32, fi fs.FileInfo) string {
	return fmt.Sprintf("%08x %d %d", crc, fi.Size(), fi.ModTime().UnixNano())
}

// storeCRC records crc on p, best effort: without xattrs Stat recomputes.
func (s *localDir) storeCRC(p string, crc uint32, fi fs.FileInfo) {
	if !s.noXattr {
		_ = syscall.Setxattr(p, crcXattr, []byte(crcRecord(crc, fi)), 0)
	}
}

// loadCRC returns the recorded CRC32C of p if it still describes fi.
func (s *localDir) loadCRC(p string, fi fs.FileInfo) (uint32, bool) {
	if s.noXattr {
		return 0, false
	}
	var buf [64]byte
	n, err := syscall.Getxattr(p, crcXattr, buf[:])
	if err != nil {
		return 0, false
	}
	var crc uint32
	var size, mtime int64
	rec := string(buf[:n])
	if _, err := fmt.Sscanf(rec, "%08x %d %d", &crc, &size, &mtime); err != nil || rec != crcRecord(crc, fi) {
		return 0, false
	}
	return crc, true
}

func (s *localDir) List(ctx context.Context, prefix, delimiter string) ([]ObjectAttrs, []string, error) {
	if delimiter != "" && delimiter != "/" {
		return nil, nil, fmt.Errorf("list %s: file:// supports only the delimiter \"/\", not %q", prefix, delimiter)
	}
	if err := validatePrefix(prefix); err != nil {
		return nil, nil, err
	}
	// Only the directory holding the prefix's last segment can contain
	// matches; read it and filter by that segment.
	dirName, base := "", prefix
	if i := strings.LastIndexByte(prefix, '/'); i >= 0 {
		dirName, base = prefix[:i+1], prefix[i+1:]
	}
	entries, err := os.ReadDir(s.path(dirName))
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) {
		return nil, nil, nil
	}
	if err != nil {
		return nil, nil, fmt.Errorf("list %s: %w", prefix, err)
	}
	var objects []ObjectAttrs
	var prefixes []string
	for _, e := range entries {
		if err := ctx.Err(); err != nil {
			return nil, nil, err
		}
		if !strings.HasPrefix(e.Name(), base) || isTempName(e.Name()) {
			continue
		}
		name := dirName + e.Name()
		switch {
		case e.IsDir() && delimiter == "/":
			ok, err := s.holdsObject(s.path(name))
			if err != nil {
				return nil, nil, fmt.Errorf("list %s: %w", prefix, err)
			}
			if ok {
				prefixes = append(prefixes, name+"/")
			}
		case e.IsDir():
			if objects, err = s.walk(ctx, name, objects); err != nil {
				return nil, nil, fmt.Errorf("list %s: %w", prefix, err)
			}
		case e.Type().IsRegular():
			if objects, err = s.appendAttrs(ctx, objects, name); err != nil {
				return nil, nil, fmt.Errorf("list %s: %w", prefix, err)
			}
		}
	}
	// Directory order is not name order ("a.x" sorts before "a/b").
	sort.Slice(objects, func(i, j int) bool { return objects[i].Name < objects[j].Name })
	sort.Strings(prefixes)
	return objects, prefixes, nil
}

// walk appends every object under the directory of object-name prefix dir.
func (s *localDir) walk(ctx context.Context, dir string, objects []ObjectAttrs) ([]ObjectAttrs, error) {
	err := filepath.WalkDir(s.path(dir), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) { // deleted while we walked
				return nil
			}
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if isTempName(d.Name()) && d.IsDir() {
			return fs.SkipDir // not ours, and nothing in it is an object
		}
		if isTempName(d.Name()) || !d.Type().IsRegular() {
			return nil
		}
		rel, err := filepath.Rel(s.root, p)
		if err != nil {
			return err
		}
		objects, err = s.appendAttrs(ctx, objects, filepath.ToSlash(rel))
		return err
	})
	return objects, err
}

// appendAttrs appends name's attributes, skipping it if it vanished.
func (s *localDir) appendAttrs(ctx context.Context, objects []ObjectAttrs, name string) ([]ObjectAttrs, error) {
	p := s.path(name)
	fi, err := os.Lstat(p)
	if errors.Is(err, fs.ErrNotExist) {
		return objects, nil
	}
	if err != nil {
		return objects, err
	}
	a, err := s.attrs(ctx, name, p, fi)
	if IsNotFound(err) {
		return objects, nil
	}
	if err != nil {
		return objects, err
	}
	return append(objects, a), nil
}

// holdsObject reports whether the directory p contains an object at any
// depth: GCS only shows a prefix that has objects under it, and an empty
// directory (or one holding only temporary files) must not look like one.
func (s *localDir) holdsObject(p string) (bool, error) {
	found := errors.New("found")
	err := filepath.WalkDir(p, func(_ string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		if isTempName(d.Name()) && d.IsDir() {
			return fs.SkipDir
		}
		if d.Type().IsRegular() && !isTempName(d.Name()) {
			return found
		}
		return nil
	})
	if err == found {
		return true, nil
	}
	return false, err
}

func (s *localDir) Delete(ctx context.Context, name string) error {
	if err := ValidateName(name); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	p := s.path(name)
	if fi, err := os.Lstat(p); err != nil {
		return notFound(name, err)
	} else if !fi.Mode().IsRegular() {
		return &NotFoundError{Name: name, Err: fs.ErrNotExist}
	}
	if err := os.Remove(p); err != nil {
		return notFound(name, err)
	}
	s.pruneEmptyDirs(filepath.Dir(p))
	return nil
}

// pruneEmptyDirs removes dir and its ancestors below the root while they are
// empty, so deleted objects leave no directories behind (GCS has none).
// rmdir fails on a non-empty directory, which is what stops it — including a
// directory in which a concurrent Put has just created its temporary file.
func (s *localDir) pruneEmptyDirs(dir string) {
	for dir != s.root && strings.HasPrefix(dir, s.root+string(filepath.Separator)) {
		if os.Remove(dir) != nil {
			return
		}
		dir = filepath.Dir(dir)
	}
}

// temporaries lists the temporary files below dir (tempStore): each is one
// Put's. Directories named like temporaries are not ours and are left alone.
func (s *localDir) temporaries(ctx context.Context, dir string) ([]temporary, error) {
	if err := validatePrefix(dir); err != nil {
		return nil, err
	}
	var out []temporary
	err := filepath.WalkDir(s.path(dir), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if !isTempName(d.Name()) {
			return nil
		}
		if d.IsDir() {
			return fs.SkipDir
		}
		if !d.Type().IsRegular() {
			return nil
		}
		fi, err := d.Info()
		if errors.Is(err, fs.ErrNotExist) { // linked and removed by its writer
			return nil
		}
		if err != nil {
			return err
		}
		out = append(out, temporary{seg: d.Name(), newest: fi.ModTime(), keys: []string{p}})
		return nil
	})
	return out, err
}

// removeTemporary deletes a temporary file (tempStore). A writer that still
// meant to publish it then fails its link or rename: nothing is published.
func (s *localDir) removeTemporary(ctx context.Context, t temporary) (int, error) {
	n := 0
	for _, p := range t.keys {
		if !isTempName(filepath.Base(p)) || !strings.HasPrefix(p, s.root+string(filepath.Separator)) {
			return n, fmt.Errorf("remove %s: not a temporary file of %s", p, s)
		}
		err := os.Remove(p)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return n, err
		}
		n++
		s.pruneEmptyDirs(filepath.Dir(p))
	}
	return n, nil
}
