package tiers

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mtcfs/mtcfs/layout"
)

// retention knows what this node holds in RAM — every .meta in spool/meta and the namespace,
// and the data in spool/sealed they name — and frees what is no longer needed (SPEC §7 local
// retention): it keeps the latest committed step, the latest replicated one (the step that
// survives the loss of a node), any newer step, any step being backed up, and any data held
// (being sealed, restored, backed up, or a replica waiting for its .meta).
//
// The publish protocol. Data appears in spool/sealed before a .meta names it (a seal moves the
// record's data in, a restore or a replica moves what arrived in). retain decides what to free
// from the .meta files it knows and from the holds, then lists spool/sealed: data that appeared
// after it took that snapshot, with its .meta written after too, would look unnamed and be
// freed. So every change that makes data appear and gives it its .meta runs inside publish,
// and retain runs inside publish too: it sees the data with its .meta, or neither. Data whose
// .meta comes in a later publish (a replica's .meta, pushed after its data) is held from its
// own publish until then.
type retention struct {
	*node
	incs *incarnations // for the latest committed, replicated and restored steps
	// heldSuspect: a free left the RAM more than half full; heldLooked: when the last look at
	// the freed files the job holds open began (warnIfHeldOpen).
	heldSuspect atomic.Bool
	heldLooked  atomic.Int64

	// publishMu makes "data appears in spool/sealed and gets its .meta" atomic with respect to
	// retain.
	publishMu sync.Mutex
	// filling: the RAM was found filling (3/4 used) and has not been below half since (retain).
	filling bool // GUARDED_BY(publishMu)

	mu    sync.Mutex
	metas map[string]string // GUARDED_BY(mu); .meta name → hash, for every .meta held
	// verified holds the data names whose content this agent hashed itself (sealing, adoption,
	// arrival from a peer or a backup) and that the job cannot have changed since (the fs layer
	// makes committed trees immutable): a restore from RAM uses them without hashing them again.
	verified  map[string]bool // GUARDED_BY(mu)
	holds     map[string]int  // GUARDED_BY(mu); data names held, and by how many
	backingUp map[jobStep]int // GUARDED_BY(mu); steps being backed up, and by how many backups
}

// jobStep is a step of a job: a mount's RAM may hold two jobs' steps of one number.
type jobStep struct {
	job  string
	step int64
}

func newRetention(n *node, incs *incarnations) *retention {
	return &retention{node: n, incs: incs, metas: map[string]string{}, verified: map[string]bool{},
		holds: map[string]int{}, backingUp: map[jobStep]int{}}
}

// FreedButOpen is what a Namespace may also do: count the files whose last name went at least
// minAge ago that the job still holds open or mapped, and the bytes they keep in the spool.
type FreedButOpen interface {
	FreedButOpen(minAge time.Duration) (files int, bytes int64)
}

// A freed checkpoint's files the job still holds open keep their RAM; the job is told once per
// incarnation when at least heldOpenMin bytes stay held heldOpenAfter after the free (a reader
// that is just finishing does not count). It is looked for at most once every heldOpenEvery,
// which is longer than heldOpenAfter: one look at a time.
const (
	heldOpenMin   = 1 << 20
	heldOpenAfter = 5 * time.Second
	heldOpenEvery = time.Minute
)

// warnIfHeldOpen tells the job, once per incarnation, when files of checkpoints the agent freed
// are still open or mapped (torch.load(mmap=True) keeps every file it loaded mapped): their RAM
// stays used, and the job's saves fail with ENOSPC within a budget sized as the README says,
// which nothing explained (a black-box run). It looks heldOpenAfter after a free, on a goroutine
// of its own. Only the syncer's goroutine calls it.
func (rt *retention) warnIfHeldOpen(lines *jobLines, inc *incarnation) {
	fb, ok := rt.ns.(FreedButOpen)
	if !ok || inc.heldOpenTold.Load() {
		return
	}
	// Only when a free left the RAM more than half full, and at most once every heldOpenEvery
	// (not at every save: looking reads the processes' maps).
	if time.Since(time.Unix(0, rt.heldLooked.Load())) < heldOpenEvery || !rt.heldSuspect.Swap(false) {
		return
	}
	rt.heldLooked.Store(time.Now().UnixNano())
	time.AfterFunc(heldOpenAfter, func() {
		if inc.ctx.Err() != nil || !rt.incs.isCurrent(inc) {
			return // the agent stops, or the job restarted
		}
		files, bytes := fb.FreedButOpen(heldOpenAfter)
		if bytes < heldOpenMin || !inc.heldOpenTold.CompareAndSwap(false, true) {
			return
		}
		total, _ := rt.spool.Usage()
		msg := fmt.Sprintf("%d file(s) of checkpoints this node freed or the job deleted (%s) are still open or mapped by a process (torch.load(mmap=True) keeps what it loaded mapped): their RAM comes back only once they are closed and unmapped, and until then the job's saves have that much less of --memory %s and may fail with ENOSPC; load without mmap, close them, or give the agent a larger --memory",
			files, FormatSize(bytes), FormatSize(total))
		rt.log.Warn(msg)
		lines.incLine(inc, msg)
	})
}

// publish runs f, which makes data appear in spool/sealed and writes the .meta naming it, so
// that no retain runs in between (see retention). Nothing in f may call publish or retain.
func (rt *retention) publish(f func() error) error {
	rt.publishMu.Lock()
	defer rt.publishMu.Unlock()
	return f()
}

// writeMeta records a .meta in the spool (so a restarted agent finds it) and in the namespace.
// Called inside publish.
func (rt *retention) writeMeta(name, content string) error {
	dir := rt.spoolDir("meta")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	if err := rt.withRoom(func() error { return layout.WriteFileAtomic(filepath.Join(dir, name), []byte(content)) }); err != nil {
		return err
	}
	if err := rt.writeFile(name, []byte(content)); err != nil {
		return err
	}
	rt.mu.Lock()
	rt.metas[name] = content
	rt.mu.Unlock()
	return nil
}

// hold protects data from retain until the returned release is called.
func (rt *retention) hold(dataName string) (release func()) {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	return rt.holdLocked(dataName)
}

func (rt *retention) holdLocked(dataName string) (release func()) {
	rt.holds[dataName]++
	return func() {
		rt.mu.Lock()
		if rt.holds[dataName]--; rt.holds[dataName] <= 0 {
			delete(rt.holds, dataName)
		}
		rt.mu.Unlock()
	}
}

// metaHash returns the hash the .meta name holds, if this node has it.
func (rt *retention) metaHash(name string) (string, bool) {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	h, ok := rt.metas[name]
	return h, ok
}

func (rt *retention) isHeld(dataName string) bool {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	return rt.holds[dataName] > 0
}

// keepStep keeps every .meta of job's step (and the data they name) until the returned release
// is called: the step is being backed up.
func (rt *retention) keepStep(job string, step int64) (release func()) {
	k := jobStep{job, step}
	rt.mu.Lock()
	rt.backingUp[k]++
	rt.mu.Unlock()
	return func() {
		rt.mu.Lock()
		if rt.backingUp[k]--; rt.backingUp[k] <= 0 {
			delete(rt.backingUp, k)
		}
		rt.mu.Unlock()
	}
}

// isBackingUp reports whether job's step is being backed up.
func (rt *retention) isBackingUp(job string, step int64) bool {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	return rt.backingUp[jobStep{job, step}] > 0
}

// holdStep returns the hashes of this node's workers' data of step, each held until release is
// called; an error if a worker's .meta is no longer here.
func (rt *retention) holdStep(cfg *Config, step int64) (hashes []string, release func(), err error) {
	hashes = make([]string, cfg.WorkersPerNode)
	rt.mu.Lock()
	defer rt.mu.Unlock()
	for w := range hashes {
		name := layout.MarkerName{Job: cfg.JobName, Step: step, Node: cfg.NodeRank, Worker: w, Kind: layout.MarkerMeta}.String()
		h, ok := rt.metas[name]
		if !ok {
			return nil, nil, fmt.Errorf("step %d worker %d is no longer in this node's RAM", step, w)
		}
		hashes[w] = h
	}
	releases := make([]func(), len(hashes))
	for i, h := range hashes {
		releases[i] = rt.holdLocked(h + ".data")
	}
	return hashes, func() {
		for _, r := range releases {
			r()
		}
	}, nil
}

// retain frees this job's steps that are neither the latest complete one, newer than it
// (still being saved), nor being backed up (SPEC §7 local retention), and the data no kept
// .meta names.
func (rt *retention) retain(cfg *Config) {
	rt.publishMu.Lock()
	defer rt.publishMu.Unlock()
	keepFrom, floor, restored := rt.incs.latest()
	inUse, inUseData := rt.incs.inUse() // read once: the step and its data go together
	// With the RAM filling, the steps between the one that survives a node's loss (the latest
	// replicated, or else the restored one) and the newest step every node committed go too:
	// every node holds that newer step, which a restore without loss takes, and a restore
	// after a loss takes the older one. Kept, they filled the RAM when pushes fell behind the
	// job's saves (a link slower than the saves): the job's saves then failed with ENOSPC and
	// the peers, just as full, refused every push, for good (a black-box run).
	// The RAM counts as filling from 3/4 of it used until less than half is: freed only down to
	// 3/4, the steps the next push's time brought filled it again (a black-box run: saves
	// failed with ENOSPC for a few seconds at every push).
	dropAbove, dropBelow := int64(-1), int64(-1)
	if total, used := rt.spool.Usage(); total > 0 && (used >= total/4*3 || (rt.filling && used >= total/2)) {
		rt.filling = true
		dropAbove, dropBelow = floor, rt.incs.everywhere()
		if floor < 0 {
			dropAbove = restored
		}
	} else {
		rt.filling = false
	}
	// A newer step that did not replicate must not cost the one reported replicated: it is the
	// step that survives the loss of a node (SPEC §7). Before the incarnation replicated any,
	// what the restore found stays: the restored step and the older ones the incarnation before
	// kept, the step it last replicated among them (the restored step may never have been, and
	// its re-protection may fail: freeing the older ones then left a node's loss nothing).
	keepUpTo := int64(-1)
	if floor < 0 {
		floor, keepUpTo = restored, restored
	}
	if floor > 0 && floor < keepFrom {
		keepFrom = floor
	}
	var drop []string
	keepHash := map[string]bool{}
	rt.mu.Lock()
	for name, hash := range rt.metas {
		m, ok := layout.ParseMarkerName(name)
		older := m.Step < keepFrom && m.Step > keepUpTo
		between := m.Step > dropAbove && m.Step < dropBelow
		if ok && m.Job == cfg.JobName && (older || between) && m.Step != inUse && rt.backingUp[jobStep{m.Job, m.Step}] == 0 {
			drop = append(drop, name)
		} else {
			keepHash[hash] = true
		}
	}
	for _, name := range drop {
		delete(rt.metas, name)
	}
	rt.mu.Unlock()
	for _, hash := range inUseData {
		keepHash[hash] = true // the restored step's data, which its markers name
	}
	for _, name := range drop {
		os.Remove(rt.spoolDir("meta", name))
		rt.ns.Remove(name)
	}
	// Data that no kept .meta names goes too.
	ents, _ := os.ReadDir(rt.spoolDir("sealed"))
	freed := false
	for _, e := range ents {
		hash := strings.TrimSuffix(e.Name(), ".data")
		if !layout.IsDataName(e.Name()) || keepHash[hash] || rt.isHeld(e.Name()) {
			continue // an attrs file goes with its data
		}
		rt.freeData(e.Name())
		rt.log.Info("freed", "data", e.Name())
		freed = true
	}
	if !freed {
		return
	}
	if total, used := rt.spool.Usage(); used*2 > total {
		// Freed, and the RAM is still more than half full, which a budget sized as the
		// README says is not once a step is freed (warnIfHeldOpen).
		rt.heldSuspect.Store(true)
	}
}

// dropMetas forgets the .meta files whose names match (from the spool and the namespace) and
// returns their names, sorted. The caller runs retain next to free their data. match is called
// with mu held.
func (rt *retention) dropMetas(match func(m layout.MarkerName, hash string) bool) []string {
	var drop []string
	rt.mu.Lock()
	for name, hash := range rt.metas {
		if m, ok := layout.ParseMarkerName(name); ok && match(m, hash) {
			drop = append(drop, name)
			delete(rt.metas, name)
		}
	}
	rt.mu.Unlock()
	sort.Strings(drop)
	for _, name := range drop {
		os.Remove(rt.spoolDir("meta", name))
		rt.ns.Remove(name)
	}
	return drop
}

// dropData removes data from the spool and the namespace (it failed its check).
func (rt *retention) dropData(dataName string) {
	rt.publishMu.Lock()
	defer rt.publishMu.Unlock()
	rt.freeData(dataName)
}

// dropUnheld frees data that is there and that nothing holds (a restore, a backup, a push), and
// reports whether it did.
func (rt *retention) dropUnheld(dataName string) bool {
	rt.publishMu.Lock()
	defer rt.publishMu.Unlock()
	if _, err := os.Lstat(rt.spoolDir("sealed", dataName)); err != nil || rt.isHeld(dataName) {
		return false
	}
	hash := strings.TrimSuffix(dataName, ".data")
	rt.mu.Lock()
	for name, h := range rt.metas {
		if m, ok := layout.ParseMarkerName(name); ok && h == hash && rt.backingUp[jobStep{m.Job, m.Step}] > 0 {
			rt.mu.Unlock()
			return false // its step is being backed up
		}
	}
	rt.mu.Unlock()
	rt.freeData(dataName)
	return true
}

// freeData removes data from the namespace, then from the spool with its attrs, and forgets it
// was verified. The caller holds publishMu.
func (rt *retention) freeData(dataName string) {
	rt.ns.Remove(dataName) // first: its nodes may borrow the record's files (fs.importTree)
	p := rt.spoolDir("sealed", dataName)
	os.RemoveAll(p)
	os.Remove(layout.AttrsFile(p))
	rt.mu.Lock()
	delete(rt.verified, dataName)
	rt.mu.Unlock()
	rt.spool.FillHeadroom()
}

func (rt *retention) isVerified(dataName string) bool {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	return rt.verified[dataName]
}

func (rt *retention) markVerified(dataName string) {
	rt.mu.Lock()
	rt.verified[dataName] = true
	rt.mu.Unlock()
}

// earlierOwnStep reports whether a .meta of an earlier step of cfg's job, of this node and
// worker, names hash.
func (rt *retention) earlierOwnStep(cfg *Config, worker int, step int64, hash string) bool {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	for name, h := range rt.metas {
		if h != hash {
			continue
		}
		if m, ok := layout.ParseMarkerName(name); ok && m.Job == cfg.JobName && m.Node == cfg.NodeRank && m.Worker == worker && m.Step < step {
			return true
		}
	}
	return false
}

// inventory lists what this node holds in RAM for the restore negotiation.
func (rt *retention) inventory(rank int) Inventory {
	inv := Inventory{Rank: rank, Metas: map[string]string{}, Shape: rt.spool.SavedShape()}
	rt.mu.Lock()
	for k, v := range rt.metas {
		inv.Metas[k] = v
	}
	rt.mu.Unlock()
	ents, _ := os.ReadDir(rt.spoolDir("sealed"))
	for _, e := range ents {
		if layout.IsDataName(e.Name()) {
			inv.Data = append(inv.Data, strings.TrimSuffix(e.Name(), ".data"))
		}
	}
	return inv
}

// warnIfFilling tells the job, once until a step replicates again, when the steps that wait for
// a newer one to replicate are about to fill this node's RAM: with a peer unreachable, each save
// was kept and the job's next write failed with ENOSPC, having been told only that a push
// failed (found by a black-box run). It is said when a push of the newest step just failed
// (pushFailed) and another step of the average size held does not fit, or when three steps or
// more wait with the RAM 75% full (replication does not keep up).
func (rt *retention) warnIfFilling(lines *jobLines, inc *incarnation, pushFailed bool) {
	rt.warnIfFillingBecause(lines, inc, pushFailed, "")
}

// warnIfFillingBecause is warnIfFilling whose line begins with why, when not "".
func (rt *retention) warnIfFillingBecause(lines *jobLines, inc *incarnation, pushFailed bool, why string) {
	total, used := rt.spool.Usage()
	if total <= 0 || inc.fillTold.Load() || !rt.incs.isCurrent(inc) || (!pushFailed && used*4 < total*3) {
		return // the common case on the seal path: one statfs
	}
	cfg := inc.Config
	_, replicated, restored := rt.incs.latest()
	floor := replicated
	if floor < 0 {
		floor = restored
	}
	steps, held := rt.stepsAbove(cfg.JobName, cfg.NodeRank, floor)
	if held == 0 {
		return
	}
	if len(steps) == 0 {
		// No step of this node waits (a job restarted: the restored one is the floor), yet a
		// peer's replica found no room: the job's saves fail with ENOSPC too, and its restart
		// was told nothing (found by a black-box run).
		if why == "" || !noRoomForAStep(total, used, held) || !inc.fillTold.CompareAndSwap(false, true) {
			return
		}
		msg := fmt.Sprintf("%sthis node's RAM is %d%% full (%s of --memory %s, %d checkpoints: this node's and its peers' replicas): the job's saves fail with ENOSPC once it is full; give the agent a larger --memory",
			why, used*100/total, FormatSize(used), FormatSize(total), held)
		rt.log.Warn(msg)
		lines.incLine(inc, msg)
		return
	}
	tight := pushFailed && noRoomForAStep(total, used, held)
	lagging := len(steps) >= 3 && used*4 >= total*3
	if !(tight || lagging) || !inc.fillTold.CompareAndSwap(false, true) {
		return
	}
	repl := "none yet"
	if replicated >= 0 {
		repl = fmt.Sprintf("step %d", replicated)
	}
	kept := fmt.Sprintf("%d steps (%d to %d) are", len(steps), steps[0], steps[len(steps)-1])
	if len(steps) == 1 {
		kept = fmt.Sprintf("step %d is", steps[0])
	}
	msg := fmt.Sprintf("%sthis node's RAM is %d%% full, and %s kept until a newer step is replicated on every node (latest replicated: %s): the job's saves fail with ENOSPC once it is full; see why steps are not replicated (mtcfs status, the agents' logs; a push that failed is told in a line of its own), or give the agent a larger --memory",
		why, used*100/total, kept, repl)
	rt.log.Warn(msg)
	lines.incLine(inc, msg)
}

// warnTightAfterRestore tells the job when the RAM left after its restore of step has less room
// than a step of the average size held: its next save fails with ENOSPC (the restored step stays
// until a newer one is complete). Once per restore; it does not take warnIfFilling's once (a
// replica refused later for lack of room must still be told: a clean-clone CI run).
func (rt *retention) warnTightAfterRestore(lines *jobLines, inc *incarnation, step int64) {
	total, used := rt.spool.Usage()
	if total <= 0 || !rt.incs.isCurrent(inc) {
		return
	}
	if fb, ok := rt.ns.(FreedButOpen); ok {
		// Files removed but still open (the save the job's crash cut short, which the
		// handshake just removed, while the dead job's descriptors are being released) come
		// back in a moment: counted, they made "RAM is 100% full" of 10 MiB used in 32
		// (black-box h59: 3 of 4).
		_, pending := fb.FreedButOpen(0)
		used = max(used-pending, 0)
	}
	_, held := rt.stepsAbove(inc.Config.JobName, inc.Config.NodeRank, -1)
	if held == 0 || !noRoomForAStep(total, used, held) {
		return
	}
	msg := fmt.Sprintf("after the restore of step %d, this node's RAM is %d%% full (%s of --memory %s, %d checkpoint(s): this node's and its peers' replicas): a next save as large fails with ENOSPC; give the agent a larger --memory",
		step, used*100/total, FormatSize(used), FormatSize(total), held)
	rt.log.Warn(msg)
	lines.incLine(inc, msg)
}

// noRoomForAStep reports whether the RAM left (total - used) is less than a step of the average
// size of the held data (held > 0): the job's next save would fail with ENOSPC.
func noRoomForAStep(total, used int64, held int) bool { return total-used < used/int64(held) }

// stepsAbove lists, in order, the steps above floor that this node holds of job's rank.
// It also counts the distinct data this node holds (its own and its peers' replicas).
func (rt *retention) stepsAbove(job string, rank int, floor int64) (steps []int64, held int) {
	rt.mu.Lock()
	data := map[string]bool{}
	for name, hash := range rt.metas {
		data[hash] = true
		if m, ok := layout.ParseMarkerName(name); ok && m.Job == job && m.Node == rank && m.Step > floor && !slices.Contains(steps, m.Step) {
			steps = append(steps, m.Step)
		}
	}
	rt.mu.Unlock()
	slices.Sort(steps)
	return steps, len(data)
}

// steps lists the .meta files held, for status.
func (rt *retention) steps() []StepInRAM {
	rt.mu.Lock()
	var steps []StepInRAM
	for name, hash := range rt.metas {
		if m, ok := layout.ParseMarkerName(name); ok {
			steps = append(steps, StepInRAM{Meta: name, Step: m.Step, Rank: m.Node, Data: hash + ".data"})
		}
	}
	rt.mu.Unlock()
	sort.Slice(steps, func(i, j int) bool { return steps[i].Meta < steps[j].Meta })
	return steps
}

// sealedPath is where this node holds the data name.
func (rt *retention) sealedPath(name string) (string, error) {
	if !layout.IsDataName(name) {
		return "", fmt.Errorf("%q: %w", name, os.ErrNotExist)
	}
	p := rt.spoolDir("sealed", name)
	if _, err := os.Lstat(p); err != nil {
		return "", err
	}
	return p, nil
}
