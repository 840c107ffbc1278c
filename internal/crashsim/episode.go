package crashsim

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mtcfs/mtcfs/internal/jobsim"
)

// backupMinutes is the jobs' backup-interval-minutes: a backup is due 1.2 s after the clock
// starts (the coordinator's first sync), so that backups run as often as the agents allow —
// once a UTC minute per job.
const backupMinutes = 0.02

// damageRE matches replicator.errors lines that say committed data was found damaged.
var damageRE = regexp.MustCompile(`could not be sealed|dropped when the agent restarted|does not verify|failed its hash`)

// errEpisodeOver ends an episode after a violation: the model no longer describes the agents.
var errEpisodeOver = errors.New("episode ended by a violation")

type node struct {
	rank       int
	dir, spool string
	a          *agent
}

// episode is one job on its own nodes.
type episode struct {
	cfg  Config
	rep  *Report
	idx  int
	spec Episode
	op   int // index of the op running, for findings

	job        string
	base       string
	backupRoot string
	nodes      []*node
	m          *model
	clients    []*jobsim.Orbax
	errsSeen   []int // by rank: lines of the current client's Errors() already noted
	errLines   []string
	nextStep   int64
	agents     []*agent       // every agent started, for cleanup
	verified   map[string]int // backup/step/rank → round, for checks already done
	keepLogs   bool           // a finding was recorded: LogDir gets the agents' logs
	completed  bool           // the script ran to its end
	maxStep    int64          // the highest step started
}

func newEpisode(cfg Config, rep *Report, idx int, spec Episode) *episode {
	e := &episode{cfg: cfg, rep: rep, idx: idx, spec: spec, m: newModel(spec.Nodes), verified: map[string]int{}, nextStep: 10}
	e.job = fmt.Sprintf("crash%d-e%d", cfg.Seed%100000, idx)
	return e
}

func (e *episode) logf(format string, args ...any) {
	e.cfg.Logf("[e%d op%d] "+format, append([]any{e.idx, e.op}, args...)...)
}

// violation records a broken guarantee and ends the episode.
func (e *episode) violation(what, detail string) error {
	e.record(true, what, detail)
	return errEpisodeOver
}

func (e *episode) record(violation bool, what, detail string) {
	f := Finding{Violation: violation, Episode: e.idx, Op: e.op, What: what, Detail: detail + e.context()}
	e.rep.Findings = append(e.rep.Findings, f)
	e.logf("%s\n%s", f, f.Detail)
	e.keepLogs = true
}

// saveLogs writes every agent's full log to cfg.LogDir.
func (e *episode) saveLogs() {
	if e.cfg.LogDir == "" || !e.keepLogs {
		return
	}
	os.MkdirAll(e.cfg.LogDir, 0o755)
	for _, a := range e.agents {
		p := filepath.Join(e.cfg.LogDir, fmt.Sprintf("seed%d-e%d-rank%d-pid%d.log", e.cfg.Seed, e.idx, a.rank, a.pid))
		os.WriteFile(p, []byte(a.log()), 0o644)
	}
}

// context describes the episode for a finding: its script so far and the agents' recent logs.
func (e *episode) context() string {
	var b strings.Builder
	fmt.Fprintf(&b, "\n  seed %d, episode %d (%d nodes, job %s), ops so far:\n", e.cfg.Seed, e.idx, e.spec.Nodes, e.job)
	for i := 0; i <= e.op && i < len(e.spec.Ops); i++ {
		fmt.Fprintf(&b, "    %2d %s\n", i, e.spec.Ops[i])
	}
	if len(e.errLines) > 0 {
		b.WriteString("  replicator.errors read by the job:\n")
		for _, l := range e.errLines[max(0, len(e.errLines)-12):] {
			b.WriteString("    " + l + "\n")
		}
	}
	for _, n := range e.nodes {
		if n.a != nil {
			fmt.Fprintf(&b, "  rank %d agent (pid %d) log tail:\n%s", n.rank, n.a.pid, n.a.tail(25))
		}
	}
	return b.String()
}

func (e *episode) run(ctx context.Context) (err error) {
	e.base = filepath.Join(e.cfg.WorkDir, fmt.Sprintf("e%d", e.idx))
	e.backupRoot = filepath.Join(e.base, "backup")
	defer func() {
		e.saveLogs()
		if cerr := e.cleanup(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	if err := os.MkdirAll(e.backupRoot, 0o755); err != nil {
		return err
	}
	for r := range e.spec.Nodes {
		n := &node{rank: r, dir: filepath.Join(e.base, fmt.Sprintf("n%d", r), "mnt"), spool: filepath.Join(e.base, fmt.Sprintf("n%d", r), "spool")}
		if err := os.MkdirAll(n.dir, 0o755); err != nil {
			return err
		}
		e.nodes = append(e.nodes, n)
	}
	e.logf("episode %d: %d node(s), job %s in %s", e.idx, e.spec.Nodes, e.job, e.base)
	err = e.script(ctx)
	if errors.Is(err, errEpisodeOver) {
		return nil // recorded; the next episode starts afresh
	}
	return err
}

func (e *episode) script(ctx context.Context) error {
	for _, n := range e.nodes {
		if err := e.startAgent(ctx, n); err != nil {
			return err
		}
	}
	e.op = 0
	if err := e.restartJob(ctx, "fresh start"); err != nil {
		return err
	}
	for i, op := range e.spec.Ops {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		e.op = i
		e.logf("%s", op)
		var err error
		switch op.Type {
		case OpSave:
			err = e.plainSave(ctx, op.Shape)
		case OpRestart:
			e.rep.Restarts++
			err = e.restartJob(ctx, "job restart")
		case OpKill:
			err = e.killOp(ctx, op)
		case OpBackup:
			err = e.waitBackup(ctx)
		}
		if err != nil {
			return err
		}
	}
	e.completed = true
	return e.finish(ctx)
}

func (e *episode) agentArgs() []string {
	return []string{"--backup", "file://" + e.backupRoot, "--memory", e.cfg.Scale.Memory,
		"--http", "127.0.0.1:0", "--listen", "127.0.0.1:0"}
}

// startAgent starts the node's agent and checks that it did not stack a mount on a stale one.
func (e *episode) startAgent(ctx context.Context, n *node) error {
	a, err := startAgent(ctx, e.cfg.Bin, n.rank, n.dir, n.spool, e.agentArgs())
	if a != nil {
		e.agents = append(e.agents, a)
	}
	if err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		n.a = nil
		return e.violation(fmt.Sprintf("rank %d: the agent did not start on its mount and spool", n.rank), err.Error())
	}
	n.a = a
	if c := mountsAt(n.dir); c != 1 {
		return e.violation(fmt.Sprintf("rank %d: %d mounts stacked at the mount directory after a start", n.rank, c), strings.Join(mountsUnder(filepath.Dir(n.dir)), "\n"))
	}
	if c := mountsAt(n.spool); c != 1 {
		return e.violation(fmt.Sprintf("rank %d: %d mounts at the spool after a start", n.rank, c), strings.Join(mountsUnder(filepath.Dir(n.dir)), "\n"))
	}
	return nil
}

func (e *episode) newClient(r int) *jobsim.Orbax {
	o := &jobsim.Orbax{
		Dir: e.nodes[r].dir, Job: e.job, Rank: r, Nodes: e.spec.Nodes, PeerRanks: peerRanks(r, e.spec.Nodes),
		BackupIntervalMinutes: backupMinutes, Poll: 20 * time.Millisecond, Timeout: e.cfg.Scale.ClientTimeout,
	}
	if e.cfg.Verbose {
		o.Logf = func(format string, args ...any) { e.cfg.Logf("[e%d] "+format, append([]any{e.idx}, args...)...) }
	}
	return o
}

// noteErrors keeps the replicator.errors lines rank r's client read since the last call.
func (e *episode) noteErrors(r int) []string {
	if e.clients == nil || e.clients[r] == nil {
		return nil
	}
	all := e.clients[r].Errors()
	fresh := all[min(e.errsSeen[r], len(all)):]
	e.errsSeen[r] = len(all)
	for _, l := range fresh {
		e.errLines = append(e.errLines, fmt.Sprintf("rank %d: %s", r, l))
		e.rep.ErrorLines[errorKind(l)]++
		if damageRE.MatchString(l) {
			// The agent says it found committed data damaged: whether a step was lost is for the
			// invariant check to tell; the message itself is worth a look.
			e.record(false, fmt.Sprintf("rank %d's agent told the job: %s", r, l), "")
		}
	}
	return fresh
}

// Saves.

// shapeFor picks the content of a new save of step: exactly the bytes of its latest save when
// the step number was saved before and the op repeats (deterministic training), otherwise
// content that differs from every earlier save of it, so that a restore tells which save it got.
func (e *episode) shapeFor(step int64, s Shape) Shape {
	rs := e.m.byStep[step]
	if s.Repeat && len(rs) > 0 {
		last := rs[len(rs)-1].shape
		last.Repeat = true
		return last
	}
	s.Repeat = false
	for {
		dup := false
		for _, rd := range rs {
			if rd.shape.sameBytes(s) {
				dup = true
			}
		}
		if !dup {
			return s
		}
		s.FileSize++
	}
}

// saveRound saves the next step on every rank at once, as the job's processes do. onReturn,
// if set, runs in rank's goroutine the moment its save (its commit rename) returned.
func (e *episode) saveRound(ctx context.Context, shape Shape, onReturn func(rank int, err error)) (*round, []error) {
	step := e.nextStep
	e.maxStep = max(e.maxStep, step)
	rd := e.m.newRound(step, e.shapeFor(step, shape))
	e.rep.Saves++
	errs := make([]error, e.spec.Nodes)
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	var wg sync.WaitGroup
	for r := range e.spec.Nodes {
		rd.tried[r] = true
		o := e.clients[r]
		o.Content = jobsim.Content{Files: rd.shape.Files, FileSize: rd.shape.FileSize}
		wg.Go(func() {
			err := o.Save(ctx, step)
			if err == nil {
				rd.ok[r], rd.at[r] = true, time.Now()
			}
			errs[r] = err
			if onReturn != nil {
				onReturn(r, err)
			}
		})
	}
	wg.Wait()
	for r := range e.spec.Nodes {
		e.noteErrors(r)
	}
	e.nextStep = step + 10
	return rd, errs
}

// plainSave is a save round no kill interrupts: every save must return 0. The step claimed
// replicated is read afterwards.
func (e *episode) plainSave(ctx context.Context, shape Shape) error {
	rd, errs := e.saveRound(ctx, shape, nil)
	for r, err := range errs {
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return e.violation(fmt.Sprintf("rank %d: save of step %d failed with every agent up", r, rd.step), err.Error())
		}
	}
	return e.readClaim(rd.step, 2*time.Second)
}

// readClaim polls every agent's /status for up to wait until one reports step replicated, and
// records the newest step any reports as the claim, after checking that every rank's data of it
// is in its peer's namespace. One-node jobs have no peers and no claim to keep.
func (e *episode) readClaim(step int64, wait time.Duration) error {
	if e.spec.Nodes < 2 {
		return nil
	}
	deadline := time.Now().Add(wait)
	for {
		best := int64(-1)
		for _, n := range e.nodes {
			if st, err := n.a.status(); err == nil {
				best = max(best, st.Replicated)
			}
		}
		if best >= step || time.Now().After(deadline) {
			if best >= 0 && (e.m.claim == nil || best >= e.m.claim.step) {
				return e.setClaim(best)
			}
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// setClaim records that step is claimed replicated, after checking the claim: every rank's
// .meta of the step and the data it names are in the namespace of the rank's peers. A check
// that fails while the agents still claim the step is a violation (a newer claim may have
// freed the step meanwhile, which is fine).
func (e *episode) setClaim(step int64) error {
	c := &claim{step: step, rounds: make([]int, e.spec.Nodes), at: time.Now()}
	for r := range e.spec.Nodes {
		c.rounds[r] = e.m.latestRound(r, step)
	}
	for r := range e.spec.Nodes {
		for _, p := range e.m.holdersOf(r) {
			if replicaHeld(e.nodes[p].dir, e.job, step, r) {
				continue
			}
			still := false
			for _, n := range e.nodes {
				if st, err := n.a.status(); err == nil && st.Replicated == step {
					still = true
				}
			}
			if still {
				return e.violation(fmt.Sprintf("step %d is reported replicated, but rank %d's data of it is not on its peer rank %d", step, r, p), "")
			}
			return nil
		}
	}
	if e.m.claim == nil || e.m.claim.step != step {
		e.logf("claim: step %d replicated", step)
	}
	e.m.claim = c
	return nil
}

// waitBackup waits until the newest step saved on every rank is in a complete backup, each
// rank's data of it checked byte by byte. Not within the scale's BackupWait is a finding: SPEC
// §10 wants it at most backup-interval (here 1.2 s, but one backup a UTC minute) after the
// commit.
func (e *episode) waitBackup(ctx context.Context) error {
	want := int64(-1)
	for _, rd := range e.m.rounds {
		all := true
		for r := range e.spec.Nodes {
			all = all && rd.ok[r]
		}
		if all {
			want = max(want, rd.step)
		}
	}
	if want < 0 {
		return nil
	}
	deadline := time.Now().Add(e.cfg.Scale.BackupWait)
	for {
		if err := e.scanBackups(ctx, "list"); err != nil {
			return err
		}
		if b := e.m.backup; b != nil && b.step >= want {
			e.logf("backup %s holds step %d", b.name, b.step)
			return nil
		}
		if time.Now().After(deadline) {
			e.record(false, fmt.Sprintf("step %d, saved on every rank, is not in a complete backup %v later", want, e.cfg.Scale.BackupWait), "")
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(300 * time.Millisecond):
		}
	}
}

// replicaHeld reports whether the namespace at dir holds rank's .meta of step and its data.
func replicaHeld(dir, job string, step int64, rank int) bool {
	hash, err := os.ReadFile(filepath.Join(dir, fmt.Sprintf("%s-s%d-n%d-w0.meta", job, step, rank)))
	if err != nil {
		return false
	}
	_, err = os.Lstat(filepath.Join(dir, strings.TrimSpace(string(hash))+".data"))
	return err == nil
}

// Kills.

// killRec is one kill as it happened.
type killRec struct {
	kind     Kind
	victims  []int
	hit      bool
	evidence []string
}

func (e *episode) kill(r int) {
	if a := e.nodes[r].a; a != nil {
		a.kill()
	}
}

// evidence reads what a killed agent's spool shows it was doing when it died: a commit it
// recorded but did not seal, a transfer it was receiving; and whether the backup location
// holds temporary files it was writing.
func (e *episode) evidence(r int) []string {
	var out []string
	n := e.nodes[r]
	if ents, _ := os.ReadDir(filepath.Join(n.spool, "commits")); len(ents) > 0 {
		for _, en := range ents {
			if _, err := os.Stat(filepath.Join(n.spool, "commits", en.Name(), "commit.json")); err == nil {
				out = append(out, "unsealed commit record")
				break
			}
		}
	}
	if incomingCount(n.spool) > 0 {
		out = append(out, "transfer being received")
	}
	if n.a != nil && len(backupTemps(e.backupRoot, e.job, n.a.pid)) > 0 {
		out = append(out, "backup upload in flight")
	}
	return out
}

// incomingCount counts the peer transfers being received into spool.
func incomingCount(spool string) int {
	ents, _ := os.ReadDir(filepath.Join(spool, "peer-incoming"))
	c := 0
	for _, en := range ents {
		if strings.HasPrefix(en.Name(), "incoming-") {
			c++
		}
	}
	return c
}

func (e *episode) killOp(ctx context.Context, op Op) error {
	k := op.Kill
	rec := &killRec{kind: k.Kind}
	var err error
	switch k.Kind {
	case MidWrite:
		err = e.killMidWrite(ctx, op, rec)
	case AfterCommit, MidSeal:
		err = e.killAfterCommit(ctx, op, rec)
	case MidPush:
		err = e.killMidPush(ctx, op, rec)
	case MidBackup:
		err = e.killMidBackup(ctx, op, rec)
	case MidRestore:
		err = e.killMidRestore(ctx, op, rec)
	case RandomDelay, AllAgents:
		err = e.killAtDelay(ctx, op, rec)
	}
	if err != nil {
		return err
	}
	e.rep.Kills[k.Kind] += len(rec.victims)
	if rec.hit {
		e.rep.Hits[k.Kind] += len(rec.victims)
	}
	for _, ev := range rec.evidence {
		e.rep.Evidence[ev]++
	}
	e.logf("killed rank(s) %v (%s): hit %v, evidence %v", rec.victims, k.Kind, rec.hit, rec.evidence)
	return e.recover(ctx, rec.victims, k)
}

// afterKill collects evidence of the victims (their spools are frozen now).
func (e *episode) afterKill(rec *killRec, victims ...int) {
	for _, r := range victims {
		rec.victims = append(rec.victims, r)
		rec.evidence = append(rec.evidence, e.evidence(r)...)
	}
}

// checkKilledSaves: saves of ranks that were not killed must have returned 0.
func (e *episode) checkKilledSaves(ctx context.Context, rd *round, errs []error, victims []int) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	for r, err := range errs {
		if err == nil || containsInt(victims, r) {
			continue
		}
		return e.violation(fmt.Sprintf("rank %d: save of step %d failed although its agent was not killed", r, rd.step), err.Error())
	}
	return nil
}

func containsInt(xs []int, x int) bool {
	for _, y := range xs {
		if y == x {
			return true
		}
	}
	return false
}

// killMidWrite kills the victim once its job has started writing the k-th data file of the
// step (k drawn from the delay), i.e. before the commit rename.
func (e *episode) killMidWrite(ctx context.Context, op Op, rec *killRec) error {
	v := op.Kill.Victim
	frac := float64(op.Kill.Delay) / float64(e.cfg.Scale.MaxDelay+1)
	want := int(frac * float64(op.Shape.Files))
	var returned atomic.Bool
	done := make(chan struct{})
	killed := make(chan struct{})
	step := e.nextStep
	go func() {
		defer close(killed)
		d := filepath.Join(e.nodes[v].dir, fmt.Sprintf("%d.orbax-checkpoint-tmp", step), "state.orbax-checkpoint-tmp", fmt.Sprintf("ocdbt.process_%d", v), "d")
		deadline := time.Now().Add(time.Minute)
		for time.Now().Before(deadline) {
			select {
			case <-done:
				return
			default:
			}
			if ents, err := os.ReadDir(d); err == nil && len(ents) > want {
				break
			}
			time.Sleep(time.Millisecond)
		}
		rec.hit = !returned.Load()
		e.kill(v)
	}()
	rd, errs := e.saveRound(ctx, op.Shape, func(r int, err error) {
		if r == v {
			returned.Store(true)
		}
	})
	close(done)
	<-killed
	if e.nodes[v].a.alive() {
		e.kill(v) // the save finished before the trigger: kill now
		rec.hit = false
	}
	rec.hit = rec.hit && errs[v] != nil
	e.afterKill(rec, v)
	return e.checkKilledSaves(ctx, rd, errs, []int{v})
}

// killAfterCommit kills the victim the moment its commit rename returned (AfterCommit), or once
// its spool shows the commit recorded and not yet sealed, after a short delay (MidSeal).
func (e *episode) killAfterCommit(ctx context.Context, op Op, rec *killRec) error {
	v := op.Kill.Victim
	rd, errs := e.saveRound(ctx, op.Shape, func(r int, err error) {
		if r != v {
			return
		}
		if op.Kill.Kind == MidSeal && err == nil {
			d := op.Kill.Delay / 10
			deadline := time.Now().Add(d)
			for time.Now().Before(deadline) && e.pendingCommit(v) {
				time.Sleep(time.Millisecond)
			}
		}
		e.kill(v)
	})
	e.afterKill(rec, v)
	switch op.Kill.Kind {
	case AfterCommit:
		rec.hit = errs[v] == nil
	case MidSeal:
		rec.hit = errs[v] == nil && containsString(rec.evidence, "unsealed commit record")
	}
	return e.checkKilledSaves(ctx, rd, errs, []int{v})
}

func containsString(xs []string, x string) bool {
	for _, y := range xs {
		if y == x {
			return true
		}
	}
	return false
}

// pendingCommit reports whether rank r's spool holds a commit record.
func (e *episode) pendingCommit(r int) bool {
	ents, _ := os.ReadDir(filepath.Join(e.nodes[r].spool, "commits"))
	return len(ents) > 0
}

// killMidPush kills the receiver (or the sender) of a peer transfer while the receiver's spool
// shows it in flight. The transfers are those of the step being saved: files pushed as the job
// closes them, then the sealed step.
func (e *episode) killMidPush(ctx context.Context, op Op, rec *killRec) error {
	n := e.spec.Nodes
	recv := op.Kill.Victim
	if op.Kill.Sender {
		recv = (op.Kill.Victim + 1) % n
	}
	v := op.Kill.Victim
	stop := make(chan struct{})
	killed := make(chan struct{})
	var seen atomic.Bool
	go func() {
		defer close(killed)
		deadline := time.Now().Add(time.Minute)
		for time.Now().Before(deadline) {
			select {
			case <-stop:
				return
			default:
			}
			if incomingCount(e.nodes[recv].spool) > 0 {
				seen.Store(true)
				time.Sleep(op.Kill.Delay / 20)
				e.kill(v)
				return
			}
			time.Sleep(500 * time.Microsecond)
		}
	}()
	rd, errs := e.saveRound(ctx, op.Shape, nil)
	// The sealed step's push starts after the commit: give it a few seconds.
	select {
	case <-killed:
	case <-time.After(5 * time.Second):
		close(stop)
		<-killed
	}
	if e.nodes[v].a.alive() {
		e.kill(v)
	}
	e.afterKill(rec, v)
	rec.hit = seen.Load()
	if v != recv && rec.hit {
		rec.evidence = append(rec.evidence, "transfer being sent")
	}
	return e.checkKilledSaves(ctx, rd, errs, []int{v})
}

// killMidBackup saves a large step, then waits until a node uploads its part of a backup (its
// temporary files appear in the backup location, or its /status shows the backup) and kills
// that node — the planned victim if it is one of the uploaders.
func (e *episode) killMidBackup(ctx context.Context, op Op, rec *killRec) error {
	rd, errs := e.saveRound(ctx, op.Shape, nil)
	if err := e.checkKilledSaves(ctx, rd, errs, nil); err != nil {
		return err
	}
	deadline := time.Now().Add(e.cfg.Scale.BackupWait)
	var lastStatus time.Time
	victim := -1
	for time.Now().Before(deadline) && victim < 0 {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		var uploading []int
		began := time.Now()
		temps := backupTemps(e.backupRoot, e.job, 0)
		walk := time.Since(began)
		for _, n := range e.nodes {
			for _, t := range temps {
				if tempPid(filepath.Base(t)) == n.a.pid {
					uploading = append(uploading, n.rank)
					break
				}
			}
		}
		if len(uploading) == 0 && time.Since(lastStatus) > 40*time.Millisecond {
			lastStatus = time.Now()
			for _, n := range e.nodes {
				if st, err := n.a.status(); err == nil && st.Backup != nil {
					uploading = append(uploading, n.rank)
				}
			}
		}
		if len(uploading) > 0 {
			victim = uploading[0]
			if containsInt(uploading, op.Kill.Victim) {
				victim = op.Kill.Victim
			}
			time.Sleep(op.Kill.Delay / 40)
			break
		}
		// Poll often, but leave the CPUs to the agents when the backup location is large.
		time.Sleep(max(2*time.Millisecond, 4*walk))
	}
	rec.hit = victim >= 0
	if victim < 0 {
		victim = op.Kill.Victim
	}
	e.kill(victim)
	e.afterKill(rec, victim)
	return nil
}

// killMidRestore restarts the job on every rank and kills the victim while they negotiate and
// restore; the interrupted start is abandoned and recovery restarts the job again.
func (e *episode) killMidRestore(ctx context.Context, op Op, rec *killRec) error {
	v := op.Kill.Victim
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	var pending atomic.Int32
	pending.Store(int32(e.spec.Nodes))
	clients := make([]*jobsim.Orbax, e.spec.Nodes)
	for r := range e.spec.Nodes {
		clients[r] = e.newClient(r)
		wg.Go(func() {
			defer pending.Add(-1)
			clients[r].Start(sctx)
		})
	}
	deadline := time.Now().Add(op.Kill.Delay / 2)
	phase := ""
	for time.Now().Before(deadline) && pending.Load() > 0 {
		if st, err := e.nodes[v].a.status(); err == nil {
			phase = st.Phase
			if st.Restore != nil {
				phase = "restoring " + st.Restore.Source
			}
			if strings.HasPrefix(phase, "restoring") {
				break
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
	rec.hit = pending.Load() > 0
	e.kill(v)
	cancel()
	wg.Wait()
	e.afterKill(rec, v)
	if rec.hit {
		rec.evidence = append(rec.evidence, "job start in progress")
	}
	if strings.HasPrefix(phase, "restoring") {
		rec.evidence = append(rec.evidence, "restore running")
	}
	return nil
}

// killAtDelay kills the victim (AllAgents: every agent) at a random delay after a save round
// started.
func (e *episode) killAtDelay(ctx context.Context, op Op, rec *killRec) error {
	var victims []int
	if op.Kill.Kind == AllAgents {
		for r := range e.spec.Nodes {
			victims = append(victims, r)
		}
	} else {
		victims = []int{op.Kill.Victim}
	}
	timer := make(chan struct{})
	go func() {
		defer close(timer)
		time.Sleep(3 * op.Kill.Delay)
		for _, r := range victims {
			e.kill(r)
		}
	}()
	rd, errs := e.saveRound(ctx, op.Shape, nil)
	<-timer
	rec.hit = true
	e.afterKill(rec, victims...)
	for _, r := range victims {
		if errs[r] != nil {
			rec.evidence = append(rec.evidence, "save in progress")
		}
	}
	return e.checkKilledSaves(ctx, rd, errs, victims)
}
