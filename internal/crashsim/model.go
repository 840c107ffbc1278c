package crashsim

import (
	"fmt"
	"sort"
	"time"
)

// The model: what the job was told (which saves returned), which RAM survived, what the agents
// claimed replicated and what the backups hold — and from it the invariant's bound, the step
// every node must restore at least.
//
// Saves are grouped in rounds: one round is one save of one step on every rank, with one
// content shape (a job that restarts from an older step saves a step number again, with other
// content, in a later round). A restore is checked round by round: every rank must get the
// bytes of one round of the step, the same round on every rank.

// copyOf is one rank's copy of a round held in that rank's RAM since at.
type copyOf struct {
	round int
	at    time.Time
}

type round struct {
	id    int
	step  int64
	shape Shape
	// ok[r]: rank r's save returned (the commit rename returned 0); tried[r]: it was started.
	ok, tried []bool
	at        []time.Time // when rank r's save returned
}

// claim is a step the agents reported replicated ("latest replicated on every node"), read
// while every agent was up in the current incarnation: every rank's copy of it (the round in
// rounds[r]) was then held by the rank and its peers.
type claim struct {
	step   int64
	rounds []int // by rank; -1: unknown
	at     time.Time
}

// backupHeld is a step a complete backup holds, checked byte by byte against a round.
type backupHeld struct {
	name  string
	step  int64
	round int
}

type model struct {
	nodes    int
	peers    [][]int // by rank
	rounds   []*round
	byStep   map[int64][]*round
	held     [][]copyOf // by rank: restored copies
	lastDrop []time.Time
	claim    *claim
	backup   *backupHeld // the newest step in a complete, verified backup
}

func newModel(nodes int) *model {
	m := &model{nodes: nodes, byStep: map[int64][]*round{}, held: make([][]copyOf, nodes), lastDrop: make([]time.Time, nodes)}
	for r := range nodes {
		m.peers = append(m.peers, peerRanks(r, nodes))
	}
	return m
}

// peerRanks is the ring the episodes use: rank r replicates to r+1.
func peerRanks(r, nodes int) []int {
	if nodes < 2 {
		return nil
	}
	return []int{(r + 1) % nodes}
}

// holdersOf lists the ranks holding r's replicas: r's peers.
func (m *model) holdersOf(r int) []int { return m.peers[r] }

func (m *model) newRound(step int64, shape Shape) *round {
	rd := &round{id: len(m.rounds), step: step, shape: shape, ok: make([]bool, m.nodes), tried: make([]bool, m.nodes), at: make([]time.Time, m.nodes)}
	m.rounds = append(m.rounds, rd)
	m.byStep[step] = append(m.byStep[step], rd)
	return rd
}

// shapeOf returns the content shape of round id.
func (m *model) shapeOf(id int) Shape { return m.rounds[id].shape }

// candidates lists the rounds of step that rank r may hold, newest first: every round whose
// save was started there (a save cut short may still have committed) plus restored copies.
func (m *model) candidates(r int, step int64) []int {
	seen := map[int]bool{}
	var out []int
	rs := m.byStep[step]
	for i := len(rs) - 1; i >= 0; i-- {
		if rs[i].tried[r] && !seen[rs[i].id] {
			seen[rs[i].id] = true
			out = append(out, rs[i].id)
		}
	}
	for _, c := range m.held[r] {
		if m.rounds[c.round].step == step && !seen[c.round] {
			seen[c.round] = true
			out = append(out, c.round)
		}
	}
	// Then every other round of the step (data that reached the rank from a peer or a backup).
	for i := len(rs) - 1; i >= 0; i-- {
		if !seen[rs[i].id] {
			seen[rs[i].id] = true
			out = append(out, rs[i].id)
		}
	}
	return out
}

// ownHeld reports whether rank r holds round id in its own RAM: its save returned, or it
// restored that round, after its RAM was last lost.
// A later save or restore of the same step number replaces it (the .meta names the newer
// data).
func (m *model) ownHeld(r, id int) bool {
	step := m.rounds[id].step
	latest, at := -1, time.Time{}
	note := func(round int, t time.Time) {
		if t.After(m.lastDrop[r]) && (latest < 0 || t.After(at)) {
			latest, at = round, t
		}
	}
	for _, rd := range m.byStep[step] {
		if rd.ok[r] {
			note(rd.id, rd.at[r])
		}
	}
	for _, c := range m.held[r] {
		if m.rounds[c.round].step == step {
			note(c.round, c.at)
		}
	}
	return latest == id
}

// heldByPeer reports whether the claim covers rank r's copy of round id and one of the ranks
// holding r's replicas kept its RAM since the claim.
func (m *model) heldByPeer(r, id int) bool {
	c := m.claim
	if c == nil || c.step != m.rounds[id].step || c.rounds[r] != id {
		return false
	}
	for _, p := range m.holdersOf(r) {
		if !m.lastDrop[p].After(c.at) {
			return true
		}
	}
	return false
}

// Bound is the invariant's lower bound after a recovery: every node must restore Step or a
// newer one; restoring Step itself, at least Round of it. Found is false when nothing is owed
// (a fresh start is then correct).
type Bound struct {
	Found  bool
	Step   int64
	Round  int
	Source string // why it is owed: "commits", "replicated", "backup <name>"
}

func (b Bound) String() string {
	if !b.Found {
		return "nothing owed"
	}
	return fmt.Sprintf("step %d (round %d, %s)", b.Step, b.Round, b.Source)
}

// bound computes the invariant's bound now: the newest round that every rank holds in its own
// RAM (its commit returned, or it restored it, since its RAM was last lost) or, for a rank whose
// RAM was lost, in a peer's RAM under the replication claim; or the newest step of a complete
// backup; whichever is newer.
func (m *model) bound() Bound {
	var b Bound
	steps := make([]int64, 0, len(m.byStep))
	for s := range m.byStep {
		steps = append(steps, s)
	}
	sort.Slice(steps, func(i, j int) bool { return steps[i] > steps[j] })
search:
	for _, s := range steps {
		rs := m.byStep[s]
		for i := len(rs) - 1; i >= 0; i-- {
			id := rs[i].id
			src := "commits"
			all := true
			for r := range m.nodes {
				if m.ownHeld(r, id) {
					continue
				}
				if m.heldByPeer(r, id) {
					src = "replicated"
					continue
				}
				all = false
				break
			}
			if all {
				b = Bound{Found: true, Step: s, Round: id, Source: src}
				break search
			}
		}
	}
	if bk := m.backup; bk != nil && (!b.Found || bk.step > b.Step || (bk.step == b.Step && bk.round > b.Round)) {
		b = Bound{Found: true, Step: bk.step, Round: bk.round, Source: "backup " + bk.name}
	}
	return b
}

// latestRound returns the round of step that rank r holds in its RAM by the model: the newest
// returned save or restored copy; -1 when none.
func (m *model) latestRound(r int, step int64) int {
	best := -1
	for _, rd := range m.byStep[step] {
		if m.ownHeld(r, rd.id) && rd.id > best {
			best = rd.id
		}
	}
	return best
}

// dropped records that rank r's RAM was lost at t.
func (m *model) dropped(r int, t time.Time) { m.lastDrop[r] = t }

// restored records that every rank r holds round ids[r] in RAM since t.
func (m *model) restored(ids []int, t time.Time) {
	for r := range m.nodes {
		m.held[r] = append(m.held[r], copyOf{round: ids[r], at: t})
	}
}
