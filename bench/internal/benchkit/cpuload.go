package benchkit

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Other processes competing for the CPUs distort every figure, so the reports say how much CPU
// they took during the run. (The load average cannot tell: a thread waiting for a FUSE reply
// sleeps uninterruptibly and counts as load.)

// clockTick is USER_HZ, the unit of /proc/stat and /proc/PID/stat times; 100 on Linux.
const clockTick = 100

// CPUAccount is a snapshot taken when the measurement starts.
type CPUAccount struct {
	start  time.Time
	busy   time.Duration // all CPUs, not idle, since boot
	steal  time.Duration // taken by the hypervisor, since boot
	ownCPU time.Duration // this process and its waited-for children
}

// StartCPUAccount takes the snapshot.
func StartCPUAccount() CPUAccount {
	busy, steal := machineCPU()
	return CPUAccount{start: time.Now(), busy: busy, steal: steal, ownCPU: ownCPU()}
}

// CPUWording fills in the sentence of OthersSummary.
type CPUWording struct {
	Span string // what the time was spent on: "measurement", "the run"
	Us   string // who counts as us: "fsbench and the agents"
	Note string // appended inside the parenthesis after the CPU count, starting with "; "
}

// OthersSummary describes the CPU time used since the snapshot by everything except this
// process, its children that were waited for, and the still running children whose pids are
// given.
func (a CPUAccount) OthersSummary(w CPUWording, running ...int) string {
	wall := time.Since(a.start)
	busy, steal := machineCPU()
	ours := ownCPU() - a.ownCPU
	for _, pid := range running {
		ours += ProcessCPU(pid)
	}
	others := max(0, busy-a.busy-ours)
	capacity := wall * time.Duration(runtime.NumCPU())
	return fmt.Sprintf("over the %.0fs of %s, %s used %.0f CPU-seconds, "+
		"other processes and the kernel's own work %.0f (%.0f%% of the %d CPUs%s), the hypervisor stole %.0f",
		wall.Seconds(), w.Span, w.Us, ours.Seconds(), others.Seconds(), 100*others.Seconds()/capacity.Seconds(),
		runtime.NumCPU(), w.Note, (steal - a.steal).Seconds())
}

// machineCPU reads the busy and stolen time of all CPUs from /proc/stat.
func machineCPU() (busy, steal time.Duration) {
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0
	}
	line, _, _ := strings.Cut(string(data), "\n")
	// cpu user nice system idle iowait irq softirq steal guest guest_nice
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return 0, 0
	}
	ticks := func(i int) time.Duration {
		n, _ := strconv.ParseInt(f[i], 10, 64)
		return time.Duration(n) * time.Second / clockTick
	}
	return ticks(1) + ticks(2) + ticks(3) + ticks(6) + ticks(7), ticks(8)
}

// ownCPU is the user and system time of this process and of its children that were waited for.
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

// ProcessCPU reads a running process's user and system time (all its threads) from
// /proc/PID/stat; its resolution is 10 ms.
func ProcessCPU(pid int) time.Duration {
	f, err := procStat(pid)
	if err != nil {
		return 0
	}
	utime, _ := strconv.ParseInt(f[11], 10, 64)
	stime, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(utime+stime) * time.Second / clockTick
}

// ProcessMinorFaults reads a running process's minor page faults (all its threads) from
// /proc/PID/stat.
func ProcessMinorFaults(pid int) (int64, error) {
	f, err := procStat(pid)
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(f[7], 10, 64)
}

// procStat is /proc/PID/stat's fields after the command name: f[0] is field 3 (state).
func procStat(pid int) ([]string, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil, err
	}
	// pid (comm) state ppid ... minflt (10) ... utime stime (14, 15); comm may contain spaces.
	_, rest, ok := strings.Cut(string(data), ") ")
	f := strings.Fields(rest)
	if !ok || len(f) < 13 {
		return nil, fmt.Errorf("/proc/%d/stat: %d fields after the command name", pid, len(f))
	}
	return f, nil
}
