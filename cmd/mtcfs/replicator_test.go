package main

// End-to-end tests of the replicator protocol (SPEC §1–3, §5–9): real agents (subprocesses
// started with startAgent), real FUSE mounts, tmpfs spools and file:// backups, driven by the
// scripted Orbax and NeMo clients of internal/jobsim.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/internal/jobsim"
)

const (
	clientPoll    = 20 * time.Millisecond
	clientTimeout = 20 * time.Second
	// fastBackupMinutes orders a backup 1.2 s after the clock started (the coordinator's first
	// sync): tests that save twice at once get one backup, of the second step (a backup per UTC
	// minute at most). The scripted clients always write backup-interval-minutes, so
	// backup-interval-steps cannot be used through them (the parser rejects both keys together).
	fastBackupMinutes = 0.02
)

// repNode is one simulated machine: a mount directory, its spool and a backup location.
type repNode struct {
	dir, spool, backupRoot string
	args                   []string // extra mount flags of every agent started on the node
	prefix                 []string // runs the agent through this command (e.g. ip netns exec NS)
	backup                 string   // the --backup URL when not file://backupRoot (e.g. gs://…)
}

func newRepNode(t *testing.T) repNode {
	t.Helper()
	base := t.TempDir()
	n := repNode{dir: filepath.Join(base, "mnt"), spool: filepath.Join(base, "spool"), backupRoot: filepath.Join(base, "backup")}
	require.NoError(t, os.Mkdir(n.dir, 0o755))
	require.NoError(t, os.Mkdir(n.backupRoot, 0o755))
	return n
}

func (n repNode) backupURL() string {
	if n.backup != "" {
		return n.backup
	}
	return "file://" + n.backupRoot
}

// start runs an agent on the node with its backup location.
func (n repNode) start(t *testing.T, args ...string) *agent {
	t.Helper()
	return startAgentIn(t, n.prefix, n.dir, n.spool, append(append([]string{"--backup", n.backupURL()}, n.args...), args...)...)
}

// dropSpool removes the RAM tier a cleanly stopped agent kept for its successor, as after a
// node replacement.
func (n repNode) dropSpool(t *testing.T) {
	t.Helper()
	if isMounted(n.spool) {
		require.NoError(t, unix.Unmount(n.spool, unix.MNT_DETACH))
	}
	require.False(t, isMounted(n.spool))
	require.NoError(t, os.RemoveAll(n.spool))
}

// startedOrbax is orbaxClient once its start (the handshake and the restore) succeeded.
func startedOrbax(t *testing.T, ctx context.Context, dir, job string, backupMinutes float64) *jobsim.Orbax {
	t.Helper()
	o := orbaxClient(t, dir, job, backupMinutes)
	_, _, err := o.Start(ctx)
	require.NoError(t, err)
	return o
}

func orbaxClient(t *testing.T, dir, job string, backupMinutes float64) *jobsim.Orbax {
	return &jobsim.Orbax{
		Dir: dir, Job: job, Rank: 0, Nodes: 1,
		BackupIntervalMinutes: backupMinutes,
		Poll:                  clientPoll, Timeout: clientTimeout,
		Content: jobsim.Content{Files: 3, FileSize: 96<<10 + 17},
		Logf:    t.Logf,
	}
}

func nemoClient(t *testing.T, dir, job string) *jobsim.NeMo {
	return &jobsim.NeMo{
		Dir: dir, Job: job, Rank: 0, Nodes: 1,
		Poll: clientPoll, Timeout: clientTimeout,
		Content: jobsim.Content{Files: 3, FileSize: 96<<10 + 17},
		Logf:    t.Logf,
	}
}

func repCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 45*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func metaPath(dir, job string, step int64) string {
	return filepath.Join(dir, fmt.Sprintf("%s-s%d-n0-w0.meta", job, step))
}

// repWait polls cond until it holds or d passes.
func repWait(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func pathExists(p string) bool {
	_, err := os.Lstat(p)
	return err == nil
}

// waitStepSealed waits until the agent published the .meta of step (SPEC §3 sealing).
func waitStepSealed(t *testing.T, dir, job string, step int64) {
	t.Helper()
	repWait(t, 10*time.Second, fmt.Sprintf("step %d to be sealed", step), func() bool { return pathExists(metaPath(dir, job, step)) })
}

// runMtcfs runs the mtcfs binary and returns its combined output and exit code.
func runMtcfs(t *testing.T, args ...string) (string, int) {
	t.Helper()
	cmd := exec.Command(binPath, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return out.String(), ee.ExitCode()
	}
	require.NoError(t, err, "run mtcfs %v", args)
	return out.String(), 0
}

var backupLineRE = regexp.MustCompile(`(?m)^(\d{4}-\d{2}-\d{2}_\d{2}-\d{2})\s+(\S+)\s+(\S+)`)

// waitCompleteBackup polls `mtcfs backups list` until a backup holding step is complete and
// returns its name.
func waitCompleteBackup(t *testing.T, n repNode, job string, step int64) string {
	t.Helper()
	var name, out string
	repWait(t, 20*time.Second, fmt.Sprintf("a complete backup of step %d", step), func() bool {
		var code int
		out, code = runMtcfs(t, "backups", "list", "--backup", n.backupURL(), "--job", job)
		require.Equal(t, 0, code, "backups list: %s", out)
		for _, m := range backupLineRE.FindAllStringSubmatch(out, -1) {
			if m[2] == "complete" && m[3] == fmt.Sprint(step) {
				name = m[1]
				return true
			}
		}
		return false
	})
	t.Logf("backups list:\n%s", out)
	return name
}

var httpAddrRE = regexp.MustCompile(`msg="http endpoints" addr=(\S+)`)

func agentHTTPAddr(t *testing.T, a *agent) string {
	t.Helper()
	m := httpAddrRE.FindStringSubmatch(a.log())
	require.NotNil(t, m, "no http endpoints line in the log:\n%s", a.log())
	return m[1]
}

func stopAgent(t *testing.T, a *agent) {
	t.Helper()
	require.NoError(t, a.cmd.Process.Signal(syscall.SIGTERM))
	require.Equal(t, 0, a.wait(30*time.Second), "clean stop should exit 0\n%s", a.log())
	require.False(t, isMounted(a.dir), "mount left behind after SIGTERM")
}

func killAgent(t *testing.T, a *agent) {
	t.Helper()
	require.NoError(t, a.cmd.Process.Signal(syscall.SIGKILL))
	a.wait(10 * time.Second)
}

// TestOrbaxLifecycle: fresh start, saves, a job restart that restores from RAM, a SIGKILLed
// agent whose successor adopts the spool and restores the latest step.
func TestOrbaxLifecycle(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	n := newRepNode(t)
	const job = "llama"
	const coordinator = "127.0.0.1:8476"
	a := n.start(t, "--rank", "0", "--jax-coordinator", coordinator)

	o := orbaxClient(t, n.dir, job, 0.05)
	o.WaitJaxInitInfo = true // SPEC §9 step 1: MaxText learns its process id from the agent
	step, found, err := o.Start(ctx)
	require.NoError(t, err)
	require.False(t, found, "fresh start restored step %d", step)
	assert.Equal(t, coordinator, o.Coordinator)
	info, err := os.ReadFile(filepath.Join(n.dir, "jax-init-info.txt"))
	require.NoError(t, err)
	assert.Equal(t, "0\n"+coordinator+"\n", string(info), "the handshake's cleanup keeps jax-init-info.txt")
	pre, err := os.ReadFile(filepath.Join(n.dir, "replicator.prerestore"))
	require.NoError(t, err)
	assert.Equal(t, "{}", strings.TrimSpace(string(pre)), "fresh start: nothing to restore")
	for _, s := range []int64{0, 10, 20} {
		require.NoError(t, o.Save(ctx, s))
	}

	// The job crashes right after committing step 20 and restarts: a new client, same agent.
	// Step 20 counts although it may still be being sealed (SPEC §2: never dropped).
	o = orbaxClient(t, n.dir, job, 0.05)
	step, found, err = o.Start(ctx)
	require.NoError(t, err)
	require.True(t, found, "restart restored nothing\n%s", a.log())
	require.EqualValues(t, 20, step)
	require.NoError(t, o.VerifyRestored(ctx, 20))
	assert.FileExists(t, metaPath(n.dir, job, 20))
	pre, err = os.ReadFile(filepath.Join(n.dir, "replicator.prerestore"))
	require.NoError(t, err)
	assert.Contains(t, string(pre), "restore-step: 20")
	assert.NotContains(t, string(pre), "restore-backup", "step 20 comes from RAM")
	assert.Empty(t, o.Errors(), "replicator.errors")

	require.NoError(t, o.Save(ctx, 30))
	waitStepSealed(t, n.dir, job, 30)
	killAgent(t, a)

	b := n.start(t)
	require.Contains(t, b.log(), "detached a stale mount")
	require.Contains(t, b.log(), "adopted from spool")
	o = orbaxClient(t, n.dir, job, 0.05)
	step, found, err = o.Start(ctx)
	require.NoError(t, err)
	require.True(t, found, "restart after SIGKILL restored nothing\n%s", b.log())
	require.EqualValues(t, 30, step, "the adopted spool holds step 30")
	require.NoError(t, o.VerifyRestored(ctx, 30))
}

// TestReuseOfAnAdoptedShard: after a restart the job saves a step that hard-links a file of the
// step it restored (an unchanged shard) instead of writing it again. Retention then drops the old
// step, record and all; the new step keeps the shard's bytes, survives a SIGKILL of the agent,
// verifies when the next agent adopts it, and serves the same bytes. (An adopted step's
// files borrow its sealed record's names; the job's link gives the shard a name of its own.)
func TestReuseOfAnAdoptedShard(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	n := newRepNode(t)
	const job = "reuse"
	a := n.start(t)
	o := orbaxClient(t, n.dir, job, 0)
	_, _, err := o.Start(ctx)
	require.NoError(t, err)
	require.NoError(t, o.Save(ctx, 10))
	waitStepSealed(t, n.dir, job, 10)
	stopAgent(t, a)

	b := n.start(t)
	require.Contains(t, b.log(), "adopted from spool")
	o = orbaxClient(t, n.dir, job, 0)
	step, found, err := o.Start(ctx)
	require.NoError(t, err)
	require.True(t, found, "restart restored nothing\n%s", b.log())
	require.EqualValues(t, 10, step)
	hash10, err := os.ReadFile(metaPath(n.dir, job, 10))
	require.NoError(t, err)
	data10 := filepath.Join(n.dir, strings.TrimSpace(string(hash10))+".data")
	var shard string // the largest file of step 10
	var shardSize int64
	require.NoError(t, filepath.WalkDir(data10, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		info, err := d.Info()
		if err == nil && info.Size() > shardSize {
			shard, shardSize = p, info.Size()
		}
		return err
	}))
	require.NotEmpty(t, shard)
	want, err := os.ReadFile(shard)
	require.NoError(t, err)

	tmp := filepath.Join(n.dir, "20.orbax-checkpoint-tmp")
	require.NoError(t, os.Mkdir(tmp, 0o755))
	require.NoError(t, os.Link(shard, filepath.Join(tmp, "reused")))
	require.NoError(t, os.WriteFile(filepath.Join(tmp, "new"), []byte("step 20"), 0o644))
	require.NoError(t, os.Rename(tmp, filepath.Join(n.dir, "20")))
	waitStepSealed(t, n.dir, job, 20)
	repWait(t, 10*time.Second, "retention to drop step 10", func() bool {
		return !pathExists(metaPath(n.dir, job, 10)) && !pathExists(data10)
	})
	hash20, err := os.ReadFile(metaPath(n.dir, job, 20))
	require.NoError(t, err)
	reused := filepath.Join(n.dir, strings.TrimSpace(string(hash20))+".data", "reused")
	got, err := os.ReadFile(reused)
	require.NoError(t, err, "the shard step 20 reused, once step 10 is gone")
	require.Equal(t, want, got)

	killAgent(t, b)
	c := n.start(t)
	require.Contains(t, c.log(), "adopted from spool")
	require.NotContains(t, c.log(), "dropping spool data that does not verify")
	require.FileExists(t, metaPath(n.dir, job, 20), "step 20 adopted")
	got, err = os.ReadFile(reused)
	require.NoError(t, err)
	require.Equal(t, want, got, "the reused shard after the SIGKILL and the adoption")
}

// TestRestartRightAfterSIGKILL: an agent started right after its predecessor was SIGKILLed
// detaches the stale mount (SPEC §8), also while the kernel still caches the root's attributes
// (the job was using the directory a moment ago).
func TestRestartRightAfterSIGKILL(t *testing.T) {
	needRoot(t)
	n := newRepNode(t)
	a := n.start(t)
	require.NoError(t, os.WriteFile(filepath.Join(n.dir, "f"), []byte("x"), 0o644))
	_, err := os.ReadDir(n.dir)
	require.NoError(t, err)
	_, err = os.Stat(n.dir)
	require.NoError(t, err)
	killAgent(t, a)

	b := n.start(t)
	require.Contains(t, b.log(), "detached a stale mount")
	_, err = os.ReadDir(n.dir)
	require.NoError(t, err, "the new agent serves the directory")
}

// TestNeMoLifecycle: NeMo's handshake (yaml written directly, prerestore required), saves with
// the off-by-one commit, and a restart that restores the latest step.
func TestNeMoLifecycle(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	n := newRepNode(t)
	const job = "gpt"
	a := n.start(t)

	c := nemoClient(t, n.dir, job)
	require.NoError(t, c.Handshake(ctx))
	step, found, err := c.Restore(ctx)
	require.NoError(t, err)
	require.False(t, found, "fresh start restored step %d", step)
	for _, gs := range []int64{5, 9} {
		require.NoError(t, c.Save(ctx, gs))
	}

	// The job restarts right after the commit.
	c = nemoClient(t, n.dir, job)
	require.NoError(t, c.Handshake(ctx))
	step, found, err = c.Restore(ctx)
	require.NoError(t, err)
	require.True(t, found, "restart restored nothing\n%s", a.log())
	require.EqualValues(t, 8, step)
	require.NoError(t, c.VerifyRestored(ctx, 8))
	assert.Empty(t, c.Errors(), "replicator.errors")
	assert.FileExists(t, metaPath(n.dir, job, 8))
	assert.NoFileExists(t, metaPath(n.dir, job, 9), "NeMo's step=9 commits step 8")

	// A clean stop right after a commit seals the step first (SPEC §2: a committed step is never
	// dropped) and keeps the spool; the next agent adopts it and the job restores from RAM.
	require.NoError(t, c.Save(ctx, 13))
	stopAgent(t, a)
	require.True(t, isMounted(n.spool), "a spool holding checkpoints is kept on a clean stop")
	b := n.start(t)
	c = nemoClient(t, n.dir, job)
	require.NoError(t, c.Handshake(ctx))
	step, found, err = c.Restore(ctx)
	require.NoError(t, err)
	require.True(t, found, "restart after a clean stop restored nothing\n%s", b.log())
	require.EqualValues(t, 12, step)
	require.NoError(t, c.VerifyRestored(ctx, 12))
}

// TestNeMoOnlySaveAtGlobalStepOne: NeMo commits global step 1 as step 0, and takes no restore
// of step 0. The agent cannot make it take one; it tells the job and the log, where the job
// started from scratch without a word (found by a black-box run).
func TestNeMoOnlySaveAtGlobalStepOne(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	n := newRepNode(t)
	const job = "gpt"
	a := n.start(t)
	c := nemoClient(t, n.dir, job)
	require.NoError(t, c.Handshake(ctx))
	_, found, err := c.Restore(ctx)
	require.NoError(t, err)
	require.False(t, found)
	require.NoError(t, c.Save(ctx, 1))
	waitStepSealed(t, n.dir, job, 0)

	c = nemoClient(t, n.dir, job)
	require.NoError(t, c.Handshake(ctx))
	_, found, err = c.Restore(ctx)
	require.NoError(t, err)
	require.False(t, found, "NeMo leaves a step-0 marker alone")
	const said = "step 0 (NeMo's global step 1) is restored, but NeMo takes no restore of step 0"
	repWait(t, 5*time.Second, "the line in replicator.errors", func() bool {
		b, _ := os.ReadFile(filepath.Join(n.dir, "replicator.errors"))
		return strings.Contains(string(b)+strings.Join(c.Errors(), "\n"), said)
	})
	require.Contains(t, a.log(), said)
	stopAgent(t, a)
}

// TestRestoreFromBackup: a node that lost its RAM tier restores from the backup; a backup with
// a missing data object is reported damaged (by backups verify and list, and to the job) and
// never restored.
func TestRestoreFromBackup(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	n := newRepNode(t)
	const job = "bk"
	a := n.start(t)

	o := orbaxClient(t, n.dir, job, fastBackupMinutes)
	_, found, err := o.Start(ctx)
	require.NoError(t, err)
	require.False(t, found)
	require.NoError(t, o.Save(ctx, 0))
	waitStepSealed(t, n.dir, job, 0) // the first sync starts the backup clock
	require.NoError(t, o.Save(ctx, 10))
	name := waitCompleteBackup(t, n, job, 10)
	assert.NoFileExists(t, filepath.Join(n.backupRoot, job, name, job+"-s0-n0-w0.meta"), "step 0 was not due for a backup")
	stopAgent(t, a)
	n.dropSpool(t)

	// A fresh node: nothing in RAM, so the newest complete backup is restored.
	b := n.start(t)
	o = orbaxClient(t, n.dir, job, fastBackupMinutes)
	step, found, err := o.Start(ctx)
	require.NoError(t, err)
	require.True(t, found, "nothing restored from backup %s\n%s", name, b.log())
	require.EqualValues(t, 10, step)
	pre, err := os.ReadFile(filepath.Join(n.dir, "replicator.prerestore"))
	require.NoError(t, err)
	assert.Contains(t, string(pre), "restore-step: 10")
	assert.Contains(t, string(pre), "restore-backup: "+name)
	require.NoError(t, o.VerifyRestored(ctx, 10))

	out, code := runMtcfs(t, "backups", "verify", "--backup", n.backupURL(), "--job", job)
	require.Equal(t, 0, code, "backups verify of an intact backup: %s", out)
	assert.Contains(t, out, name)
	assert.Contains(t, out, "complete")
	assert.NotContains(t, out, "INCOMPLETE")
	stopAgent(t, b)
	n.dropSpool(t)

	// Lose one data object of the only backup.
	var victim string
	backupDir := filepath.Join(n.backupRoot, job, name)
	require.NoError(t, filepath.WalkDir(backupDir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || victim != "" {
			return err
		}
		rel, _ := filepath.Rel(backupDir, p)
		if d.Type().IsRegular() && strings.Contains(rel, ".data/") && !strings.HasPrefix(d.Name(), ".") {
			victim = p
		}
		return nil
	}))
	require.NotEmpty(t, victim, "no data object in %s", backupDir)
	require.NoError(t, os.Remove(victim))
	t.Logf("removed %s", victim)
	out, code = runMtcfs(t, "backups", "verify", "--backup", n.backupURL(), "--job", job)
	assert.NotEqual(t, 0, code, "backups verify must fail on a damaged backup: %s", out)
	assert.Contains(t, out, "DAMAGED")
	assert.Contains(t, out, "10(damaged)")
	assert.Contains(t, out, name+" step 10: ")
	assert.Contains(t, out, "missing")
	out, code = runMtcfs(t, "backups", "list", "--backup", n.backupURL(), "--job", job)
	assert.Equal(t, 0, code, "backups list: %s", out)
	assert.Contains(t, out, "DAMAGED", "backups list shows the damage too")
	assert.Contains(t, out, name+" step 10: ")
	out, code = runMtcfs(t, "restore-version", "set", name, "--backup", n.backupURL(), "--job", job)
	assert.NotEqual(t, 0, code, "restore-version set must refuse an incomplete backup: %s", out)
	assert.NoFileExists(t, filepath.Join(n.backupRoot, job, "restore.version"))

	c := n.start(t)
	o = orbaxClient(t, n.dir, job, fastBackupMinutes)
	step, found, err = o.Start(ctx)
	require.NoError(t, err)
	require.False(t, found, "restored step %d from a damaged backup\n%s", step, c.log())
	require.FileExists(t, filepath.Join(n.dir, job+"-s0-n0-w0.restore"), "an empty s0 marker says: nothing to restore")
	pre, err = os.ReadFile(filepath.Join(n.dir, "replicator.prerestore"))
	require.NoError(t, err)
	assert.Equal(t, "{}", strings.TrimSpace(string(pre)))
	// Never a silent fresh start (SPEC §10): the job read why, before its s0 marker.
	errs := strings.Join(o.Errors(), "\n")
	assert.Contains(t, errs, "backup "+name+": step 10 is damaged and is not restored: ")
	assert.Contains(t, errs, "missing")
	assert.Contains(t, errs, "no intact checkpoint is left: starting from scratch")
}

// TestRestoreVersionMissing: a pin naming a backup that does not exist starts the job from
// scratch with a line in replicator.errors, and is deleted after the next saved step.
func TestRestoreVersionMissing(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	n := newRepNode(t)
	const job = "pinned"
	const missing = "2001-01-01_00-00"
	pin := filepath.Join(n.backupRoot, job, "restore.version")

	out, code := runMtcfs(t, "restore-version", "set", missing, "--backup", n.backupURL(), "--job", job)
	require.NotEqual(t, 0, code, "restore-version set must refuse a backup that does not exist: %s", out)
	assert.Contains(t, out, missing)
	require.NoFileExists(t, pin)

	require.NoError(t, os.MkdirAll(filepath.Dir(pin), 0o755))
	require.NoError(t, os.WriteFile(pin, []byte(missing+"\n"), 0o644))
	a := n.start(t)
	o := orbaxClient(t, n.dir, job, 0)
	step, found, err := o.Start(ctx)
	require.NoError(t, err)
	require.False(t, found, "restored step %d though the pinned backup does not exist", step)
	var line string
	for _, l := range o.Errors() {
		if strings.Contains(l, "restore.version") && strings.Contains(l, missing) {
			line = l
		}
	}
	require.NotEmpty(t, line, "replicator.errors should say that the pinned backup is missing; got %q\n%s", o.Errors(), a.log())
	assert.Regexp(t, `^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z job=`+job+` node=0/1 ERR `, line)
	assert.FileExists(t, pin, "the pin is one-shot: deleted after the next sync, not at the handshake")

	require.NoError(t, o.Save(ctx, 0))
	waitStepSealed(t, n.dir, job, 0)
	repWait(t, 10*time.Second, "restore.version to be deleted after the first sync", func() bool { return !pathExists(pin) })
}

// TestBadYAMLKeepsAgentHealthy: each invalid replicator.yaml ends in replicator.failed naming
// the key; the agent stays live and answers the next valid handshake.
func TestBadYAMLKeepsAgentHealthy(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	n := newRepNode(t)
	a := n.start(t, "--http", "127.0.0.1:0")
	addr := agentHTTPAddr(t, a)
	yamlPath := filepath.Join(n.dir, "replicator.yaml")
	failedPath := filepath.Join(n.dir, "replicator.failed")
	const rest = "node-rank: 0\nnodes: 1\npeer-ranks: []\nbackup-interval-minutes: 30"

	big := []byte("job-name: big\nframework: orbax\n" + rest + "\n")
	for len(big) < 70<<10 {
		big = append(big, "# padding padding padding padding padding padding padding padding\n"...)
	}
	cases := []struct {
		name    string
		content []byte
		want    []string // substrings of the replicator.failed line
	}{
		{"missing job-name", []byte("framework: orbax\n" + rest), []string{"job-name: required"}},
		{"unknown framework", []byte("job-name: j\nframework: tensorflow\n" + rest), []string{"framework: ", "tensorflow"}},
		{"node-rank out of range", []byte("job-name: j\nframework: orbax\nnode-rank: 2\nnodes: 2\npeer-ranks: []\nbackup-interval-minutes: 30"),
			[]string{"node-rank: ", "out of range"}},
		{"not YAML", []byte("job-name: [unclosed\nframework: {orbax\n"), []string{"replicator.yaml: "}},
		{"70 KiB", big, []string{"replicator.yaml: ", "65536"}},
	}
	lineRE := regexp.MustCompile(`^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z job=\S+ node=\S+/\S+ FATAL `)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := os.WriteFile(yamlPath, tc.content, 0o644)
			if len(tc.content) > 64<<10 {
				require.True(t, errors.Is(err, syscall.EFBIG), "a write past 64 KiB must fail with EFBIG, got %v", err)
			} else {
				require.NoError(t, err)
			}
			repWait(t, 5*time.Second, "replicator.yaml to be consumed and replicator.failed written", func() bool {
				return !pathExists(yamlPath) && pathExists(failedPath)
			})
			data, err := os.ReadFile(failedPath)
			require.NoError(t, err)
			require.NoError(t, os.Remove(failedPath))
			lines := strings.Split(strings.TrimSpace(string(data)), "\n")
			require.Len(t, lines, 1, "one fatal line per bad yaml: %q", data)
			assert.Regexp(t, lineRE, lines[0])
			for _, w := range tc.want {
				assert.Contains(t, lines[0], w)
			}
			assert.NoFileExists(t, filepath.Join(n.dir, "replicator.prerestore"), "nothing starts after a bad yaml")
			matches, _ := filepath.Glob(filepath.Join(n.dir, "*.restore"))
			assert.Empty(t, matches, "no restore markers after a bad yaml")

			resp, err := http.Get("http://" + addr + "/livez")
			require.NoError(t, err)
			resp.Body.Close()
			require.Equal(t, http.StatusOK, resp.StatusCode)
		})
	}

	// Written in pieces past the limit, each further piece failing too: one line, not one per
	// refused write (black-box h60: two identical FATAL lines).
	t.Run("70 KiB in pieces", func(t *testing.T) {
		f, err := os.OpenFile(yamlPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
		require.NoError(t, err)
		refused := 0
		for off := 0; off < len(big); off += 1 << 10 {
			if _, err := f.Write(big[off:min(off+1<<10, len(big))]); errors.Is(err, syscall.EFBIG) {
				refused++
			}
		}
		require.NoError(t, f.Close())
		require.Greater(t, refused, 1, "several writes refused")
		repWait(t, 5*time.Second, "replicator.failed", func() bool { return !pathExists(yamlPath) && pathExists(failedPath) })
		time.Sleep(200 * time.Millisecond) // a second line would be written by now
		data, err := os.ReadFile(failedPath)
		require.NoError(t, err)
		require.NoError(t, os.Remove(failedPath))
		assert.Len(t, strings.Split(strings.TrimSpace(string(data)), "\n"), 1, "one fatal line: %q", data)
	})

	// The real client's path (tmp + rename) with a bad rank ends in a fatal error naming it.
	o := orbaxClient(t, n.dir, "bad", 0)
	o.Rank, o.Nodes = 3, 2
	_, _, err := o.Start(ctx)
	var fatal *jobsim.FatalError
	require.True(t, errors.As(err, &fatal), "want a fatal error from replicator.failed, got %v", err)
	require.Len(t, fatal.Lines, 1)
	assert.Contains(t, fatal.Lines[0], "node-rank: 3 is out of range")
	assert.NoFileExists(t, failedPath, "the client unlinked replicator.failed")

	o = orbaxClient(t, n.dir, "good", 0)
	_, found, err := o.Start(ctx)
	require.NoError(t, err, "a valid handshake after bad ones\n%s", a.log())
	require.False(t, found)
	assert.Empty(t, o.Errors(), "replicator.errors of the new incarnation holds only its own lines")
	require.NoError(t, o.Save(ctx, 0))
	waitStepSealed(t, n.dir, "good", 0)
}

// TestStatusJSON: `mtcfs status --json` shows the job, its rank, the steps in RAM and the last
// backup.
func TestStatusJSON(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	n := newRepNode(t)
	const job = "stat"
	a := n.start(t, "--http", "127.0.0.1:0")
	addr := agentHTTPAddr(t, a)

	o := orbaxClient(t, n.dir, job, fastBackupMinutes)
	_, _, err := o.Start(ctx)
	require.NoError(t, err)
	require.NoError(t, o.Save(ctx, 0))
	waitStepSealed(t, n.dir, job, 0)
	require.NoError(t, o.Save(ctx, 10))
	waitStepSealed(t, n.dir, job, 10)
	hash, err := os.ReadFile(metaPath(n.dir, job, 10))
	require.NoError(t, err)

	var st statusReply
	var out string
	repWait(t, 20*time.Second, "status to show the last backup", func() bool {
		var code int
		out, code = runMtcfs(t, "status", "--json", "--http", addr)
		require.Equal(t, 0, code, "status: %s", out)
		var replies []statusReply
		require.NoError(t, json.Unmarshal([]byte(out), &replies), "status --json: %s", out)
		require.Len(t, replies, 1)
		st = replies[0]
		return st.LastBackup != ""
	})
	t.Logf("status --json:\n%s", out)
	assert.Equal(t, a.cmd.Process.Pid, st.PID)
	assert.Equal(t, n.dir, st.Dir)
	assert.Equal(t, addr, st.HTTP)
	assert.Equal(t, job, st.Job)
	assert.Equal(t, "orbax", st.Framework)
	assert.Equal(t, 0, st.Rank)
	assert.Equal(t, 1, st.Nodes)
	assert.Equal(t, "running", st.Phase)
	assert.EqualValues(t, 10, st.Committed)
	assert.NotEmpty(t, st.Incarnation)
	assert.Equal(t, n.backupURL(), st.BackupStore)
	assert.Equal(t, n.spool, st.Spool.Dir)
	assert.Positive(t, st.Spool.Used)
	var steps []int64
	for _, s := range st.Steps {
		steps = append(steps, s.Step)
		if s.Step == 10 {
			assert.Equal(t, 0, s.Rank)
			assert.Equal(t, string(hash)+".data", s.Data)
		}
	}
	assert.Equal(t, []int64{10}, steps, "steps in RAM: the latest one (older ones freed)")
	assert.Regexp(t, `^\d{4}-\d{2}-\d{2}_\d{2}-\d{2}$`, st.LastBackup)
	assert.Equal(t, st.LastBackup, waitCompleteBackup(t, n, job, 10))

	out, code := runMtcfs(t, "status", "--http", addr)
	require.Equal(t, 0, code, out)
	assert.Contains(t, out, "job        "+job)
	assert.Contains(t, out, "last: "+st.LastBackup)

	// After an agent restart, the job restores step 10 from RAM, and the newest backup holds
	// that very step: status says so at once (a black-box run: backed up -1, no last backup,
	// until a next backup that the step did not need).
	killAgent(t, a)
	b := n.start(t, "--http", "127.0.0.1:0")
	addr = agentHTTPAddr(t, b)
	o = orbaxClient(t, n.dir, job, fastBackupMinutes)
	step, found, err := o.Start(ctx)
	require.NoError(t, err)
	require.True(t, found && step == 10, "restored step %d (found %v), want 10", step, found)
	out, code = runMtcfs(t, "status", "--json", "--http", addr)
	require.Equal(t, 0, code, "status: %s", out)
	var replies []statusReply
	require.NoError(t, json.Unmarshal([]byte(out), &replies), "status --json: %s", out)
	require.Len(t, replies, 1)
	assert.Equal(t, st.LastBackup, replies[0].LastBackup, "the backup holding the restored step")
	assert.EqualValues(t, 10, replies[0].BackedUp)
	assert.Nil(t, replies[0].InRAMOnly, "step 10 is in a backup")

	// A step saved after it, in RAM only, restored after another agent restart: status still
	// names the backup of step 10 as the last one (a black-box run: no "(last: …)" at all after
	// the restart, while the other nodes named it) and step 20 as in RAM only.
	o = orbaxClient(t, n.dir, job, 60) // no backup of step 20 before the kill
	step, found, err = o.Start(ctx)
	require.NoError(t, err)
	require.True(t, found && step == 10, "restored step %d (found %v), want 10", step, found)
	require.NoError(t, o.Save(ctx, 20))
	waitStepSealed(t, n.dir, job, 20)
	killAgent(t, b)
	c := n.start(t, "--http", "127.0.0.1:0")
	addr = agentHTTPAddr(t, c)
	o = orbaxClient(t, n.dir, job, 60)
	step, found, err = o.Start(ctx)
	require.NoError(t, err)
	require.True(t, found && step == 20, "restored step %d (found %v), want 20", step, found)
	out, code = runMtcfs(t, "status", "--json", "--http", addr)
	require.Equal(t, 0, code, "status: %s", out)
	replies = nil
	require.NoError(t, json.Unmarshal([]byte(out), &replies), "status --json: %s", out)
	require.Len(t, replies, 1)
	assert.Equal(t, st.LastBackup, replies[0].LastBackup, "the newest backup, of step 10")
	assert.EqualValues(t, 10, replies[0].BackedUp)
	if assert.NotNil(t, replies[0].InRAMOnly, "step 20 is in RAM only") {
		assert.EqualValues(t, 20, *replies[0].InRAMOnly)
	}
	out, code = runMtcfs(t, "status", "--http", addr)
	require.Equal(t, 0, code, out)
	assert.Contains(t, out, "(last: "+st.LastBackup+"); step 20 in RAM only, not in a backup yet")
}

// TestKillDuringStartup: agents SIGKILLed at points spread over their start (spool, listener,
// mount, adoption, serving) each exit at once. A kill that lands while the agent's own process
// waits on its mount (go-fuse's poll hack did, as the mount went live) leaves that thread
// waiting for an answer no one will give: the agent never exits and its mount hangs.
func TestKillDuringStartup(t *testing.T) {
	needRoot(t)
	n := newRepNode(t)
	t.Cleanup(func() { forceUnmount(n.dir); forceUnmount(n.spool) })
	for i := range 25 {
		delay := time.Duration(i) * 8 * time.Millisecond
		forceUnmount(n.dir)
		cmd := exec.Command(binPath, "mount", n.dir, "--spool", n.spool, "--memory", "64MiB", "--backup", n.backupURL())
		require.NoError(t, cmd.Start())
		time.Sleep(delay)
		killAndWait(t, cmd, n.dir)
	}
	forceUnmount(n.dir)
	n.start(t) // and the next agent starts on what they left
}

// TestKillDuringAdoption: agents killed while they adopt a step of 10,000 small files (before,
// while and after its tree is built and verified), one after the other; the next agent still
// adopts the step and the job restores it from RAM, byte for byte, and the files every killed
// agent had started to link are removed.
func TestKillDuringAdoption(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	n := newRepNode(t)
	const job = "adoptkill"
	a := n.start(t, "--memory", "256MiB")
	o := orbaxClient(t, n.dir, job, 1000)
	_, _, err := o.Start(ctx)
	require.NoError(t, err)
	tr := tree{"_CHECKPOINT_METADATA": fileEnt([]byte(`{"commit_timestamp_nsecs": 1}`))}
	for i := range 10000 {
		tr[fmt.Sprintf("d%02d/f%05d", i%20, i)] = fileEnt(randomBytes(uint64(i), 2048))
	}
	require.NoError(t, saveTree(n.dir, 10, tr.withParents()))
	waitStepSealed(t, n.dir, job, 10)
	killAgent(t, a)
	for _, delay := range []time.Duration{50 * time.Millisecond, 150 * time.Millisecond, 300 * time.Millisecond} {
		forceUnmount(n.dir)
		cmd := exec.Command(binPath, "mount", n.dir, "--spool", n.spool, "--memory", "256MiB", "--backup", n.backupURL())
		require.NoError(t, cmd.Start())
		time.Sleep(delay)
		killAndWait(t, cmd, n.dir)
		linked, _ := os.ReadDir(filepath.Join(n.spool, "files"))
		t.Logf("killed %v after its start: %d files linked", delay, len(linked))
	}
	forceUnmount(n.dir)
	c := n.start(t, "--memory", "256MiB")
	o = orbaxClient(t, n.dir, job, 1000)
	step, found, err := o.Start(ctx)
	require.NoError(t, err)
	require.True(t, found && step == 10, "restored step %d (found %v)\n%s", step, found, c.log())
	require.NoError(t, sameTree(filepath.Join(n.dir, "10"), tr.withParents()))
	pre, err := os.ReadFile(filepath.Join(n.dir, "replicator.prerestore"))
	require.NoError(t, err)
	require.NotContains(t, string(pre), "restore-backup", "the step comes from RAM, not the backup")
	require.Eventually(t, func() bool {
		trash, _ := filepath.Glob(filepath.Join(n.spool, ".files-trash-*"))
		return len(trash) == 0
	}, 10*time.Second, 20*time.Millisecond, "the killed agents' files are never removed")
}

// TestYAMLAnsweredWhenItsWriterIsDone: replicator.yaml is answered at the close of its last
// writer that changed it, and only the version read is removed. Black-box h59: an open for
// writing closed without a write (`touch`) while the job still wrote the file had the agent
// answer half a file (FATAL, the yaml removed, the job's rest written into nothing: 4 of 4);
// and a yaml written again in place at once (NeMo writes it directly) was removed unanswered
// with the first one's answer (10 of 10).
func TestYAMLAnsweredWhenItsWriterIsDone(t *testing.T) {
	needRoot(t)
	n := newRepNode(t)
	a := n.start(t)
	yamlPath := filepath.Join(n.dir, "replicator.yaml")
	yaml := func(job string) string {
		return "job-name: " + job + "\nframework: orbax\nnode-rank: 0\nnodes: 1\npeer-ranks: []\nbackup-interval-minutes: 60"
	}
	marker := func(job string) string { return filepath.Join(n.dir, job+"-s0-n0-w0.restore") }

	t.Run("touched while written", func(t *testing.T) {
		f, err := os.OpenFile(yamlPath, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
		require.NoError(t, err)
		defer f.Close()
		whole := yaml("half")
		_, err = f.WriteString(whole[:20])
		require.NoError(t, err)
		for _, flags := range []int{os.O_WRONLY | os.O_CREATE, os.O_RDWR} { // touch; an open closed unwritten
			g, err := os.OpenFile(yamlPath, flags, 0o644)
			require.NoError(t, err)
			require.NoError(t, g.Close())
		}
		time.Sleep(1500 * time.Millisecond) // the agent answers a close within milliseconds
		assert.FileExists(t, yamlPath, "answered before its writer was done\n%s", a.log())
		assert.NoFileExists(t, filepath.Join(n.dir, "replicator.failed"))
		_, err = f.WriteString(whole[20:])
		require.NoError(t, err)
		require.NoError(t, f.Close())
		repWait(t, 10*time.Second, "the job's handshake", func() bool { return pathExists(marker("half")) })
		assert.NoFileExists(t, filepath.Join(n.dir, "replicator.failed"), "%s", a.log())
		assert.NoFileExists(t, yamlPath)
	})
	t.Run("written twice at once", func(t *testing.T) {
		for try := 0; try < 30; try++ { // the second open(O_CREAT) races the first's removal: it got ENOENT
			first, second := fmt.Sprintf("first%d", try), fmt.Sprintf("second%d", try)
			require.NoError(t, os.WriteFile(yamlPath, []byte(yaml(first)), 0o644))
			require.NoError(t, os.WriteFile(yamlPath, []byte(yaml(second)), 0o644))
			repWait(t, 10*time.Second, "the second yaml's answer", func() bool { return pathExists(marker(second)) })
			repWait(t, 10*time.Second, "the yaml to go", func() bool { return !pathExists(yamlPath) })
			assert.NoFileExists(t, filepath.Join(n.dir, "replicator.failed"), "%s", a.log())
		}
	})
}

// TestYAMLHeldOpenByAnotherIsAnsweredInTime: a replicator.yaml the job wrote and closed while
// another process holds it open for writing is answered as it is once yamlHeldWait passed (1 s
// here, 30 s by default): the job waited out its 300 s, told nothing (black-box h60).
func TestYAMLHeldOpenByAnotherIsAnsweredInTime(t *testing.T) {
	needRoot(t)
	t.Setenv(yamlHeldWaitEnv, "1s")
	n := newRepNode(t)
	a := n.start(t)
	yamlPath := filepath.Join(n.dir, "replicator.yaml")
	holder, err := os.OpenFile(yamlPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	require.NoError(t, err)
	defer holder.Close()
	require.NoError(t, os.WriteFile(yamlPath, []byte("job-name: held\nframework: orbax\nnode-rank: 0\nnodes: 1\npeer-ranks: []\nbackup-interval-minutes: 60"), 0o644))
	repWait(t, 10*time.Second, "the held yaml's answer", func() bool { return pathExists(filepath.Join(n.dir, "held-s0-n0-w0.restore")) })
	assert.NoFileExists(t, yamlPath)
	assert.Contains(t, a.log(), "replicator.yaml is still open for writing by a process other than the one that closed it: answered as it is")
}

// TestYAMLInADirectoryOfTheMountIsRefused: a job whose CHECKPOINT_DIR is a directory inside the
// mount gets a replicator.failed there saying where its yaml belongs, at once. It waited 300 s
// for an answer that never came (black-box h59). A file named replicator.yaml inside a step is
// the job's data, and left alone.
func TestYAMLInADirectoryOfTheMountIsRefused(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	n := newRepNode(t)
	a := n.start(t)
	sub := filepath.Join(n.dir, "run1")
	require.NoError(t, os.Mkdir(sub, 0o755))
	for _, nemo := range []bool{false, true} { // renamed onto its name; written directly
		var err error
		if nemo {
			c := nemoClient(t, sub, "job")
			if err = c.Handshake(ctx); err == nil {
				_, _, err = c.Restore(ctx)
			}
		} else {
			_, _, err = orbaxClient(t, sub, "job", 60).Start(ctx)
		}
		require.Error(t, err, "%s", a.log())
		assert.Contains(t, err.Error(), "replicator.yaml was written into run1/, a directory of the mtcfs mount, not its root", "nemo %v", nemo)
		assert.NoFileExists(t, filepath.Join(sub, "replicator.yaml"))
		require.NoError(t, os.RemoveAll(filepath.Join(sub, "replicator.failed")))
	}
	// In a step being saved, a replicator.yaml is data.
	tmp := filepath.Join(n.dir, "3.orbax-checkpoint-tmp")
	require.NoError(t, os.Mkdir(tmp, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(tmp, "replicator.yaml"), []byte("job-name: x"), 0o644))
	time.Sleep(500 * time.Millisecond)
	assert.FileExists(t, filepath.Join(tmp, "replicator.yaml"))
	assert.NoFileExists(t, filepath.Join(tmp, "replicator.failed"))
}

// TestRAMWarningAfterARestoreCountsWhatIsBeingFreed: the restart of a job whose save failed
// with ENOSPC is not told its RAM is full when the save cut short, which the handshake removes,
// is still held by the dead job's descriptors for a moment. It read "this node's RAM is 100%
// full" with 10 MiB of 32 in use (black-box h59: 3 of 4).
func TestRAMWarningAfterARestoreCountsWhatIsBeingFreed(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	n := newRepNode(t)
	n.args = []string{"--memory", "32MiB"}
	a := n.start(t)
	const job = "full"
	o := orbaxClient(t, n.dir, job, 60)
	o.Content = jobsim.Content{Files: 1, FileSize: 10 << 20}
	_, _, err := o.Start(ctx)
	require.NoError(t, err)
	require.NoError(t, o.Save(ctx, 1))
	waitStepSealed(t, n.dir, job, 1)
	// Step 2 fills the RAM, and its writer dies holding it (its descriptor closes only now).
	tmp := filepath.Join(n.dir, "2.orbax-checkpoint-tmp")
	require.NoError(t, os.Mkdir(tmp, 0o755))
	f, err := os.Create(filepath.Join(tmp, "big"))
	require.NoError(t, err)
	defer f.Close()
	chunk := make([]byte, 1<<20)
	for err == nil {
		_, err = f.Write(chunk)
	}
	require.ErrorIs(t, err, syscall.ENOSPC)
	o = orbaxClient(t, n.dir, job, 60)
	step, found, err := o.Start(ctx)
	require.NoError(t, err)
	require.True(t, found && step == 1, "restored %d (found %v)", step, found)
	require.NoError(t, f.Close())
	assert.NotContains(t, strings.Join(o.Errors(), "\n"), "RAM is", "%s", a.log())
}

// TestSpoolReadOnlyForAMomentLosesNoCommit: a spool remounted read-only for a moment right after
// the job committed a step (`mount -o remount,ro`, then rw) loses no commit: its seal is tried
// again until the spool is writable, /readyz and status say why meanwhile, and the job's
// restart restores the step. The seal failed once with EROFS, the step was "not checkpointed",
// the line saying so could not be written, and the restarted job started from the step before
// without a word (a black-box run: 3 of 4).
func TestSpoolReadOnlyForAMomentLosesNoCommit(t *testing.T) {
	needRoot(t)
	t.Setenv(sealDelayEnv, "1s") // the commit is still unsealed when the spool turns read-only
	ctx := repCtx(t)
	n := newRepNode(t)
	a := n.start(t, "--http", "127.0.0.1:0")
	addr := agentHTTPAddr(t, a)
	const job = "ro"
	o := startedOrbax(t, ctx, n.dir, job, 60)
	require.NoError(t, o.Save(ctx, 1))
	waitStepSealed(t, n.dir, job, 1)
	require.NoError(t, o.Save(ctx, 2))
	tmp3 := filepath.Join(n.dir, "3.orbax-checkpoint-tmp") // written whole before the spool turns read-only
	require.NoError(t, os.Mkdir(tmp3, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(tmp3, "state"), []byte("step 3"), 0o644))
	readOnly := func(ro bool) {
		flags := uintptr(unix.MS_REMOUNT)
		if ro {
			flags |= unix.MS_RDONLY
		}
		// EBUSY while a file of the spool is open for writing (the agent hashing the step's
		// files as they were closed): tried until it is not.
		repWait(t, 10*time.Second, "the remount", func() bool { return unix.Mount("none", n.spool, "", flags, "") == nil })
	}
	readOnly(true)
	t.Cleanup(func() { unix.Mount("none", n.spool, "", unix.MS_REMOUNT, "") }) // also on failure: the agent's stop must write
	resp, err := http.Get("http://" + addr + "/readyz")
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	assert.Contains(t, string(body), "the spool at "+n.spool+" is read-only")
	// A commit while it is read-only fails: it could not be recorded before the rename returned,
	// and a kill of the agent then lost it (black-box h60: 4 of 4).
	assert.ErrorIs(t, os.Rename(tmp3, filepath.Join(n.dir, "3")), syscall.EROFS)
	repWait(t, 20*time.Second, "the seal to fail on the read-only spool", func() bool {
		return strings.Contains(a.log(), "sealing a committed step failed; trying again") && strings.Contains(a.log(), "read-only file system")
	})
	readOnly(false)
	waitStepSealed(t, n.dir, job, 2)
	require.NoError(t, os.RemoveAll(tmp3)) // the job's failed save, which it removes
	out, code := runMtcfs(t, "status", "--http", addr)
	assert.Equal(t, 0, code, out)
	assert.NotContains(t, out, "NOT READY")

	o = orbaxClient(t, n.dir, job, 60)
	step, found, err := o.Start(ctx)
	require.NoError(t, err)
	require.True(t, found && step == 2, "restored step %d (found %v), want 2\n%s", step, found, a.log())
	require.NoError(t, o.VerifyRestored(ctx, 2))
	assert.Empty(t, o.Errors(), "replicator.errors")
	assert.NotContains(t, a.log(), "seal failed")

	// Killed while it is read-only: the next agent makes it writable again, and says so (it
	// did so silently: black-box h60); the job restores its step.
	readOnly(true)
	killAgent(t, a)
	b := n.start(t)
	assert.Contains(t, b.log(), "the kept spool's tmpfs was read-only")
	o = orbaxClient(t, n.dir, job, 60)
	step, found, err = o.Start(ctx)
	require.NoError(t, err)
	require.True(t, found && step == 2, "restored step %d (found %v), want 2\n%s", step, found, b.log())
}

// TestReadyzSaysWhenTheNodeIsUnreachable: /readyz answers 503, with why, once the mount was
// detached lazily while a process held it (the directory no longer leads to the agent: a job's
// restart writes its replicator.yaml below it and waits in vain), or once the spool's tmpfs was
// unmounted from under the agent. Both left the probes at 200 in a black-box run of an operator.
func TestReadyzSaysWhenTheNodeIsUnreachable(t *testing.T) {
	needRoot(t)
	readyz := func(addr string) (int, string) {
		resp, err := http.Get("http://" + addr + "/readyz")
		require.NoError(t, err)
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	t.Run("mount detached", func(t *testing.T) {
		n := newRepNode(t)
		a := n.start(t, "--http", "127.0.0.1:0")
		addr := agentHTTPAddr(t, a)
		code, _ := readyz(addr)
		require.Equal(t, http.StatusOK, code)
		held, err := os.Open(n.dir) // a process that holds the mount
		require.NoError(t, err)
		t.Cleanup(func() { held.Close() })
		require.NoError(t, unix.Unmount(n.dir, unix.MNT_DETACH))
		code, body := readyz(addr)
		assert.Equal(t, http.StatusServiceUnavailable, code)
		assert.Contains(t, body, "was detached (umount -l) while a process held it")
		require.NoError(t, held.Close())
		// The last holder gone, the agent sees the unmount and exits, with a failure for a
		// supervisor that restarts on failure only (it exited 0: an operator's black-box run).
		assert.Equal(t, 1, a.wait(30*time.Second))
		assert.Contains(t, a.log(), "was unmounted from outside the agent")
	})
	t.Run("spool unmounted", func(t *testing.T) {
		n := newRepNode(t)
		a := n.start(t, "--http", "127.0.0.1:0")
		addr := agentHTTPAddr(t, a)
		require.NoError(t, unix.Unmount(n.spool, unix.MNT_DETACH))
		code, body := readyz(addr)
		assert.Equal(t, http.StatusServiceUnavailable, code)
		assert.Contains(t, body, "the spool's tmpfs at "+n.spool+" was unmounted from under the agent")
		repWait(t, 10*time.Second, "the agent to log it", func() bool { return strings.Contains(a.log(), "was unmounted from under the agent") })
		// mtcfs status says it too, and fails (it said "running", a step "in RAM" that was gone).
		out, code := runMtcfs(t, "status", "--http", addr)
		assert.Equal(t, 1, code, out)
		assert.Contains(t, out, "NOT READY  the spool's tmpfs at "+n.spool+" was unmounted")
	})
}
