// Command replbench measures mtcfs's checkpoint path — the replicator.yaml handshake, sealing a
// committed step, and backing it up — side by side with what the machine does without mtcfs,
// in one run.
//
// Run it as root in bench/ (a module of its own), after building the agent (make build in the
// repository root):
//
//	go run ./replbench -mtcfs ../bin/mtcfs -out RESULTS.md
//
// It takes one to two minutes on 2 CPUs and needs about 6 GiB of free RAM and 2 GiB of free disk
// where -workdir lives (backups and copies go there). Without -out it only prints.
//
// What it measures (medians over -reps repetitions after -warmup unrecorded ones):
//
//  1. yaml consumed latency: Orbax's start-up handshake. Write replicator.yaml.tmp, rename it
//     onto replicator.yaml, and poll fstatat every 100 µs until replicator.yaml is absent;
//     timed from the rename returning. Each repetition is a new job name, i.e. a new
//     incarnation, and waits for its .restore marker before the next. Target: ≤ 100 ms.
//  2. commit-to-sealed of a step of -files × -file-mib (default 16 × 64 MiB = 1 GiB): the
//     files are written through the mount as N.orbax-checkpoint-tmp/state/shard_XX (1 MiB
//     writes, fsync, close), left closed for -settle, then N.orbax-checkpoint-tmp is renamed
//     to N and the time until <job>-sN-n0-w0.meta exists is taken (poll every 0.5 ms).
//     Beside it, in alternating order, the same tree is read once from a plain tmpfs
//     directory under /dev/shm (1 MiB reads, warm). Every step has a new number and new
//     content. Target: commit-to-sealed ≤ 1.2 × the read.
//  3. backup of that step to a local directory: a fresh agent with
//     --backup file://<workdir>/…/backups and a new job with backup-interval-steps: 1 commits
//     its first step, and the time from the rename until the backup's .meta (written last) is
//     in the backup directory is taken, subtracting nothing (sealing included). A fresh agent
//     per repetition because an agent takes at most one backup per UTC minute. Beside it, in
//     rotating order: cp -r of the same tree from /dev/shm to the same disk, and cp -r followed
//     by sync(1) of every file and directory it created (the backup store fsyncs each object).
//     Everything dirty is synced, untimed, before each of them. Target: backup throughput
//     ≥ 0.8 × cp -r.
//
// The agents run as children in their own process group. On exit, also after an error or
// Ctrl-C, each gets one SIGINT; replbench waits for it to unmount, detaches the spool tmpfs it
// keeps when it holds checkpoints (umount -l), checks /proc/mounts that nothing it mounted stays
// mounted, and removes its temporary directories.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/mtcfs/mtcfs/bench/internal/benchkit"
)

type config struct {
	mtcfsBin string
	out      string
	workDir  string // temporary mount points, spools, backups and copies (on disk)
	shmDir   string // the source tree's plain tmpfs
	reps     int
	yamlReps int
	warmup   int
	files    int
	fileSize int64
	settle   time.Duration
	memory   string
	items    string
}

func main() {
	var cfg config
	var fileMiB int
	flag.StringVar(&cfg.mtcfsBin, "mtcfs", "../bin/mtcfs", "mtcfs binary to benchmark (build it with make build in the repository root)")
	flag.StringVar(&cfg.out, "out", "", "Markdown file whose replbench section receives the results, e.g. RESULTS.md (default: print only)")
	flag.StringVar(&cfg.workDir, "workdir", os.TempDir(), "directory (on disk) for mount points, spools, backups and cp -r copies")
	flag.StringVar(&cfg.shmDir, "shm", "/dev/shm", "plain tmpfs holding the source tree (the read baseline and cp -r's source)")
	flag.IntVar(&cfg.reps, "reps", 5, "measured repetitions of the seal and backup items (at least 5)")
	flag.IntVar(&cfg.yamlReps, "yaml-reps", 30, "measured repetitions of the yaml handshake (at least 5)")
	flag.IntVar(&cfg.warmup, "warmup", 1, "unrecorded warm-up repetitions per item")
	flag.IntVar(&cfg.files, "files", 16, "files in the checkpoint step")
	flag.IntVar(&fileMiB, "file-mib", 64, "size of each file in MiB")
	flag.DurationVar(&cfg.settle, "settle", time.Second, "how long the step's files stay closed before the commit")
	flag.StringVar(&cfg.memory, "memory", "8GiB", "--memory of the agents")
	flag.StringVar(&cfg.items, "items", "yaml,seal,backup", "comma-separated subset of yaml,seal,backup to run")
	flag.Parse()
	cfg.fileSize = int64(fileMiB) << 20
	benchkit.Main("replbench", cfg.validate(), func(ctx context.Context) error { return run(ctx, cfg) })
}

func (c config) validate() error {
	switch {
	case c.reps < 5 || c.yamlReps < 5:
		return errors.New("-reps and -yaml-reps must be at least 5")
	case c.warmup < 0:
		return errors.New("-warmup must not be negative")
	case c.files <= 0 || c.fileSize <= 0:
		return errors.New("-files and -file-mib must be positive")
	}
	for _, it := range strings.Split(c.items, ",") {
		if !slices.Contains([]string{"yaml", "seal", "backup"}, it) {
			return fmt.Errorf("-items: unknown item %q (want yaml, seal, backup)", it)
		}
	}
	return nil
}

func (c config) runs(item string) bool { return slices.Contains(strings.Split(c.items, ","), item) }

// bench owns everything a run sets up.
type bench struct {
	cfg        config
	bin        string
	runID      string              // distinguishes job names of this run
	ws         *benchkit.Workspace // the agents and temporary directories
	base       string              // temporary directory under workDir
	shm        string              // temporary directory under shmDir
	backupRoot string              // the backup agents' file:// location
	tree       *tree
	res        *benchkit.Samples
}

func run(ctx context.Context, cfg config) (err error) {
	if err := benchkit.RequireRoot("the agents mount FUSE and their spool tmpfs"); err != nil {
		return err
	}
	bin, err := benchkit.AgentBinary(cfg.mtcfsBin)
	if err != nil {
		return err
	}
	b := &bench{cfg: cfg, bin: bin, runID: time.Now().UTC().Format("150405"), ws: &benchkit.Workspace{}, res: &benchkit.Samples{}}
	defer func() { err = errors.Join(err, b.ws.Close()) }()
	if b.base, err = b.ws.TempDir(cfg.workDir, "replbench-"); err != nil {
		return err
	}
	if b.shm, err = b.ws.TempDir(cfg.shmDir, "replbench-"); err != nil {
		return err
	}
	b.backupRoot = filepath.Join(b.base, "backups")

	env := describeEnvironment(bin, cfg.workDir, cfg.shmDir)
	cpu := benchkit.StartCPUAccount()
	fmt.Fprintf(os.Stderr, "replbench: writing the %s source tree to %s\n", benchkit.FormatBytes(int64(cfg.files)*cfg.fileSize), b.shm)
	if b.tree, err = newTree(b.shm, cfg.files, cfg.fileSize); err != nil {
		return fmt.Errorf("source tree: %w", err)
	}
	if err := b.measure(ctx); err != nil {
		return err
	}
	if err := b.ws.Close(); err != nil { // stop every agent before accounting for their CPU
		return err
	}
	env.CPU = cpu.OthersSummary(benchkit.CPUWording{
		Span: "the run",
		Us:   "replbench, the agents, cp and sync",
		Note: "; kernel work for our I/O, such as writeback, counts here",
	})
	return resultsSection.Publish(cfg.out, renderSection(cfg, env, b.res, b.tree.total()))
}

func (b *bench) measure(ctx context.Context) error {
	if b.cfg.runs("yaml") || b.cfg.runs("seal") {
		a, err := b.startAgent(ctx, "ram", filepath.Join(b.base, "backups-ram"))
		if err != nil {
			return err
		}
		if b.cfg.runs("yaml") {
			fmt.Fprintf(os.Stderr, "replbench: 1. yaml handshake, %d+%d repetitions\n", b.cfg.warmup, b.cfg.yamlReps)
			if err := b.measureYAML(ctx, a); err != nil {
				return err
			}
		}
		if b.cfg.runs("seal") {
			fmt.Fprintf(os.Stderr, "replbench: 2. commit-to-sealed vs one tmpfs read, %d+%d repetitions\n", b.cfg.warmup, b.cfg.reps)
			if err := b.measureSeal(ctx, a); err != nil {
				return err
			}
		}
		if err := a.Stop(); err != nil {
			return err
		}
	}
	if b.cfg.runs("backup") {
		fmt.Fprintf(os.Stderr, "replbench: 3. backup vs cp -r, %d+%d repetitions\n", b.cfg.warmup, b.cfg.reps)
		if err := b.measureBackup(ctx); err != nil {
			return err
		}
	}
	return nil
}

// progress prints one repetition's figures to stderr.
func (b *bench) progress(what string, rep int, v float64, unit string) {
	tag := fmt.Sprintf("rep %d", rep+1)
	if rep < 0 {
		tag = "warm-up"
	}
	if unit != "" {
		what = fmt.Sprintf("%s %.2f %s", what, v, unit)
	}
	fmt.Fprintf(os.Stderr, "replbench:   %s: %s\n", tag, what)
}
