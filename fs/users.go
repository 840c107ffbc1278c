package fs

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

// mountUsers names the processes that keep dir busy, as this PID namespace's /proc shows them:
// a working directory, root or open file at or below dir. It gives at most max of them, lowest
// pid first, and how many there were; the agent itself is left out. Reading another user's
// /proc/PID/fd needs root: without it only the caller's own processes are seen.
func mountUsers(dir string, max int) (users []string, n int) {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil, 0
	}
	below := func(p string) bool { return p == dir || strings.HasPrefix(p, dir+"/") }
	self := os.Getpid()
	var pids []int
	for _, e := range ents {
		if pid, err := strconv.Atoi(e.Name()); err == nil && pid != self {
			pids = append(pids, pid)
		}
	}
	sort.Ints(pids)
	for _, pid := range pids {
		base := filepath.Join("/proc", strconv.Itoa(pid))
		var what []string
		if p, err := os.Readlink(base + "/cwd"); err == nil && below(p) {
			what = append(what, "working directory")
		}
		if p, err := os.Readlink(base + "/root"); err == nil && p != "/" && below(p) {
			what = append(what, "root")
		}
		files := 0
		if fds, err := os.ReadDir(base + "/fd"); err == nil {
			for _, fd := range fds {
				if p, err := os.Readlink(base + "/fd/" + fd.Name()); err == nil && below(p) {
					files++
				}
			}
		}
		switch {
		case files == 1:
			what = append(what, "1 open file")
		case files > 1:
			what = append(what, fmt.Sprintf("%d open files", files))
		}
		if len(what) == 0 {
			continue
		}
		if n++; n <= max {
			comm, _ := os.ReadFile(base + "/comm")
			users = append(users, fmt.Sprintf("pid %d (%s: %s)", pid, strings.TrimSpace(string(comm)), strings.Join(what, ", ")))
		}
	}
	return users, n
}

// usersShown is how many processes a log line names (usersLine).
const usersShown = 5

// usersLine names the processes that keep dir busy for a log line (mountUsers, the first
// usersShown, "and K more"), and how many there were.
func usersLine(dir string) (line string, n int) {
	users, n := mountUsers(dir, usersShown)
	line = strings.Join(users, ", ")
	if n > usersShown {
		line += fmt.Sprintf(" and %d more", n-usersShown)
	}
	return line, n
}
