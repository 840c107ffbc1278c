package crashsim

import (
	"reflect"
	"testing"
	"time"
)

// The decision sequence is a function of the seed: the same seed draws the same episodes, in
// whatever order they are asked for; another seed draws others.
func TestPlanIsAFunctionOfTheSeed(t *testing.T) {
	a, b := NewPlanner(42, Long), NewPlanner(42, Long)
	b.Episode(4) // drawn in one go
	for i := range 5 {
		if !reflect.DeepEqual(a.Episode(i), b.Episode(i)) {
			t.Fatalf("episode %d differs between two planners of seed 42:\n%s\n%s", i, a.Episode(i), b.Episode(i))
		}
	}
	if reflect.DeepEqual(NewPlanner(43, Long).Episode(0), a.Episode(0)) {
		t.Fatal("seeds 42 and 43 drew the same first episode")
	}
}

// The short run of make test takes every kind of kill whatever the seed: a three-node episode
// first takes the kinds only a multi-node job has, the one-node episode the kinds left.
func TestShortRunCoversEveryKind(t *testing.T) {
	for seed := uint64(1); seed <= 200; seed++ {
		p := NewPlanner(seed, Short)
		kinds := map[Kind]bool{}
		kills := 0
		for i := range Short.Nodes {
			e := p.Episode(i)
			kills += e.Kills()
			for j, op := range e.Ops {
				if op.Type != OpKill {
					continue
				}
				kinds[op.Kill.Kind] = true
				if !op.Kill.Kind.applicable(e.Nodes) {
					t.Fatalf("seed %d episode %d op %d: %s in a %d-node job", seed, i, j, op.Kill.Kind, e.Nodes)
				}
				if op.Kill.Kind == MidBackup && j > 0 {
					t.Fatalf("seed %d episode %d: the mid-backup kill is op %d, want the first", seed, i, j)
				}
			}
		}
		if len(kinds) != len(Kinds) {
			t.Fatalf("seed %d: the short run kills at %d kinds of moment, want all %d: %v", seed, len(kinds), len(Kinds), kinds)
		}
		if kills < 8 {
			t.Fatalf("seed %d: %d kills", seed, kills)
		}
	}
}

// The bound follows the guarantees: a step whose commit returned on every rank is owed while
// the RAM survives; after a node lost its RAM, only a step claimed replicated (held by the
// node's peer) or backed up; a newer save of the same step number replaces an older one.
func TestBound(t *testing.T) {
	t0 := time.Now()
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	m := newModel(2)
	commit := func(step int64, when int, ranks ...int) *round {
		rd := m.newRound(step, Shape{Class: Small, Files: 1, FileSize: int64(100 + len(m.rounds))})
		for r := range 2 {
			rd.tried[r] = true
		}
		for _, r := range ranks {
			rd.ok[r], rd.at[r] = true, at(when)
		}
		return rd
	}
	want := func(what string, found bool, step int64, round int, source string) {
		t.Helper()
		b := m.bound()
		if b.Found != found || (found && (b.Step != step || b.Round != round || b.Source != source)) {
			t.Fatalf("%s: bound %s, want found %v step %d round %d (%s)", what, b, found, step, round, source)
		}
	}
	want("nothing saved", false, 0, 0, "")
	commit(10, 1, 0, 1)
	want("step 10 on both", true, 10, 0, "commits")
	commit(20, 2, 0) // rank 1 killed mid-write
	want("step 20 on rank 0 only", true, 10, 0, "commits")

	m.claim = &claim{step: 10, rounds: []int{0, 0}, at: at(3)}
	m.dropped(0, at(4))
	want("rank 0 replaced, step 10 claimed replicated before", true, 10, 0, "replicated")
	m.dropped(1, at(5))
	want("both replaced after the claim", false, 0, 0, "")

	m.backup = &backupHeld{name: "b", step: 10, round: 0}
	want("step 10 backed up", true, 10, 0, "backup b")

	m.restored([]int{0, 0}, at(6))
	commit(20, 7, 0, 1) // the job went on from 10 and saved step 20 again
	want("step 20 saved again on both", true, 20, 2, "commits")
	if m.ownHeld(0, 1) {
		t.Fatal("rank 0's first save of step 20 still counts after the second")
	}
	commit(20, 8, 1)                                                     // and once more, returned on rank 1 only
	want("third save of step 20 on rank 1 only", true, 10, 0, "commits") // restored at 6
	if got := m.candidates(0, 20); !reflect.DeepEqual(got, []int{3, 2, 1}) {
		t.Fatalf("candidates of rank 0 for step 20: %v, want newest first [3 2 1]", got)
	}
}
