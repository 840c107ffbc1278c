package main

// What the agent says about its environment: its descriptor limit, a backup location in RAM, a
// spool file system smaller than the budget.

import (
	"bytes"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mtcfs/mtcfs/tiers"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// TestAgentOutOfDescriptors: the agent holds a descriptor for each file open in the mount, so a
// job holding many files open meets the agent's descriptor limit, not its own: its open fails
// with EMFILE ("Too many open files"), which only the agent's log can explain. The agent warns
// at start when its limit is low, logs the cause when it runs out, and opens again once the job
// closed its files.
func TestAgentOutOfDescriptors(t *testing.T) {
	needRoot(t)
	base := t.TempDir()
	dir, spool := filepath.Join(base, "mnt"), filepath.Join(base, "spool")
	require.NoError(t, os.Mkdir(dir, 0o755))
	const limit = 200
	// sh's ulimit sets the soft and the hard limit: Go raises the soft one to the hard one.
	a := startAgentIn(t, []string{"sh", "-c", fmt.Sprintf(`ulimit -n %d && exec "$0" "$@"`, limit)}, dir, spool)
	assert.Contains(t, a.log(), "low file descriptor limit")
	assert.Contains(t, a.log(), fmt.Sprintf("limit=%d", limit))

	var open []*os.File
	closeAll := func() {
		for _, f := range open {
			f.Close()
		}
		open = nil
	}
	t.Cleanup(closeAll)
	var openErr error
	for i := 0; i < 2*limit && openErr == nil; i++ {
		var f *os.File
		if f, openErr = os.Create(filepath.Join(dir, fmt.Sprintf("f%d", i))); openErr == nil {
			open = append(open, f)
		}
	}
	require.ErrorIs(t, openErr, syscall.EMFILE, "the job's open fails at the agent's limit (%d files open)", len(open))
	assert.Less(t, len(open), limit)
	for i := range 5 { // more opens that fail
		_, err := os.Create(filepath.Join(dir, fmt.Sprintf("again%d", i)))
		require.ErrorIs(t, err, syscall.EMFILE)
	}
	repWait(t, 5*time.Second, "the agent's out-of-descriptors line", func() bool {
		return strings.Contains(a.log(), "the agent is out of file descriptors")
	})
	assert.Equal(t, 1, strings.Count(a.log(), "the agent is out of file descriptors"), "logged once, not per failed open")

	// Out of descriptors, the agent still answers `mtcfs status` and /metrics, one connection
	// after another, with its own metrics (before, accept(2) failed and status timed out; a
	// black-box run). The process collector's, which read /proc, may be missing.
	addr := agentHTTPAddr(t, a)
	for range 2 {
		out, code := runMtcfs(t, "status", "--http", addr)
		require.Equal(t, 0, code, "mtcfs status out of descriptors:\n%s", out)
		assert.Contains(t, out, dir)
		fams := scrape(t, addr)
		assert.Equal(t, 1.0, value(t, fams, "mtcfs_build_info", nil))
	}

	closeAll()
	f, err := os.Create(filepath.Join(dir, "after"))
	require.NoError(t, err, "the files closed, the agent opens again")
	require.NoError(t, f.Close())
	stopAgent(t, a)
}

// TestBackupLocationInRAM: a file:// backup location on a tmpfs (here /dev/shm) is warned about at
// start: backups there go with the node they are meant to outlive. One on a disk is not.
func TestBackupLocationInRAM(t *testing.T) {
	needRoot(t)
	var st unix.Statfs_t
	require.NoError(t, unix.Statfs("/dev/shm", &st))
	require.Equal(t, int64(unix.TMPFS_MAGIC), int64(st.Type), "/dev/shm is not a tmpfs here")
	inRAM, err := os.MkdirTemp("/dev/shm", "mtcfs-backup-test-")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(inRAM) })
	const warning = "the backup location is in RAM (tmpfs)"

	n := newRepNode(t)
	n.backup = "file://" + filepath.Join(inRAM, "not-yet-made")
	a := n.start(t)
	assert.Contains(t, a.log(), warning)
	stopAgent(t, a)

	// Inside another agent's mount: that agent's RAM too, and its job's next start removes
	// them. Refused (it was only warned of: found by a black-box run).
	other := newRepNode(t)
	o := other.start(t)
	backup := "file://" + filepath.Join(other.dir, "backups")
	out, code := runBounded(t, 30*time.Second, "mount", n.dir, "--backup", backup, "--memory", "64MiB", "--spool", n.spool)
	assert.Equal(t, 1, code, out)
	assert.Contains(t, out, "--backup "+backup+" is inside another agent's mtcfs mount")
	assert.False(t, isMounted(n.dir), "nothing is mounted")
	stopAgent(t, o)

	// file:// of a directory under the test's temporary directory, when that is on a disk.
	n.backup = ""
	require.NoError(t, unix.Statfs(n.backupRoot, &st))
	if st.Type == unix.TMPFS_MAGIC {
		t.Logf("%s is on a tmpfs here: the case of a disk is not run", n.backupRoot)
		return
	}
	b := n.start(t)
	assert.NotContains(t, b.log(), warning)
	stopAgent(t, b)
}

// TestBackupLocationNotWritable: a file:// location the agent cannot write to (here a read-only
// file system; for a user, a directory of root's) is warned of at start. The start's probe only
// reads, and said "the backup location can be read" (found by a black-box run).
func TestBackupLocationNotWritable(t *testing.T) {
	needRoot(t)
	ro := t.TempDir()
	require.NoError(t, unix.Mount("mtcfs-test-ro", ro, "tmpfs", unix.MS_RDONLY, "size=1m"))
	t.Cleanup(func() { unix.Unmount(ro, unix.MNT_DETACH) })
	n := newRepNode(t)
	n.backup = "file://" + ro
	a := n.start(t)
	assert.Contains(t, a.log(), "the backup location cannot be written by this agent")
	repWait(t, 10*time.Second, "the probe's line", func() bool { return strings.Contains(a.log(), "the backup location can be read") })
	assert.Contains(t, a.log(), "the backup location can be read, not written (above)", "not a plain \"can be read\" after the warning")
	// The job is told at its start, not the agent's log only (black-box h57: it saved for 10
	// minutes with every backup bound to fail).
	ctx := repCtx(t)
	o := startedOrbax(t, ctx, n.dir, "job", 60)
	errs := strings.Join(o.Errors(), "\n")
	assert.Contains(t, errs, "the backup location "+n.backup+" cannot be written by this node's agent")
	assert.Contains(t, errs, "read-only file system")
	stopAgent(t, a)

	n.backup = ""
	b := n.start(t)
	assert.NotContains(t, b.log(), "cannot be written")
	o = startedOrbax(t, ctx, n.dir, "job", 60)
	assert.Empty(t, o.Errors())
	stopAgent(t, b)
}

// TestBackupLocationMissing: a file:// directory that does not exist (a mistyped path, a disk not
// mounted) is warned of at start, and the probe does not say "can be read" (it did, found by a
// review); an existing one is not warned of.
func TestBackupLocationMissing(t *testing.T) {
	needRoot(t)
	const warning = "the backup directory does not exist yet"
	n := newRepNode(t)
	n.backup = "file://" + filepath.Join(t.TempDir(), "bakcups")
	a := n.start(t)
	assert.Contains(t, a.log(), warning)
	assert.Contains(t, a.log(), "missing=bakcups")
	o := startedOrbax(t, repCtx(t), n.dir, "job", 60) // the job is told too
	assert.Contains(t, strings.Join(o.Errors(), "\n"), "the backup location "+n.backup+" does not exist (bakcups is missing under ")
	stopAgent(t, a) // the probe has ended when the agent has
	assert.NotContains(t, a.log(), "the backup location can be read")

	n.backup = "file://" + t.TempDir()
	b := n.start(t)
	repWait(t, 10*time.Second, "the probe's line", func() bool { return strings.Contains(b.log(), "the backup location can be read") })
	assert.NotContains(t, b.log(), warning)
	stopAgent(t, b)

	// The default location (--backup not given) on a fresh machine is no mistake: told, not warned.
	home := filepath.Join(t.TempDir(), "fresh-home")
	n.prefix = []string{"env", "XDG_DATA_HOME=" + home}
	n.backup = "file://" + filepath.Join(home, "mtcfs", "backups") // what the agent takes without --backup
	c := n.start(t)
	assert.Contains(t, c.log(), "the default backup directory is made at the first backup")
	assert.NotContains(t, c.log(), warning)
	stopAgent(t, c)
}

// TestMountOverOtherMounts: an agent started on the parent of another agent's mount is refused,
// naming the mount below; it took the other job's directory away with a warning of hidden
// entries (found by a black-box run).
func TestMountOverOtherMounts(t *testing.T) {
	needRoot(t)
	parent := t.TempDir()
	child := newRepNode(t)
	child.dir = filepath.Join(parent, "child")
	require.NoError(t, os.Mkdir(child.dir, 0o755))
	a := child.start(t)
	out, code := runBounded(t, 30*time.Second, "mount", parent, "--memory", "64MiB", "--spool", filepath.Join(t.TempDir(), "spool"))
	require.Equal(t, 1, code, "the start should fail\n%s", out)
	assert.Contains(t, out, parent+" holds other mounts ("+child.dir+"): a mount on it would hide them")
	assert.False(t, isMounted(parent))
	_, err := os.ReadDir(child.dir)
	require.NoError(t, err, "the other agent's mount still serves")
	stopAgent(t, a)
}

// TestSmallSpoolFileSystem: an agent that accounts for the budget itself (not root: no tmpfs of
// its own) warns when the spool's file system has less room than the budget, as a container's
// 64 MiB /dev/shm has for --memory 2GiB: the job's writes would fail before the budget is used.
func TestSmallSpoolFileSystem(t *testing.T) {
	needRoot(t) // to mount the small file system
	fsDir := filepath.Join(t.TempDir(), "small")
	require.NoError(t, os.Mkdir(fsDir, 0o755))
	require.NoError(t, unix.Mount("small", fsDir, "tmpfs", 0, "size=8m"))
	t.Cleanup(func() { unix.Unmount(fsDir, unix.MNT_DETACH) })
	var logged bytes.Buffer
	old := slog.Default()
	slog.SetDefault(slog.New(slog.NewTextHandler(&logged, nil)))
	t.Cleanup(func() { slog.SetDefault(old) })

	for _, c := range []struct {
		budget int64
		warned bool
	}{{64 << 20, true}, {tiers.MinBudget, true}} {
		logged.Reset()
		s, err := tiers.OpenSpool(tiers.SpoolConfig{Dir: filepath.Join(fsDir, "spool"), Budget: c.budget, MountPath: filepath.Join(fsDir, "mnt")})
		require.NoError(t, err)
		warnSmallSpoolFS(s)
		require.NoError(t, s.Close())
		assert.Equal(t, c.warned, strings.Contains(logged.String(), "has less room than --memory leaves"), "budget %d: %s", c.budget, logged.String())
	}

	// A file system with room for the budget: no warning.
	logged.Reset()
	s, err := tiers.OpenSpool(tiers.SpoolConfig{Dir: filepath.Join(t.TempDir(), "spool"), Budget: tiers.MinBudget, MountPath: filepath.Join(fsDir, "mnt")})
	require.NoError(t, err)
	warnSmallSpoolFS(s)
	require.NoError(t, s.Close())
	assert.NotContains(t, logged.String(), "has less room")
}

// TestBackupLocationUnreadable: an agent whose backup location refuses it (no credentials, a
// wrong bucket) says so in its log at start, instead of only when a job's restore fails on it;
// it serves anyway, since the location may come back. A readable location gets no warning.
func TestBackupLocationUnreadable(t *testing.T) {
	needRoot(t)
	const warning = "the backup location cannot be read"
	refusing := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, `{"error":{"code":403,"message":"no access"}}`, http.StatusForbidden)
	}))
	t.Cleanup(refusing.Close)

	n := newRepNode(t)
	n.backup = "gs://no-access-bucket"
	n.prefix = []string{"env", "STORAGE_EMULATOR_HOST=" + strings.TrimPrefix(refusing.URL, "http://")}
	a := n.start(t)
	repWait(t, 20*time.Second, "the warning", func() bool { return strings.Contains(a.log(), warning) })
	require.Contains(t, a.log(), "serving")
	stopAgent(t, a)

	n.backup, n.prefix = "", nil
	b := n.start(t)
	repWait(t, 20*time.Second, "the probe", func() bool { return strings.Contains(b.log(), "the backup location can be read") })
	assert.NotContains(t, b.log(), warning)
	stopAgent(t, b)
}

// TestRestoreFromRAMWithTheBackupLocationDown: a job restarting while its backup location
// refuses the agent (credentials gone, an outage) restores its step from RAM, and is told that a
// restore.version there could not be read. Before, the restore failed (replicator.failed:
// "restore negotiation failed: restore plan: read restore.version: …") and the job aborted at
// every restart, with its checkpoint in RAM, until the location came back.
func TestRestoreFromRAMWithTheBackupLocationDown(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	refusing := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, `{"error":{"code":403,"message":"no access"}}`, http.StatusForbidden)
	}))
	t.Cleanup(refusing.Close)
	const job = "outage"

	n := newRepNode(t)
	a := n.start(t)
	o := orbaxClient(t, n.dir, job, 60)
	_, _, err := o.Start(ctx)
	require.NoError(t, err)
	require.NoError(t, o.Save(ctx, 7))
	waitStepSealed(t, n.dir, job, 7)
	stopAgent(t, a) // the spool stays, with step 7

	n.backup = "gs://no-access-bucket"
	n.prefix = []string{"env", "STORAGE_EMULATOR_HOST=" + strings.TrimPrefix(refusing.URL, "http://")}
	b := n.start(t)
	o = orbaxClient(t, n.dir, job, 60)
	step, found, err := o.Start(ctx)
	require.NoError(t, err, "the restart failed\n%s", b.log())
	require.True(t, found, "nothing restored\n%s", b.log())
	require.EqualValues(t, 7, step)
	require.NoError(t, o.VerifyRestored(ctx, 7))
	errs := strings.Join(o.Errors(), "\n")
	assert.Contains(t, errs, "restore.version in gs://no-access-bucket could not be read (")
	assert.Contains(t, errs, "a backup pinned there is not applied this time; restoring step 7 from the nodes' RAM")
	stopAgent(t, b)
}

// TestStopSaysTheNewestStepIsInNoBackup: an agent stopped before the backup interval took the
// newest step says so (it said only "spool kept", and a node lost afterwards lost the step: a
// black-box run), and mtcfs status says it meanwhile; once backed up, neither says it.
func TestStopSaysTheNewestStepIsInNoBackup(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	const warning = "stopping with the newest step in no backup yet"
	n := newRepNode(t)
	a := n.start(t)
	o := startedOrbax(t, ctx, n.dir, "once", 600)
	require.NoError(t, o.Save(ctx, 3))
	waitStepSealed(t, n.dir, "once", 3)
	out, code := runMtcfs(t, "status", n.dir)
	require.Equal(t, 0, code, out)
	assert.Contains(t, out, "; step 3 in RAM only, not in a backup yet")
	stopAgent(t, a)
	assert.Equal(t, 1, strings.Count(a.log(), warning), "said once (it was said twice: an operator's black-box run)")

	// A backup soon after the save: the stop after it says nothing of it.
	n2 := newRepNode(t)
	b := n2.start(t)
	o = startedOrbax(t, ctx, n2.dir, "once", 0.01)
	require.NoError(t, o.Save(ctx, 4))
	repWait(t, 30*time.Second, "the backup of step 4", func() bool { return strings.Contains(b.log(), "backup complete") })
	out, code = runMtcfs(t, "status", n2.dir)
	require.Equal(t, 0, code, out)
	assert.NotContains(t, out, "in RAM only")
	stopAgent(t, b)
	assert.NotContains(t, b.log(), warning)

	// Restarted, the agent restores step 4 from RAM and does not know of its backup: it claims
	// nothing (it said "step 4 in RAM only": a review).
	c := n2.start(t)
	o = orbaxClient(t, n2.dir, "once", 0.01)
	require.NoError(t, restoresStep(ctx, o, 4))
	out, code = runMtcfs(t, "status", n2.dir)
	require.Equal(t, 0, code, out)
	assert.NotContains(t, out, "in RAM only")
	stopAgent(t, c)
	assert.NotContains(t, c.log(), warning)
}

// TestDefaultBackupLocationUnusable: with no --backup, a default location that cannot be used
// says it is the default and where it comes from. The line named a --backup the user had not
// given (black-box h57: HOME=/root for a non-root user).
func TestDefaultBackupLocationUnusable(t *testing.T) {
	needRoot(t)
	n := newRepNode(t)
	file := filepath.Join(t.TempDir(), "file")
	require.NoError(t, os.WriteFile(file, nil, 0o644))
	cmd := exec.Command(binPath, "mount", n.dir, "--memory", "64MiB", "--spool", n.spool)
	cmd.Env = append(os.Environ(), "XDG_DATA_HOME="+file)
	b, err := cmd.CombinedOutput()
	out := string(b)
	var ee *exec.ExitError
	require.ErrorAs(t, err, &ee, out)
	assert.Equal(t, 1, ee.ExitCode(), out)
	assert.Contains(t, out, "the default backup location file://"+file+"/mtcfs/backups (--backup not given: it is $XDG_DATA_HOME/mtcfs/backups")
	assert.False(t, isMounted(n.dir), "nothing is mounted")
}
