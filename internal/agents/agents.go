// Package agents is the registry of the mtcfs agents running on this machine: each publishes a
// small file about itself (pid, mount, HTTP address, spool) so that `mtcfs status` and
// `mtcfs spool` find it without flags. Files of agents that are gone — their pid is dead, or now
// names another process — are removed by whoever lists them.
package agents

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Info is what a running agent publishes about itself so that `mtcfs status` and `mtcfs spool`
// find it without flags.
type Info struct {
	PID         int    `json:"pid"`
	Dir         string `json:"dir"`
	HTTP        string `json:"http"`
	Version     string `json:"version"`
	Passthrough bool   `json:"passthrough"`
	SpoolDir    string `json:"spool_dir,omitempty"`
	// Stopping is set once the agent got its stop signal: an agent started on the same
	// directory meanwhile waits for it to finish (Stopping, Gone) instead of failing.
	Stopping bool `json:"stopping,omitempty"`
	// StartTime is the agent process's start time (field 22 of /proc/PID/stat, clock ticks
	// since boot): a file whose pid now names a process with another start time is stale.
	StartTime uint64 `json:"start_time,omitempty"`
}

// Dir holds one small file per running agent on this machine.
func Dir() string {
	if os.Geteuid() == 0 {
		return rootDir
	}
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" {
		return filepath.Join(d, "mtcfs", "agents")
	}
	return filepath.Join(os.TempDir(), "mtcfs-"+strconv.Itoa(os.Getuid()), "agents")
}

// rootDir is where the agents started by root register (Dir, as root).
const rootDir = "/run/mtcfs/agents"

// Dirs lists the registry directories to look in: this user's (Dir) first. A user other than
// root looks in root's too: a root agent serves mounts that belong to the users whose jobs
// write into them (SPEC §10 Ownership), and they ask `mtcfs status` about them. Root looks in
// every user's too (their development mounts).
func Dirs() []string {
	dirs := []string{Dir()}
	if os.Geteuid() != 0 {
		return append(dirs, rootDir)
	}
	for _, pattern := range []string{"/run/user/*/mtcfs/agents", filepath.Join(os.TempDir(), "mtcfs-*", "agents")} {
		found, _ := filepath.Glob(pattern)
		dirs = append(dirs, found...)
	}
	return dirs
}

// Register publishes info (best effort: `mtcfs status` is a convenience) until unregister is
// called. A zero StartTime is filled in from /proc.
func Register(info Info) (unregister func()) {
	dir := Dir()
	p := filepath.Join(dir, strconv.Itoa(info.PID)+".json")
	if info.StartTime == 0 {
		info.StartTime, _ = ProcStartTime(info.PID)
	}
	data, _ := json.Marshal(info)
	if err := os.MkdirAll(dir, 0o755); err == nil {
		tmp := p + ".tmp"
		if writeNew(tmp, data) == nil {
			os.Rename(tmp, p)
		}
	}
	return func() { os.Remove(p) }
}

// Local lists the agents running on this machine (in Dirs), removing the files of agents that
// are gone where it may: their pid is dead, or now names another process (pid reuse). Only this
// user's directory failing to be read is an error.
func Local() ([]Info, error) { return localIn(Dirs()) }

// localIn is Local over dirs, this user's first. In a directory that is neither this user's nor
// root's (root looking at users' development agents, in a world-writable /tmp), an entry counts
// only if its file belongs to the user its pid runs as: no one can pass an agent off as another
// user's, or as root's. In this user's own directory (not root's), only this user's files count:
// another user who made /tmp/mtcfs-UID first could plant an entry that held the user's spool
// "in use" and answered their status (found by a black-box run).
func localIn(dirs []string) ([]Info, error) {
	var out []Info
	seen := map[int]bool{}
	euid := os.Geteuid()
	for i, dir := range dirs {
		foreign := i > 0 && dir != rootDir
		own := i == 0 && dir != rootDir
		ents, err := os.ReadDir(dir)
		if os.IsNotExist(err) || (err != nil && (i > 0 || os.IsPermission(err))) {
			// Another user's, or this user's own made unreadable by an environment kept across
			// a change of user (XDG_RUNTIME_DIR through su or setpriv): the others still count.
			continue
		}
		if err != nil {
			return nil, err
		}
		for _, e := range ents {
			if !strings.HasSuffix(e.Name(), ".json") {
				continue
			}
			p := filepath.Join(dir, e.Name())
			data, err := os.ReadFile(p)
			var info Info
			if err != nil || json.Unmarshal(data, &info) != nil || info.PID <= 0 || seen[info.PID] {
				continue
			}
			if !alive(info, p) {
				os.Remove(p) // fails in another user's directory: its owner's next look removes it
				continue
			}
			if foreign && !ownedByItsProcess(p, info.PID) {
				continue
			}
			if own && !ownedBy(p, euid) {
				continue
			}
			seen[info.PID] = true
			out = append(out, info)
		}
	}
	return out, nil
}

// writeNew writes data to a new file at p, never through a symlink planted there: a user's
// registry directory may have been made by another user (found by a review).
func writeNew(p string, data []byte) error {
	os.Remove(p) // a stale one, or a planted symlink (removed, not followed)
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW, 0o644)
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// ownedBy reports whether the file p belongs to uid.
func ownedBy(p string, uid int) bool {
	var st unix.Stat_t
	return unix.Lstat(p, &st) == nil && int(st.Uid) == uid
}

// ownedByItsProcess reports whether the file p belongs to the user process pid runs as.
func ownedByItsProcess(p string, pid int) bool {
	var file, proc unix.Stat_t
	return unix.Lstat(p, &file) == nil && unix.Stat("/proc/"+strconv.Itoa(pid), &proc) == nil && file.Uid == proc.Uid
}

// Stopping returns the agent on this machine that serves dir and is stopping (ok false: none).
// It looks only in this user's registry and root's, which no other user can write: an entry
// planted in another directory cannot hold an agent back.
func Stopping(dir string) (Info, bool) {
	dirs := []string{Dir()}
	if dirs[0] != rootDir {
		dirs = append(dirs, rootDir)
	}
	list, _ := localIn(dirs)
	for _, a := range list {
		if a.Dir == dir && a.Stopping {
			return a, true
		}
	}
	return Info{}, false
}

// Gone reports whether the agent that published info has exited (alive's test, without the
// registry file: Local read that already).
func Gone(info Info) bool { return !alive(info, "") }

// StatusAddrs returns the agents running on this machine (their HTTP addresses, mounts and
// pids), or the one serving dir when dir is not "" (a mount path resolved as agents register
// it). Finding none is an error that says what to do.
func StatusAddrs(dir string) ([]Info, error) {
	list, err := Local()
	if err != nil {
		return nil, err
	}
	if len(list) == 0 {
		return nil, errors.New("no mtcfs agent is running on this machine (start one with mtcfs mount DIR, or pass --http HOST:PORT)")
	}
	var out []Info
	for _, a := range list {
		if dir == "" || a.Dir == dir {
			out = append(out, a)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no running agent serves %s", dir)
	}
	return out, nil
}

// Stopped reports whether process pid is stopped (SIGSTOP, or a debugger: state T or t in
// /proc/PID/stat). A frozen cgroup does not show there.
func Stopped(pid int) bool {
	st := procState(pid)
	return st == 'T' || st == 't'
}

// procState is the state letter of process pid in /proc/PID/stat (0: unknown).
func procState(pid int) byte {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	i := bytes.LastIndexByte(data, ')') // the command name may hold spaces and parentheses
	if i < 0 || i+2 >= len(data) {
		return 0
	}
	return data[i+2]
}

// alive reports whether the process that wrote the registry file p still runs ("": a process
// that did not record its start time counts as running).
func alive(info Info, p string) bool {
	if unix.Kill(info.PID, 0) == unix.ESRCH {
		return false
	}
	if st := procState(info.PID); st == 'Z' || st == 'X' {
		return false // dead, not yet reaped by its parent (found by a black-box run)
	}
	start, err := ProcStartTime(info.PID)
	if err != nil {
		return !os.IsNotExist(err) // gone between the two looks; otherwise we cannot tell
	}
	if info.StartTime != 0 {
		return start == info.StartTime
	}
	// A file written by an agent that did not record its start time: the process must have
	// started before the file was written.
	fi, err := os.Stat(p)
	if err != nil {
		return true
	}
	started, ok := bootTime()
	if !ok {
		return true
	}
	started = started.Add(time.Duration(start) * time.Second / clockTicks)
	return !started.After(fi.ModTime().Add(time.Second))
}

// clockTicks is USER_HZ, the unit of /proc/PID/stat times: 100 on every Linux architecture
// Go supports.
const clockTicks = 100

// ProcStartTime reads field 22 (starttime) of /proc/pid/stat: with the pid, it names one process.
func ProcStartTime(pid int) (uint64, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// The command name (field 2) is in parentheses and may hold spaces and parentheses: the
	// fields after it start after the last ')'.
	i := bytes.LastIndexByte(data, ')')
	if i < 0 {
		return 0, fmt.Errorf("/proc/%d/stat: unexpected format", pid)
	}
	fields := strings.Fields(string(data[i+1:]))
	const idx = 22 - 3 // fields[0] is field 3 (state)
	if len(fields) <= idx {
		return 0, fmt.Errorf("/proc/%d/stat: unexpected format", pid)
	}
	return strconv.ParseUint(fields[idx], 10, 64)
}

// bootTime is the btime line of /proc/stat.
func bootTime() (time.Time, bool) {
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		return time.Time{}, false
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "btime "); ok {
			if n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64); err == nil {
				return time.Unix(n, 0), true
			}
		}
	}
	return time.Time{}, false
}
