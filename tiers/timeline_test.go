package tiers_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mtcfs/mtcfs/tiers"
)

// timelineInvs is the cluster of a black-box run: three nodes, each pushing to the next. Rank 0's
// agent went away after restore 1 with steps 1–3 of timeline A in its spool (hashes 100+step,
// held by itself only: the pushes were cut); a replacement took rank 0, the job restored step 1
// (restore 2) and saved steps 2–3 again (timeline B: 200+step for rank 0's slot, replicated to
// rank 1; 300+ and 400+ for ranks 1 and 2). Then the old rank 0 came back.
func timelineInvs() []tiers.Inventory {
	inv := func(rank int, gen int64, restores map[int64]int64) tiers.Inventory {
		return tiers.Inventory{Rank: rank, Metas: map[string]string{}, Timeline: tiers.Timeline{Generation: gen, Restores: restores}}
	}
	invs := []tiers.Inventory{inv(0, 1, map[int64]int64{1: -1}), inv(1, 2, map[int64]int64{1: -1, 2: 1}), inv(2, 2, map[int64]int64{1: -1, 2: 1})}
	hold := func(rank int, step int64, slot, hash int) {
		invs[rank].Metas[metaOf(step, slot, 0)] = hx(hash)
		invs[rank].Data = append(invs[rank].Data, hx(hash))
	}
	hold(0, 1, 0, 101) // step 1: the common timeline, replicated everywhere
	hold(1, 1, 0, 101)
	hold(1, 1, 1, 301)
	hold(2, 1, 1, 301)
	hold(2, 1, 2, 401)
	hold(0, 1, 2, 401)
	for step := int64(2); step <= 3; step++ {
		hold(0, step, 0, 100+int(step)) // timeline A, rank 0's own
		hold(1, step, 0, 200+int(step)) // timeline B: the replacement's, replicated to rank 1
		hold(1, step, 1, 300+int(step))
		hold(2, step, 1, 300+int(step))
		hold(2, step, 2, 400+int(step))
	}
	return invs
}

// TestStaleTimelineIsNotCombined: a node that missed a restore of the job (its agent away while
// a replacement took its rank) holds steps of a timeline the job left; they are not combined
// with the other nodes' saves of the same steps. Before, its own data of step 3 (timeline A) was
// restored with the others' (timeline B), with no word (found by a black-box run).
func TestStaleTimelineIsNotCombined(t *testing.T) {
	t.Parallel()
	cfg := planConfig(3, 1)
	invs := timelineInvs()
	before := fmt.Sprint(invs)
	cut, gen, above, lines := tiers.CutStaleTimelines(cfg, invs)
	assert.Equal(t, before, fmt.Sprint(invs), "the inventories given are not changed")
	assert.EqualValues(t, 3, gen, "the restore after the newest")
	assert.Equal(t, map[int]int64{0: 1}, above, "rank 0 missed restore 2, of step 1")
	require.Len(t, lines, 1)
	assert.Equal(t, "the RAM of rank 0 holds step(s) 2, 3 of a timeline the job left: its agent took no part when the job restored step 1 and went on from there (it was away, or not a node of the job then); they are not restored, and are dropped", lines[0])

	plan, err := tiers.PlanRestore(context.Background(), cfg, cut, nil, tiers.PlanLimits{})
	require.NoError(t, err)
	assert.True(t, plan.Found)
	assert.EqualValues(t, 3, plan.Step)
	assert.Equal(t, slots("n0-w0", hx(203), "n1-w0", hx(303), "n2-w0", hx(403)), plan.Data, "timeline B everywhere")

	// Without the cut, rank 0's own save won (the mix it prevents); now the two saves of its
	// slot are passed over, and step 1 restored (TestTwoSavesOfAStepAcrossTimelinesAreNotCombined).
	uncut, err := tiers.PlanRestore(context.Background(), cfg, invs, nil, tiers.PlanLimits{})
	require.NoError(t, err)
	assert.EqualValues(t, 1, uncut.Step)

	// The replica of timeline B gone too: rank 0's slot of steps 2–3 is nowhere, and step 1 is
	// restored, never timeline A's.
	invs = timelineInvs()
	for step := int64(2); step <= 3; step++ {
		delete(invs[1].Metas, metaOf(step, 0, 0))
	}
	cut, _, _, _ = tiers.CutStaleTimelines(cfg, invs)
	plan, err = tiers.PlanRestore(context.Background(), cfg, cut, nil, tiers.PlanLimits{})
	require.NoError(t, err)
	assert.EqualValues(t, 1, plan.Step)
}

// TestTimelineCutBounds: the step a stale node keeps up to is the lowest restored by the
// restores it missed; a restore no record tells the step of, or too many missed, count as none
// (everything of the job goes); unknown timelines and current ones are left alone.
func TestTimelineCutBounds(t *testing.T) {
	t.Parallel()
	cfg := planConfig(3, 1)
	steps := func(rank int, ss ...int64) map[string]string {
		m := map[string]string{}
		for _, s := range ss {
			m[metaOf(s, rank, 0)] = hx(int(s))
		}
		return m
	}
	inv := func(rank int, gen int64, restores map[int64]int64) tiers.Inventory {
		return tiers.Inventory{Rank: rank, Metas: steps(rank, 1, 2, 3, 4, 5, 6), Timeline: tiers.Timeline{Generation: gen, Restores: restores}}
	}
	for _, tc := range []struct {
		name  string
		invs  []tiers.Inventory
		above map[int]int64
	}{
		{"all current", []tiers.Inventory{inv(0, 4, nil), inv(1, 4, nil), inv(2, 4, nil)}, nil},
		{"unknown timelines", []tiers.Inventory{inv(0, 0, nil), inv(1, 4, map[int64]int64{4: 2}), inv(2, 0, nil)}, nil},
		{"missed two: the lower", []tiers.Inventory{inv(0, 2, nil), inv(1, 4, map[int64]int64{3: 5, 4: 2}), inv(2, 4, map[int64]int64{4: 2})}, map[int]int64{0: 2}},
		{"missed one not told", []tiers.Inventory{inv(0, 2, nil), inv(1, 4, map[int64]int64{4: 5}), inv(2, 4, nil)}, map[int]int64{0: -1}},
		{"missed a fresh start", []tiers.Inventory{inv(0, 3, nil), inv(1, 4, map[int64]int64{4: -1}), inv(2, 4, nil)}, map[int]int64{0: -1}},
		{"missed too many", []tiers.Inventory{inv(0, 1, nil), inv(1, 100, map[int64]int64{100: 5}), inv(2, 100, nil)}, map[int]int64{0: -1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cut, _, above, _ := tiers.CutStaleTimelines(cfg, tc.invs)
			assert.Equal(t, tc.above, above)
			for _, inv := range cut {
				b, stale := tc.above[inv.Rank]
				for name := range steps(inv.Rank, 1, 2, 3, 4, 5, 6) {
					_, kept := inv.Metas[name]
					var s int64
					fmt.Sscanf(name[strings.Index(name, "-s")+2:], "%d", &s)
					assert.Equal(t, !stale || s <= b, kept, "rank %d %s", inv.Rank, name)
				}
			}
		})
	}
}

// TestSpoolRecordsRestores: the restores a node took part in are kept with the shape, for the
// job they are of, the newest maxTimelineRestores of them, across a reopen while the owner
// record names the incarnation that recorded them; not for another job, not once another
// incarnation was answered without recording one (an agent of an earlier release: its numbers
// are stale), and not from a coordinator that numbers no restore.
func TestSpoolRecordsRestores(t *testing.T) {
	t.Parallel()
	base := t.TempDir()
	mnt, dir := filepath.Join(base, "mnt"), filepath.Join(base, "spool")
	require.NoError(t, os.Mkdir(mnt, 0o755))
	open := func() *tiers.Spool {
		s, err := tiers.OpenSpool(tiers.SpoolConfig{Dir: dir, Budget: tiers.MinBudget, MountPath: mnt})
		require.NoError(t, err)
		return s
	}
	s := open()
	shape := tiers.Shape{Nodes: 2, Workers: 1}
	require.ErrorContains(t, s.SetShapeRestored("job", "i1", shape, 1, 5), "serves another job", "no job answered yet")
	require.NoError(t, s.SetRunning("job", tiers.Running{Incarnation: "i1"}))
	for g := int64(1); g <= 70; g++ {
		require.NoError(t, s.SetShapeRestored("job", "i1", shape, g, g*10))
	}
	tl := s.Timeline("job")
	assert.EqualValues(t, 70, tl.Generation)
	assert.Len(t, tl.Restores, 64)
	assert.EqualValues(t, 700, tl.Restores[70])
	assert.EqualValues(t, 70, tl.Restores[7])
	assert.Equal(t, tiers.Timeline{}, s.Timeline("other"), "another job's")
	require.NoError(t, s.SetShape(tiers.Shape{Nodes: 4, Workers: 1}))
	assert.EqualValues(t, 70, s.Timeline("job").Generation, "a new shape keeps the job's timeline")
	require.NoError(t, s.Detach())

	s = open()
	assert.EqualValues(t, 700, s.Timeline("job").Restores[70], "kept across a reopen")
	// The job restarts, and its agent restarts before the restore is recorded (a crash during
	// the negotiation): the timeline the new incarnation continued is still trusted.
	require.NoError(t, s.SetRunning("job", tiers.Running{Incarnation: "i1b"}))
	require.NoError(t, s.Detach())
	s = open()
	assert.EqualValues(t, 700, s.Timeline("job").Restores[70], "kept across a restart before the restore was recorded")
	require.NoError(t, s.SetRunning("job", tiers.Running{Incarnation: "i1c"}))
	require.NoError(t, s.Detach())
	s = open()
	assert.EqualValues(t, 70, s.Timeline("job").Generation, "and across a second one")
	require.NoError(t, s.Detach())
	// An agent of an earlier release answers the job (its own incarnation in the owner record,
	// which it rewrites without the fields it does not know) and leaves the shape record as it is.
	ownerPath := filepath.Join(dir, tiers.OwnerFile)
	var owner map[string]any
	data, err := os.ReadFile(ownerPath)
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(data, &owner))
	owner["running"] = map[string]any{"incarnation": "old-agent", "rank": 0, "nodes": 2, "since": "2030-01-02T03:00:00Z", "tracks_restore": true}
	data, err = json.Marshal(owner)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(ownerPath, data, 0o600))
	s = open()
	tl = s.Timeline("job")
	assert.Zero(t, tl.Generation, "numbers the earlier agent did not keep are not trusted")
	assert.Empty(t, tl.Restores)
	assert.EqualValues(t, 70, tl.Floor, "the highest number known stays, so that none is given again")
	require.NoError(t, s.SetRunning("job", tiers.Running{Incarnation: "i2"}))
	require.NoError(t, s.SetShapeRestored("job", "i2", shape, 71, 1))
	assert.EqualValues(t, 71, s.Timeline("job").Generation)
	// A record that must be written again after no room keeps the restores before it (the
	// failed write forgot them).
	tmp := filepath.Join(dir, "."+tiers.ShapeFile+".tmp")
	require.NoError(t, os.Mkdir(tmp, 0o700)) // the write fails, as in a full spool
	require.Error(t, s.SetShapeRestored("job", "i2", shape, 72, 2))
	assert.Equal(t, tiers.Timeline{Floor: 72}, s.Timeline("job"), "no timeline trusted without its record, but the numbers known are still told")
	os.Remove(tmp) // the failed write's cleaning removed the empty directory already
	require.NoError(t, s.SetShapeRestored("job", "i2", shape, 72, 2))
	assert.Equal(t, map[int64]int64{71: 1, 72: 2}, s.Timeline("job").Restores)
	require.NoError(t, s.SetShapeRestored("job", "i2", shape, 0, 1), "a coordinator that numbers no restore")
	assert.Equal(t, tiers.Timeline{Floor: 72}, s.Timeline("job"))
	require.NoError(t, s.Detach())
	s = open()
	assert.Equal(t, tiers.Timeline{Floor: 72}, s.Timeline("job"), "the floor is kept across a reopen")
	assert.Equal(t, shape, s.SavedShape())
	require.ErrorContains(t, s.SetShapeRestored("other", "i3", shape, 4, 1), "serves another job", "a superseded restore of another job")
	require.NoError(t, s.Detach())
}

// TestStepsLostWithANewNodesRAMAreTold: the job restores from RAM a step older than steps the
// other nodes hold, while one node's RAM is new (a replaced machine): the steps above were lost
// with its RAM, and the job is told, where it went back two committed steps without a word
// (found by a black-box run). Over a save cut short by a crash (every node's RAM known), the
// restore says nothing, as before.
func TestStepsLostWithANewNodesRAMAreTold(t *testing.T) {
	t.Parallel()
	cfg := planConfig(3, 1)
	invs := func(fresh bool) []tiers.Inventory {
		tl := tiers.Timeline{Generation: 1, Restores: map[int64]int64{1: -1}}
		out := []tiers.Inventory{
			{Rank: 0, Metas: map[string]string{metaOf(1, 0, 0): hx(100), metaOf(1, 2, 0): hx(120)}, Data: []string{hx(100), hx(120)}, Timeline: tl},
			{Rank: 1, Metas: map[string]string{metaOf(1, 0, 0): hx(100), metaOf(1, 1, 0): hx(110)}, Data: []string{hx(100), hx(110)}, Timeline: tl},
			{Rank: 2, Metas: map[string]string{metaOf(1, 1, 0): hx(110), metaOf(1, 2, 0): hx(120)}, Data: []string{hx(110), hx(120)}, Timeline: tl},
		}
		for step := int64(2); step <= 3; step++ {
			for r := 1; r <= 2; r++ {
				out[r].Metas[metaOf(step, r, 0)] = hx(100*int(step) + 10*r)
				out[r].Data = append(out[r].Data, hx(100*int(step)+10*r))
			}
		}
		if fresh {
			out[0] = tiers.Inventory{Rank: 0, Metas: map[string]string{}}
		}
		return out
	}
	plan, err := tiers.PlanRestore(context.Background(), cfg, invs(true), nil, tiers.PlanLimits{})
	require.NoError(t, err)
	assert.EqualValues(t, 1, plan.Step)
	require.Len(t, plan.Errors, 3, "%q", plan.Errors)
	assert.Contains(t, plan.Errors[0], "step 3 in the nodes' RAM is incomplete and is not restored: no live node holds a .meta of rank 0 worker 0")
	assert.Contains(t, plan.Errors[0], "; the RAM of rank 0 is new (a replaced machine, or its spool lost)")
	assert.Contains(t, plan.Errors[1], "step 2 in the nodes' RAM is incomplete")
	assert.Equal(t, "2 incomplete steps in RAM; restoring step 1 from the nodes' RAM instead", plan.Errors[2])

	plan, err = tiers.PlanRestore(context.Background(), cfg, invs(false), nil, tiers.PlanLimits{})
	require.NoError(t, err)
	assert.EqualValues(t, 1, plan.Step)
	assert.Empty(t, plan.Errors, "a save cut short by a crash says nothing")
}

// TestTwoSavesOfAStepAcrossTimelinesAreNotCombined: when the nodes did not all take part in the
// same restores (one of an earlier release, whose timeline is unknown), two saves of a slot's
// step cannot be told apart: the step is passed over with a line, never restored from two
// timelines (found by a black-box run: the node of the earlier release came back with its own
// save of step 3 beside the replica of the job's newer one). With the same timeline on every
// node, the slot's own save wins, as before (a step saved again).
func TestTwoSavesOfAStepAcrossTimelinesAreNotCombined(t *testing.T) {
	t.Parallel()
	cfg := planConfig(3, 1)
	invs := timelineInvs()
	invs[0].Timeline = tiers.Timeline{} // rank 0's agent kept no timeline
	plan, err := tiers.PlanRestore(context.Background(), cfg, invs, nil, tiers.PlanLimits{})
	require.NoError(t, err)
	assert.EqualValues(t, 1, plan.Step, "neither save of steps 2–3 of rank 0 is taken")
	require.Len(t, plan.Errors, 3, "%q", plan.Errors)
	assert.Equal(t, "step 3 in the nodes' RAM is not restored: it holds two saves of rank 0 worker 0 (rank 0 and rank 1 hold different saves of it), and the nodes did not all take part in the same restores (one away while the job went back, or of an earlier release): which is newer cannot be told", plan.Errors[0])
	assert.Contains(t, plan.Errors[1], "step 2 in the nodes' RAM is not restored: it holds two saves of rank 0 worker 0")
	assert.Equal(t, "2 steps in RAM holding two saves of a slot; restoring step 1 from the nodes' RAM instead", plan.Errors[2], "complete steps, not incomplete ones")

	for i := range invs {
		invs[i].Timeline = tiers.Timeline{Generation: 2}
	}
	plan, err = tiers.PlanRestore(context.Background(), cfg, invs, nil, tiers.PlanLimits{})
	require.NoError(t, err)
	assert.EqualValues(t, 3, plan.Step)
	assert.Equal(t, hx(103), plan.Data[tiers.Slot{}], "the same timeline everywhere: the slot's own save")
	assert.Empty(t, plan.Errors)
}

// TestRestoresAreNumberedAboveEveryFloor: a restore is numbered above the highest generation any
// node knew of, also when no node trusts its timeline any more (Timeline.Floor). Before, nodes
// whose numbers were all cleared numbered the next restore 1 again; a node away at generation 5
// then made them look stale, and their newer steps were cut (a review).
func TestRestoresAreNumberedAboveEveryFloor(t *testing.T) {
	t.Parallel()
	cfg := planConfig(2, 1)
	_, gen, above, _ := tiers.CutStaleTimelines(cfg, []tiers.Inventory{
		{Rank: 0, Metas: map[string]string{}, Timeline: tiers.Timeline{Floor: 5}},
		{Rank: 1, Metas: map[string]string{}, Timeline: tiers.Timeline{Floor: 4}},
	})
	assert.EqualValues(t, 6, gen, "numbered above the floors")
	assert.Empty(t, above)

	// The restore so numbered, 6, restored step 20; node A, away since generation 5, comes back
	// with a step 25 of the timeline the job left.
	hold := func(inv *tiers.Inventory, step int64, slot, hash int) {
		inv.Metas[metaOf(step, slot, 0)] = hx(hash)
		inv.Data = append(inv.Data, hx(hash))
	}
	a := tiers.Inventory{Rank: 0, Metas: map[string]string{}, Timeline: tiers.Timeline{Generation: 5, Restores: map[int64]int64{5: 10}, Floor: 5}}
	b := tiers.Inventory{Rank: 1, Metas: map[string]string{}, Timeline: tiers.Timeline{Generation: 6, Restores: map[int64]int64{6: 20}, Floor: 6}}
	hold(&a, 20, 0, 1020)
	hold(&a, 20, 1, 2020)
	hold(&a, 25, 0, 1025)
	for s := int64(29); s <= 30; s++ {
		hold(&b, s, 1, 2000+int(s))
		hold(&b, s, 0, 1500+int(s)) // the replica of A's replacement's save
	}
	cut, gen, above, lines := tiers.CutStaleTimelines(cfg, []tiers.Inventory{a, b})
	assert.EqualValues(t, 7, gen)
	assert.Equal(t, map[int]int64{0: 20}, above, "A missed restore 6, which restored step 20")
	require.Len(t, lines, 1)
	assert.Contains(t, lines[0], "the RAM of rank 0 holds step(s) 25 of a timeline the job left")
	plan, err := tiers.PlanRestore(context.Background(), cfg, cut, nil, tiers.PlanLimits{})
	require.NoError(t, err)
	assert.EqualValues(t, 30, plan.Step, "B's steps, of the timeline the job is on, are not cut")
}

// TestNewNodeDoesNotMakeAStepSavedAgainPassOver: a node holding nothing of the job (a new
// machine, no timeline) beside nodes of one timeline does not make a step its slot saved again
// (a peer still holding the replica of the first save) pass over: the slot's own save wins, as
// with one timeline everywhere. Before, the new node's unknown timeline made the step pass over,
// and an older one was restored (a review).
func TestNewNodeDoesNotMakeAStepSavedAgainPassOver(t *testing.T) {
	t.Parallel()
	cfg := planConfig(3, 1)
	tl := tiers.Timeline{Generation: 4, Restores: map[int64]int64{4: 10}}
	own0 := tiers.Inventory{Rank: 0, Timeline: tl, Metas: map[string]string{metaOf(40, 0, 0): hx(2), metaOf(40, 1, 0): hx(11), metaOf(30, 0, 0): hx(30), metaOf(30, 1, 0): hx(31)},
		Data: []string{hx(2), hx(11), hx(30), hx(31)}}
	own1 := tiers.Inventory{Rank: 1, Timeline: tl, Metas: map[string]string{metaOf(40, 1, 0): hx(12), metaOf(40, 0, 0): hx(1), metaOf(40, 2, 0): hx(42), metaOf(30, 1, 0): hx(31), metaOf(30, 2, 0): hx(32), metaOf(30, 0, 0): hx(30)},
		Data: []string{hx(12), hx(1), hx(42), hx(31), hx(32), hx(30)}}
	for _, third := range []tiers.Inventory{{Rank: 2, Timeline: tl, Metas: map[string]string{}}, {Rank: 2, Metas: map[string]string{}}} {
		plan, err := tiers.PlanRestore(context.Background(), cfg, []tiers.Inventory{own0, own1, third}, nil, tiers.PlanLimits{})
		require.NoError(t, err)
		assert.EqualValues(t, 40, plan.Step, "third node's generation %d", third.Timeline.Generation)
	}
	// A third node holding a save of the job, of an unknown timeline, still makes it pass over.
	other := tiers.Inventory{Rank: 2, Metas: map[string]string{metaOf(40, 0, 0): hx(3)}, Data: []string{hx(3)}}
	plan, err := tiers.PlanRestore(context.Background(), cfg, []tiers.Inventory{own0, own1, other}, nil, tiers.PlanLimits{})
	require.NoError(t, err)
	assert.EqualValues(t, 30, plan.Step)
}
