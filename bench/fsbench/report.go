package main

import (
	"bufio"
	"debug/buildinfo"
	"errors"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// metric describes one row of the report. A limit is the ratio mtcfs÷tmpfs of the medians that
// mtcfs promises: a floor for throughput, a ceiling for latency; 0 means no promise.
type metric struct {
	key, title, unit string
	lowerIsBetter    bool
	passthroughLimit float64
	fallbackLimit    float64
}

func metrics(cfg config) []metric {
	file := formatBytes(cfg.fileSize)
	n := strconv.Itoa(cfg.creates)
	small := fmt.Sprintf("%d × %s", cfg.smallFiles, formatBytes(int64(cfg.smallSize)))
	const pt, fb, create, stat = 0.95, 0.8, 5, 1.5
	return []metric{
		{seqWriteNew, "Sequential write, new " + file + " file", "GB/s", false, pt, fb},
		{seqOverwrite, "Sequential overwrite in place, " + file, "GB/s", false, pt, fb},
		{seqReadFirst, "Sequential read, first after write, " + file, "GB/s", false, pt, fb},
		{seqReread, "Sequential re-read, " + file, "GB/s", false, pt, fb},
		{createMedian, "Create+close empty file, median of " + n, "µs", true, create, create},
		{createP99, "Create+close empty file, p99 of " + n, "µs", true, 0, 0},
		{statCached, "stat same file (cached), median", "µs", true, stat, stat},
		{statNewMedian, "stat " + n + " distinct files after creating them, median", "µs", true, 0, 0},
		{statNewP99, "stat " + n + " distinct files after creating them, p99", "µs", true, 0, 0},
		{statColdMedian, "stat " + n + " distinct files after " + cfg.cacheWait.String() + " (cache expired), median", "µs", true, 0, 0},
		{statColdP99, "stat " + n + " distinct files after " + cfg.cacheWait.String() + " (cache expired), p99", "µs", true, 0, 0},
		{smallWriteFiles, "Small files write " + small, "files/s", false, 0, 0},
		{smallWriteMBps, "Small files write " + small, "MB/s", false, 0, 0},
		{smallReadFiles, "Small files read back " + small, "files/s", false, 0, 0},
		{smallReadMBps, "Small files read back " + small, "MB/s", false, 0, 0},
	}
}

// results holds the recorded samples: metric key → target name → one value per round.
type results struct {
	samples map[string]map[string][]float64
}

func newResults() *results { return &results{samples: map[string]map[string][]float64{}} }

func (r *results) add(metric, target string, v float64) {
	if r.samples[metric] == nil {
		r.samples[metric] = map[string][]float64{}
	}
	r.samples[metric][target] = append(r.samples[metric][target], v)
}

func (r *results) median(metric, target string) float64 { return median(r.samples[metric][target]) }

// measured keeps the metrics that have samples (-workloads may have skipped some).
func (r *results) measured(ms []metric) []metric {
	return slices.DeleteFunc(ms, func(m metric) bool { return len(r.samples[m.key]) == 0 })
}

// median of xs; NaN for none.
func median(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := slices.Sorted(slices.Values(xs))
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// percentile by nearest rank: the smallest value with at least q of the samples at or below it.
func percentile(xs []float64, q float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := slices.Sorted(slices.Values(xs))
	i := int(float64(len(s))*q+0.999999) - 1
	return s[max(0, min(i, len(s)-1))]
}

// environment is what a reader needs to judge the numbers: when, how, on what.
type environment struct {
	date    time.Time
	command string
	mtcfs   string
	machine string
	cpu     string // who else used the CPUs during the run
}

func describeEnvironment(bin string) environment {
	return environment{
		date:    time.Now().UTC(),
		command: commandLine(),
		mtcfs:   describeBinary(bin),
		machine: describeMachine(),
	}
}

// commandLine reconstructs how fsbench was invoked; under go run, os.Args[0] is a temporary
// build, so the package path is shown instead.
func commandLine() string {
	prog := os.Args[0]
	if strings.Contains(prog, "go-build") {
		prog = "go run ./bench/fsbench"
	}
	parts := []string{prog}
	for _, a := range os.Args[1:] {
		parts = append(parts, shellQuote(a))
	}
	return strings.Join(parts, " ")
}

func shellQuote(s string) string {
	if s != "" && !strings.ContainsAny(s, " \t\n'\"\\$`*?[]{}()<>|&;#~!") {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// describeBinary names the mtcfs build: path, modification time, Go version and VCS stamp.
func describeBinary(bin string) string {
	desc := "`" + relativeToWorkdir(bin) + "`"
	if fi, err := os.Stat(bin); err == nil {
		desc += ", built " + fi.ModTime().UTC().Format("2006-01-02 15:04 MST")
	}
	info, err := buildinfo.ReadFile(bin)
	if err != nil {
		return desc
	}
	desc += " with " + info.GoVersion
	var rev, modified string
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			modified = s.Value
		}
	}
	if rev != "" {
		desc += " from commit " + rev[:min(len(rev), 12)]
		if modified == "true" {
			desc += " plus uncommitted changes"
		}
		return desc
	}
	// Built without a VCS stamp (-buildvcs=false): the working tree is the best guess.
	if out, err := exec.Command("git", "rev-parse", "--short=12", "HEAD").Output(); err == nil {
		desc += "; working tree at commit " + strings.TrimSpace(string(out))
		if st, err := exec.Command("git", "status", "--porcelain").Output(); err == nil && len(st) > 0 {
			desc += " plus uncommitted changes"
		}
	}
	return desc
}

func relativeToWorkdir(p string) string {
	if wd, err := os.Getwd(); err == nil {
		if r, err := filepath.Rel(wd, p); err == nil && !strings.HasPrefix(r, "..") {
			return r
		}
	}
	return p
}

// describeMachine reads CPU, memory and kernel at run time.
func describeMachine() string {
	cpu, virtual := "unknown CPU", false
	if f, err := os.Open("/proc/cpuinfo"); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			k, v, ok := strings.Cut(sc.Text(), ":")
			switch k = strings.TrimSpace(k); {
			case !ok:
			case k == "model name" && cpu == "unknown CPU":
				cpu = strings.TrimSpace(v)
			case k == "flags" && slices.Contains(strings.Fields(v), "hypervisor"):
				virtual = true
			}
		}
		f.Close()
	}
	if virtual {
		cpu += " (virtual machine)"
	}
	mem := "unknown RAM"
	if data, err := os.ReadFile("/proc/meminfo"); err == nil {
		for _, line := range strings.Split(string(data), "\n") {
			if f := strings.Fields(line); len(f) >= 2 && f[0] == "MemTotal:" {
				if kb, err := strconv.ParseInt(f[1], 10, 64); err == nil {
					mem = formatBytes(kb<<10) + " RAM"
				}
			}
		}
	}
	kernel := "unknown kernel"
	var u unix.Utsname
	if unix.Uname(&u) == nil {
		kernel = "Linux " + unix.ByteSliceToString(u.Release[:]) + " " + unix.ByteSliceToString(u.Machine[:])
	}
	return fmt.Sprintf("%s, %d CPUs, %s, %s; fsbench built with %s", cpu, runtime.NumCPU(), mem, kernel, runtime.Version())
}

// Markers delimit the part of the results file that fsbench owns.
const (
	sectionBegin = "<!-- fsbench:begin — generated by bench/fsbench; a new run replaces everything down to the end marker -->"
	sectionEnd   = "<!-- fsbench:end -->"
)

// renderSection formats the run as Markdown, between the section markers.
func renderSection(cfg config, env environment, res *results) string {
	var b strings.Builder
	w := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	w("%s\n## Latest run: %s\n\n", sectionBegin, env.date.Format("2006-01-02 15:04 MST"))
	w("- Command (as root, from the module root): `%s`\n", env.command)
	w("- mtcfs: %s; agents run with `--memory %s`, baseline tmpfs mounted with `size=%s`\n", env.mtcfs, agentMemory, tmpfsSize)
	w("- Machine: %s\n", env.machine)
	w("- CPU competition: %s.\n", env.cpu)
	w("- Method: per workload %d warm-up and %d measured rounds; each round runs all three targets, "+
		"the first target rotating from round to round; every figure is the median over the measured rounds. "+
		"Ratios are mtcfs ÷ tmpfs for throughput and latency alike (throughput: higher is better; latency: lower is better).\n\n",
		cfg.warmup, cfg.reps)

	w("| Metric | Unit | tmpfs | passthrough | ÷ tmpfs | target | fallback | ÷ tmpfs | target |\n")
	w("|---|---|--:|--:|--:|---|--:|--:|---|\n")
	met, total := 0, 0
	for _, m := range res.measured(metrics(cfg)) {
		base := res.median(m.key, tmpfsTarget)
		w("| %s | %s | %s", m.title, m.unit, formatValue(base))
		for _, side := range []struct {
			target string
			limit  float64
		}{{passthroughTarget, m.passthroughLimit}, {fallbackTarget, m.fallbackLimit}} {
			v := res.median(m.key, side.target)
			ratio := v / base
			verdict := "—"
			if side.limit > 0 {
				total++
				ok := ratio >= side.limit
				op := "≥"
				if m.lowerIsBetter {
					ok, op = ratio <= side.limit, "≤"
				}
				verdict = fmt.Sprintf("%s %g×: **NOT met**", op, side.limit)
				if ok {
					met++
					verdict = fmt.Sprintf("%s %g×: met", op, side.limit)
				}
			}
			w(" | %s | %.2f× | %s", formatValue(v), ratio, verdict)
		}
		w(" |\n")
	}
	w("\nTargets met: %d of %d.\n\n", met, total)

	w("How to read these numbers:\n\n")
	w("- Throughput is timed from open to close (close included); GB/s and MB/s are 10^9 and 10^6 bytes per second. " +
		"Small files: the whole phase over all files, each file being open, one write (or reads to EOF), close.\n")
	w("- Latency is per call as the calling process sees it: from before open to after close for create+close, around the call for stat. "+
		"Cached stat times batches of %d calls and divides, so reading the clock does not count.\n", statCachedBatchOf)
	w("- Nothing is dropped from the page cache between steps: what the kernel caches is part of what users get. " +
		"\"First read\" follows the write of the same round directly; \"re-read\" follows the first read.\n")
	w("- Writing a new file allocates fresh tmpfs pages. In a VM the first touch of memory the host has not (or no longer) backed is slow and varies from round to round; " +
		"the overwrite row measures the data path without that allocation.\n")
	w("- mtcfs lets the kernel cache entries and attributes for 5s. The cold stat pass runs after waiting %s, so each call asks the agent; "+
		"the revalidation the cached-stat loop hits every 5 s does not move its median.\n\n", cfg.cacheWait)

	w("<details><summary>Raw samples, one per measured round, in round order</summary>\n\n")
	w("| Metric | Unit | tmpfs | passthrough | fallback |\n|---|---|---|---|---|\n")
	for _, m := range res.measured(metrics(cfg)) {
		w("| %s | %s", m.title, m.unit)
		for _, t := range []string{tmpfsTarget, passthroughTarget, fallbackTarget} {
			var vs []string
			for _, v := range res.samples[m.key][t] {
				vs = append(vs, formatValue(v))
			}
			w(" | %s", strings.Join(vs, " "))
		}
		w(" |\n")
	}
	w("\n</details>\n%s\n", sectionEnd)
	return b.String()
}

// updateResultsFile replaces the generated section of path (or appends one), keeping whatever
// people wrote around it.
func updateResultsFile(path, section string) error {
	old, err := os.ReadFile(path)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	text := string(old)
	begin := strings.Index(text, "<!-- fsbench:begin")
	end := strings.Index(text, sectionEnd)
	switch {
	case len(old) == 0:
		text = "# mtcfs benchmark results\n\nWhat is measured and how to run it: [README.md](README.md).\n\n" + section
	case begin >= 0 && end > begin:
		text = text[:begin] + section + strings.TrimPrefix(text[end+len(sectionEnd):], "\n")
	default:
		text = strings.TrimRight(text, "\n") + "\n\n" + section
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(text), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

func formatValue(v float64) string {
	switch {
	case math.IsNaN(v):
		return "n/a"
	case v >= 100:
		return strconv.FormatFloat(v, 'f', 0, 64)
	case v >= 10:
		return strconv.FormatFloat(v, 'f', 1, 64)
	}
	return strconv.FormatFloat(v, 'f', 2, 64)
}

func formatBytes(n int64) string {
	switch {
	case n >= 1<<30 && n%(1<<30) == 0:
		return fmt.Sprintf("%d GiB", n>>30)
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d B", n)
}
