package main

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Other processes competing for the CPUs distort every figure, so the report says how much CPU
// they took during the run. (The load average cannot tell: a thread waiting for a FUSE reply
// sleeps uninterruptibly and counts as load.)

// clockTick is USER_HZ, the unit of /proc/stat and /proc/PID/stat times; 100 on Linux.
const clockTick = 100

// cpuAccount is a snapshot taken when the run starts.
type cpuAccount struct {
	start   time.Time
	busy    time.Duration // all CPUs, not idle, since boot
	steal   time.Duration // taken by the hypervisor, since boot
	selfCPU time.Duration // this process, user and system
}

func startCPUAccount() cpuAccount {
	busy, steal := machineCPU()
	return cpuAccount{start: time.Now(), busy: busy, steal: steal, selfCPU: selfCPU()}
}

// othersSummary describes the CPU time used since the snapshot by everything except fsbench and
// the agents (pids), which must still be running.
func (a cpuAccount) othersSummary(agents []int) string {
	wall := time.Since(a.start)
	busy, steal := machineCPU()
	ours := selfCPU() - a.selfCPU
	for _, pid := range agents {
		ours += processCPU(pid)
	}
	others := max(0, busy-a.busy-ours)
	capacity := wall * time.Duration(runtime.NumCPU())
	return fmt.Sprintf("over the %.0fs of measurement, fsbench and the agents used %.0f CPU-seconds, "+
		"other processes and the kernel's own work %.0f (%.0f%% of the %d CPUs), the hypervisor stole %.0f",
		wall.Seconds(), ours.Seconds(), others.Seconds(), 100*others.Seconds()/capacity.Seconds(),
		runtime.NumCPU(), (steal - a.steal).Seconds())
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

func selfCPU() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// processCPU reads a running process's user and system time from /proc/PID/stat.
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
