package layout

import (
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// The fixed names of CHECKPOINT_DIR (SPEC §1). Clients hard-code them, so
// they must never change.
const (
	ReplicatorYAMLName    = "replicator.yaml"       // control file written by the job
	ReplicatorYAMLTmpName = "replicator.yaml.tmp"   // Orbax writes this, then renames it
	ReplicatorErrorsName  = "replicator.errors"     // one line per error, read by the job
	ReplicatorFailedName  = "replicator.failed"     // one line per fatal error
	PrerestoreName        = "replicator.prerestore" // restore decision, before any marker
	JaxInitInfoName       = "jax-init-info.txt"     // "<rank>\n<host>:<port>\n"

	// OrbaxTmpSuffix ends the name of an Orbax save in progress:
	// "<step>.orbax-checkpoint-tmp".
	OrbaxTmpSuffix = ".orbax-checkpoint-tmp"
)

// Kinds of per-worker marker names, the last part of "<job>-s<S>-n<R>-w<W>.<kind>".
const (
	MarkerMeta    = "meta"    // content is the hash of the worker's data (mtcfs)
	MarkerRestore = "restore" // symlink to <hash>.data, or empty file for step 0 (mtcfs)
	MarkerSave    = "save"    // a finished per-worker checkpoint (framework pytorch)
)

// The regexes of SPEC §1, verbatim except that the marker regex also
// captures the job name. Clients match the same expressions, so mtcfs must
// not be more lenient than they are.
var (
	stepDirRE  = regexp.MustCompile(`^\d+$`)
	markerRE   = regexp.MustCompile(`^(.+)-s(\d+)-n(\d+)-w(\d+)\.(meta|restore|save)$`)
	dataNameRE = regexp.MustCompile(`^D?[0-9a-f]{64}\.data$`)
)

// parseDecimal parses a canonical decimal number: "0", or digits without a
// leading zero. Only canonical spellings are accepted so that every number
// has exactly one name: "7" and "007" never both name step 7, and a parsed
// name always round-trips through its String or constructor. Numbers that
// overflow bitSize are rejected.
func parseDecimal(s string, bitSize int) (int64, bool) {
	if s == "" || (len(s) > 1 && s[0] == '0') {
		return 0, false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return 0, false // also rejects "+", "-" and spaces, which ParseInt would take
		}
	}
	n, err := strconv.ParseInt(s, 10, bitSize)
	if err != nil {
		return 0, false
	}
	return n, true
}

// ParseStepDir reports whether name is a committed step directory, "<step>"
// (SPEC §1: `^\d+$`, decimal, no padding), and returns the step.
//
// Only canonical decimals are steps: "0" and "12" are, "012", "+12", " 12"
// and numbers beyond int64 are not. Clients write str(step), so a padded
// name can only come from something else, and treating it as a commit would
// give one step two names.
func ParseStepDir(name string) (int64, bool) {
	if !stepDirRE.MatchString(name) {
		return 0, false
	}
	return parseDecimal(name, 64)
}

// StepDirName returns the committed directory name of step, "<step>".
func StepDirName(step int64) string {
	return strconv.FormatInt(step, 10)
}

// ParseOrbaxTmpDir reports whether name is an Orbax save in progress,
// "<step>.orbax-checkpoint-tmp", and returns its step (canonical decimal, as
// in ParseStepDir).
func ParseOrbaxTmpDir(name string) (int64, bool) {
	s, ok := strings.CutSuffix(name, OrbaxTmpSuffix)
	if !ok {
		return 0, false
	}
	return parseDecimal(s, 64)
}

// NeMo's names: it saves into "step=<N>", flags the save with an empty file
// "step=<N>-unfinished", and commits by renaming "step=<N>" to the bare
// decimal N-1 (an off-by-one that is NeMo's, see SPEC §3).
const (
	nemoStepPrefix       = "step="
	nemoUnfinishedSuffix = "-unfinished"
)

// ParseNemoStepDir reports whether name is a NeMo save directory,
// "step=<N>", and returns N (canonical decimal, as in ParseStepDir).
func ParseNemoStepDir(name string) (int64, bool) {
	s, ok := strings.CutPrefix(name, nemoStepPrefix)
	if !ok {
		return 0, false
	}
	return parseDecimal(s, 64)
}

// ParseNemoUnfinished reports whether name is NeMo's in-progress flag,
// "step=<N>-unfinished", and returns N.
func ParseNemoUnfinished(name string) (int64, bool) {
	s, ok := strings.CutSuffix(name, nemoUnfinishedSuffix)
	if !ok {
		return 0, false
	}
	return ParseNemoStepDir(s)
}

// MarkerName is a parsed per-worker name "<job>-s<S>-n<R>-w<W>.<kind>":
// the .meta, .restore and .save names of SPEC §1.
type MarkerName struct {
	Job    string
	Step   int64
	Node   int    // the rank R the name is about; a .meta may name a peer's rank
	Worker int    // W, 0 ≤ W < workers-per-node
	Kind   string // MarkerMeta, MarkerRestore or MarkerSave
}

// String returns the file name of m.
func (m MarkerName) String() string {
	return fmt.Sprintf("%s-s%d-n%d-w%d.%s", m.Job, m.Step, m.Node, m.Worker, m.Kind)
}

// ParseMarkerName parses a name matching SPEC §1's
// `^.+-s(\d+)-n(\d+)-w(\d+)\.(meta|restore|save)$`.
//
// The job is everything before the last "-s<S>-n<R>-w<W>", so job names may
// contain dashes, and even "-s1-n2-w3" themselves. The numbers must be
// canonical decimals (see ParseStepDir), which makes the parse exact:
// ParseMarkerName(m.String()) returns m for every name it accepts. The job
// part is not checked against ValidateJobName; callers compare it with
// their own job's name.
func ParseMarkerName(name string) (MarkerName, bool) {
	sub := markerRE.FindStringSubmatch(name)
	if sub == nil {
		return MarkerName{}, false
	}
	step, ok1 := parseDecimal(sub[2], 64)
	node, ok2 := parseDecimal(sub[3], strconv.IntSize)
	worker, ok3 := parseDecimal(sub[4], strconv.IntSize)
	if !ok1 || !ok2 || !ok3 {
		return MarkerName{}, false
	}
	return MarkerName{Job: sub[1], Step: step, Node: int(node), Worker: int(worker), Kind: sub[5]}, true
}

// IsDataName reports whether name is a committed checkpoint,
// `^D?[0-9a-f]{64}\.data$`. Upper-case hex is not a data name: hashes are
// always written in lower case, and one hash must have one name.
func IsDataName(name string) bool {
	return dataNameRE.MatchString(name)
}

// ParseDataName splits a data name into its hash (64 lower-case hex digits)
// and whether it holds a directory (the "D" prefix).
func ParseDataName(name string) (hash string, dir bool, ok bool) {
	if !IsDataName(name) {
		return "", false, false
	}
	hash = strings.TrimSuffix(name, ".data")
	if dir = hash[0] == 'D'; dir {
		hash = hash[1:]
	}
	return hash, dir, true
}

// DataName returns the name of the data with the given hash (64 lower-case
// hex digits, not checked here): "D<hash>.data" for a directory tree,
// "<hash>.data" for a single file.
func DataName(hash string, dir bool) string {
	if dir {
		return "D" + hash + ".data"
	}
	return hash + ".data"
}

// maxJobNameLen bounds job names so that every name built from one fits in
// a file name (NAME_MAX 255): "<job>-s<19 digits>-n<R>-w<W>.restore" plus a
// temporary suffix stays well below the limit.
const maxJobNameLen = 200

// ValidateJobName checks that name is safe to use as one path component in
// CHECKPOINT_DIR and in the backup layout "<backup-root>/<job>/...":
// 1 to 200 characters from [A-Za-z0-9._-], not starting with "." and without "/"
// or "..". The error says what is wrong and what is allowed.
func ValidateJobName(name string) error {
	const allowed = `use only letters A-Z and a-z, digits, ".", "_" and "-"`
	switch {
	case name == "":
		return errors.New("must not be empty")
	case strings.Contains(name, "/") || strings.Contains(name, ".."):
		return fmt.Errorf("%q must not contain %q or %q", name, "/", "..")
	case strings.HasPrefix(name, "."):
		// Every marker and .meta named after the job would be a hidden file, which the
		// clients' globs (*.restore) do not see: the job waited for markers it was given.
		return fmt.Errorf("%q starts with \".\": the markers named after the job would be hidden files, which *.restore globs skip; start it with a letter, a digit, \"_\" or \"-\"", name)
	case len(name) > maxJobNameLen:
		return fmt.Errorf("is %d bytes long; at most %d are allowed", len(name), maxJobNameLen)
	}
	for _, r := range name {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-') {
			return fmt.Errorf("%q contains %q; %s", name, r, allowed)
		}
	}
	return nil
}

// backupNameLayout is the reference system's backup name: the UTC minute it was taken.
const backupNameLayout = "2006-01-02_15-04"

// BackupName names a backup taken at t: its UTC minute, YYYY-MM-DD_HH-MM (SPEC §6). Names
// sort in time order.
func BackupName(t time.Time) string { return t.UTC().Format(backupNameLayout) }

var backupNameRE = regexp.MustCompile(`^\d{4}-\d{2}-\d{2}_\d{2}-\d{2}$`)

// IsBackupName reports whether s has the form of a backup name (YYYY-MM-DD_HH-MM).
func IsBackupName(s string) bool { return backupNameRE.MatchString(s) }
