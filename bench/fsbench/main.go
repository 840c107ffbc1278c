// Command fsbench measures mtcfs against plain tmpfs, side by side in one run.
//
// Run it as root in bench/ (a module of its own), after building the agent (make build in the
// repository root):
//
//	go run ./fsbench -mtcfs ../bin/mtcfs -out RESULTS.md
//
// (make bench runs the same.) With -before OLD, an agent of the binary OLD (--passthrough on)
// is one more target of every round, and a before/after table compares it with the passthrough
// agent of -mtcfs. It mounts its targets under a temporary directory: a dedicated
// tmpfs (size=4g), an mtcfs agent with --passthrough on and one with --passthrough off, each
// agent with its own spool, and two references (anchor.go; -no-anchor skips them): a FUSE anchor,
// go-fuse's own loopback example server over a tmpfs of its own, which runs the metadata and
// small-file workloads; and the go-fuse floor, bench/fuseanchor with mtcfs's mount settings and
// no passthrough, as a loopback of a tmpfs for the sequential workloads and as a tree that
// stores no file bytes for the others. For the mtcfs targets the create workload also reports the FUSE requests per
// create+close, from the agents' mtcfs_fuse_requests_total. Every workload runs -warmup unrecorded rounds and then -reps
// measured rounds; a round visits every target, in an order rotated from round to round, so
// that drift of the machine (a VM's slow first touch of memory, a noisy neighbour) hits all
// targets alike. The medians are compared with mtcfs's targets, printed, and written to the
// generated section of -out.
//
// The I/O is done by this process with plain system calls and 1 MiB buffers; nothing is dropped
// from the page cache between steps, because what the kernel caches is part of what users get.
//
// On exit, also after an error or Ctrl-C, each agent is stopped with one SIGINT (they run in
// their own process group, so a terminal's Ctrl-C does not send them a second one, which would
// make mtcfs skip its unmount) and fsbench checks /proc/mounts that nothing it mounted stays
// mounted, detaching lazily as a last resort.
package main

import (
	"context"
	"errors"
	"flag"
	"os"
	"time"

	"github.com/mtcfs/mtcfs/bench/internal/benchkit"
)

// config is what the flags select.
type config struct {
	mtcfsBin   string
	out        string
	workDir    string
	reps       int
	warmup     int
	fileSize   int64         // bytes of the sequential file
	creates    int           // files of the create and stat-distinct workloads
	smallFiles int           // files of the many-small-files workload
	smallSize  int           // bytes of each small file
	statFor    time.Duration // how long the cached-stat loop runs per sample
	cacheWait  time.Duration // wait for mtcfs's entry and attribute cache to expire
	workloads  string        // comma-separated names; "" runs all
	noAnchor   bool          // skip the FUSE anchor and the go-fuse floor
	// beforeBin, when set, is an older mtcfs binary run as one more passthrough target in the
	// same rounds (beforeLabel, afterLabel: what the before/after table calls the two builds).
	beforeBin, beforeLabel, afterLabel string
}

func main() {
	var cfg config
	var fileMiB, smallKiB int
	flag.StringVar(&cfg.mtcfsBin, "mtcfs", "../bin/mtcfs", "mtcfs binary to benchmark (build it with make build in the repository root)")
	flag.StringVar(&cfg.out, "out", "", "Markdown file whose generated section receives the results, e.g. RESULTS.md (default: print only)")
	flag.StringVar(&cfg.workDir, "workdir", os.TempDir(), "directory for the temporary mount points and spools")
	flag.IntVar(&cfg.reps, "reps", 5, "measured rounds per workload (medians are reported; at least 3)")
	flag.IntVar(&cfg.warmup, "warmup", 1, "unrecorded warm-up rounds per workload")
	flag.IntVar(&fileMiB, "file-mib", 1024, "size of the sequential file in MiB")
	flag.IntVar(&cfg.creates, "creates", 2000, "files created (and then stat'ed) per round")
	flag.IntVar(&cfg.smallFiles, "small-files", 10000, "files of the many-small-files workload")
	flag.IntVar(&smallKiB, "small-kib", 64, "size of each small file in KiB (at most 1024)")
	flag.DurationVar(&cfg.statFor, "stat-for", time.Second, "duration of the cached-stat loop per round and target")
	flag.DurationVar(&cfg.cacheWait, "cache-wait", 5500*time.Millisecond, "wait before the cold stat pass; longer than mtcfs's kernel cache timeout (5s)")
	flag.StringVar(&cfg.workloads, "workloads", "", "comma-separated subset of sequential,create,stat,small to run (default: all)")
	flag.StringVar(&cfg.beforeBin, "before", "", "an older mtcfs binary, run with --passthrough on as one more target in the same rounds, for a before/after table")
	flag.StringVar(&cfg.beforeLabel, "before-label", "before", "what to call -before in the before/after table")
	flag.StringVar(&cfg.afterLabel, "label", "after", "what to call -mtcfs in the before/after table")
	flag.BoolVar(&cfg.noAnchor, "no-anchor", false, "do not run the FUSE anchor and the go-fuse floor (go-fuse's loopback example server and bench/fuseanchor, built with the go command)")
	flag.Parse()
	cfg.fileSize = int64(fileMiB) << 20
	cfg.smallSize = smallKiB << 10
	benchkit.Main("fsbench", cfg.validate(), func(ctx context.Context) error { return run(ctx, cfg) })
}

func (c config) validate() error {
	switch {
	case c.reps < 3:
		return errors.New("-reps must be at least 3 for a meaningful median")
	case c.warmup < 0:
		return errors.New("-warmup must not be negative")
	case c.fileSize <= 0 || c.creates <= 0 || c.smallFiles <= 0:
		return errors.New("-file-mib, -creates and -small-files must be positive")
	case c.smallSize <= 0 || c.smallSize > ioBufSize:
		return errors.New("-small-kib must be between 1 and 1024")
	}
	return nil
}

func run(ctx context.Context, cfg config) (err error) {
	if err := benchkit.RequireRoot("fsbench mounts a tmpfs, and mtcfs --passthrough on needs CAP_SYS_ADMIN"); err != nil {
		return err
	}
	bin, err := benchkit.AgentBinary(cfg.mtcfsBin)
	if err != nil {
		return err
	}
	b := newBench(cfg)
	workloads, err := selectWorkloads(b.workloads(), cfg.workloads)
	if err != nil {
		return err
	}
	env := benchkit.DescribeEnvironment("fsbench", bin)
	var before, beforeDesc string
	if cfg.beforeBin != "" {
		if before, err = benchkit.AgentBinary(cfg.beforeBin); err != nil {
			return err
		}
		// Its path and build time only: the working tree says nothing of an older build.
		beforeDesc = "`" + before + "`"
		if fi, err := os.Stat(before); err == nil {
			beforeDesc += ", built " + fi.ModTime().UTC().Format("2006-01-02 15:04 MST")
		}
	}
	cpu := benchkit.StartCPUAccount()
	targets, err := setUpTargets(ctx, bin, before, cfg.workDir, cfg.noAnchor)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, targets.ws.Close()) }()

	res := newResults()
	if err := runWorkloads(ctx, workloads, targets.list, cfg, res); err != nil {
		return err
	}
	env.CPU = cpu.OthersSummary(benchkit.CPUWording{Span: "measurement", Us: "fsbench and the agents"}, append(targets.agents, targets.servers...)...)
	return resultsSection.Publish(cfg.out, renderSection(cfg, env, beforeDesc, res))
}
