// Command clusterbench measures mtcfs's multi-node checkpoint path — replication of each sealed
// step to a peer, the restore of a replaced node from that peer, and the spool a node needs for
// it — with three agents on one machine forming a three-node job through a shared
// --backup file://DIR, one scripted Orbax client (internal/jobsim) per rank, peer-ranks set to
// the next rank and backup-interval-minutes 60 (no backup during the run). A plain Go TCP copy
// of the same number of bytes on loopback is measured in the same run as the baseline.
//
// Run it as root in bench/ (a module of its own), after building the agent (make build in the
// repository root):
//
//	go run ./clusterbench -mtcfs ../bin/mtcfs -out RESULTS.md
//
// Each repetition starts three fresh agents on fresh spools with a new job and backup
// directory, and then:
//
//  1. idle save: a client on every rank starts the job without peers (peer-ranks empty) and
//     saves step 1, timed per rank: nothing replicates anywhere.
//  2. the job restarts with peer-ranks set (every rank restores step 1 from its RAM) and saves
//     step 10 on all ranks at once, then step 20. Replication latency: from Save returning (the
//     commit rename) to the replica's <job>-sN-n<r>-w0.meta appearing in the mount of rank
//     (r+1)%3, polled with stat every 1 ms; one sample per rank and step. Files stream to the
//     peer as they are closed, so little is left to send at the commit.
//  3. save while replicating: each rank saves step 30 and, the moment it committed, step 40,
//     timed; compared with the idle save of step 1 (same size).
//  4. peak spool use: the used bytes of every node's spool are read once before step 1 (the
//     base), then with statfs every 10 ms from the restart with peers (step 1 already saved)
//     in two phases: through steps 10 and 20 until their replicas are in place, and through
//     steps 30 and 40 until step 40's replicas are in place and 500 ms more. For each phase, the
//     peak minus the base, divided by the node's checkpoint bytes (rows 3 and 3b).
//  5. replaced node: SIGKILL of rank 1's agent, its FUSE mount and spool tmpfs unmounted and the
//     spool removed, a new agent started on the same paths; then a new client on every rank
//     starts at the same moment, and rank 1's time from Start to VerifyRestored done (every byte
//     read back and compared) is taken. The other ranks restore from their RAM meanwhile.
//     Baseline: the bytes of rank 1's step ÷ the loopback TCP rate × 1.5 + 1 s.
//  6. data-parallel (dp.go): two agents, nodes 2, assume-data-parallelism 2, each the other's
//     peer (only .meta files travel); steps saved in turn; peak spool ÷ checkpoint bytes.
//  7. pair (pair.go, -pair-files 0 skips it): two agents, rank 0 saves a 1 GiB step and rank 1
//     a tiny one; rank 0's commit → its replica's .meta on rank 1.
//
// The agents run as children in their own process group. On exit, also after an error or
// Ctrl-C, each live agent gets one SIGINT; clusterbench waits for it to unmount, detaches the
// spool it keeps, unmounts whatever is left below its temporary directory (reporting it) and
// removes that directory.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/mtcfs/mtcfs/bench/internal/benchkit"
)

type config struct {
	mtcfsBin string
	out      string
	workDir  string
	reps     int
	files    int
	fileSize int64
	memory   string
	// The pair phase (pair.go).
	pairFiles    int
	pairFileSize int64
	pairMemory   string
}

func main() {
	var cfg config
	var fileMiB int
	flag.StringVar(&cfg.mtcfsBin, "mtcfs", "../bin/mtcfs", "mtcfs binary to benchmark (build it with make build in the repository root)")
	flag.StringVar(&cfg.out, "out", "", "Markdown file whose clusterbench section receives the results, e.g. RESULTS.md (default: print only)")
	flag.StringVar(&cfg.workDir, "workdir", os.TempDir(), "directory for mount points, spools and the shared backup location")
	flag.IntVar(&cfg.reps, "reps", 3, "repetitions (at least 3)")
	flag.IntVar(&cfg.files, "files", 16, "state files per step and node")
	flag.IntVar(&fileMiB, "file-mib", 16, "size of each state file in MiB")
	flag.StringVar(&cfg.memory, "memory", "2GiB", "--memory of each agent")
	var pairMiB int
	flag.IntVar(&cfg.pairFiles, "pair-files", 16, "pair phase: state files of rank 0's large step (0 skips the phase)")
	flag.IntVar(&pairMiB, "pair-file-mib", 64, "pair phase: size of each of those files in MiB")
	flag.StringVar(&cfg.pairMemory, "pair-memory", "6GiB", "pair phase: --memory of each of the two agents")
	flag.Parse()
	cfg.fileSize = int64(fileMiB) << 20
	cfg.pairFileSize = int64(pairMiB) << 20
	var invalid error
	switch {
	case cfg.reps < 3:
		invalid = errors.New("-reps must be at least 3")
	case cfg.files <= 0 || cfg.fileSize <= 0:
		invalid = errors.New("-files and -file-mib must be positive")
	}
	benchkit.Main("clusterbench", invalid, func(ctx context.Context) error { return run(ctx, cfg) })
}

// bench owns everything a run sets up.
type bench struct {
	cfg   config
	bin   string
	runID string
	base  string // the run's temporary directory; each phase works in one of its own below it
	res   *results
}

func run(ctx context.Context, cfg config) (err error) {
	if err := benchkit.RequireRoot("the agents mount FUSE and their spool tmpfs"); err != nil {
		return err
	}
	bin, err := benchkit.AgentBinary(cfg.mtcfsBin)
	if err != nil {
		return err
	}
	ws := &benchkit.Workspace{}
	defer func() { err = errors.Join(err, ws.Close()) }()
	b := &bench{cfg: cfg, bin: bin, runID: time.Now().UTC().Format("150405"), res: &results{}}
	if b.base, err = ws.TempDir(cfg.workDir, "clusterbench-"); err != nil {
		return err
	}

	env := benchkit.DescribeEnvironment("clusterbench", bin)
	cpu := benchkit.StartCPUAccount()
	for rep := range cfg.reps {
		fmt.Fprintf(os.Stderr, "clusterbench: repetition %d of %d\n", rep+1, cfg.reps)
		if err := b.phase(fmt.Sprintf("rep%d", rep+1), func(ws *benchkit.Workspace, dir string) error {
			return b.repetition(ctx, ws, dir, rep)
		}); err != nil {
			return fmt.Errorf("repetition %d: %w", rep+1, err)
		}
		if err := b.phase(fmt.Sprintf("rep%d-dp", rep+1), func(ws *benchkit.Workspace, dir string) error {
			return b.dpPhase(ctx, ws, dir, rep)
		}); err != nil {
			return fmt.Errorf("repetition %d, data-parallel phase: %w", rep+1, err)
		}
		if cfg.pairFiles > 0 {
			if err := b.phase(fmt.Sprintf("rep%d-pair", rep+1), func(ws *benchkit.Workspace, dir string) error {
				return b.pairPhase(ctx, ws, dir, rep)
			}); err != nil {
				return fmt.Errorf("repetition %d, pair phase: %w", rep+1, err)
			}
		}
	}
	env.CPU = cpu.OthersSummary(benchkit.CPUWording{
		Span: "the run",
		Us:   "clusterbench (clients, TCP copy) and the agents",
	})
	return resultsSection.Publish(cfg.out, renderSection(cfg, env, b.res))
}
