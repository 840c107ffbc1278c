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
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Targets of the issue.
const (
	yamlTargetMs    = 100.0 // yaml consumed within
	sealTargetRatio = 1.2   // commit-to-sealed ÷ one tmpfs read of the tree, at most
	backupTarget    = 0.8   // backup throughput ÷ cp -r throughput, at least
)

// environment is what a reader needs to judge the numbers: when, how, on what.
type environment struct {
	date    time.Time
	command string
	mtcfs   string
	machine string
	storage string
	cpu     string // who else used the CPUs during the run
}

func describeEnvironment(bin, workDir, shmDir string) environment {
	return environment{
		date:    time.Now().UTC(),
		command: commandLine(),
		mtcfs:   describeBinary(bin),
		machine: describeMachine(),
		storage: fmt.Sprintf("mount points, spools, backups and copies under %s (%s); source tree under %s (%s)",
			workDir, describeFS(workDir), shmDir, describeFS(shmDir)),
	}
}

// describeFS names the filesystem holding dir and its device, from /proc/self/mountinfo.
func describeFS(dir string) string {
	abs, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return "unknown filesystem"
	}
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return "unknown filesystem"
	}
	best, desc := -1, "unknown filesystem"
	for _, line := range strings.Split(string(data), "\n") {
		// id parent major:minor root mountpoint opts ... - fstype source superopts
		pre, post, ok := strings.Cut(line, " - ")
		f, g := strings.Fields(pre), strings.Fields(post)
		if !ok || len(f) < 5 || len(g) < 2 {
			continue
		}
		mp := f[4]
		if (abs == mp || strings.HasPrefix(abs, strings.TrimSuffix(mp, "/")+"/")) && len(mp) >= best {
			best, desc = len(mp), g[0]+" on "+g[1]
		}
	}
	return desc
}

// commandLine reconstructs how replbench was invoked; under go run, os.Args[0] is a temporary
// build, so the package path is shown instead.
func commandLine() string {
	prog := os.Args[0]
	if strings.Contains(prog, "go-build") {
		prog = "go run ./bench/replbench"
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
	return fmt.Sprintf("%s, %d CPUs, %s, %s; replbench built with %s", cpu, runtime.NumCPU(), mem, kernel, runtime.Version())
}

// cpuAccount is a snapshot taken when the run starts. Other processes competing for the CPUs
// distort every figure, so the report says how much CPU they took.
type cpuAccount struct {
	start   time.Time
	busy    time.Duration // all CPUs, not idle, since boot
	steal   time.Duration
	selfCPU time.Duration // this process and its waited-for children (agents, cp, sync)
}

const clockTick = 100 // USER_HZ

func startCPUAccount() cpuAccount {
	busy, steal := machineCPU()
	return cpuAccount{start: time.Now(), busy: busy, steal: steal, selfCPU: ownCPU()}
}

// othersSummary must run after every child was waited for.
func (a cpuAccount) othersSummary() string {
	wall := time.Since(a.start)
	busy, steal := machineCPU()
	ours := ownCPU() - a.selfCPU
	others := max(0, busy-a.busy-ours)
	capacity := wall * time.Duration(runtime.NumCPU())
	return fmt.Sprintf("over the %.0fs of the run, replbench, the agents, cp and sync used %.0f CPU-seconds, "+
		"other processes and the kernel's own work %.0f (%.0f%% of the %d CPUs; kernel work for our I/O, such as writeback, counts here), the hypervisor stole %.0f",
		wall.Seconds(), ours.Seconds(), others.Seconds(), 100*others.Seconds()/capacity.Seconds(),
		runtime.NumCPU(), (steal - a.steal).Seconds())
}

func machineCPU() (busy, steal time.Duration) {
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0
	}
	line, _, _ := strings.Cut(string(data), "\n")
	f := strings.Fields(line) // cpu user nice system idle iowait irq softirq steal ...
	if len(f) < 9 || f[0] != "cpu" {
		return 0, 0
	}
	ticks := func(i int) time.Duration {
		n, _ := strconv.ParseInt(f[i], 10, 64)
		return time.Duration(n) * time.Second / clockTick
	}
	return ticks(1) + ticks(2) + ticks(3) + ticks(6) + ticks(7), ticks(8)
}

// processCPU reads a running process's user and system time (all its threads) from
// /proc/PID/stat; its resolution is 10 ms.
func processCPU(pid int) time.Duration {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// pid (comm) state ppid ... utime stime: fields 14 and 15; comm may contain spaces.
	_, rest, ok := strings.Cut(string(data), ") ")
	f := strings.Fields(rest)
	if !ok || len(f) < 13 {
		return 0
	}
	utime, _ := strconv.ParseInt(f[11], 10, 64)
	stime, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(utime+stime) * time.Second / clockTick
}

func ownCPU() time.Duration {
	var total time.Duration
	for _, who := range []int{syscall.RUSAGE_SELF, syscall.RUSAGE_CHILDREN} {
		var ru syscall.Rusage
		if syscall.Getrusage(who, &ru) == nil {
			total += time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
		}
	}
	return total
}

// Markers delimit the part of the results file that replbench owns; fsbench's section and
// anything written by hand stay as they are.
const (
	sectionBegin = "<!-- replbench:begin — generated by bench/replbench; a new run replaces everything up to replbench:end -->"
	sectionEnd   = "<!-- replbench:end -->"
)

func renderSection(cfg config, env environment, res *results, treeBytes int64) string {
	var b strings.Builder
	w := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	size := formatBytes(treeBytes)
	shape := fmt.Sprintf("%d × %s", cfg.files, formatBytes(cfg.fileSize))
	w("%s\n## Checkpoint path (replbench), latest run: %s\n\n", sectionBegin, env.date.Format("2006-01-02 15:04 MST"))
	w("- Command (as root, from the module root): `%s`\n", env.command)
	w("- mtcfs: %s; agents run with `--memory %s`, `--http 127.0.0.1:0`, default passthrough (auto)\n", env.mtcfs, cfg.memory)
	w("- Machine: %s\n", env.machine)
	w("- Storage: %s\n", env.storage)
	w("- CPU competition: %s.\n", env.cpu)
	w("- Method: %d warm-up and %d measured repetitions per item (yaml: %d measured); each repetition runs mtcfs and its baseline(s) back to back, the first one rotating; figures are medians over the measured repetitions.",
		cfg.warmup, cfg.reps, cfg.yamlReps)
	w("\n\n")

	gbps := func(key string) float64 { return float64(treeBytes) / (res.median(key) / 1e3) / 1e9 }
	verdict := func(ok bool, op string, limit float64, unit string) string {
		s := fmt.Sprintf("%s %g%s: ", op, limit, unit)
		if ok {
			return s + "met"
		}
		return s + "**NOT met**"
	}
	w("| # | Target | mtcfs | baseline | ratio | target | verdict |\n|---|---|--:|--:|--:|---|---|\n")
	met, total := 0, 0
	count := func(ok bool) bool {
		total++
		if ok {
			met++
		}
		return ok
	}
	if len(res.samples[kYAML]) > 0 {
		med, mx := res.median(kYAML), res.max(kYAML)
		w("| 1 | replicator.yaml consumed (rename returned → yaml absent), median | %s ms | — | — | ≤ %g ms | %s |\n",
			formatValue(med), yamlTargetMs, verdict(count(med <= yamlTargetMs), "≤", yamlTargetMs, " ms"))
		w("| 1 | replicator.yaml consumed, max of %d | %s ms | — | — | ≤ %g ms | %s |\n",
			len(res.samples[kYAML]), formatValue(mx), yamlTargetMs, verdict(count(mx <= yamlTargetMs), "≤", yamlTargetMs, " ms"))
	}
	if len(res.samples[kSeal]) > 0 {
		ratio := res.median(kSeal) / res.median(kTmpfsRead)
		w("| 2 | commit (rename returned) → .meta exists, %s step (%s) vs one read of it from tmpfs | %s ms | %s ms (%.2f GB/s) | %.3f× | ≤ %g× the read | %s |\n",
			size, shape, formatValue(res.median(kSeal)), formatValue(res.median(kTmpfsRead)), gbps(kTmpfsRead),
			ratio, sealTargetRatio, verdict(count(ratio <= sealTargetRatio), "≤", sealTargetRatio, "×"))
	}
	if len(res.samples[kBackup]) > 0 {
		for _, base := range []struct{ key, name string }{{kCpSync, "`cp -r` + `sync` of its files"}, {kCp, "plain `cp -r`"}} {
			ratio := res.median(base.key) / res.median(kBackup) // throughput ratio
			w("| 3 | commit → backup of the %s step complete on `file://` (sealing included) vs %s | %.2f s (%.2f GB/s) | %.2f s (%.2f GB/s) | %.3f× | ≥ %g× the throughput | %s |\n",
				size, base.name, res.median(kBackup)/1e3, gbps(kBackup), res.median(base.key)/1e3, gbps(base.key),
				ratio, backupTarget, verdict(count(ratio >= backupTarget), "≥", backupTarget, "×"))
		}
	}
	w("\nTargets met: %d of %d.\n\n", met, total)

	w("Figures without a target, to explain the ones above (medians):\n\n")
	if len(res.samples[kYAMLPoll]) > 0 {
		w("- yaml: the stat poll ran every %.0f µs on average (target period %v).\n", res.median(kYAMLPoll), yamlPoll)
	}
	if len(res.samples[kSeal]) > 0 {
		w("- Sealing, as the agent logs it (`step sealed … took=`, from its commit detection to the .meta): %s ms; "+
			"the poll adds up to %v. The files were closed %v before each commit.\n",
			formatValue(res.median(kSealAgent)), slowPoll, cfg.settle)
		w("- Writing each step through the mount (mkdir to the last close; 1 MiB writes, fsync per file) took %s ms, %.2f GB/s. "+
			"A second step per repetition, committed right after its last close instead of %v later, was sealed %s ms after the commit "+
			"(agent: %s ms), %.2f× the tmpfs read.\n",
			formatValue(res.median(kSaveWrite)), gbps(kSaveWrite), cfg.settle, formatValue(res.median(kSealNow)),
			formatValue(res.median(kSealNowAgent)), res.median(kSealNow)/res.median(kTmpfsRead))
	}
	if len(res.samples[kBackup]) > 0 {
		up := res.median(kBackupAgent)
		w("- Backup repetitions: the step was sealed %s ms after the commit (the .meta in the mount); the agent's own upload (`backup complete … took=`, from its start to the .meta uploaded) took %.2f s, %.2f GB/s. "+
			"Each backup repetition uses a fresh agent and job, because an agent takes at most one backup per UTC minute, whatever the job.\n",
			formatValue(res.median(kBackupSealed)), up/1e3, float64(treeBytes)/(up/1e3)/1e9)
		w("- CPU time from the commit to the backup being complete: the agent %.2f s (all threads; the kernel's writeback threads not included); "+
			"`cp -r` %.2f s; `cp -r` + `sync` %.2f s.\n",
			res.median(kBackupCPU)/1e3, res.median(kCpCPU)/1e3, res.median(kCpSyncCPU)/1e3)
	}
	w("\n<details><summary>Raw samples, one per measured repetition, in order</summary>\n\n")
	w("| Measurement | Unit | Samples |\n|---|---|---|\n")
	for _, row := range []struct{ key, title, unit string }{
		{kYAML, "yaml consumed", "ms"},
		{kYAMLPoll, "yaml stat poll period, average", "µs"},
		{kSeal, "commit → .meta in the mount", "ms"},
		{kSealAgent, "agent: step sealed took", "ms"},
		{kTmpfsRead, "read of the tree from tmpfs", "ms"},
		{kSaveWrite, "write of the step through the mount", "ms"},
		{kSealNow, "committed right after the last close: commit → .meta", "ms"},
		{kSealNowAgent, "committed right after the last close: agent's step sealed took", "ms"},
		{kBackup, "commit → backup .meta in the backup directory", "ms"},
		{kBackupSealed, "same repetitions: commit → .meta in the mount", "ms"},
		{kBackupAgent, "agent: backup complete took", "ms"},
		{kCp, "cp -r", "ms"},
		{kCpSync, "cp -r + sync", "ms"},
		{kBackupCPU, "agent CPU, commit → backup complete", "ms"},
		{kCpCPU, "cp -r CPU", "ms"},
		{kCpSyncCPU, "cp -r + sync CPU", "ms"},
	} {
		if len(res.samples[row.key]) == 0 {
			continue
		}
		var vs []string
		for _, v := range res.samples[row.key] {
			vs = append(vs, formatValue(v))
		}
		w("| %s | %s | %s |\n", row.title, row.unit, strings.Join(vs, " "))
	}
	w("\n</details>\n%s\n", sectionEnd)
	return b.String()
}

// updateResultsFile replaces replbench's section of path (or appends one), keeping whatever
// else the file holds.
func updateResultsFile(path, section string) error {
	old, err := os.ReadFile(path)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	text := string(old)
	begin := strings.Index(text, "<!-- replbench:begin")
	end := strings.Index(text, sectionEnd)
	switch {
	case len(old) == 0:
		text = "# mtcfs benchmark results\n\nWhat is measured and how to run it: [README.md](README.md).\n\n" + section
	case begin >= 0 && end > begin:
		text = text[:begin] + section + strings.TrimPrefix(text[end+len(sectionEnd):], "\n")
	default:
		text = strings.TrimRight(text, "\n") + "\n\n" + section
	}
	tmp := path + ".replbench.tmp"
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
