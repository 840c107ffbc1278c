// Command demo is the scripted walk-through behind "make demo". On one machine it runs the
// single-node story of mtcfs with an unmodified-Orbax-style client (internal/jobsim):
//
//  1. an agent mounts a scratch CHECKPOINT_DIR with a local backup directory;
//  2. a fresh job starts (nothing to restore) and saves steps, one of which is backed up;
//  3. the training client crashes and restarts: it restores the newest step from RAM;
//  4. the agent is killed with SIGKILL and restarted: it adopts the step still in its spool and
//     the job restores it from RAM again;
//  5. mtcfs restore-version set pins an older backup: the next start restores it from the
//     backup, and the pin is consumed by the next saved step;
//  6. the agent is stopped with SIGTERM: it unmounts and keeps the spool that holds a checkpoint;
//
// then (cluster.go) a three-node job on three agents that find each other through their shared
// backup location:
//
//  7. the job saves steps on every rank, each replicating to the next rank, and one is backed up;
//  8. a replaced node (SIGKILL, its RAM gone, a new agent) restores its step from a peer;
//  9. every agent is lost and the job restores from the backup;
//
// and then stops the agents and removes everything it made.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/internal/jobsim"
)

func main() {
	bin := flag.String("mtcfs", "bin/mtcfs", "mtcfs binary")
	files := flag.Int("files", 8, "state files per checkpoint")
	fileMiB := flag.Int("file-mib", 32, "MiB per state file")
	flag.Parse()
	d := &demo{bin: *bin, content: jobsim.Content{Files: *files, FileSize: int64(*fileMiB) << 20}}
	err := d.run()
	d.cleanup()
	if err != nil {
		fmt.Fprintln(os.Stderr, "demo failed:", err)
		os.Exit(1)
	}
}

type demo struct {
	bin                       string
	content                   jobsim.Content
	base, dir, spool, backups string
	agent                     *agentProc
	cluster                   []*agentProc
}

func say(format string, args ...any)  { fmt.Printf("\n==> "+format+"\n", args...) }
func note(format string, args ...any) { fmt.Printf("    "+format+"\n", args...) }

const job = "demo-run"

func (d *demo) run() error {
	var err error
	if d.base, err = os.MkdirTemp("", "mtcfs-demo"); err != nil {
		return err
	}
	d.dir, d.spool, d.backups = filepath.Join(d.base, "ckpt"), filepath.Join(d.base, "spool"), filepath.Join(d.base, "backups")
	if err := os.Mkdir(d.dir, 0o755); err != nil {
		return err
	}
	ctx := context.Background()
	stepBytes := int64(d.content.Files) * d.content.FileSize

	say("1. start an agent: %s mount %s --backup file://%s --memory 2GiB", d.bin, d.dir, d.backups)
	if err := d.startAgent(); err != nil {
		return err
	}

	say("2. a fresh job starts (Orbax protocol: replicator.yaml.tmp → replicator.yaml, wait, glob *.restore)")
	c := d.client()
	if _, found, err := c.Start(ctx); err != nil {
		return err
	} else if found {
		return errors.New("a fresh job found something to restore")
	}
	note("nothing to restore: the agent answered with an empty %s-s0-n0-w0.restore", job)
	var backup string // the backup of step 100
	for _, s := range []int64{0, 100, 200} {
		start := time.Now()
		if err := c.Save(ctx, s); err != nil {
			return err
		}
		took := time.Since(start)
		note("saved step %d: %d MiB in %v (%.2f GB/s), committed by renaming %d.orbax-checkpoint-tmp → %d",
			s, stepBytes>>20, took.Round(time.Millisecond), float64(stepBytes)/took.Seconds()/1e9, s, s)
		if s == 100 {
			if backup, err = d.waitBackup(ctx, 100); err != nil {
				return err
			}
		}
	}
	d.show("ls -l "+d.dir, "ls", "-l", d.dir)
	d.show("mtcfs status "+d.dir, d.bin, "status", d.dir)

	say("3. the training client crashes and restarts: restore from RAM")
	if err := d.restore(ctx, 200, "RAM"); err != nil {
		return err
	}

	say("4. the agent is killed with SIGKILL and restarted on the same directory")
	d.agent.kill()
	_, err = os.Stat(filepath.Join(d.dir, "x"))
	note("the dead mount answers: %v", err)
	if err := d.startAgent(); err != nil {
		return err
	}
	if err := d.restore(ctx, 200, "RAM (adopted from the spool the killed agent left)"); err != nil {
		return err
	}

	say("5. pin the next restore to the backup with mtcfs restore-version set")
	d.show("mtcfs backups list", d.bin, "backups", "list", "--backup", "file://"+d.backups, "--job", job)
	// The backup of step 100, not the newest: when the demo crosses a UTC minute, step 200 gets
	// a backup of its own in the next one (backup names are unique per minute).
	d.show("mtcfs restore-version set "+backup, d.bin, "restore-version", "set", backup, "--backup", "file://"+d.backups, "--job", job)
	if err := d.restore(ctx, 100, "backup "+backup); err != nil {
		return err
	}
	c = d.client()
	// The restore above left the job running; it saves a new step, whose sync consumes the pin.
	c.Start(ctx)
	if err := c.Save(ctx, 300); err != nil {
		return err
	}
	pin := filepath.Join(d.backups, job, "restore.version")
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if _, err := os.Stat(pin); errors.Is(err, os.ErrNotExist) {
			note("step 300 saved and synced: restore.version is gone (the pin is one-shot)")
			break
		}
	}

	say("6. stop the agent with SIGTERM")
	if err := d.stopAgent(); err != nil {
		return err
	}
	note("unmounted %s; the spool is kept for a next agent because it holds a checkpoint", d.dir)
	return d.runCluster(ctx)
}

func (d *demo) client() *jobsim.Orbax {
	return &jobsim.Orbax{Dir: d.dir, Job: job, Nodes: 1, BackupIntervalMinutes: 0.02,
		Poll: 50 * time.Millisecond, Timeout: 60 * time.Second, Content: d.content}
}

// restore starts a new client, checks it restores want, and verifies every byte.
func (d *demo) restore(ctx context.Context, want int64, from string) error {
	c := d.client()
	start := time.Now()
	got, found, err := c.Start(ctx)
	if err != nil {
		return err
	}
	if !found || got != want {
		return fmt.Errorf("restored step %d (found %v), want %d", got, found, want)
	}
	took := time.Since(start)
	pre, _ := os.ReadFile(filepath.Join(d.dir, "replicator.prerestore"))
	note("restored step %d from %s in %v (handshake, restore decision, markers); prerestore: %s",
		got, from, took.Round(time.Millisecond), strings.TrimSpace(string(pre)))
	start = time.Now()
	if err := c.VerifyRestored(ctx, got); err != nil {
		return err
	}
	bytes := int64(d.content.Files) * d.content.FileSize
	took = time.Since(start)
	note("read back and verified %d MiB through the %d symlink in %v (%.2f GB/s, incl. comparison)",
		bytes>>20, got, took.Round(time.Millisecond), float64(bytes)/took.Seconds()/1e9)
	return nil
}

// waitBackup waits for a complete backup of step: the coordinator orders it on its own clock,
// backup-interval-minutes (0.02: 1.2 s) after its first sync, without another save.
func (d *demo) waitBackup(ctx context.Context, step int64) (string, error) {
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		out, err := exec.Command(d.bin, "backups", "list", "--backup", "file://"+d.backups, "--job", job).Output()
		if name := completeBackupOf(string(out), step); err == nil && name != "" {
			note("the coordinator's clock ordered a backup of the newest step, %d (1.2 s after its first sync, no further save needed): uploaded to file://%s/%s/%s (data first, .meta last)", step, d.backups, job, name)
			return name, nil
		}
	}
	return "", fmt.Errorf("no complete backup of step %d within 30s", step)
}

// completeBackupOf returns the name of a complete backup whose steps include step in a
// `mtcfs backups list` table, or "".
func completeBackupOf(table string, step int64) string {
	for _, line := range strings.Split(table, "\n") {
		f := strings.Fields(line)
		if len(f) >= 3 && f[1] == "complete" && slices.Contains(strings.Split(f[2], ","), strconv.FormatInt(step, 10)) {
			return f[0]
		}
	}
	return ""
}

func (d *demo) show(title string, name string, args ...string) {
	out, err := exec.Command(name, args...).CombinedOutput()
	fmt.Printf("    $ %s\n", title)
	for _, l := range strings.Split(strings.TrimRight(string(out), "\n"), "\n") {
		fmt.Printf("      %s\n", l)
	}
	if err != nil {
		fmt.Printf("      (%v)\n", err)
	}
}

func (d *demo) startAgent() error {
	a, err := startProc(d.bin, d.dir, d.spool, d.backups)
	d.agent = a
	return err
}

func (d *demo) stopAgent() error {
	if d.agent == nil {
		return nil
	}
	err := d.agent.stop()
	d.agent = nil
	return err
}

// agentProc is an mtcfs agent the demo runs.
type agentProc struct {
	cmd  *exec.Cmd
	done chan error
	logs []string // the log lines up to "serving"
}

// startProc runs "mtcfs mount dir" and waits until it serves, printing the lines worth seeing.
func startProc(bin, dir, spool, backups string, extra ...string) (*agentProc, error) {
	args := append([]string{"mount", dir, "--memory", "2GiB", "--spool", spool, "--backup", "file://" + backups}, extra...)
	cmd := exec.Command(bin, args...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w (run make build first)", bin, err)
	}
	a := &agentProc{cmd: cmd, done: make(chan error, 1)}
	sc := bufio.NewScanner(stderr)
	for sc.Scan() {
		l := sc.Text()
		a.logs = append(a.logs, l)
		if strings.Contains(l, "detached") || strings.Contains(l, "adopted") || strings.Contains(l, "mounted") {
			note("agent: %s", logMessage(l))
		}
		if strings.Contains(l, "serving") {
			go func() {
				// The same scanner: a new one would lose what this one has read ahead.
				for sc.Scan() {
					if l := sc.Text(); strings.Contains(l, "restored from a peer") || strings.Contains(l, "replicated") {
						note("agent %s: %s", filepath.Base(dir), logMessage(l))
					}
				}
				io.Copy(io.Discard, stderr) // after a line too long to scan: the agent must not block on its stderr
				a.done <- cmd.Wait()
			}()
			return a, nil
		}
	}
	err = cmd.Wait()
	a.done <- err
	return a, fmt.Errorf("agent exited before serving (%v):\n%s", err, strings.Join(a.logs, "\n"))
}

// logMessage is a text log line from its msg= attribute on, or the whole line without one.
func logMessage(l string) string {
	if i := strings.Index(l, "msg="); i >= 0 {
		return l[i:]
	}
	return l
}

func (a *agentProc) stop() error {
	a.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-a.done:
		return err
	case <-time.After(30 * time.Second):
		a.cmd.Process.Kill()
		return errors.New("agent did not stop within 30s")
	}
}

func (a *agentProc) kill() {
	a.cmd.Process.Signal(syscall.SIGKILL)
	<-a.done
}

// cleanup stops the agents that still run and removes every mount and file the demo made.
func (d *demo) cleanup() {
	for _, a := range append(d.cluster, d.agent) {
		if a != nil {
			a.stop()
		}
	}
	if data, err := os.ReadFile("/proc/self/mounts"); err == nil && d.base != "" {
		for _, line := range strings.Split(string(data), "\n") {
			if f := strings.Fields(line); len(f) > 1 && strings.HasPrefix(f[1], d.base+"/") {
				unix.Unmount(f[1], unix.MNT_DETACH)
			}
		}
	}
	if d.base != "" {
		os.RemoveAll(d.base)
	}
	if data, _ := os.ReadFile("/proc/self/mounts"); d.base != "" && strings.Contains(string(data), d.base) {
		fmt.Fprintln(os.Stderr, "demo: something is still mounted under", d.base)
		os.Exit(1)
	}
	say("cleaned up: nothing of the demo is mounted or left on disk")
}
