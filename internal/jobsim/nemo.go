package jobsim

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	"gopkg.in/yaml.v3"
)

// NeMo replays NeMo's InClusterLocalCheckpointIO with framework pytorch.distributed (SPEC §9):
// local rank 0 writes replicator.yaml directly and does not wait; the restore waits for the yaml
// to vanish, requires replicator.prerestore, and renames the first *.restore marker to
// "step=<N>"; a save writes "step=<gs>" with a "-unfinished" marker beside it and commits by
// renaming it to "<gs-1>" (NeMo's off-by-one).
type NeMo struct {
	Dir   string // CHECKPOINT_DIR (the mtcfs mount)
	Job   string // job-name
	Rank  int    // node-rank (NODE_RANK)
	Nodes int    // nodes (NNODES)
	// PeersPerNode is written as peers-per-node; zero means the client default, 1.
	PeersPerNode int
	// BackupIntervalMinutes: zero means the client default, 30; fractions are kept.
	BackupIntervalMinutes float64

	Poll    time.Duration // interval of every wait; default 1s like the real client
	Timeout time.Duration // limit of every wait; default 300s like the real client
	Content Content       // shape of the .distcp shards written per step
	Logf    func(format string, args ...any)

	errs []string // lines read from replicator.errors
}

// Errors returns the lines this client has read (and unlinked) from replicator.errors so far.
func (n *NeMo) Errors() []string { return append([]string(nil), n.errs...) }

func (n *NeMo) session() (session, error) {
	return newSession(n.Dir, n.Poll, n.Timeout, n.Logf, fmt.Sprintf("nemo %s rank %d: ", n.Job, n.Rank), &n.errs)
}

// nemoMarkerRE is the NeMo client's step extraction: a search, not a full match; a name without
// it counts as step 0.
var nemoMarkerRE = regexp.MustCompile(`-s(\d+)-n\d+-w\d+`)

// YAML returns the replicator.yaml Handshake writes: PyYAML's block style (one key per line,
// trailing newline) in the client's key order.
func (n *NeMo) YAML() string {
	peers := n.PeersPerNode
	if peers <= 0 {
		peers = 1
	}
	doc := &yaml.Node{Kind: yaml.MappingNode}
	add := func(key, tag, value string) {
		doc.Content = append(doc.Content,
			&yaml.Node{Kind: yaml.ScalarNode, Value: key},
			&yaml.Node{Kind: yaml.ScalarNode, Tag: tag, Value: value})
	}
	add("job-name", "!!str", n.Job)
	add("framework", "!!str", "pytorch.distributed")
	add("node-rank", "!!int", strconv.Itoa(n.Rank))
	add("nodes", "!!int", strconv.Itoa(n.Nodes))
	add("peers-per-node", "!!int", strconv.Itoa(peers))
	minutes, tag := formatMinutes(n.BackupIntervalMinutes), "!!int"
	if strings.Contains(minutes, ".") {
		tag = "!!float"
	}
	add("backup-interval-minutes", tag, minutes)
	out, err := yaml.Marshal(doc)
	if err != nil {
		panic(err) // a flat mapping of scalars always marshals
	}
	return string(out)
}

// Handshake is what local rank 0 does at start-up: wait until replicator.yaml is absent, then
// write it directly (open, write, close; no rename). It does not wait for the agent.
func (n *NeMo) Handshake(ctx context.Context) (err error) {
	s, err := n.session()
	if err != nil {
		return err
	}
	if err := s.waitYAMLAbsent(ctx); err != nil {
		return fmt.Errorf("nemo %s rank %d: handshake: %w", n.Job, n.Rank, err)
	}
	if err := os.WriteFile(s.path(yamlName), []byte(n.YAML()), 0o644); err != nil {
		return fmt.Errorf("nemo %s rank %d: handshake: %w", n.Job, n.Rank, err)
	}
	s.logf("wrote %s", yamlName)
	return nil
}

// Restore waits for replicator.yaml to vanish, consumes replicator.errors/failed, requires
// replicator.prerestore within Timeout, then waits for a *.restore marker and takes the first
// one: for step 0 it leaves the marker alone and returns found == false; otherwise it renames
// the marker to "step=<N>" and returns N.
//
// Beyond the real client, Restore fails when replicator.prerestore is not valid YAML (the
// client would silently use step 0) or names a different step than the marker.
func (n *NeMo) Restore(ctx context.Context) (step int64, found bool, err error) {
	s, err := n.session()
	if err != nil {
		return 0, false, err
	}
	defer func() {
		if err != nil {
			err = fmt.Errorf("nemo %s rank %d: restore: %w", n.Job, n.Rank, err)
		}
	}()
	if err := s.waitYAMLAbsent(ctx); err != nil {
		return 0, false, err
	}
	if err := s.checkStatus(); err != nil {
		return 0, false, err
	}
	var pre []byte
	err = s.waitFor(ctx, s.timeout, prerestoreName+" (the agent's restore decision)", func() (bool, error) {
		var err error
		pre, err = os.ReadFile(s.path(prerestoreName))
		if errors.Is(err, fs.ErrNotExist) {
			return false, nil
		}
		return err == nil, err
	})
	if err != nil {
		return 0, false, err
	}
	preStep, err := parsePrerestore(pre)
	if err != nil {
		return 0, false, err
	}
	s.logf("%s: restore-step %d", prerestoreName, preStep)

	var marker string
	err = s.waitFor(ctx, s.timeout, "a *.restore marker", func() (bool, error) {
		names, err := globRestore(s.dir)
		if err != nil || len(names) == 0 {
			return false, err
		}
		marker = names[0]
		return true, nil
	})
	if err != nil {
		return 0, false, err
	}
	if m := nemoMarkerRE.FindStringSubmatch(marker); m != nil {
		if step, err = strconv.ParseInt(m[1], 10, 64); err != nil {
			return 0, false, fmt.Errorf("restore marker %q: step: %w", marker, err)
		}
	}
	if step != preStep {
		return 0, false, fmt.Errorf("%s says restore-step %d but the marker %s names step %d", prerestoreName, preStep, marker, step)
	}
	if step == 0 {
		s.logf("nothing to restore (%s)", marker)
		return 0, false, nil
	}
	if err := os.Rename(s.path(marker), s.path(nemoStepDir(step))); err != nil {
		return 0, false, fmt.Errorf("rename restore marker: %w", err)
	}
	s.logf("restoring step %d: renamed %s to %s", step, marker, nemoStepDir(step))
	return step, true, nil
}

// parsePrerestore reads {restore-step: N} (or {}) as the client's yaml.safe_load + int() does.
func parsePrerestore(data []byte) (int64, error) {
	var doc map[string]any
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return 0, fmt.Errorf("%s is not valid YAML: %w (content %q)", prerestoreName, err, data)
	}
	switch v := doc["restore-step"].(type) {
	case nil:
		return 0, nil
	case int:
		return int64(v), nil
	case string:
		if n, err := strconv.ParseInt(v, 10, 64); err == nil {
			return n, nil
		}
	}
	return 0, fmt.Errorf("%s: restore-step %v is not an integer (content %q)", prerestoreName, doc["restore-step"], data)
}

func nemoStepDir(step int64) string { return "step=" + strconv.FormatInt(step, 10) }

// Save writes global step gs as NeMo does: touch "step=<gs>-unfinished", mkdir "step=<gs>",
// write common.pt, "<rank>/__<rank>_<k>.distcp" (fsynced), "<rank>/.metadata" (via
// .metadata.tmp and rename) and metadata.json, unlink the -unfinished marker, and rename
// "step=<gs>" to "<gs-1>", which commits step gs-1. The bytes are those of step gs-1, the step
// a later restore marker names, so VerifyRestored(gs-1) checks them.
func (n *NeMo) Save(ctx context.Context, globalStep int64) (err error) {
	s, err := n.session()
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			err = fmt.Errorf("nemo %s rank %d: save global step %d: %w", n.Job, n.Rank, globalStep, err)
		}
	}()
	if globalStep < 1 {
		return errors.New("global step must be at least 1 (the committed step is global step - 1)")
	}
	committed := globalStep - 1
	dir := s.path(nemoStepDir(globalStep))
	unfinished := dir + "-unfinished"
	fd, err := os.OpenFile(unfinished, os.O_WRONLY|os.O_CREATE, 0o644)
	if err != nil {
		return err
	}
	if err := fd.Close(); err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil { // torch: makedirs(exist_ok=True)
		return err
	}
	rank := strconv.Itoa(n.Rank)
	for _, f := range n.Tree(committed) {
		if err := ctx.Err(); err != nil {
			return err
		}
		p := filepath.Join(dir, filepath.FromSlash(f.Path))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil { // "<rank>/" before its first shard
			return err
		}
		switch f.Path {
		case rank + "/.metadata": // torch's FileSystemWriter: temp name, then rename
			if err := writeDirect(p+".tmp", f, true); err != nil {
				return err
			}
			if err := os.Rename(p+".tmp", p); err != nil {
				return err
			}
		default:
			if err := writeDirect(p, f, f.data == nil); err != nil {
				return err
			}
		}
	}
	if err := os.Remove(unfinished); err != nil {
		return err
	}
	if err := os.Rename(dir, s.path(strconv.FormatInt(committed, 10))); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	s.logf("saved global step %d as step %d", globalStep, committed)
	return nil
}

// VerifyRestored reads the restored "step=<N>" tree through the renamed marker — large
// sequential reads, random preads and an mmap — and compares every byte with what this rank's
// Save(N+1) wrote.
func (n *NeMo) VerifyRestored(ctx context.Context, step int64) error {
	s, err := n.session()
	if err != nil {
		return err
	}
	name := nemoStepDir(step)
	if err := verifyTree(ctx, s.path(name), name, n.Tree(step)); err != nil {
		return fmt.Errorf("nemo %s rank %d: verify restored step %d: %w", n.Job, n.Rank, step, err)
	}
	s.logf("verified %s", name)
	return nil
}

// Tree lists the files of this rank's committed step, relative to the step directory, in the
// order Save writes them and a restore reads them.
func (n *NeMo) Tree(step int64) []File {
	c := n.Content.withDefaults()
	rank := strconv.Itoa(n.Rank)
	gen := func(path string, size int64) File { return generatedFile(n.Job, n.Rank, step, path, size) }
	files := []File{
		gen("common.pt", smallGeneratedSize),
	}
	for k := 0; k < c.Files; k++ {
		files = append(files, gen(fmt.Sprintf("%s/__%s_%d.distcp", rank, rank, k), c.FileSize))
	}
	return append(files,
		gen(rank+"/.metadata", smallGeneratedSize),
		fixedFile("metadata.json", []byte(`{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}`)))
}
