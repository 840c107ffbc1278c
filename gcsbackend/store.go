package gcsbackend

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// ObjectStore is a flat namespace of objects, each written whole, modelled
// on Google Cloud Storage so that the GCS implementation is a thin adapter.
//
// Names are relative, "/"-separated paths (see ValidateName). Implementations
// are safe for concurrent use, including by several processes sharing one
// location.
type ObjectStore interface {
	// Put stores req.Body (exactly req.Size bytes) under req.Name, replacing
	// any existing object unless req.IfAbsent. It is atomic: on any error,
	// including a size or CRC32C mismatch (*ChecksumError), nothing new is
	// visible under the name.
	Put(ctx context.Context, req PutRequest) error

	// Open reads length bytes of the object starting at off (length < 0: to
	// the end). A range running past the end is cut short; off beyond the size
	// is an error. The reader is not cancelled by ctx once returned: close it.
	Open(ctx context.Context, name string, off, length int64) (io.ReadCloser, error)

	// Stat returns the object's attributes or *NotFoundError.
	Stat(ctx context.Context, name string) (ObjectAttrs, error)

	// List returns the objects whose names start with prefix, sorted by
	// name. With delimiter "/", names with a further "/" after the prefix are
	// rolled up into prefixes (each ending in "/", sorted, each holding at
	// least one object) instead, like a directory listing. The empty
	// delimiter lists recursively.
	List(ctx context.Context, prefix, delimiter string) (objects []ObjectAttrs, prefixes []string, err error)

	// Delete removes the object or returns *NotFoundError.
	Delete(ctx context.Context, name string) error

	// PutFile uploads t.Size bytes of the local file t.File to t.Name with
	// the semantics of Put with IfAbsent, and returns their CRC32C, which it
	// takes itself; a file that does not have t.Size bytes any more fails.
	// Backups uploads every data file through it, so a store moves a file
	// the best way it can (GCS: in parts, in parallel, see gcs_transfer.go)
	// and a wrapper of a store must decide what to do with it.
	PutFile(ctx context.Context, t FileTransfer) (crc uint32, err error)

	// GetFile writes the object t.Name, which must have t.Size bytes, into
	// the new, empty file t.File and returns the number of bytes and their
	// CRC32C (the caller checks them against what it expects). GCS reads
	// large objects as ranges in parallel.
	GetFile(ctx context.Context, t FileTransfer) (n int64, crc uint32, err error)

	// String returns the store's URL, as accepted by Open.
	String() string
}

// PutRequest describes one ObjectStore.Put.
type PutRequest struct {
	Name string
	Body io.Reader
	// Size is the exact number of bytes Body yields; fewer or more is an
	// error. Knowing it up front lets GCS pick a single-request upload and
	// lets us catch a source that changed under us.
	Size int64
	// CRC32C, when set, is the Castagnoli CRC of the bytes the caller meant
	// to send; the store rejects the upload with *ChecksumError if what it
	// received differs (for GCS the server checks it).
	CRC32C *uint32
	// IfAbsent makes the Put fail with *PreconditionError when the name
	// exists with other content (GCS: ifGenerationMatch=0). An existing
	// object of the same size and CRC32C counts as success, so that retrying
	// an upload whose acknowledgement was lost is safe.
	IfAbsent bool
}

// ObjectAttrs describes one stored object.
type ObjectAttrs struct {
	Name   string
	Size   int64
	CRC32C uint32 // Castagnoli, of the whole object
	// Updated is when the object was last written.
	Updated time.Time
	// Generation changes whenever the object is replaced. GCS: the object
	// generation; file://: the file's modification time in nanoseconds.
	Generation int64
}

// NotFoundError reports that an object does not exist. Err is the
// implementation's underlying error (e.g. fs.ErrNotExist), so errors.Is works
// on it as well.
type NotFoundError struct {
	Name string
	Err  error
}

func (e *NotFoundError) Error() string { return fmt.Sprintf("object %q not found", e.Name) }
func (e *NotFoundError) Unwrap() error { return e.Err }

// PreconditionError reports that a conditional write found the object in
// another state than required (it exists with different content).
type PreconditionError struct {
	Name string
	Err  error
}

func (e *PreconditionError) Error() string {
	return fmt.Sprintf("object %q: precondition failed: %v", e.Name, e.Err)
}
func (e *PreconditionError) Unwrap() error { return e.Err }

// ChecksumError reports bytes whose CRC32C is not the expected one: an upload
// that was damaged on the way, or stored data that no longer matches its
// manifest.
type ChecksumError struct {
	Name      string
	Want, Got uint32
	// Detail, when set, replaces Want and Got in the message: a client's own words for a
	// mismatch whose values it did not give in a form read here.
	Detail string
}

func (e *ChecksumError) Error() string {
	if e.Detail != "" {
		return fmt.Sprintf("object %q: crc32c mismatch: %s", e.Name, e.Detail)
	}
	return fmt.Sprintf("object %q: crc32c mismatch: want %08x, got %08x", e.Name, e.Want, e.Got)
}

// IsNotFound reports whether err is or wraps a *NotFoundError.
func IsNotFound(err error) bool {
	var nf *NotFoundError
	return errors.As(err, &nf)
}

// crcTable is the Castagnoli table GCS uses; crc32 picks the hardware
// instruction for it (about 5.6 GiB/s measured on the dev VM).
var crcTable = crc32.MakeTable(crc32.Castagnoli)

// copyBufSize is large enough that a stream's throughput is not bound by
// syscalls yet small enough to stay in a core's cache between read and write:
// on the dev VM, copying tmpfs → ext4 with 1 MiB writes ran at a third of the
// speed of 128–256 KiB writes (bench/RESULTS.md, replbench notes).
const copyBufSize = 256 << 10

var copyBufs = sync.Pool{New: func() any { b := make([]byte, copyBufSize); return &b }}

// copyCRC copies src to dst, returning the byte count and the CRC32C of the
// bytes copied. It stops early when ctx is cancelled.
func copyCRC(ctx context.Context, dst io.Writer, src io.Reader) (int64, uint32, error) {
	bp := copyBufs.Get().(*[]byte)
	defer copyBufs.Put(bp)
	buf := *bp
	var n int64
	var crc uint32
	for {
		if err := ctx.Err(); err != nil {
			return n, crc, err
		}
		m, rerr := src.Read(buf)
		if m > 0 {
			crc = crc32.Update(crc, crcTable, buf[:m])
			if _, werr := dst.Write(buf[:m]); werr != nil {
				return n, crc, werr
			}
			n += int64(m)
		}
		if rerr == io.EOF {
			return n, crc, nil
		}
		if rerr != nil {
			return n, crc, rerr
		}
	}
}

// ValidateName checks an object name: non-empty, at most 1024 bytes (the GCS
// limit), relative, "/"-separated, without empty, "." or ".." segments or NUL
// bytes, and without segments that look like a store's temporary files. The
// rules keep a name from escaping a file:// root and keep both backends
// agreeing on what is storable.
func ValidateName(name string) error {
	if name == "" {
		return errors.New("object name is empty")
	}
	if len(name) > 1024 {
		return fmt.Errorf("object name %.40q…: longer than 1024 bytes", name)
	}
	if strings.ContainsRune(name, 0) {
		return fmt.Errorf("object name %q contains a NUL byte", name)
	}
	if strings.HasPrefix(name, "/") {
		return fmt.Errorf("object name %q is absolute; names are relative to the store", name)
	}
	for _, seg := range strings.Split(name, "/") {
		switch {
		case seg == "":
			return fmt.Errorf("object name %q has an empty path segment", name)
		case seg == "." || seg == "..":
			return fmt.Errorf("object name %q contains a %q segment", name, seg)
		case isTempName(seg):
			return fmt.Errorf("object name %q uses the reserved temporary prefix %q", name, tempPrefix)
		}
	}
	return nil
}

// validatePrefix checks a List prefix: empty, or a name that may end in "/".
func validatePrefix(prefix string) error {
	p := strings.TrimSuffix(prefix, "/")
	if p == "" && prefix != "" {
		return fmt.Errorf("list prefix %q is absolute; names are relative to the store", prefix)
	}
	if p == "" {
		return nil
	}
	if err := ValidateName(p); err != nil {
		return fmt.Errorf("list prefix: %w", err)
	}
	return nil
}

// PutBytes stores a small in-memory object (a .meta, a manifest, a pin).
func PutBytes(ctx context.Context, s ObjectStore, name string, data []byte, ifAbsent bool) error {
	crc := crc32.Checksum(data, crcTable)
	return s.Put(ctx, PutRequest{Name: name, Body: bytes.NewReader(data), Size: int64(len(data)), CRC32C: &crc, IfAbsent: ifAbsent})
}

// tooLargeError is the error (wrapped) of a ReadSmall past its limit (in bytes).
type tooLargeError int64

func (e tooLargeError) Error() string { return fmt.Sprintf("larger than %d bytes", int64(e)) }

// ReadSmall returns the whole content of an object that is expected to be
// small, failing when it is larger than limit bytes (a guard against reading
// a multi-GiB object by mistake).
//
// Bytes whose CRC32C is not the one the store keeps for the object (GCS checks a
// whole object's read, *ChecksumError) were damaged on the way: the object is
// read again, as GetFile does, up to transitReads times; still damaged, the
// error says so and is no *ChecksumError. A manifest or .meta damaged once on
// the way failed the job's restore plan, and twice the restore marked intact
// data damaged for good (black-box h55, a proxy damaging every second read).
func ReadSmall(ctx context.Context, s ObjectStore, name string, limit int64) ([]byte, error) {
	var data []byte
	err := readAgainOnTheWay(ctx, name, func() (err error) {
		data, err = readSmallOnce(ctx, s, name, limit)
		return err
	})
	if err != nil {
		return nil, err
	}
	return data, nil
}

func readSmallOnce(ctx context.Context, s ObjectStore, name string, limit int64) ([]byte, error) {
	r, err := s.Open(ctx, name, 0, -1)
	if err != nil {
		return nil, err
	}
	defer r.Close()
	// The reader outlives ctx (ObjectStore.Open); this read does not: a body that stalls after
	// the headers ends with ctx, where the reader can be aborted while it reads.
	stop := context.AfterFunc(ctx, func() {
		if a, ok := r.(interface{ Abort() }); ok {
			a.Abort()
		}
	})
	data, err := io.ReadAll(io.LimitReader(r, limit+1))
	if !stop() && err != nil {
		if cause := context.Cause(ctx); cause != ctx.Err() {
			return nil, fmt.Errorf("read %s: %w (%w)", name, cause, ctx.Err())
		}
		return nil, fmt.Errorf("read %s: %w", name, ctx.Err())
	}
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", name, err)
	}
	if int64(len(data)) > limit {
		return nil, fmt.Errorf("read %s: %w", name, tooLargeError(limit))
	}
	return data, nil
}

// acceptedURLs is quoted in every URL error so the user sees the fix.
const acceptedURLs = "gs://bucket[/prefix] or file:///absolute/dir"

// Open returns the store for a --backup URL: file:///abs/dir (a local
// directory, created on first write) or gs://bucket[/prefix] (Google Cloud
// Storage through Application Default Credentials, or the emulator named by
// STORAGE_EMULATOR_HOST). Open does no I/O: the GCS client is created on
// first use and shared by every gs:// store of the process.
func Open(rawURL string) (ObjectStore, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return nil, fmt.Errorf("backup location %q: %v; want %s", rawURL, err, acceptedURLs)
	}
	if u.RawQuery != "" || u.Fragment != "" {
		return nil, fmt.Errorf("backup location %q: query and fragment are not allowed; want %s", rawURL, acceptedURLs)
	}
	switch u.Scheme {
	case "file":
		if u.Host != "" && u.Host != "localhost" {
			return nil, fmt.Errorf("backup location %q: file URLs need an absolute path, file:///absolute/dir (three slashes); %q was read as a host name", rawURL, u.Host)
		}
		if u.Opaque != "" || !filepath.IsAbs(u.Path) {
			return nil, fmt.Errorf("backup location %q: file URLs need an absolute path, file:///absolute/dir", rawURL)
		}
		return newLocalDir(filepath.Clean(u.Path))
	case "gs":
		if u.Host == "" {
			return nil, fmt.Errorf("backup location %q: missing bucket name; want gs://bucket[/prefix]", rawURL)
		}
		if u.User != nil || u.Port() != "" {
			return nil, fmt.Errorf("backup location %q: want gs://bucket[/prefix], without user or port", rawURL)
		}
		s, err := newGCS(defaultClient, u.Host, strings.Trim(u.Path, "/"), GCSOptions{})
		if err != nil {
			return nil, fmt.Errorf("backup location %q: %w", rawURL, err)
		}
		return s, nil
	default:
		return nil, fmt.Errorf("backup location %q: unsupported; want %s", rawURL, acceptedURLs)
	}
}

// fileURL is the file:// URL of an absolute directory, escaped so that Open
// reads back the same path.
func fileURL(dir string) string {
	return (&url.URL{Scheme: "file", Path: filepath.ToSlash(dir)}).String()
}

// DefaultURL is the backup location used when --backup is not given:
// $XDG_DATA_HOME/mtcfs/backups, else ~/.local/share/mtcfs/backups (the XDG
// base-directory defaults), so that `mtcfs mount ./ckpt` works unconfigured.
func DefaultURL() string {
	base := os.Getenv("XDG_DATA_HOME")
	if !filepath.IsAbs(base) { // the XDG spec says to ignore relative values
		home, err := os.UserHomeDir()
		if err != nil {
			home = os.TempDir() // no $HOME (bare containers): still somewhere writable
		}
		base = filepath.Join(home, ".local", "share")
	}
	return fileURL(filepath.Join(base, "mtcfs", "backups"))
}
