package tiers_test

// The replicator driven through its Events and a dirNamespace, as package fs drives it over a
// mount: the handshake (SPEC §2), commits and sealing (§3), restore (§5), backups (§6) and
// adoption after an agent restart (§7).

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/replication"
	"github.com/mtcfs/mtcfs/tiers"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// baseYAML is a valid one-node Orbax replicator.yaml, as Orbax writes it (one key per line,
// no trailing newline).
const baseYAML = "job-name: job\nframework: orbax\nnode-rank: 0\nnodes: 1\npeer-ranks: []\nbackup-interval-minutes: 30"

// withKeys returns baseYAML with changes applied: "key: value" replaces the key's line (or
// appends one), "-key" removes it.
func withKeys(changes ...string) string {
	lines := strings.Split(baseYAML, "\n")
	for _, ch := range changes {
		if key, ok := strings.CutPrefix(ch, "-"); ok {
			lines = slices.DeleteFunc(lines, func(l string) bool { return strings.HasPrefix(l, key+":") })
			continue
		}
		key, _, _ := strings.Cut(ch, ":")
		i := slices.IndexFunc(lines, func(l string) bool { return strings.HasPrefix(l, key+":") })
		if i >= 0 {
			lines[i] = ch
		} else {
			lines = append(lines, ch)
		}
	}
	return strings.Join(lines, "\n")
}

var lineTime = `\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ`

// failedLineRE matches a replicator.failed line that names key.
func failedLineRE(key string) *regexp.Regexp {
	return regexp.MustCompile(`^` + lineTime + ` job=\S+ node=\S+/\S+ FATAL ` + regexp.QuoteMeta(key) + `: `)
}

// errLineRE matches a replicator.errors line whose message contains text.
func errLineRE(text string) *regexp.Regexp {
	return regexp.MustCompile(`^` + lineTime + ` job=\S+ node=\S+/\S+ ERR .*` + regexp.QuoteMeta(text))
}

// checkPrerestore checks replicator.prerestore's YAML content.
func (h *harness) checkPrerestore(want map[string]any) {
	h.t.Helper()
	raw := h.read(layout.PrerestoreName)
	got := map[string]any{}
	if err := yaml.Unmarshal([]byte(raw), &got); err != nil {
		h.t.Fatalf("%s = %q is not YAML: %v", layout.PrerestoreName, raw, err)
	}
	if !h.exists(layout.PrerestoreName) || !reflect.DeepEqual(got, want) {
		h.t.Fatalf("%s = %q (exists %v), want the mapping %v", layout.PrerestoreName, raw, h.exists(layout.PrerestoreName), want)
	}
}

// opIndex returns the position of the first logged namespace operation op, -1 if none.
func (h *harness) opIndex(op string) int { return slices.Index(h.ns.opLog(), op) }

// checkPublishOrder checks that replicator.prerestore was written before any marker.
func (h *harness) checkPublishOrder() {
	h.t.Helper()
	ops := h.ns.opLog()
	pre := slices.Index(ops, "write "+layout.PrerestoreName)
	first := slices.IndexFunc(ops, func(op string) bool { return strings.HasSuffix(op, ".restore") })
	if pre < 0 || first < 0 || pre > first {
		h.t.Fatalf("%s must be written before the first marker; operations: %q", layout.PrerestoreName, ops)
	}
}

// checkEmptyMarker checks that name is an empty regular file ("nothing to restore").
func (h *harness) checkEmptyMarker(name string) {
	h.t.Helper()
	fi, err := os.Lstat(h.path(name))
	if err != nil || !fi.Mode().IsRegular() || fi.Size() != 0 {
		h.t.Fatalf("%s must be an empty regular file, got %v (err %v)", name, fi, err)
	}
}

// checkRestoreLink checks that marker is a symlink to <hash>.data holding files.
func (h *harness) checkRestoreLink(name, hash string, files map[string]string) {
	h.t.Helper()
	target, err := os.Readlink(h.path(name))
	if err != nil || target != hash+".data" {
		h.t.Fatalf("%s must be a symlink to %s.data, got %q (err %v)", name, hash, target, err)
	}
	if diff := checkTree(h.path(name), files); diff != "" {
		h.t.Fatalf("restored checkpoint through %s: %s", name, diff)
	}
}

func TestHandshakeFreshStart(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name  string
		write func(h *harness, doc string)
		doc   string
		env   map[string]string
		job   string
	}{
		{name: "orbax writes .tmp and renames it", write: (*harness).yamlOrbax, doc: baseYAML, job: "job"},
		{
			name:  "nemo writes replicator.yaml directly",
			write: (*harness).yamlNemo,
			doc:   "job-name: nemo\nframework: pytorch.distributed\nnode-rank: 0\nnodes: 1\npeers-per-node: 1\nbackup-interval-minutes: 30\n",
			job:   "nemo",
		},
		{
			name:  "$VAR and ${VAR} are expanded",
			write: (*harness).yamlOrbax,
			doc:   "job-name: $JOB\nframework: ${FW}\nnode-rank: \"$RANK\"\nnodes: ${NODES}\npeer-ranks: []\nbackup-interval-minutes: $MIN",
			env:   map[string]string{"JOB": "env-job", "FW": "orbax", "RANK": "0", "NODES": "1", "MIN": "0.5"},
			job:   "env-job",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t, harnessConfig{env: tc.env})
			tc.write(h, tc.doc)
			h.waitGone(layout.ReplicatorYAMLName)
			want := marker(tc.job, 0, 0, 0, layout.MarkerRestore)
			h.waitMarkers(want)
			h.checkEmptyMarker(want)
			h.checkPrerestore(map[string]any{})
			h.checkPublishOrder()
			if got, exp := h.names(), []string{want, layout.PrerestoreName}; !slices.Equal(got, exp) {
				t.Errorf("namespace after a fresh start = %q, want %q", got, exp)
			}
			if st := h.r.Status(); st.Job != tc.job || st.Phase != "running" {
				t.Errorf("status job %q phase %q, want %q running", st.Job, st.Phase, tc.job)
			}
		})
	}
}

func TestHandshakeEmptyYAMLIsDeletedAndIgnored(t *testing.T) {
	t.Parallel()
	for _, write := range []struct {
		name string
		f    func(h *harness, doc string)
	}{{"closed", (*harness).yamlNemo}, {"renamed", (*harness).yamlOrbax}} {
		t.Run(write.name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t, harnessConfig{})
			write.f(h, "")
			h.waitGone(layout.ReplicatorYAMLName)
			time.Sleep(50 * time.Millisecond) // nothing runs after an empty yaml; give it a chance to misbehave
			if got := h.names(); len(got) != 0 {
				t.Errorf("an empty replicator.yaml must produce no file at all; namespace holds %q", got)
			}
			for _, op := range h.ns.opLog() {
				if strings.HasPrefix(op, "write ") || strings.HasPrefix(op, "symlink ") {
					t.Errorf("an empty replicator.yaml made the replicator %s", op)
				}
			}
			// Still healthy.
			h.start(baseYAML, "job")
		})
	}
}

func TestHandshakeInvalidYAML(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		doc  string
		key  string // the key the failure line must name
	}{
		{"missing job-name", withKeys("-job-name"), "job-name"},
		{"empty job-name", withKeys(`job-name: ""`), "job-name"},
		{"job-name of an unset variable", withKeys("job-name: $UNSET"), "job-name"},
		{"job-name with a slash", withKeys("job-name: a/b"), "job-name"},
		{"job-name with ..", withKeys("job-name: a..b"), "job-name"},
		{"job-name with a space", withKeys("job-name: my job"), "job-name"},
		{"missing framework", withKeys("-framework"), "framework"},
		{"unknown framework", withKeys("framework: tensorflow"), "framework"},
		{"missing nodes", withKeys("-nodes"), "nodes"},
		{"nodes not a number", withKeys("nodes: many"), "nodes"},
		{"nodes zero", withKeys("nodes: 0"), "nodes"},
		{"missing node-rank", withKeys("-node-rank"), "node-rank"},
		{"node-rank out of range", withKeys("node-rank: 1"), "node-rank"},
		{"node-rank negative", withKeys("node-rank: -1"), "node-rank"},
		{"neither peer key", withKeys("-peer-ranks"), "peer-ranks"},
		{"peer-ranks names self", withKeys("peer-ranks: [0]"), "peer-ranks"},
		{"peer-ranks not a list", withKeys("peer-ranks: 1"), "peer-ranks"},
		{"peers-per-node zero", withKeys("-peer-ranks", "peers-per-node: 0"), "peers-per-node"},
		{"negative minutes", withKeys("backup-interval-minutes: -1"), "backup-interval-minutes"},
		{"negative steps", withKeys("-backup-interval-minutes", "backup-interval-steps: -3"), "backup-interval-steps"},
		{"both intervals", withKeys("backup-interval-steps: 3"), "backup-interval-steps"},
		{"neither interval", withKeys("-backup-interval-minutes"), "backup-interval-minutes"},
		{"workers-per-node zero", withKeys("workers-per-node: 0"), "workers-per-node"},
		{"data parallelism not dividing nodes", withKeys("assume-data-parallelism: 2"), "assume-data-parallelism"},
		{"key given twice", baseYAML + "\nnodes: 1", "nodes"},
		{"a list, not a mapping", "- job-name: job\n- nodes: 1", layout.ReplicatorYAMLName},
		{"a scalar, not a mapping", "hello", layout.ReplicatorYAMLName},
		{"only a comment", "# nothing here", layout.ReplicatorYAMLName},
		{"syntax error", "job-name: [unclosed\nnodes: 1", layout.ReplicatorYAMLName},
		{"two documents", baseYAML + "\n---\n" + baseYAML, layout.ReplicatorYAMLName},
		{"too large (EFBIG)", "", layout.ReplicatorYAMLName},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t, harnessConfig{})
			switch {
			case tc.doc == "": // the fs layer refused a write past 64 KiB
				h.writeFile(layout.ReplicatorYAMLTmpName, strings.Repeat("x", 100))
				h.r.TooLarge(layout.ReplicatorYAMLTmpName)
				h.waitGone(layout.ReplicatorYAMLTmpName)
				h.waitExists(layout.ReplicatorFailedName)
			case i%2 == 0:
				h.yamlOrbax(tc.doc)
			default:
				h.yamlNemo(tc.doc)
			}
			h.waitGone(layout.ReplicatorYAMLName)
			h.waitExists(layout.ReplicatorFailedName)
			lines := h.lines(layout.ReplicatorFailedName)
			if len(lines) != 1 || !failedLineRE(tc.key).MatchString(lines[0]) {
				t.Fatalf("replicator.failed = %q, want exactly one line matching %s", lines, failedLineRE(tc.key))
			}
			if got := h.names(); !slices.Equal(got, []string{layout.ReplicatorFailedName}) {
				t.Errorf("after an invalid yaml the namespace must hold only replicator.failed, got %q", got)
			}
			if st := h.r.Status(); st.Phase != "idle" {
				t.Errorf("status phase %q after an invalid yaml, want idle", st.Phase)
			}
			// The job reads and unlinks replicator.failed; the replicator stays healthy.
			os.Remove(h.path(layout.ReplicatorFailedName))
			h.start(baseYAML, "job")
			if h.exists(layout.ReplicatorFailedName) {
				t.Errorf("a valid yaml after an invalid one wrote replicator.failed: %q", h.read(layout.ReplicatorFailedName))
			}
		})
	}
}

func TestHandshakeWarningsDoNotStopTheRun(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, doc, warning string
	}{
		{"unknown key", withKeys("enable-telemetry: true"), `unknown key "enable-telemetry" ignored`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t, harnessConfig{})
			h.start(tc.doc, "job")
			h.checkPrerestore(map[string]any{})
			lines := h.lines(layout.ReplicatorErrorsName)
			if len(lines) != 1 || !errLineRE(tc.warning).MatchString(lines[0]) {
				t.Errorf("replicator.errors = %q, want one line matching %s", lines, errLineRE(tc.warning))
			}
			if h.exists(layout.ReplicatorFailedName) {
				t.Errorf("a warning must not be fatal: replicator.failed = %q", h.read(layout.ReplicatorFailedName))
			}
		})
	}
}

// TestHandshakeNeMoPeerKeysSayNothing: NeMo writes peers-per-node: 1 beside peer-ranks at every
// start; explicit ranks win (SPEC §4), and the job got an ERR line each time (a black-box run of
// the upstream code).
func TestHandshakeNeMoPeerKeysSayNothing(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.start(withKeys("peers-per-node: 1"), "job")
	h.checkPrerestore(map[string]any{})
	if h.exists(layout.ReplicatorErrorsName) {
		t.Errorf("replicator.errors = %q, want none", h.read(layout.ReplicatorErrorsName))
	}
}

func TestHandshakeCleansNamespace(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{jaxInit: &tiers.JaxInit{Rank: 0, Coordinator: "10.0.0.1:8476"}})
	if got := h.read(layout.JaxInitInfoName); got != "0\n10.0.0.1:8476\n" {
		t.Fatalf("jax-init-info.txt = %q after Start, want %q", got, "0\n10.0.0.1:8476\n")
	}
	hex := strings.Repeat("ab", 32)
	keep := []string{
		layout.JaxInitInfoName,
		"old-s3-n0-w0.meta",
		"D" + hex + ".data",
		hex + ".data",
	}
	stale := []string{
		"old-s3-n0-w0.restore",       // stale marker (symlink)
		"old-s0-n0-w0.restore",       // NeMo leaves the s0 marker in place
		"5",                          // step directory
		"6",                          // step symlink (a renamed marker)
		"7.orbax-checkpoint-tmp",     // tmp dir of an abandoned save
		"step=9",                     // NeMo save in progress
		"step=9-unfinished",          // NeMo flag
		layout.ReplicatorErrorsName,  // old status files
		layout.ReplicatorFailedName,  //
		layout.PrerestoreName,        //
		layout.ReplicatorYAMLTmpName, //
		"scratch.txt",                // anything else the job left
		"old-s3-n0-w0.save",          //
	}
	mk := func(name string) {
		p := h.path(name)
		var err error
		switch {
		case strings.HasPrefix(name, "D"), name == "5", strings.HasSuffix(name, "-tmp"), name == "step=9":
			err = os.MkdirAll(p+"/sub", 0o755)
			if err == nil {
				err = os.WriteFile(p+"/sub/f", []byte("x"), 0o644)
			}
		case strings.HasSuffix(name, "s3-n0-w0.restore"), name == "6":
			err = os.Symlink("D"+hex+".data", p)
		case name == layout.JaxInitInfoName:
			return
		default:
			err = os.WriteFile(p, []byte("old content\n"), 0o644)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	for _, n := range append(slices.Clone(keep), stale...) {
		mk(n)
	}
	h.start(baseYAML, "job")
	want := append(slices.Clone(keep), marker("job", 0, 0, 0, layout.MarkerRestore), layout.PrerestoreName)
	slices.Sort(want)
	if got := h.names(); !slices.Equal(got, want) {
		t.Errorf("namespace after the handshake = %q, want %q", got, want)
	}
}

func TestCommitAndSeal(t *testing.T) {
	t.Parallel()
	nemoYAML := withKeys("framework: pytorch.distributed", "-peer-ranks", "peers-per-node: 1")
	tests := []struct {
		name      string
		doc       string
		save      func(h *harness, files map[string]string) string
		step      int64
		committed string // the name that commits and must disappear
	}{
		{"orbax tmp dir renamed to 7", baseYAML, func(h *harness, f map[string]string) string { return h.orbaxSave(7, f) }, 7, "7"},
		{"nemo step=5 renamed to 4", nemoYAML, func(h *harness, f map[string]string) string { return h.nemoSave(5, f) }, 4, "4"},
		{"orbax step 0 on a fresh start", baseYAML, func(h *harness, f map[string]string) string { return h.orbaxSave(0, f) }, 0, "0"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t, harnessConfig{})
			h.start(tc.doc, "job")
			files := checkpointFiles(tc.name)
			hash := tc.save(h, files)
			meta := h.waitSealed("job", tc.step, tc.committed)
			if meta != hash {
				t.Fatalf(".meta of step %d = %q, want the tree hash %q (no newline)", tc.step, meta, hash)
			}
			data := hash + ".data"
			if !layout.IsDataName(data) || !strings.HasPrefix(data, "D") {
				t.Fatalf("data name %q is not D<64 hex>.data", data)
			}
			if diff := checkTree(h.path(data), files); diff != "" {
				t.Fatalf("sealed data: %s", diff)
			}
			if got, err := layout.HashDir(t.Context(), h.path(data)); err != nil || "D"+got != hash {
				t.Fatalf("HashDir(%s) = %q, %v; want %q", data, got, err, hash)
			}
			if got := h.spoolGlob(data); len(got) != 1 {
				t.Errorf("spool holds %d sealed copies of %s, want 1", len(got), data)
			}
			h.eventually("the step's sync", func() string {
				if syncs, _ := h.coord.syncLog(); len(syncs) != 1 || syncs[0].Step != tc.step {
					return fmt.Sprintf("syncs %+v, want one of step %d", syncs, tc.step)
				}
				return ""
			})
			if st := h.r.Status(); st.Committed != tc.step {
				t.Errorf("status latest committed step %d, want %d", st.Committed, tc.step)
			}
			if h.exists(layout.ReplicatorErrorsName) {
				t.Errorf("a clean save wrote replicator.errors: %q", h.read(layout.ReplicatorErrorsName))
			}
		})
	}
}

func TestCommitPyTorchWorkers(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	doc := "job-name: pt\nframework: pytorch\nnode-rank: 0\nnodes: 1\npeers-per-node: 1\nworkers-per-node: 2\nbackup-interval-minutes: 30"
	h.yamlNemo(doc)
	h.waitMarkers(marker("pt", 0, 0, 0, layout.MarkerRestore), marker("pt", 0, 0, 1, layout.MarkerRestore))

	// Names that are not this node's commits stay as they are.
	ignored := []string{"pt-s3-n1-w0.save", "other-s3-n0-w0.save", "pt-s3-n0-w2.save"}
	for _, n := range ignored {
		h.writeFile(n, "not mine")
	}
	h.makeTree("d.tmp", checkpointFiles("x"))
	h.rename("d.tmp", "5") // a step directory is not a pytorch commit

	// Worker 1 commits a file.
	h.writeFile("pt-s3-n0-w1.save", "tensor of worker 1")
	meta1 := h.waitMeta("pt", 3, 1)
	h.waitGone("pt-s3-n0-w1.save")
	if !layout.IsDataName(meta1+".data") || strings.HasPrefix(meta1, "D") {
		t.Fatalf("worker 1's .meta = %q, want 64 hex (a file's hash)", meta1)
	}
	if got := h.read(meta1 + ".data"); got != "tensor of worker 1" {
		t.Fatalf("%s.data = %q, want the .save file's bytes", meta1, got)
	}
	time.Sleep(20 * time.Millisecond)
	if syncs, _ := h.coord.syncLog(); len(syncs) != 0 {
		t.Fatalf("step 3 synced with only worker 1 committed: %+v", syncs)
	}
	if st := h.r.Status(); st.Committed != -1 {
		t.Fatalf("latest committed %d with only worker 1 of step 3 sealed on a fresh start: want -1 (none yet; step 0 is a step)", st.Committed)
	}

	// Worker 0 commits a directory renamed into place; now the step is complete.
	files := checkpointFiles("w0")
	h.makeTree("w0.tmp", files)
	h.rename("w0.tmp", "pt-s3-n0-w0.save")
	meta0 := h.waitMeta("pt", 3, 0)
	if !strings.HasPrefix(meta0, "D") {
		t.Fatalf("worker 0's .meta = %q, want D<hex> (a directory)", meta0)
	}
	if diff := checkTree(h.path(meta0+".data"), files); diff != "" {
		t.Fatal(diff)
	}
	h.eventually("step 3's sync", func() string {
		if syncs, _ := h.coord.syncLog(); len(syncs) != 1 || syncs[0].Step != 3 {
			return fmt.Sprintf("syncs %+v, want one of step 3", syncs)
		}
		return ""
	})
	if st := h.r.Status(); st.Committed != 3 {
		t.Errorf("status latest committed step %d, want 3", st.Committed)
	}
	for _, n := range append(ignored, "5") {
		if !h.exists(n) {
			t.Errorf("%s is not a commit of this node but was consumed", n)
		}
	}
	for _, n := range []string{"pt-s3-n1-w0.meta", "other-s3-n0-w0.meta", "pt-s3-n0-w2.meta", "pt-s5-n0-w0.meta"} {
		if h.exists(n) {
			t.Errorf("%s must not exist", n)
		}
	}
}

// TestSameContentOfAnotherSlotIsNoStall: two workers saving identical bytes for one step is no
// sign of training not making progress; it was said at every save (found by a black-box run of
// two ranks with identical parts). The same bytes as the slot's own earlier step still are.
func TestSameContentOfAnotherSlotIsNoStall(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.yamlNemo(withKeys("framework: pytorch", "workers-per-node: 2"))
	h.waitMarkers(marker("job", 0, 0, 0, layout.MarkerRestore), marker("job", 0, 0, 1, layout.MarkerRestore))
	for w := range 2 {
		save := marker("job", 1, 0, w, layout.MarkerSave)
		h.writeFile(save, "identical state")
		h.waitExists(marker("job", 1, 0, w, layout.MarkerMeta))
	}
	save := marker("job", 2, 0, 1, layout.MarkerSave)
	h.writeFile(save, "identical state") // worker 1 saves what it saved at step 1
	h.waitExists(marker("job", 2, 0, 1, layout.MarkerMeta))
	h.eventually("one line", func() string {
		l := h.lines(layout.ReplicatorErrorsName)
		if len(l) != 1 || !strings.Contains(l[0], "step 2 has exactly the content of an earlier checkpoint") {
			return fmt.Sprintf("replicator.errors = %q, want the line of step 2 only", l)
		}
		return ""
	})
}

func TestSealingTheSameContentTwiceIsReported(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.start(baseYAML, "job")
	files := checkpointFiles("same")
	hash1 := h.orbaxSave(1, files)
	h.waitSealed("job", 1, "1")
	hash2 := h.orbaxSave(2, files)
	if meta := h.waitSealed("job", 2, "2"); meta != hash1 || hash2 != hash1 {
		t.Fatalf("step 2 .meta %q (tree %q), want step 1's %q", meta, hash2, hash1)
	}
	h.waitExists(layout.ReplicatorErrorsName)
	lines := h.lines(layout.ReplicatorErrorsName)
	if len(lines) != 1 || !errLineRE("not making progress").MatchString(lines[0]) {
		t.Fatalf("replicator.errors = %q, want one line saying training is not making progress", lines)
	}
	if diff := checkTree(h.path(hash1+".data"), files); diff != "" {
		t.Fatal(diff)
	}
}

func TestNotACommit(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.start(baseYAML, "job")
	// A plain mkdir of a decimal name, with files closed inside it.
	h.makeTree("9", checkpointFiles("mkdir"))
	// Renames to names that are not canonical decimals.
	h.makeTree("a.tmp", checkpointFiles("padded"))
	h.rename("a.tmp", "007")
	h.makeTree("b.tmp", checkpointFiles("nested"))
	if err := os.MkdirAll(h.path("sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	h.rename("b.tmp", "sub/8")
	// A file renamed to a decimal name.
	h.writeFile("f.tmp", "file")
	h.rename("f.tmp", "6")

	// Events are handled in order, so once step 10 is sealed the names above were judged.
	h.orbaxSave(10, checkpointFiles("10"))
	h.waitSealed("job", 10, "10")
	for _, n := range []string{"9", "007", "sub", "6"} {
		if !h.exists(n) {
			t.Errorf("%s was consumed as if it were a commit", n)
		}
	}
	for _, step := range []int64{6, 7, 8, 9} {
		if n := marker("job", step, 0, 0, layout.MarkerMeta); h.exists(n) {
			t.Errorf("%s exists: step %d was not committed", n, step)
		}
	}
	h.eventually("step 10's sync", func() string {
		if syncs, _ := h.coord.syncLog(); len(syncs) != 1 {
			return fmt.Sprintf("syncs %+v, want only step 10's", syncs)
		}
		return ""
	})
}

func TestRetentionKeepsOnlyTheLatestStep(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.start(baseYAML, "job")
	var last string
	for step := int64(1); step <= 3; step++ {
		last = h.orbaxSave(step, checkpointFiles(fmt.Sprint(step)))
	}
	h.waitSealed("job", 3, "3")
	wantNS := []string{last + ".data", marker("job", 3, 0, 0, layout.MarkerMeta)}
	h.eventually("retention of steps 1 and 2", func() string {
		var got []string
		for _, n := range h.names() {
			if strings.HasSuffix(n, ".data") || strings.HasSuffix(n, ".meta") {
				got = append(got, n)
			}
		}
		if !slices.Equal(got, wantNS) {
			return fmt.Sprintf("namespace holds %q, want %q", got, wantNS)
		}
		if d, m := h.spoolGlob("*.data"), h.spoolGlob("*.meta"); len(d) != 1 || len(m) != 1 {
			return fmt.Sprintf("spool holds data %q and metas %q, want step 3's only", d, m)
		}
		// The owners and modes kept beside each data go with it.
		if a := h.spoolGlob("*.attrs"); len(a) != 1 || !strings.HasSuffix(a[0], last+".data.attrs") {
			return fmt.Sprintf("spool holds attrs %q, want step 3's only", a)
		}
		return ""
	})
}

func TestRestartAdoptsSealedStep(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.start(baseYAML, "job")
	files := checkpointFiles("7")
	hash := h.orbaxSave(7, files)
	h.waitSealed("job", 7, "7")

	h2 := h.restart() // empty namespace, same spool
	meta := marker("job", 7, 0, 0, layout.MarkerMeta)
	if got, want := h2.names(), []string{hash + ".data", meta}; !slices.Equal(got, want) {
		t.Fatalf("after a restart the namespace = %q, want the adopted %q", got, want)
	}
	if got := h2.read(meta); got != hash {
		t.Fatalf("adopted %s = %q, want %q", meta, got, hash)
	}
	if a := h2.spoolGlob(hash + ".data.attrs"); len(a) != 1 {
		t.Fatalf("the adopted step's owners and modes are gone: %q", a)
	}
	h2.yamlOrbax(baseYAML)
	restore := marker("job", 7, 0, 0, layout.MarkerRestore)
	h2.waitMarkers(restore)
	h2.checkPrerestore(map[string]any{"restore-step": 7})
	h2.checkPublishOrder()
	h2.checkRestoreLink(restore, hash, files)

	// Orbax renames the marker to the step: a symlink named "7" is not a commit.
	h2.rename(restore, "7")
	h2.orbaxSave(8, checkpointFiles("8"))
	h2.waitSealed("job", 8, "8")
	if fi, err := os.Lstat(h2.path("7")); err != nil || fi.Mode()&os.ModeSymlink == 0 {
		t.Errorf("the restored step's symlink 7 must stay untouched: %v, %v", fi, err)
	}
	if h2.exists(layout.ReplicatorErrorsName) {
		t.Errorf("replicator.errors = %q", h2.read(layout.ReplicatorErrorsName))
	}
	// The restored step is synced first (it is protected again without waiting for a save),
	// then step 8; the sync follows the .meta (sealing publishes first), so wait for it.
	h2.eventually("step 8's sync", func() string {
		if syncs, _ := h2.coord.syncLog(); len(syncs) != 2 || syncs[0].Step != 7 || syncs[1].Step != 8 {
			return fmt.Sprintf("syncs %+v, want the restored step 7's, then step 8's", syncs)
		}
		return ""
	})
}

// TestRestartDoesNotTakeAFailedImportForATakenName: an adoption whose import fails with an
// EEXIST of its own (a link whose new name was taken) is a failed import, not the data's name
// being there already. Before ErrNameTaken the agent took any os.ErrExist for the latter,
// verified the spool copy and published the .meta of data the namespace did not hold.
func TestRestartDoesNotTakeAFailedImportForATakenName(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.start(baseYAML, "job")
	hash := h.orbaxSave(7, checkpointFiles("7"))
	h.waitSealed("job", 7, "7")

	cfg := h.cfg
	cfg.importErr = func(name string) error {
		if name == hash+".data" {
			return &os.LinkError{Op: "link", Old: "spool/files/x", New: "spool/files/y", Err: syscall.EEXIST}
		}
		return nil
	}
	h.close()
	h2 := newHarness(t, cfg) // empty namespace, same spool
	meta := marker("job", 7, 0, 0, layout.MarkerMeta)
	if got := h2.names(); slices.Contains(got, meta) {
		t.Fatalf("after a failed import the namespace = %q: it publishes %s without its data", got, meta)
	}
	if d, m := h2.spoolGlob("*.data"), h2.spoolGlob("*.meta"); len(d)+len(m) != 0 {
		t.Errorf("spool still holds %q %q after dropping the step it could not import", d, m)
	}
	// The job starts from nothing (a peer or a backup would have it) and is told why.
	h2.start(baseYAML, "job")
	h2.checkPrerestore(map[string]any{})
	h2.checkEmptyMarker(marker("job", 0, 0, 0, layout.MarkerRestore))
	if !h2.exists(layout.ReplicatorErrorsName) || !strings.Contains(h2.read(layout.ReplicatorErrorsName), "file exists") {
		t.Errorf("the dropped step is not reported with its cause")
	}
}

func TestRestartDropsCorruptedSpoolData(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.start(baseYAML, "job")
	hash := h.orbaxSave(7, checkpointFiles("7"))
	h.waitSealed("job", 7, "7")
	h.close()

	sealed := h.spoolGlob(hash + ".data")
	if len(sealed) != 1 {
		t.Fatalf("spool copies of %s: %q, want 1", hash, sealed)
	}
	victim := sealed[0] + "/state/array_0"
	b, err := os.ReadFile(victim)
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)/2] ^= 0x01 // same size, one bit different
	if err := os.WriteFile(victim, b, 0o644); err != nil {
		t.Fatal(err)
	}

	h2 := h.restart()
	if got := h2.names(); len(got) != 0 {
		t.Fatalf("corrupted data must not be adopted; namespace = %q", got)
	}
	if d, m := h2.spoolGlob("*.data"), h2.spoolGlob("*.meta"); len(d)+len(m) != 0 {
		t.Errorf("spool still holds %q %q after dropping corrupted data", d, m)
	}
	h2.start(baseYAML, "job")
	h2.checkPrerestore(map[string]any{})
	h2.checkEmptyMarker(marker("job", 0, 0, 0, layout.MarkerRestore))
}

func TestCommittedStepSurvivesTheJobDeletingIt(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.start(baseYAML, "job")
	// The job (e.g. Orbax garbage-collecting old steps) deletes "7" after committing it, just
	// before the sealer renames it: the sealed copy in the spool is published instead.
	h.ns.setHook(func(op, name string) {
		if op == "rename" && strings.HasPrefix(name, "7 ") {
			os.RemoveAll(h.path("7"))
		}
	})
	files := checkpointFiles("7")
	hash := h.orbaxSave(7, files)
	if meta := h.waitSealed("job", 7, "7"); meta != hash {
		t.Fatalf(".meta = %q, want %q", meta, hash)
	}
	if diff := checkTree(h.path(hash+".data"), files); diff != "" {
		t.Fatal(diff)
	}
	if h.exists(layout.ReplicatorErrorsName) {
		t.Errorf("replicator.errors = %q", h.read(layout.ReplicatorErrorsName))
	}
}

// backupYAML backs up after every committed step.
var backupYAML = withKeys("-backup-interval-minutes", "backup-interval-steps: 1")

// minute returns baseTime plus n minutes: each step gets its own backup minute.
func minute(n int64) time.Time { return baseTime.Add(time.Duration(n) * time.Minute) }

// saveAndBackUp commits step at minute(step) and waits until its backup is uploaded and done.
func (h *harness) saveAndBackUp(step int64, files map[string]string) string {
	h.t.Helper()
	before, _, _ := h.cfg.store.counts()
	h.cfg.clock.Set(minute(step))
	hash := h.orbaxSave(step, files)
	h.waitSealed("job", step, fmt.Sprint(step))
	h.eventually(fmt.Sprintf("the upload of step %d", step), func() string {
		if n, _, _ := h.cfg.store.counts(); n != before+1 {
			return fmt.Sprintf("%d uploads, want %d", n, before+1)
		}
		return ""
	})
	h.waitIdle()
	return hash
}

// TestStatusAfterAStepSavedAgainAfterItsBackup: a step sealed again, naming other data, after
// this node backed it up is in RAM only, not in a backup yet, until its next backup completes:
// status said it was backed up (a black-box run); the same data sealed again changes nothing.
func TestStatusAfterAStepSavedAgainAfterItsBackup(t *testing.T) {
	t.Parallel()
	store := newTestStore(t)
	h := newHarness(t, harnessConfig{store: store})
	h.start(backupYAML, "job")
	h.saveAndBackUp(3, checkpointFiles("first"))
	require.Nil(t, h.r.Status().InRAMOnly, "step 3 is in a backup")
	store.setBeforeUpload(func(context.Context, tiers.Upload) error { return errors.New("read-only file system") })
	h.orbaxSave(3, checkpointFiles("second"))
	h.eventually("step 3 in RAM only", func() string {
		if st := h.r.Status(); st.InRAMOnly == nil || *st.InRAMOnly != 3 {
			return fmt.Sprintf("in RAM only %v, backed up %d", st.InRAMOnly, st.BackedUp)
		}
		return ""
	})
}

// TestStatusIsOfTheCurrentJob: the latest sealed and backed-up steps that status and the
// metrics show are the current job's: another job started on the mount begins with none.
// Before, it showed the steps of the job before it (found by a black-box run).
func TestStatusIsOfTheCurrentJob(t *testing.T) {
	t.Parallel()
	store := newTestStore(t)
	h := newHarness(t, harnessConfig{store: store})
	h.start(backupYAML, "job")
	h.saveAndBackUp(50, checkpointFiles("50"))
	if st := h.r.Status(); st.Sealed != 50 || st.BackedUp != 50 || st.LastBackup != layout.BackupName(minute(50)) {
		t.Fatalf("status sealed %d, backed up %d (%s); want 50, 50 (%s)", st.Sealed, st.BackedUp, st.LastBackup, layout.BackupName(minute(50)))
	}
	h.yamlOrbax(strings.ReplaceAll(backupYAML, "job-name: job", "job-name: other"))
	h.waitMarkers(marker("other", 0, 0, 0, layout.MarkerRestore))
	if st := h.r.Status(); st.Job != "other" || st.Sealed != -1 || st.BackedUp != -1 || st.LastBackup != "" {
		t.Errorf("status of job %q: sealed %d, backed up %d (%q); want -1, -1 (\"\")", st.Job, st.Sealed, st.BackedUp, st.LastBackup)
	}
	h.orbaxSave(1, checkpointFiles("1"))
	h.waitSealed("other", 1, "1")
	// The sealer notes the step right after it wrote the .meta.
	h.eventually("status to show step 1 sealed", func() string {
		if st := h.r.Status(); st.Sealed != 1 {
			return fmt.Sprintf("status sealed %d, want 1", st.Sealed)
		}
		return ""
	})
}

func TestBackupAfterEveryStep(t *testing.T) {
	t.Parallel()
	store := newTestStore(t)
	h := newHarness(t, harnessConfig{store: store})
	h.start(backupYAML, "job")
	hashes := map[int64]string{}
	for step := int64(1); step <= 3; step++ {
		hashes[step] = h.saveAndBackUp(step, checkpointFiles(fmt.Sprint(step)))
	}
	uploads, problems := store.uploadLog()
	for _, p := range problems {
		t.Error(p)
	}
	if len(uploads) != 3 {
		t.Fatalf("%d uploads, want 3", len(uploads))
	}
	for i, u := range uploads {
		step := int64(i + 1)
		name := layout.BackupName(minute(step))
		if u.Job != "job" || u.Backup != name || u.Step != step || u.Slot != (tiers.Slot{}) || u.Hash != hashes[step] {
			t.Errorf("upload %d = %+v, want job step %d slot n0-w0 hash %s to backup %s", i, u, step, hashes[step], name)
		}
		store.checkDataBeforeMeta(t, "job", name)
		steps, _, err := store.CompleteSteps(t.Context(), "job", name, tiers.Shape{Nodes: 1, Workers: 1})
		if err != nil || len(steps) != 1 || steps[0].Step != step {
			t.Errorf("backup %s: complete steps %+v, %v; want step %d", name, steps, err, step)
		}
	}
	if _, _, clears := store.counts(); clears != 0 {
		t.Errorf("restore.version deleted %d times without a pin", clears)
	}
	if st := h.r.Status(); st.LastBackup != layout.BackupName(minute(3)) {
		t.Errorf("status last backup %q, want %q", st.LastBackup, layout.BackupName(minute(3)))
	}
}

// TestBackupOrdersOfAnEarlierVersionAreTold: rank 0's agent, of an earlier version, gives no
// backup orders (Unimplemented, errors.ErrUnsupported from the remote coordinator): no backup
// holds this node's part, and the job is told once, not only the log every few seconds (a
// black-box run mixed versions: the job learned it when a restore after RAM loss started from
// scratch).
func TestBackupOrdersOfAnEarlierVersionAreTold(t *testing.T) {
	t.Parallel()
	store := newTestStore(t)
	h := newHarness(t, harnessConfig{store: store,
		backupsErr: fmt.Errorf("rank 0's agent is of an earlier version: %w (unknown method Backups)", errors.ErrUnsupported)})
	h.start(backupYAML, "job")
	h.orbaxSave(1, checkpointFiles("1"))
	h.eventually("the job told", func() string {
		for _, l := range h.lines(layout.ReplicatorErrorsName) {
			if strings.Contains(l, "backups of this node's part are not taken: rank 0's agent is of an earlier version") &&
				strings.Contains(l, "run the same mtcfs version on every node of a job") {
				return ""
			}
		}
		return fmt.Sprintf("replicator.errors: %q", h.lines(layout.ReplicatorErrorsName))
	})
	if uploads, _ := store.uploadLog(); len(uploads) != 0 {
		t.Errorf("uploads %+v without an order", uploads)
	}

	// What the coordinator found wrong with the job's backups (a rank that never asks for
	// orders) reaches the job of rank 0.
	h2 := newHarness(t, harnessConfig{store: newTestStore(t), backupTell: "the agent of rank 1 never asked for backup orders"})
	h2.start(backupYAML, "job")
	h2.eventually("the coordinator's line told", func() string {
		for _, l := range h2.lines(layout.ReplicatorErrorsName) {
			if strings.Contains(l, "the agent of rank 1 never asked for backup orders") {
				return ""
			}
		}
		return fmt.Sprintf("replicator.errors: %q", h2.lines(layout.ReplicatorErrorsName))
	})
}

// backedUpStore runs an agent that saves steps 1 and 2, each backed up, and returns the store
// and what each step holds.
func backedUpStore(t *testing.T) (*testStore, map[int64]string, map[int64]map[string]string) {
	store := newTestStore(t)
	h := newHarness(t, harnessConfig{store: store})
	h.start(backupYAML, "job")
	hashes, files := map[int64]string{}, map[int64]map[string]string{}
	for step := int64(1); step <= 2; step++ {
		files[step] = checkpointFiles(fmt.Sprint(step))
		hashes[step] = h.saveAndBackUp(step, files[step])
	}
	h.close()
	return store, hashes, files
}

func TestRestoreFromBackup(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		damage func(t *testing.T, s *testStore, hashes map[int64]string)
		step   int64 // 0: nothing to restore
	}{
		{"newest complete backup", func(*testing.T, *testStore, map[int64]string) {}, 2},
		{"newest lacks its data", func(t *testing.T, s *testStore, h map[int64]string) {
			s.deleteObject(t, "job", layout.BackupName(minute(2)), h[2]+".data")
		}, 1},
		{"newest lacks its .meta", func(t *testing.T, s *testStore, h map[int64]string) {
			s.deleteObject(t, "job", layout.BackupName(minute(2)), marker("job", 2, 0, 0, layout.MarkerMeta))
		}, 1},
		{"no backup is complete", func(t *testing.T, s *testStore, h map[int64]string) {
			s.deleteObject(t, "job", layout.BackupName(minute(2)), h[2]+".data")
			s.deleteObject(t, "job", layout.BackupName(minute(1)), h[1]+".data")
		}, 0},
		// The owners and modes are not part of what makes a backup complete (an earlier agent
		// kept none): the step restores, and the log says its entries got the defaults.
		{"newest lacks its owners and modes", func(t *testing.T, s *testStore, h map[int64]string) {
			s.deleteObject(t, "job", layout.BackupName(minute(2)), h[2]+".data.attrs")
		}, 2},
	}
	const noAttrs = "the backup keeps no owners and modes for this data"
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			store, hashes, files := backedUpStore(t)
			tc.damage(t, store, hashes)
			h := newHarness(t, harnessConfig{store: store}) // a new node: empty spool
			h.yamlOrbax(backupYAML)
			if tc.step == 0 {
				h.waitMarkers(marker("job", 0, 0, 0, layout.MarkerRestore))
				h.checkPrerestore(map[string]any{})
				return
			}
			restore := marker("job", tc.step, 0, 0, layout.MarkerRestore)
			h.waitMarkers(restore)
			h.checkPrerestore(map[string]any{"restore-step": int(tc.step), "restore-backup": layout.BackupName(minute(tc.step))})
			h.checkPublishOrder()
			h.checkRestoreLink(restore, hashes[tc.step], files[tc.step])
			if got := h.read(marker("job", tc.step, 0, 0, layout.MarkerMeta)); got != hashes[tc.step] {
				t.Errorf("restored .meta = %q, want %q", got, hashes[tc.step])
			}
			if _, downloads, _ := store.counts(); downloads != 1 {
				t.Errorf("%d downloads, want 1", downloads)
			}
			if got := h.spoolGlob(hashes[tc.step] + ".data"); len(got) != 1 {
				t.Errorf("restored data is not in the spool: %q", got)
			}
			_, attrsErr := os.Lstat(filepath.Join(store.root, "job", layout.BackupName(minute(tc.step)), hashes[tc.step]+".data.attrs"))
			if warned := strings.Contains(h.logs.String(), noAttrs); warned != errors.Is(attrsErr, os.ErrNotExist) {
				t.Errorf("the backup's attrs object: %v; warned %q: %v", attrsErr, noAttrs, warned)
			}
		})
	}
}

func TestPinnedBackupUnusable(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name  string
		pin   func(t *testing.T, s *testStore, hashes map[int64]string) string
		texts []string // one per line of replicator.errors, each line naming the pin
	}{
		{"missing", func(*testing.T, *testStore, map[int64]string) string { return "2029-12-31_23-59" }, []string{"does not exist"}},
		// No backup can have that name: as missing, not a failed restore (it was: found by a
		// black-box test, a restore.version written by hand).
		{"malformed", func(*testing.T, *testStore, map[int64]string) string { return "fresh-start-please" }, []string{"is not a backup name"}},
		{"incomplete", func(t *testing.T, s *testStore, h map[int64]string) string {
			// An upload that never finished: the .meta, written last, is not there.
			s.deleteObject(t, "job", layout.BackupName(minute(1)), marker("job", 1, 0, 0, layout.MarkerMeta))
			return layout.BackupName(minute(1))
		}, []string{"incomplete"}},
		{"damaged", func(t *testing.T, s *testStore, h map[int64]string) string {
			// A finished backup whose data was lost since: said so, with the first problem.
			s.deleteObject(t, "job", layout.BackupName(minute(1)), h[1]+".data")
			return layout.BackupName(minute(1))
		}, []string{"step 1 is damaged and is not restored: ", "has no intact step: starting from scratch"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			store, hashes, _ := backedUpStore(t) // backup 2 stays complete: the pin must still win
			pin := tc.pin(t, store, hashes)
			store.setPin(t, "job", pin)
			h := newHarness(t, harnessConfig{store: store, clock: newFakeClock(minute(10))})
			h.yamlOrbax(backupYAML)
			s0 := marker("job", 0, 0, 0, layout.MarkerRestore)
			h.waitMarkers(s0)
			h.checkPrerestore(map[string]any{})
			lines := h.lines(layout.ReplicatorErrorsName)
			if len(lines) != len(tc.texts) {
				t.Fatalf("replicator.errors = %q, want %d lines naming %s and saying %q", lines, len(tc.texts), pin, tc.texts)
			}
			for i, text := range tc.texts {
				if !errLineRE(pin).MatchString(lines[i]) || !strings.Contains(lines[i], text) {
					t.Fatalf("replicator.errors line %d = %q, want it to name %s and say %q", i, lines[i], pin, text)
				}
			}
			if e, m := h.opIndex("write "+layout.ReplicatorErrorsName), h.opIndex("write "+s0); e < 0 || e > m {
				t.Fatalf("replicator.errors must be written before the s0 marker; operations %q", h.ns.opLog())
			}
			if _, _, clears := store.counts(); clears != 0 {
				t.Fatalf("restore.version deleted before any sync")
			}
			// One-shot: gone after the next step's sync.
			h.orbaxSave(1, checkpointFiles("after pin"))
			h.eventually("restore.version to be deleted", func() string {
				if _, ok, _ := store.RestoreVersion(t.Context(), "job"); ok {
					return "restore.version still exists"
				}
				return ""
			})
			h.orbaxSave(2, checkpointFiles("after pin 2"))
			h.waitSealed("job", 2, "2")
			if _, _, clears := store.counts(); clears != 1 {
				t.Errorf("restore.version deleted %d times, want once", clears)
			}
		})
	}
}

func TestPinnedBackupWinsOverRAM(t *testing.T) {
	t.Parallel()
	store := newTestStore(t)
	h := newHarness(t, harnessConfig{store: store})
	h.start(backupYAML, "job")
	files1 := checkpointFiles("1")
	hash1 := h.saveAndBackUp(1, files1)
	h.saveAndBackUp(2, checkpointFiles("2"))
	store.setPin(t, "job", layout.BackupName(minute(1))+"\n")

	// The job restarts on the same agent, which holds step 2 in RAM.
	h.cfg.clock.Set(minute(5))
	h.yamlOrbax(backupYAML)
	restore := marker("job", 1, 0, 0, layout.MarkerRestore)
	h.waitMarkers(restore)
	h.checkRestoreLink(restore, hash1, files1)
	if _, downloads, _ := store.counts(); downloads != 1 {
		t.Errorf("%d downloads, want 1 (step 1 was no longer in RAM)", downloads)
	}
	// Re-syncing the pinned step itself does not consume the pin; the next new step does.
	h.saveAndBackUp(6, checkpointFiles("6"))
	if _, ok, _ := store.RestoreVersion(t.Context(), "job"); ok {
		t.Errorf("restore.version survived the sync of a new step")
	}
}

// TestStatusAfterARestoreDropsNewerSteps: once a restore dropped the steps above the restored one
// (the job went back to a pinned backup), status no longer names a dropped step as the newest,
// in RAM only and not in a backup yet, nor does the stop's warning (a black-box run: "step 4 in
// RAM only" after both nodes restored step 2, backed up).
func TestStatusAfterARestoreDropsNewerSteps(t *testing.T) {
	t.Parallel()
	store := newTestStore(t)
	h := newHarness(t, harnessConfig{store: store})
	h.start(backupYAML, "job")
	files1 := checkpointFiles("1")
	hash1 := h.saveAndBackUp(1, files1)
	h.orbaxSave(2, checkpointFiles("2"))
	h.waitSealed("job", 2, "2")
	h.eventually("step 2 in RAM only", func() string { // the sealer notes it just after its .meta
		if st := h.r.Status(); st.InRAMOnly == nil || *st.InRAMOnly != 2 {
			return fmt.Sprintf("newest step in RAM only %v (backed up %d), want 2", st.InRAMOnly, st.BackedUp)
		}
		return ""
	})
	store.setPin(t, "job", layout.BackupName(minute(1))+"\n")
	require.NoError(t, os.Remove(h.path(marker("job", 0, 0, 0, layout.MarkerRestore))))
	h.yamlOrbax(backupYAML) // the job restarts, and goes back to step 1
	restore := marker("job", 1, 0, 0, layout.MarkerRestore)
	h.waitMarkers(restore)
	h.checkRestoreLink(restore, hash1, files1)
	require.False(t, h.exists(marker("job", 2, 0, 0, layout.MarkerMeta)), "step 2 is dropped")
	st := h.r.Status()
	require.Nil(t, st.InRAMOnly, "a dropped step named in RAM only")
	require.EqualValues(t, 1, st.Sealed)
	h.close()
	require.NotContains(t, h.logs.String(), "stopping with the newest step in no backup yet")
}

// TestStatusAfterARestartNamesTheRestoredStepInRAMOnly: the agent restarts while its newest
// step is in no backup (the location refuses writes), and the job restores that step from RAM.
// Status said nothing of it being in RAM only, as it had before the restart (a black-box run:
// "step 2 in RAM only, not in a backup yet" gone after a kill -9 of the agent).
func TestStatusAfterARestartNamesTheRestoredStepInRAMOnly(t *testing.T) {
	t.Parallel()
	store := newTestStore(t)
	h := newHarness(t, harnessConfig{store: store})
	h.start(backupYAML, "job")
	h.saveAndBackUp(1, checkpointFiles("1"))
	store.setBeforeUpload(func(context.Context, tiers.Upload) error { return errors.New("read-only file system") })
	files2 := checkpointFiles("2")
	hash2 := h.orbaxSave(2, files2)
	h.waitSealed("job", 2, "2")

	h2 := h.restart()
	h2.yamlOrbax(backupYAML)
	restore := marker("job", 2, 0, 0, layout.MarkerRestore)
	h2.waitMarkers(restore)
	h2.checkRestoreLink(restore, hash2, files2)
	st := h2.r.Status()
	require.NotNil(t, st.InRAMOnly, "the restored step 2 is in no backup (backed up %d)", st.BackedUp)
	require.EqualValues(t, 2, *st.InRAMOnly)
}

// TestSyncNamesTheStepsData: a sync names the node's data of the step, so that the coordinator
// tells a step saved again (other data) from a retry, and backs it up again.
func TestSyncNamesTheStepsData(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.start(baseYAML, "job")
	first := h.orbaxSave(1, checkpointFiles("first"))
	h.waitSealed("job", 1, "1")
	second := h.orbaxSave(1, checkpointFiles("second"))
	h.eventually("both saves of step 1 synced", func() string {
		syncs, _ := h.coord.syncLog()
		var data []string
		for _, s := range syncs {
			data = append(data, s.Data)
		}
		if !slices.Equal(data, []string{first + ".data", second + ".data"}) {
			return fmt.Sprintf("syncs name %q, want %q then %q", data, first+".data", second+".data")
		}
		return ""
	})
}

// TestWorkerSavingAStepTwiceBeforeTheOtherSavesItOnce: a pytorch node of two workers where
// worker 1 saves step 3 twice before worker 0 saves it, then worker 0 saves it twice too. Once
// every worker reported, each save syncs the step with the workers' latest data: {w0 first,
// w1 second}, then {w0 second, w1 second}, what the node holds. Worker 0's second save waited
// for a worker 1 that had already reported and was never synced: the coordinator kept, and
// backed up, data the node had replaced (a reviewer's reading).
func TestWorkerSavingAStepTwiceBeforeTheOtherSavesItOnce(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.yamlNemo(withKeys("framework: pytorch", "workers-per-node: 2"))
	h.waitMarkers(marker("job", 0, 0, 0, layout.MarkerRestore), marker("job", 0, 0, 1, layout.MarkerRestore))
	save := func(w int, content string) string {
		name := marker("job", 3, 0, w, layout.MarkerSave)
		h.r.Opened(true)
		require.NoError(t, os.WriteFile(h.path(name), []byte(content), 0o644))
		h.r.Flushed(name) // the kernel's order: the close's flush, then the release
		h.r.Closed(name)
		h.waitGone(name)
		meta := marker("job", 3, 0, w, layout.MarkerMeta)
		var got string
		h.eventually("worker's .meta names its save", func() string {
			got = strings.TrimSpace(h.read(meta))
			if h.read(got+".data") != content {
				return fmt.Sprintf("%s names %q, not the data of %q", meta, got, content)
			}
			return ""
		})
		return got + ".data"
	}
	save(1, "worker 1, first save")
	w1b := save(1, "worker 1, second save")
	w0a := save(0, "worker 0, first save")
	w0b := save(0, "worker 0, second save")
	want := []string{w0a + "," + w1b, w0b + "," + w1b}
	h.eventually("two syncs of step 3, each naming the workers' latest data", func() string {
		syncs, _ := h.coord.syncLog()
		var data []string
		for _, s := range syncs {
			data = append(data, s.Data)
		}
		if !slices.Equal(data, want) {
			return fmt.Sprintf("syncs name %q, want %q", data, want)
		}
		return ""
	})
}

func TestNewIncarnation(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.start(withKeys("first-key: 1"), "job")
	first := h.r.Status().Incarnation
	if lines := h.lines(layout.ReplicatorErrorsName); len(lines) != 1 || !strings.Contains(lines[0], "first-key") {
		t.Fatalf("replicator.errors = %q, want the first incarnation's warning", lines)
	}
	require.NoError(t, os.Remove(h.path(layout.ReplicatorErrorsName))) // read, as the job does
	files := checkpointFiles("5")
	hash := h.orbaxSave(5, files)
	h.waitSealed("job", 5, "5")
	h.makeTree("6"+layout.OrbaxTmpSuffix, checkpointFiles("6")) // a save in progress, abandoned

	h.yamlOrbax(withKeys("second-key: 2"))
	restore := marker("job", 5, 0, 0, layout.MarkerRestore)
	h.waitMarkers(restore)
	h.checkRestoreLink(restore, hash, files)
	h.checkPrerestore(map[string]any{"restore-step": 5})
	lines := h.lines(layout.ReplicatorErrorsName)
	if len(lines) != 1 || !strings.Contains(lines[0], "second-key") {
		t.Errorf("replicator.errors of the new incarnation = %q, want only its own warning", lines)
	}
	if h.exists("6" + layout.OrbaxTmpSuffix) {
		t.Errorf("the abandoned save was not cleaned")
	}
	if st := h.r.Status(); st.Incarnation == first || st.Incarnation == "" || st.Restored != 5 {
		t.Errorf("status incarnation %q (first %q) restored %d, want a new incarnation that restored 5", st.Incarnation, first, st.Restored)
	}
}

// --- Races found earlier -----------------------------------------------------------------------
//
// The tests below open race windows deterministically with the fakes' hooks. Each failed against
// an earlier version of the code and names the defect it guards against.

// blockOnce returns a namespace hook that blocks the first operation op on name until release
// is closed; entered is closed when it blocks.
func blockOnce(op, name string) (hook func(string, string), entered, release chan struct{}) {
	entered, release = make(chan struct{}), make(chan struct{})
	var once atomic.Bool
	return func(o, n string) {
		if o != op || n != name || !once.CompareAndSwap(false, true) {
			return
		}
		close(entered)
		<-release
	}, entered, release
}

func countOps(ops []string, op string) int {
	n := 0
	for _, o := range ops {
		if o == op {
			n++
		}
	}
	return n
}

func waitChan(t *testing.T, ch chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(waitTimeout):
		t.Fatalf("timed out waiting for %s", what)
	}
}

// Regression (retain, now in retention.go): retain took its keep-set of hashes under mu, then
// listed spool/sealed without it. Data sealed in between (its hold already released, its .meta
// already recorded, but after the snapshot) is neither in the keep-set nor in flight, so it is
// deleted: the newest committed step loses its data while its .meta stays. Here the retention
// that ends a backup races with the sealer.
func TestRetentionAtBackupEndKeepsAStepSealedMeanwhile(t *testing.T) {
	t.Parallel()
	store := newTestStore(t)
	h := newHarness(t, harnessConfig{store: store}) // the clock stands still: one backup only
	h.start(backupYAML, "job")
	gate := make(chan struct{})
	uploading := make(chan struct{}, 1)
	store.setBeforeUpload(func(_ context.Context, u tiers.Upload) error {
		if u.Step == 1 {
			select {
			case uploading <- struct{}{}:
			default:
			}
			<-gate
		}
		return nil
	})
	h.orbaxSave(1, checkpointFiles("1"))
	h.waitSealed("job", 1, "1")
	// Step 2 comes while step 1's backup runs (it holds step 1): wait for the upload to start,
	// or step 2's sync may free step 1 before the backup order reaches the node.
	waitChan(t, uploading, "the backup of step 1")
	h.orbaxSave(2, checkpointFiles("2"))
	h.waitSealed("job", 2, "2")
	h.eventually("step 2's sync", func() string {
		if syncs, _ := h.coord.syncLog(); len(syncs) != 2 {
			return fmt.Sprintf("syncs %+v", syncs)
		}
		return ""
	})

	// The backup of step 1 ends; its retention stops just after taking its snapshot.
	hook, entered, release := blockOnce("remove", marker("job", 1, 0, 0, layout.MarkerMeta))
	h.ns.setHook(hook)
	close(gate)
	waitChan(t, entered, "the backup's retention")
	hash3 := h.orbaxSave(3, checkpointFiles("3"))
	// The sealer now works on step 3 while the retention is stopped half-way; publishing waits
	// for the retention (or, before the fix, slipped in and lost its data).
	time.Sleep(100 * time.Millisecond)
	close(release)
	h.eventually("step 3 to be sealed and synced", func() string {
		if syncs, _ := h.coord.syncLog(); len(syncs) != 3 {
			return fmt.Sprintf("syncs %+v", syncs)
		}
		return ""
	})
	h.close() // waits for the backup goroutine

	if !h.exists(hash3+".data") || len(h.spoolGlob(hash3+".data")) != 1 {
		t.Errorf("step 3 was sealed but retention freed its data %s.data (namespace %q); its .meta %q remains",
			hash3, h.names(), h.read(marker("job", 3, 0, 0, layout.MarkerMeta)))
	}
}

// Regression (restore.go, bringIn, now restoreSlot): bringIn released its hold on the data it
// brought in when it returns, but the .meta that protects the data from retention is written
// only afterwards. A retention in that window (here the one that ends a backup of the previous
// incarnation) frees the data, and the .restore marker then points at nothing.
func TestRetentionDuringRestoreKeepsTheRestoredData(t *testing.T) {
	t.Parallel()
	store := newTestStore(t)
	h := newHarness(t, harnessConfig{store: store})
	h.start(backupYAML, "job")
	files1 := checkpointFiles("1")
	hash1 := h.saveAndBackUp(1, files1)
	h.saveAndBackUp(2, checkpointFiles("2")) // step 1 leaves RAM

	gate := make(chan struct{})
	store.setBeforeUpload(func(_ context.Context, u tiers.Upload) error {
		if u.Step == 3 {
			<-gate
		}
		return nil
	})
	h.cfg.clock.Set(minute(3))
	h.orbaxSave(3, checkpointFiles("3"))
	h.waitSealed("job", 3, "3")
	h.eventually("the backup of step 3 to start", func() string {
		if n, _, _ := store.counts(); n != 3 {
			return fmt.Sprintf("%d uploads", n)
		}
		return ""
	})

	// The job restarts pinned to step 1's backup; the restore stops between bringIn and the .meta.
	store.setPin(t, "job", layout.BackupName(minute(1)))
	hook, entered, release := blockOnce("write", marker("job", 1, 0, 0, layout.MarkerMeta))
	h.ns.setHook(hook)
	h.yamlOrbax(backupYAML)
	waitChan(t, entered, "the restore to write step 1's .meta")
	removals := func() int { return countOps(h.ns.opLog(), "remove "+hash1+".data") }
	before := removals() // incarnation 1 freed step 1 once already
	close(gate)          // the old incarnation's backup ends and runs retention
	h.eventually("the old incarnation's backup to end", func() string {
		if st := h.r.Status(); st.LastBackup != layout.BackupName(minute(3)) {
			return "last backup " + st.LastBackup
		}
		return ""
	})
	// Its retention runs right after; give it time to do harm.
	for deadline := time.Now().Add(200 * time.Millisecond); time.Now().Before(deadline) && removals() == before; {
		time.Sleep(2 * time.Millisecond)
	}
	close(release)
	restore := marker("job", 1, 0, 0, layout.MarkerRestore)
	h.waitMarkers(restore)
	if diff := checkTree(h.path(restore), files1); diff != "" {
		t.Errorf("the restore marker of step 1 is unusable (%s): retention freed the data being restored; operations %q",
			diff, h.ns.opLog())
	}
}

// Regression (appendLine, now in joblines.go): appending was a read-modify-write of the whole
// file with no lock, and it runs on several goroutines (sealer, backup, restore, control loop).
// Two concurrent appends lose one line.
func TestConcurrentErrorLinesAreAllKept(t *testing.T) {
	t.Parallel()
	store := newTestStore(t)
	h := newHarness(t, harnessConfig{store: store})
	h.start(backupYAML, "job")
	gate := make(chan struct{})
	store.setBeforeUpload(func(_ context.Context, u tiers.Upload) error {
		<-gate
		return errors.New("injected upload failure")
	})
	files := checkpointFiles("same")
	h.orbaxSave(1, files)
	h.waitSealed("job", 1, "1")

	// Step 2 has step 1's content: the sealer appends "not making progress" and stops just
	// before writing the file; meanwhile the backup fails and appends its own line.
	hook, entered, release := blockOnce("write", layout.ReplicatorErrorsName)
	h.ns.setHook(hook)
	h.orbaxSave(2, files)
	waitChan(t, entered, "the sealer's error line")
	close(gate)
	// The backup fails now and tries to append while the sealer's append is stopped half-way.
	time.Sleep(100 * time.Millisecond)
	close(release)
	h.waitSealed("job", 2, "2") // the sealer wrote its line before the .meta
	h.eventually("the backup failure line", func() string {
		if !strings.Contains(h.read(layout.ReplicatorErrorsName), "injected upload failure") {
			return "no backup failure line yet"
		}
		return ""
	})
	lines := h.lines(layout.ReplicatorErrorsName)
	text := strings.Join(lines, "\n")
	if !strings.Contains(text, "not making progress") || !strings.Contains(text, "injected upload failure") {
		t.Errorf("replicator.errors = %q, want both the sealer's and the backup's line", lines)
	}
}

// TestRestoreFromABackupThatRotted: the newest backup's data changed on its storage in a way the
// listing does not show (a flipped byte, the mtime kept), so the restore plan picks it and the
// download fails its check, twice. The restore fails (replicator.failed), and marks the data
// damaged in the backup: the job's next start passes over it, says so in replicator.errors,
// and restores the older backup instead of failing on the same data again.
func TestRestoreFromABackupThatRotted(t *testing.T) {
	t.Parallel()
	store, hashes, files := backedUpStore(t)
	rot(t, store, layout.BackupName(minute(2)), hashes[2])

	h := newHarness(t, harnessConfig{store: store}) // a new node: empty spool
	h.yamlOrbax(backupYAML)
	h.eventually("the restore to fail", func() string {
		if l := h.lines(layout.ReplicatorFailedName); len(l) != 1 || !strings.Contains(l[0], "is now marked damaged in the backup") {
			return fmt.Sprintf("replicator.failed = %q", l)
		}
		return ""
	})
	if _, downloads, _ := store.counts(); downloads != 2 {
		t.Errorf("%d downloads, want 2 (one more after the first failed its check)", downloads)
	}
	// The other nodes are told, for as long as their jobs wait for their restore: a rank 0
	// frozen past 10 s (SIGSTOP) was never told, and its job waited out its 300 s (a black-box
	// run); the call is retried until rank 0 answers (RemoteCoordinator).
	h.eventually("the other nodes to be told", func() string {
		if calls := h.coord.restoreFailedCalls(); len(calls) != 1 || calls[0] < 4*time.Minute {
			return fmt.Sprintf("RestoreFailed calls with time left %v, want one with the job's wait (5m)", calls)
		}
		return ""
	})

	// The job restarts: the rotted backup is passed over, with a word, for the older one.
	h.yamlOrbax(backupYAML)
	restore := marker("job", 1, 0, 0, layout.MarkerRestore)
	h.waitMarkers(restore)
	h.checkPrerestore(map[string]any{"restore-step": 1, "restore-backup": layout.BackupName(minute(1))})
	h.checkRestoreLink(restore, hashes[1], files[1])
	errs := strings.Join(h.lines(layout.ReplicatorErrorsName), "\n")
	for _, want := range []string{"backup " + layout.BackupName(minute(2)) + ": step 2 is damaged and is not restored: " + hashes[2] + ".data: a restore found it damaged: rank 0",
		"1 damaged backup step; restoring step 1 from backup " + layout.BackupName(minute(1)) + " instead"} {
		if !strings.Contains(errs, want) {
			t.Errorf("replicator.errors:\n%s\nwant it to say %q", errs, want)
		}
	}
}

// TestRestoreFromABackupThatRottedInAReadOnlyLocation: as TestRestoreFromABackupThatRotted, but
// the location refuses the record of the damage (read-only or full). Found by a black-box test:
// every later start of the job failed on the same data, although the older backup was intact.
// The agent remembers the damage (RememberDamage, as cmd wires the store) and its next plan
// passes over it; the job is told that only this agent knows.
func TestRestoreFromABackupThatRottedInAReadOnlyLocation(t *testing.T) {
	t.Parallel()
	store, hashes, files := backedUpStore(t)
	rot(t, store, layout.BackupName(minute(2)), hashes[2])
	store.BackupStore = tiers.RememberDamage(refusedMarks{store.BackupStore})

	h := newHarness(t, harnessConfig{store: store})
	h.yamlOrbax(backupYAML)
	h.eventually("the restore to fail", func() string {
		if l := h.lines(layout.ReplicatorFailedName); len(l) != 1 || !strings.Contains(l[0], "the backup location refused the record of its damage (read-only file system)") {
			return fmt.Sprintf("replicator.failed = %q", l)
		}
		return ""
	})
	for _, o := range store.objectsOf(t, "job", layout.BackupName(minute(2))) {
		if strings.HasSuffix(o.Name, ".damaged") {
			t.Fatalf("%s is in the backup, but the location refused every write", o.Name)
		}
	}

	h.yamlOrbax(backupYAML)
	restore := marker("job", 1, 0, 0, layout.MarkerRestore)
	h.waitMarkers(restore)
	h.checkPrerestore(map[string]any{"restore-step": 1, "restore-backup": layout.BackupName(minute(1))})
	h.checkRestoreLink(restore, hashes[1], files[1])
	errs := strings.Join(h.lines(layout.ReplicatorErrorsName), "\n")
	for _, want := range []string{"backup " + layout.BackupName(minute(2)) + ": step 2 is damaged and is not restored: " + hashes[2] + ".data failed its check at a restore by this agent",
		"1 damaged backup step; restoring step 1 from backup " + layout.BackupName(minute(1)) + " instead"} {
		if !strings.Contains(errs, want) {
			t.Errorf("replicator.errors:\n%s\nwant it to say %q", errs, want)
		}
	}
}

// refusedMarks is a backup location that refuses the record of damaged data.
type refusedMarks struct{ tiers.BackupStore }

func (refusedMarks) MarkDamaged(context.Context, string, string, string, string) error {
	return errors.New("read-only file system")
}

// TestRestoreGivenUpAtTheBarrierTellsRankZero: a node that gives up waiting for the others at
// the barrier (rank 0 not reached for 90 s: frozen, a stalled VM) tells rank 0, for when it
// answers again: before, only failures before the barrier did, and a rank 0 frozen past the
// give-up never learnt that this node's job had failed; its own job waited out its 300 s at a
// barrier this node would never reach (a black-box run).
func TestRestoreGivenUpAtTheBarrierTellsRankZero(t *testing.T) {
	t.Parallel()
	coord := &giveUpCoordinator{Coordinator: replication.LocalClient{Job: replication.NewJob(replication.Options{})}}
	h := newHarness(t, harnessConfig{coord: coord})
	h.yamlOrbax(baseYAML)
	h.eventually("the restore to fail", func() string {
		if l := h.lines(layout.ReplicatorFailedName); len(l) != 1 || !strings.Contains(l[0], "waiting for the other nodes to restore failed: rank 0's coordinator") {
			return fmt.Sprintf("replicator.failed = %q", l)
		}
		return ""
	})
	h.eventually("rank 0 to be told", func() string {
		coord.mu.Lock()
		defer coord.mu.Unlock()
		if len(coord.told) != 1 || !strings.Contains(coord.told[0], "waiting for the other nodes to restore failed") {
			return fmt.Sprintf("RestoreFailed reasons %q", coord.told)
		}
		return ""
	})
}

// giveUpCoordinator fails every Restored call as a rank 0 not reached does, and records the
// RestoreFailed calls.
type giveUpCoordinator struct {
	tiers.Coordinator
	mu   sync.Mutex
	told []string // GUARDED_BY(mu)
}

func (c *giveUpCoordinator) Restored(context.Context, tiers.Incarnation) error {
	return errors.New("rank 0's coordinator, which planned this restore, was not reached for 1m30s: restart the job")
}

func (c *giveUpCoordinator) RestoreFailed(_ context.Context, _ tiers.Incarnation, reason string) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.told = append(c.told, reason)
	return nil
}

// TestRestoreFromBackupAfterAFaultOnTheWay: data that fails its check once (a fault between the
// store and the node) is downloaded again and restored; nothing is marked damaged.
func TestRestoreFromBackupAfterAFaultOnTheWay(t *testing.T) {
	t.Parallel()
	store, hashes, files := backedUpStore(t)
	store.mu.Lock()
	store.afterDownload = func(n int, dest string) {
		if n != 1 {
			return
		}
		filepath.WalkDir(dest, func(p string, d fs.DirEntry, err error) error {
			if err == nil && d.Type().IsRegular() {
				if data, rerr := os.ReadFile(p); rerr == nil && len(data) > 0 {
					data[0] ^= 1
					os.WriteFile(p, data, 0o644)
				}
				return fs.SkipAll
			}
			return err
		})
	}
	store.mu.Unlock()
	h := newHarness(t, harnessConfig{store: store})
	h.yamlOrbax(backupYAML)
	restore := marker("job", 2, 0, 0, layout.MarkerRestore)
	h.waitMarkers(restore)
	h.checkRestoreLink(restore, hashes[2], files[2])
	if _, downloads, _ := store.counts(); downloads != 2 {
		t.Errorf("%d downloads, want 2", downloads)
	}
	for _, o := range store.objectsOf(t, "job", layout.BackupName(minute(2))) {
		if strings.HasSuffix(o.Name, ".damaged") {
			t.Errorf("%s written after a fault that the second download did not meet", o.Name)
		}
	}
	if l := h.lines(layout.ReplicatorFailedName); len(l) != 0 {
		t.Errorf("replicator.failed = %q", l)
	}
}

// rot flips a byte of a data file of hash in the file:// backup, keeping its mtime: bit rot the
// store's listing does not show, so only reading the data notices.
func rot(t *testing.T, store *testStore, backup, hash string) {
	t.Helper()
	rotted := filepath.Join(store.root, "job", backup, hash+".data")
	var victim string
	if err := filepath.WalkDir(rotted, func(p string, d fs.DirEntry, err error) error {
		if err == nil && victim == "" && d.Type().IsRegular() {
			victim = p
		}
		return err
	}); err != nil || victim == "" {
		t.Fatalf("no data file under %s: %v", rotted, err)
	}
	fi, err := os.Stat(victim)
	if err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(victim)
	if err != nil || len(data) == 0 {
		t.Fatalf("read %s: %v (%d bytes)", victim, err, len(data))
	}
	data[len(data)/2] ^= 0x10
	if err := os.WriteFile(victim, data, fi.Mode()); err != nil {
		t.Fatal(err)
	}
	if err := os.Chtimes(victim, fi.ModTime(), fi.ModTime()); err != nil {
		t.Fatal(err)
	}
}

// TestEveryBackupRotted: both backups rotted. Each start fails on the newest backup not yet
// marked, and marks it; the third start has no intact checkpoint left, says so for both, and
// starts from scratch instead of failing again.
func TestEveryBackupRotted(t *testing.T) {
	t.Parallel()
	store, hashes, _ := backedUpStore(t)
	rot(t, store, layout.BackupName(minute(2)), hashes[2])
	rot(t, store, layout.BackupName(minute(1)), hashes[1])
	h := newHarness(t, harnessConfig{store: store})
	for _, step := range []int64{2, 1} {
		h.yamlOrbax(backupYAML)
		h.eventually(fmt.Sprintf("the restore of step %d to fail", step), func() string {
			l := h.lines(layout.ReplicatorFailedName)
			if len(l) != 1 || !strings.Contains(l[0], fmt.Sprintf("restore of step %d failed", step)) || !strings.Contains(l[0], "is now marked damaged") {
				return fmt.Sprintf("replicator.failed = %q", l)
			}
			return ""
		})
	}
	h.yamlOrbax(backupYAML)
	h.waitMarkers(marker("job", 0, 0, 0, layout.MarkerRestore))
	h.checkPrerestore(map[string]any{})
	errs := strings.Join(h.lines(layout.ReplicatorErrorsName), "\n")
	for _, want := range []string{"step 2 is damaged and is not restored: " + hashes[2] + ".data: a restore found it damaged",
		"step 1 is damaged and is not restored: " + hashes[1] + ".data: a restore found it damaged",
		"2 damaged backup steps and no intact checkpoint is left: starting from scratch"} {
		if !strings.Contains(errs, want) {
			t.Errorf("replicator.errors:\n%s\nwant it to say %q", errs, want)
		}
	}
	if _, downloads, _ := store.counts(); downloads != 4 {
		t.Errorf("%d downloads, want 4 (two per rotted backup)", downloads)
	}
}

// TestRestoreGivesTheStepToTheJobsUser: the handshake takes the job's user from the owner of
// its replicator.yaml, and a restore of data another user owns gives it to that user, from the
// attrs kept beside it; a yaml written by root gives nothing (fs tests what Reown does).
func TestRestoreGivesTheStepToTheJobsUser(t *testing.T) {
	t.Parallel()
	if os.Geteuid() != 0 {
		t.Skip("needs root to give the yaml another owner")
	}
	h := newHarness(t, harnessConfig{})
	h.start(baseYAML, "job")
	hash := h.orbaxSave(7, checkpointFiles("7"))
	h.waitSealed("job", 7, "7")
	reowns := func(h *harness) []string {
		var got []string
		for _, op := range h.ns.opLog() {
			if strings.HasPrefix(op, "reown ") {
				got = append(got, op)
			}
		}
		return got
	}

	h2 := h.restart()
	h2.yamlOrbax(baseYAML) // written by root, the test
	restore := marker("job", 7, 0, 0, layout.MarkerRestore)
	h2.waitMarkers(restore)
	if got := reowns(h2); len(got) != 0 {
		t.Errorf("a root yaml says nothing of the job's user, yet: %q", got)
	}

	h3 := h2.restart()
	h3.writeFile(layout.ReplicatorYAMLTmpName, baseYAML)
	if err := os.Chown(h3.path(layout.ReplicatorYAMLTmpName), 1000, 1000); err != nil {
		t.Fatal(err)
	}
	h3.rename(layout.ReplicatorYAMLTmpName, layout.ReplicatorYAMLName)
	h3.waitMarkers(restore)
	if got, want := reowns(h3), []string{"reown " + hash + ".data 1000 attrs=true"}; !slices.Equal(got, want) {
		t.Errorf("restored for uid 1000: %q, want %q", got, want)
	}
}

// After a restore the restored step counts as sealed on the node (it is sealed data), as it
// counts as committed and, once re-protected, replicated. Before, a restarted agent said
// sealed -1 beside committed and replicated 3 until the job saved again (found by a
// black-box run, in /metrics).
func TestRestoredStepCountsAsSealed(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	doc := withKeys()
	h.start(doc, "job")
	h.orbaxSave(3, checkpointFiles("3"))
	h.waitSealed("job", 3, "3")
	h2 := h.restart()
	h2.yamlOrbax(doc)
	h2.waitMarkers(marker("job", 3, 0, 0, layout.MarkerRestore))
	h2.eventually("the restored step's status", func() string {
		if st := h2.r.Status(); st.Committed != 3 || st.Sealed != 3 || st.Replicated != 3 {
			return fmt.Sprintf("committed %d, sealed %d, replicated %d: want 3, 3, 3", st.Committed, st.Sealed, st.Replicated)
		}
		return ""
	})
}

// Status shows the lines reported to the newest incarnation's job, not another job's on the same
// mount: before, a second job's status led with the first job's errors (found by a black-box
// run).
func TestStatusErrorsAreTheJobs(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.start(withKeys("bogus-key: 1"), "job")
	if errs := h.r.Status().Errors; len(errs) != 1 || !strings.Contains(errs[0], `job=job `) || !strings.Contains(errs[0], `unknown key "bogus-key"`) {
		t.Fatalf("status errors of job: %q", errs)
	}
	h.start(withKeys("job-name: other", "other-bogus: 1"), "other")
	errs := h.r.Status().Errors
	if len(errs) == 0 {
		t.Fatal("status shows no error of job other")
	}
	for _, e := range errs {
		if !strings.Contains(e, "job=other ") {
			t.Errorf("status of job other shows %q", e)
		}
	}
}

// Before anything is sealed or restored, sealed is -1, not the 0 of "nothing restored".
func TestSealedBeforeAnyStepIsMinusOne(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.start(withKeys(), "job")
	if st := h.r.Status(); st.Sealed != -1 {
		t.Fatalf("sealed %d on a fresh start, want -1", st.Sealed)
	}
}

// backedUpThenGone saves step 1 of a one-node job ("job") with a backup after every step, waits
// for its complete backup and closes the agent: a new harness on the store is a node whose RAM
// was lost. It returns the store, the job's yaml and the backup's name.
func backedUpThenGone(t *testing.T) (store *testStore, doc, backup string) {
	t.Helper()
	store = newTestStore(t)
	h := newHarness(t, harnessConfig{store: store})
	doc = withKeys("backup-interval-steps: 1", "-backup-interval-minutes")
	h.start(doc, "job")
	h.orbaxSave(1, checkpointFiles("1"))
	backup = h.waitBackedUp(store, "job", 1, 1)
	h.close()
	return store, doc, backup
}

// A step restored from a backup is in a complete backup: status says so (last backup, step
// backed up) as it would had this node uploaded it. Before, an agent that restored from a
// backup said backed_up -1 in /metrics and no last backup (found by a black-box run).
func TestStepRestoredFromABackupCountsAsBackedUp(t *testing.T) {
	t.Parallel()
	store, doc, name := backedUpThenGone(t)
	h2 := newHarness(t, harnessConfig{store: store}) // the node's RAM is lost
	h2.yamlOrbax(doc)
	h2.waitMarkers(marker("job", 1, 0, 0, layout.MarkerRestore))
	if st := h2.r.Status(); st.BackedUp != 1 || st.LastBackup != name {
		t.Fatalf("backed up %d, last backup %q: want 1, %q", st.BackedUp, st.LastBackup, name)
	}
}

// TestWithdrawLines: a line withdrawn (the restart notice no job read) leaves the other lines
// of the file, and the file goes with its last line.
func TestWithdrawLines(t *testing.T) {
	h := newHarness(t, harnessConfig{})
	p := h.path(layout.ReplicatorFailedName)
	other := "2030-01-01T00:00:00Z job=j node=0/1 FATAL restore of step 5 failed\n"
	ours := "2030-01-01T00:00:01Z job=j node=0/1 FATAL … while incarnation abc (since …) waited …\n"
	if err := os.WriteFile(p, []byte(other+ours+other), 0o644); err != nil {
		t.Fatal(err)
	}
	if !h.r.WithdrawLines(layout.ReplicatorFailedName, "while incarnation abc ") {
		t.Fatal("the line was not withdrawn")
	}
	if got, _ := os.ReadFile(p); string(got) != other+other {
		t.Fatalf("left %q, want the two other lines", got)
	}
	if h.r.WithdrawLines(layout.ReplicatorFailedName, "while incarnation abc ") {
		t.Fatal("withdrawn twice")
	}
	if err := os.WriteFile(p, []byte(ours), 0o644); err != nil {
		t.Fatal(err)
	}
	if !h.r.WithdrawLines(layout.ReplicatorFailedName, "while incarnation abc ") || fileThere(p) {
		t.Fatal("a file left without a line is removed")
	}
	if h.r.WithdrawLines(layout.ReplicatorFailedName, "while incarnation abc ") {
		t.Fatal("nothing to withdraw from a missing file")
	}
}

// TestIncarnationsNameTheOnesTheySupersede: each Negotiate names the agent's earlier
// incarnations, the previous agent's last one on the spool included, so that the coordinator
// refuses a call of theirs arriving late (replication's TestLateNegotiateOfAGivenUpIncarnation).
func TestIncarnationsNameTheOnesTheySupersede(t *testing.T) {
	t.Parallel()
	mnt := filepath.Join(t.TempDir(), "mnt")
	require.NoError(t, os.Mkdir(mnt, 0o755))
	h := newHarness(t, harnessConfig{mountPath: mnt})
	restart := func(h *harness) {
		if err := os.Remove(h.path(marker("job", 0, 0, 0, layout.MarkerRestore))); err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
		h.start(baseYAML, "job")
	}
	restart(h)
	restart(h)
	incs := h.coord.negotiated()
	require.Len(t, incs, 2)
	assert.Empty(t, incs[0].Superseded, "a new spool's first incarnation")
	assert.Equal(t, []string{incs[0].ID}, incs[1].Superseded)
	h2 := h.restart()
	restart(h2)
	incs2 := h2.coord.negotiated()
	require.Len(t, incs2, 1)
	assert.Equal(t, []string{incs[1].ID}, incs2[0].Superseded, "the previous agent's last incarnation, from the spool's owner record")
	for range tiers.MaxSuperseded + 2 {
		restart(h2)
	}
	incs2 = h2.coord.negotiated()
	last := incs2[len(incs2)-1].Superseded
	assert.Len(t, last, tiers.MaxSuperseded)
	assert.Equal(t, incs2[len(incs2)-2].ID, last[len(last)-1], "the newest last")
}

// gatedCoordinator holds every Negotiate while gate is set (a link to rank 0 that stalls).
type gatedCoordinator struct {
	tiers.Coordinator
	gate atomic.Pointer[chan struct{}]
	held atomic.Int64 // negotiations that reached a gate
}

func (g *gatedCoordinator) Negotiate(ctx context.Context, inc tiers.Incarnation, inv tiers.Inventory) (tiers.RestorePlan, error) {
	if ch := g.gate.Load(); ch != nil {
		g.held.Add(1)
		select {
		case <-*ch:
		case <-ctx.Done():
			return tiers.RestorePlan{}, ctx.Err()
		}
	}
	return g.Coordinator.Negotiate(ctx, inc, inv)
}

// waitHeld waits for a negotiation to reach the gate: its inventory is taken, so a step the job
// commits from now on is not in its plan (a step sealed before a late negotiation was, under
// load, and the plan restored it rather than the step the test held the restore of).
func (g *gatedCoordinator) waitHeld(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for g.held.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("no negotiation reached the gate")
		}
		time.Sleep(time.Millisecond)
	}
}

// syncOrderCoordinator is a gatedCoordinator that records the steps synced, in order, and
// those the coordinator refused; byInc records the steps synced by incarnation.
type syncOrderCoordinator struct {
	*gatedCoordinator
	mu      sync.Mutex
	synced  []int64
	refused []int64
	byInc   map[string][]int64
}

func (c *syncOrderCoordinator) Sync(ctx context.Context, inc tiers.Incarnation, rep tiers.SyncReport) (tiers.SyncDecision, error) {
	dec, err := c.gatedCoordinator.Sync(ctx, inc, rep)
	c.mu.Lock()
	if err != nil {
		c.refused = append(c.refused, rep.Step)
	} else {
		c.synced = append(c.synced, rep.Step)
		if c.byInc == nil {
			c.byInc = map[string][]int64{}
		}
		c.byInc[inc.ID] = append(c.byInc[inc.ID], rep.Step)
	}
	c.mu.Unlock()
	return dec, err
}

// TestRestoredStepIsSyncedBeforeStepsCommittedDuringItsRestore: a step the job commits while
// its restore waits, which the syncer takes only once the restore is done but before the
// restored step, is synced after it. Before, it went first; the coordinator, which takes steps
// in order, refused the restored step, and the job read "sync of step 5 failed" (1 run in about
// 100 of TestStepsCommittedWhileTheRestoreWaitsAreKept). The order is forced here: the syncer
// is held on step 6 until the restore is done, with the restored step queued behind it.
func TestRestoredStepIsSyncedBeforeStepsCommittedDuringItsRestore(t *testing.T) {
	t.Parallel()
	coord := &syncOrderCoordinator{gatedCoordinator: &gatedCoordinator{Coordinator: replication.LocalClient{Job: replication.NewJob(replication.Options{})}}}
	taken6, release := make(chan struct{}), make(chan struct{})
	releaseOnce := sync.OnceFunc(func() { close(release) })
	var holding atomic.Bool
	h := newHarness(t, harnessConfig{coord: coord, syncerPop: func(step int64, restored bool) {
		if step == 6 && !restored && holding.CompareAndSwap(true, false) {
			close(taken6)
			<-release
		}
	}})
	t.Cleanup(releaseOnce) // runs before the harness's close, which waits for the syncer
	h.start(baseYAML, "job")
	hash5 := h.orbaxSave(5, checkpointFiles("5"))
	h.waitSealed("job", 5, "5")
	gate := make(chan struct{})
	coord.gate.Store(&gate)
	require.NoError(t, os.Remove(h.path(marker("job", 0, 0, 0, layout.MarkerRestore))))
	holding.Store(true)
	h.yamlOrbax(baseYAML) // the job restarts; its negotiation is held
	h.waitGone(layout.ReplicatorYAMLName)
	coord.waitHeld(t)                    // its inventory is taken: the plan restores step 5
	h.orbaxSave(6, checkpointFiles("6")) // and it saves without waiting for its markers
	select {
	case <-taken6: // the syncer holds step 6, taken while the restore runs
	case <-time.After(30 * time.Second):
		t.Fatal("the syncer did not take step 6")
	}
	close(gate)
	restore5 := marker("job", 5, 0, 0, layout.MarkerRestore)
	h.waitMarkers(restore5) // the restore is done; the restored step is queued behind step 6
	releaseOnce()
	h.eventually("step 6 synced", func() string {
		if st := h.r.Status(); st.Replicated != 6 {
			return fmt.Sprintf("latest replicated step %d", st.Replicated)
		}
		return ""
	})
	coord.mu.Lock()
	synced, refused := slices.Clone(coord.synced), slices.Clone(coord.refused)
	restarted := slices.Clone(coord.byInc[h.r.Status().Incarnation])
	coord.mu.Unlock()
	require.Empty(t, refused, "syncs refused (synced: %v)", synced)
	require.Equal(t, []int64{5, 6}, synced[len(synced)-2:], "the syncs, in order")
	// The restored step itself is synced in the restarted incarnation, first (a step 6 synced
	// first left step 5 below it: not sent at all, which the two checks above did not see).
	require.Equal(t, []int64{5, 6}, restarted, "the restarted incarnation's syncs, in order")
	require.NotContains(t, h.logs.String(), "passed over")
	require.NotContains(t, h.logs.String(), "a step below one already committed")
	for _, l := range h.lines(layout.ReplicatorErrorsName) {
		require.NotContains(t, l, "sync of step")
	}
	h.checkRestoreLink(restore5, hash5, checkpointFiles("5"))
}

// TestAStepBelowTheRestoredOneIsToldNotSynced: a job handed step 3 by its restore (a new run
// of the same job-name, say) that saves step 1 is told that step 1 is neither replicated nor
// backed up, and why. The coordinator refuses a rank's steps out of order; for a while the
// refusal was passed over in silence, and the run's work was lost with the RAM (a black-box run).
func TestAStepBelowTheRestoredOneIsToldNotSynced(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.start(baseYAML, "job")
	h.orbaxSave(3, checkpointFiles("3"))
	h.waitSealed("job", 3, "3")
	require.NoError(t, os.Remove(h.path(marker("job", 0, 0, 0, layout.MarkerRestore))))
	h.yamlOrbax(baseYAML) // the job restarts, and is handed step 3
	restore3 := marker("job", 3, 0, 0, layout.MarkerRestore)
	h.waitMarkers(restore3)
	h.orbaxSave(1, checkpointFiles("1")) // and counts from 1 again
	h.waitSealed("job", 1, "1")
	h.eventually("the line", func() string {
		for _, l := range h.lines(layout.ReplicatorErrorsName) {
			if strings.Contains(l, "step 1 was saved after step 3 in this run (restored or committed): steps are kept in increasing order, so step 1 (and any later one below step 3) stays in this node's RAM only, is not replicated nor backed up, and a restart restores step 3") {
				return ""
			}
		}
		return fmt.Sprintf("replicator.errors = %q", h.lines(layout.ReplicatorErrorsName))
	})
	require.Equal(t, int64(3), h.r.Status().Replicated)
	h.orbaxSave(2, checkpointFiles("2")) // told once per start, not at every save
	h.waitSealed("job", 2, "2")
	h.eventually("step 2 passed over", func() string {
		if strings.Count(h.logs.String(), `msg="a step below one already committed in this run is not synced" step=2`) == 0 {
			return "not yet"
		}
		return ""
	})
	n := 0
	for _, l := range h.lines(layout.ReplicatorErrorsName) {
		if strings.Contains(l, "in this run (restored or committed)") {
			n++
		}
	}
	require.Equal(t, 1, n, "%q", h.lines(layout.ReplicatorErrorsName))
}

// TestStepsCommittedWhileAFreshStartWaitsAreKept: on the job's first start (no shape recorded
// in the spool yet), the steps it commits while its negotiation is held are kept too, and its
// next start restores them. Before, the restore kept them from one drop and dropped them in
// the next, as of an unrecorded shape, after telling the job they were kept; and their sync,
// refused before the restore ended, was never made (a review).
func TestStepsCommittedWhileAFreshStartWaitsAreKept(t *testing.T) {
	t.Parallel()
	gated := &gatedCoordinator{Coordinator: replication.LocalClient{Job: replication.NewJob(replication.Options{})}}
	h := newHarness(t, harnessConfig{coord: gated})
	gate := make(chan struct{})
	gated.gate.Store(&gate)
	h.yamlOrbax(baseYAML) // the job starts; its negotiation is held
	h.waitGone(layout.ReplicatorYAMLName)
	gated.waitHeld(t)
	hash3 := h.orbaxSave(3, checkpointFiles("3")) // it saves without waiting for its markers
	h.waitSealed("job", 3, "3")
	close(gate)
	restore0 := marker("job", 0, 0, 0, layout.MarkerRestore)
	h.waitMarkers(restore0)
	h.eventually("the line", func() string {
		for _, l := range h.lines(layout.ReplicatorErrorsName) {
			if strings.Contains(l, "step(s) 3 were committed before this restore ended (the job saved without waiting for its .restore markers): the restore takes nothing, and they are kept, not dropped") {
				return ""
			}
		}
		return fmt.Sprintf("replicator.errors = %q", h.lines(layout.ReplicatorErrorsName))
	})
	require.True(t, h.exists(marker("job", 3, 0, 0, layout.MarkerMeta)), "step 3 was dropped:\n%s", h.logs.String())
	// Synced once the restore was done: the coordinator refused it before ("not negotiated",
	// a line the job could do nothing with), and it was never synced until a next save.
	h.eventually("step 3 synced", func() string {
		if st := h.r.Status(); st.Replicated != 3 {
			return fmt.Sprintf("latest replicated step %d", st.Replicated)
		}
		return ""
	})
	for _, l := range h.lines(layout.ReplicatorErrorsName) {
		require.NotContains(t, l, "sync of step")
	}
	gated.gate.Store(nil)
	for _, m := range []string{restore0, layout.ReplicatorErrorsName} {
		require.NoError(t, os.Remove(h.path(m)))
	}
	h.yamlOrbax(baseYAML)
	restore3 := marker("job", 3, 0, 0, layout.MarkerRestore)
	h.waitMarkers(restore3)
	h.checkRestoreLink(restore3, hash3, checkpointFiles("3"))
}

// TestStepsCommittedWhileTheRestoreWaitsAreKept: a job that goes on saving while its restore
// waits for the negotiation (a held link to rank 0) keeps those steps when the restore ends
// with an older one: they are no timeline the job left. Before, the restore dropped them as
// such, and the job's next start restored an older step, or nothing, without a word (found by a
// black-box run).
func TestStepsCommittedWhileTheRestoreWaitsAreKept(t *testing.T) {
	t.Parallel()
	gated := &gatedCoordinator{Coordinator: replication.LocalClient{Job: replication.NewJob(replication.Options{})}}
	h := newHarness(t, harnessConfig{coord: gated})
	h.start(baseYAML, "job")
	hash5 := h.orbaxSave(5, checkpointFiles("5"))
	h.waitSealed("job", 5, "5")
	gate := make(chan struct{})
	gated.gate.Store(&gate)
	require.NoError(t, os.Remove(h.path(marker("job", 0, 0, 0, layout.MarkerRestore))))
	h.yamlOrbax(baseYAML) // the job restarts; its negotiation is held
	h.waitGone(layout.ReplicatorYAMLName)
	gated.waitHeld(t)
	hash6 := h.orbaxSave(6, checkpointFiles("6")) // and it saves without waiting for its markers
	h.waitSealed("job", 6, "6")
	close(gate)
	// The plan restores step 5, whose data retention may have freed meanwhile (step 6 is newer):
	// the restore then fails, and the job restarts. Either way step 6 stays.
	restore5 := marker("job", 5, 0, 0, layout.MarkerRestore)
	h.eventually("the restore of step 5 to end", func() string {
		if h.exists(restore5) || h.exists(layout.ReplicatorFailedName) {
			return ""
		}
		return "neither its markers nor replicator.failed"
	})
	if h.exists(restore5) { // step 6 is synced once the restore is done
		h.eventually("step 6 synced", func() string {
			if st := h.r.Status(); st.Replicated != 6 {
				return fmt.Sprintf("latest replicated step %d", st.Replicated)
			}
			return ""
		})
		for _, l := range h.lines(layout.ReplicatorErrorsName) {
			require.NotContains(t, l, "sync of step")
		}
		// The job reads its restored step now: step 6 (synced, replicated) did not free it, as
		// it was committed before the restore was done (a black-box run: ENOENT).
		h.checkRestoreLink(restore5, hash5, checkpointFiles("5"))
	}
	h.eventually("the line", func() string {
		for _, l := range h.lines(layout.ReplicatorErrorsName) {
			if strings.Contains(l, "step(s) 6 were committed before this restore ended (the job saved without waiting for its .restore markers): the restore takes step 5, and they are kept, not dropped") {
				return ""
			}
		}
		return fmt.Sprintf("replicator.errors = %q", h.lines(layout.ReplicatorErrorsName))
	})
	require.True(t, h.exists(marker("job", 6, 0, 0, layout.MarkerMeta)), "step 6 was dropped")
	gated.gate.Store(nil)
	for _, m := range []string{restore5, layout.ReplicatorErrorsName, layout.ReplicatorFailedName} {
		if err := os.Remove(h.path(m)); err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
	}
	h.yamlOrbax(baseYAML)
	restore6 := marker("job", 6, 0, 0, layout.MarkerRestore)
	h.waitMarkers(restore6)
	h.checkRestoreLink(restore6, hash6, checkpointFiles("6"))
}

// barrierCoordinator holds the barrier after the restore (Restored) while its gate is set.
type barrierCoordinator struct {
	tiers.Coordinator
	gate atomic.Pointer[chan struct{}]
	held atomic.Int64
}

func (g *barrierCoordinator) Restored(ctx context.Context, inc tiers.Incarnation) error {
	if ch := g.gate.Load(); ch != nil {
		g.held.Add(1)
		select {
		case <-*ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return g.Coordinator.Restored(ctx, inc)
}

// TestRestoredStepCommittedAgainWhileTheRestoreWaits: the job commits the very step its restore
// is to take (step 5, new bytes) while the restore waits: for the negotiation, or, its data
// published, for the other nodes (the barrier). The newer commit is the step now: the restore
// takes it on this node, its .meta stays, and the next start restores it. Before, the restore
// wrote the plan's older .meta over it, its data was freed, and the next start restored the
// older bytes on this node beside the newer ones elsewhere, without a word (found by a black-box
// run, 3 of 3); committed during the barrier, the marker named the older data, which was freed
// (a review).
func TestRestoredStepCommittedAgainWhileTheRestoreWaits(t *testing.T) {
	t.Parallel()
	for _, at := range []string{"negotiation", "barrier"} {
		t.Run(at, func(t *testing.T) {
			t.Parallel()
			restoredStepCommittedAgain(t, at == "barrier")
		})
	}
}

func restoredStepCommittedAgain(t *testing.T, atBarrier bool) {
	gated := &gatedCoordinator{Coordinator: replication.LocalClient{Job: replication.NewJob(replication.Options{})}}
	barrier := &barrierCoordinator{Coordinator: gated}
	h := newHarness(t, harnessConfig{coord: barrier})
	h.start(baseYAML, "job")
	hashOld := h.orbaxSave(5, checkpointFiles("5"))
	h.waitSealed("job", 5, "5")
	gate := make(chan struct{})
	if atBarrier {
		barrier.gate.Store(&gate)
	} else {
		gated.gate.Store(&gate)
	}
	require.NoError(t, os.Remove(h.path(marker("job", 0, 0, 0, layout.MarkerRestore))))
	h.yamlOrbax(baseYAML) // the job restarts; its restore is held
	h.waitGone(layout.ReplicatorYAMLName)
	if atBarrier {
		h.eventually("the barrier reached", func() string {
			if barrier.held.Load() == 0 {
				return "not yet"
			}
			return ""
		})
	} else {
		gated.waitHeld(t)
	}
	hashNew := h.orbaxSave(5, checkpointFiles("5 again")) // the same step, before its markers
	require.NotEqual(t, hashOld, hashNew)
	meta := marker("job", 5, 0, 0, layout.MarkerMeta)
	h.eventually("the new commit sealed", func() string {
		if b, _ := os.ReadFile(h.path(meta)); string(b) != hashNew {
			return fmt.Sprintf(".meta %q", b)
		}
		return ""
	})
	close(gate)
	restore5 := marker("job", 5, 0, 0, layout.MarkerRestore)
	h.waitMarkers(restore5)
	h.checkRestoreLink(restore5, hashNew, checkpointFiles("5 again"))
	b, err := os.ReadFile(h.path(meta))
	require.NoError(t, err)
	require.Equal(t, hashNew, string(b), "the restore wrote the plan's older .meta over the new commit")

	gated.gate.Store(nil)
	barrier.gate.Store(nil)
	for _, m := range []string{restore5, layout.ReplicatorErrorsName, layout.ReplicatorFailedName} {
		if err := os.Remove(h.path(m)); err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
	}
	h.yamlOrbax(baseYAML)
	h.waitMarkers(restore5)
	h.checkRestoreLink(restore5, hashNew, checkpointFiles("5 again"))
}

// TestLinesNotReadBeforeANewStartAreCarried: a NeMo or pytorch job reads replicator.errors and
// replicator.failed only at its restore, and every handshake removes them: each line of its run
// (a push refused, a save cut short) was removed unread at its next start (a black-box run: 5 of
// 5). The new incarnation gets them, each said to be unread and when it was written; a line of
// another job stays unsaid, and a job that read its file gets nothing again.
func TestLinesNotReadBeforeANewStartAreCarried(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.start(withKeys("first-key: 1"), "job")
	require.NoError(t, os.Remove(h.path(layout.ReplicatorErrorsName))) // read at its restore
	h.r.ReportLine("", "a line of the run", false)
	h.r.ReportLine("", "a fatal line of the run", true)
	h.r.ReportLine("", "the mtcfs agent of this node was restarted while incarnation x …: restart the job", true) // what the new start does
	h.r.ReportLine("other", "another job's line", false)
	restart := func() []string {
		t.Helper()
		require.NoError(t, os.Remove(h.path(marker("job", 0, 0, 0, layout.MarkerRestore))))
		h.yamlOrbax(baseYAML)
		h.waitMarkers(marker("job", 0, 0, 0, layout.MarkerRestore))
		return h.lines(layout.ReplicatorErrorsName)
	}
	lines := restart()
	require.Len(t, lines, 2, "%q", lines)
	require.Regexp(t, `job=job node=0/1 ERR not read by the job before this start \(replicator.failed, written at \S+Z\): FATAL a fatal line of the run$`, lines[0])
	require.Regexp(t, `job=job node=0/1 ERR not read by the job before this start \(replicator.errors, written at \S+Z\): ERR a line of the run$`, lines[1])
	require.False(t, h.exists(layout.ReplicatorFailedName), "the fatal line is no failure of the new start")

	// Not read again (a job that never unlinks): carried once, not at every start.
	require.Empty(t, restart(), "carried lines are not carried again")

	// Past the limit: the fatal line and the newest lines, and how many went.
	h.r.ReportLine("", "fatal", true)
	for i := range 25 {
		h.r.ReportLine("", fmt.Sprintf("line %d", i), false)
	}
	lines = restart()
	require.Len(t, lines, 21, "%q", lines)
	require.Contains(t, lines[0], "FATAL fatal")
	require.Contains(t, lines[1], "ERR line 6")
	require.Contains(t, lines[19], "ERR line 24")
	require.Contains(t, lines[20], "and 6 earlier line(s) not read by the job before this start")

	require.NoError(t, os.Remove(h.path(layout.ReplicatorErrorsName))) // read
	require.Empty(t, restart(), "nothing was left unread")
}

// TestRestoredDataStaysWhenItsStepIsSavedAgainAtOnce: right after the restore of step 5, another
// process of the job saves step 5 again. The restored data stays while the job may read it (its
// marker names it) though the .meta names the newer save: it was freed at once, and the job read
// through a dangling marker, without a word (found by a black-box run, 3 of 4). A step above
// ends that use, as before.
func TestRestoredDataStaysWhenItsStepIsSavedAgainAtOnce(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.start(baseYAML, "job")
	hashOld := h.orbaxSave(5, checkpointFiles("5"))
	h.waitSealed("job", 5, "5")
	require.NoError(t, os.Remove(h.path(marker("job", 0, 0, 0, layout.MarkerRestore))))
	h.yamlOrbax(baseYAML)
	restore5 := marker("job", 5, 0, 0, layout.MarkerRestore)
	h.waitMarkers(restore5)
	hashNew := h.orbaxSave(5, checkpointFiles("5 again"))
	meta := marker("job", 5, 0, 0, layout.MarkerMeta)
	h.eventually("the new commit sealed", func() string {
		if b, _ := os.ReadFile(h.path(meta)); string(b) != hashNew {
			return fmt.Sprintf(".meta %q", b)
		}
		return ""
	})
	h.orbaxSave(4, checkpointFiles("4")) // below: no end of the use; retention runs again
	h.waitSealed("job", 4, "4")
	h.checkRestoreLink(restore5, hashOld, checkpointFiles("5"))
	h.orbaxSave(6, checkpointFiles("6"))
	h.waitSealed("job", 6, "6")
	h.eventually("the restored data freed once a step above is saved", func() string {
		if h.exists(hashOld + ".data") {
			return "still there"
		}
		return ""
	})
}

// TestStatusCommittedWhileSyncsWait: a step this node committed and sealed is "latest
// committed" in status at once, while the syncs go one at a time and an earlier one waits (for
// a stopped rank 0). Status said the step the syncer had reached: "latest committed 60" beside
// step 70 in RAM and being pushed (black-box h58: 4 of 4).
func TestStatusCommittedWhileSyncsWait(t *testing.T) {
	t.Parallel()
	held, release := make(chan struct{}), make(chan struct{})
	releaseOnce := sync.OnceFunc(func() { close(release) })
	h := newHarness(t, harnessConfig{syncerPop: func(step int64, restored bool) {
		if step == 2 && !restored {
			close(held)
			<-release
		}
	}})
	t.Cleanup(releaseOnce) // before the harness's close, which waits for the syncer
	h.start(baseYAML, "job")
	h.orbaxSave(1, checkpointFiles("1"))
	h.eventually("step 1 committed", func() string {
		if st := h.r.Status(); st.Committed != 1 {
			return fmt.Sprintf("latest committed %d", st.Committed)
		}
		return ""
	})
	h.orbaxSave(2, checkpointFiles("2"))
	<-held // the syncer holds step 2
	h.orbaxSave(3, checkpointFiles("3"))
	h.waitSealed("job", 3, "3")
	if st := h.r.Status(); st.Committed != 3 || st.Replicated > 1 {
		t.Errorf("status: latest committed %d, replicated %d while the syncer holds step 2: want 3 and at most 1", st.Committed, st.Replicated)
	}
	releaseOnce()
	h.eventually("step 3 replicated", func() string {
		if st := h.r.Status(); st.Replicated != 3 {
			return fmt.Sprintf("latest replicated %d", st.Replicated)
		}
		return ""
	})
}

// otherIncCoordinator answers Sync and Backups with ErrOtherIncarnation once on is set: the job
// restarted without this node, and rank 0 coordinates a newer incarnation.
type otherIncCoordinator struct {
	tiers.Coordinator
	on    atomic.Bool
	shape bool // answers ErrJobShape: the job restarted with another yaml
}

func (c *otherIncCoordinator) Sync(ctx context.Context, inc tiers.Incarnation, rep tiers.SyncReport) (tiers.SyncDecision, error) {
	switch {
	case c.on.Load() && c.shape:
		return tiers.SyncDecision{}, fmt.Errorf("rank 0: %w: the caller has backup interval 60min, the incarnation backup interval 1min", tiers.ErrJobShape)
	case c.on.Load():
		return tiers.SyncDecision{}, fmt.Errorf("incarnation %s: %w (superseded by a newer one)", inc.ID, tiers.ErrOtherIncarnation)
	}
	return c.Coordinator.Sync(ctx, inc, rep)
}

// TestSupersededIncarnationSaysSo: a node whose incarnation the coordinator no longer serves
// (its agent was cut off while the job restarted without it) shows "superseded" in status, and
// the job is told once. It said "running", and the log repeated the refused calls (black-box
// h58).
func TestSupersededIncarnationSaysSo(t *testing.T) {
	t.Parallel()
	for _, shape := range []bool{false, true} { // the job restarted with the same yaml; with another (black-box h61)
		t.Run(fmt.Sprintf("shape=%v", shape), func(t *testing.T) { testSuperseded(t, shape) })
	}
}

func testSuperseded(t *testing.T, shape bool) {
	coord := &otherIncCoordinator{Coordinator: replication.LocalClient{Job: replication.NewJob(replication.Options{})}, shape: shape}
	h := newHarness(t, harnessConfig{coord: coord})
	h.r.SetSupersededAfter(300 * time.Millisecond)
	h.start(baseYAML, "job")
	h.orbaxSave(1, checkpointFiles("1"))
	h.eventually("running", func() string {
		if st := h.r.Status(); st.Phase != "running" || st.Replicated != 1 {
			return fmt.Sprintf("phase %q, replicated %d", st.Phase, st.Replicated)
		}
		return ""
	})
	coord.on.Store(true)
	h.orbaxSave(2, checkpointFiles("2"))
	h.orbaxSave(3, checkpointFiles("3"))
	// Not at once: the whole job's restart reaches this node within seconds, and rank 0 answers
	// it so meanwhile (black-box h61: a node told it was left behind during a full restart).
	if st := h.r.Status(); st.Phase != "running" {
		t.Errorf("phase %q right after the first refusal, want running", st.Phase)
	}
	h.eventually("superseded", func() string {
		if st := h.r.Status(); st.Phase != tiers.PhaseSuperseded || st.Committed != 3 {
			return fmt.Sprintf("phase %q, committed %d", st.Phase, st.Committed)
		}
		return ""
	})
	h.eventually("the line, once", func() string {
		l := h.lines(layout.ReplicatorErrorsName)
		if len(l) != 1 || !strings.Contains(l[0], "the job's coordinator (rank 0) does not serve this node's incarnation of the job") {
			return fmt.Sprintf("replicator.errors = %q", l)
		}
		return ""
	})
}

// TestWorkersThatNeverCommitAreTold: with workers-per-node 2 and only worker 0 saving, the job
// is told once, at worker 0's next step a minute on, that its steps are never complete. It
// heard of it only at its restart, which started from scratch (black-box h59).
func TestWorkersThatNeverCommitAreTold(t *testing.T) {
	t.Parallel()
	clock := newFakeClock(baseTime)
	// A minute passes once the syncer took steps 1 and 2 (within the minute: workers may lag).
	h := newHarness(t, harnessConfig{clock: clock, syncerPop: func(step int64, restored bool) {
		if step == 3 {
			clock.Set(baseTime.Add(61 * time.Second))
		}
	}})
	doc := "job-name: pt\nframework: pytorch\nnode-rank: 0\nnodes: 1\npeers-per-node: 1\nworkers-per-node: 2\nbackup-interval-minutes: 30"
	h.yamlNemo(doc)
	h.waitMarkers(marker("pt", 0, 0, 0, layout.MarkerRestore), marker("pt", 0, 0, 1, layout.MarkerRestore))
	want := "step 1: worker(s) 0 of this node committed it 1m1s ago, worker(s) 1 never did (workers-per-node: 2), and step 3 was committed since"
	h.writeFile("pt-s1-n0-w0.save", "worker 0 step 1")
	h.waitMeta("pt", 1, 0)
	h.writeFile("pt-s2-n0-w0.save", "worker 0 step 2")
	h.waitMeta("pt", 2, 0)
	h.writeFile("pt-s3-n0-w0.save", "worker 0 step 3")
	h.waitMeta("pt", 3, 0)
	h.eventually("the line", func() string {
		l := h.lines(layout.ReplicatorErrorsName)
		if len(l) != 1 || !strings.Contains(l[0], want) {
			return fmt.Sprintf("replicator.errors = %q", l)
		}
		return ""
	})
	h.writeFile("pt-s4-n0-w0.save", "worker 0 step 4")
	h.waitMeta("pt", 4, 0)
	time.Sleep(50 * time.Millisecond)
	assert.Len(t, h.lines(layout.ReplicatorErrorsName), 1, "told once")
}

// TestRestartWithinTheGraceIsNoSupersession: rank 0's coordinator refuses this node's calls
// during the whole job's restart, until this node's yaml comes: the node is not told it was
// left behind (black-box h61: 1 restart in 12 told so).
func TestRestartWithinTheGraceIsNoSupersession(t *testing.T) {
	t.Parallel()
	coord := &otherIncCoordinator{Coordinator: replication.LocalClient{Job: replication.NewJob(replication.Options{})}}
	h := newHarness(t, harnessConfig{coord: coord})
	h.r.SetSupersededAfter(500 * time.Millisecond)
	h.start(baseYAML, "job")
	coord.on.Store(true)
	h.orbaxSave(1, checkpointFiles("1"))
	h.eventually("the refusal", func() string {
		if !strings.Contains(h.logs.String(), "sync refused: the coordinator serves another incarnation of the job") {
			return "not yet"
		}
		return ""
	})
	coord.on.Store(false)
	require.NoError(t, os.Remove(h.path(marker("job", 0, 0, 0, layout.MarkerRestore))))
	h.yamlOrbax(baseYAML) // this node's part of the restart
	h.waitMarkers(marker("job", 1, 0, 0, layout.MarkerRestore))
	time.Sleep(time.Second)
	if st := h.r.Status(); st.Phase == tiers.PhaseSuperseded {
		t.Errorf("phase %q after a restart within the grace", st.Phase)
	}
	assert.NotContains(t, strings.Join(h.lines(layout.ReplicatorErrorsName), "\n"), "does not serve this node's incarnation")
	assert.NotContains(t, h.logs.String(), "does not serve this node's incarnation")
}

// TestReplicaOfANodeLeftBehindSaysSo: a push from a node whose incarnation took part in an
// earlier restore than this node's is refused as the sender's, left behind by the job's
// restart; it blamed the receiver's address and its --peers (black-box h63). A push from a
// later restore than this node's is refused as this node's.
func TestReplicaOfANodeLeftBehindSaysSo(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.start(baseYAML, "job")
	require.NoError(t, os.Remove(h.path(marker("job", 0, 0, 0, layout.MarkerRestore))))
	h.yamlOrbax(baseYAML) // a second start: a second restore
	h.waitMarkers(marker("job", 0, 0, 0, layout.MarkerRestore))
	own := h.r.RestoreGeneration("job", h.r.Status().Incarnation)
	require.Greater(t, own, int64(1))
	err := h.r.AdmitReplica("job", 1, own-1)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "the sending node is not a node of the running job: rank 1 took part in restore")
	err = h.r.AdmitReplica("job", 1, own+1)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "the agent at this address took part in restore")
	assert.NoError(t, h.r.AdmitReplica("job", 1, own))
}
