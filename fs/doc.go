// Package fs is the FUSE adapter of mtcfs: it serves the checkpoint namespace at CHECKPOINT_DIR
// with go-fuse and keeps every regular file's bytes in a backing file of the RAM tier
// (tiers.Spool). It holds no checkpoint policy; the replicator logic lives in package tiers.
//
// # Data path
//
// Directories, symlinks, permissions and extended attributes live in the go-fuse inode tree
// (persistent inodes: the tree is the namespace, the kernel forgetting an inode loses nothing).
// A regular file's size, times and bytes live in its spool file. When the kernel and privileges
// allow it, opens use FUSE passthrough: reads, writes and mmap go from the kernel straight to the
// spool file on tmpfs and the agent never sees the bytes. Otherwise (fallback) writes arrive as
// FUSE requests and go to the spool file with pwrite; reads are spliced from the spool file; the
// page cache is kept across opens (FOPEN_KEEP_CACHE) because nobody else changes the bytes.
//
// # Caching
//
// Entries, attributes and negative lookups are cached by the kernel for the timeouts in Options.
// Every namespace change made by the agent itself (not through a FUSE request) must go through
// the Notify* calls of go-fuse so the kernel drops what it cached.
//
// # Deadlocks and contexts
//
// The agent process must never touch its own mount (a FUSE request served by the process that
// waits on it deadlocks, and a SIGKILL that lands during such a wait leaves the process
// unkillable, its mount hung). That is why Mount skips go-fuse's poll hack, an open of the
// mount from the mounting process, unless Options.InProcess asks for it (tests, which open
// files on their own mount). For the same reason the notifications that take a directory's
// lock in the kernel are written by a helper process (notifier.go). Request contexts are cancelled when the caller is interrupted; work
// that outlives a request is started on the agent's own context, never on the request's.
//
// # Errors
//
// All errors leave this package through toErrno (errno.go); anything unexpected becomes EIO and
// is logged, never ENOSYS.
package fs
