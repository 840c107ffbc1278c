package crashsim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/mtcfs/mtcfs/internal/jobsim"
	"github.com/mtcfs/mtcfs/tiers"
)

// recover brings the killed agents back — on the same spool, or after a node replacement on a
// new one — and restarts the job on every rank, checking the invariant.
func (e *episode) recover(ctx context.Context, victims []int, k KillSpec) error {
	e.rep.Recoveries++
	if k.Drop {
		r := victims[0]
		if k.Kind == AllAgents {
			r = k.Victim
		}
		n := e.nodes[r]
		forceUnmount(n.dir)
		forceUnmount(n.spool)
		if err := os.RemoveAll(n.spool); err != nil {
			return err
		}
		e.m.dropped(r, time.Now())
		e.rep.Drops++
		e.logf("rank %d replaced: its RAM (spool) is gone", r)
	}
	for _, r := range victims {
		if err := e.startAgent(ctx, e.nodes[r]); err != nil {
			return err
		}
	}
	return e.restartJob(ctx, "recovery after "+string(k.Kind))
}

type startResult struct {
	step  int64
	found bool
	err   error
}

// restartJob starts the job on every rank with a new replicator.yaml, as the unmodified client
// does, and checks the invariant: every rank restores the same step, at least the bound, with
// exactly the bytes of one round of it (the same round on every rank); a fresh start only when
// nothing is owed. A failure that replicator.errors explains is recorded as a finding; one it
// does not explain is a violation. Then the restored step must be reported replicated again.
func (e *episode) restartJob(ctx context.Context, label string) error {
	bound, err := e.computeBound(ctx)
	if err != nil {
		return err
	}
	marks := make([]int, len(e.nodes))
	for i, n := range e.nodes {
		marks[i] = n.a.mark()
	}
	// A real job whose start fails with replicator.failed on one rank aborts on every rank and
	// is restarted: so does this one, twice at most. The job was told, so it is a finding, not a
	// violation — unless the restarts do not help either.
	var res []startResult
	var explained []string
	for attempt := 1; ; attempt++ {
		var fatal int
		res, fatal = e.startAll(ctx)
		// Lines that could say why a step is not restored (not, say, that a backup failed).
		for r := range e.spec.Nodes {
			for _, l := range e.noteErrors(r) {
				if explainsRE.MatchString(l) {
					explained = append(explained, l)
				}
			}
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if fatal < 0 || attempt == 3 {
			break
		}
		e.record(false, fmt.Sprintf("%s: the job's start failed on rank %d (%v); the job aborts and starts again", label, fatal, res[fatal].err), "")
	}
	for r, x := range res {
		if x.err != nil {
			return e.violation(fmt.Sprintf("%s: the job could not start on rank %d (bound: %s)", label, r, bound), x.err.Error())
		}
	}
	for r, x := range res {
		if x.found != res[0].found || x.step != res[0].step {
			return e.violation(fmt.Sprintf("%s: ranks restored different steps: rank 0 %s, rank %d %s", label, describe(res[0]), r, describe(x)), "")
		}
	}
	got := res[0]
	source := e.restoreSource(got, marks)
	e.rep.Restores[source]++
	e.logf("%s: restored %s from %s; bound %s", label, describe(got), source, bound)
	fail := func(what string) error {
		if len(explained) > 0 {
			e.record(false, what+" (explained in replicator.errors)", "replicator.errors: "+strings.Join(explained, " | "))
			return errEpisodeOver // the model cannot follow what the agents chose
		}
		return e.violation(what, "nothing in replicator.errors")
	}
	if !got.found {
		if bound.Found {
			return fail(fmt.Sprintf("%s: fresh start although %s is owed", label, bound))
		}
		e.resume(0)
		return nil
	}
	if got.step < bound.Step {
		return fail(fmt.Sprintf("%s: restored step %d, older than the bound %s", label, got.step, bound))
	}
	// Byte-exact, and one round on every rank.
	rounds := make([]int, e.spec.Nodes)
	for r := range e.spec.Nodes {
		id, err := e.identify(ctx, e.clients[r], r, got.step)
		if err != nil {
			return e.violation(fmt.Sprintf("%s: rank %d restored step %d with bytes that match no save of it", label, r, got.step), err.Error())
		}
		rounds[r] = id
	}
	// Every rank's bytes are some save of the step: the model can follow, so a mix of saves or
	// an older save than owed is recorded and the episode goes on.
	e.m.restored(rounds, time.Now())
	e.resume(got.step)
	for r := range rounds {
		if !e.m.shapeOf(rounds[r]).sameBytes(e.m.shapeOf(rounds[0])) {
			e.record(true, fmt.Sprintf("%s: step %d restored from different saves of it: rank 0 got round %d (%s), rank %d round %d (%s)",
				label, got.step, rounds[0], e.m.shapeOf(rounds[0]), r, rounds[r], e.m.shapeOf(rounds[r])), e.roundsHistory(got.step))
			break
		}
	}
	if got.step == bound.Step {
		for r := range rounds {
			if rounds[r] < bound.Round && !e.m.shapeOf(rounds[r]).sameBytes(e.m.shapeOf(bound.Round)) {
				e.record(true, fmt.Sprintf("%s: rank %d restored an older save (round %d) of step %d than the one owed (round %d, %s)",
					label, r, rounds[r], got.step, bound.Round, bound.Source), e.roundsHistory(got.step))
				break
			}
		}
	}
	return e.waitProtected(got.step)
}

// resume sets the step the job saves next after restoring step (0: nothing): the next one, as
// real training does, if the episode saves step numbers again; otherwise the one after the
// highest step ever started.
func (e *episode) resume(step int64) {
	e.nextStep = step + 10
	if !e.spec.Resave {
		e.nextStep = max(e.nextStep, e.maxStep+10)
	}
}

// startAll starts the job on every rank with a new replicator.yaml; when a rank's start ends
// with replicator.failed, the others are cancelled (the job aborts as a whole) and that rank
// is returned (-1: none).
func (e *episode) startAll(ctx context.Context) ([]startResult, int) {
	sctx, cancel := context.WithTimeout(ctx, 2*e.cfg.Scale.ClientTimeout)
	defer cancel()
	e.clients = make([]*jobsim.Orbax, e.spec.Nodes)
	e.errsSeen = make([]int, e.spec.Nodes)
	res := make([]startResult, e.spec.Nodes)
	var mu sync.Mutex
	fatal := -1
	var wg sync.WaitGroup
	for r := range e.spec.Nodes {
		e.clients[r] = e.newClient(r)
		wg.Go(func() {
			step, found, err := e.clients[r].Start(sctx)
			res[r] = startResult{step, found, err}
			var fe *jobsim.FatalError
			if errors.As(err, &fe) {
				mu.Lock()
				if fatal < 0 {
					fatal = r
				}
				mu.Unlock()
				cancel()
			}
		})
	}
	wg.Wait()
	return res, fatal
}

func describe(x startResult) string {
	if !x.found {
		return "nothing (fresh start)"
	}
	return fmt.Sprintf("step %d", x.step)
}

// roundsHistory lists the saves of step, for a finding.
func (e *episode) roundsHistory(step int64) string {
	var b strings.Builder
	fmt.Fprintf(&b, "  saves of step %d:\n", step)
	for _, rd := range e.m.byStep[step] {
		fmt.Fprintf(&b, "    round %d (%s): started %v, returned %v\n", rd.id, rd.shape, rd.tried, rd.ok)
	}
	return b.String()
}

// identify checks the step rank r restored byte by byte, through the client (VerifyRestored),
// against each save of it the rank may hold, newest first, and returns the one that matches.
func (e *episode) identify(ctx context.Context, o *jobsim.Orbax, r int, step int64) (int, error) {
	var first error
	for _, id := range e.m.candidates(r, step) {
		sh := e.m.shapeOf(id)
		o.Content = jobsim.Content{Files: sh.Files, FileSize: sh.FileSize}
		err := o.VerifyRestored(ctx, step)
		if err == nil {
			return id, nil
		}
		if first == nil {
			first = err
		}
	}
	if first == nil {
		first = fmt.Errorf("step %d was never saved", step)
	}
	return -1, first
}

// restoreSource tells where the restored step came from: the prerestore file names a backup,
// or an agent logged a fetch from a peer, or else every node had it in RAM.
func (e *episode) restoreSource(got startResult, marks []int) string {
	if !got.found {
		return "fresh start"
	}
	if pre, err := os.ReadFile(filepath.Join(e.nodes[0].dir, "replicator.prerestore")); err == nil && strings.Contains(string(pre), "restore-backup") {
		return "backup"
	}
	for i, n := range e.nodes {
		for _, l := range n.a.linesSince(marks[i]) {
			if strings.Contains(l, "restored from a peer") {
				return "peer"
			}
		}
	}
	return "RAM"
}

// waitProtected waits until every agent reports the restored step replicated again (SPEC §10)
// and takes it as the claim.
func (e *episode) waitProtected(step int64) error {
	if e.spec.Nodes < 2 {
		return nil
	}
	deadline := time.Now().Add(e.cfg.Scale.ProtectWait)
	var sts []tiers.Status
	for {
		sts = sts[:0]
		low := step
		for _, n := range e.nodes {
			st, err := n.a.status()
			if err != nil {
				st.Replicated = -2
			}
			sts = append(sts, st)
			low = min(low, st.Replicated)
		}
		if low >= step {
			return e.setClaim(low)
		}
		if time.Now().After(deadline) {
			var desc []string
			for r, st := range sts {
				desc = append(desc, fmt.Sprintf("rank %d: latest replicated %d", r, st.Replicated))
			}
			return e.violation(fmt.Sprintf("restored step %d is not reported replicated again within %v", step, e.cfg.Scale.ProtectWait), strings.Join(desc, "; "))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Backups.

// runMtcfs runs the mtcfs command line.
func (e *episode) runMtcfs(ctx context.Context, args ...string) (string, int, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, e.cfg.Bin, args...)
	out, err := cmd.CombinedOutput()
	if ee, ok := err.(*exec.ExitError); ok {
		return string(out), ee.ExitCode(), nil
	}
	return string(out), 0, err
}

// computeBound reads the backups (mtcfs backups list, each complete step checked byte by byte)
// and returns the invariant's bound.
func (e *episode) computeBound(ctx context.Context) (Bound, error) {
	if err := e.scanBackups(ctx, "list"); err != nil {
		return Bound{}, err
	}
	return e.m.bound(), nil
}

// scanBackups runs `mtcfs backups list` or `verify` and checks every step it shows complete:
// each rank's .meta must be there and name data holding exactly the bytes of one save of the
// step, the same save for every rank. The newest complete backup's step goes into the model.
func (e *episode) scanBackups(ctx context.Context, verb string) error {
	out, code, err := e.runMtcfs(ctx, "backups", verb, "--backup", "file://"+e.backupRoot, "--job", e.job)
	if err != nil {
		return err
	}
	if verb == "list" && code != 0 {
		return e.violation("mtcfs backups list failed", out)
	}
	var newest *backupHeld
	for _, row := range parseBackupRows(out) {
		for _, s := range row.steps {
			if s.damaged {
				return e.violation(fmt.Sprintf("mtcfs backups %s shows step %d of backup %s damaged: a .meta names data that is missing or differs from its manifest", verb, s.step, row.name), out)
			}
			if !s.complete {
				continue
			}
			round, missing, err := e.checkBackupStep(ctx, row.name, s.step)
			switch {
			case err != nil:
				return e.violation(fmt.Sprintf("mtcfs backups %s shows step %d of backup %s complete, but its data does not match what the job saved", verb, s.step, row.name), err.Error()+"\n"+out)
			case missing >= 0:
				key := fmt.Sprintf("missing/%s/%d", row.name, s.step)
				if _, done := e.verified[key]; !done {
					e.verified[key] = 0
					e.record(false, fmt.Sprintf("mtcfs backups %s shows backup %s (step %d) as %s although rank %d's .meta is missing: it infers the node count from the .meta files present",
						verb, row.name, s.step, row.status, missing), out)
				}
			case newest == nil:
				newest = &backupHeld{name: row.name, step: s.step, round: round}
			}
		}
	}
	if newest != nil {
		e.m.backup = newest
	}
	return nil
}

var (
	explainsRE   = regexp.MustCompile(`(?i)restor|dropped|could not be sealed|verif|hash|scratch|lost|missing|incomplete`)
	backupNameRE = regexp.MustCompile(`^\d{4}-\d{2}-\d{2}_\d{2}-\d{2}$`)
	stepsFieldRE = regexp.MustCompile(`^\d+(\((incomplete|damaged)\))?(,\d+(\((incomplete|damaged)\))?)*$`)
)

type backupRow struct {
	name, status string
	steps        []backupStep
}

type backupStep struct {
	step     int64
	complete bool
	damaged  bool // finished uploading, then lost or changed data: never made by a crash
}

// parseBackupRows reads the table of `mtcfs backups list|verify`: BACKUP STATUS STEPS
// NODES×WORKERS NOTE, newest first; steps are "20" or "10(incomplete)".
func parseBackupRows(out string) []backupRow {
	var rows []backupRow
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) < 3 || !backupNameRE.MatchString(f[0]) {
			continue
		}
		row := backupRow{name: f[0], status: f[1]}
		if (f[1] != "complete" && f[1] != "INCOMPLETE" && f[1] != "DAMAGED") || !stepsFieldRE.MatchString(f[2]) {
			rows = append(rows, row) // no step (or an error): nothing to check
			continue
		}
		for _, s := range strings.Split(f[2], ",") {
			st := backupStep{complete: !strings.HasSuffix(s, ")"), damaged: strings.HasSuffix(s, "(damaged)")}
			if _, err := fmt.Sscanf(s, "%d", &st.step); err == nil {
				row.steps = append(row.steps, st)
			}
		}
		rows = append(rows, row)
	}
	return rows
}

// checkBackupStep verifies one step of a backup for every rank through the client's own
// restore check (a symlink named after the step, pointing at the backup's <hash>.data, read by
// VerifyRestored). It returns the round the data is, or the first rank whose .meta is missing,
// or an error when the bytes match no save or ranks hold different saves.
func (e *episode) checkBackupStep(ctx context.Context, name string, step int64) (round, missing int, err error) {
	dir := filepath.Join(e.backupRoot, e.job, name)
	round = -1
	for r := range e.spec.Nodes {
		key := fmt.Sprintf("%s/%d/%d", name, step, r)
		id, ok := e.verified[key]
		if !ok {
			hash, rerr := os.ReadFile(filepath.Join(dir, fmt.Sprintf("%s-s%d-n%d-w0.meta", e.job, step, r)))
			if os.IsNotExist(rerr) {
				return -1, r, nil
			}
			if rerr != nil {
				return -1, -1, rerr
			}
			id, err = e.verifyTreeAt(ctx, filepath.Join(dir, strings.TrimSpace(string(hash))+".data"), r, step)
			if err != nil {
				return -1, -1, fmt.Errorf("rank %d: %w", r, err)
			}
			e.verified[key] = id
		}
		if round >= 0 && !e.m.shapeOf(id).sameBytes(e.m.shapeOf(round)) {
			return -1, -1, fmt.Errorf("the backup holds round %d for rank 0 and round %d for rank %d\n%s", round, id, r, e.roundsHistory(step))
		}
		round = id
	}
	return round, -1, nil
}

// verifyTreeAt checks that the tree at data is rank r's save of step, and which one.
func (e *episode) verifyTreeAt(ctx context.Context, data string, r int, step int64) (int, error) {
	scratch, err := os.MkdirTemp(e.base, "verify-")
	if err != nil {
		return -1, err
	}
	defer os.RemoveAll(scratch)
	if err := os.Symlink(data, filepath.Join(scratch, fmt.Sprint(step))); err != nil {
		return -1, err
	}
	o := &jobsim.Orbax{Dir: scratch, Job: e.job, Rank: r, Nodes: e.spec.Nodes}
	return e.identify(ctx, o, r, step)
}

// backupTemps lists the temporary files of the backup location's job directory written by pid
// (file:// names them .mtcfs-tmp-<host>-<pid>-<start>-<random>); pid 0 lists them all. Only the
// newest two backups and the registry are looked at: uploads go to the newest.
func backupTemps(root, job string, pid int) []string {
	jobDir := filepath.Join(root, job)
	ents, _ := os.ReadDir(jobDir)
	var backups []string
	for _, en := range ents {
		if en.IsDir() && backupNameRE.MatchString(en.Name()) {
			backups = append(backups, en.Name())
		}
	}
	var out []string
	dirs := []string{jobDir, filepath.Join(jobDir, "agents")}
	for i := max(0, len(backups)-2); i < len(backups); i++ {
		dirs = append(dirs, filepath.Join(jobDir, backups[i]))
	}
	for i, d := range dirs {
		if i < 2 {
			out = append(out, tempsIn(d, pid, false)...)
		} else {
			out = append(out, tempsIn(d, pid, true)...)
		}
	}
	return out
}

// allBackupTemps lists every temporary file under the job's backup directory.
func allBackupTemps(root, job string) []string {
	return tempsIn(filepath.Join(root, job), 0, true)
}

func tempsIn(dir string, pid int, recursive bool) []string {
	var out []string
	ents, _ := os.ReadDir(dir)
	for _, en := range ents {
		p := filepath.Join(dir, en.Name())
		if strings.HasPrefix(en.Name(), ".mtcfs-tmp-") {
			if pid == 0 || tempPid(en.Name()) == pid {
				out = append(out, p)
			}
			continue
		}
		if recursive && en.IsDir() {
			out = append(out, tempsIn(p, pid, true)...)
		}
	}
	return out
}

// tempPid is the writer pid in a temporary name .mtcfs-tmp-<host>-<pid>-<start>-<random>.
func tempPid(name string) int {
	f := strings.Split(strings.TrimPrefix(name, ".mtcfs-tmp-"), "-")
	if len(f) < 2 {
		return 0
	}
	var pid int
	fmt.Sscanf(f[1], "%d", &pid)
	return pid
}

// End of an episode.

// finish runs the checks that need the whole episode — every complete backup read back in
// full (backups verify), leftovers of cut-short uploads — then stops every agent cleanly,
// frees the spools they keep through `mtcfs spool`, and checks that nothing stays mounted.
func (e *episode) finish(ctx context.Context) error {
	if err := e.scanBackups(ctx, "verify"); err != nil {
		return err
	}
	for _, t := range allBackupTemps(e.backupRoot, e.job) {
		pid := tempPid(filepath.Base(t))
		for _, a := range e.agents {
			if a.pid != pid || a.alive() || a.killed.IsZero() {
				continue
			}
			// A backup that started (its uploads begin by removing the leftovers of writers that
			// are gone) clearly after the kill.
			for _, b := range e.agents {
				if b.loggedAfter(`msg="backup started"`, a.killed.Add(500*time.Millisecond)) {
					return e.violation(fmt.Sprintf("a temporary file of killed agent pid %d is still in the backup location after a later backup started", pid), t)
				}
			}
		}
	}
	for _, n := range e.nodes {
		if err := n.a.stop(); err != nil {
			return e.violation(fmt.Sprintf("rank %d: clean stop failed", n.rank), err.Error())
		}
		if t := mountType(n.dir); t != "" {
			return e.violation(fmt.Sprintf("rank %d: %s still mounted at the mount directory after a clean stop", n.rank, t), "")
		}
	}
	out, code, err := e.runMtcfs(ctx, "spool", "list", "--json")
	if err != nil || code != 0 {
		return e.violation("mtcfs spool list --json failed", fmt.Sprint(err, out))
	}
	var spools []struct {
		Dir       string `json:"spool"`
		MountPath string `json:"mount_path"`
		Job       string `json:"job"`
		InUse     bool   `json:"in_use"`
	}
	if err := json.Unmarshal([]byte(out), &spools); err != nil {
		return e.violation("mtcfs spool list --json: not JSON", out)
	}
	for _, n := range e.nodes {
		if mountType(n.spool) == "" {
			continue // not kept: it held no checkpoint
		}
		listed := false
		for _, s := range spools {
			if s.Dir == n.spool {
				listed = true
				if s.MountPath != n.dir || s.Job != e.job || s.InUse {
					return e.violation(fmt.Sprintf("rank %d: kept spool listed as mount %q job %q in use %v, want %q %q false", n.rank, s.MountPath, s.Job, s.InUse, n.dir, e.job), out)
				}
			}
		}
		if !listed {
			return e.violation(fmt.Sprintf("rank %d: kept spool %s is not in mtcfs spool list", n.rank, n.spool), out)
		}
		fout, code, err := e.runMtcfs(ctx, "spool", "free", n.dir)
		if err != nil || code != 0 {
			return e.violation(fmt.Sprintf("rank %d: mtcfs spool free %s failed", n.rank, n.dir), fmt.Sprint(err, fout))
		}
		if t := mountType(n.spool); t != "" {
			return e.violation(fmt.Sprintf("rank %d: spool still mounted (%s) after mtcfs spool free", n.rank, t), fout)
		}
	}
	if left := mountsUnder(e.base); len(left) > 0 {
		return e.violation("mounts left behind at the end of the episode", strings.Join(left, "\n"))
	}
	return nil
}

// cleanup kills every agent the episode started that still runs, detaches whatever is mounted
// under the episode's directory and removes it. It runs after every episode, also after a
// failure.
func (e *episode) cleanup() error {
	for _, a := range e.agents {
		a.kill()
	}
	for _, n := range e.nodes {
		forceUnmount(n.dir)
		forceUnmount(n.spool)
	}
	for _, m := range mountsUnder(e.base) {
		forceUnmount(strings.TrimSuffix(m[:strings.LastIndex(m, " (")], "/"))
	}
	if left := mountsUnder(e.base); len(left) > 0 {
		return fmt.Errorf("cannot detach %s", strings.Join(left, ", "))
	}
	return os.RemoveAll(e.base)
}
