package main

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/tiers"
)

// Kept spools (SPEC §10): an agent that stops cleanly keeps its spool when it holds committed
// checkpoints, so that its successor on the same mount restores from RAM. These commands show
// them and free them; a starting agent reaps those whose mount directory is gone.

const spoolSynopsis = "mtcfs spool list [--json] | mtcfs spool free PATH|--orphaned"

// spoolTmpfsSource is the source name of the tmpfs mounts agents make for their spools
// (tiers.OpenSpool).
const spoolTmpfsSource = "mtcfs-spool"

// spoolInfo is one spool as `mtcfs spool list` shows it.
type spoolInfo struct {
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
	// MountState is "exists", "gone", "not a directory" or "unknown" (no owner record).
	MountState  string `json:"mount_path_state"`
	MountExists bool   `json:"mount_path_exists"`
}

const (
	mountExists = "exists"
	mountGone   = "gone"
	mountNotDir = "not a directory"
	mountUnkown = "unknown"
)

// orphaned: the spool's mount directory no longer exists, so no agent will ever adopt it.
func (s spoolInfo) orphaned() bool { return s.MountState == mountGone || s.MountState == mountNotDir }

func cmdSpool(args []string) int {
	if len(args) == 0 || (args[0] != "list" && args[0] != "free") {
		fmt.Fprintf(os.Stderr, "Usage: %s\n", spoolSynopsis)
		if len(args) > 0 && (args[0] == "-h" || args[0] == "--help" || args[0] == "help") {
			return 0
		}
		return 2
	}
	if args[0] == "list" {
		return cmdSpoolList(args[1:])
	}
	return cmdSpoolFree(args[1:])
}

func cmdSpoolList(args []string) int {
	fset := newFlagSet("spool list", "mtcfs spool list [--json]")
	asJSON := fset.Bool("json", false, "print JSON")
	pos, err := parseFlags(fset, args)
	if err != nil {
		return flagError(fset, err)
	}
	if len(pos) != 0 {
		return flagError(fset, fmt.Errorf("unexpected argument %q", pos[0]))
	}
	spools, err := listSpools()
	if err != nil {
		fmt.Fprintln(os.Stderr, "mtcfs spool list:", err)
		return 1
	}
	if *asJSON {
		if spools == nil {
			spools = []spoolInfo{}
		}
		out, _ := json.MarshalIndent(spools, "", "  ")
		fmt.Println(string(out))
		return 0
	}
	printSpools(os.Stdout, spools)
	return 0
}

func printSpools(w io.Writer, spools []spoolInfo) {
	if len(spools) == 0 {
		fmt.Fprintln(w, "no mtcfs spools on this machine")
		return
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "SPOOL\tMOUNT PATH\tJOB\tSTEPS\tUSED\tAGENT\tMOUNT DIR")
	freeable := false
	for _, s := range spools {
		mp, job, steps, agent := s.MountPath, s.Job, "-", "none"
		if mp == "" {
			mp = "?"
		}
		if job == "" {
			job = "-"
		}
		if len(s.Steps) > 0 {
			parts := make([]string, len(s.Steps))
			for i, st := range s.Steps {
				parts[i] = strconv.FormatInt(st, 10)
			}
			steps = strings.Join(parts, ",")
		}
		switch {
		case s.InUse && s.AgentPID > 0:
			agent = fmt.Sprintf("serving (pid %d)", s.AgentPID)
		case s.InUse:
			agent = "serving"
		default:
			freeable = true
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", s.Dir, mp, job, steps, tiers.FormatSize(s.Bytes), agent, s.MountState)
	}
	tw.Flush()
	if freeable {
		fmt.Fprintln(w, "free one with: mtcfs spool free MOUNT-PATH|SPOOL; all whose mount directory is gone: mtcfs spool free --orphaned")
	}
}

func cmdSpoolFree(args []string) int {
	fset := newFlagSet("spool free", "mtcfs spool free PATH|--orphaned")
	orphaned := fset.Bool("orphaned", false, "free every spool not in use whose mount directory no longer exists")
	pos, err := parseFlags(fset, args)
	if err != nil {
		return flagError(fset, err)
	}
	switch {
	case *orphaned && len(pos) > 0:
		return flagError(fset, errors.New("give a PATH or --orphaned, not both"))
	case !*orphaned && len(pos) != 1:
		return flagError(fset, errors.New("want one PATH (a mount path or a spool directory), or --orphaned"))
	}
	spools, err := listSpools()
	if err != nil {
		fmt.Fprintln(os.Stderr, "mtcfs spool free:", err)
		return 1
	}
	var targets []spoolInfo
	if *orphaned {
		for _, s := range spools {
			if s.orphaned() && !s.InUse {
				targets = append(targets, s)
			}
		}
		if len(targets) == 0 {
			fmt.Println("no orphaned spools: every kept spool's mount directory still exists (mtcfs spool list shows them)")
			return 0
		}
	} else if targets, err = spoolsFor(pos[0], spools); err != nil {
		fmt.Fprintln(os.Stderr, "mtcfs spool free:", err)
		return 1
	}
	code := 0
	for _, s := range targets {
		if err := freeSpool(s); err != nil {
			fmt.Fprintln(os.Stderr, "mtcfs spool free:", err)
			code = 1
			continue
		}
		fmt.Printf("freed spool %s (%s)\n", s.Dir, s.describe())
	}
	return code
}

// describe names what a spool held, for messages and logs.
func (s spoolInfo) describe() string {
	mp, job := s.MountPath, s.Job
	if mp == "" {
		mp = "unknown"
	}
	if job == "" {
		job = "none"
	}
	return fmt.Sprintf("mount %s, job %s, %d checkpoint(s), %s", mp, job, len(s.Metas), tiers.FormatSize(s.Bytes))
}

// spoolsFor finds the spools PATH names: PATH is a spool directory, or a mount path whose
// spools (every spool recording it, and its default spool) are meant.
func spoolsFor(path string, spools []spoolInfo) ([]spoolInfo, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, err
	}
	real := tiers.ResolveMountPath(path)
	for _, s := range spools {
		if s.Dir == abs || s.Dir == real {
			return []spoolInfo{s}, nil
		}
	}
	var out []spoolInfo
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
	for _, d := range []string{real, tiers.DefaultSpoolDir(real)} {
		if !seen[d] && looksLikeSpool(d) {
			s, err := inspectSpool(d, nil, nil)
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

// freeSpool unmounts and removes a spool that no agent uses. It holds the spool's lock while
// doing so, so an agent starting on it meanwhile waits and then starts with an empty spool.
func freeSpool(s spoolInfo) error {
	if s.InUse {
		return refusal(s)
	}
	if euid := os.Geteuid(); euid != 0 && s.UID != euid {
		return fmt.Errorf("spool %s belongs to uid %d: only that user or root can free it", s.Dir, s.UID)
	}
	if !looksLikeSpool(s.Dir) {
		return fmt.Errorf("%s does not look like an mtcfs spool (no %s, no %s tmpfs, unknown entries): not removing it", s.Dir, tiers.OwnerFile, spoolTmpfsSource)
	}
	lock, err := tiers.LockSpool(s.Dir)
	if errors.Is(err, tiers.ErrSpoolInUse) {
		return refusal(s)
	}
	if err != nil {
		return err
	}
	defer lock.Close()
	for i := 0; i < 8 && isSpoolTmpfs(s.Dir); i++ { // a spool mounted twice is unmounted twice
		if err := unix.Unmount(s.Dir, unix.MNT_DETACH); err != nil {
			return fmt.Errorf("unmount spool tmpfs %s: %w", s.Dir, err)
		}
	}
	if err := os.RemoveAll(s.Dir); err != nil {
		return fmt.Errorf("remove spool %s: %w", s.Dir, err)
	}
	return nil
}

func refusal(s spoolInfo) error {
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

// reapOrphanedSpools frees, at agent start, the kept spools whose mount directory no longer
// exists: no agent will ever adopt them. A spool in use is never touched, nor is own (the
// spool this agent is about to open).
func reapOrphanedSpools(own string) {
	spools, err := listSpools()
	if err != nil {
		slog.Warn("cannot look for orphaned spools", "err", err)
		return
	}
	for _, s := range spools {
		if s.Dir == own || !s.orphaned() || s.InUse {
			continue
		}
		if err := freeSpool(s); err != nil {
			if _, e := os.Lstat(s.Dir); errors.Is(e, fs.ErrNotExist) {
				continue // another agent starting now reaped it first
			}
			slog.Warn("cannot reap a spool whose mount directory is gone", "spool", s.Dir, "mount", s.MountPath, "err", err)
			continue
		}
		slog.Info("reaped a kept spool whose mount directory no longer exists", "spool", s.Dir, "mount", s.MountPath,
			"mount_state", s.MountState, "job", s.Job, "steps", s.Steps, "bytes", s.Bytes)
	}
}

// listSpools finds this machine's spools (all of them as root, otherwise the user's own): the
// union of the spool tmpfs mounts, the directories with an owner record under the default
// spool roots, and the spools of the running agents.
func listSpools() ([]spoolInfo, error) {
	agents, err := localAgents()
	if err != nil {
		return nil, fmt.Errorf("agent registry %s: %w", agentsDir(), err)
	}
	dirs := map[string]bool{}
	for _, d := range spoolTmpfsMounts() {
		dirs[d] = true
	}
	roots := []string{tiers.DefaultSpoolRoot()}
	if os.Geteuid() == 0 {
		more, _ := filepath.Glob("/dev/shm/mtcfs-*") // the per-user roots of non-root agents
		roots = append(roots, more...)
	}
	for _, root := range roots {
		ents, _ := os.ReadDir(root)
		for _, e := range ents {
			d := filepath.Join(root, e.Name())
			if _, err := os.Lstat(filepath.Join(d, tiers.OwnerFile)); e.IsDir() && err == nil {
				dirs[d] = true
			}
		}
	}
	for _, a := range agents {
		if a.SpoolDir != "" {
			dirs[a.SpoolDir] = true
		}
	}
	procs := mountProcesses()
	var out []spoolInfo
	for d := range dirs {
		s, err := inspectSpool(d, agents, procs)
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

// inspectSpool describes the spool at dir. agents are the live local agents and procs the
// running mount processes (nil: look them up).
func inspectSpool(dir string, agents []agentInfo, procs []mountProc) (spoolInfo, error) {
	s := spoolInfo{Dir: dir, MountState: mountUnkown, Steps: []int64{}, Metas: []string{}}
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return s, err
	}
	s.UID = int(st.Uid)
	if o, err := tiers.ReadOwner(dir); err == nil {
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
	for st := range steps {
		s.Steps = append(s.Steps, st)
	}
	sort.Slice(s.Steps, func(i, j int) bool { return s.Steps[i] < s.Steps[j] })
	if s.Job == "" && len(jobs) == 1 { // a spool without an owner record: the .meta names tell
		for j := range jobs {
			s.Job = j
		}
	}
	s.Tmpfs = isSpoolTmpfs(dir)
	if s.Tmpfs {
		var fsst unix.Statfs_t
		if unix.Statfs(dir, &fsst) == nil {
			s.Bytes = int64(fsst.Blocks-fsst.Bfree) * fsst.Bsize
		}
	} else {
		s.Bytes = treeBytes(dir)
	}
	if s.MountPath != "" {
		s.MountState = mountPathState(s.MountPath)
		s.MountExists = s.MountState == mountExists
	}
	s.InUse, s.AgentPID = spoolUser(s, agents, procs)
	return s, nil
}

// spoolUser tells whether an agent uses the spool now and, if known, its pid: the spool's lock
// is held, a live agent registered it, or an mtcfs mount process runs with it (agents that
// predate spool locks and records; agents still starting).
func spoolUser(s spoolInfo, agents []agentInfo, procs []mountProc) (bool, int) {
	if agents == nil {
		agents, _ = localAgents()
	}
	if procs == nil {
		procs = mountProcesses()
	}
	for _, a := range agents {
		if a.SpoolDir == s.Dir {
			return true, a.PID
		}
	}
	lock, err := tiers.LockSpool(s.Dir)
	if errors.Is(err, tiers.ErrSpoolInUse) {
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
		if spool != "" {
			mp.spools = append(mp.spools, abs(spool))
		} else if dir != "" {
			d := abs(dir)
			mp.spools = append(mp.spools, tiers.DefaultSpoolDir(d), legacyDefaultSpoolDir(d))
		}
		out = append(out, mp)
	}
	return out
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

// mountPathState says whether a spool's mount directory still exists. Anything but a clear
// "not there" (ENOENT, ENOTDIR, or not a directory) counts as existing: a stale FUSE mount
// answers ENOTCONN, an unreadable parent EACCES, and neither means the mount is gone.
func mountPathState(p string) string {
	fi, err := os.Lstat(p)
	switch {
	case err == nil && fi.IsDir():
		return mountExists
	case err == nil:
		return mountNotDir
	case errors.Is(err, fs.ErrNotExist), errors.Is(err, unix.ENOTDIR):
		return mountGone
	}
	return mountExists
}

// looksLikeSpool guards the removal of a directory: it must be a spool tmpfs, or look exactly
// like a spool: a files/ directory, nothing but directories besides the owner record (which,
// when present, must parse and name another path as its mount), and not a FUSE mount.
func looksLikeSpool(dir string) bool {
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
		case name == tiers.OwnerFile:
			o, err := tiers.ReadOwner(dir)
			if err != nil || o.MountPath == "" || o.MountPath == dir {
				return false
			}
		case strings.HasPrefix(name, "."+tiers.OwnerFile+".tmp-"):
		case !e.IsDir():
			return false
		case name == "files":
			hasFiles = true
		}
	}
	return hasFiles
}

// spoolTmpfsMounts lists the mount points of spool tmpfs mounts (source mtcfs-spool).
func spoolTmpfsMounts() []string {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	seen := map[string]bool{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		// id parent major:minor root mountpoint options [optional...] - fstype source superopts
		fields := strings.Fields(sc.Text())
		sep := -1
		for i, x := range fields {
			if x == "-" {
				sep = i
				break
			}
		}
		if sep < 5 || sep+2 >= len(fields) || fields[sep+1] != "tmpfs" || fields[sep+2] != spoolTmpfsSource {
			continue
		}
		if p := unescapeMountinfo(fields[4]); !seen[p] {
			seen[p] = true
			out = append(out, p)
		}
	}
	return out
}

func isSpoolTmpfs(dir string) bool {
	for _, p := range spoolTmpfsMounts() {
		if p == dir {
			return true
		}
	}
	return false
}

// unescapeMountinfo undoes the octal escapes (\040 for a space) of /proc/self/mountinfo.
func unescapeMountinfo(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// treeBytes is the size of the distinct files below dir (hard links counted once: sealed data
// shares its bytes with the files it was made from).
func treeBytes(dir string) int64 {
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
