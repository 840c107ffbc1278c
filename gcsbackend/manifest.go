package gcsbackend

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
)

// manifestFormat versions the sidecar; a reader refuses formats it does not
// know rather than misjudging completeness. Readers ignore unknown fields, so
// adding one does not need a new version.
const manifestFormat = "mtcfs-manifest-v1"

// manifest is the content of <hash>.data.manifest: everything needed to tell
// whether <hash>.data is fully present and intact, and to rebuild the tree
// (including empty directories, which an object store cannot hold). Example:
//
//	{"format":"mtcfs-manifest-v1","kind":"dir","dirs":["state"],
//	 "files":[{"path":"state/a","size":12,"crc32c":"e3069283"}]}
//
// A single-file data has kind "file" and one entry with an empty path. The
// encoding is deterministic (sorted, no timestamps or node identity), so two
// nodes holding identical data write byte-identical manifests.
type manifest struct {
	Format string         `json:"format"`
	Kind   string         `json:"kind"` // "dir" or "file", matching the hash's D prefix
	Dirs   []string       `json:"dirs,omitempty"`
	Files  []manifestFile `json:"files"`
}

type manifestFile struct {
	Path   string    `json:"path"` // relative, "/"-separated; "" for kind "file"
	Size   int64     `json:"size"`
	CRC32C crc32cHex `json:"crc32c"`
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

func (m *manifest) encode() ([]byte, error) {
	data, err := json.Marshal(m)
	if err != nil {
		return nil, err
	}
	return append(data, '\n'), nil
}

// decodeManifest parses and checks the manifest of hash's data. A backup's
// content is untrusted input: every path is validated before Download uses
// it to create files.
func decodeManifest(data []byte, hash string) (*manifest, error) {
	var m manifest
	if err := json.Unmarshal(data, &m); err != nil {
		return nil, fmt.Errorf("manifest of %s: %w", hash, err)
	}
	if m.Format != manifestFormat {
		return nil, fmt.Errorf("manifest of %s: format %q, want %q", hash, m.Format, manifestFormat)
	}
	if m.Kind != kindOf(hash) {
		return nil, fmt.Errorf("manifest of %s: kind %q, but the hash names a %s", hash, m.Kind, kindOf(hash))
	}
	if m.Kind == kindFile {
		if len(m.Files) != 1 || m.Files[0].Path != "" || len(m.Dirs) != 0 {
			return nil, fmt.Errorf("manifest of %s: a single-file data needs exactly one entry with an empty path", hash)
		}
		return &m, nil
	}
	for _, d := range m.Dirs {
		if err := ValidateName(d); err != nil {
			return nil, fmt.Errorf("manifest of %s: directory: %w", hash, err)
		}
	}
	seen := make(map[string]bool, len(m.Files))
	for _, f := range m.Files {
		if err := ValidateName(f.Path); err != nil {
			return nil, fmt.Errorf("manifest of %s: file: %w", hash, err)
		}
		if seen[f.Path] {
			return nil, fmt.Errorf("manifest of %s: file %q listed twice", hash, f.Path)
		}
		if f.Size < 0 {
			return nil, fmt.Errorf("manifest of %s: file %q has negative size", hash, f.Path)
		}
		seen[f.Path] = true
	}
	return &m, nil
}

// total is the number of data bytes the manifest describes.
func (m *manifest) total() int64 {
	var n int64
	for _, f := range m.Files {
		n += f.Size
	}
	return n
}
