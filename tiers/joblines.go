package tiers

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"

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
	unwritten map[string][]string // GUARDED_BY(mu)
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
		l.log.Error("error of an earlier incarnation", "incarnation", inc.ID, "message", msg)
		return
	}
	l.errLine(inc.Config, msg)
}

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
	l.mu.Lock()
	unwritten := l.unwritten[file]
	delete(l.unwritten, file)
	l.mu.Unlock()
	old, err := l.ns.ReadFile(file, 1<<20)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		l.log.Error("read "+file, "err", err)
	}
	werr := l.writeFile(file, append(old, strings.Join(append(unwritten, lines...), "")...))
	if werr != nil {
		l.log.Error("write "+file+": the lines are written with the next one", "err", werr, "lines", len(unwritten)+len(lines))
		l.mu.Lock()
		if l.unwritten == nil {
			l.unwritten = map[string][]string{}
		}
		l.unwritten[file] = append(unwritten, lines...)
		if n := len(l.unwritten[file]); n > recentLines {
			l.unwritten[file] = l.unwritten[file][n-recentLines:]
		}
		l.mu.Unlock()
	}
	for i, msg := range msgs {
		l.log.Warn("reported to the job", "file", file, "message", oneLine(msg), "written", werr == nil)
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
	old, err := l.ns.ReadFile(file, 1<<20)
	if err != nil {
		return false
	}
	var keep []byte
	for line := range strings.Lines(string(old)) {
		if !strings.Contains(line, ours) {
			keep = append(keep, line...)
		}
	}
	switch {
	case len(keep) == len(old):
		return false
	case len(keep) == 0:
		err = l.ns.Remove(file)
	default:
		err = l.writeFile(file, keep)
	}
	if err != nil {
		l.log.Error("withdraw a line of "+file, "err", err)
		return false
	}
	return true
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
