package tiers

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"

	"github.com/mtcfs/mtcfs/layout"
)

// jobLines reports to the job: it appends lines to replicator.errors and replicator.failed
// (SPEC §2.3), from any stage, and keeps the last ones for status.
type jobLines struct {
	*node
	incs *incarnations

	// writeMu serialises appends: each rewrites the whole file (read, append, write).
	writeMu sync.Mutex
	mu      sync.Mutex
	recent  []reportedLine // GUARDED_BY(mu); the last lines reported, oldest first
	// unwritten holds, per file, lines whose write failed: the next write to it adds them.
	unwritten map[string]unwrittenLines // GUARDED_BY(mu)
}

// unwrittenLines are lines of the incarnation of cfg whose write failed.
type unwrittenLines struct {
	cfg   *Config
	lines []string
}

// reportedLine is a line reported to a job, kept for status.
type reportedLine struct{ job, line string }

// recentLines is how many reported lines status shows.
const recentLines = 20

// errLine appends a line to replicator.errors; failLine to replicator.failed (SPEC §2.3).
func (l *jobLines) errLine(cfg *Config, msg string) {
	l.appendLines(layout.ReplicatorErrorsName, "ERR", cfg, msg)
}

// errLines appends lines to replicator.errors in one write: the job reads and unlinks the file,
// and a line appended between its read and its unlink is lost (the next write replaces the file
// it then unlinks), so lines of one moment go together (a CI run lost two of a plan's three).
func (l *jobLines) errLines(cfg *Config, msgs []string) {
	if len(msgs) > 0 {
		l.appendLines(layout.ReplicatorErrorsName, "ERR", cfg, msgs...)
	}
}
func (l *jobLines) failLine(cfg *Config, msg string) {
	l.appendLines(layout.ReplicatorFailedName, "FATAL", cfg, msg)
}

// incLine reports an error of a background task of inc; once a newer incarnation started, the
// line only goes to the log, since the first line of the new incarnation's replicator.errors
// must be its own (SPEC §2).
func (l *jobLines) incLine(inc *incarnation, msg string) {
	if !l.incs.isCurrent(inc) {
		l.log.Error("error of an earlier incarnation", "incarnation", inc.ID, "line", msg)
		return
	}
	l.errLine(inc.Config, msg)
}

// maxLinesFile bounds replicator.errors and replicator.failed as the agent reads them back.
const maxLinesFile = 1 << 20

func (l *jobLines) appendLines(file, level string, cfg *Config, msgs ...string) {
	l.writeMu.Lock()
	defer l.writeMu.Unlock()
	job, rank, nodes := "?", "?", "?"
	if cfg != nil {
		if cfg.JobName != "" {
			job = cfg.JobName
		}
		if cfg.NodeRank >= 0 {
			rank = itoa(int64(cfg.NodeRank))
		}
		if cfg.Nodes >= 0 {
			nodes = itoa(int64(cfg.Nodes))
		}
	}
	var lines []string
	for _, msg := range msgs {
		lines = append(lines, fmt.Sprintf("%s job=%s node=%s/%s %s %s\n", l.now().UTC().Format("2006-01-02T15:04:05Z"), job, rank, nodes, level, oneLine(msg)))
	}
	// Lines a write failed for go first: they were said to be reported, and were lost (a
	// black-box run: the give-up line of a commit met the descriptor limit too).
	// Only the same incarnation's (the same Config): a line of an earlier one, or of another
	// job, is not the news of this one (SPEC §2; a review).
	l.mu.Lock()
	u := l.unwritten[file]
	delete(l.unwritten, file)
	l.mu.Unlock()
	if u.cfg != cfg && len(u.lines) > 0 {
		l.log.Error("lines of an earlier incarnation never written to "+file, "lines", u.lines)
		u.lines = nil
	}
	all := strings.Join(append(u.lines, lines...), "")
	// Read and written as one, in the headroom and with the spare descriptors: a read that
	// failed (out of descriptors) wrote the new lines over those the job had not read yet (a
	// review).
	werr := l.withRoom(func() error {
		return l.rewrite(file, func(old []byte, err error) ([]byte, bool, error) {
			switch {
			case errors.Is(err, syscall.EFBIG):
				// Unread for long (an Orbax job reads it at its restarts): the lines before go,
				// not every line from now on (a review: none was written any more).
				l.log.Warn(file+" passed its size limit unread: the lines before are dropped", "limit", maxLinesFile)
				old = fmt.Appendf(nil, "%s job=%s node=%s/%s %s the lines before this one were dropped: %s passed %d bytes unread\n",
					l.now().UTC().Format("2006-01-02T15:04:05Z"), job, rank, nodes, level, file, maxLinesFile)
			case err != nil && !errors.Is(err, os.ErrNotExist):
				return nil, false, fmt.Errorf("read: %w", err)
			}
			return append(old, all...), false, nil
		})
	})
	if werr != nil {
		l.log.Error("write "+file+": the lines are written with the next one", "err", werr, "lines", len(u.lines)+len(lines))
		u.cfg, u.lines = cfg, append(u.lines, lines...)
		if n := len(u.lines); n > recentLines {
			u.lines = u.lines[n-recentLines:]
		}
		l.mu.Lock()
		if l.unwritten == nil {
			l.unwritten = map[string]unwrittenLines{}
		}
		l.unwritten[file] = u
		l.mu.Unlock()
	}
	for i, msg := range msgs {
		// "line", not "message": that is the JSON log's key of the log message itself, and a
		// second one made the line invalid for strict parsers (an operator's black-box run).
		l.log.Warn("reported to the job", "file", file, "line", oneLine(msg), "written", werr == nil)
		l.mu.Lock()
		l.recent = append(l.recent, reportedLine{job, strings.TrimSpace(lines[i])})
		if len(l.recent) > recentLines {
			l.recent = l.recent[len(l.recent)-recentLines:]
		}
		l.mu.Unlock()
	}
}

// withdraw removes the lines of file that contain ours, and file with them if no other line is
// left; it reports whether it removed any.
func (l *jobLines) withdraw(file, ours string) bool {
	l.writeMu.Lock()
	defer l.writeMu.Unlock()
	removed := false
	err := l.withRoom(func() error {
		return l.rewrite(file, func(old []byte, err error) ([]byte, bool, error) {
			removed = false
			if err != nil {
				return nil, false, errNoChange
			}
			var keep []byte
			for line := range strings.Lines(string(old)) {
				if !strings.Contains(line, ours) {
					keep = append(keep, line...)
				}
			}
			if len(keep) == len(old) {
				return nil, false, errNoChange
			}
			removed = true
			return keep, len(keep) == 0, nil
		})
	})
	if errors.Is(err, errNoChange) {
		return false
	}
	if err != nil {
		l.log.Error("withdraw a line of "+file, "err", err)
		return false
	}
	return removed
}

// errNoChange: a rewrite's change has nothing to write.
var errNoChange = errors.New("no change")

// rewrite sets file to what change makes of its content (change gets the read's error: a file
// that does not exist has os.ErrNotExist; remove: no file), read and written as one against the
// job's unlink where the namespace allows it (ReportFiles): an unlink between the two had the
// job read the lines it had read once more. change may be called again. Caller holds writeMu.
func (l *jobLines) rewrite(file string, change func(old []byte, readErr error) (data []byte, remove bool, err error)) error {
	rf, versioned := l.ns.(ReportFiles)
	for try := 1; ; try++ {
		var old []byte
		var ver uint64
		var err error
		if versioned {
			old, ver, err = rf.ReadReport(file, maxLinesFile)
		} else {
			old, err = l.ns.ReadFile(file, maxLinesFile)
		}
		data, remove, err := change(old, err)
		if err != nil {
			return err
		}
		switch {
		case !versioned && remove:
			return l.ns.Remove(file)
		case !versioned:
			return l.ns.WriteFile(file, data)
		case remove:
			err = rf.RemoveReport(file, ver)
		default:
			err = rf.ReplaceReport(file, data, ver)
		}
		if !errors.Is(err, ErrReportChanged) || try == 50 {
			return err
		}
	}
}

// recentErrors returns the last lines reported to job (of every incarnation of it; another job's
// on the same mount are not its news).
func (l *jobLines) recentErrors(job string) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, r := range l.recent {
		if job == "" || r.job == job || r.job == "?" { // "?": a line before the job was known
			out = append(out, r.line)
		}
	}
	return out
}

// giveBack writes again lines of file that the job removed without having read them (they were
// added between its read and its unlink; see fs/reports.go), before the lines written since.
func (l *jobLines) giveBack(file string, lines []string) {
	l.writeMu.Lock()
	defer l.writeMu.Unlock()
	err := l.withRoom(func() error {
		return l.rewrite(file, func(old []byte, err error) ([]byte, bool, error) {
			if err != nil && !errors.Is(err, os.ErrNotExist) {
				return nil, false, fmt.Errorf("read: %w", err)
			}
			return append([]byte(strings.Join(lines, "")), old...), false, nil
		})
	})
	if err != nil {
		l.log.Error("write again lines of "+file+" the job removed unread: they are lost", "err", err, "lines", lines)
	}
}

// maxUnreadCarried bounds the lines takeUnread carries into a new incarnation.
const maxUnreadCarried = 20

// unreadLabel starts a line takeUnread carries.
const unreadLabel = "not read by the job before this start"

// takeUnread removes replicator.errors and replicator.failed, as every handshake does (SPEC
// §2.4), and returns what they held for job as lines for its new incarnation. The job unlinks
// what it reads, so whatever is left it never read: a NeMo or pytorch job reads them only at its
// restore, and every line of its run (a push refused, a save cut short by a kill) was removed
// unread at its next start (a black-box run: 5 of 5 lines). Lines of another job stay unsaid;
// so do the agent's restart notices (the new start is what they ask for), and lines carried
// once already (a job that never unlinks them got them again at every start). Past
// maxUnreadCarried, the fatal lines and the newest are kept (a review).
func (l *jobLines) takeUnread(job string) []string {
	l.writeMu.Lock()
	defer l.writeMu.Unlock()
	var fatal, errs []string
	for _, file := range []string{layout.ReplicatorFailedName, layout.ReplicatorErrorsName} {
		var data []byte
		l.rewrite(file, func(old []byte, err error) ([]byte, bool, error) {
			if errors.Is(err, os.ErrNotExist) {
				return nil, false, errNoChange
			}
			data = old // nil when unreadable: removed all the same
			return nil, true, nil
		})
		// Lines whose write failed are the job's unread news too: with the spool read-only for a
		// moment, the line saying a commit could not be sealed was never written, and the
		// restarted job restored the step before without a word (a black-box run).
		l.mu.Lock()
		u := l.unwritten[file]
		if u.cfg != nil && u.cfg.JobName == job {
			delete(l.unwritten, file)
		} else {
			u.lines = nil
		}
		l.mu.Unlock()
		text := string(data)
		if text != "" && !strings.HasSuffix(text, "\n") {
			text += "\n"
		}
		written := strings.Count(text, "\n") // the lines after these were never written
		for i, line := range slices.Collect(strings.Lines(text + strings.Join(u.lines, ""))) {
			// "<time> job=J node=R/N LEVEL message"
			f := strings.SplitN(strings.TrimSpace(line), " ", 5)
			if len(f) < 5 || f[1] != "job="+job || strings.HasPrefix(f[4], unreadLabel) || strings.HasPrefix(f[4], restartNotice) {
				continue
			}
			carried := fmt.Sprintf("%s (%s, written at %s): %s %s", unreadLabel, file, f[0], f[3], f[4])
			if i >= written {
				carried = fmt.Sprintf("%s (%s, which could not be written at %s): %s %s", unreadLabel, file, f[0], f[3], f[4])
			}
			if file == layout.ReplicatorFailedName {
				fatal = append(fatal, carried)
			} else {
				errs = append(errs, carried)
			}
		}
	}
	fatal = fatal[max(0, len(fatal)-maxUnreadCarried):]
	dropped := 0
	if room := maxUnreadCarried - len(fatal); len(errs) > room {
		dropped, errs = len(errs)-room, errs[len(errs)-room:]
	}
	out := append(fatal, errs...)
	if dropped > 0 {
		out = append(out, fmt.Sprintf("and %d earlier line(s) %s (the agent's log has them: \"reported to the job\")", dropped, unreadLabel))
	}
	if len(out) > 0 {
		l.log.Info("lines the job did not read before its new start are written again", "lines", len(out))
	}
	return out
}
