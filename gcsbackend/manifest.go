package gcsbackend

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"path"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/mtcfs/mtcfs/planecodec"
)

// Manifest formats. A reader refuses formats it does not know rather than
// misjudging completeness; readers ignore unknown fields.
//
// v1 holds directories and regular files stored at <hash>.data/<path>. v2
// adds what a v1 reader would silently skip and so wrongly call complete:
// symlinks, special files (FIFOs, sockets, devices), files stored under a
// mapped object name (see longObject), and names that are not valid UTF-8
// (written as {"base64": …}). A tree that needs none of these is written as
// v1, byte for byte what earlier versions wrote, so agents of mixed versions
// uploading the same data still write identical manifests.
//
// v3 adds compressed objects (Upload with Compress auto): a file entry with a
// codec, whose object holds a sequence of planecodec chunks instead of the
// file's bytes. A v1 or v2 reader refuses it rather than restoring the
// stored bytes as the file. A manifest without a compressed object is written
// as v1 or v2, so that backups taken with compression off, or whose data did
// not compress, are byte for byte what earlier versions wrote.
const (
	manifestFormatV1 = "mtcfs-manifest-v1"
	manifestFormatV2 = "mtcfs-manifest-v2"
	manifestFormatV3 = "mtcfs-manifest-v3"
)

// manifest is the content of <hash>.data.manifest: everything needed to tell
// whether <hash>.data is fully present and intact, and to rebuild the tree
// (including empty directories, symlinks and special files, which an object
// store cannot hold). Example:
//
//	{"format":"mtcfs-manifest-v2","kind":"dir","dirs":["state"],
//	 "files":[{"path":"state/a","size":12,"crc32c":"e3069283"},
//	          {"path":"state/<1100 bytes>","size":3,"crc32c":"…","object":"D….data.long/<64 hex>"}],
//	 "symlinks":[{"path":"latest","target":"state"}],
//	 "specials":[{"path":"state/fifo","type":"fifo"},{"path":"null","type":"chardev","rdev":259}]}
//
// A single-file data has kind "file" and one entry with an empty path. The
// encoding is deterministic (sorted by path, no timestamps or node
// identity), so two nodes holding identical data write byte-identical
// manifests to the same store.
type manifest struct {
	Format   string            `json:"format"`
	Kind     string            `json:"kind"` // "dir" or "file", matching the hash's D prefix
	Dirs     []text            `json:"dirs,omitempty"`
	Files    []manifestFile    `json:"files"`
	Symlinks []manifestSymlink `json:"symlinks,omitempty"` // v2
	Specials []manifestSpecial `json:"specials,omitempty"` // v2
}

type manifestFile struct {
	Path text  `json:"path"` // relative, "/"-separated; "" for kind "file"
	Size int64 `json:"size"`
	// CRC32C is the CRC32C of the file's bytes, also when its object holds
	// them compressed.
	CRC32C crc32cHex `json:"crc32c"`
	// Object (v2) is the object holding the bytes, relative to the backup,
	// when it is not <hash>.data/<path>: always longObject(hash, path).
	Object string `json:"object,omitempty"`

	// Codec (v3) is how the object stores the file's bytes: "" as they are,
	// codecPlanes as a sequence of planecodec chunks, chunk i holding the
	// file's bytes [i·ChunkLen, (i+1)·ChunkLen) in Chunks[i] stored bytes.
	// The object has StoredSize bytes and CRC32C StoredCRC32C.
	Codec        string    `json:"codec,omitempty"`
	StoredSize   int64     `json:"stored_size,omitempty"`
	StoredCRC32C crc32cHex `json:"stored_crc32c,omitempty"`
	ChunkLen     int64     `json:"chunk_len,omitempty"`
	Chunks       []int64   `json:"chunks,omitempty"`
}

type manifestSymlink struct {
	Path   text `json:"path"`
	Target text `json:"target"` // verbatim, never followed
}

type manifestSpecial struct {
	Path text   `json:"path"`
	Type string `json:"type"`           // see specialTypes
	Rdev uint64 `json:"rdev,omitempty"` // chardev, blockdev: st_rdev
}

// The special types a manifest may name.
const (
	specialFIFO     = "fifo"
	specialSocket   = "socket"
	specialCharDev  = "chardev"
	specialBlockDev = "blockdev"
)

// text is a path or symlink target: any bytes. Valid UTF-8 is a JSON string;
// anything else (which JSON strings cannot carry) is {"base64":"…"}.
type text string

func (t text) MarshalJSON() ([]byte, error) {
	if utf8.ValidString(string(t)) {
		return json.Marshal(string(t))
	}
	return json.Marshal(struct {
		B64 string `json:"base64"`
	}{base64.StdEncoding.EncodeToString([]byte(t))})
}

func (t *text) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err == nil {
		*t = text(s)
		return nil
	}
	var o struct {
		B64 *string `json:"base64"`
	}
	if err := json.Unmarshal(b, &o); err != nil || o.B64 == nil {
		return fmt.Errorf("name %.40s: want a string or {\"base64\": …}", b)
	}
	raw, err := base64.StdEncoding.DecodeString(*o.B64)
	if err != nil {
		return fmt.Errorf("name %.40s: %w", b, err)
	}
	*t = text(raw)
	return nil
}

// crc32cHex encodes a CRC32C as 8 lowercase hex digits: readable, and the
// same spelling as in error messages.
type crc32cHex uint32

func (c crc32cHex) MarshalText() ([]byte, error) { return fmt.Appendf(nil, "%08x", uint32(c)), nil }

func (c *crc32cHex) UnmarshalText(b []byte) error {
	if len(b) != 8 {
		return fmt.Errorf("crc32c %q: want 8 hex digits", b)
	}
	v, err := strconv.ParseUint(string(b), 16, 32)
	if err != nil {
		return fmt.Errorf("crc32c %q: want 8 hex digits", b)
	}
	*c = crc32cHex(v)
	return nil
}

const (
	kindDir  = "dir"
	kindFile = "file"
)

// kindOf is the data kind a hash names: "D" + hex is a directory (SPEC §1).
func kindOf(hash string) string {
	if strings.HasPrefix(hash, "D") {
		return kindDir
	}
	return kindFile
}

// needsV3 reports whether the manifest holds a compressed object.
func (m *manifest) needsV3() bool {
	for _, f := range m.Files {
		if f.compressed() {
			return true
		}
	}
	return false
}

// needsV2 reports whether the manifest holds anything a v1 reader would skip.
func (m *manifest) needsV2() bool {
	if len(m.Symlinks) > 0 || len(m.Specials) > 0 {
		return true
	}
	for _, d := range m.Dirs {
		if !utf8.ValidString(string(d)) {
			return true
		}
	}
	for _, f := range m.Files {
		if f.Object != "" || !utf8.ValidString(string(f.Path)) {
			return true
		}
	}
	return false
}

// encode sets the format (the lowest that holds the content) and encodes.
func (m *manifest) encode() ([]byte, error) {
	m.Format = manifestFormatV1
	switch {
	case m.needsV3():
		m.Format = manifestFormatV3
	case m.needsV2():
		m.Format = manifestFormatV2
	}
	data, err := json.Marshal(m)
	if err != nil {
		return nil, err
	}
	return append(data, '\n'), nil
}

// maxSymlinkTarget is Linux's limit on a symlink's target (PATH_MAX - 1).
const maxSymlinkTarget = 4095

// errUnknownFormat marks a manifest this version cannot read (a format or codec a newer mtcfs
// writes): the backup is not damaged, only unreadable here.
var errUnknownFormat = errors.New("unknown to this version of mtcfs")

// decodeManifest parses and checks the manifest of hash's data. A backup's
// content is untrusted input: every path, target, type and object name is
// validated before Download uses it to create anything.
func decodeManifest(data []byte, hash string) (*manifest, error) {
	var m manifest
	if err := json.Unmarshal(data, &m); err != nil {
		return nil, fmt.Errorf("manifest of %s: %w", hash, err)
	}
	if err := m.check(hash); err != nil {
		return nil, fmt.Errorf("manifest of %s: %w", hash, err)
	}
	return &m, nil
}

func (m *manifest) check(hash string) error {
	switch m.Format {
	case manifestFormatV1, manifestFormatV2, manifestFormatV3:
	default:
		return fmt.Errorf("format %q, want %q, %q or %q (a newer mtcfs wrote it?): %w", m.Format, manifestFormatV1, manifestFormatV2, manifestFormatV3, errUnknownFormat)
	}
	if m.Kind != kindOf(hash) {
		return fmt.Errorf("kind %q, but the hash names a %s", m.Kind, kindOf(hash))
	}
	if m.Format == manifestFormatV1 && m.needsV2() {
		return fmt.Errorf("format %s cannot hold symlinks, special files or mapped object names", manifestFormatV1)
	}
	if m.Format != manifestFormatV3 && m.needsV3() {
		return fmt.Errorf("format %s cannot hold compressed objects", m.Format)
	}
	for _, f := range m.Files {
		if err := f.checkCodec(); err != nil {
			return fmt.Errorf("file %q: %w", f.Path, err)
		}
	}
	if m.Kind == kindFile {
		if len(m.Files) != 1 || m.Files[0].Path != "" || m.Files[0].Object != "" ||
			len(m.Dirs)+len(m.Symlinks)+len(m.Specials) != 0 {
			return fmt.Errorf("a single-file data needs exactly one entry with an empty path")
		}
		if m.Files[0].Size < 0 {
			return fmt.Errorf("negative size")
		}
		return nil
	}

	// What each path is: a parent of any entry must be a directory.
	types := make(map[string]string, len(m.Dirs)+len(m.Files)+len(m.Symlinks)+len(m.Specials))
	add := func(kind string, p text) error {
		if err := validTreePath(string(p)); err != nil {
			return fmt.Errorf("%s: %w", kind, err)
		}
		if _, dup := types[string(p)]; dup {
			return fmt.Errorf("%s %q listed twice", kind, p)
		}
		types[string(p)] = kind
		return nil
	}
	for _, d := range m.Dirs {
		if err := add("directory", d); err != nil {
			return err
		}
	}
	for _, f := range m.Files {
		if err := add("file", f.Path); err != nil {
			return err
		}
		if f.Size < 0 {
			return fmt.Errorf("file %q has negative size", f.Path)
		}
		if f.Object != "" && f.Object != longObject(hash, string(f.Path)) {
			return fmt.Errorf("file %q: object %.80q is not %s", f.Path, f.Object, longObject(hash, string(f.Path)))
		}
		if f.Object == "" {
			if err := ValidateName(dataObject(hash, string(f.Path))); err != nil {
				return fmt.Errorf("file %q: %w", f.Path, err)
			}
		}
	}
	for _, l := range m.Symlinks {
		if err := add("symlink", l.Path); err != nil {
			return err
		}
		switch {
		case l.Target == "":
			return fmt.Errorf("symlink %q has an empty target", l.Path)
		case len(l.Target) > maxSymlinkTarget:
			return fmt.Errorf("symlink %q: target longer than %d bytes", l.Path, maxSymlinkTarget)
		case strings.IndexByte(string(l.Target), 0) >= 0:
			return fmt.Errorf("symlink %q: target contains a NUL byte", l.Path)
		}
	}
	for _, s := range m.Specials {
		if err := add("special file", s.Path); err != nil {
			return err
		}
		switch s.Type {
		case specialFIFO, specialSocket:
			if s.Rdev != 0 {
				return fmt.Errorf("%s %q has a device number", s.Type, s.Path)
			}
		case specialCharDev, specialBlockDev:
		default:
			return fmt.Errorf("special file %q has unknown type %q", s.Path, s.Type)
		}
	}
	for p, kind := range types {
		for dir := path.Dir(p); dir != "."; dir = path.Dir(dir) {
			if t, ok := types[dir]; ok && t != "directory" {
				return fmt.Errorf("%s %q is below %q, which is a %s", kind, p, dir, t)
			}
		}
	}
	return nil
}

// maxNameSegment is NAME_MAX, the longest name a path element can have.
const maxNameSegment = 255

// validTreePath checks a path inside a checkpoint tree: relative,
// "/"-separated, without empty, "." or ".." elements, NUL bytes or elements
// longer than NAME_MAX. Its length is not limited.
func validTreePath(p string) error {
	if p == "" {
		return fmt.Errorf("empty path")
	}
	if strings.IndexByte(p, 0) >= 0 {
		return fmt.Errorf("path %.80q contains a NUL byte", p)
	}
	if strings.HasPrefix(p, "/") {
		return fmt.Errorf("path %.80q is absolute", p)
	}
	for seg := range strings.SplitSeq(p, "/") {
		switch {
		case seg == "" || seg == "." || seg == "..":
			return fmt.Errorf("path %.80q has an empty, \".\" or \"..\" element", p)
		case len(seg) > maxNameSegment:
			return fmt.Errorf("path %.80q has an element longer than %d bytes", p, maxNameSegment)
		}
	}
	return nil
}

// total is the number of data bytes the manifest describes.
func (m *manifest) total() int64 {
	var n int64
	for _, f := range m.Files {
		n += f.Size
	}
	return n
}

// compressed reports whether f's object holds its bytes encoded.
func (f manifestFile) compressed() bool {
	return f.Codec != "" || f.StoredSize != 0 || f.StoredCRC32C != 0 || f.ChunkLen != 0 || len(f.Chunks) != 0
}

// checkCodec checks the fields of a compressed object against each other.
func (f manifestFile) checkCodec() error {
	if !f.compressed() {
		return nil
	}
	if f.Codec != codecPlanes {
		return fmt.Errorf("codec %q, want %q (a newer mtcfs wrote it?): %w", f.Codec, codecPlanes, errUnknownFormat)
	}
	if f.ChunkLen < minChunkLen || f.ChunkLen > maxChunkLen {
		return fmt.Errorf("chunk length %d outside %d–%d", f.ChunkLen, minChunkLen, maxChunkLen)
	}
	if f.Size <= 0 || int64(len(f.Chunks)) != (f.Size+f.ChunkLen-1)/f.ChunkLen {
		return fmt.Errorf("%d chunks for %d bytes in chunks of %d", len(f.Chunks), f.Size, f.ChunkLen)
	}
	var stored int64
	for i, c := range f.Chunks {
		if c < planecodecHeaderLen || c > int64(planecodec.MaxEncodedLen(int(f.chunkSize(i)))) {
			return fmt.Errorf("chunk %d: %d bytes stored for %d", i, c, f.chunkSize(i))
		}
		stored += c
	}
	if stored != f.StoredSize {
		return fmt.Errorf("chunks hold %d bytes, stored size says %d", stored, f.StoredSize)
	}
	return nil
}

// chunkSize is the number of the file's bytes in chunk i of a compressed object.
func (f manifestFile) chunkSize(i int) int64 {
	return min(f.ChunkLen, f.Size-int64(i)*f.ChunkLen)
}

// storedSize and storedCRC are the size and CRC32C the object must have.
func (f manifestFile) storedSize() int64 {
	if f.compressed() {
		return f.StoredSize
	}
	return f.Size
}

func (f manifestFile) storedCRC() uint32 {
	if f.compressed() {
		return uint32(f.StoredCRC32C)
	}
	return uint32(f.CRC32C)
}

// object is the object holding file f of hash's data, relative to the backup.
func (f manifestFile) object(hash string) string {
	if f.Object != "" {
		return f.Object
	}
	return dataObject(hash, string(f.Path))
}
