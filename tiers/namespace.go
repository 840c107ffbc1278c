package tiers

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/mtcfs/mtcfs/layout"
)

// Namespace is the part of the mounted tree the replicator manages: the names at the top of
// CHECKPOINT_DIR. Package fs implements it over its inode tree. Every change is visible to the
// kernel (its caches invalidated) before the call returns. Never call it from a FUSE request's
// goroutine — invalidations wait for the kernel, which may be waiting for that request — except
// Seal, which makes no invalidation.
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
	// Seal makes the tree at the top-level name a committed checkpoint: from now on the job can
	// change nothing in it (EROFS), and it is hard-linked into dst (a new path inside the spool)
	// without copying bytes — except files still open for writing, which are copied so that
	// writes through those descriptors cannot reach the checkpoint. A regular file at name
	// becomes the file dst. Seal may run on a FUSE request's goroutine: the replicator records
	// a commit with it before the job's rename (or close) returns.
	Seal(name, dst string) (SealInfo, error)
	// HoldSpoolFile returns the spool file that holds the bytes of the regular file at path
	// ("a/b/c", relative to the top), for reading them without going through the mount, with a
	// context derived from ctx that ends when the file loses its last name: the reads must stop
	// then, and end must be called once they are done (it may be called more than once). Until
	// then a job that deletes the file and writes again waits for the end (SPEC §10: space
	// returns at once; a descriptor of the agent's kept the bytes on tmpfs).
	HoldSpoolFile(ctx context.Context, path string) (spoolPath string, held context.Context, end func(), err error)
	// Import makes the spool tree at src (a file or a directory) visible as the top-level name,
	// sharing its bytes (src's own files, or hard links of them), immutable to the job like a
	// sealed tree: src must stay until the name is removed. It fails with ErrNameTaken if name
	// exists. Its entries take the owners and modes layout.AttrsFile(src) records, if it
	// exists; else the agent's (0644 files, 0755 directories).
	Import(src, name string) error
	// ImportVerified is Import of data not verified yet: verify runs while the tree is built,
	// and the name appears only if it returns nil; else ImportVerified returns verify's error
	// and leaves nothing behind. verify gets the listing of src the tree is built from
	// (layout.ListTreeUnsized's: regular files' sizes are -1), to hash what is imported without
	// listing it again, or nil when src is not a directory or holds nothing (verify then reads
	// src itself); when it gets a listing it must fill in the entries' digests and sizes
	// (layout.HashEntries, VerifyListed do).
	ImportVerified(src, name string, verify func(listing []layout.TreeEntry) error) error
	// Owner returns the owner and group of the top-level name (for a file the job made, the
	// job's user and group).
	Owner(name string) (uid, gid uint32, err error)
	// Reown gives the entries of the top-level name that saved (its kept layout.Attrs; nil: the
	// entries' current owners) says belong to the saved top's owner to uid, and every other
	// entry its saved owner; groups and modes stay. A checkpoint restored for a job that runs as
	// another user than the one that saved it is then that job's, as saved for a job of the
	// saving user. It returns how many entries changed owner.
	Reown(name string, saved *layout.Attrs, uid uint32) (int, error)
}

// ErrNameTaken is the error (wrapped) of an Import or ImportVerified whose name exists already.
// It is an os.ErrExist, but other failures of an import can be too (a link whose new name was
// taken): only this one says that the name is there.
// ReportFiles is implemented by namespaces that rewrite a report file (replicator.errors,
// replicator.failed) only if it is still the version the agent read: the job reads such a file
// and unlinks it, and an unlink between the agent's read and its write had the job read the
// same lines again. Versions are never 0; 0 stands for no file.
type ReportFiles interface {
	ReadReport(name string, limit int64) (data []byte, version uint64, err error)
	ReplaceReport(name string, data []byte, version uint64) error
	RemoveReport(name string, version uint64) error
}

// AgentFilesOwner is implemented by namespaces whose entries have owners: the files and
// symlinks the agent makes at the top (restore markers, reports, prerestore, .meta) get
// uid:gid, the job's user, from the handshake on. In a sticky mount root only an entry's owner
// may rename or remove it, and the job renames its marker and unlinks its reports.
type AgentFilesOwner interface {
	OwnAgentFiles(uid, gid uint32)
}

// RootOwned is implemented by namespaces whose root has an owner: a step restored for a job
// that runs as another user than the one that saved it is given to the job's user only when
// that user owns the mount root. Anyone who may write the mount root may write a
// replicator.yaml: another user of a group-writable root got a job's private (0600) checkpoint
// given to them that way (black-box h57).
type RootOwned interface {
	RootOwner() uint32
}

// MisplacedYAML is implemented by namespaces that can answer a replicator.yaml written into a
// directory of the mount instead of its root: a job whose CHECKPOINT_DIR was a directory inside
// the mount waited 300 s for an answer that never came, and its "commits" there were none
// (black-box h59).
type MisplacedYAML interface {
	// AnswerMisplaced removes dir/yamlName and writes failed as dir/failedName.
	AnswerMisplaced(dir, yamlName, failedName string, failed []byte) error
}

// ControlFiles is implemented by namespaces that tell the version of a control file
// (replicator.yaml) read, so that the handshake removes only the yaml it answered: a job that
// wrote the file again in place at once (NeMo writes it directly) had its second yaml removed
// unanswered, without a word (black-box h59: 10 of 10).
type ControlFiles interface {
	// ReadControl is ReadFile, with the version read.
	ReadControl(name string, limit int64) (data []byte, v ControlVersion, err error)
	// RemoveControl removes name if it still holds v; otherwise it returns ErrReportChanged
	// and removes nothing.
	RemoveControl(name string, v ControlVersion) error
}

// ControlVersion is a version of a control file: the file (Node) and how many times its bytes
// changed (Changes). Writing: a handle that may write it is open (its last close is reported).
type ControlVersion struct {
	Node, Changes uint64
	Writing       bool
}

// ErrReportChanged: the report file is no longer the version read.
var ErrReportChanged = errors.New("the report file changed since it was read")

var ErrNameTaken = fmt.Errorf("the name exists in the namespace: %w", os.ErrExist)

// SealInfo says what Seal did besides linking.
type SealInfo struct {
	// Copied counts files that were open for writing and were copied: the job's tree then
	// diverges from the checkpoint, whose namespace entry must be rebuilt from the sealed copy.
	Copied int
	// CopiedExample is the path of one of the copied files, from the namespace's root.
	CopiedExample string
	// Xattrs counts the entries that have extended attributes, which a checkpoint does not keep.
	Xattrs int
	// Attrs are the owners and modes of the sealed entries (nil: the namespace keeps none).
	Attrs *layout.Attrs
	// OpenAfterCommit, for a file linked (not copied) at the close that committed it, reports
	// whether, after waiting up to wait, that close's descriptor is still open (a duplicate of
	// it, a forked child, a shared mapping): with passthrough its writes change the linked
	// bytes, so the sealer copies them first. nil: nothing can change them.
	OpenAfterCommit func(wait time.Duration) bool
	// StillOpen: the file was copied by the sealer because OpenAfterCommit said so (Copied is 1).
	StillOpen bool
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
	// Opened: the job opened (or created) a file, for writing when writing is set; Closed
	// follows when a handle open for writing goes away. Pushes yield to the job's saves with
	// these, and the early hashing of closed files to any use of the mount (yield.go).
	Opened(writing bool)
	// Closed: the last reference to a handle opened for writing went away. path is relative
	// to the mount root ("a/b/c").
	Closed(path string)
	// Renamed: oldPath became newPath; typ is what was renamed.
	Renamed(oldPath, newPath string, typ layout.EntryType)
	// TooLarge: a write to path was refused with EFBIG (see WriteLimit).
	TooLarge(path string)
	// Created: the job made path, of type typ, whole in one call (mkdir, symlink, mknod, link):
	// reported for top-level names only.
	Created(path string, typ layout.EntryType)
	// Flushed: the job closed a descriptor of path, opened for writing, where CommitsOnClose
	// said so, and no close committed that file before. It is called synchronously, before
	// close(2) returns to the job.
	Flushed(path string)
	// Abandoned replaces Flushed and Closed for such a descriptor whose file is known to be cut
	// short, why says how (the kernel closed it for the writer a signal killed, or it is a zip
	// its writer did not finish): its close is not a commit.
	Abandoned(path, why string)
}

// CommitsOnClose reports whether closing the top-level name after writing it may commit a step
// (framework pytorch's "<job>-sS-nR-wW.save" files): the fs layer then lets the kernel tell it
// about each close (FLUSH) instead of only the asynchronous release, so that the commit is
// recorded before close(2) returns.
func CommitsOnClose(name string) bool {
	m, ok := layout.ParseMarkerName(name)
	return ok && m.Kind == layout.MarkerSave
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
