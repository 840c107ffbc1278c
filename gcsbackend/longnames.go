package gcsbackend

import (
	"encoding/hex"
	"unicode/utf8"

	"lukechampine.com/blake3"
)

// Object names for paths that cannot be stored as themselves (SPEC §10
// "Names": long object names are mapped, not refused).
//
// A file at <path> of hash's data is normally the object
// <job>/<backup>/<hash>.data/<path>. When that name cannot be an object name —
// longer than the store allows (1024 bytes, less the prefix of a gs:// store),
// not valid UTF-8, holding a control character (GCS refuses CR and LF), or
// holding a segment with the reserved temporary prefix — the file is stored
// as <job>/<backup>/<hash>.data.long/<64 hex digits of BLAKE3-256(path)>, and
// its manifest entry records that object name. "<hash>.data.long" is a
// sibling of "<hash>.data", so it cannot collide with any path of the tree.

// maxObjectName is GCS's limit on an object name, in bytes.
const maxObjectName = 1024

// nameBudgeter is implemented by stores that add to every name (a gs://
// prefix): maxName is the longest store name they can hold.
type nameBudgeter interface {
	maxName() int
}

func (b *Backups) nameBudget() int {
	if nb, ok := b.Store.(nameBudgeter); ok {
		return nb.maxName()
	}
	return maxObjectName
}

// longObject is the mapped object name of path in hash's data, relative to
// the backup.
func longObject(hash, path string) string {
	sum := blake3.Sum256([]byte(path))
	return hash + ".data.long/" + hex.EncodeToString(sum[:])
}

// mappedObject returns the object name to record in the manifest for the
// file at path, relative to the backup dir: "" when the plain name
// dir+<hash>.data/<path> can be stored, else longObject(hash, path).
func mappedObject(dir, hash, path string, budget int) string {
	full := dir + dataObject(hash, path)
	if len(full) <= budget && portableName(full) && ValidateName(full) == nil {
		return ""
	}
	return longObject(hash, path)
}

// portableName reports whether every store takes name as it is: valid UTF-8
// without control characters.
func portableName(name string) bool {
	if !utf8.ValidString(name) {
		return false
	}
	for _, r := range name {
		if r < 0x20 || r == 0x7f || (r >= 0x80 && r < 0xa0) {
			return false
		}
	}
	return true
}
