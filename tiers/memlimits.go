package tiers

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// MemoryLimits is what bounds the agent's memory, and so the spool's budget: the machine's RAM
// and, in a container (or any memory cgroup with a limit), the cgroup's limit (0: none).
type MemoryLimits struct {
	Machine int64
	Cgroup  int64
}

// ReadMemoryLimits reads the machine's RAM and this process's memory cgroup limit (v2 or v1)
// under the cgroup file system root (normally /sys/fs/cgroup; a parameter for tests).
func ReadMemoryLimits(procSelfCgroup, cgroupRoot string) MemoryLimits {
	var l MemoryLimits
	var si unix.Sysinfo_t
	if unix.Sysinfo(&si) == nil {
		l.Machine = int64(si.Totalram) * int64(si.Unit)
	}
	l.Cgroup = cgroupMemoryLimit(procSelfCgroup, cgroupRoot)
	return l
}

// cgroupMemoryLimit returns the memory limit of this process's cgroup, 0 for none. In a cgroup
// namespace (a container) the path in /proc/self/cgroup is "/", and the root is the
// container's own cgroup.
func cgroupMemoryLimit(procSelfCgroup, root string) int64 {
	f, err := os.Open(procSelfCgroup)
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// hierarchy-ID:controller-list:cgroup-path
		parts := strings.SplitN(sc.Text(), ":", 3)
		if len(parts) != 3 {
			continue
		}
		var candidates []string
		switch {
		case parts[0] == "0" && parts[1] == "": // v2
			candidates = []string{filepath.Join(root, parts[2], "memory.max"), filepath.Join(root, "memory.max")}
		case strings.Contains(","+parts[1]+",", ",memory,"): // v1
			candidates = []string{filepath.Join(root, "memory", parts[2], "memory.limit_in_bytes"), filepath.Join(root, "memory", "memory.limit_in_bytes")}
		default:
			continue
		}
		for _, p := range candidates {
			if n, ok := readLimit(p); ok {
				return n
			}
		}
	}
	return 0
}

// readLimit reads a cgroup memory limit file: "max" or a huge number (v1's way to say none) is
// no limit (0).
func readLimit(p string) (int64, bool) {
	data, err := os.ReadFile(p)
	if err != nil {
		return 0, false
	}
	s := strings.TrimSpace(string(data))
	if s == "max" {
		return 0, true
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n <= 0 || n >= 1<<60 {
		return 0, true
	}
	return n, true
}

// DefaultBudget is half of what the agent may use: the machine's RAM, or the cgroup's limit
// when it is lower (what a default tmpfs would get, within the container's share).
func (l MemoryLimits) DefaultBudget() int64 {
	avail := l.Machine
	if l.Cgroup > 0 && (avail == 0 || l.Cgroup < avail) {
		avail = l.Cgroup
	}
	if avail <= 0 {
		return 1 << 30
	}
	return avail / 2
}

// CheckBudget refuses a --memory the machine or the cgroup cannot hold: the tmpfs would accept
// it, and the node (or the container) would run out of memory at the first large checkpoint.
func (l MemoryLimits) CheckBudget(budget int64) error {
	switch {
	case l.Machine > 0 && budget > l.Machine:
		return fmt.Errorf("--memory %s is more than this machine's memory (%s): give at most what the node can spare for checkpoints", FormatSize(budget), FormatSize(l.Machine))
	case l.Cgroup > 0 && budget > l.Cgroup:
		return fmt.Errorf("--memory %s is more than this agent's memory cgroup limit (%s, e.g. the container's memory limit): raise the limit or lower --memory", FormatSize(budget), FormatSize(l.Cgroup))
	}
	return nil
}

// minGoMemoryLimit is the least --go-memory-limit taken: the agent's heap (gRPC buffers, the
// namespace's nodes, hashing) is tens of MiB at rest.
const minGoMemoryLimit = 32 << 20

// SetGoMemoryLimit decides the Go runtime's soft memory limit (the heap, not the spool, which is
// tmpfs) from --go-memory-limit: "auto" takes 90% of what the cgroup leaves once the spool's
// budget is counted (the spool's pages may be charged to the same cgroup), none without a cgroup
// limit; "off" sets none; a size sets that. GOMEMLIMIT in the environment wins over all of these
// (the runtime applied it at start). It returns the limit set (0: none) and why.
func (l MemoryLimits) SetGoMemoryLimit(flag string, budget int64) (int64, string, error) {
	if v := os.Getenv("GOMEMLIMIT"); v != "" {
		return debug.SetMemoryLimit(-1), "GOMEMLIMIT=" + v, nil
	}
	switch flag {
	case "off":
		return 0, "off", nil
	case "auto", "":
		if l.Cgroup == 0 {
			return 0, "no cgroup memory limit", nil
		}
		left := l.Cgroup - budget
		if left < 64<<20 {
			return 0, "", fmt.Errorf("the memory cgroup limit (%s) leaves less than 64MiB for the agent beside --memory %s: raise the limit or lower --memory", FormatSize(l.Cgroup), FormatSize(budget))
		}
		limit := left / 10 * 9
		debug.SetMemoryLimit(limit)
		return limit, "90% of the cgroup limit left beside --memory", nil
	}
	n, err := ParseSize(flag)
	if err != nil {
		return 0, "", errors.New("--go-memory-limit: want auto, off or a size such as 512MiB")
	}
	if n < minGoMemoryLimit {
		// 1KiB was accepted: the collector then runs without pause and the agent crawls.
		return 0, "", fmt.Errorf("--go-memory-limit %s is less than the agent's own heap needs (at least %s): give more, or off", flag, FormatSize(minGoMemoryLimit))
	}
	debug.SetMemoryLimit(n)
	return n, "--go-memory-limit", nil
}
