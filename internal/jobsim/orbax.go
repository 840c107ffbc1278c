package jobsim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"
)

// Orbax replays Orbax's ReplicatorCheckpointManager as MaxText drives it (SPEC §9): the
// start-up handshake and restore-marker processing of multi_tier_checkpointing.initialization,
// the save sequence of a local CheckpointManager with "state" and "process_metadata" items, and
// the reads of a restore. Configure the exported fields, then call Start once, then Save and
// VerifyRestored as the training loop would.
type Orbax struct {
	Dir   string // CHECKPOINT_DIR (the mtcfs mount)
	Job   string // job-name (the real client uses the run name / JOBSET_NAME)
	Rank  int    // node-rank; replaced by the rank in jax-init-info.txt when WaitJaxInitInfo
	Nodes int    // nodes

	// PeerRanks is written as "peer-ranks: [a, b]"; nil writes "peer-ranks: []", as
	// single-slice Orbax does.
	PeerRanks []int
	// DataParallelism, when > 0, is written as "assume-data-parallelism: D" (real Orbax always
	// writes it, defaulting to the number of slices). VerifyRestored then accepts data written
	// by a column-mate (writer ≡ Rank mod Nodes/D), as SPEC §4 allows.
	DataParallelism int
	// BackupIntervalMinutes is written in the shortest form that round-trips, so fractional
	// minutes survive ("0.05"); zero means the client default, 30.
	BackupIntervalMinutes float64
	// ExtraYAML lines ("key: value") are appended to replicator.yaml after the standard keys.
	ExtraYAML []string

	// WaitJaxInitInfo makes Start wait for jax-init-info.txt first (SPEC §9 step 1), for three
	// times Timeout (the real client: 900 s against 300 s).
	WaitJaxInitInfo bool

	Poll    time.Duration // interval of every wait; default 1s like the real client
	Timeout time.Duration // limit of every wait; default 300s like the real client
	Content Content       // shape of the state data written per step
	Logf    func(format string, args ...any)
	// BeforeCommit, when set, runs in Save after the last file is written and before the
	// rename that commits the step, where multi-host Orbax waits on a barrier of all hosts.
	BeforeCommit func()

	// Coordinator is set by Start from jax-init-info.txt when WaitJaxInitInfo.
	Coordinator string

	errs []string // lines read from replicator.errors
}

// Errors returns the lines this client has read (and unlinked) from replicator.errors so far.
func (o *Orbax) Errors() []string { return append([]string(nil), o.errs...) }

func (o *Orbax) session() (session, error) {
	return newSession(o.Dir, o.Poll, o.Timeout, o.Logf, fmt.Sprintf("orbax %s rank %d: ", o.Job, o.Rank), &o.errs)
}

// orbaxMarkerRE is initialization._RESTORE_DIR_RE: every *.restore name must match it, or the
// client raises.
var orbaxMarkerRE = regexp.MustCompile(`^.+-s(\d+)-n\d+-w\d+\.restore$`)

var (
	stepNameRE = regexp.MustCompile(`^\d+$`)
	dataNameRE = regexp.MustCompile(`^D?[0-9a-f]{64}\.data$`)
)

// Start performs SPEC §9 start-up steps 1–6: optionally wait for jax-init-info.txt; wait for
// replicator.yaml to be absent; write replicator.yaml.tmp and rename it onto replicator.yaml;
// wait for the agent to consume it; consume replicator.errors/failed; then poll for *.restore
// markers. It returns the step the agent restored (found) or found == false when the agent
// offered nothing (an empty "-s0-" marker, which is left in place like the real client does).
// Finally it lists the step directories, reads their _CHECKPOINT_METADATA and removes leftover
// *.orbax-checkpoint-tmp directories, as the checkpoint manager's constructor does.
//
// Beyond the real client, Start fails (instead of going on with a wrong checkpoint) when the
// step-0 marker is not an empty regular file, when the chosen marker is not a symlink to a
// "<hash>.data" directory, or when the restored step has no readable _CHECKPOINT_METADATA.
func (o *Orbax) Start(ctx context.Context) (step int64, found bool, err error) {
	s, err := o.session()
	if err != nil {
		return 0, false, err
	}
	defer func() {
		if err != nil {
			err = fmt.Errorf("orbax %s rank %d: start: %w", o.Job, o.Rank, err)
		}
	}()
	if o.WaitJaxInitInfo {
		if err := o.readJaxInitInfo(ctx, s); err != nil {
			return 0, false, err
		}
	}
	if err := s.waitYAMLAbsent(ctx); err != nil {
		return 0, false, err
	}
	if err := os.WriteFile(s.path(yamlTmpName), []byte(o.YAML()), 0o644); err != nil {
		return 0, false, err
	}
	if err := os.Rename(s.path(yamlTmpName), s.path(yamlName)); err != nil {
		return 0, false, err
	}
	s.logf("wrote %s", yamlName)
	if err := s.waitYAMLAbsent(ctx); err != nil {
		return 0, false, err
	}
	if err := s.checkStatus(); err != nil {
		return 0, false, err
	}
	if step, found, err = o.processMarkers(ctx, s); err != nil {
		return 0, false, err
	}
	if err := o.initialCleanup(s, step, found); err != nil {
		return 0, false, err
	}
	return step, found, nil
}

// YAML returns the replicator.yaml content Start writes: one key per line, no trailing
// newline, in the real client's order.
func (o *Orbax) YAML() string {
	lines := []string{"job-name: " + o.Job, "framework: orbax"}
	if o.DataParallelism > 0 {
		lines = append(lines, "assume-data-parallelism: "+strconv.Itoa(o.DataParallelism))
	}
	peers := make([]string, len(o.PeerRanks))
	for i, p := range o.PeerRanks {
		peers[i] = strconv.Itoa(p)
	}
	lines = append(lines,
		"node-rank: "+strconv.Itoa(o.Rank),
		"nodes: "+strconv.Itoa(o.Nodes),
		"peer-ranks: ["+strings.Join(peers, ", ")+"]",
		"backup-interval-minutes: "+formatMinutes(o.BackupIntervalMinutes))
	for _, l := range o.ExtraYAML {
		lines = append(lines, strings.TrimSpace(l))
	}
	return strings.Join(lines, "\n")
}

// formatMinutes prints minutes in the shortest decimal form that round-trips; 0 is the default.
func formatMinutes(m float64) string {
	if m == 0 {
		m = defaultBackupInterval
	}
	return strconv.FormatFloat(m, 'f', -1, 64)
}

// readJaxInitInfo waits for jax-init-info.txt and takes the process id (the node rank) and the
// coordinator address from its first two lines.
func (o *Orbax) readJaxInitInfo(ctx context.Context, s session) error {
	var data []byte
	err := s.waitFor(ctx, 3*s.timeout, jaxInitName, func() (bool, error) {
		var err error
		data, err = os.ReadFile(s.path(jaxInitName))
		if errors.Is(err, fs.ErrNotExist) {
			return false, nil
		}
		return err == nil, err
	})
	if err != nil {
		return err
	}
	values := strings.Split(string(data), "\n")
	if len(values) < 2 || values[0] == "" || values[1] == "" {
		return fmt.Errorf("%s lacks the process id and coordinator address: %q", jaxInitName, data)
	}
	rank, err := strconv.Atoi(values[0])
	if err != nil {
		return fmt.Errorf("%s: process id %q is not a number", jaxInitName, values[0])
	}
	if rank != o.Rank {
		s.logf("%s says rank %d (configured %d); using %d", jaxInitName, rank, o.Rank, rank)
	}
	o.Rank, o.Coordinator = rank, values[1]
	return nil
}

// processMarkers is SPEC §9 step 5.
func (o *Orbax) processMarkers(ctx context.Context, s session) (step int64, found bool, err error) {
	err = s.waitFor(ctx, s.timeout, "a *.restore marker", func() (bool, error) {
		names, err := globRestore(s.dir)
		if err != nil {
			return false, err
		}
		steps := make([]int64, len(names))
		best := -1
		for i, n := range names {
			m := orbaxMarkerRE.FindStringSubmatch(n)
			if m == nil {
				return false, fmt.Errorf("unexpected restore artifact name %q: want {job_name}-s{step}-n{node_rank}-w{worker_rank}.restore", n)
			}
			if steps[i], err = strconv.ParseInt(m[1], 10, 64); err != nil {
				return false, fmt.Errorf("restore artifact %q: step: %w", n, err)
			}
			if best < 0 || steps[i] > steps[best] {
				best = i
			}
		}
		if err := s.checkStatus(); err != nil {
			return false, err
		}
		if best < 0 {
			return false, nil
		}
		step = steps[best]
		if step == 0 {
			return true, checkEmptyMarker(s.path(names[best]))
		}
		target, err := checkRestoreLink(s.path(names[best]))
		if err != nil {
			return false, err
		}
		if err := os.Rename(s.path(names[best]), s.path(strconv.FormatInt(step, 10))); err != nil {
			return false, fmt.Errorf("rename restore marker: %w", err)
		}
		s.logf("restoring step %d: renamed %s (→ %s) to %d", step, names[best], target, step)
		for i, n := range names {
			if i != best {
				if err := os.Remove(s.path(n)); err != nil && !errors.Is(err, fs.ErrNotExist) {
					return false, fmt.Errorf("unlink extra restore marker: %w", err)
				}
			}
		}
		found = true
		return true, nil
	})
	if err == nil && !found {
		s.logf("nothing to restore (step-0 marker)")
	}
	return step, found, err
}

// checkEmptyMarker insists that a step-0 marker is an empty regular file (SPEC §1).
func checkEmptyMarker(path string) error {
	fi, err := os.Lstat(path)
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() || fi.Size() != 0 {
		return fmt.Errorf("step-0 marker %s is a %v of %d bytes, want an empty regular file", filepath.Base(path), fi.Mode().Type(), fi.Size())
	}
	return nil
}

// checkRestoreLink insists that a marker of a real step is a symlink to a relative
// "<hash>.data" name that resolves to a directory (SPEC §1), and returns the target.
func checkRestoreLink(path string) (string, error) {
	target, err := os.Readlink(path)
	if err != nil {
		return "", fmt.Errorf("restore marker %s is not a symlink: %w", filepath.Base(path), err)
	}
	if !dataNameRE.MatchString(target) {
		return "", fmt.Errorf("restore marker %s points to %q, want a relative <hash>.data name", filepath.Base(path), target)
	}
	fi, err := os.Stat(path)
	if err != nil {
		return "", fmt.Errorf("restore marker %s → %s: %w", filepath.Base(path), target, err)
	}
	if !fi.IsDir() {
		return "", fmt.Errorf("restore marker %s → %s is not a directory", filepath.Base(path), target)
	}
	return target, nil
}

// listSteps returns the steps of the directory as Orbax sees them: entries named ^\d+$ that are
// directories, following symlinks.
func listSteps(dir string) ([]int64, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var steps []int64
	for _, e := range entries {
		if !stepNameRE.MatchString(e.Name()) {
			continue
		}
		fi, err := os.Stat(filepath.Join(dir, e.Name()))
		if err != nil || !fi.IsDir() {
			continue // a dangling or non-directory entry is not a step for Orbax either
		}
		n, err := strconv.ParseInt(e.Name(), 10, 64)
		if err != nil {
			continue
		}
		steps = append(steps, n)
	}
	sort.Slice(steps, func(i, j int) bool { return steps[i] < steps[j] })
	return steps, nil
}

// initialCleanup is SPEC §9 step 6: list steps, read their _CHECKPOINT_METADATA, remove leftover
// *.orbax-checkpoint-tmp directories.
func (o *Orbax) initialCleanup(s session, restored int64, found bool) error {
	steps, err := listSteps(s.dir)
	if err != nil {
		return err
	}
	s.logf("steps present: %v", steps)
	for _, st := range steps {
		name := filepath.Join(strconv.FormatInt(st, 10), checkpointMetadataName)
		data, err := os.ReadFile(s.path(name))
		if err == nil && !json.Valid(data) {
			err = errors.New("not valid JSON")
		}
		if err != nil {
			if found && st == restored {
				return fmt.Errorf("restored step: read %s: %w", name, err)
			}
			s.logf("step %d: read %s: %v", st, name, err)
		}
	}
	entries, err := os.ReadDir(s.dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if strings.HasSuffix(e.Name(), orbaxTmpSuffix) {
			s.logf("removing leftover %s", e.Name())
			if err := os.RemoveAll(s.path(e.Name())); err != nil {
				return err
			}
		}
	}
	return nil
}

// Save writes step S exactly as Orbax does (SPEC §9, "each save of step S"): check
// errors/failed; rmtree a leftover S.orbax-checkpoint-tmp; mkdir it; write
// _CHECKPOINT_METADATA; mkdir the item dirs process_metadata.orbax-checkpoint-tmp and
// state.orbax-checkpoint-tmp; write their files (temp name with O_EXCL, pwrite in chunks, fsync,
// rename); write commit_success.txt in each item dir; rename the item dirs to their final names;
// rewrite _CHECKPOINT_METADATA with the commit time; write commit_success.txt; rename
// S.orbax-checkpoint-tmp to S, which commits the step. A fresh job saves step 0 first.
func (o *Orbax) Save(ctx context.Context, step int64) (err error) {
	s, err := o.session()
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			err = fmt.Errorf("orbax %s rank %d: save step %d: %w", o.Job, o.Rank, step, err)
		}
	}()
	if err := s.checkStatus(); err != nil {
		return err
	}
	name := strconv.FormatInt(step, 10)
	tmp := s.path(name + orbaxTmpSuffix)
	if err := os.RemoveAll(tmp); err != nil {
		return err
	}
	if err := os.Mkdir(tmp, 0o755); err != nil {
		return err
	}
	l := o.layout(step, o.Rank)
	if err := writeDirect(filepath.Join(tmp, checkpointMetadataName), l.initialMetadata, false); err != nil {
		return err
	}
	for _, item := range l.items {
		itemTmp := filepath.Join(tmp, item.name+orbaxTmpSuffix)
		if err := os.Mkdir(itemTmp, 0o755); err != nil {
			return err
		}
	}
	for _, item := range l.items {
		itemTmp := filepath.Join(tmp, item.name+orbaxTmpSuffix)
		for _, f := range item.files {
			if err := ctx.Err(); err != nil {
				return err
			}
			p := filepath.Join(itemTmp, filepath.FromSlash(f.Path))
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				return err
			}
			if err := writeExclusive(p, f); err != nil {
				return err
			}
		}
	}
	for _, item := range l.items {
		itemTmp := filepath.Join(tmp, item.name+orbaxTmpSuffix)
		if err := writeDirect(filepath.Join(itemTmp, commitSuccessName), item.commit, false); err != nil {
			return err
		}
		if err := os.Rename(itemTmp, filepath.Join(tmp, item.name)); err != nil {
			return err
		}
	}
	if err := writeDirect(filepath.Join(tmp, checkpointMetadataName), l.metadata, false); err != nil {
		return err
	}
	if err := writeDirect(filepath.Join(tmp, commitSuccessName), l.commit, false); err != nil {
		return err
	}
	if o.BeforeCommit != nil {
		o.BeforeCommit()
	}
	if err := os.Rename(tmp, s.path(name)); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	s.logf("saved step %d", step)
	return nil
}

// VerifyRestored replays SPEC §9 steps 6–7 for a restored step: the step must be listed (a
// directory named ^\d+$, through the symlink), and then process_metadata/*.json,
// _CHECKPOINT_METADATA and state/... are read through the symlink — large sequential reads,
// random preads and an mmap — and every byte is compared with what Save(step) wrote. The writer
// is recognised by its per-process OCDBT directory; it must be this rank, or with
// DataParallelism a column-mate.
func (o *Orbax) VerifyRestored(ctx context.Context, step int64) (err error) {
	s, err := o.session()
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			err = fmt.Errorf("orbax %s rank %d: verify restored step %d: %w", o.Job, o.Rank, step, err)
		}
	}()
	steps, err := listSteps(s.dir)
	if err != nil {
		return err
	}
	if i := sort.Search(len(steps), func(i int) bool { return steps[i] >= step }); i == len(steps) || steps[i] != step {
		return fmt.Errorf("step %d is not among the step directories %v", step, steps)
	}
	name := strconv.FormatInt(step, 10)
	writer, err := orbaxWriterRank(s.path(name))
	if err != nil {
		return err
	}
	if !o.mayRestoreFrom(writer) {
		return fmt.Errorf("step %d holds the data of rank %d, which rank %d cannot use (nodes %d, assume-data-parallelism %d)",
			step, writer, o.Rank, o.Nodes, o.DataParallelism)
	}
	if err := verifyTree(ctx, s.path(name), name, o.layout(step, writer).tree()); err != nil {
		return err
	}
	s.logf("verified step %d (written by rank %d)", step, writer)
	return nil
}

// mayRestoreFrom reports whether this rank can use data written by writer: its own, or in
// data-parallel mode a column-mate's (SPEC §4).
func (o *Orbax) mayRestoreFrom(writer int) bool {
	if writer == o.Rank {
		return true
	}
	if o.DataParallelism <= 0 || o.Nodes <= 0 || o.Nodes%o.DataParallelism != 0 {
		return false
	}
	if o.PeerRanks != nil {
		// As Orbax: the peer-ranks are the other processes of this one's column, which may
		// not be the ranks equal to it mod P (process indices mapped to other node ranks).
		return slices.Contains(o.PeerRanks, writer)
	}
	p := o.Nodes / o.DataParallelism
	return writer%p == o.Rank%p
}

// orbaxWriterRank finds the rank that wrote a step from its "state/ocdbt.process_<rank>" dir.
func orbaxWriterRank(stepDir string) (int, error) {
	entries, err := os.ReadDir(filepath.Join(stepDir, "state"))
	if err != nil {
		return 0, err
	}
	var ranks []int
	for _, e := range entries {
		if r, ok := strings.CutPrefix(e.Name(), ocdbtProcessPrefix); ok && e.IsDir() {
			n, err := strconv.Atoi(r)
			if err != nil {
				return 0, fmt.Errorf("state/%s: not a process directory", e.Name())
			}
			ranks = append(ranks, n)
		}
	}
	if len(ranks) != 1 {
		return 0, fmt.Errorf("state/ holds %d %s* directories, want 1", len(ranks), ocdbtProcessPrefix)
	}
	return ranks[0], nil
}

// The checkpoint layout of one Orbax save.

const (
	checkpointMetadataName = "_CHECKPOINT_METADATA"
	commitSuccessName      = "commit_success.txt"
	ocdbtProcessPrefix     = "ocdbt.process_"
	devicesPerNode         = 4 // the mesh of the simulated job: 4 accelerators per node
	smallGeneratedSize     = 1536
)

type orbaxItem struct {
	name   string // final item directory name
	files  []File // relative to the item directory
	commit File   // commit_success.txt of the item
}

type orbaxLayout struct {
	initialMetadata, metadata File // _CHECKPOINT_METADATA before and after commit
	items                     []orbaxItem
	commit                    File
}

// layout builds what Save(step) writes for the given writer rank. Timestamps are derived from
// the step so that the same save always produces the same bytes.
func (o *Orbax) layout(step int64, writer int) orbaxLayout {
	c := o.Content.withDefaults()
	name := strconv.FormatInt(step, 10)
	initNs := int64(1_700_000_000_000_000_000) + step*1_000_000_000
	meta := func(commit string) []byte {
		return fmt.Appendf(nil, `{"item_handlers": {"process_metadata": "orbax.checkpoint.experimental.emergency.process_metadata_checkpoint_handler.ProcessMetadataCheckpointHandler", "state": "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"}, "metrics": {}, "performance_metrics": {}, "init_timestamp_nsecs": %d, "commit_timestamp_nsecs": %s, "custom_metadata": {}}`, initNs, commit)
	}
	commitFile := func(rel string) File {
		return fixedFile(commitSuccessName, []byte("Checkpoint commit was successful to "+rel))
	}

	// process_metadata: the device mesh, identical on every node.
	var perProcess [][]int
	var mesh []int
	for n := 0; n < max(o.Nodes, 1); n++ {
		var ids []int
		for d := 0; d < devicesPerNode; d++ {
			ids = append(ids, n*devicesPerNode+d)
		}
		perProcess = append(perProcess, ids)
		mesh = append(mesh, ids...)
	}
	pm := orbaxItem{name: "process_metadata", commit: commitFile(name + "/process_metadata"), files: []File{
		fixedFile("global_process_metadata.json", mustJSON(perProcess)),
		fixedFile("mesh_metadata.json", mustJSON(mesh)),
	}}

	// state: OCDBT layout, data files under this process's directory. Generated bytes are keyed
	// by the path relative to the step directory.
	proc := ocdbtProcessPrefix + strconv.Itoa(writer)
	gen := func(rel string, size int64) File {
		f := generatedFile(o.Job, writer, step, "state/"+rel, size)
		f.Path = rel
		return f
	}
	type leaf struct {
		File  string `json:"file"`
		Bytes int64  `json:"bytes"`
	}
	tree := map[string]leaf{}
	var data []File
	for k := 0; k < c.Files; k++ {
		id := newStream(o.Job, writer, step, "d/"+strconv.Itoa(k))
		rel := fmt.Sprintf("%s/d/%016x%016x", proc, id.word(0), id.word(1))
		data = append(data, gen(rel, c.FileSize))
		tree[fmt.Sprintf("params.layer_%d", k)] = leaf{File: rel, Bytes: c.FileSize}
	}
	state := orbaxItem{name: "state", commit: commitFile(name + "/state")}
	state.files = append([]File{
		fixedFile("_METADATA", mustJSON(map[string]any{"tree_metadata": tree, "use_zarr3": true, "use_ocdbt": true})),
		gen("manifest.ocdbt", smallGeneratedSize),
		gen(proc+"/manifest.ocdbt", smallGeneratedSize),
	}, data...)
	return orbaxLayout{
		initialMetadata: fixedFile(checkpointMetadataName, meta("null")),
		metadata:        fixedFile(checkpointMetadataName, meta(strconv.FormatInt(initNs+1_000_000_000, 10))),
		items:           []orbaxItem{pm, state},
		commit:          commitFile(name),
	}
}

// tree lists the committed step's files in the order a restore reads them: process metadata,
// checkpoint metadata, then the state item.
func (l orbaxLayout) tree() []File {
	var out []File
	add := func(prefix string, files ...File) {
		for _, f := range files {
			if prefix != "" {
				f.Path = prefix + "/" + f.Path
			}
			out = append(out, f)
		}
	}
	add("process_metadata", l.items[0].files...)
	add("process_metadata", l.items[0].commit)
	add("", l.metadata, l.commit)
	add("state", l.items[1].files...)
	add("state", l.items[1].commit)
	return out
}

// Tree lists the files of this rank's committed step, relative to the step directory: what
// Save(step) leaves and VerifyRestored(step) expects.
func (o *Orbax) Tree(step int64) []File { return o.layout(step, o.Rank).tree() }

func mustJSON(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err) // only fixed, JSON-safe values are marshalled
	}
	return b
}
