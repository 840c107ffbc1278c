package main

// Kept spools (SPEC §10): mtcfs spool list|free, reaping at agent start, the stop log line; and
// the agent registry surviving pid reuse, and mounts reached through a symlink.

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mtcfs/mtcfs/internal/agents"
	"github.com/mtcfs/mtcfs/internal/jobsim"
	"github.com/mtcfs/mtcfs/tiers"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// keptSpoolNode runs an agent on a new node, saves step 10 of job, and stops the agent
// cleanly, so that the node's spool is kept holding that step.
func keptSpoolNode(t *testing.T, job string) (repNode, *agent) {
	t.Helper()
	ctx := repCtx(t)
	n := newRepNode(t)
	a := n.start(t)
	o := orbaxClient(t, n.dir, job, 60)
	_, _, err := o.Start(ctx)
	require.NoError(t, err)
	require.NoError(t, o.Save(ctx, 10))
	waitStepSealed(t, n.dir, job, 10)
	stopAgent(t, a)
	require.True(t, isMounted(n.spool), "a spool holding a checkpoint is kept on a clean stop\n%s", a.log())
	return n, a
}

// spoolList runs mtcfs spool list --json.
func spoolList(t *testing.T) []tiers.SpoolInfo {
	t.Helper()
	out, code := runMtcfs(t, "spool", "list", "--json")
	require.Equal(t, 0, code, "spool list: %s", out)
	var list []tiers.SpoolInfo
	require.NoError(t, json.Unmarshal([]byte(out), &list), "spool list --json printed %s", out)
	return list
}

func findSpool(list []tiers.SpoolInfo, dir string) (tiers.SpoolInfo, bool) {
	for _, s := range list {
		if s.Dir == dir {
			return s, true
		}
	}
	return tiers.SpoolInfo{}, false
}

// TestSpoolListAndFree: a live agent's spool is listed as served and cannot be freed; after a
// clean stop the log says how to free it, the list shows mount path, job, steps and bytes,
// and mtcfs spool free MOUNT-PATH frees it.
func TestSpoolListAndFree(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	n := newRepNode(t)
	const job = "llama"
	a := n.start(t)
	o := orbaxClient(t, n.dir, job, 60)
	_, _, err := o.Start(ctx)
	require.NoError(t, err)
	require.NoError(t, o.Save(ctx, 10))
	waitStepSealed(t, n.dir, job, 10)

	s, ok := findSpool(spoolList(t), n.spool)
	require.True(t, ok, "the live agent's spool %s is not listed", n.spool)
	assert.Equal(t, n.dir, s.MountPath)
	assert.True(t, s.InUse, "the spool of a running agent counts as in use")
	assert.Equal(t, a.cmd.Process.Pid, s.AgentPID)
	assert.Equal(t, tiers.MountExists, s.MountState)
	for _, p := range []string{n.dir, n.spool} {
		out, code := runMtcfs(t, "spool", "free", p)
		assert.Equal(t, 1, code, "free %s while its agent runs: %s", p, out)
		assert.Contains(t, out, "in use by the running mtcfs agent pid "+strconv.Itoa(a.cmd.Process.Pid))
		assert.Contains(t, out, "stop that agent first")
	}
	require.True(t, isMounted(n.spool), "a refused free unmounted the spool")
	out, code := runMtcfs(t, "spool", "free", "--orphaned")
	require.Equal(t, 0, code, "%s", out)
	require.NotContains(t, out, n.spool, "--orphaned freed a spool whose mount directory exists")

	stopAgent(t, a)
	require.True(t, isMounted(n.spool), "a spool holding a checkpoint is kept on a clean stop")
	require.Contains(t, a.log(), "free it with: mtcfs spool free "+n.dir, "the stop log line says how to free the kept spool")

	s, ok = findSpool(spoolList(t), n.spool)
	require.True(t, ok, "the kept spool %s is not listed", n.spool)
	assert.Equal(t, n.dir, s.MountPath)
	assert.Equal(t, job, s.Job)
	assert.Equal(t, []int64{10}, s.Steps)
	assert.Equal(t, []string{job + "-s10-n0-w0.meta"}, s.Metas)
	assert.Greater(t, s.Bytes, int64(3*(96<<10)), "the step's files are in the spool")
	assert.True(t, s.Tmpfs)
	assert.False(t, s.InUse, "no agent serves the kept spool")
	assert.Equal(t, tiers.MountExists, s.MountState)
	assert.True(t, s.MountExists)

	text, code := runMtcfs(t, "spool", "list")
	require.Equal(t, 0, code, "%s", text)
	var line string
	for _, l := range strings.Split(text, "\n") {
		if strings.HasPrefix(l, n.spool+" ") {
			line = l
		}
	}
	require.NotEmpty(t, line, "spool list does not show %s:\n%s", n.spool, text)
	for _, want := range []string{n.dir, job, " 10 ", "none", "exists"} {
		assert.Contains(t, line, want, "spool list line for the kept spool")
	}

	// status of the stopped agent's mount names what it left in RAM (it said only "no running
	// agent serves").
	out, code = runMtcfs(t, "status", n.dir)
	assert.Equal(t, 1, code, "%s", out)
	// Its first line is "no running agent serves DIR", or, when no other test's agent runs
	// either, "no mtcfs agent is running on this machine".
	assert.Contains(t, out, "spool "+n.spool+", kept for "+n.dir+", holds job "+job+"'s step(s) 10 (")
	assert.Contains(t, out, "the next mtcfs mount "+n.dir+" (with the same --spool, if it had one) serves them; mtcfs spool free "+n.dir+" frees the RAM")

	out, code = runMtcfs(t, "spool", "free", n.dir)
	require.Equal(t, 0, code, "%s", out)
	assert.Contains(t, out, "freed spool "+n.spool)
	assert.Contains(t, out, "note: step(s) 10 of job "+job+" were in it: only a peer's replica or a backup, if any, holds them now")
	// The spool recorded the job's incarnation, which goes with it: the user is told.
	assert.Contains(t, out, "note: the agent of "+n.dir+" last answered job "+job+" (incarnation ")
	assert.Contains(t, out, "if that job still runs, restart it")
	assert.False(t, isMounted(n.spool), "free left the spool mounted")
	assert.NoDirExists(t, n.spool)
	_, ok = findSpool(spoolList(t), n.spool)
	assert.False(t, ok, "a freed spool is still listed")

	out, code = runMtcfs(t, "spool", "free", n.dir)
	assert.Equal(t, 1, code, "%s", out)
	assert.Contains(t, out, "no mtcfs spool found for "+n.dir)
	for _, args := range [][]string{{"spool", "free"}, {"spool", "free", n.dir, "--orphaned"}, {"spool", "frob"}} {
		out, code = runMtcfs(t, args...)
		assert.Equal(t, 2, code, "mtcfs %v: %s", args, out)
	}
}

// TestSpoolFreeOrphaned: --orphaned frees the kept spools whose mount directory is gone or is
// no longer a directory, and leaves the one whose mount directory exists and the one a live
// agent uses (even when its record names a mount path that is gone).
func TestSpoolFreeOrphaned(t *testing.T) {
	needRoot(t)
	gone, _ := keptSpoolNode(t, "gone")
	notDir, _ := keptSpoolNode(t, "notdir")
	kept, _ := keptSpoolNode(t, "kept")
	live := newRepNode(t)
	la := live.start(t)
	tamperOwner(t, live.spool, filepath.Join(filepath.Dir(live.dir), "no-such-mount"))
	// Last, as any agent starting on this machine from now on reaps these two.
	require.NoError(t, os.Remove(gone.dir))
	require.NoError(t, os.Remove(notDir.dir))
	require.NoError(t, os.WriteFile(notDir.dir, []byte("a file now"), 0o644))

	// status of the mount whose directory is gone names its kept spool (a black-box run of a
	// stopped agent whose directory was gone heard only "no running agent serves").
	out, code := runMtcfs(t, "status", gone.dir)
	assert.Equal(t, 1, code, "%s", out)
	assert.Contains(t, out, "spool "+gone.spool+", kept for "+gone.dir)
	assert.Contains(t, out, "its mount directory is gone: make it again and run mtcfs mount "+gone.dir+" (with the same --spool, if it had one) to serve them, or free the RAM with mtcfs spool free "+gone.spool)

	list := spoolList(t)
	for _, c := range []struct {
		n     repNode
		state string
	}{{gone, tiers.MountGone}, {notDir, tiers.MountNotDir}, {kept, tiers.MountExists}, {live, tiers.MountGone}} {
		s, ok := findSpool(list, c.n.spool)
		require.True(t, ok, "spool %s not listed", c.n.spool)
		assert.Equal(t, c.state, s.MountState, "mount state of %s", c.n.spool)
	}

	out, code = runMtcfs(t, "spool", "free", "--orphaned")
	require.Equal(t, 0, code, "%s", out)
	for _, n := range []repNode{gone, notDir} {
		assert.Contains(t, out, "freed spool "+n.spool)
		assert.False(t, isMounted(n.spool), "orphaned spool %s still mounted", n.spool)
		assert.NoDirExists(t, n.spool)
	}
	assert.NotContains(t, out, kept.spool)
	assert.True(t, isMounted(kept.spool), "--orphaned freed a spool whose mount directory exists")
	assert.NotContains(t, out, live.spool)
	assert.True(t, isMounted(live.spool), "--orphaned freed a live agent's spool")
	_, err := os.ReadDir(live.dir)
	assert.NoError(t, err, "the live agent still serves")
	stopAgent(t, la)
}

// TestSpoolReapedAtMount: a starting agent frees the kept spools whose mount directory was
// removed, logs what it freed, and leaves a kept spool whose mount directory exists and a
// live agent's spool alone.
func TestSpoolReapedAtMount(t *testing.T) {
	needRoot(t)
	gone, _ := keptSpoolNode(t, "reapme")
	kept, _ := keptSpoolNode(t, "keepme")
	live := newRepNode(t)
	live.start(t)
	tamperOwner(t, live.spool, filepath.Join(filepath.Dir(live.dir), "no-such-mount"))
	nb := newRepNode(t)
	// A mount directory removed just now, and made again, keeps its spool (found by a
	// black-box run: another agent starting in between reaped it).
	recent, _ := keptSpoolNode(t, "recent")
	require.NoError(t, os.Remove(recent.dir))
	ageSpool(t, gone.spool)
	require.NoError(t, os.Remove(gone.dir)) // last: any agent starting from now on reaps it

	b := nb.start(t)
	require.DirExists(t, recent.spool, "a spool unused for less than the grace was reaped\n%s", b.log())
	require.NoError(t, os.Mkdir(recent.dir, 0o755))
	ra := recent.start(t)
	o := orbaxClient(t, recent.dir, "recent", 60)
	require.NoError(t, restoresStep(repCtx(t), o, 10), "%s", ra.log())
	stopAgent(t, ra)
	log := b.log()
	require.Contains(t, log, "reaped a kept spool whose mount directory no longer exists")
	var line string
	for _, l := range strings.Split(log, "\n") {
		if strings.Contains(l, "reaped a kept spool") && strings.Contains(l, "spool="+gone.spool+" ") {
			line = l
		}
	}
	require.NotEmpty(t, line, "no reap line for %s:\n%s", gone.spool, log)
	assert.Contains(t, line, "mount="+gone.dir)
	assert.Contains(t, line, "job=reapme")
	assert.Regexp(t, `bytes=[1-9]\d*`, line)
	assert.False(t, isMounted(gone.spool), "the orphaned spool is still mounted")
	assert.NoDirExists(t, gone.spool)
	assert.True(t, isMounted(kept.spool), "a kept spool whose mount directory exists was reaped")
	assert.NotContains(t, log, "spool="+kept.spool)
	assert.True(t, isMounted(live.spool), "a live agent's spool was reaped")
	assert.NotContains(t, log, "spool="+live.spool)
}

// tamperOwner makes a spool's owner record name another mount path, as if its mount directory
// were gone: what a reaper must still not free while an agent uses the spool.
// ageSpool makes the kept spool at spool look unused for longer than the reaping grace: its
// owner record's time and its directories' times are set back.
func ageSpool(t *testing.T, spool string) {
	t.Helper()
	old := time.Now().Add(-tiers.ReapGrace - time.Minute)
	p := filepath.Join(spool, "owner.json")
	data, err := os.ReadFile(p)
	require.NoError(t, err)
	var rec map[string]any
	require.NoError(t, json.Unmarshal(data, &rec))
	rec["last_used"] = old.UTC().Format(time.RFC3339Nano)
	data, err = json.Marshal(rec)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(p, data, 0o600))
	for _, d := range []string{spool, filepath.Join(spool, "files"), filepath.Join(spool, "commits")} {
		if _, err := os.Stat(d); err == nil {
			require.NoError(t, os.Chtimes(d, old, old))
		}
	}
}

func tamperOwner(t *testing.T, spool, mountPath string) {
	t.Helper()
	p := filepath.Join(spool, "owner.json")
	data, err := os.ReadFile(p)
	require.NoError(t, err)
	var rec map[string]any
	require.NoError(t, json.Unmarshal(data, &rec))
	rec["mount_path"] = mountPath
	data, err = json.Marshal(rec)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(p, data, 0o600))
}

// TestStatusPidReuse: a registry file whose pid now belongs to another process (another start
// time, or a process younger than the file) is dropped and mtcfs status still answers; an
// agent that is alive but does not answer is reported while the others are still printed.
func TestStatusPidReuse(t *testing.T) {
	needRoot(t)
	n := newRepNode(t)
	a := n.start(t)
	sleep := exec.Command("sleep", "300")
	require.NoError(t, sleep.Start())
	t.Cleanup(func() { sleep.Process.Kill(); sleep.Wait() })
	pid := sleep.Process.Pid
	start, err := agents.ProcStartTime(pid)
	require.NoError(t, err)
	regFile := filepath.Join(agents.Dir(), strconv.Itoa(pid)+".json")
	t.Cleanup(func() { os.Remove(regFile) })
	writeReg := func(info agents.Info, mtime time.Time) {
		t.Helper()
		data, err := json.Marshal(info)
		require.NoError(t, err)
		require.NoError(t, os.MkdirAll(agents.Dir(), 0o755))
		require.NoError(t, os.WriteFile(regFile, data, 0o644))
		require.NoError(t, os.Chtimes(regFile, mtime, mtime))
	}
	// A dead agent that served the same directory; its pid now runs sleep.
	dead := agents.Info{PID: pid, Dir: n.dir, HTTP: "127.0.0.1:1", Version: "dev"}
	header := fmt.Sprintf("agent pid %d,", a.cmd.Process.Pid)

	for _, c := range []struct {
		name  string
		start uint64
		mtime time.Time
	}{
		{"another start time", start + 1, time.Now()},
		{"no start time, file older than the process", 0, time.Now().Add(-time.Hour)},
	} {
		t.Run(c.name, func(t *testing.T) {
			info := dead
			info.StartTime = c.start
			writeReg(info, c.mtime)
			out, code := runMtcfs(t, "status", n.dir)
			require.Equal(t, 0, code, "status with a reused pid in the registry:\n%s", out)
			assert.Contains(t, out, header)
			assert.NoFileExists(t, regFile, "the stale registry file is removed")
		})
	}

	// The same pid with its real start time is a live agent that does not answer: said so,
	// the others still printed, exit 1.
	info := dead
	info.StartTime = start
	writeReg(info, time.Now())
	out, code := runMtcfs(t, "status", n.dir)
	assert.Equal(t, 1, code, "%s", out)
	assert.Contains(t, out, header, "the answering agent is still printed")
	assert.Contains(t, out, fmt.Sprintf("the agent of %s (pid %d, 127.0.0.1:1) did not answer", n.dir, pid))
	assert.FileExists(t, regFile, "a live agent's registry file is kept")
}

// TestMountThroughSymlink: mounting a symlink to a live mount is refused like the real path; a
// symlink to a fresh directory mounts on that directory, under the directory's own name.
func TestMountThroughSymlink(t *testing.T) {
	needRoot(t)
	base := t.TempDir()
	real, link := filepath.Join(base, "mnt"), filepath.Join(base, "link")
	require.NoError(t, os.Mkdir(real, 0o755))
	require.NoError(t, os.Symlink("mnt", link))
	t.Cleanup(func() { forceUnmount(real) })

	a := startAgent(t, link, filepath.Join(base, "spool"))
	assert.True(t, isMounted(real), "the agent mounted on the symlink's target")
	assert.False(t, isMounted(link), "nothing is mounted on the symlink itself")
	require.NoError(t, os.WriteFile(filepath.Join(link, "f"), []byte("via link"), 0o644))
	got, err := os.ReadFile(filepath.Join(real, "f"))
	require.NoError(t, err)
	assert.Equal(t, "via link", string(got))
	s, ok := findSpool(spoolList(t), filepath.Join(base, "spool"))
	require.True(t, ok)
	assert.Equal(t, real, s.MountPath, "the spool records the resolved mount path")
	out, code := runMtcfs(t, "status", link)
	require.Equal(t, 0, code, "status through the link: %s", out)
	assert.Contains(t, out, "mount "+real)

	t.Cleanup(func() { forceUnmount(filepath.Join(base, "spool2")) }) // if a second agent got that far
	for _, dir := range []string{real, link} {
		out, code := runBounded(t, 20*time.Second, "mount", dir, "--spool", filepath.Join(base, "spool2"), "--memory", "64MiB", "--backup", "file://"+filepath.Join(base, "backup"))
		assert.Equal(t, 1, code, "a second agent on %s: %s", dir, out)
		assert.Contains(t, out, "is already a live FUSE mount")
		assert.Equal(t, 1, fuseMountsAt(real), "a second mount is stacked on %s", real)
	}
	_, err = os.ReadDir(real)
	require.NoError(t, err, "the first agent still serves")

	// Through the link, a stale mount left by a killed agent is detached like at the real path.
	killAgent(t, a)
	b := startAgent(t, link, filepath.Join(base, "spool"))
	assert.Contains(t, b.log(), "detached a stale mount")
	assert.Equal(t, 1, fuseMountsAt(real))
	_, err = os.ReadDir(real)
	require.NoError(t, err, "the new agent serves")
	stopAgent(t, b)
	assert.Equal(t, 0, fuseMountsAt(real), "mount left behind after SIGTERM")
}

// runBounded runs mtcfs and kills it if it does not exit within d (a mount that wrongly
// succeeded would serve forever); what it mounted is detached by the caller's cleanup.
func runBounded(t *testing.T, d time.Duration, args ...string) (string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	out, err := exec.CommandContext(ctx, binPath, args...).CombinedOutput()
	if ctx.Err() != nil {
		t.Errorf("mtcfs %v did not exit within %v:\n%s", args, d, out)
		return string(out), -1
	}
	if ee, ok := err.(*exec.ExitError); ok {
		return string(out), ee.ExitCode()
	}
	require.NoError(t, err)
	return string(out), 0
}

func fuseMountsAt(p string) int {
	data, _ := os.ReadFile("/proc/self/mounts")
	n := 0
	for _, line := range strings.Split(string(data), "\n") {
		if f := strings.Fields(line); len(f) > 2 && f[1] == p && strings.HasPrefix(f[2], "fuse") {
			n++
		}
	}
	return n
}

// TestStoppedAgentBlocksNoOtherAgent: an agent that is stopped (SIGSTOP, a frozen cgroup, a
// debugger) answers nothing on its mount. An agent starting on the same machine looks at every
// kept spool's mount path (ReapOrphaned), and so does mtcfs spool list; their stat of the stopped
// agent's mount root waited for it, unkillably (10 minutes by hand, until SIGCONT). Mount points
// are no longer stat'ed: they exist.
func TestStoppedAgentBlocksNoOtherAgent(t *testing.T) {
	needRoot(t)
	stopped := newRepNode(t)
	a := stopped.start(t)
	// A create in the mount's root invalidates the root's cached attributes, so that the next
	// stat of the mount path asks the agent instead of the kernel's cache.
	require.NoError(t, os.WriteFile(filepath.Join(stopped.dir, "x"), nil, 0o644))
	require.NoError(t, a.cmd.Process.Signal(syscall.SIGSTOP))
	t.Cleanup(func() { a.cmd.Process.Signal(syscall.SIGCONT) }) // before startAgent's cleanup kills it

	out, code := runBounded(t, 20*time.Second, "spool", "list", "--json")
	require.NotEqual(t, -1, code, "mtcfs spool list waited for the stopped agent")
	require.Equal(t, 0, code, out)
	var list []tiers.SpoolInfo
	require.NoError(t, json.Unmarshal([]byte(out), &list), "spool list --json printed %s", out)
	s, ok := findSpool(list, stopped.spool)
	require.True(t, ok, "the stopped agent's spool is listed: %s", out)
	assert.True(t, s.InUse, "the stopped agent's spool is in use")
	assert.Equal(t, tiers.MountExists, s.MountState)

	b := newRepNode(t).start(t) // fails if it does not serve within 15 s
	stopAgent(t, b)
	require.NoError(t, a.cmd.Process.Signal(syscall.SIGCONT))
	stopAgent(t, a)
}

// TestSpoolFlagNamingAUsersDirectory: `mtcfs mount DIR --spool D` with D an existing directory
// of the user's (a typo: --spool /data) refuses to start and leaves D as it was. Before, the
// agent mounted its tmpfs over D, and its clean stop removed D with everything in it.
func TestSpoolFlagNamingAUsersDirectory(t *testing.T) {
	needRoot(t)
	base := t.TempDir()
	dir, precious := filepath.Join(base, "mnt"), filepath.Join(base, "data")
	require.NoError(t, os.Mkdir(dir, 0o755))
	require.NoError(t, os.Mkdir(precious, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(precious, "notes.txt"), []byte("mine"), 0o644))
	require.NoError(t, os.Mkdir(filepath.Join(precious, "files"), 0o755)) // a spool's name, the user's directory
	require.NoError(t, os.WriteFile(filepath.Join(precious, "files", "more.txt"), []byte("more"), 0o644))
	t.Cleanup(func() { forceUnmount(dir); forceUnmount(precious) })

	out, code := runBounded(t, 30*time.Second, "mount", dir, "--spool", precious, "--memory", "64MiB") // the old agent served on
	require.Equal(t, 1, code, "the start should fail\n%s", out)
	assert.Contains(t, out, "spool "+precious+" is not empty and not an mtcfs spool (no owner.json of an agent; it holds files, notes.txt)")
	assert.False(t, isMounted(dir), "nothing is mounted at the refused start")
	assert.False(t, isMounted(precious), "no tmpfs over the user's directory")
	data, err := os.ReadFile(filepath.Join(precious, "notes.txt"))
	require.NoError(t, err, "the user's directory is intact")
	assert.Equal(t, "mine", string(data))
	data, err = os.ReadFile(filepath.Join(precious, "files", "more.txt"))
	require.NoError(t, err, "the user's files directory is intact")
	assert.Equal(t, "more", string(data))
}

// TestSpoolInsideTheMount: a spool at or below the mount directory (also through a symlink), or a
// mount directory inside the spool, is refused before anything is mounted. Before, the agent
// served with its spool hidden under its own mount, and the job's first write failed.
func TestSpoolInsideTheMount(t *testing.T) {
	needRoot(t)
	base := t.TempDir()
	dir := filepath.Join(base, "mnt")
	require.NoError(t, os.Mkdir(dir, 0o755))
	require.NoError(t, os.Symlink(dir, filepath.Join(base, "link")))
	t.Cleanup(func() {
		forceUnmount(dir)
		forceUnmount(filepath.Join(dir, "spool"))
	})
	for _, c := range []struct{ spool, want string }{
		{dir, "is inside the mount directory"},
		{filepath.Join(dir, "spool"), "is inside the mount directory"},
		{filepath.Join(base, "link", "a", "b"), "is inside the mount directory"},
		{base, "is inside the spool"},
	} {
		out, code := runBounded(t, 30*time.Second, "mount", dir, "--spool", c.spool, "--memory", "64MiB") // the old agent served on
		require.Equal(t, 1, code, "--spool %s should be refused\n%s", c.spool, out)
		assert.Contains(t, out, c.want, "--spool %s", c.spool)
		assert.False(t, isMounted(dir), "--spool %s: nothing is mounted", c.spool)
	}
	assert.NoDirExists(t, filepath.Join(dir, "spool"), "no spool directory was made")
}

// TestBackupInsideTheMount: a file:// backup location at or below the mount directory (also
// through a symlink) is refused before anything is mounted or made. Before, the agent served,
// wrote its backups through its own mount into the RAM spool, where the job's namespace showed
// them and they were lost with the spool; the directory under the mount never got a byte.
func TestBackupInsideTheMount(t *testing.T) {
	needRoot(t)
	base := t.TempDir()
	dir := filepath.Join(base, "mnt")
	require.NoError(t, os.Mkdir(dir, 0o755))
	require.NoError(t, os.Symlink(dir, filepath.Join(base, "link")))
	// An agent that served anyway (the fault) is killed at the time limit: detach what it left.
	t.Cleanup(func() { forceUnmount(dir); forceUnmount(filepath.Join(base, "spool")) })
	for _, backup := range []string{dir, filepath.Join(dir, "backups"), filepath.Join(base, "link", "a", "b")} {
		out, code := runBounded(t, 30*time.Second, "mount", dir, "--backup", "file://"+backup, "--memory", "64MiB", "--spool", filepath.Join(base, "spool"))
		require.Equal(t, 1, code, "--backup file://%s should be refused\n%s", backup, out)
		assert.Contains(t, out, "--backup file://"+backup+" is inside the mount directory "+dir, "--backup %s", backup)
		assert.False(t, isMounted(dir), "--backup %s: nothing is mounted", backup)
	}
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	assert.Empty(t, entries, "nothing was made under the mount directory")
	assert.NoDirExists(t, filepath.Join(base, "spool"), "no spool was made")

	// Beside the mount directory, above it (backups go to <root>/<job>), or in GCS is fine.
	for _, backup := range []string{"file://" + dir + "-backups", "file://" + base, "gs://bucket" + dir} {
		assert.NoError(t, checkBackupPlacement(dir, backup), backup)
	}
}

// TestMountMovedWhileServing: a directory above the mount is renamed while the agent serves it
// (the kernel moves the mount with it). The stop unmounts it where it is now and keeps the spool,
// and the next agent on the new path, with the default spool, restores the job's step from it.
// Before, the stop failed to unmount, left a dead mount at the new path, and freed the spool as
// orphaned: the step was lost (found by a black-box run).
func TestMountMovedWhileServing(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	base := t.TempDir()
	dir, moved := filepath.Join(base, "par", "m"), filepath.Join(base, "par2", "m")
	require.NoError(t, os.MkdirAll(dir, 0o755))
	backup := "file://" + t.TempDir()
	t.Cleanup(func() {
		forceUnmount(moved)
		forceUnmount(dir)
		for _, p := range []string{dir, moved} {
			runMtcfs(t, "spool", "free", p)
		}
	})
	a := startAgentIn(t, nil, dir, "", "--backup", backup)
	const job = "moved"
	o := orbaxClient(t, dir, job, 60)
	_, _, err := o.Start(ctx)
	require.NoError(t, err)
	require.NoError(t, o.Save(ctx, 1))
	waitStepSealed(t, dir, job, 1)

	spool := tiers.DefaultSpoolDir(dir)
	require.NoError(t, os.Rename(filepath.Join(base, "par"), filepath.Join(base, "par2")))
	require.True(t, isMounted(moved), "the kernel moved the mount")
	// A process holds the moved mount busy: the stop waits for it (up to 30 s, then gives up).
	// The new path is in the spool's record before that wait, so that a stop that gives up
	// keeps the spool too (found by a review).
	held, err := os.Open(metaPath(moved, job, 1))
	require.NoError(t, err)
	defer held.Close()
	require.NoError(t, a.cmd.Process.Signal(syscall.SIGTERM))
	repWait(t, 10*time.Second, "the new path in the spool's record while the stop waits", func() bool {
		o, err := tiers.ReadOwner(spool)
		return err == nil && o.MountPath == moved
	})
	repWait(t, 10*time.Second, "the processes holding the moved mount named", func() bool {
		return strings.Contains(a.log(), "the moved mount is busy") && strings.Contains(a.log(), fmt.Sprintf("pid %d", os.Getpid()))
	})
	require.NoError(t, held.Close())
	require.Equal(t, 0, a.wait(30*time.Second), "clean stop should exit 0\n%s", a.log())
	require.False(t, isMounted(moved), "the moved mount is left behind\n%s", a.log())
	require.Contains(t, a.log(), "it is unmounted where it is now")
	require.Contains(t, a.log(), "spool kept for the next agent on this mount")
	require.NotContains(t, a.log(), "freeing the spool although it holds committed checkpoints")

	b := startAgentIn(t, nil, moved, "", "--backup", backup)
	require.Contains(t, b.log(), "using the kept spool that records this mount directory")
	o = orbaxClient(t, moved, job, 60)
	require.NoError(t, restoresStep(ctx, o, 1), "%s", b.log())
	require.Contains(t, b.log(), "adopted from spool")
	stopAgent(t, b)
}

// TestMountDirMovedWhileStopped: the job's mount directory renamed while no agent ran. The
// agent started on the new path has a new, empty spool; the kept spool of the old path holds
// the job's newer step, and is reaped once unused for ReapGrace. Before, the job restored an
// older step (or nothing) without a word and lost the newer one (found by a black-box run).
// Now the job is told in replicator.errors which spool holds what, and the advice works.
func TestMountDirMovedWhileStopped(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	base := t.TempDir()
	dir, moved := filepath.Join(base, "m"), filepath.Join(base, "m-renamed")
	require.NoError(t, os.Mkdir(dir, 0o755))
	old := tiers.DefaultSpoolDir(dir)
	t.Cleanup(func() {
		forceUnmount(moved)
		forceUnmount(dir)
		runMtcfs(t, "spool", "free", old)
		runMtcfs(t, "spool", "free", moved)
	})
	const job = "renamed-dir"
	a := startAgentIn(t, nil, dir, "")
	o := startedOrbax(t, ctx, dir, job, 0)
	require.NoError(t, o.Save(ctx, 1))
	waitStepSealed(t, dir, job, 1)
	stopAgent(t, a)
	require.DirExists(t, old, "the spool with the step is kept")
	require.NoError(t, os.Rename(dir, moved))

	b := startAgentIn(t, nil, moved, "")
	o = orbaxClient(t, moved, job, 0)
	_, found, err := o.Start(ctx)
	require.NoError(t, err)
	require.False(t, found, "a new spool, no peer, no backup: nothing to restore")
	told := fmt.Sprintf("spool %s holds step(s) 1 of this job, newer than what this restore finds, but no agent serves it: its mount directory %s is gone", old, dir)
	repWait(t, 10*time.Second, "the job told (after its markers)", func() bool {
		b, _ := os.ReadFile(filepath.Join(moved, "replicator.errors"))
		all := string(b) + strings.Join(o.Errors(), "\n")
		return strings.Contains(all, told) && strings.Contains(all, "start it again with --spool "+old)
	})
	stopAgent(t, b)

	// The advice: the same mount with the kept spool restores the step.
	c := startAgentIn(t, nil, moved, old)
	o = orbaxClient(t, moved, job, 0)
	require.NoError(t, restoresStep(ctx, o, 1), "%s", c.log())
	for _, l := range o.Errors() {
		require.NotContains(t, l, "no agent serves it", "the spool served is not an orphan")
	}
	stopAgent(t, c)
}

// TestSpoolOfAnotherMountIsRefused: a --spool that is the kept spool of another mount directory,
// which still exists, is refused: a black-box run mistyped it, and the agent adopted the spool,
// told the other job's restart notice to its own job, and freed the other job's only copy of its
// newest step at its own job's start. That mount's agent then restores it. (With the other
// mount directory gone, the kept spool is served: TestMountDirMovedWhileStopped.)
func TestSpoolOfAnotherMountIsRefused(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	base := t.TempDir()
	dir1, dir2 := filepath.Join(base, "m1"), filepath.Join(base, "m2")
	require.NoError(t, os.Mkdir(dir1, 0o755))
	require.NoError(t, os.Mkdir(dir2, 0o755))
	spool1 := tiers.DefaultSpoolDir(dir1)
	t.Cleanup(func() {
		forceUnmount(dir1)
		forceUnmount(dir2)
		runMtcfs(t, "spool", "free", spool1)
		runMtcfs(t, "spool", "free", tiers.DefaultSpoolDir(dir2))
	})
	const job = "owner-job"
	a := startAgentIn(t, nil, dir1, "")
	o := startedOrbax(t, ctx, dir1, job, 0)
	require.NoError(t, o.Save(ctx, 1))
	waitStepSealed(t, dir1, job, 1)
	stopAgent(t, a)

	out, code := runBounded(t, 30*time.Second, "mount", dir2, "--spool", spool1, "--memory", "64MiB")
	require.Equal(t, 1, code, "the start should fail\n%s", out)
	assert.Contains(t, out, "--spool "+spool1+" is the kept spool of the mount directory "+dir1+" (job "+job+"), which still exists")
	assert.False(t, isMounted(dir2), "nothing is mounted at the refused start")

	b := startAgentIn(t, nil, dir1, "")
	require.NoError(t, restoresStep(ctx, orbaxClient(t, dir1, job, 0), 1), "%s", b.log())
	stopAgent(t, b)
}

// TestExportIntoAMountIsRefused: `backups export` into an mtcfs mount is refused before anything
// is written: the export took the job's RAM budget, and the job removed it at its next start
// without a word (a black-box run).
func TestExportIntoAMountIsRefused(t *testing.T) {
	needRoot(t)
	dir := filepath.Join(t.TempDir(), "m")
	require.NoError(t, os.Mkdir(dir, 0o755))
	t.Cleanup(func() {
		forceUnmount(dir)
		runMtcfs(t, "spool", "free", tiers.DefaultSpoolDir(dir))
	})
	a := startAgentIn(t, nil, dir, "")
	for _, dest := range []string{dir, filepath.Join(dir, "export")} {
		out, code := runMtcfs(t, "backups", "export", "2026-12-05_10-00", dest, "--backup", "file://"+t.TempDir(), "--job", "train")
		require.Equal(t, 1, code, out)
		assert.Contains(t, out, dest+" is inside an mtcfs mount")
	}
	assert.NoDirExists(t, filepath.Join(dir, "export"))
	stopAgent(t, a)
}

// TestExportIntoTheBackupLocationIsRefused: an export into the job's directory of a file://
// location, or to a path named like a backup of any job there, is refused before anything is
// written (a black-box run exported into <root>/<job>/<backup-name>, which was listed as a
// DAMAGED backup from then on); other directories of the location's disk are not.
func TestExportIntoTheBackupLocationIsRefused(t *testing.T) {
	root := t.TempDir()
	for dest, why := range map[string]string{
		root:                         "it is the location itself",
		filepath.Join(root, "train"): "it is job train's directory there",
		filepath.Join(root, "train", "exports", "x"):            "it is job train's directory there",
		filepath.Join(root, "other", "2026-12-05_10-00"):        "it would read as backup 2026-12-05_10-00 of job other",
		filepath.Join(root, "other", "2026-12-05_10-00", "sub"): "it would read as backup 2026-12-05_10-00 of job other",
	} {
		out, code := runMtcfs(t, "backups", "export", "2026-12-05_10-00", dest, "--backup", "file://"+root, "--job", "train")
		require.Equal(t, 1, code, out)
		assert.Contains(t, out, dest+" is inside the backup location")
		assert.Contains(t, out, why)
	}
	entries, err := os.ReadDir(root)
	require.NoError(t, err)
	assert.Empty(t, entries, "a refused export wrote into the location")
	dest := filepath.Join(root, "exports", "x")
	out, code := runMtcfs(t, "backups", "export", "2026-12-05_10-00", dest, "--backup", "file://"+root, "--job", "train")
	assert.Equal(t, 1, code, out)
	assert.Contains(t, out, "job train has no backup 2026-12-05_10-00", "a directory of the location's disk that is no job's is taken")
}

// TestBackupIntoTheMountIsRefused: a file:// location may hold the mount directory (backups go
// to <root>/<job>), but a job named like the directory on the way would back up into its own
// mount, the agent's RAM: it is refused in replicator.failed (it was served, and said "backup
// complete", found by a black-box run), while a job of another name is served. A location
// inside the spool is refused at start: backups took the job's budget and went with the spool.
func TestBackupIntoTheMountIsRefused(t *testing.T) {
	needRoot(t)
	base := t.TempDir()
	n := repNode{dir: filepath.Join(base, "llama"), spool: filepath.Join(t.TempDir(), "spool"), backup: "file://" + base}
	require.NoError(t, os.MkdirAll(n.dir, 0o755))
	a := n.start(t)
	writeJobYAML(t, n.dir, &jobsim.Orbax{Dir: n.dir, Job: "llama", Nodes: 1, BackupIntervalMinutes: 1})
	line := oneFailedLine(t, n.dir, a)
	assert.Contains(t, line, "FATAL job-name: llama: this job's backups would go to "+filepath.Join(base, "llama")+", which holds the mount directory "+n.dir)
	require.NoError(t, os.Remove(filepath.Join(n.dir, "replicator.failed")))
	repWait(t, 10*time.Second, "the refused yaml gone", func() bool { return !pathExists(filepath.Join(n.dir, "replicator.yaml")) })

	// Another name: its backups go beside the mount, and it is served.
	o := &jobsim.Orbax{Dir: n.dir, Job: "alpaca", Nodes: 1, BackupIntervalMinutes: 1}
	writeJobYAML(t, n.dir, o)
	repWait(t, 10*time.Second, "the s0 marker", func() bool {
		m, _ := filepath.Glob(filepath.Join(n.dir, "*.restore"))
		return len(m) > 0
	})
	assert.NoFileExists(t, filepath.Join(n.dir, "replicator.failed"))
	stopAgent(t, a)

	// A mount below <root>/<job>: the backups go beside it, but the agents walk and clean that
	// directory (leftovers of cut-short backups), which would reach into the mount.
	below := filepath.Join(base, "llama", "ckpt")
	check := backupJobCheck(below, "file://"+base)
	require.NotNil(t, check)
	assert.ErrorContains(t, check(&tiers.Config{JobName: "llama"}), "this job's backup directory "+filepath.Join(base, "llama")+" holds the mount directory "+below+": the agents walk and clean that directory")
	assert.NoError(t, check(&tiers.Config{JobName: "alpaca"}))
	assert.Nil(t, backupJobCheck(below, "gs://bucket"+base), "gs:// holds no mount")

	// Inside the spool.
	spool := filepath.Join(t.TempDir(), "spool")
	t.Cleanup(func() { forceUnmount(spool) }) // an agent that was not refused left its spool mounted
	backup := "file://" + filepath.Join(spool, "backups")
	out, code := runBounded(t, 30*time.Second, "mount", n.dir, "--backup", backup, "--memory", "64MiB", "--spool", spool)
	assert.Equal(t, 1, code, out)
	assert.Contains(t, out, "--backup "+backup+" is inside the spool "+spool)
	assert.False(t, isMounted(n.dir), "nothing is mounted")
}

// TestRestoreTellsOfTheKeptSpoolOfThisMount: an agent restarted on the same mount with another
// --spool restores nothing from RAM, and the job is told that the kept spool of this mount holds
// a newer step, and how to restore from it (it was told nothing: a black-box run). Started again
// with that spool, the agent restores the step.
func TestRestoreTellsOfTheKeptSpoolOfThisMount(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	n := newRepNode(t)
	a := n.start(t)
	o := startedOrbax(t, ctx, n.dir, "moved", 30)
	require.NoError(t, o.Save(ctx, 5))
	waitStepSealed(t, n.dir, "moved", 5)
	stopAgent(t, a) // the spool is kept with step 5

	old := n.spool
	n.spool = filepath.Join(t.TempDir(), "other-spool")
	a = n.start(t)
	o = orbaxClient(t, n.dir, "moved", 30)
	step, found, err := o.Start(ctx)
	require.NoError(t, err)
	assert.False(t, found, "restored step %d", step)
	want := "spool " + old + " holds step(s) 5 of this job, newer than what this restore finds: it records this mount directory, but this agent runs with the spool " + n.spool
	assert.True(t, slices.ContainsFunc(o.Errors(), func(l string) bool {
		return strings.Contains(l, want) && strings.Contains(l, "start it again with --spool "+old)
	}), "replicator.errors: %q", o.Errors())
	stopAgent(t, a)

	n.spool = old
	a = n.start(t)
	require.NoError(t, restoresStep(ctx, orbaxClient(t, n.dir, "moved", 30), 5))
	stopAgent(t, a)
}
