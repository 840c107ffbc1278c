package tiers_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/tiers"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// snapshotSpool copies the harness's spool to a new root, as a kill -9 would leave it at this
// moment (the running agent goes on with the original), and returns the new root.
func snapshotSpool(t *testing.T, h *harness) string {
	t.Helper()
	root := t.TempDir()
	if err := copyTreeLinks(filepath.Join(h.cfg.root, "spool"), filepath.Join(root, "spool")); err != nil {
		t.Fatal(err)
	}
	return root
}

// copyTreeLinks copies a spool tree: bytes, directories and symlinks.
func copyTreeLinks(src, dst string) error { return copyTree(src, dst) }

// A step whose commit rename returned is restored after the agent is killed at any point of its
// sealing (SPEC §10): the commit is recorded in the spool before the rename returns.
func TestCommitSurvivesAKillAtEveryPointOfSealing(t *testing.T) {
	for _, point := range []string{"right after the rename", "after hashing, before the .meta"} {
		t.Run(point, func(t *testing.T) {
			t.Parallel()
			block := make(chan struct{})
			defer close(block)
			blocked := make(chan string, 1)
			hcfg := harnessConfig{}
			if point == "right after the rename" {
				// The rename returned (the record and its commit.json are written); the sealer
				// stops before it touches the record, as a kill at that moment leaves it.
				hcfg.beforeSeal = func(int64) {
					select {
					case blocked <- "seal":
						<-block
					default:
					}
				}
			}
			h := newHarness(t, hcfg)
			h.start(baseYAML, "job")
			h.ns.setHook(func(op, name string) {
				// The sealer's first namespace call (whether the data's name is there) comes after
				// it hashed the record and moved the data into spool/sealed.
				if op == "owner" && point != "right after the rename" {
					select {
					case blocked <- "owner":
						<-block
					default:
					}
				}
			})
			files := checkpointFiles("7")
			hash := h.orbaxSave(7, files)
			<-blocked
			root := snapshotSpool(t, h)
			if recs, _ := filepath.Glob(filepath.Join(root, "spool", "commits", "*", "commit.json")); len(recs) != 1 {
				t.Fatalf("the killed agent's spool holds %d commit records, want 1", len(recs))
			}
			h2 := newHarness(t, harnessConfig{root: root})
			h2.yamlOrbax(baseYAML)
			restore := marker("job", 7, 0, 0, layout.MarkerRestore)
			h2.waitMarkers(restore)
			h2.checkRestoreLink(restore, hash, files)
			if got := h2.spoolEntries("commits/*"); len(got) != 0 {
				t.Errorf("records left after recovery: %q", got)
			}
		})
	}
}

// A record the killed agent did not finish writing (no commit.json: the rename had not
// returned) is dropped, and one that cannot be sealed is reported to the job, not dropped
// silently.
func TestIncompleteAndBrokenCommitRecords(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	commits := filepath.Join(root, "spool", "commits")
	// Incomplete: data but no commit.json.
	inc := filepath.Join(commits, "00000000000000000001-aa")
	if err := os.MkdirAll(filepath.Join(inc, "data", "state"), 0o700); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(inc, "data", "state", "a"), []byte("x"), 0o600)
	// Broken: a commit.json whose data vanished and was never sealed.
	broken := filepath.Join(commits, "00000000000000000002-bb")
	os.MkdirAll(broken, 0o700)
	os.WriteFile(filepath.Join(broken, "commit.json"), []byte(`{"job":"job","incarnation":"x","rank":0,"worker":0,"step":9,"name":"9"}`), 0o600)

	h := newHarness(t, harnessConfig{root: root})
	h.yamlOrbax(baseYAML)
	h.waitMarkers(marker("job", 0, 0, 0, layout.MarkerRestore))
	errs := h.lines(layout.ReplicatorErrorsName)
	if len(errs) != 1 || !strings.Contains(errs[0], "step 9 of job job") || !strings.Contains(errs[0], "could not be sealed") {
		t.Fatalf("replicator.errors = %q, want one line about step 9", errs)
	}
	if got := h.spoolEntries("commits/*"); len(got) != 0 {
		t.Errorf("records left: %q", got)
	}
	if got := h.spoolEntries("meta/*"); len(got) != 0 {
		t.Errorf("metas: %q", got)
	}
}

// Data that fails its hash when the agent restarts is reported in replicator.errors and the
// step is restored from the backup instead — never a silent fresh start (SPEC §10).
func TestCorruptedRAMIsReportedAndRestoredFromBackup(t *testing.T) {
	t.Parallel()
	store := newTestStore(t)
	h := newHarness(t, harnessConfig{store: store})
	h.start(withKeys("backup-interval-steps: 1", "-backup-interval-minutes"), "job")
	files := checkpointFiles("4")
	hash := h.orbaxSave(4, files)
	h.waitSealed("job", 4, "4")
	h.eventually("the backup of step 4", func() string {
		names, _ := store.Backups(t.Context(), "job")
		for _, n := range names {
			if steps, _, _ := store.CompleteSteps(t.Context(), "job", n, tiers.Shape{Nodes: 1, Workers: 1}); len(steps) > 0 && steps[0].Step == 4 {
				return ""
			}
		}
		return "no complete backup of step 4 yet"
	})
	h.close()
	// The RAM copy goes bad while no agent runs.
	victim := filepath.Join(h.cfg.root, "spool", "sealed", hash+".data", "state", "array_0")
	if err := os.WriteFile(victim, []byte("flipped"), 0o600); err != nil {
		t.Fatal(err)
	}
	h2 := newHarness(t, h.cfg)
	h2.yamlOrbax(withKeys("backup-interval-steps: 1", "-backup-interval-minutes"))
	restore := marker("job", 4, 0, 0, layout.MarkerRestore)
	h2.waitMarkers(restore)
	h2.checkRestoreLink(restore, hash, files)
	errs := h2.lines(layout.ReplicatorErrorsName)
	if !slices.ContainsFunc(errs, func(l string) bool { return strings.Contains(l, "job-s4-n0-w0.meta") && strings.Contains(l, "dropped") }) {
		t.Errorf("replicator.errors = %q, want a line saying step 4's RAM copy was dropped", errs)
	}
}

// A mount reused by another job frees the first job's checkpoints at the new job's handshake:
// they are never restored for it and do not take its budget (SPEC §10).
func TestOtherJobsDataIsFreed(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.start(baseYAML, "job")
	hash := h.orbaxSave(3, checkpointFiles("3"))
	h.waitSealed("job", 3, "3")
	h2 := h.restart()
	h2.yamlOrbax(strings.Replace(baseYAML, "job-name: job", "job-name: other", 1))
	h2.waitMarkers(marker("other", 0, 0, 0, layout.MarkerRestore))
	if got := h2.spoolEntries("sealed/*"); len(got) != 0 {
		t.Errorf("spool still holds %q of job 'job'", got)
	}
	if h2.exists(hash+".data") || h2.exists(marker("job", 3, 0, 0, layout.MarkerMeta)) {
		t.Errorf("namespace still shows job 'job': %q", h2.names())
	}
	errs := h2.lines(layout.ReplicatorErrorsName)
	if len(errs) != 1 || !strings.Contains(errs[0], "job-s3-n0-w0.meta") || !strings.Contains(errs[0], "freed") {
		t.Errorf("replicator.errors = %q, want one line naming the freed checkpoint", errs)
	}
	// No backup held it: the line says so (it read the same whether or not one did).
	if len(errs) == 1 && !strings.Contains(errs[0], "step(s) 3 of job job were in no backup this node completed") {
		t.Errorf("replicator.errors = %q, want it to say step 3 was in no backup", errs)
	}
}

// TestOtherJobsStepBeingBackedUpIsFreedAfterItsBackup: another job's step whose backup is
// uploading when a job negotiates on the mount is kept until the backup ends, then freed. Freed
// at once, it was neither in RAM nor yet in the backup when its job came back a moment later
// (its name mistyped once), and that job started from scratch (found by a black-box run).
func TestOtherJobsStepBeingBackedUpIsFreedAfterItsBackup(t *testing.T) {
	t.Parallel()
	store := newTestStore(t)
	gate := make(chan struct{})
	store.setBeforeUpload(func(ctx context.Context, _ tiers.Upload) error {
		select {
		case <-gate:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	})
	h := newHarness(t, harnessConfig{store: store})
	job := withKeys("backup-interval-steps: 1", "-backup-interval-minutes")
	other := strings.Replace(job, "job-name: job", "job-name: other", 1)
	meta := marker("job", 3, 0, 0, layout.MarkerMeta)
	h.start(job, "job")
	hash := h.orbaxSave(3, checkpointFiles("3"))
	h.waitSealed("job", 3, "3")
	h.eventually("the backup's upload", func() string {
		if n, _, _ := store.counts(); n == 0 {
			return "no upload yet"
		}
		return ""
	})

	h.yamlOrbax(other) // the job restarted under another name
	h.waitMarkers(marker("other", 0, 0, 0, layout.MarkerRestore))
	if !h.exists(hash+".data") || !h.exists(meta) {
		t.Fatalf("step 3 of job 'job', being backed up, was freed: %q", h.names())
	}
	if errs := h.lines(layout.ReplicatorErrorsName); len(errs) != 1 || !strings.Contains(errs[0], "holds step 3 of job job, being backed up: freed once the backup ends") {
		t.Errorf("replicator.errors = %q, want the line saying step 3 is freed once its backup ends", errs)
	}
	h.yamlOrbax(job) // back under its name before the backup ended: step 3 is restored
	h.waitMarkers(marker("job", 3, 0, 0, layout.MarkerRestore))

	h.yamlOrbax(other)
	h.waitMarkers(marker("other", 0, 0, 0, layout.MarkerRestore))
	time.Sleep(50 * time.Millisecond)
	if !h.exists(hash + ".data") {
		t.Fatalf("step 3 freed while its backup still runs: %q", h.names())
	}
	close(gate) // the backup ends: step 3 goes
	h.eventually("step 3 of job 'job' freed once its backup ended", func() string {
		if h.exists(hash+".data") || h.exists(meta) || len(h.spoolEntries("sealed/*")) != 0 {
			return fmt.Sprintf("still there: %q", h.names())
		}
		return ""
	})
}

// TestHandshakeSaysWhatItRemoved: the job's own top-level files, which every replicator.yaml
// removes (SPEC §2.4), are named in the log (they went without a word: a black-box run).
func TestHandshakeSaysWhatItRemoved(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.start(baseYAML, "job")
	h.writeFile("config.json", "{}")
	h.yamlOrbax(baseYAML)
	h.eventually("the handshake", func() string {
		if h.exists(layout.ReplicatorYAMLName) || h.exists("config.json") {
			return fmt.Sprintf("%q", h.names())
		}
		return ""
	})
	if logs := h.logs.String(); !strings.Contains(logs, "removed the top-level entries that are not checkpoints") || !strings.Contains(logs, "config.json") {
		t.Errorf("the log does not name config.json as removed:\n%s", logs)
	}
}

// TestJobToldAnotherJobSavedInItsMountMomentsAgo: two jobs on one mount (two trainer pods of
// different jobs on one Kubernetes node agent) share its directory, and each restores the
// other's saves (a black-box run). The job that takes the mount over is told when the other
// job's freed step is recent; a step saved long ago (the mount reused between jobs) is freed as
// before, without that line.
func TestJobToldAnotherJobSavedInItsMountMomentsAgo(t *testing.T) {
	t.Parallel()
	const told = "both jobs use this one directory"
	for _, tc := range []struct {
		name string
		age  time.Duration
		want bool
	}{{"moments ago", 0, true}, {"an hour ago", time.Hour, false}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t, harnessConfig{})
			h.start(baseYAML, "job")
			h.orbaxSave(3, checkpointFiles("3"))
			h.waitSealed("job", 3, "3")
			h2 := h.restart()
			if tc.age > 0 {
				metas := h2.spoolGlob("job-s3-*.meta")
				if len(metas) != 1 {
					t.Fatalf("spool metas %q, want job's step 3", metas)
				}
				old := time.Now().Add(-tc.age)
				if err := os.Chtimes(metas[0], old, old); err != nil {
					t.Fatal(err)
				}
			}
			h2.yamlOrbax(strings.Replace(baseYAML, "job-name: job", "job-name: other", 1))
			h2.waitMarkers(marker("other", 0, 0, 0, layout.MarkerRestore))
			errs := strings.Join(h2.lines(layout.ReplicatorErrorsName), "\n")
			if !strings.Contains(errs, "held checkpoints of other jobs (job-s3-n0-w0.meta)") {
				t.Fatalf("replicator.errors = %q, want job's step 3 freed", errs)
			}
			if got := strings.Contains(errs, "job job's step 3 came into this node's RAM") && strings.Contains(errs, told); got != tc.want {
				t.Errorf("told that the jobs may share the mount: %v, want %v; replicator.errors = %q", got, tc.want, errs)
			}
		})
	}
}

// TestRestoreLinesInOneWrite: the lines a restore has for the job (here: another job's steps
// freed now, and a newer step of the job's in an orphaned spool) reach replicator.errors in one write before
// the prerestore: the job reads the file and unlinks it, and a line appended between the two is
// lost (a clean-clone CI run lost plan lines; a review found the others written one by one).
func TestRestoreLinesInOneWrite(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.start(baseYAML, "job")
	h.orbaxSave(3, checkpointFiles("3"))
	h.waitSealed("job", 3, "3")
	h2 := h.restart()
	other := strings.Replace(baseYAML, "job-name: job", "job-name: other", 1)
	h2.yamlOrbax(other)
	h2.waitMarkers(marker("other", 0, 0, 0, layout.MarkerRestore))
	h2.orbaxSave(1, checkpointFiles("other 1"))
	h2.waitSealed("other", 1, "1")
	h2.close()
	cfg := h2.cfg
	orphan := tiers.SpoolInfo{Dir: t.TempDir(), MountPath: "/gone", Metas: []string{marker("job", 9, 0, 0, layout.MarkerMeta)},
		UID: os.Geteuid(), MountState: tiers.MountGone}
	cfg.keptSpools = func() ([]tiers.SpoolInfo, error) { return []tiers.SpoolInfo{orphan}, nil }
	h3 := newHarness(t, cfg)
	h3.yamlOrbax(baseYAML)
	h3.waitMarkers(marker("job", 0, 0, 0, layout.MarkerRestore))
	errs := h3.lines(layout.ReplicatorErrorsName)
	if len(errs) != 2 || !strings.Contains(errs[0], "held checkpoints of other jobs (other-s1-n0-w0.meta)") || !strings.Contains(errs[1], "holds step(s) 9 of this job") {
		t.Fatalf("replicator.errors = %q, want the two lines", errs)
	}
	var writes []int
	ops := h3.ns.opLog()
	for i, op := range ops {
		if op == "write "+layout.ReplicatorErrorsName {
			writes = append(writes, i)
		}
	}
	if pre := slices.Index(ops, "write "+layout.PrerestoreName); len(writes) != 1 || writes[0] > pre {
		t.Errorf("replicator.errors written at ops %v, the prerestore at %d: want one write before it", writes, pre)
	}
}

// Data whose integrity the agent cannot vouch for (a .save committed at its close: a duplicate
// descriptor could still write) is hashed before a restore uses it; a copy that fails is
// reported and restored from the backup (SPEC §10).
func TestUnverifiedRAMIsCheckedAtRestore(t *testing.T) {
	t.Parallel()
	store := newTestStore(t)
	h := newHarness(t, harnessConfig{store: store})
	doc := withKeys("framework: pytorch", "backup-interval-steps: 1", "-backup-interval-minutes")
	h.start(doc, "job")
	save := marker("job", 2, 0, 0, layout.MarkerSave)
	h.writeFile(save, "torch state")
	hash := h.waitSealed("job", 2, save)
	h.eventually("the backup of step 2", func() string {
		names, _ := store.Backups(t.Context(), "job")
		for _, n := range names {
			if steps, _, _ := store.CompleteSteps(t.Context(), "job", n, tiers.Shape{Nodes: 1, Workers: 1}); len(steps) > 0 && steps[0].Step == 2 {
				return ""
			}
		}
		return "no complete backup of step 2 yet"
	})
	if err := os.WriteFile(filepath.Join(h.cfg.root, "spool", "sealed", hash+".data"), []byte("torch STATE"), 0o600); err != nil {
		t.Fatal(err)
	}
	h.yamlNemo(doc) // the job restarts; the agent does not
	restore := marker("job", 2, 0, 0, layout.MarkerRestore)
	h.waitMarkers(restore)
	if got := h.read(restore); got != "torch state" {
		t.Fatalf("restored %q, want the backed-up bytes", got)
	}
	errs := h.lines(layout.ReplicatorErrorsName)
	if !slices.ContainsFunc(errs, func(l string) bool { return strings.Contains(l, "fails its check") }) {
		t.Errorf("replicator.errors = %q, want a line about the RAM copy failing its check", errs)
	}
}

// A record whose data was hashed (sealed-as written) is never hashed again: a kill while its
// data was being removed as a duplicate, or moved, leaves a partial tree that must not be
// sealed as a (truncated) checkpoint. And a record cut short while being removed after its
// .meta was written is an incomplete one, not an error.
func TestCommitRecordsCutShort(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.start(baseYAML, "job")
	files := checkpointFiles("5")
	hash := h.orbaxSave(5, files)
	h.waitSealed("job", 5, "5")
	h.close()
	commits := filepath.Join(h.cfg.root, "spool", "commits")
	// 1. A duplicate's data half removed: sealed-as names the data already sealed.
	dup := filepath.Join(commits, "00000000000000000001-dup")
	os.MkdirAll(filepath.Join(dup, "data", "state"), 0o700)
	os.WriteFile(filepath.Join(dup, "data", "state", "array_0"), []byte("half of it"), 0o600)
	os.WriteFile(filepath.Join(dup, "commit.json"), []byte(`{"job":"job","incarnation":"x","rank":0,"worker":0,"step":6,"name":"6"}`), 0o600)
	os.WriteFile(filepath.Join(dup, "sealed-as"), []byte(hash+".data"), 0o600)
	// 2. A served record cut short in its removal: commit.json is gone first.
	served := filepath.Join(commits, "00000000000000000002-served")
	os.MkdirAll(served, 0o700)
	os.WriteFile(filepath.Join(served, "sealed-as"), []byte("D"+strings.Repeat("a", 64)+".data"), 0o600)

	h2 := newHarness(t, harnessConfig{root: h.cfg.root})
	h2.yamlOrbax(baseYAML)
	restore := marker("job", 6, 0, 0, layout.MarkerRestore)
	h2.waitMarkers(restore)
	h2.checkRestoreLink(restore, hash, files)
	if errs := h2.lines(layout.ReplicatorErrorsName); len(errs) != 0 {
		t.Errorf("replicator.errors = %q, want none", errs)
	}
}

// TestMisnamedSaveIsReported: a .save of another job, node or worker (a job started with the
// wrong rank in its environment) is not a commit of this node, and its step would never be
// checkpointed without a word: the job is told, once per file, what this node commits.
func TestMisnamedSaveIsReported(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.yamlNemo(withKeys("framework: pytorch", "workers-per-node: 2"))
	h.waitMarkers(marker("job", 0, 0, 0, layout.MarkerRestore), marker("job", 0, 0, 1, layout.MarkerRestore))
	bad := map[string]string{
		marker("job", 5, 1, 0, layout.MarkerSave):   "node 1 is not this node (node-rank 0)",
		marker("job", 5, 0, 2, layout.MarkerSave):   "worker 2 is outside workers-per-node 2",
		marker("other", 5, 0, 0, layout.MarkerSave): `job "other" is not this job (job-name "job")`,
	}
	for name := range bad {
		h.writeFile(name, "torch state")
		h.writeFile(name, "torch state, again") // closed twice: told once
	}
	renamed := marker("job", 6, 3, 0, layout.MarkerSave) // renamed into place, as torch.save to a temporary name
	bad[renamed] = "node 3 is not this node (node-rank 0)"
	h.writeFile("partial", "torch state")
	h.rename("partial", renamed)
	good := marker("job", 5, 0, 0, layout.MarkerSave)
	h.writeFile(good, "torch state")
	h.waitSealed("job", 5, good)
	h.eventually("a line for each", func() string {
		if l := h.lines(layout.ReplicatorErrorsName); len(l) != len(bad) {
			return fmt.Sprintf("replicator.errors = %q, want %d lines", l, len(bad))
		}
		return ""
	})
	errs := strings.Join(h.lines(layout.ReplicatorErrorsName), "\n")
	for name, why := range bad {
		if !strings.Contains(errs, name+" is not committed (its step is not checkpointed): "+why+"; this node commits job-s<step>-n0-w<worker below 2>.save") {
			t.Errorf("replicator.errors:\n%s\nwant a line for %s saying %q", errs, name, why)
		}
	}
	if strings.Contains(errs, good) {
		t.Errorf("the committed %s is reported:\n%s", good, errs)
	}
}

// TestMisnamedStepDirIsReported: a directory renamed to digits that are no step name (a leading
// zero, past int64) commits nothing; the job is told, once per name. Before, the rename returned
// and the step was never checkpointed, without a word (found by a black-box run).
func TestMisnamedStepDirIsReported(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.yamlOrbax(baseYAML)
	h.waitMarkers(marker("job", 0, 0, 0, layout.MarkerRestore))
	bad := []string{"009", "99999999999999999999", "9223372036854775808"}
	for _, name := range bad {
		h.makeTree("tmp", map[string]string{"state": "weights"})
		h.rename("tmp", name)
	}
	h.orbaxSave(10, map[string]string{"state": "weights"})
	h.waitSealed("job", 10, "10") // a good name: committed, and nothing to say
	h.eventually("a line for each", func() string {
		if l := h.lines(layout.ReplicatorErrorsName); len(l) != len(bad) {
			return fmt.Sprintf("replicator.errors = %q, want %d lines", l, len(bad))
		}
		return ""
	})
	errs := strings.Join(h.lines(layout.ReplicatorErrorsName), "\n")
	for _, name := range bad {
		if !strings.Contains(errs, name+" is not committed (its step is not checkpointed): a step directory is named by its step in decimal, without leading zeros, at most 9223372036854775807") {
			t.Errorf("replicator.errors:\n%s\nwant a line for %s", errs, name)
		}
	}
}

// TestStepDirMadeNotRenamedIsReported: a directory made under a step's name (a copy moved in
// from another file system) is not a commit, and the job's next start removes it; the job is
// told once a file is written in it, where it lost it without a word (found by a black-box
// run). A directory renamed onto the name commits, with nothing to say, also onto an empty one
// the job made first (told as no commit before: a black-box run).
func TestStepDirMadeNotRenamedIsReported(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.yamlOrbax(baseYAML)
	h.waitMarkers(marker("job", 0, 0, 0, layout.MarkerRestore))
	require.NoError(t, os.Mkdir(h.path("14"), 0o755)) // made empty, renamed onto later
	h.r.Created("14", layout.EntryDir)
	require.NoError(t, os.Mkdir(h.path("12"), 0o755))
	h.r.Created("12", layout.EntryDir) // the kernel's mkdir, then the copy's files
	h.makeTree("12", map[string]string{"state": "weights"})
	h.makeTree("notastep", nil)
	h.r.Created("notastep", layout.EntryDir)
	want := "12 is not committed (its step is not checkpointed): a directory made under a step's name (mkdir, or a copy such as cp -r or mv from another file system) is not a commit: only a directory renamed onto the step's name commits it (make it as 12.orbax-checkpoint-tmp, then rename it to 12); the job's next start removes it"
	h.eventually("a line", func() string { // handled after the mkdir of 14, events being handled in order
		if l := h.lines(layout.ReplicatorErrorsName); len(l) != 1 || !strings.HasSuffix(l[0], " ERR "+want) {
			return fmt.Sprintf("replicator.errors = %q, want 1 line of 12", l)
		}
		return ""
	})
	h.orbaxSave(13, map[string]string{"state": "weights 13"})
	h.waitSealed("job", 13, "13")
	h.makeTree("tmp14", map[string]string{"state": "weights 14"})
	require.NoError(t, syscall.Rename(h.path("tmp14"), h.path("14"))) // onto the empty directory (os.Rename refuses)
	h.r.Renamed("tmp14", "14", layout.EntryDir)
	h.waitSealed("job", 14, "14")
	if l := h.lines(layout.ReplicatorErrorsName); len(l) != 1 {
		t.Errorf("replicator.errors = %q, want only the line of 12", l)
	}
}

// TestSaveDirMadeInPlaceIsReported: framework pytorch, a worker's .save made as a directory
// in place (mkdir, then its files) is not a commit, and the job's next start removes it; the job
// is told once a file is written in it, where its step was lost without a word (found by a
// black-box run). A .save directory renamed into place commits, also onto an empty one.
func TestSaveDirMadeInPlaceIsReported(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.yamlNemo(withKeys("framework: pytorch", "workers-per-node: 2"))
	h.waitMarkers(marker("job", 0, 0, 0, layout.MarkerRestore), marker("job", 0, 0, 1, layout.MarkerRestore))
	made, empty := marker("job", 3, 0, 1, layout.MarkerSave), marker("job", 3, 0, 0, layout.MarkerSave)
	require.NoError(t, os.Mkdir(h.path(empty), 0o755)) // made empty, renamed onto later
	h.r.Created(empty, layout.EntryDir)
	require.NoError(t, os.Mkdir(h.path(made), 0o755))
	h.r.Created(made, layout.EntryDir)
	h.makeTree(made, map[string]string{"model.pt": "weights"})
	h.r.Closed(made + "/model.pt")
	want := made + " is not committed (its step is not checkpointed): a directory made under a .save name (mkdir, or a copy such as cp -r) is not a commit: a .save directory commits when it is renamed into place (make it under another name, then rename it to " + made + "); the job's next start removes it"
	h.eventually("a line", func() string {
		if l := h.lines(layout.ReplicatorErrorsName); len(l) != 1 || !strings.HasSuffix(l[0], " ERR "+want) {
			return fmt.Sprintf("replicator.errors = %q, want 1 line of %s", l, made)
		}
		return ""
	})
	h.makeTree("tmp", map[string]string{"model.pt": "weights 0"})
	require.NoError(t, syscall.Rename(h.path("tmp"), h.path(empty)))
	h.r.Renamed("tmp", empty, layout.EntryDir)
	h.waitSealed("job", 3, empty)
	if l := h.lines(layout.ReplicatorErrorsName); len(l) != 1 {
		t.Errorf("replicator.errors = %q, want only the line of %s", l, made)
	}
}

// TestNeMoSaveAtGlobalStepZeroIsReported: NeMo renames its save of global step 0 to -1, which
// is no step; the job is told, where the directory was dropped at the next start without a
// word (found by a black-box run).
func TestNeMoSaveAtGlobalStepZeroIsReported(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.yamlNemo(withKeys("framework: pytorch.distributed"))
	h.waitMarkers(marker("job", 0, 0, 0, layout.MarkerRestore))
	h.makeTree("step=0", map[string]string{"common.pt": "weights"})
	h.rename("step=0", "-1")
	h.eventually("a line", func() string {
		if l := h.lines(layout.ReplicatorErrorsName); len(l) != 1 {
			return fmt.Sprintf("replicator.errors = %q, want 1 line", l)
		}
		return ""
	})
	errs := strings.Join(h.lines(layout.ReplicatorErrorsName), "\n")
	if !strings.Contains(errs, "-1 is not committed (its step is not checkpointed): a step is not negative (NeMo's save at global step 0 is renamed to -1; NeMo restores its saves from global step 2 on)") {
		t.Errorf("replicator.errors:\n%s", errs)
	}
}

// TestSaveOfTheSameStepAgainWhileTheFirstIsPending: a .save of the same step saved again as soon
// as the first one's name is free (its data renamed to <hash>.data), while the first commit
// still counts as pending, is committed too: its close is a commit of its own (Flushed), not a
// later close of the first file. It was passed over as one, and the second save was never
// committed, without a word (a black-box run: 3 of 30 tries).
func TestSaveOfTheSameStepAgainWhileTheFirstIsPending(t *testing.T) {
	t.Parallel()
	saved := marker("job", 5, 0, 0, layout.MarkerSave)
	published, resume := make(chan struct{}), make(chan struct{})
	var once sync.Once
	h := newHarness(t, harnessConfig{afterPublish: func(step int64) {
		once.Do(func() {
			close(published)
			<-resume
		})
	}})
	releaseOnce := sync.OnceFunc(func() { close(resume) })
	t.Cleanup(releaseOnce)
	h.yamlNemo(withKeys("framework: pytorch"))
	h.waitMarkers(marker("job", 0, 0, 0, layout.MarkerRestore))
	h.r.Opened(true)
	h.writeFile(saved, "the first save")
	h.r.Flushed(saved)
	<-published // the first save's name went to its data; its commit still counts as pending
	require.False(t, h.exists(saved))
	h.r.Opened(true)
	h.writeFile(saved, "the second save")
	hash, _, err := layout.HashData(t.Context(), h.path(saved))
	require.NoError(t, err)
	want := strings.TrimSuffix(layout.DataName(hash, false), ".data")
	h.r.Flushed(saved)
	releaseOnce()
	h.eventually("step 5 committed again, with the second save", func() string {
		if got := strings.TrimSpace(h.read(marker("job", 5, 0, 0, layout.MarkerMeta))); got != want {
			return fmt.Sprintf(".meta names %q, want %q; names %v", got, want, h.names())
		}
		return ""
	})
	h.r.Closed(saved) // its release, which comes after its flush (handled after it here, so
	// that it cannot commit the file itself once the first commit is done)
}

// TestOrbaxStepRenamedAgainWhileTheFirstIsPending: a step directory renamed to S again as soon
// as S is free (the first commit's tree sealed away to its data), while the first commit still
// counts as pending, is committed too, and the step is the second tree in every tier. It was
// passed over as a later close of the first commit: the rename had returned, the job had saved,
// and the first tree was restored (a black-box run: 7 of 24 tries at gaps of 0-5 ms).
func TestOrbaxStepRenamedAgainWhileTheFirstIsPending(t *testing.T) {
	t.Parallel()
	published, resume := make(chan struct{}), make(chan struct{})
	var once sync.Once
	h := newHarness(t, harnessConfig{afterPublish: func(step int64) {
		once.Do(func() {
			close(published)
			<-resume
		})
	}})
	releaseOnce := sync.OnceFunc(func() { close(resume) })
	t.Cleanup(releaseOnce)
	h.start(baseYAML, "job")
	h.orbaxSave(5, checkpointFiles("A"))
	<-published // S's tree went to its data; the first commit still counts as pending
	require.False(t, h.exists("5"))
	want := h.orbaxSave(5, checkpointFiles("B"))
	releaseOnce()
	h.eventually("step 5 committed again, with the second tree", func() string {
		if got := strings.TrimSpace(h.read(marker("job", 5, 0, 0, layout.MarkerMeta))); got != want {
			return fmt.Sprintf(".meta names %q, want %q; names %v", got, want, h.names())
		}
		return ""
	})
	if n := strings.Count(h.logs.String(), `msg="step committed" step=5`); n != 2 {
		t.Errorf("%d lines \"step committed\" of step 5, want 2", n)
	}
}

// TestCommittedSaveIsNotReportedAfterARestart: a .save committed at its flush under one
// incarnation whose close is handled after a new replicator.yaml changed workers-per-node is not
// reported as misnamed: it was committed.
func TestCommittedSaveIsNotReportedAfterARestart(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.yamlNemo(withKeys("framework: pytorch", "workers-per-node: 2"))
	h.waitMarkers(marker("job", 0, 0, 0, layout.MarkerRestore), marker("job", 0, 0, 1, layout.MarkerRestore))
	saved := marker("job", 5, 0, 1, layout.MarkerSave)
	h.r.Opened(true)
	if err := os.WriteFile(h.path(saved), []byte("torch state"), 0o644); err != nil {
		t.Fatal(err)
	}
	h.r.Flushed(saved) // committed here, under workers-per-node 2
	h.yamlNemo(withKeys("framework: pytorch"))
	h.waitMarkers(marker("job", 0, 0, 0, layout.MarkerRestore))
	h.r.Closed(saved) // its release, handled under workers-per-node 1
	// Events are handled in order: once a later misnamed .save is reported, the close above was.
	later := marker("job", 6, 0, 3, layout.MarkerSave)
	h.writeFile(later, "torch state")
	h.eventually("the later file's line", func() string {
		if !strings.Contains(h.read(layout.ReplicatorErrorsName), later) {
			return "replicator.errors = " + h.read(layout.ReplicatorErrorsName)
		}
		return ""
	})
	if errs := h.read(layout.ReplicatorErrorsName); strings.Contains(errs, saved) {
		t.Errorf("the committed %s is reported as not committed:\n%s", saved, errs)
	}
}

// TestMoveDataTakesItsAttrsAlong: data moved into spool/sealed (a sealed record, a replica, a
// restored slot) takes the owners and modes kept beside it; data already there keeps its own,
// and takes the newcomer's only when it has none (an earlier agent's).
func TestMoveDataTakesItsAttrsAlong(t *testing.T) {
	dir := t.TempDir()
	p := func(n string) string { return filepath.Join(dir, n) }
	attrs := func(uid uint32) *layout.Attrs {
		return layout.NewAttrsBuilder(layout.Attr{Mode: 0o700, UID: uid, GID: uid}, true).Attrs()
	}
	incoming := func(name string, a *layout.Attrs) string {
		require.NoError(t, os.MkdirAll(p(name), 0o700))
		require.NoError(t, os.WriteFile(p(name+"/f"), []byte(name), 0o600))
		require.NoError(t, layout.WriteAttrs(p(name), a))
		return p(name)
	}
	kept := func(sealed string) *layout.Attrs {
		a, err := layout.ReadAttrs(sealed)
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		require.NoError(t, err)
		return a
	}
	sealed := p("D1.data")
	dup, err := tiers.MoveData(incoming("in1", attrs(1000)), sealed)
	require.NoError(t, err)
	assert.False(t, dup)
	assert.Equal(t, attrs(1000), kept(sealed))
	assert.NoFileExists(t, layout.AttrsFile(p("in1")))

	// The same data again: the first one's attrs stay, the newcomer goes entirely.
	dup, err = tiers.MoveData(incoming("in2", attrs(2000)), sealed)
	require.NoError(t, err)
	assert.True(t, dup)
	assert.Equal(t, attrs(1000), kept(sealed))
	assert.NoDirExists(t, p("in2"))
	assert.NoFileExists(t, layout.AttrsFile(p("in2")))

	// Data held without attrs takes the newcomer's.
	require.NoError(t, os.Remove(layout.AttrsFile(sealed)))
	dup, err = tiers.MoveData(incoming("in3", attrs(3000)), sealed)
	require.NoError(t, err)
	assert.True(t, dup)
	assert.Equal(t, attrs(3000), kept(sealed))

	// Data without attrs moves as before.
	require.NoError(t, os.MkdirAll(p("in4"), 0o700))
	dup, err = tiers.MoveData(p("in4"), p("D4.data"))
	require.NoError(t, err)
	assert.False(t, dup)
	assert.DirExists(t, p("D4.data"))
	assert.Nil(t, kept(p("D4.data")))
}

// TestStepSealedWithoutAttrsTooLargeToKeep: owners and modes that cannot be kept (an encoding
// readers would refuse, or no room left in the spool for them) do not cost the step: it is
// sealed without them (the log and the job are told), and the next step keeps its own.
func TestStepSealedWithoutAttrsTooLargeToKeep(t *testing.T) {
	t.Parallel()
	huge := layout.NewAttrsBuilder(layout.Attr{Mode: 0o755}, true)
	long := strings.Repeat("n", 250)
	for i := 0; i*260 <= layout.MaxAttrsSize; i++ {
		huge.Add(layout.EntryFile, layout.Attr{Mode: 0o600, UID: 1000}, func() string { return fmt.Sprintf("%08d/%s", i, long) })
	}
	h := newHarness(t, harnessConfig{sealAttrs: func(name string) *layout.Attrs {
		if name == "5" {
			return huge.Attrs()
		}
		return nil
	}})
	h.start(baseYAML, "job")
	hash := h.orbaxSave(5, checkpointFiles("5"))
	h.waitSealed("job", 5, "5")
	assert.Empty(t, h.spoolGlob(hash+".data.attrs*"), "nothing kept")
	// The record goes right after the .meta is out (publish): waitSealed may look in between.
	h.eventually("no record left", func() string {
		if got := h.spoolEntries("commits/*"); len(got) != 0 {
			return fmt.Sprintf("records left: %q", got)
		}
		return ""
	})
	hash6 := h.orbaxSave(6, checkpointFiles("6"))
	h.waitSealed("job", 6, "6")
	assert.Len(t, h.spoolGlob(hash6+".data.attrs"), 1, "the next step keeps its own")
	// The job is told, once: they were lost with a line in the log only (found by a black-box run).
	h.eventually("the line", func() string {
		l := h.lines(layout.ReplicatorErrorsName)
		if len(l) != 1 || !strings.Contains(l[0], "step 5 (worker 0): its owners and modes are not kept (") ||
			!strings.Contains(l[0], "restored, its entries get the agent's (root, files 0644, directories 0755)") {
			return fmt.Sprintf("replicator.errors = %q, want one line of step 5's owners and modes", l)
		}
		return ""
	})
}

// TestCommitRecordFailingOnAShortageIsTriedAgain: a commit whose record cannot be written for a
// shortage that passes (the agent out of open files while the job holds many) is tried again
// until it is recorded and sealed, and the restore waits for it. Before, the record was dropped
// once, the job's rename having returned: the job's restart restored the step before it (found
// by a black-box run with a low open-file limit).
func TestCommitRecordFailingOnAShortageIsTriedAgain(t *testing.T) {
	t.Parallel()
	var failing atomic.Bool
	var tries atomic.Int32
	failing.Store(true)
	h := newHarness(t, harnessConfig{sealErr: emfileFor2(&tries, failing.Load)})
	_, hash := h.saveTwoWhileRecordFails(&tries, 3)
	// The job restarts on the same agent while the record still fails: its restore waits.
	h.yamlOrbax(baseYAML)
	time.Sleep(300 * time.Millisecond)
	if h.exists(layout.PrerestoreName) {
		t.Fatal("the restore planned while a commit was not yet recorded")
	}
	failing.Store(false)
	restore := marker("job", 2, 0, 0, layout.MarkerRestore)
	h.waitMarkers(restore)
	h.checkRestoreLink(restore, hash, checkpointFiles("2"))
	if l := h.lines(layout.ReplicatorErrorsName); len(l) != 0 {
		t.Errorf("replicator.errors = %q: the step was sealed in the end", l)
	}
}

// TestRecordOnTheRenameDoesNotWaitForTheReserve: the record of a commit, written on the job's
// rename (a FUSE request, during which the kernel holds the lock of the mount's root), does not
// wait for the descriptor reserve while another write holds it; the sealer records the commit
// once the shortage passed. Before, it waited, and the write holding the reserve, when it
// changed a name at the root, waited for the kernel's notification, which waited for the root's
// lock: the mount hung (a review).
func TestRecordOnTheRenameDoesNotWaitForTheReserve(t *testing.T) {
	t.Parallel()
	var failing atomic.Bool
	var tries atomic.Int32
	failing.Store(true)
	h := newHarness(t, harnessConfig{sealErr: emfileFor2(&tries, failing.Load)})
	h.start(baseYAML, "job")
	h.orbaxSave(1, checkpointFiles("1"))
	h.waitSealed("job", 1, "1")
	tmp := "2" + layout.OrbaxTmpSuffix
	h.makeTree(tmp, checkpointFiles("2"))
	require.NoError(t, os.Rename(h.path(tmp), h.path("2")))
	release := h.r.HoldFDReserve()
	renamed := make(chan struct{})
	go func() {
		h.r.Renamed(tmp, "2", layout.EntryDir) // the rename's request
		close(renamed)
	}()
	select {
	case <-renamed:
		release()
	case <-time.After(20 * time.Second):
		release()
		<-renamed
		t.Fatal("the rename's record waited for the descriptor reserve another write held")
	}
	require.NotZero(t, tries.Load(), "the record was tried on the rename")
	failing.Store(false)
	h.waitSealed("job", 2, "2")
	h.eventually("no record of a failed try left", func() string {
		ents, _ := os.ReadDir(filepath.Join(h.cfg.root, "spool", "commits"))
		if len(ents) != 0 {
			return fmt.Sprintf("%d records", len(ents))
		}
		return ""
	})
}

// emfileFor2 is a harnessConfig.sealErr that fails the record of step 2 with EMFILE while
// failing says so, counting its tries.
func emfileFor2(tries *atomic.Int32, failing func() bool) func(string) error {
	return func(name string) error {
		if name != "2" {
			return nil
		}
		tries.Add(1)
		if failing() {
			return &os.PathError{Op: "open", Path: "commits/x/data/state", Err: syscall.EMFILE}
		}
		return nil
	}
}

// failFor2 is a harnessConfig.hashFault that fails the hashing of step 2's record with errno,
// counting its tries.
func failFor2(tries *atomic.Int32, errno syscall.Errno) func(int64) error {
	return func(step int64) error {
		if step != 2 {
			return nil
		}
		tries.Add(1)
		return &os.PathError{Op: "open", Path: "commits/x/data/state", Err: errno}
	}
}

// saveTwoWhileRecordFails starts the job, saves step 1 (sealed) and step 2, and waits until the
// record or hash of step 2 was tried n times (emfileFor2, failFor2); it returns their hashes.
func (h *harness) saveTwoWhileRecordFails(tries *atomic.Int32, n int32) (hash1, hash2 string) {
	h.t.Helper()
	h.start(baseYAML, "job")
	hash1 = h.orbaxSave(1, checkpointFiles("1"))
	h.waitSealed("job", 1, "1")
	hash2 = h.orbaxSave(2, checkpointFiles("2"))
	h.eventually("tries of the record", func() string {
		if got := tries.Load(); got < n {
			return fmt.Sprintf("%d tries", got)
		}
		return ""
	})
	return hash1, hash2
}

// TestCommitRecordedAtTheLastTryIsSealedByTheNextAgent: an agent that stops while the record
// of a commit still fails on a shortage tries once more; recorded then, the commit is sealed by
// the next agent, and restored. Without that try the step was lost (its rename had returned).
func TestCommitRecordedAtTheLastTryIsSealedByTheNextAgent(t *testing.T) {
	t.Parallel()
	var r atomic.Pointer[tiers.Replicator]
	var tries atomic.Int32
	h := newHarness(t, harnessConfig{sealErr: emfileFor2(&tries, func() bool { // passes once the agent stops
		rr := r.Load()
		return rr == nil || !rr.BackupsStopping()
	})})
	r.Store(h.r)
	_, hash := h.saveTwoWhileRecordFails(&tries, 2)
	h.close()
	if !strings.Contains(h.logs.String(), "the agent stops before a committed step could be sealed") {
		t.Fatalf("no last try recorded the commit: %d tries", tries.Load())
	}
	if l := h.lines(layout.ReplicatorErrorsName); len(l) != 0 {
		t.Errorf("replicator.errors = %q: the step is not lost", l)
	}

	newHarness(t, harnessConfig{root: h.cfg.root}).restoresFromRecords(2, hash, checkpointFiles("2"))
}

// TestSealGivenUpTellsTheJobWhatItMeans: a commit whose record still fails on a shortage when
// its tries end is not checkpointed, and the job is told so and what to do; its restart
// restores the step before it, as the line says.
func TestSealGivenUpTellsTheJobWhatItMeans(t *testing.T) {
	t.Parallel()
	var tries atomic.Int32
	h := newHarness(t, harnessConfig{sealRetryFor: time.Second, sealErr: emfileFor2(&tries, func() bool { return true })})
	hash1, _ := h.saveTwoWhileRecordFails(&tries, 1)
	want := "sealing step 2 (worker 0) failed: open commits/x/data/state: too many open files; the step is not checkpointed: " +
		"a restart restores the one before it (raise the agent's --memory or descriptor limit, or hold fewer files open)"
	h.eventually("the line", func() string {
		if l := h.lines(layout.ReplicatorErrorsName); len(l) != 1 || !strings.HasSuffix(l[0], " ERR "+want) {
			return fmt.Sprintf("replicator.errors = %q", l)
		}
		return ""
	})
	os.Remove(h.path(layout.ReplicatorErrorsName))        // read and unlinked, as the job does
	h.restoresFromRecords(1, hash1, checkpointFiles("1")) // no record: the step is not checkpointed
}

// TestGiveUpLineReachesTheRestartedJob: a job that restarts while a commit's record still
// fails waits for the tries; when they end, the line saying the step is lost is the restarted
// job's. Before, it went to the incarnation that committed, was logged as an earlier one's, and
// the restarted job got the step before without a word (found by a black-box run).
func TestGiveUpLineReachesTheRestartedJob(t *testing.T) {
	t.Parallel()
	var tries atomic.Int32
	h := newHarness(t, harnessConfig{sealRetryFor: time.Second, sealErr: emfileFor2(&tries, func() bool { return true })})
	h.restartDuringTries(&tries, "the step is not checkpointed")
}

// restartDuringTries saves steps 1 and 2 (whose record or hash fails: tries counts them), restarts
// the job during the tries, checks that it restores step 1 with no record left, and waits for
// the line of step 2's failure, which contains want; it returns step 1's hash.
func (h *harness) restartDuringTries(tries *atomic.Int32, want string) string {
	h.t.Helper()
	hash1, _ := h.saveTwoWhileRecordFails(tries, 1)
	h.restoresFromRecords(1, hash1, checkpointFiles("1")) // the job's restart (one yaml: a second one's .tmp met the first's cleaning, in CI)
	h.eventually("the line", func() string {
		for _, l := range h.lines(layout.ReplicatorErrorsName) {
			if strings.Contains(l, "sealing step 2 (worker 0) failed: ") && strings.Contains(l, want) {
				return ""
			}
		}
		return fmt.Sprintf("replicator.errors = %q", h.lines(layout.ReplicatorErrorsName))
	})
	return hash1
}

// TestLinesWhoseWriteFailedGoWithTheNext: a line for the job whose write failed (the agent out
// of descriptors, say) is written with the next one, not lost; it was logged as reported.
func TestLinesWhoseWriteFailedGoWithTheNext(t *testing.T) {
	t.Parallel()
	var failing atomic.Bool
	failing.Store(true)
	h := newHarness(t, harnessConfig{writeErr: func(name string) error {
		if name == layout.ReplicatorErrorsName && failing.Load() {
			return &os.PathError{Op: "open", Path: name, Err: syscall.ENFILE}
		}
		return nil
	}})
	h.start(baseYAML, "job")
	h.makeTree("tmp", map[string]string{"state": "weights"})
	h.rename("tmp", "007")
	h.eventually("the failed write", func() string {
		if !strings.Contains(h.logs.String(), "the lines are written with the next one") {
			return "not yet"
		}
		return ""
	})
	failing.Store(false)
	h.makeTree("tmp", map[string]string{"state": "weights"})
	h.rename("tmp", "-3")
	h.eventually("both lines", func() string {
		l := h.lines(layout.ReplicatorErrorsName)
		if len(l) != 2 || !strings.Contains(l[0], "007 is not committed") || !strings.Contains(l[1], "-3 is not committed") {
			return fmt.Sprintf("replicator.errors = %q", l)
		}
		return ""
	})
}

// TestLinesAreNeitherOverwrittenNorCarriedOver: a line whose read of replicator.errors failed
// is not written over the lines the job has not read yet (it wrote only the new line, erasing
// them: a review); it goes with the next line of its incarnation, and never into the next
// incarnation's file.
func TestLinesAreNeitherOverwrittenNorCarriedOver(t *testing.T) {
	t.Parallel()
	var failing atomic.Bool
	h := newHarness(t, harnessConfig{readErr: func(name string) error {
		if name == layout.ReplicatorErrorsName && failing.Load() {
			return &os.PathError{Op: "open", Path: name, Err: syscall.ENFILE}
		}
		return nil
	}})
	h.start(baseYAML, "job")
	misname := func(name string) {
		h.makeTree("tmp", map[string]string{"state": "weights"})
		h.rename("tmp", name)
	}
	waitLines := func(want ...string) {
		h.eventually("the lines", func() string {
			l := h.lines(layout.ReplicatorErrorsName)
			if len(l) != len(want) {
				return fmt.Sprintf("replicator.errors = %q, want %q", l, want)
			}
			for i, w := range want {
				if !strings.Contains(l[i], w+" is not committed") {
					return fmt.Sprintf("replicator.errors = %q, want %q", l, want)
				}
			}
			return ""
		})
	}
	misname("01")
	waitLines("01")
	failing.Store(true)
	misname("02")
	h.eventually("the failed write", func() string {
		if !strings.Contains(h.logs.String(), "the lines are written with the next one") {
			return "not yet"
		}
		return ""
	})
	waitLines("01") // not overwritten
	failing.Store(false)
	misname("03")
	waitLines("01", "02", "03")

	// A line of this incarnation that could not be written is not the next one's own news: it
	// goes to the next incarnation labelled as never read, before that one's own lines (it
	// was lost, and a job restarted after a seal that failed so was told nothing: a black-box
	// run).
	failing.Store(true)
	misname("04")
	h.eventually("the second failed write", func() string {
		if strings.Count(h.logs.String(), "the lines are written with the next one") < 2 {
			return "not yet"
		}
		return ""
	})
	failing.Store(false)
	require.NoError(t, os.Remove(h.path(layout.ReplicatorErrorsName)))                  // read and unlinked, as the job does
	require.NoError(t, os.Remove(h.path(marker("job", 0, 0, 0, layout.MarkerRestore)))) // the new incarnation's, waited for below
	h.yamlOrbax(baseYAML)
	h.waitMarkers(marker("job", 0, 0, 0, layout.MarkerRestore))
	misname("-5")
	waitLines("04", "-5")
	l := h.lines(layout.ReplicatorErrorsName)
	assert.Contains(t, l[0], "not read by the job before this start (replicator.errors, which could not be written at ")
	assert.NotContains(t, l[1], "not read by the job")
}

// TestKeptRecordGoesWithARestartDuringTheTries: a job that restarts while a commit's hash still
// fails waits for the tries; when they end, its restore continues from the step before and drops
// the record, which the line says (it said the next start would seal it), and no agent start
// seals that step of the timeline the job left.
func TestKeptRecordGoesWithARestartDuringTheTries(t *testing.T) {
	t.Parallel()
	var tries atomic.Int32
	h := newHarness(t, harnessConfig{sealRetryFor: time.Second, hashFault: failFor2(&tries, syscall.EMFILE),
		afterSealDone: func(name string) {
			if name == "2" {
				// The restore waiting for the commit goes on now: a record the sealer keeps
				// only after done is too late for it (a review: the test passed either way).
				time.Sleep(300 * time.Millisecond)
			}
		}})
	hash1 := h.restartDuringTries(&tries, "the step is not checkpointed: the job's restart restores the one before it")
	cfg := h.cfg
	cfg.hashFault = nil
	h.close()
	newHarness(t, cfg).restoresFromRecords(1, hash1, checkpointFiles("1"))
}

// TestRecordNotHashedStaysForTheNextStarts: a commit recorded but not hashed when its tries end
// keeps its record, and the job is told to restart the agent first; an agent start that cannot
// hash it either keeps it again, and the next start seals and restores it.
func TestRecordNotHashedStaysForTheNextStarts(t *testing.T) {
	t.Parallel()
	var tries atomic.Int32
	h := newHarness(t, harnessConfig{sealRetryFor: time.Second, hashFault: failFor2(&tries, syscall.EMFILE)})
	_, hash2 := h.saveTwoWhileRecordFails(&tries, 1)
	h.eventually("the line", func() string {
		for _, l := range h.lines(layout.ReplicatorErrorsName) {
			if strings.Contains(l, " ERR sealing step 2 (worker 0) failed: ") && strings.HasSuffix(l, "too many open files; its record stays in the spool, and the agent's next start seals it: "+
				"restart the agent before the job (a job restart on this agent restores the step before it, and drops this one) (raise the agent's --memory or descriptor limit, or hold fewer files open)") {
				return ""
			}
		}
		return fmt.Sprintf("replicator.errors = %q", h.lines(layout.ReplicatorErrorsName))
	})
	if got := h.spoolEntries("commits/*"); len(got) != 1 {
		t.Fatalf("records = %q, want the one of step 2", got)
	}

	// The agent restarts, and hashing still fails: the record is kept again.
	h2 := h.restart()
	if got := h2.spoolEntries("commits/*"); len(got) != 1 {
		t.Fatalf("records = %q, want the one of step 2 kept", got)
	}
	if !strings.Contains(h2.logs.String(), "a commit recorded by the previous agent could not be sealed") {
		t.Error("the adoption did not say it could not seal the record")
	}
	h2.close()

	cfg := h.cfg
	cfg.hashFault = nil
	newHarness(t, cfg).restoresFromRecords(2, hash2, checkpointFiles("2"))
}

// TestJobRestoreDropsTheKeptRecordOfAStepItAbandons: a job that restarts on the agent that kept
// a record it could not hash continues from the step before it (as the job was told): the
// record goes with the rest of that timeline, and its RAM with it. Before, it stayed, holding
// a step's bytes no retention freed, and the agent's next start sealed it as the newest step
// of a timeline the job had left (a review).
func TestJobRestoreDropsTheKeptRecordOfAStepItAbandons(t *testing.T) {
	t.Parallel()
	var tries atomic.Int32
	h := newHarness(t, harnessConfig{sealRetryFor: 300 * time.Millisecond, hashFault: failFor2(&tries, syscall.ENOMEM)})
	hash1, _ := h.saveTwoWhileRecordFails(&tries, 1)
	h.eventually("the line", func() string {
		if l := h.lines(layout.ReplicatorErrorsName); len(l) == 0 || !strings.Contains(l[0], "its record stays in the spool") {
			return fmt.Sprintf("replicator.errors = %q", l)
		}
		return ""
	})
	h.yamlOrbax(baseYAML)
	restore1 := marker("job", 1, 0, 0, layout.MarkerRestore)
	h.waitMarkers(restore1)
	h.checkRestoreLink(restore1, hash1, checkpointFiles("1"))
	if got := h.spoolEntries("commits/*"); len(got) != 0 {
		t.Errorf("records = %q: the restore of step 1 abandons step 2", got)
	}
	cfg := h.cfg
	cfg.hashFault = nil
	h.close()
	h2 := newHarness(t, cfg)
	h2.yamlOrbax(baseYAML)
	h2.waitMarkers(restore1)
	h2.checkRestoreLink(restore1, hash1, checkpointFiles("1"))
}

// TestNewestOfTwoRecordsOfAStepIsSealed: of two records of one step left unsealed (the older
// kept by an agent that could not hash it, the newer of the job's commit of the step again, cut
// by a kill), the newer is sealed and restored. Sealed in name order, the older one's new .meta
// made the newer record look older than the step sealed, which dropped it (a review).
func TestNewestOfTwoRecordsOfAStepIsSealed(t *testing.T) {
	t.Parallel()
	leave := func(at time.Time, tag string) (root, hash string) {
		block := make(chan struct{})
		blocked := make(chan struct{}, 1)
		h := newHarness(t, harnessConfig{clock: newFakeClock(at), beforeSeal: func(int64) {
			select {
			case blocked <- struct{}{}:
				<-block
			default:
			}
		}})
		h.start(baseYAML, "job")
		hash = h.orbaxSave(7, checkpointFiles(tag))
		<-blocked
		root = snapshotSpool(t, h) // the record of the commit, unsealed
		close(block)
		return root, hash
	}
	root, _ := leave(time.Now().Add(-time.Hour), "older")
	newerRoot, hash := leave(time.Now().Add(-30*time.Minute), "newer")
	recs, err := filepath.Glob(filepath.Join(newerRoot, "spool", "commits", "*"))
	require.NoError(t, err)
	require.Len(t, recs, 1)
	require.NoError(t, copyTreeLinks(recs[0], filepath.Join(root, "spool", "commits", filepath.Base(recs[0]))))

	newHarness(t, harnessConfig{root: root}).restoresFromRecords(7, hash, checkpointFiles("newer"))
}

// restoresFromRecords starts the job on h and checks that it restores step (hash, files) with
// no commit record left in the spool.
func (h *harness) restoresFromRecords(step int64, hash string, files map[string]string) {
	h.t.Helper()
	h.yamlOrbax(baseYAML)
	restore := marker("job", step, 0, 0, layout.MarkerRestore)
	h.waitMarkers(restore)
	h.checkRestoreLink(restore, hash, files)
	if got := h.spoolEntries("commits/*"); len(got) != 0 {
		h.t.Errorf("records left: %q", got)
	}
}

// TestOlderCommitRecordDoesNotReplaceANewerSeal: a record an agent left unsealed (killed, or a
// seal that failed) must not, at the next start, replace a newer commit of the same step sealed
// since: the newer commit wins, as it does while one agent runs (found by a review).
func TestOlderCommitRecordDoesNotReplaceANewerSeal(t *testing.T) {
	t.Parallel()
	block := make(chan struct{})
	blocked := make(chan struct{}, 1)
	old := newHarness(t, harnessConfig{clock: newFakeClock(time.Now().Add(-time.Hour)), beforeSeal: func(int64) {
		select {
		case blocked <- struct{}{}:
			<-block
		default:
		}
	}})
	old.start(baseYAML, "job")
	old.orbaxSave(7, checkpointFiles("old"))
	<-blocked
	root := snapshotSpool(t, old) // the record of the old commit, unsealed
	close(block)

	newer := newHarness(t, harnessConfig{})
	newer.start(baseYAML, "job")
	hash := newer.orbaxSave(7, checkpointFiles("new"))
	newer.waitSealed("job", 7, "7")
	meta := marker("job", 7, 0, 0, layout.MarkerMeta)
	for _, p := range []string{filepath.Join("meta", meta), filepath.Join("sealed", hash+".data")} {
		if err := copyTreeLinks(filepath.Join(newer.cfg.root, "spool", p), filepath.Join(root, "spool", p)); err != nil {
			t.Fatal(err)
		}
	}

	newHarness(t, harnessConfig{root: root}).restoresFromRecords(7, hash, checkpointFiles("new"))
}

// TestStatusNamesAStepInItsSealTries: a committed step whose record, or then whose hash, fails
// on a shortage shows in the status (and as mtcfs_seal_retrying) while it is tried again, and
// no longer once it is sealed. Before, it showed nowhere until the give-up (a black-box run).
func TestStatusNamesAStepInItsSealTries(t *testing.T) {
	t.Parallel()
	var recordFails, hashFails atomic.Bool
	recordFails.Store(true)
	hashFails.Store(true)
	var tries, hashTries atomic.Int32
	h := newHarness(t, harnessConfig{sealErr: emfileFor2(&tries, recordFails.Load), hashFault: func(step int64) error {
		if step == 2 && hashFails.Load() {
			hashTries.Add(1)
			return &os.PathError{Op: "open", Path: "commits/x/data/state", Err: syscall.ENOMEM}
		}
		return nil
	}})
	reg := prometheus.NewRegistry()
	tiers.NewMetrics(reg, h.r)
	retrying := func() float64 {
		fams, err := reg.Gather()
		require.NoError(t, err)
		for _, f := range fams {
			if f.GetName() == "mtcfs_seal_retrying" {
				return f.GetMetric()[0].GetGauge().GetValue()
			}
		}
		t.Fatal("mtcfs_seal_retrying is not exported")
		return 0
	}
	h.saveTwoWhileRecordFails(&tries, 2)
	seen := func(recorded bool, errText string) {
		h.eventually("the step in its tries", func() string {
			sv := h.r.Status().Sealing
			switch {
			case sv == nil:
				return "no step in its tries in the status"
			case sv.Step != 2 || sv.Worker != 0 || sv.Recorded != recorded || sv.Tries < 2 || !strings.Contains(sv.Err, errText):
				return fmt.Sprintf("status shows %+v", *sv)
			case sv.Until.Sub(sv.Committed) != 2*time.Minute:
				return fmt.Sprintf("tried until %v after the commit, want 2m", sv.Until.Sub(sv.Committed))
			}
			return ""
		})
		assert.EqualValues(t, 1, retrying())
	}
	seen(false, "too many open files")
	recordFails.Store(false) // recorded at the next try; then its hash fails
	h.eventually("hash tries", func() string {
		if hashTries.Load() < 2 {
			return "not yet"
		}
		return ""
	})
	seen(true, "cannot allocate memory")
	hashFails.Store(false)
	h.waitSealed("job", 2, "2")
	h.eventually("the sealed step out of the status", func() string {
		if sv := h.r.Status().Sealing; sv != nil {
			return fmt.Sprintf("status shows %+v", *sv)
		}
		return ""
	})
	assert.Zero(t, retrying())
}

// TestRecordsOfFailedTriesAreRemoved: the record each failed try of a commit makes is removed,
// also when its removal fails at first for lack of descriptors (a later try removes it). Before,
// os.RemoveAll failed as the try had, and the records stayed until the agent's restart, holding
// links to the step's bytes (a black-box run: 30 after the give-up).
func TestRecordsOfFailedTriesAreRemoved(t *testing.T) {
	t.Parallel()
	var recordFails, removeFails atomic.Bool
	recordFails.Store(true)
	removeFails.Store(true)
	var tries atomic.Int32
	h := newHarness(t, harnessConfig{sealErr: emfileFor2(&tries, recordFails.Load), recordRemoveErr: func(string) error {
		if removeFails.Load() {
			return &os.PathError{Op: "open", Path: "commits/x", Err: syscall.EMFILE}
		}
		return nil
	}})
	h.saveTwoWhileRecordFails(&tries, 4) // a try seals twice, the second time with the reserve
	if got := h.spoolEntries("commits/*"); len(got) < 2 {
		t.Fatalf("records = %q: the removals failed, 2 tries leave 2", got)
	}
	removeFails.Store(false)
	n := tries.Load()
	h.eventually("the records of the failed tries removed", func() string {
		if tries.Load() < n+1 {
			return "no try since"
		}
		if got := h.spoolEntries("commits/*"); len(got) != 0 {
			return fmt.Sprintf("records = %q", got)
		}
		return ""
	})
	recordFails.Store(false)
	h.waitSealed("job", 2, "2")
	// The .meta is out a moment before the sealed record is removed (a clean-clone CI run
	// looked in between).
	h.eventually("no record after the seal", func() string {
		if got := h.spoolEntries("commits/*"); len(got) != 0 {
			return fmt.Sprintf("records = %q", got)
		}
		return ""
	})
}

// TestLinesGoOnPastTheFilesLimit: once replicator.errors passed its size limit unread (an Orbax
// job reads it at its restarts), the lines before are dropped with a line saying so, and the
// new ones are written. Before, the read failed (EFBIG) and no line reached the job any more (a
// review).
func TestLinesGoOnPastTheFilesLimit(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.start(baseYAML, "job")
	h.writeFile(layout.ReplicatorErrorsName, strings.Repeat("an old line the job did not read\n", (1<<20)/33+1))
	h.makeTree("tmp", map[string]string{"state": "weights"})
	h.rename("tmp", "007")
	h.eventually("the lines", func() string {
		l := h.lines(layout.ReplicatorErrorsName)
		if len(l) != 2 || !strings.Contains(l[0], "ERR the lines before this one were dropped: replicator.errors passed 1048576 bytes unread") ||
			!strings.Contains(l[1], "007 is not committed") {
			return fmt.Sprintf("replicator.errors = %.300q", l)
		}
		return ""
	})
}

// TestFileRenamedOntoAStepNameIsTold: a regular file renamed onto a step's name is no commit,
// and the job is told (Orbax lists steps following symlinks: it looked saved; black-box h59);
// the restore marker, a symlink renamed onto the step's name as Orbax does, is not.
func TestFileRenamedOntoAStepNameIsTold(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessConfig{})
	h.start(baseYAML, "job")
	h.orbaxSave(1, checkpointFiles("1"))
	h.waitSealed("job", 1, "1")
	h.writeFile("x", "not a step")
	h.rename("x", "9")
	h.eventually("the line", func() string {
		l := h.lines(layout.ReplicatorErrorsName)
		if len(l) != 1 || !strings.Contains(l[0], "9 is not committed (its step is not checkpointed): a step is a directory renamed onto its step's name") {
			return fmt.Sprintf("replicator.errors = %q", l)
		}
		return ""
	})
	require.NoError(t, os.Remove(h.path(layout.ReplicatorErrorsName)))
	require.NoError(t, os.Remove(h.path(marker("job", 0, 0, 0, layout.MarkerRestore))))
	h.yamlOrbax(baseYAML) // the job restarts and takes its marker as Orbax does
	restore1 := marker("job", 1, 0, 0, layout.MarkerRestore)
	h.waitMarkers(restore1)
	h.rename(restore1, "1")
	time.Sleep(100 * time.Millisecond)
	assert.Empty(t, h.lines(layout.ReplicatorErrorsName), "the marker's rename is no mistake")
}
