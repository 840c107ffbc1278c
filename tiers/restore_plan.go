package tiers

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/mtcfs/mtcfs/layout"
)

// Slot is one training process of the job: a node rank and a worker index.
type Slot struct{ Rank, Worker int }

func (s Slot) String() string { return fmt.Sprintf("n%d-w%d", s.Rank, s.Worker) }

// Inventory is what one node holds in RAM: its .meta entries and the data it has.
type Inventory struct {
	Rank int
	// Metas maps .meta names ("<job>-sS-nR-wW.meta") to their content, the data's hash
	// ("D<hex>" or "<hex>").
	Metas map[string]string
	// Data lists the hashes whose .data this node holds.
	Data []string
	// Shape is the shape of the job whose steps this node holds, as its spool recorded it when
	// the job last planned a restore (the zero Shape: unknown, a new spool). The steps of its
	// .meta entries are passed over by a job of a shape that cannot restore them.
	Shape Shape
	// Timeline is the restores of the job this node took part in, as its spool recorded them
	// (the zero Timeline: unknown, a new spool or an agent before timelines).
	Timeline Timeline
}

// RestorePlan is the job-wide restore decision of SPEC §5.
type RestorePlan struct {
	// Step to restore; 0 with Found false means "start from scratch".
	Step  int64
	Found bool
	// Backup is set when the step comes from a backup rather than from RAM in the cluster.
	Backup string
	// BackedUpIn names, for a step restored from RAM, the job's newest complete backup when it
	// holds that very step: the nodes show it as their last backup, as after a restore from it
	// ("": not known, or a coordinator of an earlier version).
	BackedUpIn string
	// LastBackup names, for a step restored from RAM that BackedUpIn does not name, the job's
	// newest complete backup when it holds an earlier step (LastBackupStep): the nodes show it
	// as their last backup (a black-box run: after an agent restart, status named no backup
	// while one of step 2 existed and step 3 was in RAM). "": none, or not known.
	LastBackup     string
	LastBackupStep int64
	// Data is the hash each slot restores.
	Data map[Slot]string
	// Holders lists, per hash, the ranks that hold it in RAM (for fetching from peers).
	Holders map[string][]int
	// Errors are lines every node writes to replicator.errors before its markers.
	Errors []string
	// Generation numbers this restore (CutStaleTimelines; 0: none, a coordinator before
	// timelines): every node records it with the step restored (Spool.SetShapeRestored).
	Generation int64
	// StaleAbove holds, for each node that missed restores of the job, the step above which
	// what it holds is of a timeline the job left: the node drops it.
	StaleAbove map[int]int64
	// Pinned is the restore.version content that was in force ("" when none).
	Pinned string
	// BackupsUnread: restore.version could not be read, and the step comes from RAM. Only the
	// coordinator uses it (it then does not list the backups either); it is not sent to nodes.
	BackupsUnread bool
}

// BackupStep is one complete step of a backup.
type BackupStep struct {
	Step int64
	Data map[Slot]string // the hash each slot's .meta names
}

// DamagedStep is a step of a backup whose upload finished (a slot's .meta is there) but whose
// data is no longer all there or no longer matches its manifest: objects deleted since, bit rot,
// a foreign write. It is never restored, and a restore that passes over it says so.
type DamagedStep struct {
	Step     int64
	Problems []string // sorted; at least one
}

// BackupStore is the backup tier as the replicator sees it. cmd wires an implementation from
// package gcsbackend (file:// or gs://).
type BackupStore interface {
	// Backups lists the job's backup names, newest first.
	Backups(ctx context.Context, job string) ([]string, error)
	// CompleteSteps lists the complete steps of one backup for a job of shape, highest first,
	// and its damaged ones, highest first; a missing backup returns an error wrapping
	// ErrNoBackup, a backup of a job of another shape (one shape cannot restore) a *ShapeError.
	CompleteSteps(ctx context.Context, job, backup string, shape Shape) (complete []BackupStep, damaged []DamagedStep, err error)
	// Upload stores one slot's data (data first, .meta last).
	Upload(ctx context.Context, req Upload) error
	// Download fetches a hash's data into dest (which must not exist), verified; data that
	// fails its check is an error wrapping ErrCorruptBackup.
	Download(ctx context.Context, job, backup, hash, dest string, progress func(done, total int64)) error
	// MarkDamaged records in the backup that hash's data failed its check (why: a line), so
	// that CompleteSteps reports the steps naming it damaged from then on.
	MarkDamaged(ctx context.Context, job, backup, hash, why string) error
	// RestoreVersion reads <job>/restore.version; ok is false when it does not exist.
	RestoreVersion(ctx context.Context, job string) (name string, ok bool, err error)
	ClearRestoreVersion(ctx context.Context, job string) error
	// CleanLeftovers removes what uploads of the job that were cut short (a crash, a stop) left
	// behind, never touching an upload still running elsewhere; it returns how many it removed.
	CleanLeftovers(ctx context.Context, job string) (int, error)
	// Resumable reports whether backup is an upload of step cut short that completing with
	// data (the step's hashes) leaves nothing else in, and if not, why (see
	// gcsbackend.Backups.Resumable).
	Resumable(ctx context.Context, job, backup string, step int64, data []string, shape Shape) (ok bool, why string, err error)
	// DeleteIncomplete removes backup when it holds no complete and no damaged step, an upload
	// that no agent writes to any more (gcsbackend.Backups.DeleteIncomplete with force), and
	// returns how many objects it removed; it refuses any other.
	DeleteIncomplete(ctx context.Context, job, backup string) (int, error)
	String() string
}

// Upload is one slot's contribution to a backup.
type Upload struct {
	Job, Backup string
	Step        int64
	Slot        Slot
	// Shape is the job's, recorded with the backup so that tools reading it know every rank it
	// must hold, and so that a job of another shape does not restore it.
	Shape Shape
	Hash  string // "D<hex>" or "<hex>"
	// Source is the sealed data in the spool; "" uploads only the .meta, naming Hash, which a
	// column-mate uploaded to the backup (data-parallel mode, SPEC §6).
	Source   string
	Progress func(done, total int64)
}

// ErrCorruptBackup means data downloaded from a backup does not match its manifest or hash.
var ErrCorruptBackup = errors.New("the backup's data is corrupt")

// ErrOtherIncarnation is the coordinator's answer to a call from an incarnation it does not
// coordinate (an older one, or one that has not negotiated): replication returns it (wrapped).
var ErrOtherIncarnation = errors.New("call from another incarnation of the job")

// ErrJobShape is the coordinator's answer to a call whose job shape differs from its current
// incarnation's: replication returns it (wrapped). To a sync or backup call of an incarnation
// that negotiated with it, it means the job restarted with another shape without this node.
var ErrJobShape = errors.New("job shape differs from the coordinator's incarnation")

// ErrIncarnationOver is the coordinator's answer to a call of an incarnation it closed (the job
// restarted): replication returns it (wrapped).
var ErrIncarnationOver = errors.New("job coordinator closed: the incarnation is over")

// ErrNoBackup means a named backup does not exist.
var ErrNoBackup = errors.New("no such backup")

// ErrDataNotInBackup means an Upload without a Source named data that is not in the backup.
var ErrDataNotInBackup = errors.New("the data is not in the backup")

// PlanLimits bound a restore plan's use of the backup location, so that an outage of the
// location (GCS unreachable, a network that drops packets, credentials gone) neither keeps a job
// from its checkpoint in RAM nor outlasts the job's wait for its markers (300 s, SPEC §5). Zero
// fields take the defaults.
type PlanLimits struct {
	// PinRead bounds the read of restore.version when the nodes' RAM holds a complete step:
	// past it, or on an error, the step in RAM is restored and a pin, if any, is not applied
	// (it stays for the next restore). Several attempts of a read fit in the default, 20 s.
	PinRead time.Duration
	// Store bounds the whole plan's use of the location otherwise: the plan then fails with a
	// line the job can read before it gives up waiting. Default 4 minutes.
	Store time.Duration
}

// WithDefaults returns l with its zero fields set to the defaults.
func (l PlanLimits) WithDefaults() PlanLimits {
	if l.PinRead <= 0 {
		l.PinRead = 20 * time.Second
	}
	if l.Store <= 0 {
		l.Store = 4 * time.Minute
	}
	return l
}

// PlanRestore decides what the job restores (SPEC §5) from every node's inventory and the
// backup store: the pinned backup when restore.version names one, else the highest step
// complete in the cluster's RAM, else the newest complete backup. When restore.version cannot
// be read (within limits.PinRead) and the RAM holds a complete step, that step is restored.
func PlanRestore(ctx context.Context, cfg *Config, invs []Inventory, store BackupStore, limits PlanLimits) (RestorePlan, error) {
	limits = limits.WithDefaults()
	plan := RestorePlan{Holders: map[string][]int{}}
	for _, inv := range invs {
		for _, h := range inv.Data {
			plan.Holders[h] = append(plan.Holders[h], inv.Rank)
		}
	}
	for _, hs := range plan.Holders {
		sort.Ints(hs)
	}
	others := OtherShapeSteps(cfg, invs)
	ramStep, ramData, inRAM, mixed := clusterStep(cfg, invs, plan.Holders, others)
	ctx, cancel := context.WithTimeoutCause(ctx, limits.Store, fmt.Errorf("the backup location %v did not answer within %v", store, limits.Store))
	defer cancel()
	var pinUnread string // why restore.version could not be read, when RAM is restored instead
	if store != nil {
		pctx, pcancel := ctx, context.CancelFunc(func() {})
		if inRAM {
			pctx, pcancel = context.WithTimeoutCause(ctx, limits.PinRead, fmt.Errorf("no answer within %v", limits.PinRead))
		}
		pin, ok, err := store.RestoreVersion(pctx, cfg.JobName)
		if cause := context.Cause(pctx); err != nil && cause != nil && ctx.Err() == nil && !errors.Is(err, cause) {
			err = fmt.Errorf("%w (%v)", cause, err)
		}
		pcancel()
		switch {
		case err != nil && inRAM && ctx.Err() == nil:
			plan.BackupsUnread = true
			pinUnread = fmt.Sprintf("restore.version in %v could not be read (%v): a backup pinned there is not applied this time", store, err)
			ok = false
		case err != nil && errors.Is(err, os.ErrPermission):
			// It read as if only the pin were the problem (black-box h57: a non-root agent, the
			// backups root's 0700).
			return plan, fmt.Errorf("the backup location %v cannot be read by this agent (its first read, restore.version: %w): nothing in it can be restored; give the agent's user access to it, or the agents a --backup it may read and write", store, CauseFirst(ctx, err))
		case err != nil:
			return plan, fmt.Errorf("read restore.version: %w", CauseFirst(ctx, err))
		}
		if ok && !layout.IsBackupName(pin) {
			// No backup has that name: as for a missing one (SPEC §5.1), not a failed restore.
			plan.Pinned = pin
			plan.Errors = append(plan.Errors, fmt.Sprintf("restore.version holds %q, which is not a backup name (YYYY-MM-DD_HH-MM, UTC): starting from scratch"+pinLost, pin))
			return plan, nil
		}
		if ok {
			plan.Pinned = pin
			steps, damaged, err := store.CompleteSteps(ctx, cfg.JobName, pin, cfg.Shape())
			var shaped *ShapeError
			switch {
			case errors.As(err, &shaped):
				plan.Errors = append(plan.Errors, shapeLine(shaped),
					fmt.Sprintf("restore.version names backup %q, of a job of another shape: starting from scratch (start the job with that shape, pin another backup with mtcfs restore-version set, or clear the pin)", pin))
			case errors.Is(err, ErrNoBackup):
				plan.Errors = append(plan.Errors, fmt.Sprintf("restore.version names backup %q, which does not exist in %s: starting from scratch"+pinLost, pin, store))
			case err != nil:
				return plan, fmt.Errorf("check pinned backup %s: %w", pin, CauseFirst(ctx, err))
			case len(steps) == 0 && len(damaged) > 0:
				plan.Errors = append(plan.Errors, damageLine(cfg, store, pin, damaged[0]),
					fmt.Sprintf("restore.version names backup %q, which has no intact step: starting from scratch (pin another backup with mtcfs restore-version set, or clear the pin)", pin))
			case len(steps) == 0:
				plan.Errors = append(plan.Errors, fmt.Sprintf("restore.version names backup %q, which is incomplete: starting from scratch"+pinLost, pin))
			default:
				plan.Step, plan.Found, plan.Backup, plan.Data = steps[0].Step, true, pin, steps[0].Data
				var passed passedOver
				for _, d := range damaged {
					if d.Step > plan.Step {
						passed.damaged(cfg, store, pin, d)
					}
				}
				plan.Errors = append(plan.Errors, passed.lines(fmt.Sprintf(" in the pinned backup; restoring its step %d", plan.Step))...)
			}
			return plan, nil
		}
	}
	// A checkpoint passed over (damaged, or of a job of another shape) above the one restored
	// is one the job loses: say so (SPEC §10: never a silent fresh start), each kind newest
	// first, and what is restored instead.
	// report gives the lines for what was passed over: the steps in RAM of another shape above
	// the one restored, the incomplete ones when none in RAM is restored (a save cut short
	// is routine when a step in RAM is restored; the job losing every step in RAM is not), then
	// what the backups showed, then outcome.
	report := func(fromRAM bool, backups passedOver, outcome string) []string {
		var p passedOver
		for _, s := range sortedSteps(others) {
			if plan.Found && s < plan.Step {
				break
			}
			p.shaped(fmt.Sprintf("step %d in the nodes' RAM %s; this job has %s: %s and freed (a backup of that shape, if one holds it, restores it to a job of that shape: mtcfs backups list shows the backups' shapes)", s, others[s], cfg.Shape(), shapeWhy))
		}
		// Also from RAM when a node's RAM is new while the others' took part in restores: the
		// steps above were likely committed everywhere and lost with that node's RAM, not cut
		// short by a crash (a black-box run: two committed steps went without a word).
		for _, s := range sortedSteps(mixed) {
			if plan.Found && s <= plan.Step {
				break
			}
			p.mixed(fmt.Sprintf("step %d in the nodes' RAM is not restored: %s", s, mixed[s]))
		}
		if fresh := newRAMRanks(invs); !fromRAM || len(fresh) > 0 {
			incomplete := incompleteSteps(cfg, invs, plan.Holders, others)
			for _, s := range sortedSteps(incomplete) {
				if plan.Found && s <= plan.Step {
					break // restored (from a backup or a peer), or below it: nothing lost
				}
				if _, told := mixed[s]; told {
					continue // one line a step
				}
				line := fmt.Sprintf("step %d in the nodes' RAM is incomplete and is not restored: %s", s, incomplete[s])
				if len(fresh) > 0 {
					line += fmt.Sprintf("; the RAM of rank %s is new (a replaced machine, or its spool lost)", listSome(fresh, 3))
				}
				p.incomplete(line)
			}
		}
		p.merge(backups)
		return p.lines(outcome)
	}
	var passed passedOver
	if inRAM {
		plan.Step, plan.Found, plan.Data = ramStep, true, ramData
		if pinUnread != "" {
			plan.Errors = append(plan.Errors, fmt.Sprintf("%s; restoring step %d from the nodes' RAM", pinUnread, ramStep))
		}
		plan.Errors = append(plan.Errors, report(true, passed, fmt.Sprintf("; restoring step %d from the nodes' RAM instead", ramStep))...)
		return plan, nil
	}
	if store == nil {
		plan.Errors = append(plan.Errors, report(false, passed, " and no intact checkpoint is left: starting from scratch")...)
		return plan, nil
	}
	names, err := store.Backups(ctx, cfg.JobName)
	if err != nil {
		return plan, fmt.Errorf("list backups: %w", CauseFirst(ctx, err))
	}
	for _, name := range names {
		steps, damaged, err := store.CompleteSteps(ctx, cfg.JobName, name, cfg.Shape())
		if shaped := (*ShapeError)(nil); errors.As(err, &shaped) {
			passed.shaped(shapeLine(shaped))
			continue
		}
		if err != nil && !errors.Is(err, ErrNoBackup) {
			return plan, fmt.Errorf("check backup %s: %w", name, CauseFirst(ctx, err))
		}
		for _, d := range damaged {
			if len(steps) > 0 && d.Step < steps[0].Step {
				break // damaged is highest first; what is below the restored step is not lost
			}
			passed.damaged(cfg, store, name, d)
		}
		if err == nil && len(steps) == 0 && len(damaged) == 0 {
			// Before, passed over without a word: the job lost the step it was of silently.
			passed.unfinished(fmt.Sprintf("backup %s holds no complete step (an upload cut short, or one still running): it is not restored", name))
		}
		if len(steps) > 0 {
			plan.Step, plan.Found, plan.Backup, plan.Data = steps[0].Step, true, name, steps[0].Data
			plan.Errors = append(plan.Errors, report(false, passed, fmt.Sprintf("; restoring step %d from backup %s instead", plan.Step, name))...)
			return plan, nil
		}
	}
	plan.Errors = append(plan.Errors, report(false, passed, " and no intact checkpoint is left: starting from scratch")...)
	return plan, nil
}

// CauseFirst is err of a call made under ctx (one to the backup location), saying first what
// ctx's deadline was about when that deadline is why it failed (context.WithTimeoutCause).
func CauseFirst(ctx context.Context, err error) error {
	if cause := context.Cause(ctx); cause != nil && ctx.Err() == context.DeadlineExceeded && !errors.Is(err, cause) {
		return fmt.Errorf("%w: %w", cause, err)
	}
	return err
}

// maxPassedLines bounds the replicator.errors lines a restore writes for the checkpoints it
// passes over (a bucket emptied by a lifecycle rule could hold hundreds of damaged steps).
const maxPassedLines = 5

// passedOver gathers the checkpoints a restore passes over, damaged backup steps and
// checkpoints of a job of another shape: a line for each of the first maxPassedLines, and how
// many of each there were.
type passedOver struct {
	first                                               []string
	nDamaged, nShaped, nIncomplete, nUnfinished, nMixed int
}

func (r *passedOver) add(line string) {
	if len(r.first) < maxPassedLines {
		r.first = append(r.first, line)
	}
}

func (r *passedOver) damaged(cfg *Config, store BackupStore, backup string, d DamagedStep) {
	r.nDamaged++
	r.add(damageLine(cfg, store, backup, d))
}

func (r *passedOver) shaped(line string) {
	r.nShaped++
	r.add(line)
}

func (r *passedOver) incomplete(line string) {
	r.nIncomplete++
	r.add(line)
}

// mixed counts a complete step in RAM passed over for holding two saves of a slot.
func (r *passedOver) mixed(line string) {
	r.nMixed++
	r.add(line)
}

func (r *passedOver) unfinished(line string) {
	r.nUnfinished++
	r.add(line)
}

// merge adds what o gathered after what r did.
func (r *passedOver) merge(o passedOver) {
	for _, l := range o.first {
		r.add(l)
	}
	r.nDamaged += o.nDamaged
	r.nShaped += o.nShaped
	r.nIncomplete += o.nIncomplete
	r.nUnfinished += o.nUnfinished
	r.nMixed += o.nMixed
}

// lines returns the replicator.errors lines (none when nothing was passed over): one per
// checkpoint kept, then the counts followed by outcome, what the restore does instead.
func (r *passedOver) lines(outcome string) []string {
	n := r.nDamaged + r.nShaped + r.nIncomplete + r.nUnfinished + r.nMixed
	if n == 0 {
		return nil
	}
	var parts []string
	if r.nMixed > 0 {
		parts = append(parts, fmt.Sprintf("%d step%s in RAM holding two saves of a slot", r.nMixed, plural(r.nMixed)))
	}
	if r.nIncomplete > 0 {
		parts = append(parts, fmt.Sprintf("%d incomplete step%s in RAM", r.nIncomplete, plural(r.nIncomplete)))
	}
	if r.nDamaged > 0 {
		parts = append(parts, fmt.Sprintf("%d damaged backup step%s", r.nDamaged, plural(r.nDamaged)))
	}
	if r.nUnfinished > 0 {
		parts = append(parts, fmt.Sprintf("%d incomplete backup%s", r.nUnfinished, plural(r.nUnfinished)))
	}
	if r.nShaped > 0 {
		parts = append(parts, fmt.Sprintf("%d checkpoint%s of a job of another shape", r.nShaped, plural(r.nShaped)))
	}
	summary := strings.Join(parts, " and ")
	if n > maxPassedLines {
		summary += fmt.Sprintf(" (the first %d above)", maxPassedLines)
	}
	return append(r.first, summary+outcome)
}

// shapeWhy says why a checkpoint of a job of another shape is not restored.
const shapeWhy = "one node's checkpoint data is never split or merged across nodes, so it is passed over"

// shapeLine is the replicator.errors line for a backup of a job of another shape.
func shapeLine(e *ShapeError) string {
	return e.Error() + ": " + shapeWhy + " (start the job with its former shape to restore it)"
}

// sortedSteps returns the keys of m, highest first.
func sortedSteps[V any](m map[int64]V) []int64 {
	out := make([]int64, 0, len(m))
	for s := range m {
		out = append(out, s)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] > out[j] })
	return out
}

// damageLine is the replicator.errors line for one damaged step of a backup: its first problem,
// and the command that lists them all.
func damageLine(cfg *Config, store BackupStore, backup string, d DamagedStep) string {
	first := "damaged"
	if len(d.Problems) > 0 {
		first = d.Problems[0]
	}
	more := ""
	if len(d.Problems) > 1 {
		more = fmt.Sprintf(" (and %d more problems)", len(d.Problems)-1)
	}
	return fmt.Sprintf("backup %s: step %d is damaged and is not restored: %s%s; see: mtcfs backups verify %s --backup %s --job %s",
		backup, d.Step, first, more, backup, store, cfg.JobName)
}

// newRAMRanks lists the ranks whose inventory is empty and knows no restore, while another took
// part in restores of the job: a node that replaced one, or lost its spool.
func newRAMRanks(invs []Inventory) (ranks []string) {
	known := false
	for _, inv := range invs {
		known = known || inv.Timeline.Generation > 0
	}
	for _, inv := range invs {
		if known && inv.Timeline.Generation == 0 && len(inv.Metas) == 0 && len(inv.Data) == 0 {
			ranks = append(ranks, strconv.Itoa(inv.Rank))
		}
	}
	return ranks
}

// incompleteSteps maps each step of the job in the nodes' RAM (of its shape) that is not
// complete to what it lacks: the slots no live node holds a .meta of (a save cut short, or a
// node whose RAM was lost before its replica was made) and those whose data no live node holds.
func incompleteSteps(cfg *Config, invs []Inventory, holders map[string][]int, others map[int64]string) map[int64]string {
	type slotState struct{ meta, data bool }
	steps := map[int64]map[Slot]*slotState{}
	for _, inv := range invs {
		for name, hash := range inv.Metas {
			m, inShape, ok := JobMeta(cfg, name)
			if !ok || !inShape {
				continue
			}
			if _, other := others[m.Step]; other {
				continue
			}
			if steps[m.Step] == nil {
				steps[m.Step] = map[Slot]*slotState{}
			}
			st := steps[m.Step][Slot{m.Node, m.Worker}]
			if st == nil {
				st = &slotState{}
				steps[m.Step][Slot{m.Node, m.Worker}] = st
			}
			st.meta = true
			st.data = st.data || len(holders[hash]) > 0
		}
	}
	out := map[int64]string{}
	for step, slots := range steps {
		var noMeta, noData []string
		for r := range cfg.Nodes {
			for w := range cfg.WorkersPerNode {
				slot := Slot{r, w}
				switch st := slots[slot]; {
				case st == nil:
					noMeta = append(noMeta, slotName(slot))
				case !st.data:
					noData = append(noData, slotName(slot))
				}
			}
		}
		var why []string
		if len(noMeta) > 0 {
			why = append(why, "no live node holds a .meta of "+listSome(noMeta, 3)+" (a save cut short, a node whose RAM was lost before its replica was made, or a restore of the step that failed on that node after the others brought in their part)")
		}
		if len(noData) > 0 {
			why = append(why, "no live node holds the data of "+listSome(noData, 3))
		}
		if len(why) > 0 {
			out[step] = strings.Join(why, "; ")
		}
	}
	return out
}

func slotName(s Slot) string { return fmt.Sprintf("rank %d worker %d", s.Rank, s.Worker) }

// clusterStep finds the highest step for which every slot has a .meta whose data some node
// holds. When nodes disagree on a slot's .meta (the step was saved again and a peer still holds
// the replica of the earlier save), the slot's own node wins: its .meta is of its newest commit
// of the step; among replicas, the lowest rank's, so that the plan does not depend on order.
// Steps in others (saved by a job of another shape) are never picked.
//
// Nodes that did not all take part in the same restores (their timelines differ, or some are
// unknown: an agent of an earlier release, one whose numbers were cleared) cannot tell which of
// two saves of a slot's step is the newer: the step is passed over (mixed, with why), never
// restored from two timelines (a black-box run: a node of the previous release, away while the
// job went back, came back and its own save of step 3 was restored beside the others' newer one).
func clusterStep(cfg *Config, invs []Inventory, holders map[string][]int, others map[int64]string) (int64, map[Slot]string, bool, map[int64]string) {
	bySlot := map[int64]map[Slot]string{}
	owned := map[int64]map[Slot]bool{}             // the slot's .meta came from its own node
	saves := map[int64]map[Slot]map[string][]int{} // the hashes of each slot's step, by the ranks holding the .meta
	// Nodes holding nothing of the job (a new machine) bring no save to tell apart: left out,
	// they no longer made a step saved again on one timeline pass over (a review).
	sameTimeline, gen := true, int64(-1)
	for _, inv := range invs {
		if !holdsJobSteps(cfg, inv) {
			continue
		}
		if gen < 0 {
			gen = inv.Timeline.Generation
		}
		sameTimeline = sameTimeline && inv.Timeline.Generation == gen
	}
	for _, inv := range invs {
		for name, hash := range inv.Metas {
			m, inShape, ok := JobMeta(cfg, name)
			if !ok || !inShape {
				continue
			}
			if _, other := others[m.Step]; other || len(holders[hash]) == 0 {
				continue
			}
			if bySlot[m.Step] == nil {
				bySlot[m.Step], owned[m.Step] = map[Slot]string{}, map[Slot]bool{}
			}
			slot := Slot{m.Node, m.Worker}
			if saves[m.Step] == nil {
				saves[m.Step] = map[Slot]map[string][]int{}
			}
			if saves[m.Step][slot] == nil {
				saves[m.Step][slot] = map[string][]int{}
			}
			saves[m.Step][slot][hash] = append(saves[m.Step][slot][hash], inv.Rank)
			if _, seen := bySlot[m.Step][slot]; seen && (owned[m.Step][slot] || inv.Rank != m.Node) {
				continue // the owner's is kept; otherwise the first (lowest rank) replica
			}
			bySlot[m.Step][slot] = hash
			owned[m.Step][slot] = inv.Rank == m.Node
		}
	}
	mixed := map[int64]string{}
	if !sameTimeline {
		for step, slots := range saves {
			var why []string
			for _, slot := range sortedSlots(slots) {
				if hs := slots[slot]; len(hs) > 1 {
					var who []string
					for _, h := range slices.Sorted(maps.Keys(hs)) {
						who = append(who, "rank "+JoinSteps(hs[h]))
					}
					why = append(why, fmt.Sprintf("%s (%s hold different saves of it)", slotName(slot), strings.Join(who, " and ")))
				}
			}
			if len(why) > 0 {
				mixed[step] = "it holds two saves of " + listSome(why, 2) + ", and the nodes did not all take part in the same restores (one away while the job went back, or of an earlier release): which is newer cannot be told"
			}
		}
	}
	for _, s := range sortedSteps(bySlot) {
		if _, ok := mixed[s]; ok {
			continue
		}
		if len(bySlot[s]) == cfg.Nodes*cfg.WorkersPerNode {
			return s, bySlot[s], true, mixed
		}
	}
	return 0, nil, false, mixed
}

// holdsJobSteps reports whether inv holds a .meta of a step of the job.
func holdsJobSteps(cfg *Config, inv Inventory) bool {
	for name := range inv.Metas {
		if _, _, ok := JobMeta(cfg, name); ok {
			return true
		}
	}
	return false
}

// sortedSlots returns the keys of m in rank, then worker order.
func sortedSlots[V any](m map[Slot]V) []Slot {
	out := slices.Collect(maps.Keys(m))
	slices.SortFunc(out, func(a, b Slot) int {
		if a.Rank != b.Rank {
			return a.Rank - b.Rank
		}
		return a.Worker - b.Worker
	})
	return out
}

// pinLost ends the line of a pin that sends the job to scratch: what that costs, and what to do
// (the line said only "starting from scratch", found by a review; and again, a local variable of
// PlanRestore shadowed it, found by a black-box run).
const pinLost = " (the job's steps in the nodes' RAM are dropped with the timeline it leaves; its backups stay: " +
	"mtcfs backups list shows them; pin one with mtcfs restore-version set, which refuses a missing or incomplete backup, or clear the pin)"
