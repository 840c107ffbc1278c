package tiers

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mtcfs/mtcfs/layout"
)

// fuzzEnv is the environment the fuzzer's documents expand from.
func fuzzEnv(name string) string {
	return map[string]string{"NODES": "4", "RANK": "1", "JOB": "fuzz-job", "MIN": "0.5", "EMPTY": ""}[name]
}

// FuzzParseConfig feeds ParseConfig arbitrary bytes. The seed corpus in
// testdata/fuzz/FuzzParseConfig holds the files real clients write and one
// of each kind of invalid file. It asserts that ParseConfig never panics,
// that a failure is a one-line *ConfigError naming a real key, and that a
// success is a Config whose invariants hold, which re-validates, and which
// parses back to itself when written out again.
func FuzzParseConfig(f *testing.F) {
	f.Fuzz(func(t *testing.T, data []byte) {
		c, warnings, err := ParseConfig(data, fuzzEnv)
		if err != nil {
			checkConfigError(t, c, warnings, err)
			return
		}
		checkConfigInvariants(t, c, warnings)

		again, againWarnings, err := ParseConfig(data, fuzzEnv)
		if err != nil || !reflect.DeepEqual(again, c) || !slices.Equal(againWarnings, warnings) {
			t.Fatalf("a second parse differs: %+v %q %v, first %+v %q", again, againWarnings, err, c, warnings)
		}

		doc := renderConfig(c)
		back, _, err := ParseConfig([]byte(doc), fuzzEnv)
		if err != nil {
			t.Fatalf("the config written out as\n%s\ndoes not parse: %v", doc, err)
		}
		if !reflect.DeepEqual(back, c) {
			t.Fatalf("the config written out as\n%s\nparses to %+v, want %+v", doc, back, c)
		}
	})
}

// TestFuzzSeedsAreWhatTheySay keeps the seed corpus honest: seeds named
// valid_* parse and seeds named invalid_* fail, so each exercises what its
// name promises.
func TestFuzzSeedsAreWhatTheySay(t *testing.T) {
	paths, err := filepath.Glob(filepath.Join("testdata", "fuzz", "FuzzParseConfig", "*"))
	if err != nil || len(paths) < 15 {
		t.Fatalf("want at least 15 seeds, found %d (%v)", len(paths), err)
	}
	for _, path := range paths {
		raw, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		header, value, _ := strings.Cut(strings.TrimSpace(string(raw)), "\n")
		quoted, ok := strings.CutPrefix(value, "[]byte(")
		doc, err := strconv.Unquote(strings.TrimSuffix(quoted, ")"))
		if header != "go test fuzz v1" || !ok || err != nil {
			t.Fatalf("%s is not a corpus file of one []byte: %v", path, err)
		}
		_, _, err = ParseConfig([]byte(doc), fuzzEnv)
		switch name := filepath.Base(path); {
		case strings.HasPrefix(name, "valid_") && err != nil:
			t.Errorf("%s fails: %v", name, err)
		case strings.HasPrefix(name, "invalid_") && err == nil:
			t.Errorf("%s parses", name)
		case !strings.HasPrefix(name, "valid_") && !strings.HasPrefix(name, "invalid_"):
			t.Logf("%s: %v", name, err) // a seed the fuzzer added
		}
	}
}

func checkConfigError(t *testing.T, c *Config, warnings []string, err error) {
	t.Helper()
	var ce *ConfigError
	if !errors.As(err, &ce) {
		t.Fatalf("error %v is a %T, want *ConfigError", err, err)
	}
	if c != nil || warnings != nil {
		t.Fatalf("error %v came with config %+v and warnings %q", err, c, warnings)
	}
	if ce.Key != layout.ReplicatorYAMLName && !slices.Contains(keyOrder, ce.Key) {
		t.Fatalf("error %q names key %q, which is neither a known key nor %q", err, ce.Key, layout.ReplicatorYAMLName)
	}
	if ce.Problem == "" || strings.ContainsAny(err.Error(), "\n\r") {
		t.Fatalf("error %q is empty or spans lines", err)
	}
}

func checkConfigInvariants(t *testing.T, c *Config, warnings []string) {
	t.Helper()
	fail := func(format string, args ...any) {
		t.Helper()
		t.Fatalf("accepted %+v, but %s", *c, fmt.Sprintf(format, args...))
	}
	if err := c.Validate(); err != nil {
		fail("Validate() = %v", err)
	}
	if err := layout.ValidateJobName(c.JobName); err != nil {
		fail("the job name is invalid: %v", err)
	}
	if !slices.Contains(frameworks, c.Framework) {
		fail("the framework is unknown")
	}
	if c.Nodes < 1 || c.Nodes > maxNodes || c.NodeRank < 0 || c.NodeRank >= c.Nodes {
		fail("the rank or node count is out of range")
	}
	if c.PeerRanks == nil && c.PeersPerNode < 1 {
		fail("there is neither peer-ranks nor peers-per-node")
	}
	if c.PeerRanks == nil && c.Nodes > 1 && c.PeersPerNode >= c.Nodes {
		fail("peers-per-node is not below nodes")
	}
	for _, peers := range [][]int{c.PeerRanks, c.Peers()} {
		if len(peers) > c.Nodes-1 {
			fail("there are more peers %v than other nodes", peers)
		}
		seen := map[int]bool{}
		for _, p := range peers {
			if p < 0 || p >= c.Nodes || p == c.NodeRank || seen[p] {
				fail("peer %d of %v is out of range, self or repeated", p, peers)
			}
			seen[p] = true
		}
	}
	every, steps := c.BackupInterval()
	if (every > 0) == (steps > 0) || every < 0 || steps < 0 || (every > 0 && every < time.Millisecond) {
		fail("the backup interval is %v / %d steps", every, steps)
	}
	if c.AssumeDataParallelism < 0 || (c.AssumeDataParallelism > 0 && c.Nodes%c.AssumeDataParallelism != 0) {
		fail("assume-data-parallelism does not divide nodes")
	}
	if c.WorkersPerNode < 1 || c.WorkersPerNode > maxWorkersPerNode {
		fail("workers-per-node is out of range")
	}
	if !slices.IsSorted(unknownKeyWarnings(warnings)) {
		fail("the unknown-key warnings %q are not sorted", warnings)
	}
	for _, w := range warnings {
		if w == "" || strings.ContainsAny(w, "\n\r") {
			fail("warning %q is empty or spans lines", w)
		}
	}
}

func unknownKeyWarnings(warnings []string) []string {
	var out []string
	for _, w := range warnings {
		if strings.HasPrefix(w, `unknown key "`) {
			out = append(out, w)
		}
	}
	return out
}

// renderConfig writes c as a replicator.yaml, the way a client would.
func renderConfig(c *Config) string {
	lines := []string{
		"job-name: '" + c.JobName + "'", // quoted: "123" and ".inf" are names here
		"framework: " + c.Framework,
		"node-rank: " + strconv.Itoa(c.NodeRank),
		"nodes: " + strconv.Itoa(c.Nodes),
		"workers-per-node: " + strconv.Itoa(c.WorkersPerNode),
	}
	if c.PeerRanks != nil {
		ranks := make([]string, len(c.PeerRanks))
		for i, r := range c.PeerRanks {
			ranks[i] = strconv.Itoa(r)
		}
		lines = append(lines, "peer-ranks: ["+strings.Join(ranks, ", ")+"]")
	}
	if c.PeersPerNode > 0 {
		lines = append(lines, "peers-per-node: "+strconv.Itoa(c.PeersPerNode))
	}
	if c.BackupIntervalMinutes > 0 {
		lines = append(lines, "backup-interval-minutes: "+formatFloat(c.BackupIntervalMinutes))
	}
	if c.BackupIntervalSteps > 0 {
		lines = append(lines, "backup-interval-steps: "+strconv.Itoa(c.BackupIntervalSteps))
	}
	if c.AssumeDataParallelism > 0 {
		lines = append(lines, "assume-data-parallelism: "+strconv.Itoa(c.AssumeDataParallelism))
	}
	return strings.Join(lines, "\n")
}
