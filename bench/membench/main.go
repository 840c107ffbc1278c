// Command membench measures the agent's own memory per file: an agent serves a step of N small
// files written through its mount, and its resident memory (VmRSS) and Go heap in use
// (go_memstats_heap_inuse_bytes on /metrics) are read before the files exist, once they are
// written, and once the step is committed and sealed. The checkpoint bytes themselves live in the
// tmpfs spool and are not counted by either.
//
// Run it as root in bench/ (a module of its own), after make build in the repository root:
//
//	go run ./membench -mtcfs ../bin/mtcfs -out RESULTS.md
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/mtcfs/mtcfs/bench/internal/benchkit"
)

var section = benchkit.Section{Name: "membench", Note: "written by go run ./membench"}

func main() {
	bin := flag.String("mtcfs", "../bin/mtcfs", "the mtcfs binary (make build in the repository root)")
	counts := flag.String("files", "10000,100000", "comma-separated numbers of files per run")
	size := flag.Int("size", 4096, "bytes per file")
	out := flag.String("out", "", "update this results file (e.g. RESULTS.md)")
	flag.Parse()
	benchkit.Main("membench", nil, func(ctx context.Context) error { return run(ctx, *bin, *counts, *size, *out) })
}

type sample struct {
	files       int
	rss, heap   [3]int64 // before, written, sealed
	write, seal time.Duration
	rename      time.Duration // the commit rename itself (the commit is recorded before it returns)
	perFileRSS  float64       // sealed − before, per file
	perFileHeap float64
}

func run(ctx context.Context, binPath, counts string, size int, out string) error {
	bin, err := benchkit.AgentBinary(binPath)
	if err != nil {
		return err
	}
	env := benchkit.DescribeEnvironment("membench", bin)
	cpu := benchkit.StartCPUAccount()
	var samples []sample
	for _, c := range strings.Split(counts, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(c))
		if err != nil || n <= 0 {
			return fmt.Errorf("-files: %q is not a positive number", c)
		}
		s, err := measure(ctx, bin, n, size)
		if err != nil {
			return err
		}
		samples = append(samples, s)
		fmt.Printf("%d files: RSS %s → %s → %s, heap %s → %s → %s, write %v, seal %v\n", n,
			benchkit.FormatBytes(s.rss[0]), benchkit.FormatBytes(s.rss[1]), benchkit.FormatBytes(s.rss[2]),
			benchkit.FormatBytes(s.heap[0]), benchkit.FormatBytes(s.heap[1]), benchkit.FormatBytes(s.heap[2]), s.write.Round(time.Millisecond), s.seal.Round(time.Millisecond))
		fmt.Printf("  commit rename took %v\n", s.rename.Round(time.Millisecond))
	}
	env.CPU = cpu.OthersSummary(benchkit.CPUWording{Span: "the run", Us: "membench and the agents"})
	var b strings.Builder
	fmt.Fprintf(&b, "%s\n## The agent's own memory per file (membench): %s\n\n", section.Begin(), env.Date.Format("2006-01-02 15:04 MST"))
	fmt.Fprintf(&b, "- Command (as root, in bench/): `%s`\n- mtcfs: %s\n- Machine: %s\n- CPU competition: %s.\n\n", env.Command, env.MTCFS, env.Machine, env.CPU)
	fmt.Fprintf(&b, "An agent serves one step of N files of %d bytes written through the mount (100 directories), then the step is committed and sealed. RSS is the agent's VmRSS; heap is `go_memstats_heap_inuse_bytes`. The files' bytes live in the tmpfs spool and are in neither.\n\n", size)
	b.WriteString("| files | RSS before | RSS written | RSS sealed | heap before | heap written | heap sealed | RSS per file | heap per file | write | commit rename | commit → .meta |\n|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n")
	for _, s := range samples {
		fmt.Fprintf(&b, "| %d | %s | %s | %s | %s | %s | %s | %.0f B | %.0f B | %v | %v | %v |\n", s.files,
			benchkit.FormatBytes(s.rss[0]), benchkit.FormatBytes(s.rss[1]), benchkit.FormatBytes(s.rss[2]),
			benchkit.FormatBytes(s.heap[0]), benchkit.FormatBytes(s.heap[1]), benchkit.FormatBytes(s.heap[2]),
			s.perFileRSS, s.perFileHeap, s.write.Round(time.Millisecond), s.rename.Round(time.Millisecond), s.seal.Round(time.Millisecond))
	}
	b.WriteString("\nPer file = (sealed − before) ÷ files. The sealed step keeps every file's node (name, attributes, spool link) in the agent's inode tree for as long as the step is held.\n")
	b.WriteString(section.End() + "\n")
	fmt.Println()
	return section.Publish(out, b.String())
}

func measure(ctx context.Context, bin string, n, size int) (s sample, err error) {
	s = sample{files: n}
	ws := &benchkit.Workspace{}
	defer func() { err = errors.Join(err, ws.Close()) }()
	base, err := ws.TempDir("", "mtcfs-membench")
	if err != nil {
		return s, err
	}
	dir := filepath.Join(base, "mnt")
	a, err := ws.StartAgent(ctx, benchkit.AgentConfig{Bin: bin, Dir: dir, Spool: filepath.Join(base, "spool"),
		Flags:      []string{"--memory", "4GiB", "--http", "127.0.0.1:0", "--backup", "file://" + filepath.Join(base, "backup")},
		KeepsSpool: true}) // it holds the sealed step when stopped
	if err != nil {
		return s, err
	}
	read := func(i int) error {
		time.Sleep(2 * time.Second) // let background hashing and GC settle
		var err error
		if s.rss[i], err = vmRSS(a.Pid()); err != nil {
			return err
		}
		m, err := a.Metrics()
		if err != nil {
			return err
		}
		heap := m.Value("go_memstats_heap_inuse_bytes")
		if math.IsNaN(heap) {
			return errors.New("no go_memstats_heap_inuse_bytes on /metrics")
		}
		s.heap[i] = int64(heap)
		return nil
	}
	yaml := "job-name: mem\nframework: orbax\nnode-rank: 0\nnodes: 1\npeer-ranks: []\nbackup-interval-minutes: 600\n"
	if err := os.WriteFile(filepath.Join(dir, "replicator.yaml"), []byte(yaml), 0o644); err != nil {
		return s, err
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if _, err := os.Stat(filepath.Join(dir, "mem-s0-n0-w0.restore")); err == nil {
			break
		}
		if time.Now().After(deadline) {
			return s, fmt.Errorf("the agent did not answer replicator.yaml")
		}
	}
	if err := read(0); err != nil {
		return s, err
	}
	tmp := filepath.Join(dir, "1.orbax-checkpoint-tmp")
	buf := make([]byte, size)
	start := time.Now()
	for i := range n {
		d := filepath.Join(tmp, fmt.Sprintf("d%02d", i%100))
		if i < 100 {
			if err := os.MkdirAll(d, 0o755); err != nil {
				return s, err
			}
		}
		buf[0] = byte(i)
		if err := os.WriteFile(filepath.Join(d, fmt.Sprintf("f%07d", i)), buf, 0o644); err != nil {
			return s, err
		}
	}
	s.write = time.Since(start)
	if err := read(1); err != nil {
		return s, err
	}
	start = time.Now()
	if err := os.Rename(tmp, filepath.Join(dir, "1")); err != nil {
		return s, err
	}
	s.rename = time.Since(start)
	for deadline := time.Now().Add(5 * time.Minute); ; time.Sleep(5 * time.Millisecond) {
		if _, err := os.Stat(filepath.Join(dir, "mem-s1-n0-w0.meta")); err == nil {
			break
		}
		if time.Now().After(deadline) {
			return s, fmt.Errorf("step 1 not sealed within 5 minutes")
		}
	}
	s.seal = time.Since(start)
	if err := read(2); err != nil {
		return s, err
	}
	s.perFileRSS = float64(s.rss[2]-s.rss[0]) / float64(n)
	s.perFileHeap = float64(s.heap[2]-s.heap[0]) / float64(n)
	return s, nil
}

// vmRSS reads a process's resident set size.
func vmRSS(pid int) (int64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return kb << 10, err
		}
	}
	return 0, fmt.Errorf("no VmRSS for pid %d", pid)
}
