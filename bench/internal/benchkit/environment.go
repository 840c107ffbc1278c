package benchkit

import (
	"bufio"
	"debug/buildinfo"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/internal/buildstamp"
)

// Environment is what a reader needs to judge the numbers: when, how, on what.
type Environment struct {
	Date    time.Time
	Command string // how the program was invoked
	MTCFS   string // the agent binary under test
	Machine string
	CPU     string // who else used the CPUs during the run; see CPUAccount
}

// DescribeEnvironment describes a run of the bench program prog (e.g. "fsbench", the name of its
// directory under bench/) against the agent binary bin; CPU is left for the end of the run.
func DescribeEnvironment(prog, bin string) Environment {
	return Environment{
		Date:    time.Now().UTC(),
		Command: commandLine(prog),
		MTCFS:   describeBinary(bin),
		Machine: describeMachine(prog),
	}
}

// commandLine reconstructs how prog was invoked; under go run, os.Args[0] is a temporary build,
// so the package path is shown instead.
func commandLine(prog string) string {
	name := os.Args[0]
	if strings.Contains(name, "go-build") {
		name = "go run ./" + prog
	}
	parts := []string{name}
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
	if rev, modified := buildstamp.VCS(info); rev != "" {
		desc += " from commit " + rev[:min(len(rev), 12)]
		if modified {
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

// describeMachine reads CPU, memory and kernel at run time, and names the Go that built prog.
func describeMachine(prog string) string {
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
					mem = FormatBytes(kb<<10) + " RAM"
				}
			}
		}
	}
	kernel := "unknown kernel"
	var u unix.Utsname
	if unix.Uname(&u) == nil {
		kernel = "Linux " + unix.ByteSliceToString(u.Release[:]) + " " + unix.ByteSliceToString(u.Machine[:])
	}
	return fmt.Sprintf("%s, %d CPUs, %s, %s; %s built with %s", cpu, runtime.NumCPU(), mem, kernel, prog, runtime.Version())
}
