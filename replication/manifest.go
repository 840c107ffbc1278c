package replication

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"math"
	"math/bits"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/replication/peerpb"
	"google.golang.org/protobuf/proto"
)

// dataKind is what a transfer carries, told by its name.
type dataKind int

const (
	kindTree dataKind = iota // "D<hash>.data": a directory tree
	kindFile                 // "<hash>.data": one regular file
	kindMeta                 // "<job>-s<S>-n<R>-w<W>.meta": one small file naming a data hash
)

// Limits on what a manifest may describe. They bound the work and memory a peer can cause; real
// checkpoints are far inside them.
const (
	maxEntries = 1 << 20 // files + directories + symlinks + specials
	// maxPathLen bounds a path inside a tree. It is not PATH_MAX: a job may create paths relative
	// to a deep working directory, and a legal ~4 KiB path in the mount is longer still once
	// prefixed with where the tree lives; layout.Dir handles any length. Eight times PATH_MAX
	// keeps the depth of a tree (one descriptor per level while it is created and listed)
	// bounded.
	maxPathLen   = 8 * 4096
	maxNameLen   = 255     // NAME_MAX, one path element
	maxTargetLen = 4095    // a symlink's target: PATH_MAX less the NUL, what symlink(2) takes
	maxTotal     = 1 << 50 // bytes, so that sums cannot overflow
	maxMetaSize  = 65      // "D" + 64 hex digits
)

// manifest is a Manifest that passed checkManifest.
type manifest struct {
	pb    *peerpb.Manifest
	kind  dataKind
	total int64 // sum of the file sizes
	// presumed marks the files a push does not send (the receiver holds them as early files);
	// nil when every file is sent. sendTotal is the sum of the other files' sizes.
	presumed  []bool
	sendTotal int64
}

// toSend is the bytes a push sends: the files not presumed.
func (m *manifest) toSend() int64 {
	if m.presumed != nil {
		return m.sendTotal
	}
	return m.total
}

// presume marks the files listed in idx (strictly increasing indices) as not sent.
func (m *manifest) presume(idx []uint32) error {
	m.presumed = make([]bool, len(m.pb.Files))
	m.sendTotal = m.total
	for k, i := range idx {
		if int(i) >= len(m.pb.Files) || (k > 0 && idx[k-1] >= i) {
			return errInvalid("%s: presumed file indices must be strictly increasing and < %d", m.pb.DataName, len(m.pb.Files))
		}
		m.presumed[i] = true
		m.sendTotal -= m.pb.Files[i].Size
	}
	return nil
}

// sent reports whether file i travels in the push.
func (m *manifest) sent(i int) bool { return m.presumed == nil || !m.presumed[i] }

// specialTypes maps the wire's special types to layout's.
var specialTypes = map[peerpb.SpecialType]layout.EntryType{
	peerpb.SpecialType_SPECIAL_TYPE_FIFO:         layout.EntryFIFO,
	peerpb.SpecialType_SPECIAL_TYPE_SOCKET:       layout.EntrySocket,
	peerpb.SpecialType_SPECIAL_TYPE_CHAR_DEVICE:  layout.EntryCharDev,
	peerpb.SpecialType_SPECIAL_TYPE_BLOCK_DEVICE: layout.EntryBlockDev,
}

// wireSpecialType is the wire's name for a special entry type (UNSPECIFIED for others).
func wireSpecialType(t layout.EntryType) peerpb.SpecialType {
	for w, e := range specialTypes {
		if e == t {
			return w
		}
	}
	return peerpb.SpecialType_SPECIAL_TYPE_UNSPECIFIED
}

// entries returns what the manifest of a tree lists, as layout entries: the files first, entry i
// being file i (with its digest), then the directories, symlinks and special entries.
func (m *manifest) entries() []layout.TreeEntry {
	pb := m.pb
	out := make([]layout.TreeEntry, 0, len(pb.Files)+len(pb.Dirs)+len(pb.Symlinks)+len(pb.Specials))
	for _, f := range pb.Files {
		e := layout.TreeEntry{Path: string(f.Path), Type: layout.EntryFile, Size: f.Size}
		copy(e.Digest[:], f.Blake3) // checkManifest checked its length
		out = append(out, e)
	}
	for _, d := range pb.Dirs {
		out = append(out, layout.TreeEntry{Path: string(d), Type: layout.EntryDir})
	}
	for _, l := range pb.Symlinks {
		out = append(out, layout.TreeEntry{Path: string(l.Path), Type: layout.EntrySymlink, Target: string(l.Target)})
	}
	for _, sp := range pb.Specials {
		out = append(out, layout.TreeEntry{Path: string(sp.Path), Type: specialTypes[sp.Type], Rdev: sp.Rdev})
	}
	return out
}

// parseDataName tells the kind of the data a name stands for and, for .data names, the hash the
// content must have. A .meta name must be of job; meta is whether .meta names are allowed at all.
func parseDataName(name, job string, meta bool) (dataKind, string, error) {
	if hash, dir, ok := layout.ParseDataName(name); ok {
		if dir {
			return kindTree, hash, nil
		}
		return kindFile, hash, nil
	}
	if mk, ok := layout.ParseMarkerName(name); ok && meta && mk.Kind == layout.MarkerMeta {
		if mk.Job != job {
			return 0, "", errInvalid("%q is a .meta of job %q, not of %q", name, mk.Job, job)
		}
		return kindMeta, "", nil
	}
	want := "<hash>.data or D<hash>.data (64 lower-case hex digits)"
	if meta {
		want += " or a .meta name of job " + job
	}
	return 0, "", errInvalid("data name %q: want %s", name, want)
}

// checkManifest validates a manifest received from a peer before anything is written for it:
// the name, every path and symlink target, sizes, digests, and that the listing hashes to the
// name. Broken rules are InvalidArgument; a listing that does not hash to its name is DataLoss
// (a header damaged in transit looks like that).
func checkManifest(pb *peerpb.Manifest, job string, meta bool) (*manifest, error) {
	if pb == nil {
		return nil, errInvalid("missing manifest")
	}
	kind, hash, err := parseDataName(pb.DataName, job, meta)
	if err != nil {
		return nil, err
	}
	m := &manifest{pb: pb, kind: kind}
	if n := len(pb.Files) + len(pb.Dirs) + len(pb.Symlinks) + len(pb.Specials); n > maxEntries {
		return nil, errInvalid("%s: %d entries, at most %d allowed", pb.DataName, n, maxEntries)
	}
	if !isHex64(pb.TreeHash) {
		return nil, errInvalid("%s: tree hash %q is not 64 lower-case hex digits", pb.DataName, pb.TreeHash)
	}
	if len(pb.Attrs) > 0 {
		if kind == kindMeta {
			return nil, errInvalid("%s: a .meta has no attrs", pb.DataName)
		}
		if _, err := layout.DecodeAttrs(pb.Attrs); err != nil {
			return nil, errInvalid("%s: %v", pb.DataName, err)
		}
	}
	for i, f := range pb.Files {
		if f.Size < 0 || f.Size > maxTotal-m.total {
			return nil, errInvalid("%s: file %q: size %d out of range", pb.DataName, f.Path, f.Size)
		}
		if len(f.Blake3) != len(layout.FileDigest{}) {
			return nil, errInvalid("%s: file %q: digest of %d bytes, want %d", pb.DataName, f.Path, len(f.Blake3), len(layout.FileDigest{}))
		}
		if kind == kindTree && i > 0 && bytes.Compare(pb.Files[i-1].Path, f.Path) >= 0 {
			return nil, errInvalid("%s: files not in strictly increasing order of path at %q", pb.DataName, f.Path)
		}
		m.total += f.Size
	}

	if kind != kindTree {
		if len(pb.Files) != 1 || len(pb.Files[0].Path) != 0 || len(pb.Dirs) != 0 || len(pb.Symlinks) != 0 || len(pb.Specials) != 0 {
			return nil, errInvalid("%s names a single file: want exactly one file with an empty path", pb.DataName)
		}
		switch d := hex.EncodeToString(pb.Files[0].Blake3); {
		case kind == kindMeta && m.total > maxMetaSize:
			return nil, errInvalid("%s: %d bytes, a .meta holds at most %d", pb.DataName, m.total, maxMetaSize)
		case kind == kindMeta && d != pb.TreeHash, kind == kindFile && (d != hash || pb.TreeHash != hash):
			return nil, errCorrupt("%s: file digest %s, tree hash %s: they must equal the hash of the name", pb.DataName, d, pb.TreeHash)
		}
		return m, nil
	}

	for _, l := range pb.Symlinks {
		if err := checkSymlinkTarget(string(l.Path), string(l.Target)); err != nil {
			return nil, errInvalid("%s: %v", pb.DataName, err)
		}
	}
	for _, sp := range pb.Specials {
		if err := checkSpecial(sp); err != nil {
			return nil, errInvalid("%s: %v", pb.DataName, err)
		}
	}
	entries := m.entries()
	for _, e := range entries {
		if err := checkPath(e.Path); err != nil {
			return nil, errInvalid("%s: %v", pb.DataName, err)
		}
	}
	got, err := layout.TreeHash(entries) // also refuses duplicates and entries below non-directories
	if err != nil {
		return nil, errInvalid("%s: %v", pb.DataName, err)
	}
	switch {
	case got != hash:
		return nil, errCorrupt("%s: its files hash to %s, not to %s, the hash its name carries", pb.DataName, got, hash)
	case pb.TreeHash != hash:
		return nil, errCorrupt("%s: its manifest gives its hash as %s, not %s, the hash its name carries", pb.DataName, pb.TreeHash, hash)
	}
	return m, nil
}

func isHex64(s string) bool {
	return len(s) == 64 && strings.Trim(s, "0123456789abcdef") == ""
}

// checkPath accepts a relative slash-separated path without empty, "." or ".." elements that the
// file system can hold.
func checkPath(p string) error {
	if !layout.ValidPath(p) {
		return fmt.Errorf("path %q: want a relative slash-separated path without empty, \".\" or \"..\" elements", p)
	}
	if len(p) > maxPathLen {
		return fmt.Errorf("path %.40q...: %d bytes, at most %d allowed", p, len(p), maxPathLen)
	}
	for elem := range strings.SplitSeq(p, "/") {
		if len(elem) > maxNameLen {
			return fmt.Errorf("path %q: element of %d bytes, at most %d allowed", p, len(elem), maxNameLen)
		}
	}
	return nil
}

// checkSymlinkTarget accepts any target a symlink can hold: it is kept verbatim, even absolute,
// dangling or leading out of the tree (the job made it so, and a restore must give it back).
// That is safe because nothing that handles a tree follows a symlink inside it: the receiver
// creates every entry relative to its parent's descriptor without following links (layout.Dir),
// and TreeHash refuses an entry below a non-directory.
func checkSymlinkTarget(link, target string) error {
	if target == "" || len(target) > maxTargetLen || strings.IndexByte(target, 0) >= 0 {
		return fmt.Errorf("symlink %q: target %.40q is empty, longer than %d bytes or holds a NUL byte", link, target, maxTargetLen)
	}
	return nil
}

// checkSpecial accepts a FIFO, socket or device entry of a known type whose device number can
// be created (mknod takes 32 bits; a FIFO or socket has none).
func checkSpecial(sp *peerpb.Special) error {
	t, ok := specialTypes[sp.Type]
	switch {
	case !ok:
		return fmt.Errorf("special entry %q: unknown type %v", sp.Path, sp.Type)
	case (t == layout.EntryCharDev || t == layout.EntryBlockDev) && sp.Rdev > math.MaxUint32:
		return fmt.Errorf("%v %q: device number %#x does not fit in 32 bits", t, sp.Path, sp.Rdev)
	case t != layout.EntryCharDev && t != layout.EntryBlockDev && sp.Rdev != 0:
		return fmt.Errorf("%v %q: has a device number", t, sp.Path)
	}
	return nil
}

// buildManifest lists and hashes the local data at src for sending under dataName: a directory
// for "D<hash>.data", a regular file otherwise (src is followed if it is a symlink). File
// digests come from digests when it has them (files hashed when they were closed), else they
// are computed. It refuses to send data that does not hash to its name, or that a receiver
// would refuse (checkManifest).
func buildManifest(ctx context.Context, src, dataName, job string, digests *layout.DigestCache) (*manifest, error) {
	kind, _, err := parseDataName(dataName, job, true)
	if err != nil {
		return nil, err
	}
	info, err := os.Stat(src)
	if err != nil {
		return nil, err
	}
	pb := &peerpb.Manifest{DataName: dataName}
	var entries []layout.TreeEntry
	switch {
	case kind == kindTree && !info.IsDir(), kind != kindTree && !info.Mode().IsRegular():
		return nil, fmt.Errorf("%s: a %v cannot be sent as %s", src, info.Mode().Type(), dataName)
	case kind == kindTree:
		// Listed and read relative to the tree's root: no path length limit, no symlink followed.
		d, err := layout.OpenDir(src)
		if err != nil {
			return nil, err
		}
		defer d.Close()
		if entries, err = d.List(); err != nil {
			return nil, err
		}
		if err := d.HashEntries(ctx, entries, digests); err != nil {
			return nil, fmt.Errorf("hash %s: %w", src, err)
		}
	default:
		entries = []layout.TreeEntry{{Type: layout.EntryFile, Size: info.Size()}} // src itself
		if err := layout.HashEntries(ctx, src, entries, digests); err != nil {
			return nil, fmt.Errorf("hash %s: %w", src, err)
		}
	}
	for _, e := range entries {
		switch {
		case e.Type == layout.EntryDir:
			pb.Dirs = append(pb.Dirs, []byte(e.Path))
		case e.Type == layout.EntrySymlink:
			pb.Symlinks = append(pb.Symlinks, &peerpb.Symlink{Path: []byte(e.Path), Target: []byte(e.Target)})
		case e.Type.Special():
			pb.Specials = append(pb.Specials, &peerpb.Special{Path: []byte(e.Path), Type: wireSpecialType(e.Type), Rdev: e.Rdev})
		default:
			pb.Files = append(pb.Files, &peerpb.File{Path: []byte(e.Path), Size: e.Size, Blake3: e.Digest[:]})
		}
	}
	slices.SortFunc(pb.Files, func(a, b *peerpb.File) int { return bytes.Compare(a.Path, b.Path) })
	if kind == kindTree {
		if pb.TreeHash, err = layout.TreeHash(entries); err != nil {
			return nil, fmt.Errorf("%s: %w", src, err)
		}
	} else {
		pb.TreeHash = hex.EncodeToString(pb.Files[0].Blake3)
	}
	if kind != kindMeta {
		pb.Attrs = attrsToSend(src, proto.Size(pb))
	}
	checked, err := checkManifest(pb, job, true)
	if err != nil {
		return nil, fmt.Errorf("%s cannot be sent: %w", src, err)
	}
	return checked, nil
}

// attrsToSend returns the encoded owners and modes kept beside the data at src
// (layout.AttrsFile), or nil when there are none, they do not parse, or they would not fit in
// the header beside a manifest of size bytes: the receiver then restores with its defaults.
func attrsToSend(src string, size int) []byte {
	_, enc, err := layout.ReadAttrsEncoded(src)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err == nil && size+len(enc) > maxMessage-messageOverhead {
		err = fmt.Errorf("%d bytes beside a manifest of %d: more than a header holds", len(enc), size)
	}
	if err != nil {
		slog.Warn("a replica goes without its owners and modes: the peer restores it as root's, 0644 and 0755", "data", filepath.Base(src), "err", err)
		return nil
	}
	return enc
}

// piece is a byte range of one file, sent by one stream.
type piece struct {
	file   int
	off, n int64
}

// share cuts the bytes of all files sent (not presumed), in manifest order, into count contiguous parts of nearly
// equal size, and returns part index: every stream reads its files sequentially, and one large
// file is spread over all streams. Empty files need no piece: checkManifest's receiver creates
// them.
func (m *manifest) share(index, count int) []piece {
	total := m.total
	if m.presumed != nil {
		total = m.sendTotal
	}
	start, end := mulDiv(total, index, count), mulDiv(total, index+1, count)
	var out []piece
	var pos int64 // start of file i in the concatenation of the files sent
	for i, f := range m.pb.Files {
		if !m.sent(i) {
			continue
		}
		lo, hi := max(start, pos), min(end, pos+f.Size)
		if lo < hi {
			out = append(out, piece{file: i, off: lo - pos, n: hi - lo})
		}
		pos += f.Size
		if pos >= end {
			break
		}
	}
	return out
}

// mulDiv returns total·i/n without overflow (total < 2^63, 0 ≤ i ≤ n).
func mulDiv(total int64, i, n int) int64 {
	hi, lo := bits.Mul64(uint64(total), uint64(i))
	q, _ := bits.Div64(hi, lo, uint64(n))
	return int64(q)
}
