package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/bench/internal/benchkit"
)

// Keys of the recorded samples, one value per measured repetition: what each measures, and its
// unit, as the table of raw samples shows them.
const (
	kYAML         = "yaml consumed (rename of replicator.yaml.tmp → replicator.yaml absent), ms"
	kYAMLPoll     = "yaml stat poll period, average, µs"
	kSeal         = "commit → .meta in the mount, ms"
	kSealAgent    = "agent: mtcfs_seal_duration_seconds, ms"
	kTmpfsRead    = "read of the tree from tmpfs, ms"
	kSaveWrite    = "write of the step through the mount (mkdir to the last close), ms"
	kSealNow      = "committed right after the last close: commit → .meta, ms"
	kSealNowAgent = "committed right after the last close: agent's mtcfs_seal_duration_seconds, ms"
	kBackup       = "commit → backup .meta in the backup directory, ms"
	kBackupSealed = "same repetitions: commit → .meta in the mount, ms"
	kBackupAgent  = "agent: mtcfs_backup_duration_seconds, ms"
	kCp           = "cp -r, ms"
	kCpSync       = "cp -r + sync of its files and directories, ms"
	kBackupCPU    = "agent CPU, commit → backup complete, ms"
	kCpCPU        = "cp -r CPU, ms"
	kCpSyncCPU    = "cp -r + sync CPU, ms"
)

// Poll periods: the yaml poll must resolve well below its 100 ms target, the others time
// seconds.
const (
	yamlPoll = 100 * time.Microsecond
	slowPoll = 500 * time.Microsecond
)

// nap sleeps with a plain nanosleep: Go's timers may round sub-millisecond sleeps up.
func nap(d time.Duration) {
	ts := unix.NsecToTimespec(d.Nanoseconds())
	for unix.Nanosleep(&ts, &ts) == unix.EINTR {
	}
}

// openDir returns an O_PATH descriptor of dir for fstatat. It pins the mount: close it before
// the agent stops.
func openDir(dir string) (int, error) {
	fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("open %s: %w", dir, err)
	}
	return fd, nil
}

// present reports whether dirfd/name exists (fstatat, not following symlinks).
func present(dirfd int, name string) (bool, error) {
	var st unix.Stat_t
	for {
		switch err := unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err {
		case nil:
			return true, nil
		case unix.ENOENT:
			return false, nil
		case unix.EINTR:
			continue
		default:
			return false, fmt.Errorf("stat %s: %w", name, err)
		}
	}
}

// yamlText is a replicator.yaml as Orbax writes it: one key per line, no trailing newline.
func yamlText(job, interval string) string {
	return strings.Join([]string{
		"job-name: " + job,
		"framework: orbax",
		"node-rank: 0",
		"nodes: 1",
		"peer-ranks: []",
		interval,
	}, "\n")
}

// handshake plays Orbax's start-up against the agent: wait for replicator.yaml to be absent,
// write replicator.yaml.tmp, rename it onto replicator.yaml, and poll until the agent consumed
// it. It returns the time from the rename returning to the yaml being absent and the average
// poll period achieved, then waits for this incarnation's .restore marker and checks
// replicator.failed, as the client would.
func (b *bench) handshake(ctx context.Context, a *agent, job, interval string) (latency, pollPeriod time.Duration, err error) {
	const yaml, tmp = "replicator.yaml", "replicator.yaml.tmp"
	dirfd, err := openDir(a.Dir)
	if err != nil {
		return 0, 0, err
	}
	defer unix.Close(dirfd)
	for deadline := time.Now().Add(10 * time.Second); ; {
		if ok, err := present(dirfd, yaml); err != nil {
			return 0, 0, err
		} else if !ok {
			break
		}
		if time.Now().After(deadline) {
			return 0, 0, errors.New("replicator.yaml of an earlier handshake still present after 10s")
		}
		time.Sleep(time.Millisecond)
	}
	if err := os.WriteFile(filepath.Join(a.Dir, tmp), []byte(yamlText(job, interval)), 0o644); err != nil {
		return 0, 0, err
	}
	if err := unix.Renameat(dirfd, tmp, dirfd, yaml); err != nil {
		return 0, 0, fmt.Errorf("rename %s → %s: %w", tmp, yaml, err)
	}
	start := time.Now()
	polls := 0
	for {
		polls++
		ok, err := present(dirfd, yaml)
		if err != nil {
			return 0, 0, err
		}
		if !ok {
			break
		}
		if time.Since(start) > 60*time.Second {
			return 0, 0, fmt.Errorf("replicator.yaml not consumed after 60s; agent log:\n%s", a.Log())
		}
		nap(yamlPoll)
	}
	latency = time.Since(start)
	pollPeriod = latency / time.Duration(polls)
	if err := a.waitIncarnation(ctx, job); err != nil {
		return 0, 0, err
	}
	return latency, pollPeriod, nil
}

// waitIncarnation waits for the job's .restore marker (the end of the restore negotiation),
// failing on replicator.failed; it reads and removes replicator.errors like the client.
func (a *agent) waitIncarnation(ctx context.Context, job string) error {
	deadline := time.Now().Add(60 * time.Second)
	for {
		if data, err := os.ReadFile(filepath.Join(a.Dir, "replicator.failed")); err == nil {
			return fmt.Errorf("agent %s wrote replicator.failed: %s", a.name, strings.TrimSpace(string(data)))
		}
		ents, err := os.ReadDir(a.Dir)
		if err != nil {
			return err
		}
		for _, e := range ents {
			if strings.HasPrefix(e.Name(), job+"-s") && strings.HasSuffix(e.Name(), ".restore") {
				errs := filepath.Join(a.Dir, "replicator.errors")
				if data, err := os.ReadFile(errs); err == nil {
					fmt.Fprintf(os.Stderr, "replbench: note: agent %s replicator.errors: %s\n", a.name, strings.TrimSpace(string(data)))
					os.Remove(errs)
				}
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no .restore marker for job %s after 60s; agent log:\n%s", job, a.Log())
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// measureYAML runs the handshake -warmup + -yaml-reps times on one agent, each with a new job
// name, i.e. a new incarnation.
func (b *bench) measureYAML(ctx context.Context, a *agent) error {
	for i := -b.cfg.warmup; i < b.cfg.yamlReps; i++ {
		lat, period, err := b.handshake(ctx, a, fmt.Sprintf("yaml%d", i+b.cfg.warmup), "backup-interval-minutes: 60")
		if err != nil {
			return fmt.Errorf("yaml repetition %d: %w", i, err)
		}
		if i >= 0 {
			b.res.Add(kYAML, ms(lat))
			b.res.Add(kYAMLPoll, float64(period.Microseconds()))
		}
		b.progress("yaml consumed", i, ms(lat), "ms")
	}
	return nil
}

// What the agent measures itself, from its /metrics (README: Metrics).
const (
	sealSeconds   = "mtcfs_seal_duration_seconds"   // commit → .meta, per step and worker
	backupSeconds = "mtcfs_backup_duration_seconds" // this node's part of one backup
)

// measureSeal saves a new step of the tree per repetition through the agent's mount, lets the
// files sit closed for -settle, and times the commit until the .meta appears. Beside it, in an
// order alternating per repetition, it reads the tree once from /dev/shm.
func (b *bench) measureSeal(ctx context.Context, a *agent) error {
	job := "seal-" + b.runID
	if _, _, err := b.handshake(ctx, a, job, "backup-interval-minutes: 60"); err != nil {
		return err
	}
	buf := make([]byte, ioBufSize)
	if _, _, err := b.tree.readOnce(buf); err != nil { // warm
		return err
	}
	for i := -b.cfg.warmup; i < b.cfg.reps; i++ {
		step := int64(2*(i+b.cfg.warmup) + 1)
		if err := b.tree.stamp(fmt.Sprintf("%s seal step %d", b.runID, step)); err != nil {
			return err
		}
		saveStart := time.Now()
		tmp, err := b.tree.saveStep(a.Dir, step)
		if err != nil {
			return fmt.Errorf("save step %d: %w", step, err)
		}
		save := time.Since(saveStart)
		time.Sleep(b.cfg.settle)
		var sealed, agentTook, read time.Duration
		for _, what := range rotate([]string{"mtcfs", "tmpfs"}, i+b.cfg.warmup) {
			if err := ctx.Err(); err != nil {
				return err
			}
			switch what {
			case "tmpfs":
				var n int64
				if read, n, err = b.tree.readOnce(buf); err != nil {
					return err
				}
				if n != b.tree.total() {
					return fmt.Errorf("read %d bytes of the tree, want %d", n, b.tree.total())
				}
			case "mtcfs":
				if sealed, agentTook, err = b.commitAndWaitSealed(ctx, a, job, step, tmp); err != nil {
					return err
				}
				time.Sleep(200 * time.Millisecond) // let retention free the previous step
			}
		}
		// Without a target: the same, committed right after the last file's close.
		now := step + 1
		if err := b.tree.stamp(fmt.Sprintf("%s seal step %d", b.runID, now)); err != nil {
			return err
		}
		if tmp, err = b.tree.saveStep(a.Dir, now); err != nil {
			return fmt.Errorf("save step %d: %w", now, err)
		}
		sealedNow, agentNow, err := b.commitAndWaitSealed(ctx, a, job, now, tmp)
		if err != nil {
			return err
		}
		time.Sleep(200 * time.Millisecond)
		st, err := a.Status()
		if err != nil {
			return err
		}
		for _, e := range st.Errors {
			if strings.Contains(e, "not making progress") {
				return fmt.Errorf("agent says training is not making progress: the stamped content did not change the hash (%s)", e)
			}
		}
		if i >= 0 {
			b.res.Add(kSeal, ms(sealed))
			b.res.Add(kSealAgent, ms(agentTook))
			b.res.Add(kTmpfsRead, ms(read))
			b.res.Add(kSaveWrite, ms(save))
			b.res.Add(kSealNow, ms(sealedNow))
			b.res.Add(kSealNowAgent, ms(agentNow))
		}
		b.progress(fmt.Sprintf("commit→sealed %s (agent: %v), tmpfs read %v; write of the step %v; committed right after the close: sealed after %v (agent: %v)",
			round(sealed), round(agentTook), round(read), round(save), round(sealedNow), round(agentNow)), i, 0, "")
	}
	return nil
}

// commitAndWaitSealed renames tmp to the step's bare decimal and polls for the .meta, and
// returns that time and the agent's own seal duration of the step (one observation of
// sealSeconds). It checks that the .meta names data present in the mount.
func (b *bench) commitAndWaitSealed(ctx context.Context, a *agent, job string, step int64, tmp string) (took, agentTook time.Duration, err error) {
	dirfd, err := openDir(a.Dir)
	if err != nil {
		return 0, 0, err
	}
	defer unix.Close(dirfd)
	before, err := a.Histogram(sealSeconds)
	if err != nil {
		return 0, 0, err
	}
	meta := fmt.Sprintf("%s-s%d-n0-w0.meta", job, step)
	if err := unix.Renameat(dirfd, filepath.Base(tmp), dirfd, fmt.Sprint(step)); err != nil {
		return 0, 0, fmt.Errorf("commit step %d: %w", step, err)
	}
	start := time.Now()
	for {
		ok, err := present(dirfd, meta)
		if err != nil {
			return 0, 0, err
		}
		if ok {
			break
		}
		if time.Since(start) > 5*time.Minute {
			return 0, 0, fmt.Errorf("%s did not appear within 5 minutes of the commit; agent log:\n%s", meta, a.Log())
		}
		nap(slowPoll)
	}
	took = time.Since(start)
	hash, err := os.ReadFile(filepath.Join(a.Dir, meta))
	if err != nil {
		return 0, 0, err
	}
	if ok, err := present(dirfd, string(hash)+".data"); err != nil || !ok {
		return 0, 0, fmt.Errorf("%s names %s.data, which is not in the mount (%v)", meta, hash, err)
	}
	seal, err := a.WaitObserved(ctx, before, 5*time.Second, sealSeconds)
	if err != nil {
		return 0, 0, err
	}
	if seal.Count != 1 {
		return 0, 0, fmt.Errorf("step %d: the agent observed %d seals, want 1", step, seal.Count)
	}
	return took, seconds(seal.Sum), nil
}

// measureBackup runs per repetition, in an order rotating per repetition: a backup of the
// tree by a fresh agent and job (see backupOnce), cp -r of the tree to the backup disk, and
// cp -r followed by sync of what it wrote. Before each, everything dirty is synced (untimed),
// and each copy is deleted afterwards.
func (b *bench) measureBackup(ctx context.Context) error {
	cpRoot := filepath.Join(b.base, "cp")
	if err := os.MkdirAll(cpRoot, 0o755); err != nil {
		return err
	}
	for i := -b.cfg.warmup; i < b.cfg.reps; i++ {
		n := i + b.cfg.warmup
		var total, sealed, agentTook, cp, cpSync, agentCPU, cpCPU, cpSyncCPU time.Duration
		for _, what := range rotate([]string{"mtcfs", "cp", "cp+sync"}, n) {
			if err := ctx.Err(); err != nil {
				return err
			}
			var err error
			switch what {
			case "mtcfs":
				total, sealed, agentTook, agentCPU, err = b.backupOnce(ctx, n)
			case "cp":
				cp, cpCPU, err = b.timeCp(ctx, filepath.Join(cpRoot, fmt.Sprintf("plain-%d", n)), false)
			case "cp+sync":
				cpSync, cpSyncCPU, err = b.timeCp(ctx, filepath.Join(cpRoot, fmt.Sprintf("sync-%d", n)), true)
			}
			if err != nil {
				if ctx.Err() != nil {
					return ctx.Err()
				}
				return fmt.Errorf("backup repetition %d, %s: %w", i, what, err)
			}
		}
		if i >= 0 {
			b.res.Add(kBackup, ms(total))
			b.res.Add(kBackupSealed, ms(sealed))
			b.res.Add(kBackupAgent, ms(agentTook))
			b.res.Add(kCp, ms(cp))
			b.res.Add(kCpSync, ms(cpSync))
			b.res.Add(kBackupCPU, ms(agentCPU))
			b.res.Add(kCpCPU, ms(cpCPU))
			b.res.Add(kCpSyncCPU, ms(cpSyncCPU))
		}
		b.progress(fmt.Sprintf("commit→backup complete %v (sealed after %v, agent's upload %v, agent CPU %v), cp -r %v (CPU %v), cp -r + sync %v (CPU %v)",
			round(total), round(sealed), round(agentTook), round(agentCPU), round(cp), round(cpCPU), round(cpSync), round(cpSyncCPU)), i, 0, "")
	}
	return nil
}

func (b *bench) timeCp(ctx context.Context, dst string, syncFiles bool) (wall, cpu time.Duration, err error) {
	unix.Sync()
	wall, cpu, err = b.tree.cpTree(ctx, dst, syncFiles)
	if err != nil {
		return 0, 0, err
	}
	if err := verifySizes(dst, b.tree); err != nil {
		return 0, 0, err
	}
	unix.Sync() // the plain copy's dirty pages must not slow down the next measurement
	return wall, cpu, os.RemoveAll(dst)
}

// backupOnce starts a fresh agent with a new job (a backup namespace of its own; the agent takes
// at most one backup per UTC minute), saves the tree as step 1 and times the commit until the
// backup's .meta exists in the backup directory (it is uploaded last, after the data and its
// manifest, each fsynced), noting on the way when the step was sealed. It checks that
// /status reports the backup and that the backup holds the whole tree, then stops the agent and
// deletes the backup.
func (b *bench) backupOnce(ctx context.Context, n int) (total, sealed, agentTook, agentCPU time.Duration, err error) {
	a, err := b.startAgent(ctx, fmt.Sprintf("backup%d", n), b.backupRoot)
	if err != nil {
		return 0, 0, 0, 0, err
	}
	defer func() {
		err = errors.Join(err, a.Stop())
		benchkit.RemoveAllUnlessMounted(filepath.Join(b.base, a.name)) // best effort: the run's directory goes at the end anyway
	}()
	job := fmt.Sprintf("bk-%s-%d", b.runID, n)
	if _, _, err := b.handshake(ctx, a, job, "backup-interval-steps: 1"); err != nil {
		return 0, 0, 0, 0, err
	}
	if err := b.tree.stamp(fmt.Sprintf("%s backup %d", b.runID, n)); err != nil {
		return 0, 0, 0, 0, err
	}
	tmp, err := b.tree.saveStep(a.Dir, 1)
	if err != nil {
		return 0, 0, 0, 0, err
	}
	time.Sleep(b.cfg.settle)
	unix.Sync()

	dirfd, err := openDir(a.Dir)
	if err != nil {
		return 0, 0, 0, 0, err
	}
	defer func() {
		if dirfd >= 0 {
			unix.Close(dirfd) // before the agent stops: it pins the mount
		}
	}()
	meta := job + "-s1-n0-w0.meta"
	jobDir := filepath.Join(b.backupRoot, job)
	cpu0 := benchkit.ProcessCPU(a.Pid())
	if err := unix.Renameat(dirfd, filepath.Base(tmp), dirfd, "1"); err != nil {
		return 0, 0, 0, 0, fmt.Errorf("commit: %w", err)
	}
	start := time.Now()
	var backupName string
	for backupName == "" {
		if sealed == 0 {
			if ok, err := present(dirfd, meta); err != nil {
				return 0, 0, 0, 0, err
			} else if ok {
				sealed = time.Since(start)
			}
		}
		ents, _ := os.ReadDir(jobDir) // absent until the first object is written
		for _, e := range ents {
			if _, err := os.Lstat(filepath.Join(jobDir, e.Name(), meta)); err == nil {
				backupName = e.Name()
			}
		}
		if time.Since(start) > 10*time.Minute {
			return 0, 0, 0, 0, fmt.Errorf("no backup of step 1 in %s after 10 minutes; agent log:\n%s", jobDir, a.Log())
		}
		if backupName == "" {
			nap(slowPoll)
		}
	}
	total = time.Since(start)
	agentCPU = benchkit.ProcessCPU(a.Pid()) - cpu0
	if sealed == 0 {
		sealed = total // the .meta in the mount is written before the backup starts
	}
	unix.Close(dirfd)
	dirfd = -1

	// The agent's view: /status names the backup once Upload returned.
	for deadline := time.Now().Add(10 * time.Second); ; {
		st, err := a.Status()
		if err == nil && st.LastBackup == backupName {
			break
		}
		if time.Now().After(deadline) {
			return 0, 0, 0, 0, fmt.Errorf("/status last_backup is %q (err %v), want %q", st.LastBackup, err, backupName)
		}
		time.Sleep(5 * time.Millisecond)
	}
	// A fresh agent: its only backup (this node's part of it) is the one observation.
	upload, err := a.WaitObserved(ctx, benchkit.Histogram{}, 5*time.Second, backupSeconds)
	if err != nil {
		return 0, 0, 0, 0, err
	}
	agentTook = seconds(upload.Sum / float64(upload.Count))
	hash, err := os.ReadFile(filepath.Join(jobDir, backupName, meta))
	if err != nil {
		return 0, 0, 0, 0, err
	}
	if err := verifySizes(filepath.Join(jobDir, backupName, string(hash)+".data"), b.tree); err != nil {
		return 0, 0, 0, 0, fmt.Errorf("backup %s: %w", backupName, err)
	}
	return total, sealed, agentTook, agentCPU, os.RemoveAll(jobDir)
}

// verifySizes checks that dir holds every file of the tree with its size.
func verifySizes(dir string, t *tree) error {
	for _, rel := range t.files {
		fi, err := os.Stat(filepath.Join(dir, rel))
		if err != nil {
			return err
		}
		if fi.Size() != t.fileSize {
			return fmt.Errorf("%s has %d bytes, want %d", rel, fi.Size(), t.fileSize)
		}
	}
	return nil
}

// rotate returns xs rotated left by k, so that every item goes first in turn.
func rotate(xs []string, k int) []string {
	k %= len(xs)
	return append(append([]string(nil), xs[k:]...), xs[:k]...)
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

func round(d time.Duration) time.Duration {
	switch {
	case d >= time.Second:
		return d.Round(time.Millisecond)
	case d >= time.Millisecond:
		return d.Round(10 * time.Microsecond)
	}
	return d.Round(time.Microsecond)
}
