package tiers

import "github.com/mtcfs/mtcfs/layout"

// Namespace is the part of the mounted tree the replicator manages: the names at the top of
// CHECKPOINT_DIR. Package fs implements it over its inode tree. Every change is visible to the
// kernel (its caches invalidated) before the call returns. Never call it from a FUSE request's
// goroutine: invalidations wait for the kernel, which may be waiting for that request.
type Namespace interface {
	// List returns the top-level entries.
	List() ([]DirEntry, error)
	// ReadFile returns the content of a top-level regular file, at most limit bytes.
	ReadFile(name string, limit int64) ([]byte, error)
	// WriteFile atomically replaces (or creates) a top-level regular file.
	WriteFile(name string, data []byte) error
	// Symlink creates a top-level symlink, replacing whatever had the name.
	Symlink(target, name string) error
	// Rename renames a top-level entry, replacing a file or empty directory at newName.
	Rename(oldName, newName string) error
	// Remove deletes a top-level entry and everything below it; a missing name is not an error.
	Remove(name string) error
	// Export hard-links the tree at the top-level name into dst (a new directory inside the
	// spool) without copying bytes, and lists what it linked. A regular file at name is linked
	// as the file dst.
	Export(name, dst string) ([]layout.TreeEntry, error)
	// SpoolFile returns the spool file that holds the bytes of the regular file at path
	// ("a/b/c", relative to the top), for reading them without going through the mount.
	SpoolFile(path string) (string, error)
	// Import makes the spool tree at src (a file or a directory) visible as the top-level name,
	// sharing its bytes (hard links). It fails if name exists.
	Import(src, name string) error
}

// DirEntry is one top-level name.
type DirEntry struct {
	Name string
	Type layout.EntryType
}

// Events receives changes that the training job makes through the mount. Package fs calls it
// on FUSE request goroutines after the change is complete in the namespace: implementations
// record the event and return at once, and do the work on their own goroutine.
type Events interface {
	// Closed: the last reference to a handle opened for writing went away. path is relative
	// to the mount root ("a/b/c").
	Closed(path string)
	// Renamed: oldPath became newPath; typ is what was renamed.
	Renamed(oldPath, newPath string, typ layout.EntryType)
	// TooLarge: a write to path was refused with EFBIG (see WriteLimit).
	TooLarge(path string)
}

// WriteLimit is the size limit of a file created at the top-level name, 0 for none. Control
// files have limits so that a runaway writer cannot fill RAM; the fs layer also sends their
// bytes through the agent (no passthrough) so that it can enforce the limit.
func WriteLimit(name string) int64 {
	switch name {
	case "replicator.yaml", "replicator.yaml.tmp":
		return MaxConfigSize
	}
	return 0
}
