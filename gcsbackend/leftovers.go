package gcsbackend

// Leftovers of interrupted writes (SPEC §10: "leftovers of a cut-short
// backup are removed by the next agent").
//
// Every write that goes through a temporary name — a file:// Put's
// temporary file beside the object, a gs:// composite upload's part objects
// under <job>/.mtcfs-tmp-…/ — names it after its writer:
//
//	.mtcfs-tmp-<host>-<pid>-<start>-<random>
//
// host is 16 hex digits of BLAKE3(boot id, pid namespace): two processes
// with the same host tag see each other's pids. pid and start (the
// process's start time in clock ticks since boot, /proc/<pid>/stat) name
// the writing process; start tells a reused pid from the writer.
//
// CleanLeftovers removes a temporary when its writer is provably gone, and
// never otherwise:
//   - same host tag: removed when the pid does not exist or now belongs to a
//     process with another start time; kept while the writer lives,
//     however old the temporary is;
//   - another host tag (another machine, container or boot), or a name
//     without one (written by an earlier version, or without /proc): removed
//     when nothing of it was written for Backups.LeftoverAge (default 1 h).
//     A live upload writes its temporaries continuously (GCS parts, each
//     bounded by the stall timeout and retries; file:// streams its one
//     temporary file and links it at once), so a temporary idle that long
//     has no writer. Should a stalled writer wake up after that, its
//     publish step finds the temporary gone and fails, and the upload is
//     retried: nothing incomplete is ever published.
//
// Removing a temporary never touches an object: temporaries are hidden from
// List and Stat, and their names are not valid object names.

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"lukechampine.com/blake3"
)

// DefaultLeftoverAge is how long a temporary of a writer whose liveness
// cannot be checked must have been idle before CleanLeftovers removes it.
const DefaultLeftoverAge = time.Hour

// writer identifies a process in temporary names.
type writer struct {
	host  string // 16 hex digits; "" when unknown
	pid   int
	start uint64
}

// self is this process, read once.
var self = sync.OnceValue(func() writer {
	w := writer{pid: os.Getpid()}
	start, ok := procStart(w.pid)
	host, hok := hostTag()
	if ok && hok {
		w.host, w.start = host, start
	}
	return w
})

// hostTag identifies the set of processes whose pids this one can check:
// same kernel boot, same pid namespace.
func hostTag() (string, bool) {
	boot, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil || len(bytes.TrimSpace(boot)) == 0 {
		return "", false
	}
	ns, err := os.Readlink("/proc/self/ns/pid")
	if err != nil || ns == "" {
		return "", false
	}
	sum := blake3.Sum256([]byte(string(bytes.TrimSpace(boot)) + "\x00" + ns))
	return hex.EncodeToString(sum[:8]), true
}

// procStart returns the start time of process pid (field 22 of
// /proc/<pid>/stat, in clock ticks since boot).
func procStart(pid int) (uint64, bool) {
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, false
	}
	// The command name (field 2) is in parentheses and may hold anything.
	i := bytes.LastIndexByte(data, ')')
	if i < 0 {
		return 0, false
	}
	fields := strings.Fields(string(data[i+1:]))
	if len(fields) < 20 { // fields 3.. follow the name; starttime is 22
		return 0, false
	}
	v, err := strconv.ParseUint(fields[19], 10, 64)
	return v, err == nil
}

// newTempName returns a fresh temporary name segment owned by this process.
func newTempName() string {
	var rnd [8]byte
	rand.Read(rnd[:]) // never fails
	w := self()
	if w.host == "" {
		return tempPrefix + hex.EncodeToString(rnd[:])
	}
	return fmt.Sprintf("%s%s-%d-%d-%s", tempPrefix, w.host, w.pid, w.start, hex.EncodeToString(rnd[:]))
}

// parseTempName returns the writer a temporary name segment records.
func parseTempName(seg string) (writer, bool) {
	rest, ok := strings.CutPrefix(seg, tempPrefix)
	if !ok {
		return writer{}, false
	}
	parts := strings.Split(rest, "-")
	if len(parts) != 4 || len(parts[0]) != 16 || !isHex(parts[0]) || !isHex(parts[3]) {
		return writer{}, false
	}
	pid, err := strconv.Atoi(parts[1])
	if err != nil || pid <= 0 || parts[1] != strconv.Itoa(pid) {
		return writer{}, false
	}
	start, err := strconv.ParseUint(parts[2], 10, 64)
	if err != nil {
		return writer{}, false
	}
	return writer{host: parts[0], pid: pid, start: start}, true
}

func isHex(s string) bool {
	_, err := hex.DecodeString(s)
	return err == nil && s != ""
}

// alive reports whether the process w may still be running. Only called for
// a writer with this process's host tag.
func (w writer) alive() bool {
	err := unix.Kill(w.pid, 0)
	if errors.Is(err, unix.ESRCH) {
		return false
	}
	// It exists (EPERM: another user's). Same pid, other start: reused.
	if start, ok := procStart(w.pid); ok && start != w.start {
		return false
	}
	return true
}

// temporary is what one interrupted or running write may have left: a
// file:// temporary file, or the part objects of one gs:// upload.
type temporary struct {
	seg    string    // the temporary name segment, naming the writer
	newest time.Time // when any of it was last written
	keys   []string  // the store's own locations of its files or objects
}

// tempStore is implemented by stores whose writes go through temporaries.
type tempStore interface {
	// temporaries lists the temporaries that writes of objects under dir
	// (a store name ending in "/") may have left.
	temporaries(ctx context.Context, dir string) ([]temporary, error)
	// removeTemporary deletes t's files or objects (missing ones are not
	// an error) and returns how many it deleted.
	removeTemporary(ctx context.Context, t temporary) (int, error)
}

// garbage decides whether t has no writer any more (see the rules above).
func garbage(t temporary, now time.Time, maxAge time.Duration) bool {
	if w, ok := parseTempName(t.seg); ok && w.host == self().host && self().host != "" {
		return !w.alive()
	}
	return now.Sub(t.newest) > maxAge
}

// CleanLeftovers removes the temporary files (file://) or objects (gs://)
// under job's part of the store that writers which are gone left behind:
// kill -9 or a crash during a backup, a registration or a pin. On gs:// it
// also removes temporary areas that earlier versions wrote at the store's
// root, by age. Uploads still running in any process, on this machine or
// another, are not disturbed (rules at the top of leftovers.go). It returns
// the number of files or objects removed. Safe to call concurrently with
// uploads and with other CleanLeftovers.
func (b *Backups) CleanLeftovers(ctx context.Context, job string) (removed int, err error) {
	if err := validateJob(job); err != nil {
		return 0, err
	}
	ts, ok := b.Store.(tempStore)
	if !ok {
		return 0, nil
	}
	temps, err := ts.temporaries(ctx, job+"/")
	if err != nil {
		return 0, fmt.Errorf("clean leftovers of %s: %w", job, err)
	}
	now := time.Now()
	if b.now != nil {
		now = b.now()
	}
	maxAge := b.LeftoverAge
	if maxAge <= 0 {
		maxAge = DefaultLeftoverAge
	}
	var errs []error
	for _, t := range temps {
		if err := ctx.Err(); err != nil {
			return removed, err
		}
		if !garbage(t, now, maxAge) {
			continue
		}
		n, err := ts.removeTemporary(ctx, t)
		removed += n
		if err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return removed, fmt.Errorf("clean leftovers of %s: %w", job, err)
	}
	return removed, nil
}
