package fs

import (
	"os"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/cespare/xxhash/v2"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/tiers"
)

// Report files (replicator.errors, replicator.failed) are the agent's lines to the job: the job
// reads such a file and unlinks it (SPEC §2.3; MaxText's replicator_error_handler, NeMo's
// handle_replicator_fail_situation). The agent adds a line by writing the file anew in its place
// (a new node, the old content and the line), so a line added between the job's read and its
// unlink was unlinked unread: the job was never told (a clean-clone CI run, twice: a line of a
// refused replica came 16 ms after the restore's lines).
//
// Each version the agent writes remembers its lines (as hashes) and whether the job opened it,
// and the lines of the newest version before it that the job opened. When the job unlinks a
// version it never opened, having opened an earlier one, the lines it did not read go back to
// the agent (UnreadLines) once the unlink is done, and the agent writes them again. A job that
// read no version of the file, and removes it, removes it.

// UnreadLines is implemented by a mount's Events that take back the lines of a report file the
// job unlinked without having read them; they are handed over after the unlink, oldest first,
// with their newlines.
type UnreadLines interface {
	Unread(name string, lines []string)
}

// isReportName reports whether the top-level name is one of the agent's report files.
func isReportName(name string) bool {
	return name == layout.ReplicatorErrorsName || name == layout.ReplicatorFailedName
}

// reportState is what a version of a report file the agent wrote remembers.
type reportState struct {
	lines  map[uint64]struct{} // hashes of its lines
	opened atomic.Bool         // the job (or anyone through the mount) opened it

	mu sync.Mutex
	// prev is the version this one replaced (read when this one is unlinked: the job may have
	// opened it just before the replacement); readBefore the lines of the newest version
	// before prev that was opened (nil: none).
	prev       *reportState        // GUARDED_BY(mu)
	readBefore map[uint64]struct{} // GUARDED_BY(mu)
}

func lineHash(l string) uint64 { return xxhash.Sum64String(strings.TrimRight(l, "\n")) }

func newReportState(data []byte, old *reportState) *reportState {
	rs := &reportState{lines: map[uint64]struct{}{}}
	for l := range strings.Lines(string(data)) {
		rs.lines[lineHash(l)] = struct{}{}
	}
	if old != nil {
		old.mu.Lock()
		rs.prev, rs.readBefore = old, old.readSet()
		old.prev = nil // no longer needed: old has no name left to be unlinked under
		old.mu.Unlock()
	}
	return rs
}

// readSet is the lines of the newest version up to rs that the job opened (nil: none). Caller
// holds rs.mu.
func (rs *reportState) readSet() map[uint64]struct{} {
	switch {
	case rs.opened.Load():
		return rs.lines
	case rs.prev != nil && rs.prev.opened.Load():
		return rs.prev.lines
	}
	return rs.readBefore
}

// unread returns the lines of data, the content of the version rs, that the job did not read
// when it unlinked rs; none when it opened rs itself, or no version before it.
func (rs *reportState) unread(data []byte) []string {
	rs.mu.Lock()
	read := rs.readSet()
	rs.mu.Unlock()
	if read == nil || rs.opened.Load() {
		return nil
	}
	var out []string
	for l := range strings.Lines(string(data)) {
		if _, ok := read[lineHash(l)]; !ok && strings.TrimSpace(l) != "" {
			if !strings.HasSuffix(l, "\n") {
				l += "\n"
			}
			out = append(out, l)
		}
	}
	return out
}

// giveBackUnread hands lines of the report file name that the job unlinked unread to the
// mount's Events (the name is gone: Unlink removed it). Not on the request's goroutine, nor with
// its context: the agent writes the file again through the namespace.
func (d *dirNode) giveBackUnread(name string, lines []string) {
	u, ok := d.fs.events.(UnreadLines)
	if !ok || len(lines) == 0 {
		return
	}
	go func() {
		d.fs.log.Warn("the job removed "+name+" with lines it had not read (added after its read): they are written again", "lines", len(lines))
		u.Unread(name, lines)
	}()
}

// unreadReport returns the lines of the report file f the job did not read (reportState.unread).
func (f *fileNode) unreadReport() []string {
	if f.report.opened.Load() {
		return nil
	}
	f.mu.Lock()
	p := f.backing
	f.mu.Unlock()
	if p == "" {
		return nil
	}
	data, err := os.ReadFile(p)
	if err != nil {
		f.fs.log.Warn("reading a report file the job removed", "err", err)
		return nil
	}
	return f.report.unread(data)
}

var _ UnreadLines = (*tiers.Replicator)(nil)
