package jobsim

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"
)

// The names of CHECKPOINT_DIR (SPEC §1) as the clients hard-code them.
const (
	yamlName       = "replicator.yaml"
	yamlTmpName    = "replicator.yaml.tmp"
	errorsName     = "replicator.errors"
	failedName     = "replicator.failed"
	prerestoreName = "replicator.prerestore"
	jaxInitName    = "jax-init-info.txt"
	orbaxTmpSuffix = ".orbax-checkpoint-tmp"
	restoreSuffix  = ".restore"
)

// The real clients' defaults.
const (
	defaultPoll           = time.Second
	defaultTimeout        = 300 * time.Second
	defaultBackupInterval = 30 // minutes
)

// ErrTimeout is wrapped by every error of a wait that gave up; the message says what was
// awaited and for how long.
var ErrTimeout = errors.New("timed out")

// FatalError is how a client ends when it finds replicator.failed: it has read and unlinked the
// file, and Lines are its non-empty lines (possibly none: the file's presence alone is fatal,
// as in MaxText).
type FatalError struct {
	Lines []string
}

func (e *FatalError) Error() string {
	if len(e.Lines) == 0 {
		return "replicator fatal error: " + failedName + " present but empty"
	}
	return "replicator fatal error in " + failedName + ": " + strings.Join(e.Lines, " | ")
}

// session holds what every wait and status check of one client call needs.
type session struct {
	dir     string
	poll    time.Duration
	timeout time.Duration
	logf    func(format string, args ...any)
	errs    *[]string // lines consumed from replicator.errors, kept for the caller
}

func newSession(dir string, poll, timeout time.Duration, logf func(string, ...any), prefix string, errs *[]string) (session, error) {
	if dir == "" {
		return session{}, errors.New("jobsim: Dir is empty")
	}
	if poll <= 0 {
		poll = defaultPoll
	}
	if timeout <= 0 {
		timeout = defaultTimeout
	}
	out := func(string, ...any) {}
	if logf != nil {
		out = func(format string, args ...any) { logf(prefix+format, args...) }
	}
	return session{dir: dir, poll: poll, timeout: timeout, logf: out, errs: errs}, nil
}

func (s session) path(name string) string { return filepath.Join(s.dir, name) }

// waitFor calls check every poll interval until it reports done or an error, the context ends,
// or timeout has passed since the first call. what completes "waiting for ...".
func (s session) waitFor(ctx context.Context, timeout time.Duration, what string, check func() (bool, error)) error {
	deadline := time.Now().Add(timeout)
	timer := time.NewTimer(s.poll)
	defer timer.Stop()
	for {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("waiting for %s: %w", what, err)
		}
		done, err := check()
		if err != nil || done {
			return err
		}
		if !time.Now().Before(deadline) {
			return fmt.Errorf("%w after %v waiting for %s", ErrTimeout, timeout, what)
		}
		timer.Reset(min(s.poll, time.Until(deadline)+time.Millisecond))
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for %s: %w", what, ctx.Err())
		case <-timer.C:
		}
	}
}

// waitYAMLAbsent waits, as both clients do before writing the control file and Orbax also does
// after, until the agent has consumed replicator.yaml.
func (s session) waitYAMLAbsent(ctx context.Context) error {
	return s.waitFor(ctx, s.timeout, yamlName+" to disappear (consumed by the agent)", func() (bool, error) {
		_, err := os.Lstat(s.path(yamlName))
		if errors.Is(err, fs.ErrNotExist) {
			return true, nil
		}
		return false, err
	})
}

// checkStatus is MaxText's replicator_error_handler and NeMo's handle_replicator_fail_situation:
// read, log and unlink replicator.errors; then, if replicator.failed exists, read and unlink it
// and fail with its lines.
func (s session) checkStatus() error {
	lines, present, err := readAndUnlink(s.path(errorsName))
	if err != nil {
		return err
	}
	for _, l := range lines {
		s.logf("%s: %s", errorsName, l)
	}
	*s.errs = append(*s.errs, lines...)
	if present && len(lines) == 0 {
		s.logf("%s present but empty", errorsName)
	}
	lines, present, err = readAndUnlink(s.path(failedName))
	if err != nil {
		return err
	}
	if present {
		s.logf("%s: %s", failedName, strings.Join(lines, " | "))
		return &FatalError{Lines: lines}
	}
	return nil
}

// readAndUnlink returns the non-empty lines of the file at path and removes it; a missing file
// is not an error (present is false).
func readAndUnlink(path string) (lines []string, present bool, err error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, fmt.Errorf("read %s: %w", filepath.Base(path), err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, true, fmt.Errorf("unlink %s: %w", filepath.Base(path), err)
	}
	for _, l := range strings.Split(string(data), "\n") {
		if l = strings.TrimRight(l, "\r"); strings.TrimSpace(l) != "" {
			lines = append(lines, l)
		}
	}
	return lines, true, nil
}

// globRestore is Python's glob("*.restore") in the directory: names ending in ".restore" that
// do not start with a dot, sorted (glob's order is the directory's; sorting keeps runs
// repeatable).
func globRestore(dir string) ([]string, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var names []string
	for _, e := range entries {
		if n := e.Name(); strings.HasSuffix(n, restoreSuffix) && !strings.HasPrefix(n, ".") {
			names = append(names, n)
		}
	}
	sort.Strings(names)
	return names, nil
}
