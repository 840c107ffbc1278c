package main

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mtcfs/mtcfs/gcsbackend"
	"github.com/mtcfs/mtcfs/internal/syncbuf"
	"github.com/mtcfs/mtcfs/tiers"
)

// backupOfTrain makes a file:// location holding backup 2026-12-05_10-00 of job train: step 7,
// one file, under a made-up hash (its data does not hash to it). It returns the directory and
// its URL.
func backupOfTrain(t *testing.T) (root, url string) {
	t.Helper()
	root = t.TempDir()
	url = "file://" + root
	store, err := gcsbackend.Open(url)
	require.NoError(t, err)
	src := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(src, "f"), []byte("state"), 0o644))
	require.NoError(t, (&gcsbackend.Backups{Store: store}).Upload(context.Background(), gcsbackend.UploadRequest{
		Job: "train", Backup: "2026-12-05_10-00", Step: 7, Hash: "D" + strings.Repeat("ab", 32), Source: src}))
	return root, url
}

// TestBackupCommandsOnMistypedInput: a mistyped --backup path, --job or backup NAME gets an
// answer that says so, instead of an empty listing or a store's "object not found".
func TestBackupCommandsOnMistypedInput(t *testing.T) {
	t.Parallel()
	root, url := backupOfTrain(t)
	const backup = "2026-12-05_10-00"

	out, code := runMtcfs(t, "backups", "list", "--backup", url, "--job", "train")
	require.Equal(t, 0, code, out)
	assert.Contains(t, out, backup)

	// The same directory written as file://localhost/… and with an escaped character.
	out, code = runMtcfs(t, "backups", "list", "--backup", "file://localhost"+strings.Replace(root, "t", "%74", 1), "--job", "train")
	require.Equal(t, 0, code, out)
	assert.Contains(t, out, backup)

	out, code = runMtcfs(t, "backups", "list", "--backup", url+"-typo", "--job", "train")
	assert.Equal(t, 1, code, out)
	assert.Contains(t, out, "--backup "+url+"-typo: no such directory")

	out, code = runMtcfs(t, "backups", "list", "--backup", url, "--job", "trian")
	assert.Equal(t, 0, code, out)
	assert.Contains(t, out, "no backups of job trian in "+url)
	assert.Contains(t, out, "jobs with something there: train")

	out, code = runMtcfs(t, "backups", "verify", "2026-01-01_00-00", "--backup", url, "--job", "train")
	assert.Equal(t, 1, code, out)
	assert.Contains(t, out, "no backup 2026-01-01_00-00 of job train in "+url+" (newest: "+backup)
	assert.NotContains(t, out, "not found")

	out, code = runMtcfs(t, "backups", "verify", backup, "--backup", url, "--job", "trian")
	assert.Equal(t, 1, code, out)
	assert.Contains(t, out, "no backups of job trian")

	out, code = runMtcfs(t, "restore-version", "set", "2026-01-01_00-00", "--backup", url, "--job", "train")
	assert.Equal(t, 1, code, out)
	assert.Contains(t, out, "job train has no backup 2026-01-01_00-00 in "+url)
	assert.NoFileExists(t, filepath.Join(root, "train", "restore.version"))

	// A backup that records no job shape (written without it here, as agents of early
	// versions did) is pinned with a warning: it may lack the parts of the job's highest ranks,
	// and the agents then start the job from scratch (a black-box run pinned such a backup of
	// a 2-node job, and lost the step in RAM).
	require.NoFileExists(t, filepath.Join(root, "train", backup, "mtcfs-backup.json"))
	out, code = runMtcfs(t, "restore-version", "set", backup, "--backup", url, "--job", "train")
	assert.Equal(t, 0, code, out)
	assert.Contains(t, out, "restores in a job with as many nodes as its .meta names and as many workers per node (a job of more nodes, not data-parallel, finds it incomplete)")
	assert.Contains(t, out, "mtcfs restore-version: backup "+backup+" does not record its job's shape")
	assert.Contains(t, out, "it is complete for a job of 1 node × 1 worker only; if the job has more nodes, its agents find it incomplete and the pin starts the job from scratch")
}

// TestSlowStoreNotice: a command at work with its backup location says so after a while, and
// again later, and stops saying it when it is done. Before, a location that did not answer left
// `mtcfs backups list` silent for minutes.
func TestSlowStoreNotice(t *testing.T) {
	var out syncbuf.Buffer
	stop := slowStore(&out, "backups list", fakeStoreName("gs://bucket/prefix"), 20*time.Millisecond, 20*time.Millisecond)
	require.Eventually(t, func() bool { return strings.Count(out.String(), "\n") >= 2 }, 5*time.Second, time.Millisecond)
	stop()
	n := out.String()
	time.Sleep(60 * time.Millisecond)
	assert.Equal(t, n, out.String(), "nothing after stop")
	assert.Contains(t, n, "mtcfs backups list: still at work with gs://bucket/prefix after ")
	var quick syncbuf.Buffer
	slowStore(&quick, "backups list", fakeStoreName("gs://bucket"), time.Minute, time.Minute)()
	assert.Empty(t, quick.String(), "a command done in time says nothing")
}

// blackholedLocation is a listener that accepts connections and never answers: a storage
// emulator (STORAGE_EMULATOR_HOST) behind a blackhole. It closes them when the test ends.
func blackholedLocation(t *testing.T) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() {
		var held []net.Conn
		for {
			c, err := ln.Accept()
			if err != nil {
				for _, c := range held {
					c.Close()
				}
				return
			}
			held = append(held, c) // never answered
		}
	}()
	t.Cleanup(func() { ln.Close() })
	return ln
}

// TestBackupCommandsTimeout: --timeout bounds the backup-location commands against a location
// that does not answer (a bucket behind a blackhole, here a listener that never replies): they
// exit 1 saying they gave up, where they retried for about 8 minutes before (a black-box run).
func TestBackupCommandsTimeout(t *testing.T) {
	t.Parallel()
	ln := blackholedLocation(t)
	run := func(args ...string) (string, int, time.Duration) {
		cmd := exec.Command(binPath, args...)
		cmd.Env = append(os.Environ(), "STORAGE_EMULATOR_HOST="+ln.Addr().String())
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		start := time.Now()
		err := cmd.Run()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		} else {
			require.NoError(t, err)
		}
		return out.String(), code, time.Since(start)
	}
	for _, args := range [][]string{
		{"backups", "list"},
		{"backups", "verify"},
		{"backups", "delete", "2026-12-05_10-00"},
		{"backups", "export", "2026-12-05_10-00", t.TempDir()},
		{"restore-version", "set", "2026-12-05_10-00"},
		{"restore-version", "clear"},
	} {
		out, code, took := run(append(args, "--backup", "gs://blackholed", "--job", "train", "--timeout", "2s")...)
		assert.Equal(t, 1, code, "%v: %s", args, out)
		assert.Contains(t, out, "gave up after --timeout 2s, still at work with gs://blackholed", "%v", args)
		assert.Less(t, took, time.Minute, "%v", args) // bounded: not the minutes of retries
	}
	out, code, _ := run("backups", "list", "--backup", "gs://blackholed", "--job", "train", "--timeout", "-1s")
	assert.Equal(t, 2, code, out)
	assert.Contains(t, out, "--timeout -1s: want a positive duration, or 0 for no limit")
}

// TestBackupCommandsStopAtCtrlC: Ctrl-C ends a backups command as --timeout does: it exits 1
// saying it was interrupted, and an export leaves its destination as it found it. Before, the
// process died of the signal, and an export left a hidden half-written data directory that made
// the next export refuse the destination (a black-box run).
func TestBackupCommandsStopAtCtrlC(t *testing.T) {
	t.Parallel()
	ln := blackholedLocation(t)
	dest := filepath.Join(t.TempDir(), "export")
	for _, args := range [][]string{
		{"backups", "list"},
		{"backups", "verify"},
		{"backups", "export", "2026-12-05_10-00", dest},
	} {
		cmd := exec.Command(binPath, append(args, "--backup", "gs://blackholed", "--job", "train")...)
		cmd.Env = append(os.Environ(), "STORAGE_EMULATOR_HOST="+ln.Addr().String())
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		require.NoError(t, cmd.Start())
		// Time to reach its work (the handler is set before any request): the blackholed
		// location holds it there for minutes.
		time.Sleep(2 * time.Second)
		require.NoError(t, cmd.Process.Signal(os.Interrupt))
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		var err error
		select {
		case err = <-done:
		case <-time.After(30 * time.Second):
			cmd.Process.Kill()
			t.Fatalf("%v: still running 30 s after Ctrl-C: %s", args, out.String())
		}
		var ee *exec.ExitError
		require.ErrorAs(t, err, &ee, "%v: %s", args, out.String())
		assert.Equal(t, 1, ee.ExitCode(), "%v: exit 1, not death by the signal: %s", args, out.String())
		assert.Contains(t, out.String(), "interrupted", "%v", args)
	}
	assert.True(t, emptyOrMissing(dest), "the export's destination is left as it was")
}

// TestBackupsExportFailureSaysTheDirectoryIsPartial: an export that fails after writing (here the
// data does not hash to the name its .meta gives) says that DIR holds part of it, which the next
// export refuses (a review).
func TestBackupsExportFailureSaysTheDirectoryIsPartial(t *testing.T) {
	t.Parallel()
	_, url := backupOfTrain(t)
	const backup = "2026-12-05_10-00"
	dir := filepath.Join(t.TempDir(), "export")
	out, code := runMtcfs(t, "backups", "export", backup, dir, "--backup", url, "--job", "train")
	require.Equal(t, 1, code, out)
	assert.Contains(t, out, "; "+dir+" holds what was exported before the failure: remove it before trying again")
	out, code = runMtcfs(t, "backups", "export", backup, dir, "--backup", url, "--job", "train")
	require.Equal(t, 1, code, out)
	assert.Contains(t, out, "is not empty")
	assert.NotContains(t, out, "holds what was exported before the failure", "a directory refused from the start is not called partial")
}

type fakeStoreName string

func (s fakeStoreName) String() string { return string(s) }

// TestBackupsDeleteRemovesOnlyIncompleteBackups: `mtcfs backups delete` removes a backup an
// upload cut short left (verify exits 1 while it is there, and no agent completes it once the
// job saved a newer step) and refuses every other (found by black-box runs: verify could not be
// used in monitoring after any crash).
func TestBackupsDeleteRemovesOnlyIncompleteBackups(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	url := "file://" + root
	store, err := gcsbackend.Open(url)
	require.NoError(t, err)
	b := &gcsbackend.Backups{Store: store}
	shape := tiers.Shape{Nodes: 2, Workers: 1}
	const complete, cut = "2026-12-05_10-00", "2026-12-05_10-01"
	upload := func(backup string, step int64, rank int) {
		src := t.TempDir()
		require.NoError(t, os.WriteFile(filepath.Join(src, "f"), []byte(fmt.Sprint("state ", step, rank)), 0o644))
		require.NoError(t, b.Upload(context.Background(), gcsbackend.UploadRequest{Job: "train", Backup: backup, Step: step,
			Slot: gcsbackend.Slot{Rank: rank}, Hash: "D" + strings.Repeat(fmt.Sprintf("%02x", 16*step+int64(rank)), 32), Source: src, Shape: shape}))
	}
	upload(complete, 7, 0)
	upload(complete, 7, 1)
	upload(cut, 8, 0) // rank 1's part was cut short
	out, code := runMtcfs(t, "backups", "list", "--backup", url, "--job", "train")
	require.Equal(t, 0, code, out)
	assert.Regexp(t, cut+` +INCOMPLETE .*written \d+s ago: an upload may still be running`, out)
	old := time.Now().Add(-time.Hour)
	require.NoError(t, filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			err = os.Chtimes(p, old, old)
		}
		return err
	}))

	out, code = runMtcfs(t, "backups", "verify", "--backup", url, "--job", "train")
	require.Equal(t, 1, code, out)
	assert.Contains(t, out, "an upload cut short (mtcfs backups delete "+cut+" removes it)")
	out, code = runMtcfs(t, "backups", "delete", complete, "--backup", url, "--job", "train")
	assert.Equal(t, 1, code, out)
	assert.Contains(t, out, "mtcfs deletes only incomplete backups")
	out, code = runMtcfs(t, "backups", "delete", cut, "--backup", url, "--job", "train")
	require.Equal(t, 0, code, out)
	assert.Contains(t, out, "deleted the incomplete backup "+cut+" of job train")
	out, code = runMtcfs(t, "backups", "verify", "--backup", url, "--job", "train")
	require.Equal(t, 0, code, out)
	assert.NotContains(t, out, cut)
	out, code = runMtcfs(t, "backups", "delete", cut, "--backup", url, "--job", "train")
	assert.Equal(t, 1, code, out)
	assert.Contains(t, out, "has no backup "+cut)
}

// TestStatusJSONOfNoAgent: `mtcfs status --json` of an agent that does not answer prints an
// empty list on stdout (it printed null) and the reason on stderr, and exits 1.
func TestStatusJSONOfNoAgent(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	ln.Close() // nothing listens there now
	cmd := exec.Command(binPath, "status", "--json", "--http", addr)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err = cmd.Run()
	var ee *exec.ExitError
	require.ErrorAs(t, err, &ee)
	assert.Equal(t, 1, ee.ExitCode())
	assert.Equal(t, "[]\n", stdout.String())
	assert.Contains(t, stderr.String(), "mtcfs status: agent at "+addr)
}

// TestStatusOfAnAgentWithoutHTTP: `mtcfs status DIR` of an agent started with --http "" says it
// serves no HTTP endpoint (it printed `Get "http:///status": http: no Host in request URL`).
func TestStatusOfAnAgentWithoutHTTP(t *testing.T) {
	needRoot(t)
	n := newRepNode(t)
	a := n.start(t, "--http", "")
	out, code := runMtcfs(t, "status", n.dir)
	assert.Equal(t, 1, code, out)
	assert.Contains(t, out, "serves no HTTP endpoint (started with --http \"\")")
	assert.NotContains(t, out, "no Host")
	stopAgent(t, a)
}
