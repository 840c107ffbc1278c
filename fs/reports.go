package fs

import (
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"

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
	// prev is the version this one replaced, and so on back, up to reportChain versions: the
	// job may open one of them after it was replaced (its lookup came first), and read it
	// (a review: cut after one version, lines of two replacements during one read were lost).
	// readBefore, at the end of the chain, is the lines of the newest version before it the job
	// opened (nil: none).
	prev       *reportState        // GUARDED_BY(mu)
	readBefore map[uint64]struct{} // GUARDED_BY(mu)
}

// reportChain bounds the versions a report file's newest version remembers.
const reportChain = 16

func lineHash(l string) uint64 { return xxhash.Sum64String(strings.TrimRight(l, "\n")) }

func newReportState(data []byte, old *reportState) *reportState {
	rs := &reportState{lines: map[uint64]struct{}{}, prev: old}
	for l := range strings.Lines(string(data)) {
		rs.lines[lineHash(l)] = struct{}{}
	}
	// The chain past reportChain versions ends in what it had read.
	cur := rs
	for i := 0; cur != nil && i < reportChain; i++ {
		cur.mu.Lock()
		next := cur.prev
		cur.mu.Unlock()
		cur = next
	}
	if cur != nil {
		cur.mu.Lock()
		cur.readBefore, cur.prev = cur.readSetLocked(), nil
		cur.mu.Unlock()
	}
	return rs
}

// readSetLocked is readSet of rs, whose mu the caller holds.
func (rs *reportState) readSetLocked() map[uint64]struct{} {
	if rs.opened.Load() {
		return rs.lines
	}
	if rs.prev != nil {
		return rs.prev.readSet()
	}
	return rs.readBefore
}

// readSet is the lines of the newest version up to rs that the job opened (nil: none).
func (rs *reportState) readSet() map[uint64]struct{} {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	return rs.readSetLocked()
}

// unread returns the lines of data, the content of the version rs, that the job did not read
// when it unlinked rs; none when it opened rs itself, or no version before it.
func (rs *reportState) unread(data []byte) []string {
	read := rs.readSet()
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

// The agent's read and rewrite of a report file go as one against the job's unlink: read with
// ReadReport, written with ReplaceReport or RemoveReport only if the name still holds the
// version read (reportMu orders them with Unlink's removal of the name). Read, then unlinked
// by the job, then written with the new line, the file gave the job the lines it had read once
// more (a black-box run: 10 to 90 lines read twice in tight read loops).

// reportVersion names this node among the report files (never 0).
func (f *fileNode) reportVersion() uint64 {
	if v := f.reportVer.Load(); v != 0 {
		return v
	}
	f.reportVer.CompareAndSwap(0, f.fs.nextReportVer.Add(1))
	return f.reportVer.Load()
}

// currentReport returns the node at the report name and its version (0: no file; a symlink or
// special file the job made there counts as none, as WriteFile replaces it). Caller holds
// reportMu.
func (ns *namespace) currentReport(name string) (*gofs.Inode, *fileNode, uint64, error) {
	ch := ns.root.GetChild(name)
	if ch == nil {
		return nil, nil, 0, nil
	}
	if ch.IsDir() {
		return ch, nil, 0, fmt.Errorf("replace %s: %w", name, syscall.EISDIR)
	}
	fn, ok := ch.Operations().(*fileNode)
	if !ok {
		return ch, nil, 0, nil
	}
	return ch, fn, fn.reportVersion(), nil
}

// ReadReport is ReadFile for a report file, with the version read (0: none, and
// os.ErrNotExist).
func (ns *namespace) ReadReport(name string, limit int64) ([]byte, uint64, error) {
	ns.m.reportMu.Lock()
	_, fn, ver, err := ns.currentReport(name)
	ns.m.reportMu.Unlock()
	if err != nil || fn == nil {
		return nil, 0, fmt.Errorf("read %s: %w", name, os.ErrNotExist)
	}
	data, err := fn.readAll(name, limit) // the node of that version, whatever is there now
	return data, ver, err
}

// ReplaceReport writes data as the report file name if the name still holds version (0: no
// file); otherwise it returns tiers.ErrReportChanged and changes nothing.
func (ns *namespace) ReplaceReport(name string, data []byte, version uint64) error {
	return ns.replaceReport(name, data, version, true)
}

// replaceReport writes data as the report file name; when check is set, only if the name still
// holds version.
func (ns *namespace) replaceReport(name string, data []byte, version uint64, check bool) error {
	fn, ch, err := ns.newAgentFile(name, data)
	if err != nil {
		return err
	}
	ns.m.reportMu.Lock()
	old, ofn, ver, err := ns.currentReport(name)
	if err == nil && check && ver != version {
		err = tiers.ErrReportChanged
	}
	if err != nil {
		ns.m.reportMu.Unlock()
		fn.dropLink()
		return err
	}
	var prev *reportState
	if ofn != nil {
		prev = ofn.report
	}
	fn.report = newReportState(data, prev)
	ns.root.AddChild(name, ch, true)
	ns.m.reportMu.Unlock()
	ns.m.sealedTop.Delete(name)
	ns.changed(name)
	if ofn != nil {
		ofn.replacedByAgent()
	} else if old != nil {
		dropped(old)
	}
	return nil
}

// RemoveReport removes the report file name if it still holds version; otherwise it returns
// tiers.ErrReportChanged.
func (ns *namespace) RemoveReport(name string, version uint64) error {
	ns.m.reportMu.Lock()
	ch, _, ver, err := ns.currentReport(name)
	if err == nil && ver != version {
		err = tiers.ErrReportChanged
	}
	if err != nil || ch == nil {
		ns.m.reportMu.Unlock()
		return err
	}
	ns.root.RmChildIf(name, ch)
	ns.m.reportMu.Unlock()
	ns.entryGone(ns.root.EmbeddedInode(), name, ch)
	dropped(ch)
	return nil
}

var _ tiers.ReportFiles = (*namespace)(nil)

// ReadControl is ReadFile for a control file, with its version (tiers.ControlFiles).
func (ns *namespace) ReadControl(name string, limit int64) ([]byte, tiers.ControlVersion, error) {
	_, fn, ok := ns.controlFile(name)
	if !ok {
		return nil, tiers.ControlVersion{}, fmt.Errorf("read %s: %w", name, os.ErrNotExist)
	}
	v := fn.controlVersion()
	data, err := fn.readAll(name, limit)
	return data, v, err
}

// RemoveControl removes the control file name if it still holds v (tiers.ControlFiles).
func (ns *namespace) RemoveControl(name string, v tiers.ControlVersion) error {
	ns.m.controlMu.Lock() // no writable open between the check and the removal
	defer ns.m.controlMu.Unlock()
	ch, fn, ok := ns.controlFile(name)
	if !ok {
		return nil
	}
	if now := fn.controlVersion(); now.Node != v.Node || now.Changes != v.Changes {
		return tiers.ErrReportChanged
	}
	if !ns.root.RmChildIf(name, ch) { // replaced meanwhile (a rename onto it): the new one stays
		return tiers.ErrReportChanged
	}
	ns.entryGone(ns.root.EmbeddedInode(), name, ch)
	dropped(ch)
	return nil
}

// controlFile returns the file at the top-level name.
func (ns *namespace) controlFile(name string) (*gofs.Inode, *fileNode, bool) {
	ch := ns.root.GetChild(name)
	if ch == nil {
		return nil, nil, false
	}
	fn, ok := ch.Operations().(*fileNode)
	return ch, fn, ok
}

// controlVersion is the version of f as a control file.
func (f *fileNode) controlVersion() tiers.ControlVersion {
	f.mu.Lock()
	writing := f.writers > 0
	f.mu.Unlock()
	return tiers.ControlVersion{Node: f.reportVersion(), Changes: f.ctlChanges.Load(), Writing: writing}
}

var _ tiers.ControlFiles = (*namespace)(nil)
