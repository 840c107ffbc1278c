package tiers

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/mtcfs/mtcfs/layout"
	"gopkg.in/yaml.v3"
)

// MaxConfigSize is the largest replicator.yaml mtcfs reads (SPEC §2.3). The
// file system refuses writes past it; ParseConfig refuses it too so that no
// caller can be made to parse an unbounded document.
const MaxConfigSize = 64 << 10

// The frameworks a job may name (SPEC §2). They decide what commits a step:
// a directory renamed to "<step>" (orbax, pytorch.distributed) or a closed
// "<job>-sS-nR-wW.save" (pytorch).
const (
	FrameworkOrbax              = "orbax"
	FrameworkPyTorchDistributed = "pytorch.distributed"
	FrameworkPyTorch            = "pytorch"
)

// The keys of replicator.yaml.
const (
	keyJobName         = "job-name"
	keyFramework       = "framework"
	keyNodes           = "nodes"
	keyNodeRank        = "node-rank"
	keyPeerRanks       = "peer-ranks"
	keyPeersPerNode    = "peers-per-node"
	keyBackupMinutes   = "backup-interval-minutes"
	keyBackupSteps     = "backup-interval-steps"
	keyDataParallelism = "assume-data-parallelism"
	keyWorkersPerNode  = "workers-per-node"
)

// keyOrder is the fixed order in which keys are checked; the first problem
// in this order is the one reported. A key comes after the keys its checks
// depend on (node-rank after nodes, peer-ranks after node-rank), so every
// message can rely on the earlier values being valid.
var keyOrder = []string{
	keyJobName,
	keyFramework,
	keyNodes,
	keyNodeRank,
	keyPeerRanks,
	keyPeersPerNode,
	keyBackupMinutes,
	keyBackupSteps,
	keyDataParallelism,
	keyWorkersPerNode,
}

// Limits beyond the SPEC's. They are far above any real job and keep every
// derived quantity (peer lists, names, durations) small and representable.
const (
	maxNodes          = 1 << 20
	maxWorkersPerNode = 1 << 10
	// maxBackupInterval is "practically never", well inside what a
	// time.Duration holds (about 292 years), so that converting any accepted
	// number of minutes cannot overflow.
	maxBackupInterval = 100 * 365 * 24 * time.Hour
	// minBackupInterval rejects intervals so small that they would round to
	// "back up continuously"; tests use seconds, not microseconds.
	minBackupInterval = time.Millisecond
)

var frameworks = []string{FrameworkOrbax, FrameworkPyTorchDistributed, FrameworkPyTorch}

// Config is the content of a valid replicator.yaml: one incarnation of the
// job as this node sees it.
type Config struct {
	JobName   string // safe as one path component, see layout.ValidateJobName
	Framework string // FrameworkOrbax, FrameworkPyTorchDistributed or FrameworkPyTorch
	NodeRank  int    // this node, 0 ≤ NodeRank < Nodes
	Nodes     int    // nodes in the job, ≥ 1

	// PeerRanks are the explicit peer-ranks: nil when the key was not given,
	// empty (non-nil) for "peer-ranks: []", which means no peers. When
	// non-nil they win over PeersPerNode; use Peers.
	PeerRanks    []int
	PeersPerNode int // K of SPEC §4; 0 when not given

	// Exactly one of the two backup intervals is > 0; use BackupInterval.
	BackupIntervalMinutes float64
	BackupIntervalSteps   int

	AssumeDataParallelism int // D of SPEC §4; 0 = data-parallel mode off
	WorkersPerNode        int // ≥ 1; 1 when not given
}

// ConfigError is a problem with replicator.yaml. Its text, "<key>: <problem>",
// is what the job reads from replicator.failed, so Key is verbatim the key of
// the file (or "replicator.yaml" for the file as a whole) and Problem says
// what is wrong in one line.
type ConfigError struct {
	Key     string
	Problem string
}

func (e *ConfigError) Error() string { return e.Key + ": " + e.Problem }

// fileError is a problem with the document as a whole.
func fileError(format string, args ...any) *ConfigError {
	return &ConfigError{Key: layout.ReplicatorYAMLName, Problem: oneLine(fmt.Sprintf(format, args...))}
}

// oneLine keeps a message on one line, replacing control characters with
// spaces: replicator.failed is read line by line. Values quoted with %q are
// already escaped and pass unchanged.
func oneLine(s string) string {
	return strings.Map(func(r rune) rune {
		if r < ' ' || r == 0x7f {
			return ' '
		}
		return r
	}, s)
}

// ParseConfig parses and validates replicator.yaml (SPEC §2).
//
// Every string value has $VAR and ${VAR} expanded through getenv (os.Getenv
// when nil); a variable that is unset expands to "". VAR is a POSIX name
// ([A-Za-z_][A-Za-z0-9_]*); any other "$" is kept as it is. Numeric strings
// count as numbers, so `nodes: "$NODES"` is 4 when NODES=4; integer keys take
// a float only when it is integral ("2.0" is 2, "2.5" is an error). Booleans,
// lists and mappings where a single value belongs are errors.
//
// A key whose value is null ("key:" or "key: ~") counts as not given.
// Keys are case-sensitive. Unknown keys are not errors — older and newer
// clients add keys — but each becomes a warning, `unknown key "foo" ignored`,
// sorted by key. Then come warnings for keys that are not names at all (a
// list used as a key), by line, and a note when explicit peer-ranks
// override peers-per-node.
//
// Interpretation choices:
//   - Giving both backup-interval-minutes and backup-interval-steps is an
//     error: neither client writes both, and silently preferring one would
//     back up on a schedule the user did not ask for.
//   - Giving both peer-ranks and peers-per-node is allowed (SPEC: explicit
//     ranks win); peers-per-node is still checked.
//   - peers-per-node must be below nodes, except that any peers-per-node ≥ 1
//     is accepted in a one-node job, where it means no peers (NeMo writes
//     peers-per-node: 1 on a single node).
//   - assume-data-parallelism: 0 means off, like leaving it out.
//   - A key given twice is an error, since either reading could be wrong.
//
// Only the first problem is reported, as a *ConfigError: problems with the
// document as a whole (size, syntax, not a mapping) first, then per key in
// the order job-name, framework, nodes, node-rank, peer-ranks,
// peers-per-node, backup-interval-minutes, backup-interval-steps,
// assume-data-parallelism, workers-per-node.
//
// A zero-length file is not a configuration at all (SPEC §2.1 ignores it);
// callers handle it before calling ParseConfig, which reports it as an error.
func ParseConfig(data []byte, getenv func(string) string) (*Config, []string, error) {
	if getenv == nil {
		getenv = os.Getenv
	}
	root, ce := parseDocument(data)
	if ce != nil {
		return nil, nil, ce
	}
	settings, warnings := collectSettings(root)

	p := valueParser{getenv: getenv}
	c := &Config{WorkersPerNode: 1}
	for _, key := range keyOrder {
		s := settings[key]
		switch {
		case s != nil && s.dupLine > 0:
			return nil, nil, &ConfigError{Key: key, Problem: fmt.Sprintf("given twice (lines %d and %d)", s.line, s.dupLine)}
		case s != nil && !isNull(s.value):
			if ce := p.set(c, key, s.value); ce != nil {
				return nil, nil, ce
			}
		case key == keyJobName || key == keyFramework || key == keyNodes || key == keyNodeRank:
			problem := "required"
			if k := misspelt(root, key); k != "" && s == nil {
				// The FATAL line said only "job-name: required" for a file that gave "Job-Name"
				// (black-box h59): the unknown key's warning is never written after a FATAL.
				problem = fmt.Sprintf("required (the file gives %q: keys are lower-case, with dashes)", k)
			}
			return nil, nil, givenNoValue(&ConfigError{Key: key, Problem: problem}, settings)
		}
		if ce := c.check(key); ce != nil {
			return nil, nil, givenNoValue(ce, settings)
		}
	}
	// peers-per-node beside peer-ranks is not worth a line: explicit ranks win (SPEC §4), and
	// NeMo writes both at every start (a line there each time was noise, found by a black-box
	// run of the upstream code).
	if w := c.fewerPeers(); w != "" {
		warnings = append(warnings, w)
	}
	return c, warnings, nil
}

// givenNoValue adds to a problem of a key written with no value ("backup-interval-minutes:"),
// which counts as absent, that the file gives it none: "one of backup-interval-minutes or
// backup-interval-steps is required" alone sent the user looking for a missing line.
func givenNoValue(ce *ConfigError, settings map[string]*setting) *ConfigError {
	keys := []string{ce.Key}
	switch ce.Key { // the pairs of which one is required, reported under the first
	case keyPeerRanks:
		keys = append(keys, keyPeersPerNode)
	case keyBackupMinutes:
		keys = append(keys, keyBackupSteps)
	}
	for _, k := range keys {
		if s := settings[k]; s != nil && isNull(s.value) {
			ce.Problem += fmt.Sprintf(" (line %d gives %s no value)", s.line, k)
			break
		}
	}
	return ce
}

// Validate checks c as ParseConfig checks a parsed file, in the same order,
// and returns the first problem as a *ConfigError. It serves configurations
// built in code, and proves that a parsed one is still consistent.
func (c *Config) Validate() error {
	for _, key := range keyOrder {
		if ce := c.check(key); ce != nil {
			return ce
		}
	}
	return nil
}

// fewerPeers says when peers-per-node gives this node fewer peers than it asks for and the job
// has: SPEC §4's choice repeats ranks (3 nodes, 2 peers each: ranks 0 and 2 get one), and a
// job that asked for 2 copies of each step lost a step when two nodes lost their RAM, with no
// word before (a black-box run).
func (c *Config) fewerPeers() string {
	if c.PeerRanks != nil || c.PeersPerNode <= 0 || c.Nodes <= 1 {
		return ""
	}
	most := c.Nodes - 1
	if d := c.AssumeDataParallelism; d > 0 {
		most = d - 1 // the other members of its column
	}
	if most == 0 {
		// Asked for peers, given none: "replicated" then means committed, and a node's loss
		// left only the backup, with no word before (a black-box run).
		return fmt.Sprintf("%s: %d gives this node no peer: with %s: %d every node is a column of its own, and only column-mates are peers (SPEC §4); a step counts as replicated once committed, and a node that loses its RAM restores from a backup only; list %s to choose peers",
			keyPeersPerNode, c.PeersPerNode, keyDataParallelism, c.AssumeDataParallelism, keyPeerRanks)
	}
	peers := c.Peers()
	if len(peers) >= min(c.PeersPerNode, most) {
		return ""
	}
	return fmt.Sprintf("%s: %d gives this node (rank %d of %d) %d peer(s), %s: the ranks chosen for it repeat (SPEC §4); list %s to choose them",
		keyPeersPerNode, c.PeersPerNode, c.NodeRank, c.Nodes, len(peers), rankNames(peers), keyPeerRanks)
}

// rankNames writes ranks as "rank 1" or "ranks 0, 2".
func rankNames(ranks []int) string {
	if len(ranks) == 1 {
		return fmt.Sprintf("rank %d", ranks[0])
	}
	return "ranks " + JoinAtMost(ranks, maxRanksNamed)
}

// maxRanksNamed bounds the ranks a line names: a yaml of a million nodes made one line of
// 8 MB in replicator.errors and the log (black-box h59).
const maxRanksNamed = 20

// JoinAtMost is JoinSteps of the first n, then "and N more".
func JoinAtMost[T ~int | ~int64](xs []T, n int) string {
	if len(xs) <= n {
		return JoinSteps(xs)
	}
	return fmt.Sprintf("%s and %d more", JoinSteps(xs[:n]), len(xs)-n)
}

// PeersOutsideColumn returns the explicit peer-ranks that are not in this rank's data-parallel
// column (the ranks equal to it mod nodes/D, SPEC §4); nil outside data-parallel mode (D > 1).
// Orbax computes its peer-ranks from process indices mapped to node ranks, which may differ
// from them: its column-mates are then not the ranks mtcfs takes for equivalent, and a node's
// data must not stand for another's (a black-box run of the upstream code restored a rank with
// another column's data, and backed up only half the columns).
func (c *Config) PeersOutsideColumn() []int {
	d := c.AssumeDataParallelism
	if d <= 1 || c.Nodes%d != 0 || c.PeerRanks == nil {
		return nil
	}
	part := c.Nodes / d
	var out []int
	for _, p := range c.PeerRanks {
		if p%part != c.NodeRank%part {
			out = append(out, p)
		}
	}
	return out
}

// Peers returns the ranks this node replicates to: the explicit peer-ranks
// when given, otherwise PeerRanks' choice for peers-per-node. Empty means no
// peers; then the latest committed step counts as replicated (SPEC §2).
func (c *Config) Peers() []int {
	if c.PeerRanks != nil {
		return slices.Clone(c.PeerRanks)
	}
	return PeerRanks(c.NodeRank, c.Nodes, c.PeersPerNode, c.AssumeDataParallelism)
}

// BackupInterval says when a backup is due: every `every` of wall time, or
// every `steps` committed steps. In a valid Config exactly one is non-zero.
func (c *Config) BackupInterval() (every time.Duration, steps int) {
	if c.BackupIntervalSteps > 0 {
		return 0, c.BackupIntervalSteps
	}
	return minutesToDuration(c.BackupIntervalMinutes), 0
}

func minutesToDuration(m float64) time.Duration {
	return time.Duration(math.Round(m * float64(time.Minute)))
}

// check validates one key of c, assuming every key before it in keyOrder is
// valid. It works on the struct alone, so a key that is absent from the file
// and a zero value look the same here; ParseConfig reports "required" and
// "must be > 0, got 0" for the file before calling it.
func (c *Config) check(key string) *ConfigError {
	problem := func(format string, args ...any) *ConfigError {
		return &ConfigError{Key: key, Problem: oneLine(fmt.Sprintf(format, args...))}
	}
	switch key {
	case keyJobName:
		if err := layout.ValidateJobName(c.JobName); err != nil {
			return problem("%s", err)
		}
	case keyFramework:
		if c.Framework == "" {
			return problem("required")
		}
		if !slices.Contains(frameworks, c.Framework) {
			return problem("%q is not one of %s", c.Framework, strings.Join(frameworks, ", "))
		}
	case keyNodes:
		if c.Nodes <= 0 {
			return problem("must be > 0, got %d", c.Nodes)
		}
		if c.Nodes > maxNodes {
			return problem("%d is more than the supported maximum of %d", c.Nodes, maxNodes)
		}
	case keyNodeRank:
		if c.NodeRank < 0 || c.NodeRank >= c.Nodes {
			return problem("%d is out of range [0, %d)", c.NodeRank, c.Nodes)
		}
	case keyPeerRanks:
		seen := make(map[int]bool, len(c.PeerRanks))
		for _, r := range c.PeerRanks {
			switch {
			case r < 0 || r >= c.Nodes:
				return problem("rank %d is out of range [0, %d)", r, c.Nodes)
			case r == c.NodeRank:
				return problem("rank %d is this node's own rank", r)
			case seen[r]:
				return problem("duplicate rank %d", r)
			}
			seen[r] = true
		}
	case keyPeersPerNode:
		switch {
		case c.PeersPerNode < 0:
			return problem("must be > 0, got %d", c.PeersPerNode)
		case c.PeerRanks == nil && c.PeersPerNode == 0:
			return &ConfigError{Key: keyPeerRanks, Problem: fmt.Sprintf("one of %s or %s is required", keyPeerRanks, keyPeersPerNode)}
		case c.Nodes > 1 && c.PeersPerNode >= c.Nodes:
			return problem("%d must be less than nodes %d (a node has at most %d peers)", c.PeersPerNode, c.Nodes, c.Nodes-1)
		}
	case keyBackupMinutes:
		m := c.BackupIntervalMinutes
		switch {
		case math.IsNaN(m) || math.IsInf(m, 0):
			return problem("must be a finite number, got %s", formatFloat(m))
		case m < 0:
			return problem("must be > 0, got %s", formatFloat(m))
		case m > maxBackupInterval.Minutes():
			return problem("%s is too large; at most %d minutes (100 years) are supported", formatFloat(m), int64(maxBackupInterval/time.Minute))
		case m > 0 && minutesToDuration(m) < minBackupInterval:
			return problem("%s is too small; the interval must be at least %v", formatFloat(m), minBackupInterval)
		}
	case keyBackupSteps:
		switch {
		case c.BackupIntervalSteps < 0:
			return problem("must be > 0, got %d", c.BackupIntervalSteps)
		case c.BackupIntervalSteps > 0 && c.BackupIntervalMinutes > 0:
			return problem("cannot be combined with %s; give only one of them", keyBackupMinutes)
		case c.BackupIntervalSteps == 0 && c.BackupIntervalMinutes == 0:
			return &ConfigError{Key: keyBackupMinutes, Problem: fmt.Sprintf("one of %s or %s is required", keyBackupMinutes, keyBackupSteps)}
		}
	case keyDataParallelism:
		d := c.AssumeDataParallelism
		if d < 0 {
			return problem("must not be negative, got %d", d)
		}
		if d > 0 && c.Nodes%d != 0 {
			return problem("%d does not divide nodes %d", d, c.Nodes)
		}
	case keyWorkersPerNode:
		if c.WorkersPerNode <= 0 {
			return problem("must be > 0, got %d", c.WorkersPerNode)
		}
		if c.WorkersPerNode > maxWorkersPerNode {
			return problem("%d is more than the supported maximum of %d", c.WorkersPerNode, maxWorkersPerNode)
		}
		if c.WorkersPerNode > 1 && c.Framework != FrameworkPyTorch {
			// Served, no step was ever complete: the job trained without a checkpoint, told
			// nothing until its restart (found by a black-box run; NeMo's rename too: a review).
			return problem("%d with framework %s: the rename of a step directory commits this node's worker 0 only (SPEC §3), so no step would ever be complete; give 1 (or leave the key out), or use framework pytorch, whose workers each commit a .save", c.WorkersPerNode, c.Framework)
		}
	}
	return nil
}

func formatFloat(f float64) string { return strconv.FormatFloat(f, 'g', -1, 64) }

// parseDocument parses data as exactly one YAML document whose top level is
// a mapping, and returns that mapping.
func parseDocument(data []byte) (*yaml.Node, *ConfigError) {
	if len(data) > MaxConfigSize {
		return nil, fileError("is %d bytes; at most %d are allowed", len(data), MaxConfigSize)
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	if err := yamlCall(func() error { return dec.Decode(&doc) }); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, fileError("has no settings")
		}
		return nil, fileError("%s", strings.TrimPrefix(err.Error(), "yaml: "))
	}
	var next yaml.Node
	switch err := yamlCall(func() error { return dec.Decode(&next) }); {
	case err == nil:
		return nil, fileError(`holds more than one YAML document (separated by "---"); write a single mapping`)
	case !errors.Is(err, io.EOF):
		return nil, fileError("%s", strings.TrimPrefix(err.Error(), "yaml: "))
	}

	root := &doc
	if doc.Kind == yaml.DocumentNode && len(doc.Content) == 1 {
		root = resolveAlias(doc.Content[0])
	}
	if root.Kind != yaml.MappingNode {
		return nil, fileError("must be a mapping of settings such as %q, got %s", "job-name: NAME", describeKind(root))
	}
	return root, nil
}

// yamlCall runs a yaml.v3 call, turning a panic into an error: the file comes
// from the job, and no content of it may bring the agent down.
func yamlCall(f func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("cannot be parsed: %v", r)
		}
	}()
	return f()
}

// setting is one known key's value as found in the document.
type setting struct {
	value   *yaml.Node // aliases resolved
	line    int
	dupLine int // line of a second occurrence of the key, 0 if none
}

// collectSettings maps the known keys of the mapping to their values and
// returns a warning for each unknown key.
func collectSettings(root *yaml.Node) (map[string]*setting, []string) {
	settings := make(map[string]*setting)
	unknown := make(map[string]bool)
	var odd []string // keys that are not plain scalars, in document order
	for i := 0; i+1 < len(root.Content); i += 2 {
		keyNode, value := resolveAlias(root.Content[i]), resolveAlias(root.Content[i+1])
		if keyNode.Kind != yaml.ScalarNode {
			odd = append(odd, fmt.Sprintf("unknown key at line %d (%s, not a name) ignored", root.Content[i].Line, describeKind(keyNode)))
			continue
		}
		key := keyNode.Value
		if !slices.Contains(keyOrder, key) {
			unknown[key] = true
			continue
		}
		if s := settings[key]; s != nil {
			if s.dupLine == 0 {
				s.dupLine = root.Content[i].Line
			}
			continue
		}
		settings[key] = &setting{value: value, line: root.Content[i].Line}
	}

	var warnings []string
	for key := range unknown {
		w := fmt.Sprintf("unknown key %q ignored", key)
		if known := suggestKey(key); known != "" {
			w += fmt.Sprintf(" (did you mean %q?)", known)
		}
		warnings = append(warnings, oneLine(w))
	}
	sort.Strings(warnings)
	return settings, append(warnings, odd...)
}

// misspelt returns a key of the mapping root that suggestKey takes for key ("": none).
func misspelt(root *yaml.Node, key string) string {
	for i := 0; i+1 < len(root.Content); i += 2 {
		if k := resolveAlias(root.Content[i]); k.Kind == yaml.ScalarNode && k.Value != key && suggestKey(k.Value) == key {
			return k.Value
		}
	}
	return ""
}

// suggestKey returns the known key that an unknown key probably meant
// ("Job_Name" → "job-name"), or "".
func suggestKey(key string) string {
	norm := strings.ToLower(strings.ReplaceAll(strings.TrimSpace(key), "_", "-"))
	if slices.Contains(keyOrder, norm) {
		return norm
	}
	return ""
}

// resolveAlias follows *alias references to the anchored node.
func resolveAlias(n *yaml.Node) *yaml.Node {
	for i := 0; n != nil && n.Kind == yaml.AliasNode && i < 8; i++ {
		n = n.Alias
	}
	if n == nil || n.Kind == yaml.AliasNode {
		return &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!null"}
	}
	return n
}

func isNull(n *yaml.Node) bool {
	return n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null"
}

// describeKind names a YAML value's kind for messages.
func describeKind(n *yaml.Node) string {
	switch n.Kind {
	case yaml.SequenceNode:
		return "a list"
	case yaml.MappingNode:
		return "a mapping"
	case yaml.ScalarNode:
		switch n.ShortTag() {
		case "!!null":
			return "null"
		case "!!bool":
			return "a boolean"
		case "!!int", "!!float":
			return "a number"
		}
		return "a string"
	}
	return "an empty document"
}

// valueParser turns YAML values into the Config's Go values.
type valueParser struct {
	getenv func(string) string
}

// set parses the value n of key into c. It reports type errors, and the
// problems that only the file shows: an explicit 0 or empty value for a key
// where the struct's zero value means "not given".
func (p valueParser) set(c *Config, key string, n *yaml.Node) *ConfigError {
	problem := func(format string, args ...any) *ConfigError {
		return &ConfigError{Key: key, Problem: oneLine(fmt.Sprintf(format, args...))}
	}
	var bad string // a type problem, from the parsers below
	switch key {
	case keyJobName:
		if c.JobName, bad = p.text(n); bad == "" && c.JobName == "" {
			return problem("must not be empty, got %s", p.describe(n))
		}
	case keyFramework:
		if c.Framework, bad = p.text(n); bad == "" && c.Framework == "" {
			return problem("%s is not one of %s", p.describe(n), strings.Join(frameworks, ", "))
		}
	case keyNodes:
		c.Nodes, bad = p.integer(n)
	case keyNodeRank:
		c.NodeRank, bad = p.integer(n)
	case keyPeerRanks:
		c.PeerRanks, bad = p.ranks(n)
	case keyPeersPerNode:
		if c.PeersPerNode, bad = p.integer(n); bad == "" && c.PeersPerNode <= 0 {
			return problem("must be > 0, got %d", c.PeersPerNode)
		}
	case keyBackupMinutes:
		if c.BackupIntervalMinutes, bad = p.number(n); bad == "" && c.BackupIntervalMinutes <= 0 {
			return problem("must be > 0, got %s", formatFloat(c.BackupIntervalMinutes))
		}
	case keyBackupSteps:
		if c.BackupIntervalSteps, bad = p.integer(n); bad == "" && c.BackupIntervalSteps <= 0 {
			return problem("must be > 0, got %d", c.BackupIntervalSteps)
		}
	case keyDataParallelism:
		c.AssumeDataParallelism, bad = p.integer(n)
	case keyWorkersPerNode:
		c.WorkersPerNode, bad = p.integer(n)
	}
	if bad != "" {
		return problem("%s", bad)
	}
	return nil
}

// Numeric strings, after expansion and trimming: plain decimal only, so that
// "0x10" or "1_000" from the environment is not silently reinterpreted.
var (
	decimalIntRE   = regexp.MustCompile(`^[+-]?[0-9]+$`)
	decimalFloatRE = regexp.MustCompile(`^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?$`)
)

// isStringValue reports whether a scalar is a string, which is what gets
// $VAR expansion. Tags other than null, bool, int and float (timestamps,
// custom tags) are strings to mtcfs.
func isStringValue(n *yaml.Node) bool {
	switch n.ShortTag() {
	case "!!null", "!!bool", "!!int", "!!float":
		return false
	}
	return true
}

// describe shows a value in a message: a string quoted (with its expansion
// when that differs), anything else as written or by kind.
func (p valueParser) describe(n *yaml.Node) string {
	if n.Kind != yaml.ScalarNode {
		return describeKind(n)
	}
	switch n.ShortTag() {
	case "!!null":
		return "null"
	case "!!bool":
		return "boolean " + n.Value
	case "!!int", "!!float":
		return n.Value
	}
	if s := expandEnv(n.Value, p.getenv); s != n.Value {
		return fmt.Sprintf("%q (expands to %q)", n.Value, s)
	}
	return strconv.Quote(n.Value)
}

// text reads a value that is a name. Numbers are taken as written
// ("job-name: 123" is the name "123").
func (p valueParser) text(n *yaml.Node) (string, string) {
	if n.Kind != yaml.ScalarNode || n.ShortTag() == "!!bool" {
		return "", "must be a string, got " + p.describe(n)
	}
	if isStringValue(n) {
		return expandEnv(n.Value, p.getenv), ""
	}
	return n.Value, ""
}

// integer reads an integer: a YAML integer, an integral YAML float, or a
// string that is one of those in decimal after expansion.
func (p valueParser) integer(n *yaml.Node) (int, string) {
	f, isInt, i, bad := p.scalarNumber(n, "an integer")
	if bad != "" {
		return 0, bad
	}
	if !isInt {
		if f != math.Trunc(f) || math.IsInf(f, 0) || math.IsNaN(f) {
			return 0, "must be an integer, got " + p.describe(n)
		}
		// 2^63 is exactly representable; anything at or past it overflows.
		if f >= math.MaxInt64 || f < math.MinInt64 {
			return 0, p.describe(n) + " is too large"
		}
		i = int64(f)
	}
	if int64(int(i)) != i {
		return 0, p.describe(n) + " is too large"
	}
	return int(i), ""
}

// number reads a finite real number.
func (p valueParser) number(n *yaml.Node) (float64, string) {
	f, isInt, i, bad := p.scalarNumber(n, "a number")
	if bad != "" {
		return 0, bad
	}
	if isInt {
		f = float64(i)
	}
	if math.IsNaN(f) || math.IsInf(f, 0) {
		return 0, "must be a finite number, got " + p.describe(n)
	}
	return f, ""
}

// scalarNumber reads a numeric scalar as an exact integer (isInt) or a float.
// want names the expected kind for the message.
func (p valueParser) scalarNumber(n *yaml.Node, want string) (f float64, isInt bool, i int64, bad string) {
	wrong := "must be " + want + ", got " + p.describe(n)
	if n.Kind != yaml.ScalarNode {
		return 0, false, 0, wrong
	}
	switch n.ShortTag() {
	case "!!null", "!!bool":
		return 0, false, 0, wrong
	case "!!int":
		var v any
		if err := yamlCall(func() error { return n.Decode(&v) }); err != nil {
			return 0, false, 0, wrong
		}
		switch v := v.(type) {
		case int:
			return 0, true, int64(v), ""
		case int64:
			return 0, true, v, ""
		case uint64:
			if v > math.MaxInt64 {
				return 0, false, 0, p.describe(n) + " is too large"
			}
			return 0, true, int64(v), ""
		}
		return 0, false, 0, wrong
	case "!!float":
		if err := yamlCall(func() error { return n.Decode(&f) }); err != nil {
			return 0, false, 0, wrong
		}
		return f, false, 0, ""
	}
	s := strings.TrimSpace(expandEnv(n.Value, p.getenv))
	switch {
	case decimalIntRE.MatchString(s):
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return 0, false, 0, p.describe(n) + " is too large"
		}
		return 0, true, v, ""
	case decimalFloatRE.MatchString(s):
		v, err := strconv.ParseFloat(s, 64)
		if err != nil {
			return 0, false, 0, p.describe(n) + " is too large"
		}
		return v, false, 0, ""
	}
	return 0, false, 0, wrong
}

// ranks reads a list of integer ranks. The result is non-nil even when the
// list is empty: "peer-ranks: []" means "no peers", unlike a missing key.
func (p valueParser) ranks(n *yaml.Node) ([]int, string) {
	if n.Kind != yaml.SequenceNode {
		return nil, "must be a list of ranks such as [1, 2], got " + p.describe(n)
	}
	ranks := make([]int, 0, len(n.Content))
	for i, item := range n.Content {
		r, bad := p.integer(resolveAlias(item))
		if bad != "" {
			return nil, fmt.Sprintf("item %d of %d %s", i+1, len(n.Content), bad)
		}
		ranks = append(ranks, r)
	}
	return ranks, ""
}

// expandEnv replaces $NAME and ${NAME} in s with getenv(NAME). NAME is a
// POSIX variable name; "$" followed by anything else ("$1", "$$", "${x-y}",
// a lone "$") is kept literally, so such text reaches the checks unchanged
// and shows up in their messages.
func expandEnv(s string, getenv func(string) string) string {
	if !strings.Contains(s, "$") {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		if s[i] != '$' {
			b.WriteByte(s[i])
			i++
			continue
		}
		name, width := envRef(s[i+1:])
		if width == 0 {
			b.WriteByte('$')
			i++
			continue
		}
		b.WriteString(getenv(name))
		i += 1 + width
	}
	return b.String()
}

// envRef reads the variable reference after a "$": "{NAME}" or "NAME". It
// returns the name and how many bytes the reference takes, 0 if none.
func envRef(s string) (name string, width int) {
	if strings.HasPrefix(s, "{") {
		end := strings.IndexByte(s, '}')
		if end < 0 || !isEnvName(s[1:end]) {
			return "", 0
		}
		return s[1:end], end + 1
	}
	n := 0
	for n < len(s) && isEnvNameByte(s[n], n == 0) {
		n++
	}
	return s[:n], n
}

func isEnvName(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if !isEnvNameByte(s[i], i == 0) {
			return false
		}
	}
	return true
}

func isEnvNameByte(c byte, first bool) bool {
	return c == '_' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || !first && c >= '0' && c <= '9'
}
