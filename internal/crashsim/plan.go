package crashsim

import (
	"fmt"
	"math/rand/v2"
	"sort"
	"strings"
	"time"
)

// Kind is the moment of a kill: what the victim agent is meant to be doing when it gets SIGKILL.
type Kind string

const (
	// MidWrite kills the victim while its job writes a step (before the commit rename).
	MidWrite Kind = "mid-write"
	// AfterCommit kills the victim the moment its job's commit rename returned.
	AfterCommit Kind = "after-commit"
	// MidSeal kills the victim while a commit it recorded is not sealed yet (a record in
	// spool/commits), on a step of many small files.
	MidSeal Kind = "mid-seal"
	// MidPush kills the sender or the receiver of a peer transfer in flight (an incoming-*
	// directory in the receiver's spool).
	MidPush Kind = "mid-push"
	// MidBackup kills a node while it uploads its part of a backup (its /status shows the
	// backup, or the backup directory holds its temporary files).
	MidBackup Kind = "mid-backup"
	// MidRestore kills the victim while the job restarts on every node (restore negotiation,
	// fetch, markers).
	MidRestore Kind = "mid-restore"
	// RandomDelay kills the victim at a random delay after a save round started.
	RandomDelay Kind = "random-delay"
	// AllAgents kills every agent of the job at a random delay after a save round started.
	AllAgents Kind = "all-agents"
)

// Kinds lists every kind, in report order.
var Kinds = []Kind{MidWrite, AfterCommit, MidSeal, MidPush, MidBackup, MidRestore, RandomDelay, AllAgents}

// applicable reports whether a kill of kind k makes sense in a job of n nodes.
func (k Kind) applicable(n int) bool {
	switch k {
	case MidPush:
		return n >= 2 // a one-node job has no peers
	case AllAgents:
		return n >= 2 // with one node it is a plain kill
	}
	return true
}

// ShapeClass is the kind of step a save writes.
type ShapeClass string

const (
	Small ShapeClass = "small" // a few files of tens to hundreds of KiB
	Large ShapeClass = "large" // a few files of MiBs: long writes, pushes and uploads
	Many  ShapeClass = "many"  // hundreds or thousands of tiny files: long freezes and seals
)

// Shape is the content of one save: Files state files of FileSize bytes each (plus Orbax's
// metadata files), as jobsim.Content.
type Shape struct {
	Class    ShapeClass
	Files    int
	FileSize int64
	// Repeat: when the step number was saved before (an episode that saves step numbers again
	// after a restore), save exactly the bytes of its latest save again, as deterministic
	// training does; otherwise other bytes.
	Repeat bool
}

func (s Shape) String() string {
	r := ""
	if s.Repeat {
		r = " (repeat)"
	}
	return fmt.Sprintf("%s %d×%d%s", s.Class, s.Files, s.FileSize, r)
}

// sameBytes reports whether two saves of one step number with shapes s and o write the same
// bytes.
func (s Shape) sameBytes(o Shape) bool { return s.Files == o.Files && s.FileSize == o.FileSize }

// OpType says what an Op does.
type OpType int

const (
	OpSave    OpType = iota // every rank saves the next step
	OpRestart               // the job restarts on every rank (a new replicator.yaml), no kill
	OpKill                  // a kill of Kill.Kind, with the save (or restart) that leads to it, then recovery
	// OpBackup waits until the newest step saved everywhere is in a complete backup (SPEC §10:
	// at most backup-interval after its commit, but at most one backup a UTC minute per job).
	OpBackup
)

// KillSpec says whom to kill and when; which concrete moment is reached depends on the agents.
type KillSpec struct {
	Kind   Kind
	Victim int // rank; for MidPush the rank whose role Sender says
	// Sender: MidPush kills the pushing rank instead of the receiving one.
	Sender bool
	// Delay is the random part of the moment: how long after the trigger the kill comes (and
	// for RandomDelay and AllAgents, after the save round started).
	Delay time.Duration
	// Drop: the victim's node is replaced after the kill (its RAM, the spool, is lost).
	// For AllAgents, Victim is the node whose RAM is lost.
	Drop bool
}

// Op is one step of an episode's script.
type Op struct {
	Type  OpType
	Shape Shape // the step saved (OpSave, and OpKill of kinds that save)
	Kill  KillSpec
}

func (o Op) String() string {
	switch o.Type {
	case OpSave:
		return "save " + o.Shape.String()
	case OpRestart:
		return "restart job"
	case OpBackup:
		return "wait for a complete backup of the newest step"
	}
	k := o.Kill
	s := fmt.Sprintf("kill %s rank %d", k.Kind, k.Victim)
	if k.Kind == AllAgents {
		s = "kill all-agents"
	}
	if k.Kind == MidPush {
		role := "receiver"
		if k.Sender {
			role = "sender"
		}
		s += " (" + role + ")"
	}
	s += fmt.Sprintf(" +%v", k.Delay)
	if k.Drop {
		s += fmt.Sprintf(", drop rank %d's RAM", k.Victim)
	}
	if k.Kind != MidRestore {
		s += ", saving " + o.Shape.String()
	}
	return s
}

// Episode is one job on its own set of nodes, from a fresh start to a clean stop.
type Episode struct {
	Nodes int
	// Resave: after restoring step R the job goes on with R+10, as real training does, and so
	// saves again step numbers it saved before the restore (with other content). Otherwise it
	// goes on after the highest step it ever started, and no step number is saved twice.
	Resave bool
	Ops    []Op
}

// Kills counts the agents the episode's script kills (AllAgents counts each node).
func (e Episode) Kills() int {
	n := 0
	for _, op := range e.Ops {
		if op.Type == OpKill {
			n += killCount(op.Kill, e.Nodes)
		}
	}
	return n
}

func killCount(k KillSpec, nodes int) int {
	if k.Kind == AllAgents {
		return nodes
	}
	return 1
}

func (e Episode) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%d node(s), resave %v, %d kills:\n", e.Nodes, e.Resave, e.Kills())
	for j, op := range e.Ops {
		fmt.Fprintf(&b, "  %2d %s\n", j, op)
	}
	return b.String()
}

// Planner draws a run's episodes, one after the other, from the seed: the decision sequence is
// a pure function of the seed and the scale, whatever the agents do.
type Planner struct {
	Seed  uint64
	Scale Scale
	rng   *rand.Rand
	eps   []Episode
	used  map[Kind]bool // kinds some episode already took
}

// NewPlanner starts the decision sequence of seed.
func NewPlanner(seed uint64, sc Scale) *Planner {
	return &Planner{Seed: seed, Scale: sc, rng: rand.New(rand.NewPCG(seed, 0x6d746366637261)), used: map[Kind]bool{}} // "mtcfcra"
}

// Episode returns episode i of the sequence, drawing it (and those before it) if needed.
func (p *Planner) Episode(i int) Episode {
	for len(p.eps) <= i {
		p.eps = append(p.eps, p.draw(len(p.eps)))
	}
	return p.eps[i]
}

// Scale sets the sizes of a run: the short one in `make test`, the long one of the bench.
type Scale struct {
	Name string
	// Nodes of the episodes, in turn (the first episode takes Nodes[0], ...). Empty: drawn
	// (one node a quarter of the time, two a quarter, three half).
	Nodes []int
	// KillsPerEpisode bounds the kills of one episode (an AllAgents kill counts as one here).
	KillsPerEpisode [2]int
	// SmallFileSize, LargeFileSize and ManyFiles are ranges [lo, hi] of the shapes.
	SmallFileSize [2]int64
	LargeFileSize [2]int64
	ManyFiles     [2]int
	// MaxDelay bounds the random part of a kill's moment.
	MaxDelay time.Duration
	// Memory is each agent's --memory.
	Memory string
	// BackupWait is how long a MidBackup kill waits for a backup to start (at most one backup a
	// UTC minute per job) before it kills at once instead.
	BackupWait time.Duration
	// ProtectWait is how long a restored step may take to be reported replicated again.
	ProtectWait time.Duration
	// ClientTimeout bounds each wait of the scripted clients (the real ones wait 300 s).
	ClientTimeout time.Duration
	// Resave says which episodes reuse step numbers after restoring an older step.
	Resave ResaveMode
}

// ResaveMode says which episodes save a step number again after restoring an older step.
type ResaveMode int

const (
	ResaveNever  ResaveMode = iota // no episode: step numbers only grow
	ResaveHalf                     // drawn per episode, half of them
	ResaveAlways                   // every episode, as real training does
)

// Short is the run of `make test`: two episodes (three nodes, then one), small steps.
var Short = Scale{
	Name:            "short",
	Nodes:           []int{3, 1},
	KillsPerEpisode: [2]int{4, 5},
	SmallFileSize:   [2]int64{16 << 10, 128 << 10},
	LargeFileSize:   [2]int64{1 << 20, 3 << 20},
	ManyFiles:       [2]int{150, 400},
	MaxDelay:        150 * time.Millisecond,
	Memory:          "256MiB",
	BackupWait:      20 * time.Second,
	ProtectWait:     20 * time.Second,
	ClientTimeout:   60 * time.Second,
	// Every job saves step numbers again after restoring an older step, as real training does:
	// the case in which the long run once found a restore mixing two saves of a step (fixed, and
	// replayed without timing by TestCrashConsistencyStepSavedTwice).
	Resave: ResaveAlways,
}

// Long is the bench's run: episodes of one to three nodes, larger steps, many kills.
var Long = Scale{
	Name:            "long",
	KillsPerEpisode: [2]int{5, 9},
	SmallFileSize:   [2]int64{32 << 10, 512 << 10},
	LargeFileSize:   [2]int64{3 << 20, 10 << 20},
	ManyFiles:       [2]int{600, 2500},
	MaxDelay:        400 * time.Millisecond,
	Memory:          "768MiB",
	BackupWait:      75 * time.Second,
	ProtectWait:     30 * time.Second,
	ClientTimeout:   120 * time.Second,
	Resave:          ResaveHalf,
}

// draw draws episode e. A MidBackup kill, when an episode has one, comes first (a job's first
// backup is due seconds after its first step, the next ones only at the next UTC minute); every
// episode runs through all the kinds that apply to it in a shuffled order before repeating one.
func (p *Planner) draw(e int) Episode {
	rng, sc := p.rng, p.Scale
	nodes := 0
	if len(sc.Nodes) > 0 {
		nodes = sc.Nodes[e%len(sc.Nodes)]
	} else {
		nodes = []int{1, 2, 3, 3}[rng.IntN(4)]
	}
	ep := Episode{Nodes: nodes}
	switch sc.Resave {
	case ResaveAlways:
		ep.Resave = true
	case ResaveHalf:
		ep.Resave = rng.IntN(2) == 0
	}
	n := sc.KillsPerEpisode[0] + rng.IntN(sc.KillsPerEpisode[1]-sc.KillsPerEpisode[0]+1)
	// Kinds the run has not used yet come first, those that only a multi-node job can take
	// first of all, so that a few episodes cover every kind.
	var kinds []Kind
	for len(kinds) < n {
		var perm []Kind
		for _, k := range Kinds {
			if k.applicable(nodes) {
				perm = append(perm, k)
			}
		}
		rng.Shuffle(len(perm), func(i, j int) { perm[i], perm[j] = perm[j], perm[i] })
		rank := func(k Kind) int {
			switch {
			case p.used[k]:
				return 2
			case !k.applicable(1):
				return 0
			}
			return 1
		}
		sort.SliceStable(perm, func(i, j int) bool { return rank(perm[i]) < rank(perm[j]) })
		kinds = append(kinds, perm...)
	}
	kinds = kinds[:n]
	for _, k := range kinds {
		p.used[k] = true
	}
	for i, k := range kinds {
		if k == MidBackup && i > 0 && !hasKind(kinds[:i], MidBackup) {
			copy(kinds[1:i+1], kinds[:i])
			kinds[0] = MidBackup
		}
	}
	// A job's first backup is due seconds after its first step. An episode that does not kill it
	// (mid-backup) waits for it, and its next kill replaces the victim's node, so that the
	// restore needs a peer's replica or the backup.
	withBackup := kinds[0] != MidBackup
	if withBackup {
		ep.Ops = append(ep.Ops, Op{Type: OpSave, Shape: drawShape(rng, sc, Small)}, Op{Type: OpBackup})
	}
	for i, k := range kinds {
		if i > 0 {
			for range rng.IntN(3) {
				ep.Ops = append(ep.Ops, Op{Type: OpSave, Shape: drawShape(rng, sc, "")})
			}
			if rng.IntN(6) == 0 {
				ep.Ops = append(ep.Ops, Op{Type: OpRestart})
			}
		}
		op := Op{Type: OpKill, Shape: drawShape(rng, sc, killShape(k, rng)), Kill: drawKill(rng, sc, k, nodes)}
		if i == 0 && withBackup {
			op.Kill.Drop = true
		}
		ep.Ops = append(ep.Ops, op)
	}
	// The episode ends with a save the next agent must keep.
	ep.Ops = append(ep.Ops, Op{Type: OpSave, Shape: drawShape(rng, sc, Small)})
	return ep
}

func hasKind(ks []Kind, k Kind) bool {
	for _, x := range ks {
		if x == k {
			return true
		}
	}
	return false
}

// killShape is the step a kill of kind k saves: large steps keep writes, pushes and uploads
// going long enough to be hit, many small files keep a commit unsealed for a while.
func killShape(k Kind, rng *rand.Rand) ShapeClass {
	switch k {
	case MidWrite, MidPush, MidBackup:
		return Large
	case MidSeal:
		return Many
	case AfterCommit:
		if rng.IntN(2) == 0 {
			return Many
		}
		return Large
	}
	return "" // drawn
}

func drawShape(rng *rand.Rand, sc Scale, class ShapeClass) Shape {
	if class == "" {
		class = []ShapeClass{Small, Small, Large, Many}[rng.IntN(4)]
	}
	between := func(r [2]int64) int64 { return r[0] + rng.Int64N(r[1]-r[0]+1) }
	var s Shape
	switch class {
	case Large:
		s = Shape{Class: Large, Files: 2 + rng.IntN(3), FileSize: between(sc.LargeFileSize)}
	case Many:
		s = Shape{Class: Many, Files: sc.ManyFiles[0] + rng.IntN(sc.ManyFiles[1]-sc.ManyFiles[0]+1), FileSize: 256 + rng.Int64N(3<<10)}
	default:
		s = Shape{Class: Small, Files: 2 + rng.IntN(4), FileSize: between(sc.SmallFileSize)}
	}
	s.Repeat = rng.IntN(3) == 0
	return s
}

func drawKill(rng *rand.Rand, sc Scale, k Kind, nodes int) KillSpec {
	ks := KillSpec{Kind: k, Victim: rng.IntN(nodes), Sender: rng.IntN(2) == 0,
		Delay: time.Duration(rng.Int64N(int64(sc.MaxDelay) + 1))}
	// A node replacement now and then; at most one node's RAM is lost per recovery, so that the
	// step claimed replicated stays within reach.
	ks.Drop = rng.IntN(4) == 0
	return ks
}
