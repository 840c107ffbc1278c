package tiers

// Kept spools (SPEC §10): an agent that stops cleanly keeps its spool when it holds committed
// checkpoints, so that its successor on the same mount restores from RAM (Spool.Release). Spools
// lists them and frees them (mtcfs spool list|free); a starting agent reaps those whose mount
// directory is gone.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/internal/fusectl"
	"github.com/mtcfs/mtcfs/layout"
)

// spoolTmpfsSource is the source name of the tmpfs mounts agents make for their spools
// (OpenSpool).
const spoolTmpfsSource = "mtcfs-spool"

// SpoolInfo is one spool as `mtcfs spool list` shows it.
type SpoolInfo struct {
	Dir       string     `json:"spool"`
	MountPath string     `json:"mount_path"` // "" when the spool predates owner records
	Job       string     `json:"job"`
	Steps     []int64    `json:"steps"`
	Metas     []string   `json:"metas"`
	Bytes     int64      `json:"bytes"`
	Tmpfs     bool       `json:"tmpfs"`
	UID       int        `json:"uid"`
	LastUsed  *time.Time `json:"last_used,omitempty"`
	// InUse: an agent holds the spool now (its lock, or a live agent registered with it).
	InUse    bool `json:"in_use"`
	AgentPID int  `json:"agent_pid,omitempty"`
	// MountState is MountExists, MountGone, MountNotDir or MountUnknown (no owner record).
	MountState  string `json:"mount_path_state"`
	MountExists bool   `json:"mount_path_exists"`
}

// The states of a spool's mount directory (SpoolInfo.MountState).
const (
	MountExists  = "exists"
	MountGone    = "gone"
	MountNotDir  = "not a directory"
	MountUnknown = "unknown"
)

// Orphaned: the spool's mount directory no longer exists, so no agent will ever adopt it.
func (s SpoolInfo) Orphaned() bool { return s.MountState == MountGone || s.MountState == MountNotDir }

// Describe names what a spool held, for messages and logs.
func (s SpoolInfo) Describe() string {
	mp, job := s.MountPath, s.Job
	if mp == "" {
		mp = "unknown"
	}
	if job == "" {
		job = "none"
	}
	return fmt.Sprintf("mount %s, job %s, %d checkpoint(s), %s", mp, job, len(s.Metas), FormatSize(s.Bytes))
}

// SpoolUser is a running agent and the spool it serves (from the local agent registry).
type SpoolUser struct {
	PID      int
	SpoolDir string
}

// Spools finds, describes and frees the spools of this machine: all of them as root, otherwise
// the user's own.
type Spools struct {
	// Users lists the running agents; an error fails List. Nil: none known.
	Users func() ([]SpoolUser, error)
	// Dirs, when set, replaces the search of the machine (spool tmpfs mounts and the default
	// spool roots) with these directories; the agents' spools are added either way. For tests,
	// which must not find (and reap) spools that are not theirs.
	Dirs func() []string
}

func (h Spools) users() ([]SpoolUser, error) {
	if h.Users == nil {
		return nil, nil
	}
	return h.Users()
}

// Find returns the spools path names, among spools (from List) and beyond: path is a spool
// directory, or a mount path whose spools (every spool recording it, and its default spool) are
// meant.
func (h Spools) Find(path string, spools []SpoolInfo) ([]SpoolInfo, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, err
	}
	real := ResolveMountPath(path)
	for _, s := range spools {
		if s.Dir == abs || s.Dir == real {
			return []SpoolInfo{s}, nil
		}
	}
	var out []SpoolInfo
	var notOurs error
	seen := map[string]bool{}
	for _, s := range spools {
		if s.MountPath == real {
			out = append(out, s)
			seen[s.Dir] = true
		}
	}
	// A spool that no discovery finds but that is unmistakably one (e.g. a non-root agent's
	// --spool outside the default root, or a default spool made before owner records).
	for _, d := range []string{real, DefaultSpoolDir(real)} {
		if !seen[d] && looksLikeSpool(d) {
			s, err := h.inspect(d, nil, nil, nil)
			if err != nil {
				return nil, err
			}
			if s.UID != os.Geteuid() && os.Geteuid() != 0 {
				notOurs = fmt.Errorf("spool %s belongs to uid %d: only that user or root can free it", d, s.UID)
				continue
			}
			out = append(out, s)
			seen[d] = true
		}
	}
	if len(out) == 0 && notOurs != nil {
		return nil, notOurs
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no mtcfs spool found for %s: give a mount path or a spool directory that mtcfs spool list shows", path)
	}
	return out, nil
}

// Settle waits, at most wait, while s is in use by an agent that is exiting (kill -9 a moment
// ago: SIGKILL pending, a zombie, or gone while its lock is released), and returns s as it is
// then. A spool in use by a live agent is returned at once. Before, `mtcfs spool free` right
// after a kill -9 refused, naming the dying agent as running.
func (h Spools) Settle(s SpoolInfo, wait time.Duration) SpoolInfo {
	deadline := time.Now().Add(wait)
	for s.InUse && s.AgentPID > 0 && pidExiting(s.AgentPID) && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
		s.InUse, s.AgentPID = h.user(s, nil, nil)
	}
	return s
}

// pidExiting reports whether process pid is gone or exiting (exitingStatus).
func pidExiting(pid int) bool {
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	return err != nil || exitingStatus(string(status))
}

// FreeSpool unmounts and removes a spool that no agent uses. It holds the spool's lock while
// doing so, so an agent starting on it meanwhile waits and then starts with an empty spool.
func FreeSpool(s SpoolInfo) error {
	if s.InUse {
		return refusal(s)
	}
	if euid := os.Geteuid(); euid != 0 && s.UID != euid {
		return fmt.Errorf("spool %s belongs to uid %d: only that user or root can free it", s.Dir, s.UID)
	}
	if !looksLikeSpool(s.Dir) {
		return fmt.Errorf("%s does not look like an mtcfs spool (no %s, no %s tmpfs, unknown entries): not removing it", s.Dir, OwnerFile, spoolTmpfsSource)
	}
	lock, err := LockSpool(s.Dir)
	if errors.Is(err, ErrSpoolInUse) {
		return refusal(s)
	}
	if err != nil {
		return err
	}
	defer lock.Close()
	unmounted := false
	for i := 0; i < 8 && isSpoolTmpfs(s.Dir); i++ { // a spool mounted twice is unmounted twice
		if err := unix.Unmount(s.Dir, unix.MNT_DETACH); err != nil {
			return fmt.Errorf("unmount spool tmpfs %s: %w", s.Dir, err)
		}
		unmounted = true
	}
	return removeSpoolDir(s.Dir, unmounted)
}

func refusal(s SpoolInfo) error {
	who := "a running mtcfs agent"
	if s.AgentPID > 0 {
		who = fmt.Sprintf("the running mtcfs agent pid %d", s.AgentPID)
	}
	mp := s.MountPath
	if mp == "" {
		mp = "its mount"
	}
	return fmt.Errorf("spool %s is in use by %s serving %s: stop that agent first (SIGTERM; it keeps the spool if it holds checkpoints), then free it", s.Dir, who, mp)
}

// ReapGrace is how long a kept spool whose mount directory is gone must have been unused before
// a starting agent reaps it: a mount directory removed and made again between an agent's stop
// and its next start (a pod's emptyDir made anew, a user's rm -rf and mkdir) cost the
// checkpoints when any other agent started in between (found by a black-box run).
const ReapGrace = 10 * time.Minute

// lastUsed is when the spool was last used, as far as can be told: its owner record's time,
// or a later change of its directory, files or commit records.
func lastUsed(s SpoolInfo) time.Time {
	var t time.Time
	if s.LastUsed != nil {
		t = *s.LastUsed
	}
	for _, p := range []string{s.Dir, filepath.Join(s.Dir, "files"), filepath.Join(s.Dir, commitsDir)} {
		if fi, err := os.Stat(p); err == nil && fi.ModTime().After(t) {
			t = fi.ModTime()
		}
	}
	return t
}

// ReapOrphaned frees, at agent start, the kept spools whose mount directory no longer exists
// and that have not been used for ReapGrace: no agent will ever adopt them. A spool in use is
// never touched, nor is own (the spool this agent is about to open). It returns how long until
// the youngest orphan it kept is due (0: none), for the agent to look again then: an orphan's
// RAM is not held until some later start.
func (h Spools) ReapOrphaned(own string, log *slog.Logger) (again time.Duration) {
	spools, err := h.List()
	if err != nil {
		log.Warn("cannot look for orphaned spools", "err", err)
		return 0
	}
	for _, s := range spools {
		if s.Dir == own || !s.Orphaned() || s.InUse {
			continue
		}
		if idle := time.Since(lastUsed(s)); idle < ReapGrace {
			if due := ReapGrace - idle + time.Second; again == 0 || due < again {
				again = due
			}
			log.Info("a kept spool's mount directory is gone; the spool is kept until it has been unused for the grace time (mtcfs spool free --orphaned frees it now)",
				"spool", s.Dir, "mount", s.MountPath, "job", s.Job, "unused_for", idle.Round(time.Second).String(), "grace", ReapGrace.String())
			continue
		}
		if err := FreeSpool(s); err != nil {
			if _, e := os.Lstat(s.Dir); errors.Is(e, fs.ErrNotExist) {
				continue // another agent starting now reaped it first
			}
			log.Warn("cannot reap a spool whose mount directory is gone", "spool", s.Dir, "mount", s.MountPath, "err", err)
			continue
		}
		log.Info("reaped a kept spool whose mount directory no longer exists", "spool", s.Dir, "mount", s.MountPath,
			"mount_state", s.MountState, "job", s.Job, "steps", s.Steps, "bytes", s.Bytes)
	}
	return again
}

// KeptFor finds the one kept spool, not in use and not the mount path's default spool, that
// records mountPath: a mount moved while its agent served it (Spool.MountMoved).
func (h Spools) KeptFor(mountPath string) (SpoolInfo, bool) {
	spools, err := h.List()
	if err != nil {
		return SpoolInfo{}, false
	}
	real, def := ResolveMountPath(mountPath), DefaultSpoolDir(mountPath)
	var found []SpoolInfo
	for _, s := range spools {
		// Only this user's, in this user's default root: root lists users' spools too, and
		// took a user's moved spool, hiding it under a tmpfs of its own (found by a review).
		if s.MountPath == real && s.Dir != def && !s.InUse && s.UID == os.Geteuid() && filepath.Dir(s.Dir) == DefaultSpoolRoot() {
			found = append(found, s)
		}
	}
	if len(found) != 1 {
		return SpoolInfo{}, false
	}
	return found[0], true
}

// ReapOrphanedLater runs ReapOrphaned again after again, and so on while it keeps orphans that
// are not due yet, until ctx ends.
func (h Spools) ReapOrphanedLater(ctx context.Context, own string, again time.Duration, log *slog.Logger) {
	for again > 0 {
		t := time.NewTimer(again)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		again = h.ReapOrphaned(own, log)
	}
}

// List finds the spools: the union of the spool tmpfs mounts, the directories with an owner
// record under the default spool roots, and the spools of the running agents.
func (h Spools) List() ([]SpoolInfo, error) { return h.list(nil) }

// Orphaned lists the spools List would whose owner record names a mount directory that no
// longer exists, inspecting only those: a restore asks at every start (ReplicatorConfig.
// KeptSpools), and inspecting a spool without its own tmpfs walks all its files (a review). A
// mount directory that is a mount point is not looked at (a stopped agent's FUSE mount would
// hang the look: a review), nor one that does not answer within mountStatTimeout.
func (h Spools) Orphaned() ([]SpoolInfo, error) { return h.OrphanedOrOf("", "") }

// OrphanedOrOf lists what Orphaned does and the spools but own whose owner record names
// mountPath (the mount directory of the agent asking, which may run with another spool: a
// --spool changed between two starts left the job's steps in the old one, and its restore said
// nothing; found by a black-box run). own, the asking agent's spool, is not inspected: without
// a tmpfs that walks all its files, at every restore (a review).
func (h Spools) OrphanedOrOf(mountPath, own string) ([]SpoolInfo, error) {
	return h.list(func(dir string, mounts mountTable) bool {
		if own != "" && filepath.Clean(dir) == filepath.Clean(own) {
			return false
		}
		o, err := ReadOwner(dir)
		if err != nil || o.MountPath == "" {
			return false
		}
		return (mountPath != "" && o.MountPath == mountPath) || mountPathState(o.MountPath, mounts) == MountGone
	})
}

// list is List over the spools keep accepts (nil: all); keep gets the mount table read once.
func (h Spools) list(keep func(dir string, mounts mountTable) bool) ([]SpoolInfo, error) {
	agents, err := h.users()
	if err != nil {
		return nil, err
	}
	dirs := map[string]bool{}
	var roots []string
	mounts := readMounts() // once for every spool below
	if h.Dirs != nil {
		for _, d := range h.Dirs() {
			dirs[d] = true
		}
	} else {
		for _, d := range mounts.spoolTmpfs() {
			dirs[d] = true
		}
		roots = []string{DefaultSpoolRoot()}
		if os.Geteuid() == 0 {
			more, _ := filepath.Glob("/dev/shm/mtcfs-*") // the per-user roots of non-root agents
			roots = append(roots, more...)
		}
	}
	for _, root := range roots {
		ents, _ := os.ReadDir(root)
		for _, e := range ents {
			d := filepath.Join(root, e.Name())
			if _, err := os.Lstat(filepath.Join(d, OwnerFile)); e.IsDir() && err == nil {
				dirs[d] = true
			}
		}
	}
	for _, a := range agents {
		if a.SpoolDir != "" {
			dirs[a.SpoolDir] = true
		}
	}
	if keep != nil {
		for d := range dirs {
			if !keep(d, mounts) {
				delete(dirs, d)
			}
		}
		if len(dirs) == 0 {
			return nil, nil
		}
	}
	procs := mountProcesses()
	var out []SpoolInfo
	for d := range dirs {
		s, err := h.inspect(d, agents, procs, mounts)
		if err != nil {
			continue // vanished meanwhile, or not ours to read
		}
		if euid := os.Geteuid(); euid != 0 && s.UID != euid {
			continue
		}
		out = append(out, s)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Dir < out[j].Dir })
	return out, nil
}

// inspect describes the spool at dir. agents are the running agents, procs the running mount
// processes and mounts the mount table (nil: look them up).
func (h Spools) inspect(dir string, agents []SpoolUser, procs []mountProc, mounts mountTable) (SpoolInfo, error) {
	if mounts == nil {
		mounts = readMounts()
	}
	s := SpoolInfo{Dir: dir, MountState: MountUnknown, Steps: []int64{}, Metas: []string{}}
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return s, err
	}
	s.UID = int(st.Uid)
	if o, err := ReadOwner(dir); err == nil {
		s.MountPath, s.Job = o.MountPath, o.Job
		if !o.LastUsed.IsZero() {
			lu := o.LastUsed
			s.LastUsed = &lu
		}
		if o.PID > 0 {
			s.AgentPID = o.PID
		}
	}
	jobs := map[string]bool{}
	steps := map[int64]bool{}
	ents, _ := os.ReadDir(filepath.Join(dir, "meta"))
	for _, e := range ents {
		m, ok := layout.ParseMarkerName(e.Name())
		if !ok || m.Kind != layout.MarkerMeta {
			continue
		}
		s.Metas = append(s.Metas, e.Name())
		steps[m.Step] = true
		jobs[m.Job] = true
	}
	// Steps committed and recorded, not sealed yet (the agent stopped first; the next one seals
	// them) are in the spool too: a stop while the job saved left steps 6 to 14 listed as 5,
	// and `spool free` named 5 alone as lost (a black-box run).
	recs, _ := filepath.Glob(filepath.Join(dir, commitsDir, "*", commitRecordName))
	for _, p := range recs {
		var rec commitRecord
		if b, err := os.ReadFile(p); err == nil && json.Unmarshal(b, &rec) == nil && rec.Job != "" {
			steps[rec.Step] = true
			jobs[rec.Job] = true
		}
	}
	for st := range steps {
		s.Steps = append(s.Steps, st)
	}
	sort.Slice(s.Steps, func(i, j int) bool { return s.Steps[i] < s.Steps[j] })
	if s.Job == "" && len(jobs) == 1 { // a spool without an owner record: the .meta names tell
		for j := range jobs {
			s.Job = j
		}
	}
	s.Tmpfs = mounts.isSpoolTmpfs(dir)
	if s.Tmpfs {
		var fsst unix.Statfs_t
		if unix.Statfs(dir, &fsst) == nil {
			s.Bytes = int64(fsst.Blocks-fsst.Bfree) * fsst.Bsize
			if fi, err := os.Stat(filepath.Join(dir, HeadroomFile)); err == nil {
				s.Bytes -= fi.Size() // room the running agent keeps, not the job's
			}
		}
	} else {
		s.Bytes = distinctFileBytes(dir)
	}
	if s.MountPath != "" {
		s.MountState = mountPathState(s.MountPath, mounts)
		s.MountExists = s.MountState == MountExists
	}
	s.InUse, s.AgentPID = h.user(s, agents, procs)
	return s, nil
}

// user tells whether an agent uses the spool now and, if known, its pid: the spool's lock is
// held, a live agent registered it, or an mtcfs mount process runs with it (agents that predate
// spool locks and records; agents still starting).
func (h Spools) user(s SpoolInfo, agents []SpoolUser, procs []mountProc) (bool, int) {
	if agents == nil {
		agents, _ = h.users()
	}
	if procs == nil {
		procs = mountProcesses()
	}
	for _, a := range agents {
		if a.SpoolDir == s.Dir {
			return true, a.PID
		}
	}
	lock, err := LockSpool(s.Dir)
	if errors.Is(err, ErrSpoolInUse) {
		return true, s.AgentPID // the pid recorded by the agent that opened it
	}
	if err == nil {
		defer lock.Close()
	}
	for _, p := range procs {
		for _, d := range p.spools {
			if d == s.Dir {
				return true, p.pid
			}
		}
	}
	return false, 0
}

// mountProc is a running "mtcfs mount" process and the spool directories it may use.
type mountProc struct {
	pid    int
	dir    string // its mount directory, absolute ("" if its command line names none)
	spools []string
}

// mountProcesses finds the running "mtcfs mount" processes from their command lines: the
// spool each uses is its --spool, or the default derived from its mount directory (as this
// version derives it, and as versions that did not resolve symlinks did).
func mountProcesses() []mountProc {
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	var out []mountProc
	for _, p := range procs {
		data, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		argv := strings.Split(strings.TrimRight(string(data), "\x00"), "\x00")
		if len(argv) < 3 || !strings.Contains(filepath.Base(argv[0]), "mtcfs") || argv[1] != "mount" {
			continue
		}
		pid, err := strconv.Atoi(filepath.Base(filepath.Dir(p)))
		if err != nil || pid == os.Getpid() {
			continue
		}
		cwd, _ := os.Readlink(filepath.Join(filepath.Dir(p), "cwd"))
		abs := func(x string) string {
			if filepath.IsAbs(x) || cwd == "" {
				return filepath.Clean(x)
			}
			return filepath.Join(cwd, x)
		}
		var spool, dir string
		for i := 2; i < len(argv); i++ {
			a := argv[i]
			switch {
			case a == "--spool" || a == "-spool":
				if i+1 < len(argv) {
					spool = argv[i+1]
					i++
				}
			case strings.HasPrefix(a, "--spool=") || strings.HasPrefix(a, "-spool="):
				_, spool, _ = strings.Cut(a, "=")
			case strings.HasPrefix(a, "-"):
				if !strings.Contains(a, "=") && i+1 < len(argv) && !strings.HasPrefix(argv[i+1], "-") && !isBoolMountFlag(a) {
					i++ // the flag's value
				}
			case dir == "":
				dir = a
			}
		}
		mp := mountProc{pid: pid}
		if dir != "" {
			mp.dir = abs(dir)
		}
		if spool != "" {
			mp.spools = append(mp.spools, abs(spool))
		} else if dir != "" {
			d := abs(dir)
			mp.spools = append(mp.spools, DefaultSpoolDir(d), legacyDefaultSpoolDir(d))
		}
		out = append(out, mp)
	}
	return out
}

// MountProcessFor returns the pid of a running "mtcfs mount" process (not this one) whose mount
// directory is dir (absolute, symlinks resolved as ResolveMountPath does), or 0. A process that is
// exiting (a zombie, or SIGKILL pending: a killed agent whose exit waits on a thread stuck in the
// kernel) does not count.
func MountProcessFor(dir string) int {
	for _, mp := range mountProcesses() {
		if mp.dir == "" || (mp.dir != dir && ResolveMountPath(mp.dir) != dir) {
			continue
		}
		if status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", mp.pid)); err == nil && !exitingStatus(string(status)) {
			return mp.pid
		}
	}
	return 0
}

// exitingStatus reports whether a /proc/PID/status text is of a zombie or dead process, or of
// one with SIGKILL pending (for the whole process, ShdPnd, or its main thread, SigPnd).
func exitingStatus(status string) bool {
	for _, line := range strings.Split(status, "\n") {
		k, v, _ := strings.Cut(line, ":")
		v = strings.TrimSpace(v)
		switch k {
		case "State":
			if strings.HasPrefix(v, "Z") || strings.HasPrefix(v, "X") {
				return true
			}
		case "SigPnd", "ShdPnd":
			if mask, err := strconv.ParseUint(v, 16, 64); err == nil && mask&(1<<(unix.SIGKILL-1)) != 0 {
				return true
			}
		}
	}
	return false
}

func isBoolMountFlag(a string) bool {
	switch strings.TrimLeft(a, "-") {
	case "xattrs", "debug-fuse":
		return true
	}
	return false
}

// legacyDefaultSpoolDir is the default spool of agents that did not resolve symlinks in the
// mount path.
func legacyDefaultSpoolDir(abs string) string {
	sum := sha256.Sum256([]byte(abs))
	base := filepath.Base(abs)
	if base == "/" || base == "." {
		base = "root"
	}
	return filepath.Join("/dev/shm", "mtcfs", base+"-"+hex.EncodeToString(sum[:6]))
}

// OwnerMountState returns the mount directory the spool at dir records (its owner record; ""
// when none) and whether that directory exists (MountExists, MountGone, MountNotDir), as spool
// list tells, without waiting on a stopped agent's mount.
func OwnerMountState(dir string) (Owner, string) {
	o, err := ReadOwner(dir)
	if err != nil || o.MountPath == "" {
		return o, MountUnknown
	}
	return o, mountPathState(o.MountPath, readMounts())
}

// mountStatTimeout bounds mountPathState's lstat.
var mountStatTimeout = 2 * time.Second

// mountPathState says whether a spool's mount directory still exists. Anything but a clear
// "not there" (ENOENT, ENOTDIR, or not a directory) counts as existing: a stale FUSE mount
// answers ENOTCONN, an unreadable parent EACCES, and neither means the mount is gone.
//
// A mount point exists, and is not looked at: the mount path of another agent's spool is that
// agent's mount, and if the agent is stopped (SIGSTOP, a frozen cgroup, a debugger), a stat of
// the mount's root waits for it to answer, unkillably but by SIGKILL. Every agent starting on the
// machine (ReapOrphaned) and every spool command would wait with it. A path that is not a mount
// point can still lie below one; its lstat is given mountStatTimeout, and one that does not
// answer by then counts as existing (its goroutine is left waiting). mounts is the mount table.
func mountPathState(p string, mounts mountTable) string {
	if mounts.isMountPoint(p) {
		return MountExists
	}
	type result struct {
		fi  fs.FileInfo
		err error
	}
	done := make(chan result, 1)
	go func() {
		fi, err := os.Lstat(p)
		done <- result{fi, err}
	}()
	var fi fs.FileInfo
	var err error
	select {
	case r := <-done:
		fi, err = r.fi, r.err
	case <-time.After(mountStatTimeout):
		return MountExists
	}
	switch {
	case err == nil && fi.IsDir():
		return MountExists
	case err == nil:
		return MountNotDir
	case errors.Is(err, fs.ErrNotExist), errors.Is(err, unix.ENOTDIR):
		return MountGone
	}
	return MountExists
}

// looksLikeSpool guards the removal of a directory: it must be a spool tmpfs, or look exactly
// like a spool: a files/ directory, nothing but directories besides the owner record (which,
// when present, must parse and name another path as its mount), and not a FUSE mount.
// isSpoolFile tells whether name is a regular file a spool's root holds: the records beside the
// owner's (the job's shape, the agent's headroom) and their temporaries.
func isSpoolFile(name string) bool {
	switch name {
	case ShapeFile, "." + ShapeFile + ".tmp", HeadroomFile:
		return true
	}
	return strings.HasPrefix(name, "."+OwnerFile+".tmp-")
}

func looksLikeSpool(dir string) bool {
	// A FUSE mount is no spool, and is not touched: the lstat of one whose agent is stopped
	// (SIGSTOP) waits for it, and `mtcfs spool free MOUNT` hung there (found by a black-box run).
	if slices.ContainsFunc(readMounts(), func(m fusectl.Mount) bool { return m.Point == dir && m.IsFUSE() }) {
		return false
	}
	fi, err := os.Lstat(dir)
	if err != nil || !fi.IsDir() {
		return false
	}
	if isSpoolTmpfs(dir) {
		return true
	}
	var fsst unix.Statfs_t
	if unix.Statfs(dir, &fsst) != nil || fsst.Type == unix.FUSE_SUPER_MAGIC {
		return false
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return false
	}
	hasFiles := false
	for _, e := range ents {
		switch name := e.Name(); {
		case name == OwnerFile:
			o, err := ReadOwner(dir)
			if err != nil || o.MountPath == "" || o.MountPath == dir {
				return false
			}
		case !e.IsDir() && !isSpoolFile(name):
			return false
		case name == "files":
			hasFiles = true
		}
	}
	return hasFiles
}

// mountTable is this mount namespace's mount table (fusectl.Mounts).
type mountTable []fusectl.Mount

// readMounts reads the mount table; empty (not nil) if it cannot be read.
func readMounts() mountTable {
	m, _ := fusectl.Mounts()
	if m == nil {
		return mountTable{}
	}
	return m
}

func isSpoolTmpfsMount(m fusectl.Mount) bool {
	return m.FSType == "tmpfs" && m.Source == spoolTmpfsSource
}

// spoolTmpfs lists the mount points of spool tmpfs mounts (source mtcfs-spool), each once.
func (t mountTable) spoolTmpfs() []string {
	var out []string
	for _, m := range t {
		if isSpoolTmpfsMount(m) && !slices.Contains(out, m.Point) {
			out = append(out, m.Point)
		}
	}
	return out
}

// isSpoolTmpfs tells whether a spool tmpfs is mounted at dir.
func (t mountTable) isSpoolTmpfs(dir string) bool {
	return slices.ContainsFunc(t, func(m fusectl.Mount) bool { return m.Point == dir && isSpoolTmpfsMount(m) })
}

// isMountPoint tells whether anything is mounted at p.
func (t mountTable) isMountPoint(p string) bool {
	return slices.ContainsFunc(t, func(m fusectl.Mount) bool { return m.Point == p })
}

// isSpoolTmpfs tells whether a spool tmpfs is mounted at dir now.
func isSpoolTmpfs(dir string) bool { return readMounts().isSpoolTmpfs(dir) }

// findable reports whether List finds the spool at dir without a running agent: a spool tmpfs,
// or a directory of the default root.
func findable(dir string) bool {
	return isSpoolTmpfs(dir) || filepath.Dir(dir) == DefaultSpoolRoot()
}

// distinctFileBytes is the size of the distinct files below dir (hard links counted once: sealed data
// shares its bytes with the files it was made from).
func distinctFileBytes(dir string) int64 {
	var total int64
	seen := map[[2]uint64]bool{}
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return nil
		}
		var st unix.Stat_t
		if unix.Lstat(p, &st) != nil {
			return nil
		}
		key := [2]uint64{uint64(st.Dev), st.Ino}
		if !seen[key] {
			seen[key] = true
			total += st.Size
		}
		return nil
	})
	return total
}

// Release ends the agent's use of the spool: it keeps the spool for the next agent when it holds
// committed checkpoints (so a restarted agent restores from RAM) or records a job's incarnation
// (Owner.Running: the next agent tells that job, if it still runs, to restart), and frees it
// otherwise — also when its mount directory is gone, since no agent would ever adopt it then.
func (s *Spool) Release(log *slog.Logger) {
	metas, _ := os.ReadDir(filepath.Join(s.Dir(), "meta"))
	pending := pendingCommits(s.Dir())
	owner := s.Owner()
	mountPath := owner.MountPath
	if len(metas)+pending > 0 || owner.Running != nil {
		state := MountExists
		if mountPath != "" {
			state = mountPathState(mountPath, readMounts())
		}
		if state == MountExists {
			s.Detach()
			target := mountPath
			if target == "" || !findable(s.Dir()) {
				// A non-root agent's --spool outside the default root is a plain directory that
				// no discovery finds once the agent is gone: `spool free MOUNT` said it found
				// nothing to free (found by a re-check helper).
				target = s.Dir()
			}
			why := "it holds committed checkpoints"
			if len(metas)+pending == 0 {
				why = "it records that job " + owner.Job + " was running, for the next agent to tell it to restart"
			}
			log.Info("spool kept for the next agent on this mount: "+why+"; free it with: mtcfs spool free "+shellQuote(target),
				"spool", s.Dir(), "mount", mountPath, "metas", len(metas), "unsealed_commits", pending)
			return
		}
		log.Warn("freeing the spool although it holds committed checkpoints: its mount directory is "+state+", so no agent would adopt them",
			"spool", s.Dir(), "mount", mountPath, "metas", len(metas))
	}
	if err := s.Close(); err != nil {
		log.Error("release spool", "err", err)
	}
}

// shellQuote quotes p for a command line a user copies, when it needs quoting.
func shellQuote(p string) string {
	if p != "" && strings.Trim(p, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789/._-+=,:@") == "" {
		return p
	}
	return "'" + strings.ReplaceAll(p, "'", `'\''`) + "'"
}

// pendingCommits counts the commit records (spool/commits/*/commit.json) not yet turned into a
// .meta: a commit that returned to the job must survive the stop as well.
func pendingCommits(spoolDir string) int {
	recs, _ := filepath.Glob(filepath.Join(spoolDir, commitsDir, "*", commitRecordName))
	return len(recs)
}
