package tiers

import (
	"errors"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

// testEnv is the environment the config tests expand variables from.
func testEnv(name string) string {
	return map[string]string{
		"JOB":     "env-job",
		"NODES":   "4",
		"RANK":    "3",
		"MINUTES": "0.5",
		"PEER":    "1",
		"SPACED":  " 2 \n",
		"FW":      "pytorch",
	}[name]
}

// validBase is a valid replicator.yaml that the error cases edit.
const validBase = "job-name: j\nframework: orbax\nnode-rank: 2\nnodes: 4\npeers-per-node: 1\nbackup-interval-minutes: 30"

// edit returns doc with each change applied: "key: value" replaces the
// line of key (or appends one), "-key" removes it.
func edit(doc string, changes ...string) string {
	lines := strings.Split(doc, "\n")
	for _, ch := range changes {
		if key, ok := strings.CutPrefix(ch, "-"); ok {
			lines = slices.DeleteFunc(lines, func(l string) bool { return strings.HasPrefix(l, key+":") })
			continue
		}
		key, _, _ := strings.Cut(ch, ":")
		replaced := false
		for i, l := range lines {
			if strings.HasPrefix(l, key+":") {
				lines[i], replaced = ch, true
			}
		}
		if !replaced {
			lines = append(lines, ch)
		}
	}
	return strings.Join(lines, "\n")
}

func TestParseConfigValid(t *testing.T) {
	tests := []struct {
		name     string
		doc      string
		want     Config
		warnings []string
		peers    []int
	}{
		{
			// Exactly what Orbax's _create_replicator_file writes for a single
			// slice: lines stripped, no trailing newline, "peer-ranks: []".
			name: "orbax single slice",
			doc:  "job-name: maxtext-run\nframework: orbax\nnode-rank: 0\nnodes: 1\npeer-ranks: []\nbackup-interval-minutes: 30",
			want: Config{JobName: "maxtext-run", Framework: "orbax", NodeRank: 0, Nodes: 1, PeerRanks: []int{},
				BackupIntervalMinutes: 30, WorkersPerNode: 1},
		},
		{
			name: "orbax multislice with data parallelism",
			doc:  "job-name: maxtext-run\nframework: orbax\nassume-data-parallelism: 2\nnode-rank: 1\nnodes: 4\npeer-ranks: [3]\nbackup-interval-minutes: 30",
			want: Config{JobName: "maxtext-run", Framework: "orbax", NodeRank: 1, Nodes: 4, PeerRanks: []int{3},
				BackupIntervalMinutes: 30, AssumeDataParallelism: 2, WorkersPerNode: 1},
			peers: []int{3},
		},
		{
			name: "maxtext with workers-per-node and several peers",
			doc:  "job-name: run\nframework: orbax\nassume-data-parallelism: 4\nnode-rank: 0\nnodes: 8\nworkers-per-node: 1\npeer-ranks: [2, 4, 6]\nbackup-interval-minutes: 30",
			want: Config{JobName: "run", Framework: "orbax", NodeRank: 0, Nodes: 8, PeerRanks: []int{2, 4, 6},
				BackupIntervalMinutes: 30, AssumeDataParallelism: 4, WorkersPerNode: 1},
			peers: []int{2, 4, 6},
		},
		{
			// NeMo on one node asks for one peer, which cannot exist.
			name: "nemo single node",
			doc:  "job-name: nemo\nframework: pytorch.distributed\nnode-rank: 0\nnodes: 1\npeers-per-node: 1\nbackup-interval-minutes: 30\n",
			want: Config{JobName: "nemo", Framework: "pytorch.distributed", NodeRank: 0, Nodes: 1, PeersPerNode: 1,
				BackupIntervalMinutes: 30, WorkersPerNode: 1},
		},
		{
			name: "nemo four nodes",
			doc:  "job-name: nemo\nframework: pytorch.distributed\nnode-rank: 2\nnodes: 4\npeers-per-node: 1\nbackup-interval-minutes: 0.25\n",
			want: Config{JobName: "nemo", Framework: "pytorch.distributed", NodeRank: 2, Nodes: 4, PeersPerNode: 1,
				BackupIntervalMinutes: 0.25, WorkersPerNode: 1},
			peers: []int{3}, // 2 XOR 1
		},
		{
			name: "pytorch with steps and workers",
			doc:  "job-name: pt\nframework: pytorch\nnode-rank: 0\nnodes: 2\npeers-per-node: 1\nbackup-interval-steps: 100\nworkers-per-node: 8",
			want: Config{JobName: "pt", Framework: "pytorch", NodeRank: 0, Nodes: 2, PeersPerNode: 1,
				BackupIntervalSteps: 100, WorkersPerNode: 8},
			peers: []int{1},
		},
		{
			name: "variables in every form",
			doc:  "job-name: $JOB\nframework: ${FW}\nnode-rank: \"${RANK}\"\nnodes: \"$NODES\"\npeer-ranks: [\"$PEER\", $SPACED]\nbackup-interval-minutes: $MINUTES",
			want: Config{JobName: "env-job", Framework: "pytorch", NodeRank: 3, Nodes: 4, PeerRanks: []int{1, 2},
				BackupIntervalMinutes: 0.5, WorkersPerNode: 1},
			peers: []int{1, 2},
		},
		{
			name: "variables inside text",
			doc:  edit(validBase, "job-name: run-${JOB}-$RANK.x"),
			want: Config{JobName: "run-env-job-3.x", Framework: "orbax", NodeRank: 2, Nodes: 4, PeersPerNode: 1,
				BackupIntervalMinutes: 30, WorkersPerNode: 1},
			peers: []int{3},
		},
		{
			name: "numeric strings and integral floats",
			doc:  "job-name: '007'\nframework: pytorch\nnode-rank: \"3\"\nnodes: 4.0\npeer-ranks: ['1', 2.0]\nbackup-interval-steps: \"+10\"\nworkers-per-node: \" 2 \"",
			want: Config{JobName: "007", Framework: "pytorch", NodeRank: 3, Nodes: 4, PeerRanks: []int{1, 2},
				BackupIntervalSteps: 10, WorkersPerNode: 2},
			peers: []int{1, 2},
		},
		{
			// Numbers as names are taken as written, not as their value.
			name: "numeric job name",
			doc:  edit(validBase, "job-name: 0123"),
			want: Config{JobName: "0123", Framework: "orbax", NodeRank: 2, Nodes: 4, PeersPerNode: 1,
				BackupIntervalMinutes: 30, WorkersPerNode: 1},
			peers: []int{3},
		},
		{
			name: "null optional keys are absent",
			doc:  edit(validBase, "assume-data-parallelism: ~", "workers-per-node:", "peer-ranks: null", "backup-interval-steps:"),
			want: Config{JobName: "j", Framework: "orbax", NodeRank: 2, Nodes: 4, PeersPerNode: 1,
				BackupIntervalMinutes: 30, WorkersPerNode: 1},
			peers: []int{3},
		},
		{
			name: "data parallelism zero is off, one is legal",
			doc:  edit(validBase, "assume-data-parallelism: 0"),
			want: Config{JobName: "j", Framework: "orbax", NodeRank: 2, Nodes: 4, PeersPerNode: 1,
				BackupIntervalMinutes: 30, WorkersPerNode: 1},
			peers: []int{3},
		},
		{
			// D = 1: one column holding every node, so no column-mates.
			name: "data parallelism one",
			doc:  edit(validBase, "assume-data-parallelism: 1", "-peers-per-node", "peer-ranks: []"),
			want: Config{JobName: "j", Framework: "orbax", NodeRank: 2, Nodes: 4, PeerRanks: []int{},
				BackupIntervalMinutes: 30, AssumeDataParallelism: 1, WorkersPerNode: 1},
		},
		{
			name: "data parallel peers",
			doc:  edit(validBase, "assume-data-parallelism: 2", "nodes: 8", "peers-per-node: 3"),
			want: Config{JobName: "j", Framework: "orbax", NodeRank: 2, Nodes: 8, PeersPerNode: 3,
				BackupIntervalMinutes: 30, AssumeDataParallelism: 2, WorkersPerNode: 1},
			peers: []int{6}, // P = 4; 2-4 ≡ 2+4 ≡ 6, only one column-mate
		},
		{
			name: "one node accepts any peers-per-node",
			doc:  edit(validBase, "nodes: 1", "node-rank: 0", "peers-per-node: 5"),
			want: Config{JobName: "j", Framework: "orbax", NodeRank: 0, Nodes: 1, PeersPerNode: 5,
				BackupIntervalMinutes: 30, WorkersPerNode: 1},
		},
		{
			name: "peers-per-node giving fewer peers than asked says so",
			doc:  edit(validBase, "nodes: 3", "node-rank: 0", "peers-per-node: 2"),
			want: Config{JobName: "j", Framework: "orbax", NodeRank: 0, Nodes: 3, PeersPerNode: 2,
				BackupIntervalMinutes: 30, WorkersPerNode: 1},
			warnings: []string{"peers-per-node: 2 gives this node (rank 0 of 3) 1 peer(s), rank 1: the ranks chosen for it repeat (SPEC §4); list peer-ranks to choose them"},
			peers:    []int{1},
		},
		{
			name: "peers-per-node with data-parallelism 1 gives no peer and says so",
			doc:  edit(validBase, "nodes: 2", "node-rank: 0", "peers-per-node: 1", "assume-data-parallelism: 1"),
			want: Config{JobName: "j", Framework: "orbax", NodeRank: 0, Nodes: 2, PeersPerNode: 1, AssumeDataParallelism: 1,
				BackupIntervalMinutes: 30, WorkersPerNode: 1},
			warnings: []string{"peers-per-node: 1 gives this node no peer: with assume-data-parallelism: 1 every node is a column of its own, and only column-mates are peers (SPEC §4); a step counts as replicated once committed, and a node that loses its RAM restores from a backup only; list peer-ranks to choose peers"},
		},
		{
			name: "peers-per-node giving what is asked says nothing",
			doc:  edit(validBase, "nodes: 3", "node-rank: 1", "peers-per-node: 2"),
			want: Config{JobName: "j", Framework: "orbax", NodeRank: 1, Nodes: 3, PeersPerNode: 2,
				BackupIntervalMinutes: 30, WorkersPerNode: 1},
			peers: []int{0, 2},
		},
		{
			name: "explicit ranks win over peers-per-node",
			doc:  edit(validBase, "peer-ranks: [0, 1]"),
			want: Config{JobName: "j", Framework: "orbax", NodeRank: 2, Nodes: 4, PeerRanks: []int{0, 1}, PeersPerNode: 1,
				BackupIntervalMinutes: 30, WorkersPerNode: 1},
			peers: []int{0, 1},
		},
		{
			name: "unknown keys are sorted warnings",
			doc:  edit(validBase, "zeta: 1", "Job_Name: x", "alpha: [1]", "alpha: 2", "1: one", "[a]: b"),
			want: Config{JobName: "j", Framework: "orbax", NodeRank: 2, Nodes: 4, PeersPerNode: 1,
				BackupIntervalMinutes: 30, WorkersPerNode: 1},
			warnings: []string{
				`unknown key "1" ignored`,
				`unknown key "Job_Name" ignored (did you mean "job-name"?)`,
				`unknown key "alpha" ignored`,
				`unknown key "zeta" ignored`,
				`unknown key at line 11 (a list, not a name) ignored`,
			},
			peers: []int{3},
		},
		{
			name: "anchors and aliases",
			doc:  "n: &n 4\njob-name: j\nframework: orbax\nnode-rank: 0\nnodes: *n\npeer-ranks: [&p 1, 2]\nx: *p\nbackup-interval-minutes: *n # comment\n",
			want: Config{JobName: "j", Framework: "orbax", NodeRank: 0, Nodes: 4, PeerRanks: []int{1, 2},
				BackupIntervalMinutes: 4, WorkersPerNode: 1},
			warnings: []string{`unknown key "n" ignored`, `unknown key "x" ignored`},
			peers:    []int{1, 2},
		},
		{
			name: "flow mapping with CRLF and comments",
			doc:  "---\r\n# written by hand\r\n{job-name: j, framework: orbax, node-rank: 2, nodes: 4, peer-ranks: [0], backup-interval-minutes: 30}\r\n",
			want: Config{JobName: "j", Framework: "orbax", NodeRank: 2, Nodes: 4, PeerRanks: []int{0},
				BackupIntervalMinutes: 30, WorkersPerNode: 1},
			peers: []int{0},
		},
		{
			name: "yaml integer syntax",
			doc:  edit(validBase, "framework: pytorch", "nodes: 0x8", "workers-per-node: 1_0"),
			want: Config{JobName: "j", Framework: "pytorch", NodeRank: 2, Nodes: 8, PeersPerNode: 1,
				BackupIntervalMinutes: 30, WorkersPerNode: 10},
			peers: []int{3},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, warnings, err := ParseConfig([]byte(tt.doc), testEnv)
			if err != nil {
				t.Fatalf("ParseConfig(%q) failed: %v", tt.doc, err)
			}
			if !reflect.DeepEqual(*c, tt.want) {
				t.Errorf("ParseConfig(%q)\n got %+v\nwant %+v", tt.doc, *c, tt.want)
			}
			if !reflect.DeepEqual(warnings, tt.warnings) {
				t.Errorf("warnings = %q, want %q", warnings, tt.warnings)
			}
			if err := c.Validate(); err != nil {
				t.Errorf("Validate() of a parsed config = %v, want nil", err)
			}
			if got := c.Peers(); len(got) != len(tt.peers) || (len(got) > 0 && !reflect.DeepEqual(got, tt.peers)) {
				t.Errorf("Peers() = %v, want %v", got, tt.peers)
			}
		})
	}
}

func TestParseConfigErrors(t *testing.T) {
	long := strings.Repeat("x", 201)
	tests := []struct {
		name string
		doc  string
		want string // the exact message
	}{
		// The document as a whole.
		{"too large", validBase + "\n#" + strings.Repeat("x", MaxConfigSize-len(validBase)-1), "replicator.yaml: is 65537 bytes; at most 65536 are allowed"},
		{"empty", "", "replicator.yaml: has no settings"},
		{"only comments", "# nothing\n\n", "replicator.yaml: has no settings"},
		{"only a document marker", "---\n", `replicator.yaml: must be a mapping of settings such as "job-name: NAME", got null`},
		{"a list", "- job-name: j\n", `replicator.yaml: must be a mapping of settings such as "job-name: NAME", got a list`},
		{"a string", "job-name=j", `replicator.yaml: must be a mapping of settings such as "job-name: NAME", got a string`},
		{"two documents", validBase + "\n---\n" + validBase, `replicator.yaml: holds more than one YAML document (separated by "---"); write a single mapping`},
		{"syntax", "job-name: [j\nnodes: 4", "replicator.yaml: line 1: did not find expected ',' or ']'"},
		{"syntax in second document", validBase + "\n---\n[", "replicator.yaml: line 8: did not find expected node content"},
		{"tab indentation", "job-name: j\n\tnodes: 4", "replicator.yaml: line 2: found a tab character that violates indentation"},
		{"unknown alias", "nodes: *nope", "replicator.yaml: unknown anchor 'nope' referenced"},
		{"not utf-8", "job-name: \xff\xfe", "replicator.yaml: invalid leading UTF-8 octet"},

		// job-name
		{"job-name missing", edit(validBase, "-job-name"), "job-name: required"},
		{"job-name misspelt", edit(validBase, "-job-name", "Job-Name: j"), `job-name: required (the file gives "Job-Name": keys are lower-case, with dashes)`},
		{"nodes misspelt", edit(validBase, "-nodes", "NODES: 4"), `nodes: required (the file gives "NODES": keys are lower-case, with dashes)`},
		{"job-name null", edit(validBase, "job-name:"), "job-name: required (line 1 gives job-name no value)"},
		{"job-name empty", edit(validBase, `job-name: ""`), `job-name: must not be empty, got ""`},
		{"job-name unset variable", edit(validBase, "job-name: $UNSET"), `job-name: must not be empty, got "$UNSET" (expands to "")`},
		{"job-name slash", edit(validBase, "job-name: a/b"), `job-name: "a/b" must not contain "/" or ".."`},
		{"job-name absolute", edit(validBase, "job-name: /etc"), `job-name: "/etc" must not contain "/" or ".."`},
		{"job-name dotdot", edit(validBase, "job-name: .."), `job-name: ".." must not contain "/" or ".."`},
		{"job-name inner dotdot", edit(validBase, "job-name: a..b"), `job-name: "a..b" must not contain "/" or ".."`},
		{"job-name dot", edit(validBase, "job-name: ."), `job-name: "." starts with ".": the markers named after the job would be hidden files, which *.restore globs skip; start it with a letter, a digit, "_" or "-"`},
		{"job-name hidden", edit(validBase, "job-name: .ckpt"), `job-name: ".ckpt" starts with ".": the markers named after the job would be hidden files, which *.restore globs skip; start it with a letter, a digit, "_" or "-"`},
		{"job-name space", edit(validBase, `job-name: "a b"`), `job-name: "a b" contains ' '; use only letters A-Z and a-z, digits, ".", "_" and "-"`},
		{"job-name newline", edit(validBase, `job-name: "a\nb"`), `job-name: "a\nb" contains '\n'; use only letters A-Z and a-z, digits, ".", "_" and "-"`},
		{"job-name unicode", edit(validBase, "job-name: jöb"), `job-name: "jöb" contains 'ö'; use only letters A-Z and a-z, digits, ".", "_" and "-"`},
		{"job-name dollar kept", edit(validBase, "job-name: a$1"), `job-name: "a$1" contains '$'; use only letters A-Z and a-z, digits, ".", "_" and "-"`},
		{"job-name too long", edit(validBase, "job-name: "+long), "job-name: is 201 bytes long; at most 200 are allowed"},
		{"job-name boolean", edit(validBase, "job-name: true"), "job-name: must be a string, got boolean true"},
		{"job-name list", edit(validBase, "job-name: [a]"), "job-name: must be a string, got a list"},
		{"job-name mapping", edit(validBase, "job-name: {a: b}"), "job-name: must be a string, got a mapping"},
		{"job-name twice", validBase + "\njob-name: k", "job-name: given twice (lines 1 and 7)"},

		// framework
		{"framework missing", edit(validBase, "-framework"), "framework: required"},
		{"framework unknown", edit(validBase, "framework: tensorflow"), `framework: "tensorflow" is not one of orbax, pytorch.distributed, pytorch`},
		{"framework case", edit(validBase, "framework: Orbax"), `framework: "Orbax" is not one of orbax, pytorch.distributed, pytorch`},
		{"framework empty", edit(validBase, "framework: ''"), `framework: "" is not one of orbax, pytorch.distributed, pytorch`},
		{"framework unset variable", edit(validBase, "framework: $UNSET"), `framework: "$UNSET" (expands to "") is not one of orbax, pytorch.distributed, pytorch`},
		{"framework number", edit(validBase, "framework: 1"), `framework: "1" is not one of orbax, pytorch.distributed, pytorch`},
		{"framework list", edit(validBase, "framework: [orbax]"), "framework: must be a string, got a list"},

		// nodes
		{"nodes missing", edit(validBase, "-nodes"), "nodes: required"},
		{"nodes null", edit(validBase, "nodes: ~"), "nodes: required (line 4 gives nodes no value)"},
		{"nodes zero", edit(validBase, "nodes: 0"), "nodes: must be > 0, got 0"},
		{"nodes negative", edit(validBase, "nodes: -4"), "nodes: must be > 0, got -4"},
		{"nodes word", edit(validBase, "nodes: four"), `nodes: must be an integer, got "four"`},
		{"nodes fraction", edit(validBase, "nodes: 2.5"), "nodes: must be an integer, got 2.5"},
		{"nodes fraction string", edit(validBase, `nodes: "2.5"`), `nodes: must be an integer, got "2.5"`},
		{"nodes boolean", edit(validBase, "nodes: true"), "nodes: must be an integer, got boolean true"},
		{"nodes list", edit(validBase, "nodes: [4]"), "nodes: must be an integer, got a list"},
		{"nodes mapping", edit(validBase, "nodes: {n: 4}"), "nodes: must be an integer, got a mapping"},
		{"nodes unset variable", edit(validBase, "nodes: $UNSET"), `nodes: must be an integer, got "$UNSET" (expands to "")`},
		{"nodes variable not a number", edit(validBase, "nodes: $JOB"), `nodes: must be an integer, got "$JOB" (expands to "env-job")`},
		{"nodes hex string", edit(validBase, `nodes: "0x4"`), `nodes: must be an integer, got "0x4"`},
		{"nodes infinity", edit(validBase, "nodes: .inf"), "nodes: must be an integer, got .inf"},
		{"nodes nan", edit(validBase, "nodes: .nan"), "nodes: must be an integer, got .nan"},
		{"nodes huge", edit(validBase, "nodes: 99999999999999999999"), "nodes: 99999999999999999999 is too large"},
		{"nodes huge string", edit(validBase, `nodes: "99999999999999999999"`), `nodes: "99999999999999999999" is too large`},
		{"nodes huge uint", edit(validBase, "nodes: 18446744073709551615"), "nodes: 18446744073709551615 is too large"},
		{"nodes above maximum", edit(validBase, "nodes: 2000000"), "nodes: 2000000 is more than the supported maximum of 1048576"},
		{"nodes twice", validBase + "\nnodes: 4", "nodes: given twice (lines 4 and 7)"},

		// node-rank
		{"node-rank missing", edit(validBase, "-node-rank"), "node-rank: required"},
		{"node-rank too large", edit(validBase, "node-rank: 5"), "node-rank: 5 is out of range [0, 4)"},
		{"node-rank equal to nodes", edit(validBase, "node-rank: 4"), "node-rank: 4 is out of range [0, 4)"},
		{"node-rank negative", edit(validBase, "node-rank: -1"), "node-rank: -1 is out of range [0, 4)"},
		{"node-rank fraction", edit(validBase, "node-rank: 1.5"), "node-rank: must be an integer, got 1.5"},

		// peer-ranks and peers-per-node
		{"peers missing", edit(validBase, "-peers-per-node"), "peer-ranks: one of peer-ranks or peers-per-node is required"},
		{"peer-ranks null, no peers-per-node", edit(validBase, "-peers-per-node", "peer-ranks:"), "peer-ranks: one of peer-ranks or peers-per-node is required (line 6 gives peer-ranks no value)"},
		{"peer-ranks self", edit(validBase, "peer-ranks: [1, 2]"), "peer-ranks: rank 2 is this node's own rank"},
		{"peer-ranks out of range", edit(validBase, "peer-ranks: [7]"), "peer-ranks: rank 7 is out of range [0, 4)"},
		{"peer-ranks negative", edit(validBase, "peer-ranks: [-1]"), "peer-ranks: rank -1 is out of range [0, 4)"},
		{"peer-ranks duplicate", edit(validBase, "peer-ranks: [1, 3, 1]"), "peer-ranks: duplicate rank 1"},
		{"peer-ranks string", edit(validBase, "peer-ranks: 1,2"), `peer-ranks: must be a list of ranks such as [1, 2], got "1,2"`},
		{"peer-ranks scalar", edit(validBase, "peer-ranks: 3"), "peer-ranks: must be a list of ranks such as [1, 2], got 3"},
		{"peer-ranks mapping", edit(validBase, "peer-ranks: {1: 3}"), "peer-ranks: must be a list of ranks such as [1, 2], got a mapping"},
		{"peer-ranks bad item", edit(validBase, "peer-ranks: [1, x]"), `peer-ranks: item 2 of 2 must be an integer, got "x"`},
		{"peer-ranks null item", edit(validBase, "peer-ranks: [1, ~]"), "peer-ranks: item 2 of 2 must be an integer, got null"},
		{"peer-ranks nested", edit(validBase, "peer-ranks: [[1]]"), "peer-ranks: item 1 of 1 must be an integer, got a list"},
		{"peer-ranks fraction", edit(validBase, "peer-ranks: [1.5]"), "peer-ranks: item 1 of 1 must be an integer, got 1.5"},
		{"peer-ranks unset variable", edit(validBase, "peer-ranks: [$UNSET]"), `peer-ranks: item 1 of 1 must be an integer, got "$UNSET" (expands to "")`},
		{"peers-per-node zero", edit(validBase, "peers-per-node: 0"), "peers-per-node: must be > 0, got 0"},
		{"peers-per-node negative", edit(validBase, "peers-per-node: -2"), "peers-per-node: must be > 0, got -2"},
		{"peers-per-node word", edit(validBase, "peers-per-node: two"), `peers-per-node: must be an integer, got "two"`},
		{"peers-per-node too many", edit(validBase, "peers-per-node: 4"), "peers-per-node: 4 must be less than nodes 4 (a node has at most 3 peers)"},
		{"peers-per-node checked beside peer-ranks", edit(validBase, "peer-ranks: []", "peers-per-node: 9"), "peers-per-node: 9 must be less than nodes 4 (a node has at most 3 peers)"},

		// backup interval
		{"backup missing", edit(validBase, "-backup-interval-minutes"), "backup-interval-minutes: one of backup-interval-minutes or backup-interval-steps is required"},
		{"backup steps null", edit(validBase, "-backup-interval-minutes", "backup-interval-steps:"), "backup-interval-minutes: one of backup-interval-minutes or backup-interval-steps is required (line 6 gives backup-interval-steps no value)"},
		{"backup null", edit(validBase, "backup-interval-minutes:"), "backup-interval-minutes: one of backup-interval-minutes or backup-interval-steps is required (line 6 gives backup-interval-minutes no value)"},
		{"backup minutes negative", edit(validBase, "backup-interval-minutes: -1"), "backup-interval-minutes: must be > 0, got -1"},
		{"backup minutes zero", edit(validBase, "backup-interval-minutes: 0"), "backup-interval-minutes: must be > 0, got 0"},
		{"backup minutes negative string", edit(validBase, `backup-interval-minutes: "-0.5"`), "backup-interval-minutes: must be > 0, got -0.5"},
		{"backup minutes word", edit(validBase, "backup-interval-minutes: soon"), `backup-interval-minutes: must be a number, got "soon"`},
		{"backup minutes with unit", edit(validBase, "backup-interval-minutes: 30m"), `backup-interval-minutes: must be a number, got "30m"`},
		{"backup minutes boolean", edit(validBase, "backup-interval-minutes: false"), "backup-interval-minutes: must be a number, got boolean false"},
		{"backup minutes nan", edit(validBase, "backup-interval-minutes: .nan"), "backup-interval-minutes: must be a finite number, got .nan"},
		{"backup minutes infinite", edit(validBase, "backup-interval-minutes: .inf"), "backup-interval-minutes: must be a finite number, got .inf"},
		{"backup minutes overflow string", edit(validBase, `backup-interval-minutes: "1e999"`), `backup-interval-minutes: "1e999" is too large`},
		{"backup minutes too large", edit(validBase, "backup-interval-minutes: 1e300"), "backup-interval-minutes: 1e+300 is too large; at most 52560000 minutes (100 years) are supported"},
		{"backup minutes just too large", edit(validBase, "backup-interval-minutes: 52560000.001"), "backup-interval-minutes: 5.2560000001e+07 is too large; at most 52560000 minutes (100 years) are supported"},
		{"backup minutes at the duration limit", edit(validBase, "backup-interval-minutes: 153722867.28"), "backup-interval-minutes: 1.5372286728e+08 is too large; at most 52560000 minutes (100 years) are supported"},
		{"backup minutes too small", edit(validBase, "backup-interval-minutes: 1e-9"), "backup-interval-minutes: 1e-09 is too small; the interval must be at least 1ms"},
		{"backup both", edit(validBase, "backup-interval-steps: 10"), "backup-interval-steps: cannot be combined with backup-interval-minutes; give only one of them"},
		{"backup steps zero", edit(validBase, "-backup-interval-minutes", "backup-interval-steps: 0"), "backup-interval-steps: must be > 0, got 0"},
		{"backup steps fraction", edit(validBase, "-backup-interval-minutes", "backup-interval-steps: 1.5"), "backup-interval-steps: must be an integer, got 1.5"},

		// assume-data-parallelism
		{"data parallelism does not divide", edit(validBase, "assume-data-parallelism: 3"), "assume-data-parallelism: 3 does not divide nodes 4"},
		{"data parallelism above nodes", edit(validBase, "assume-data-parallelism: 8"), "assume-data-parallelism: 8 does not divide nodes 4"},
		{"data parallelism negative", edit(validBase, "assume-data-parallelism: -2"), "assume-data-parallelism: must not be negative, got -2"},
		{"data parallelism word", edit(validBase, "assume-data-parallelism: yes"), `assume-data-parallelism: must be an integer, got "yes"`},

		// workers-per-node
		{"workers zero", edit(validBase, "workers-per-node: 0"), "workers-per-node: must be > 0, got 0"},
		{"workers negative", edit(validBase, "workers-per-node: -1"), "workers-per-node: must be > 0, got -1"},
		{"workers above maximum", edit(validBase, "workers-per-node: 5000"), "workers-per-node: 5000 is more than the supported maximum of 1024"},
		{"orbax with two workers", edit(validBase, "framework: orbax", "workers-per-node: 2"), "workers-per-node: 2 with framework orbax: the rename of a step directory commits this node's worker 0 only (SPEC §3), so no step would ever be complete; give 1 (or leave the key out), or use framework pytorch, whose workers each commit a .save"},
		{"nemo with two workers", edit(validBase, "framework: pytorch.distributed", "workers-per-node: 2"), "workers-per-node: 2 with framework pytorch.distributed: the rename of a step directory commits this node's worker 0 only (SPEC §3), so no step would ever be complete; give 1 (or leave the key out), or use framework pytorch, whose workers each commit a .save"},

		// With several problems, the first in key order is reported.
		{"order: job-name before framework", edit(validBase, "framework: x", "job-name: a/b"), `job-name: "a/b" must not contain "/" or ".."`},
		{"order: nodes before node-rank", edit(validBase, "node-rank: x", "nodes: x"), `nodes: must be an integer, got "x"`},
		{"order: peers before backup", edit(validBase, "backup-interval-minutes: -1", "peer-ranks: [9]"), "peer-ranks: rank 9 is out of range [0, 4)"},
		{"order: backup before workers", edit(validBase, "workers-per-node: 0", "-backup-interval-minutes"), "backup-interval-minutes: one of backup-interval-minutes or backup-interval-steps is required"},
		{"order: a whole-file problem first", "job-name: a/b\nnodes: 0\n---\n", `replicator.yaml: holds more than one YAML document (separated by "---"); write a single mapping`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, warnings, err := ParseConfig([]byte(tt.doc), testEnv)
			if err == nil {
				t.Fatalf("ParseConfig(%q) = %+v, want error %q", short(tt.doc), *c, tt.want)
			}
			if err.Error() != tt.want {
				t.Errorf("ParseConfig(%q) error\n got %q\nwant %q", short(tt.doc), err.Error(), tt.want)
			}
			var ce *ConfigError
			if !errors.As(err, &ce) {
				t.Fatalf("error %v is a %T, want *ConfigError", err, err)
			}
			if ce.Key+": "+ce.Problem != tt.want {
				t.Errorf("Key %q, Problem %q do not make %q", ce.Key, ce.Problem, tt.want)
			}
			if c != nil || warnings != nil {
				t.Errorf("on error got config %+v and warnings %q, want nil", c, warnings)
			}
		})
	}
}

// short abbreviates a document for a failure message.
func short(doc string) string {
	if len(doc) > 300 {
		return doc[:300] + "…"
	}
	return doc
}

func TestParseConfigSizeLimit(t *testing.T) {
	// A file of exactly MaxConfigSize bytes is accepted.
	doc := validBase + "\n#"
	doc += strings.Repeat("x", MaxConfigSize-len(doc))
	if _, _, err := ParseConfig([]byte(doc), testEnv); err != nil {
		t.Errorf("a %d-byte file: %v, want it accepted", len(doc), err)
	}
}

func TestParseConfigNilGetenvUsesEnvironment(t *testing.T) {
	t.Setenv("MTCFS_TEST_JOB", "from-env")
	c, _, err := ParseConfig([]byte(edit(validBase, "job-name: $MTCFS_TEST_JOB")), nil)
	if err != nil {
		t.Fatal(err)
	}
	if c.JobName != "from-env" {
		t.Errorf("JobName = %q, want %q", c.JobName, "from-env")
	}
}

func TestExpandEnv(t *testing.T) {
	env := func(name string) string {
		return map[string]string{"A": "x", "B_2": "y", "_": "u"}[name]
	}
	tests := []struct{ in, want string }{
		{"plain", "plain"},
		{"$A", "x"},
		{"${A}", "x"},
		{"$A$B_2", "xy"},
		{"${A}b", "xb"},
		{"$Ab", ""}, // the name is "Ab", which is unset
		{"$_", "u"},
		{"$UNSET-z", "-z"},
		{"a.$A.b", "a.x.b"},
		{"$", "$"},
		{"a$", "a$"},
		{"$$", "$$"},
		{"$1", "$1"},
		{"${}", "${}"},
		{"${A", "${A"},
		{"${A-b}", "${A-b}"},
		{"${1A}", "${1A}"},
		{"$-", "$-"},
		{"€$A€", "€x€"},
	}
	for _, tt := range tests {
		if got := expandEnv(tt.in, env); got != tt.want {
			t.Errorf("expandEnv(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

func TestBackupInterval(t *testing.T) {
	tests := []struct {
		c         Config
		wantEvery time.Duration
		wantSteps int
	}{
		{Config{BackupIntervalMinutes: 30}, 30 * time.Minute, 0},
		{Config{BackupIntervalMinutes: 0.05}, 3 * time.Second, 0},
		{Config{BackupIntervalMinutes: 1.0 / 60}, time.Second, 0},
		{Config{BackupIntervalSteps: 7}, 0, 7},
		{Config{BackupIntervalMinutes: 52560000}, 100 * 365 * 24 * time.Hour, 0}, // the largest accepted
	}
	for _, tt := range tests {
		every, steps := tt.c.BackupInterval()
		if every != tt.wantEvery || steps != tt.wantSteps {
			t.Errorf("%+v.BackupInterval() = %v, %d; want %v, %d", tt.c, every, steps, tt.wantEvery, tt.wantSteps)
		}
	}
}

func TestValidate(t *testing.T) {
	valid := Config{JobName: "j", Framework: FrameworkOrbax, NodeRank: 1, Nodes: 2, PeersPerNode: 1,
		BackupIntervalMinutes: 1, WorkersPerNode: 1}
	if err := valid.Validate(); err != nil {
		t.Fatalf("Validate() = %v, want nil", err)
	}
	tests := []struct {
		name   string
		change func(*Config)
		want   string
	}{
		{"zero value", func(c *Config) { *c = Config{} }, "job-name: must not be empty"},
		{"no framework", func(c *Config) { c.Framework = "" }, "framework: required"},
		{"no nodes", func(c *Config) { c.Nodes = 0 }, "nodes: must be > 0, got 0"},
		{"no peers", func(c *Config) { c.PeersPerNode = 0 }, "peer-ranks: one of peer-ranks or peers-per-node is required"},
		{"negative peers", func(c *Config) { c.PeersPerNode = -1 }, "peers-per-node: must be > 0, got -1"},
		{"no backup", func(c *Config) { c.BackupIntervalMinutes = 0 }, "backup-interval-minutes: one of backup-interval-minutes or backup-interval-steps is required"},
		{"negative steps", func(c *Config) { c.BackupIntervalSteps = -1 }, "backup-interval-steps: must be > 0, got -1"},
		{"nan minutes", func(c *Config) { c.BackupIntervalMinutes = nan() }, "backup-interval-minutes: must be a finite number, got NaN"},
		{"no workers", func(c *Config) { c.WorkersPerNode = 0 }, "workers-per-node: must be > 0, got 0"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := valid
			tt.change(&c)
			err := c.Validate()
			if err == nil || err.Error() != tt.want {
				t.Errorf("Validate() = %v, want %q", err, tt.want)
			}
		})
	}
}

func nan() float64 {
	zero := 0.0
	return zero / zero
}

func TestPeersCopiesExplicitRanks(t *testing.T) {
	c := Config{PeerRanks: []int{3, 1}}
	p := c.Peers()
	p[0] = 99
	if c.PeerRanks[0] != 3 {
		t.Errorf("changing Peers()' result changed the config: %v", c.PeerRanks)
	}
}

// TestLongRankListsAreCut: a line names at most 20 ranks; a yaml of a million nodes made one
// line of 8 MB in replicator.errors and the log (black-box h59).
func TestLongRankListsAreCut(t *testing.T) {
	_, warnings, err := ParseConfig([]byte(edit(validBase, "nodes: 1048576", "node-rank: 0", "peers-per-node: 1048575")), testEnv)
	if err != nil {
		t.Fatal(err)
	}
	want := "peers-per-node: 1048575 gives this node (rank 0 of 1048576) 1048574 peer(s), ranks 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20 and 1048554 more: the ranks chosen for it repeat"
	if len(warnings) != 1 || !strings.HasPrefix(warnings[0], want) {
		t.Errorf("warnings = %.300q, want one starting %q", warnings, want)
	}
}
