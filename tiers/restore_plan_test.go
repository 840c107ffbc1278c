package tiers_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/tiers"
)

// planConfig is a job of nodes × workers; PlanRestore reads only the job name and the sizes.
func planConfig(nodes, workers int) *tiers.Config {
	return &tiers.Config{JobName: "job", Framework: tiers.FrameworkOrbax, Nodes: nodes, WorkersPerNode: workers,
		PeersPerNode: 1, BackupIntervalSteps: 1}
}

// hx is a distinct directory hash for each n.
func hx(n int) string { return fmt.Sprintf("D%064x", n) }

// metaOf names job's .meta of step for rank n, worker w.
func metaOf(step int64, n, w int) string { return marker("job", step, n, w, layout.MarkerMeta) }

// slots maps "n<R>-w<W>" (as Slot.String prints) to hashes, for readable tables.
func slots(kv ...any) map[tiers.Slot]string {
	out := map[tiers.Slot]string{}
	for i := 0; i+1 < len(kv); i += 2 {
		var s tiers.Slot
		if _, err := fmt.Sscanf(kv[i].(string), "n%d-w%d", &s.Rank, &s.Worker); err != nil {
			panic(err)
		}
		out[s] = kv[i+1].(string)
	}
	return out
}

// oneNodeInv is rank 0 holding, for each step, a .meta naming hx(step) and its data.
func oneNodeInv(steps ...int64) tiers.Inventory {
	inv := tiers.Inventory{Rank: 0, Metas: map[string]string{}}
	for _, s := range steps {
		inv.Metas[metaOf(s, 0, 0)] = hx(int(s))
		inv.Data = append(inv.Data, hx(int(s)))
	}
	return inv
}

func TestPlanRestore(t *testing.T) {
	t.Parallel()
	const b1, b2, b3 = "2030-01-01_00-01", "2030-01-01_00-02", "2030-01-01_00-03"
	// threeNodes: step 5 complete across three inventories, each slot's data held by some
	// node; rank 1's data is held twice (by itself and by its peer, rank 0).
	threeNodes := func() []tiers.Inventory {
		return []tiers.Inventory{
			{Rank: 0, Metas: map[string]string{metaOf(5, 0, 0): hx(50), metaOf(5, 1, 0): hx(51)}, Data: []string{hx(50), hx(51)}},
			{Rank: 1, Metas: map[string]string{metaOf(5, 1, 0): hx(51), metaOf(5, 2, 0): hx(52)}, Data: []string{hx(51)}},
			{Rank: 2, Metas: map[string]string{}, Data: []string{hx(52)}},
		}
	}
	with := func(invs []tiers.Inventory, rank int, metas map[string]string, data ...string) []tiers.Inventory {
		maps.Copy(invs[rank].Metas, metas)
		invs[rank].Data = append(invs[rank].Data, data...)
		return invs
	}
	tests := []struct {
		name    string
		nodes   int
		workers int
		invs    []tiers.Inventory
		store   func(t *testing.T, s *testStore) // nil: no backup tier
		want    tiers.RestorePlan                // Holders are checked separately
		errText string                           // the one line of Errors must contain it
		errMore string                           // and this too
	}{
		{
			name: "highest step of one node", nodes: 1, workers: 1,
			invs: []tiers.Inventory{oneNodeInv(1, 3, 2)},
			want: tiers.RestorePlan{Step: 3, Found: true, Data: slots("n0-w0", hx(3))},
		},
		{
			name: "slots spread across inventories", nodes: 3, workers: 1,
			invs: threeNodes(),
			want: tiers.RestorePlan{Step: 5, Found: true, Data: slots("n0-w0", hx(50), "n1-w0", hx(51), "n2-w0", hx(52))},
		},
		{
			name: "a step missing one slot's meta is skipped", nodes: 3, workers: 1,
			invs: with(threeNodes(), 0, map[string]string{metaOf(6, 0, 0): hx(60), metaOf(6, 1, 0): hx(61)}, hx(60), hx(61)),
			want: tiers.RestorePlan{Step: 5, Found: true, Data: slots("n0-w0", hx(50), "n1-w0", hx(51), "n2-w0", hx(52))},
		},
		{
			name: "a meta whose data nobody holds is skipped", nodes: 3, workers: 1,
			invs: with(with(threeNodes(), 0, map[string]string{metaOf(6, 0, 0): hx(60), metaOf(6, 1, 0): hx(61)}, hx(60), hx(61)),
				1, map[string]string{metaOf(6, 2, 0): hx(62)}), // nobody holds hx(62)
			want: tiers.RestorePlan{Step: 5, Found: true, Data: slots("n0-w0", hx(50), "n1-w0", hx(51), "n2-w0", hx(52))},
		},
		{
			name: "other jobs and slots outside the job below the restored step do not count", nodes: 1, workers: 1,
			invs: []tiers.Inventory{{Rank: 0, Metas: map[string]string{
				metaOf(2, 0, 0):       hx(2),
				"other-s9-n0-w0.meta": hx(9),
				metaOf(1, 1, 0):       hx(9), // rank 1 of a larger earlier job (TestPlanRestorePassesOverAnotherShape)
				metaOf(1, 0, 1):       hx(9), // worker 1 of an earlier job
			}, Data: []string{hx(2), hx(9)}}},
			want: tiers.RestorePlan{Step: 2, Found: true, Data: slots("n0-w0", hx(2))},
		},
		{
			name: "workers-per-node 2: every worker of every node", nodes: 2, workers: 2,
			invs: []tiers.Inventory{
				{Rank: 0, Metas: map[string]string{
					metaOf(4, 0, 0): hx(400), metaOf(4, 0, 1): hx(401), metaOf(4, 1, 0): hx(410), metaOf(4, 1, 1): hx(411),
					metaOf(5, 0, 0): hx(500), metaOf(5, 0, 1): hx(501), metaOf(5, 1, 0): hx(510),
				}, Data: []string{hx(400), hx(401), hx(500), hx(501)}},
				{Rank: 1, Metas: map[string]string{}, Data: []string{hx(410), hx(411), hx(510)}},
			},
			want: tiers.RestorePlan{Step: 4, Found: true, Data: slots("n0-w0", hx(400), "n0-w1", hx(401), "n1-w0", hx(410), "n1-w1", hx(411))},
		},
		{
			name: "nothing in RAM and no backup tier", nodes: 1, workers: 1,
			invs: []tiers.Inventory{{Rank: 0}},
			want: tiers.RestorePlan{},
		},
		{
			name: "nothing in RAM and no backups", nodes: 1, workers: 1,
			invs:  []tiers.Inventory{{Rank: 0}},
			store: func(t *testing.T, s *testStore) {},
			want:  tiers.RestorePlan{},
		},
		{
			name: "nothing in RAM: the newest complete backup", nodes: 2, workers: 1,
			invs: []tiers.Inventory{{Rank: 0}, {Rank: 1}},
			store: func(t *testing.T, s *testStore) {
				s.addBackup(t, "job", b1, 3, slots("n0-w0", hx(30), "n1-w0", hx(31)))
				s.addBackup(t, "job", b2, 4, slots("n0-w0", hx(40), "n1-w0", hx(41)))
			},
			want: tiers.RestorePlan{Step: 4, Found: true, Backup: b2, Data: slots("n0-w0", hx(40), "n1-w0", hx(41))},
		},
		{
			name: "within a backup, its highest complete step", nodes: 1, workers: 1,
			invs: []tiers.Inventory{{Rank: 0}},
			store: func(t *testing.T, s *testStore) {
				s.addBackup(t, "job", b1, 3, slots("n0-w0", hx(30)))
				s.addBackup(t, "job", b1, 7, slots("n0-w0", hx(70)))
				s.addBackup(t, "job", b1, 5, slots("n0-w0", hx(50)))
			},
			want: tiers.RestorePlan{Step: 7, Found: true, Backup: b1, Data: slots("n0-w0", hx(70))},
		},
		{
			name: "RAM wins over a newer backup", nodes: 1, workers: 1,
			invs: []tiers.Inventory{oneNodeInv(2)},
			store: func(t *testing.T, s *testStore) {
				s.addBackup(t, "job", b1, 9, slots("n0-w0", hx(90)))
			},
			want: tiers.RestorePlan{Step: 2, Found: true, Data: slots("n0-w0", hx(2))},
		},
		{
			name: "pinned backup wins over RAM and newer backups", nodes: 1, workers: 1,
			invs: []tiers.Inventory{oneNodeInv(8)},
			store: func(t *testing.T, s *testStore) {
				s.addBackup(t, "job", b1, 3, slots("n0-w0", hx(30)))
				s.addBackup(t, "job", b2, 4, slots("n0-w0", hx(40)))
				s.setPin(t, "job", " "+b1+"\n")
			},
			want: tiers.RestorePlan{Step: 3, Found: true, Backup: b1, Pinned: b1, Data: slots("n0-w0", hx(30))},
		},
		{
			name: "pinned backup missing: start from scratch", nodes: 1, workers: 1,
			invs: []tiers.Inventory{oneNodeInv(8)},
			store: func(t *testing.T, s *testStore) {
				s.addBackup(t, "job", b1, 3, slots("n0-w0", hx(30)))
				s.setPin(t, "job", "1999-01-01_00-00")
			},
			want:    tiers.RestorePlan{Pinned: "1999-01-01_00-00"},
			errText: `"1999-01-01_00-00", which does not exist in file://`,
			errMore: `: starting from scratch (the job's steps in the nodes' RAM are dropped`,
		},
		{
			name: "pinned backup incomplete: start from scratch", nodes: 2, workers: 1,
			invs: []tiers.Inventory{{Rank: 0}, {Rank: 1}},
			store: func(t *testing.T, s *testStore) {
				s.addBackup(t, "job", b1, 3, slots("n0-w0", hx(30), "n1-w0", hx(31)))
				s.addBackup(t, "job", b2, 4, slots("n0-w0", hx(40)))
				s.setPin(t, "job", b2)
			},
			want:    tiers.RestorePlan{Pinned: b2},
			errText: `"` + b2 + `", which is incomplete: starting from scratch (the job's steps in the nodes' RAM are dropped`,
			errMore: `or clear the pin)`,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var store tiers.BackupStore
			if tc.store != nil {
				fs := newTestStore(t)
				tc.store(t, fs)
				store = fs
			}
			got, err := tiers.PlanRestore(t.Context(), planConfig(tc.nodes, tc.workers), tc.invs, store, tiers.PlanLimits{})
			if err != nil {
				t.Fatalf("PlanRestore: %v", err)
			}
			if got.Step != tc.want.Step || got.Found != tc.want.Found || got.Backup != tc.want.Backup || got.Pinned != tc.want.Pinned {
				t.Errorf("plan step %d found %v backup %q pinned %q, want step %d found %v backup %q pinned %q",
					got.Step, got.Found, got.Backup, got.Pinned, tc.want.Step, tc.want.Found, tc.want.Backup, tc.want.Pinned)
			}
			if len(got.Data) != 0 || len(tc.want.Data) != 0 {
				if !reflect.DeepEqual(got.Data, tc.want.Data) {
					t.Errorf("plan data %v, want %v", got.Data, tc.want.Data)
				}
			}
			switch {
			case tc.errText == "" && len(got.Errors) != 0:
				t.Errorf("plan errors %q, want none", got.Errors)
			case tc.errText != "" && (len(got.Errors) != 1 || !strings.Contains(got.Errors[0], tc.errText) || !strings.Contains(got.Errors[0], tc.errMore)):
				t.Errorf("plan errors %q, want one containing %q and %q", got.Errors, tc.errText, tc.errMore)
			}
			// Holders: every hash some inventory holds, with its ranks sorted.
			want := map[string][]int{}
			for _, inv := range tc.invs {
				for _, h := range inv.Data {
					want[h] = append(want[h], inv.Rank)
				}
			}
			if !reflect.DeepEqual(got.Holders, want) {
				t.Errorf("plan holders %v, want %v", got.Holders, want)
			}
		})
	}
}

func TestPlanRestoreHoldersOfReplicatedData(t *testing.T) {
	t.Parallel()
	// Rank 1's data is held by rank 2 (a replica) and by itself; the list is sorted.
	invs := []tiers.Inventory{
		{Rank: 2, Metas: map[string]string{metaOf(1, 1, 0): hx(11)}, Data: []string{hx(11)}},
		{Rank: 1, Metas: map[string]string{metaOf(1, 1, 0): hx(11)}, Data: []string{hx(11)}},
		{Rank: 0, Metas: map[string]string{metaOf(1, 0, 0): hx(10), metaOf(1, 2, 0): hx(12)}, Data: []string{hx(10), hx(12)}},
	}
	got, err := tiers.PlanRestore(t.Context(), planConfig(3, 1), invs, nil, tiers.PlanLimits{})
	if err != nil || !got.Found || got.Step != 1 {
		t.Fatalf("PlanRestore = %+v, %v; want step 1", got, err)
	}
	if h := got.Holders[hx(11)]; !reflect.DeepEqual(h, []int{1, 2}) {
		t.Errorf("holders of rank 1's data = %v, want [1 2]", h)
	}
}

// When nodes disagree on a slot's .meta of a step (the step was saved again and a peer still
// holds the replica of the earlier save), the slot's own node's .meta wins, whatever the order
// the inventories arrive in.
func TestPlanRestorePrefersTheOwnersMeta(t *testing.T) {
	cfg := planConfig(2, 1)
	own0 := tiers.Inventory{Rank: 0, Metas: map[string]string{metaOf(40, 0, 0): hx(2), metaOf(40, 1, 0): hx(11)}, Data: []string{hx(2), hx(11)}}
	own1 := tiers.Inventory{Rank: 1, Metas: map[string]string{metaOf(40, 1, 0): hx(12), metaOf(40, 0, 0): hx(1)}, Data: []string{hx(12), hx(1)}}
	for _, invs := range [][]tiers.Inventory{{own0, own1}, {own1, own0}} {
		plan, err := tiers.PlanRestore(t.Context(), cfg, invs, nil, tiers.PlanLimits{})
		if err != nil {
			t.Fatal(err)
		}
		if want := slots("n0-w0", hx(2), "n1-w0", hx(12)); !plan.Found || plan.Step != 40 || !maps.Equal(plan.Data, want) {
			t.Errorf("plan %+v, want step 40 with each node's own data %v", plan, want)
		}
	}
}

// TestPlanRestoreReportsDamagedBackups: a backup step whose upload finished (its .meta is there)
// but whose data was lost since is never restored, and the restore says so in the lines every
// node writes to replicator.errors, with what it restores instead (SPEC §10: never a silent fresh
// start). An interrupted upload (a .meta missing) is not damage, and neither is a damaged step
// below the one restored.
func TestPlanRestoreReportsDamagedBackups(t *testing.T) {
	t.Parallel()
	backup := func(i int) string { return fmt.Sprintf("2030-01-01_00-%02d", i) }
	// damage removes the only data object of hash in the backup (not its manifest), as a
	// lifecycle rule or a hand-run `gcloud storage rm` would.
	damage := func(t *testing.T, s *testStore, name, hash string) {
		t.Helper()
		s.deleteObject(t, "job", name, hash+".data/placeholder")
	}
	tests := []struct {
		name   string
		nodes  int
		store  func(t *testing.T, s *testStore)
		found  bool
		step   int64
		from   string
		errors []string // each line must contain its entry, in order; nil: no line at all
	}{
		{
			name: "newest damaged, older intact", nodes: 1,
			store: func(t *testing.T, s *testStore) {
				s.addBackup(t, "job", backup(1), 3, slots("n0-w0", hx(30)))
				s.addBackup(t, "job", backup(2), 4, slots("n0-w0", hx(40)))
				damage(t, s, backup(2), hx(40))
			},
			found: true, step: 3, from: backup(1),
			errors: []string{
				"backup " + backup(2) + ": step 4 is damaged and is not restored: " + hx(40) + ".data: " + hx(40) + ".data/placeholder missing; see: mtcfs backups verify " + backup(2) + " --backup file://",
				"1 damaged backup step; restoring step 3 from backup " + backup(1) + " instead",
			},
		},
		{
			name: "the only backup damaged", nodes: 2,
			store: func(t *testing.T, s *testStore) {
				s.addBackup(t, "job", backup(1), 3, slots("n0-w0", hx(30), "n1-w0", hx(31)))
				damage(t, s, backup(1), hx(31))
			},
			errors: []string{
				"backup " + backup(1) + ": step 3 is damaged",
				"1 damaged backup step and no intact checkpoint is left: starting from scratch",
			},
		},
		{
			name: "damaged step below the restored one", nodes: 1,
			store: func(t *testing.T, s *testStore) {
				s.addBackup(t, "job", backup(1), 3, slots("n0-w0", hx(30)))
				s.addBackup(t, "job", backup(1), 5, slots("n0-w0", hx(50)))
				damage(t, s, backup(1), hx(30))
			},
			found: true, step: 5, from: backup(1),
		},
		{
			// Not damage, and not passed over in silence either: the job loses the step it was of.
			name: "interrupted uploads are not damage", nodes: 2,
			store: func(t *testing.T, s *testStore) {
				s.addBackup(t, "job", backup(1), 3, slots("n0-w0", hx(30), "n1-w0", hx(31)))
				s.addBackup(t, "job", backup(2), 4, slots("n0-w0", hx(40))) // rank 1 never finished
				s.addBackup(t, "job", backup(3), 5, slots("n0-w0", hx(50))) // nor in this one
			},
			found: true, step: 3, from: backup(1),
			errors: []string{
				"backup " + backup(3) + " holds no complete step (an upload cut short, or one still running): it is not restored",
				"backup " + backup(2) + " holds no complete step",
				"2 incomplete backups; restoring step 3 from backup " + backup(1) + " instead",
			},
		},
		{
			name: "many damaged backups", nodes: 1,
			store: func(t *testing.T, s *testStore) {
				for i := 1; i <= 7; i++ {
					s.addBackup(t, "job", backup(i), int64(i), slots("n0-w0", hx(i)))
					damage(t, s, backup(i), hx(i))
				}
			},
			errors: []string{
				"backup " + backup(7) + ": step 7 is damaged", "backup " + backup(6) + ": step 6",
				"backup " + backup(5) + ": step 5", "backup " + backup(4) + ": step 4", "backup " + backup(3) + ": step 3",
				"7 damaged backup steps (the first 5 above) and no intact checkpoint is left: starting from scratch",
			},
		},
		{
			name: "pinned backup with a damaged step above its intact one", nodes: 1,
			store: func(t *testing.T, s *testStore) {
				s.addBackup(t, "job", backup(1), 3, slots("n0-w0", hx(30)))
				s.addBackup(t, "job", backup(1), 5, slots("n0-w0", hx(50)))
				damage(t, s, backup(1), hx(50))
				s.setPin(t, "job", backup(1))
			},
			found: true, step: 3, from: backup(1),
			errors: []string{
				"backup " + backup(1) + ": step 5 is damaged",
				"1 damaged backup step in the pinned backup; restoring its step 3",
			},
		},
		{
			name: "pinned backup damaged", nodes: 1,
			store: func(t *testing.T, s *testStore) {
				s.addBackup(t, "job", backup(1), 3, slots("n0-w0", hx(30)))
				s.addBackup(t, "job", backup(2), 4, slots("n0-w0", hx(40)))
				damage(t, s, backup(1), hx(30))
				s.setPin(t, "job", backup(1))
			},
			errors: []string{
				"backup " + backup(1) + ": step 3 is damaged",
				`restore.version names backup "` + backup(1) + `", which has no intact step: starting from scratch`,
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := newTestStore(t)
			tc.store(t, s)
			invs := make([]tiers.Inventory, tc.nodes)
			for r := range invs {
				invs[r].Rank = r
			}
			got, err := tiers.PlanRestore(t.Context(), planConfig(tc.nodes, 1), invs, s, tiers.PlanLimits{})
			if err != nil {
				t.Fatalf("PlanRestore: %v", err)
			}
			checkPlan(t, got, tc.found, tc.step, tc.from, tc.errors)
		})
	}
}

// checkPlan checks a plan's outcome and its replicator.errors lines: each must contain its
// entry of errors, in order (nil: no line at all).
func checkPlan(t *testing.T, got tiers.RestorePlan, found bool, step int64, from string, errors []string) {
	t.Helper()
	if got.Found != found || got.Step != step || got.Backup != from {
		t.Errorf("plan found %v step %d backup %q, want found %v step %d backup %q", got.Found, got.Step, got.Backup, found, step, from)
	}
	if len(got.Errors) != len(errors) {
		t.Fatalf("plan errors:\n%s\nwant %d lines", strings.Join(got.Errors, "\n"), len(errors))
	}
	for i, want := range errors {
		if !strings.Contains(got.Errors[i], want) {
			t.Errorf("plan error %d:\n%s\nwant it to contain\n%s", i, got.Errors[i], want)
		}
	}
}

// TestPlanRestorePassesOverAnotherShape: a job restarted with another number of nodes or
// workers per node (or, in data-parallel mode, of partitions) cannot use the checkpoints of its
// former shape: one node's data is never split or merged across nodes. Before, the plan took
// the slots that fit (a 2-node job restored ranks 0 and 1 of a 3-node checkpoint) and said
// nothing. Now each such checkpoint above the one restored is passed over with a line, in RAM
// and in backups; a data-parallel job may do without replicas of its partitions.
func TestPlanRestorePassesOverAnotherShape(t *testing.T) {
	t.Parallel()
	backup := func(i int) string { return fmt.Sprintf("2030-01-01_00-%02d", i) }
	shape := func(nodes, workers, d int) tiers.Shape {
		return tiers.Shape{Nodes: nodes, Workers: workers, DataParallelism: d}
	}
	// ram is the nodes' inventories: rank 0 holds every .meta and data of steps (rank r's
	// data of step s is hx(10*s+r)), over ranks 0..ranks-1.
	ram := func(nodes, ranks int, steps ...int64) []tiers.Inventory {
		invs := make([]tiers.Inventory, nodes)
		for r := range invs {
			invs[r] = tiers.Inventory{Rank: r, Metas: map[string]string{}}
		}
		for _, s := range steps {
			for r := range ranks {
				invs[0].Metas[metaOf(s, r, 0)] = hx(int(10*s) + r)
				invs[0].Data = append(invs[0].Data, hx(int(10*s)+r))
			}
		}
		return invs
	}
	// ranksOf is the slots of a backup of step s over ranks 0..ranks-1, data column-wise
	// (rank r names the data of rank r mod columns).
	ranksOf := func(s, ranks, columns int) map[tiers.Slot]string {
		m := map[tiers.Slot]string{}
		for r := range ranks {
			m[tiers.Slot{Rank: r}] = hx(10*s + r%columns)
		}
		return m
	}
	tests := []struct {
		name   string
		job    tiers.Shape
		invs   []tiers.Inventory // nil: every rank holds nothing
		store  func(t *testing.T, s *testStore)
		found  bool
		step   int64
		from   string
		errors []string              // each line must contain its entry, in order; nil: no line at all
		data   map[tiers.Slot]string // nil: not checked
	}{
		{
			name: "RAM: a 3-node step, the job now 2 nodes", job: shape(2, 1, 0),
			invs: ram(2, 3, 10),
			errors: []string{
				"step 10 in the nodes' RAM was saved by a job with a rank 2 worker 0; this job has 2 nodes × 1 worker: one node's checkpoint data is never split or merged",
				"1 checkpoint of a job of another shape and no intact checkpoint is left: starting from scratch",
			},
		},
		{
			name: "RAM: a 3-node step above a 2-node one", job: shape(2, 1, 0),
			invs: func() []tiers.Inventory {
				invs := ram(2, 3, 10)
				invs[0].Metas[metaOf(5, 0, 0)], invs[0].Metas[metaOf(5, 1, 0)] = hx(50), hx(51)
				invs[1].Data = append(invs[1].Data, hx(50), hx(51))
				return invs
			}(),
			found: true, step: 5,
			errors: []string{"step 10 in the nodes' RAM", "1 checkpoint of a job of another shape; restoring step 5 from the nodes' RAM instead"},
		},
		{
			name: "RAM: a 3-node step below the backup restored is not lost", job: shape(2, 1, 0),
			invs: ram(2, 3, 10),
			store: func(t *testing.T, s *testStore) {
				s.addShapedBackup(t, "job", backup(1), 20, shape(2, 1, 0), ranksOf(20, 2, 2))
			},
			found: true, step: 20, from: backup(1),
		},
		{
			name: "RAM: a 3-node step above the backup restored", job: shape(2, 1, 0),
			invs: ram(2, 3, 30),
			store: func(t *testing.T, s *testStore) {
				s.addShapedBackup(t, "job", backup(1), 20, shape(2, 1, 0), ranksOf(20, 2, 2))
			},
			found: true, step: 20, from: backup(1),
			errors: []string{"step 30 in the nodes' RAM", "1 checkpoint of a job of another shape; restoring step 20 from backup " + backup(1) + " instead"},
		},
		{
			name: "RAM: recorded data-parallel 4 nodes of 2 partitions, the job now 2 nodes", job: shape(2, 1, 0),
			invs: func() []tiers.Inventory {
				invs := ram(2, 4, 10) // rank 0 holds its column-mate's .meta (rank 2), and rank 3's
				invs[0].Shape, invs[1].Shape = shape(4, 1, 2), shape(4, 1, 2)
				return invs
			}(),
			found: true, step: 10,
		},
		{
			name: "RAM: the same without a record: the .meta names show 4 nodes", job: shape(2, 1, 0),
			invs:   ram(2, 4, 10),
			errors: []string{"step 10 in the nodes' RAM was saved by a job with a rank 3 worker 0", "starting from scratch"},
		},
		{
			name: "RAM: recorded 3 nodes", job: shape(2, 1, 0),
			invs: func() []tiers.Inventory {
				invs := ram(2, 2, 10) // no .meta past rank 1: only the record tells
				invs[0].Shape = shape(3, 1, 0)
				return invs
			}(),
			errors: []string{"step 10 in the nodes' RAM was saved by a job of 3 nodes × 1 worker (as rank 0's spool recorded it); this job has 2 nodes × 1 worker", "starting from scratch"},
		},
		{
			name: "RAM: data-parallel, fewer replicas", job: shape(2, 1, 2),
			invs:  ram(2, 4, 10),
			found: true, step: 10,
		},
		{
			name: "RAM: fewer workers per node", job: shape(1, 1, 0),
			invs: func() []tiers.Inventory {
				invs := ram(1, 1, 10)
				invs[0].Metas[metaOf(10, 0, 1)] = hx(7)
				return invs
			}(),
			errors: []string{"step 10 in the nodes' RAM was saved by a job with a rank 0 worker 1; this job has 1 node × 1 worker", "starting from scratch"},
		},
		{
			name: "backup: recorded 3 nodes above one of 2, the job now 2", job: shape(2, 1, 0),
			store: func(t *testing.T, s *testStore) {
				s.addShapedBackup(t, "job", backup(1), 3, shape(2, 1, 0), ranksOf(3, 2, 2))
				s.addShapedBackup(t, "job", backup(2), 4, shape(3, 1, 0), ranksOf(4, 3, 3))
			},
			found: true, step: 3, from: backup(1),
			errors: []string{
				"backup " + backup(2) + " was taken by a job of 3 nodes × 1 worker; this job has 2 nodes × 1 worker: one node's checkpoint data is never split or merged across nodes, so it is passed over (start the job with its former shape to restore it)",
				"1 checkpoint of a job of another shape; restoring step 3 from backup " + backup(1) + " instead",
			},
		},
		{
			name: "backup: recorded 2 nodes, the job grew to 3", job: shape(3, 1, 0),
			store: func(t *testing.T, s *testStore) {
				s.addShapedBackup(t, "job", backup(1), 3, shape(2, 1, 0), ranksOf(3, 2, 2))
			},
			errors: []string{"backup " + backup(1) + " was taken by a job of 2 nodes × 1 worker; this job has 3 nodes × 1 worker", "starting from scratch"},
		},
		{
			name: "backup: unrecorded, its .meta names show 3 nodes", job: shape(2, 1, 0),
			store: func(t *testing.T, s *testStore) {
				s.addBackup(t, "job", backup(1), 3, ranksOf(3, 3, 3))
			},
			errors: []string{"backup " + backup(1) + " was taken by a job of at least 3 nodes × 1 worker (its .meta names); this job has 2 nodes × 1 worker", "starting from scratch"},
		},
		{
			name: "backup: unrecorded, fewer ranks than the job is incomplete, as before", job: shape(3, 1, 0),
			store: func(t *testing.T, s *testStore) {
				s.addBackup(t, "job", backup(1), 3, ranksOf(3, 2, 2))
			},
			errors: []string{"backup " + backup(1) + " holds no complete step", "1 incomplete backup and no intact checkpoint is left: starting from scratch"},
		},
		{
			name: "backup: data-parallel 4 nodes of 2 partitions, the job now 2 nodes", job: shape(2, 1, 0),
			store: func(t *testing.T, s *testStore) {
				s.addShapedBackup(t, "job", backup(1), 3, shape(4, 1, 2), ranksOf(3, 4, 2))
			},
			found: true, step: 3, from: backup(1),
		},
		{
			// Found by a black-box run: it was "incomplete" (and, pinned, a fresh start).
			name: "backup: 2 nodes of 2 partitions, the job now data-parallel 4 nodes of 2 partitions", job: shape(4, 1, 2),
			store: func(t *testing.T, s *testStore) {
				s.addShapedBackup(t, "job", backup(1), 3, shape(2, 1, 1), ranksOf(3, 2, 2))
				s.addShapedBackup(t, "job", backup(0), 2, shape(2, 1, 1), ranksOf(2, 2, 2))
			},
			found: true, step: 3, from: backup(1),
			data: map[tiers.Slot]string{{Rank: 0}: hx(30), {Rank: 1}: hx(31), {Rank: 2}: hx(30), {Rank: 3}: hx(31)},
		},
		{
			name: "backup: data-parallel, partitions differ", job: shape(2, 1, 2),
			store: func(t *testing.T, s *testStore) {
				s.addShapedBackup(t, "job", backup(1), 3, shape(4, 1, 2), ranksOf(3, 4, 2))
			},
			errors: []string{"was taken by a job of 4 nodes × 1 worker, data-parallelism 2; this job has 2 nodes × 1 worker, data-parallelism 2", "starting from scratch"},
		},
		{
			name: "backup: recorded before data-parallelism was, same nodes", job: shape(4, 1, 2),
			store: func(t *testing.T, s *testStore) {
				s.addBackup(t, "job", backup(1), 3, ranksOf(3, 4, 2))
				s.putLegacyShape(t, "job", backup(1), 4, 1)
			},
			found: true, step: 3, from: backup(1),
		},
		{
			name: "backup: recorded before data-parallelism was, other nodes", job: shape(2, 1, 1),
			store: func(t *testing.T, s *testStore) {
				s.addBackup(t, "job", backup(1), 3, ranksOf(3, 4, 2))
				s.putLegacyShape(t, "job", backup(1), 4, 1)
			},
			errors: []string{"was taken by a job of 4 nodes × 1 worker; this job has 2 nodes × 1 worker, data-parallelism 1", "starting from scratch"},
		},
		{
			name: "backup: recorded workers differ", job: shape(1, 1, 0),
			store: func(t *testing.T, s *testStore) {
				s.addShapedBackup(t, "job", backup(1), 3, shape(1, 2, 0), map[tiers.Slot]string{{Rank: 0, Worker: 0}: hx(1), {Rank: 0, Worker: 1}: hx(2)})
			},
			errors: []string{"was taken by a job of 1 node × 2 workers; this job has 1 node × 1 worker", "starting from scratch"},
		},
		{
			name: "pinned backup of another shape", job: shape(2, 1, 0),
			store: func(t *testing.T, s *testStore) {
				s.addShapedBackup(t, "job", backup(1), 3, shape(2, 1, 0), ranksOf(3, 2, 2))
				s.addShapedBackup(t, "job", backup(2), 4, shape(3, 1, 0), ranksOf(4, 3, 3))
				s.setPin(t, "job", backup(2))
			},
			errors: []string{
				"backup " + backup(2) + " was taken by a job of 3 nodes × 1 worker",
				`restore.version names backup "` + backup(2) + `", of a job of another shape: starting from scratch`,
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cfg := planConfig(tc.job.Nodes, tc.job.Workers)
			cfg.AssumeDataParallelism = tc.job.DataParallelism
			invs := tc.invs
			if invs == nil {
				invs = ram(tc.job.Nodes, 0)
			}
			var store tiers.BackupStore
			if tc.store != nil {
				s := newTestStore(t)
				tc.store(t, s)
				store = s
			}
			got, err := tiers.PlanRestore(t.Context(), cfg, invs, store, tiers.PlanLimits{})
			if err != nil {
				t.Fatalf("PlanRestore: %v", err)
			}
			checkPlan(t, got, tc.found, tc.step, tc.from, tc.errors)
			if tc.data != nil && !reflect.DeepEqual(got.Data, tc.data) {
				t.Errorf("plan data %v, want %v", got.Data, tc.data)
			}
		})
	}
}

// TestPlanRestoreReportsIncompleteSteps: when no step in RAM can be restored, the steps the
// nodes hold are dropped (a fresh start, or an older backup, begins a new timeline); the job is
// told which and why, never in silence. A node lost before its restored step was replicated
// again left its peers with a step they could not complete: the job started from step 0 with no
// line anywhere. A step restored from RAM over an incomplete newer one (a save cut short) is
// routine and says nothing.
func TestPlanRestoreReportsIncompleteSteps(t *testing.T) {
	t.Parallel()
	const b1 = "2030-01-01_00-01"
	// ranks holds step s of the given ranks, each on its own node with its data.
	ranks := func(nodes int, s int64, rs ...int) []tiers.Inventory {
		invs := make([]tiers.Inventory, nodes)
		for r := range invs {
			invs[r] = tiers.Inventory{Rank: r, Metas: map[string]string{}}
		}
		for _, r := range rs {
			invs[r].Metas[metaOf(s, r, 0)] = hx(int(10*s) + r)
			invs[r].Data = append(invs[r].Data, hx(int(10*s)+r))
		}
		return invs
	}
	tests := []struct {
		name   string
		invs   []tiers.Inventory
		store  func(t *testing.T, s *testStore)
		found  bool
		step   int64
		from   string
		errors []string
	}{
		{
			name: "rank 0's RAM lost, no backup",
			invs: ranks(3, 10, 1, 2),
			errors: []string{
				"step 10 in the nodes' RAM is incomplete and is not restored: no live node holds a .meta of rank 0 worker 0 (a save cut short, a node whose RAM was lost before its replica was made, or a restore of the step that failed on that node after the others brought in their part)",
				"1 incomplete step in RAM and no intact checkpoint is left: starting from scratch",
			},
		},
		{
			name: "a .meta whose data no node holds",
			invs: func() []tiers.Inventory {
				invs := ranks(3, 10, 0, 1)
				invs[0].Metas[metaOf(10, 2, 0)] = hx(102) // a replica's .meta; the data is gone
				return invs
			}(),
			errors: []string{"step 10 in the nodes' RAM is incomplete and is not restored: no live node holds the data of rank 2 worker 0", "starting from scratch"},
		},
		{
			name:  "a save cut short above a complete step: routine, no line",
			invs:  nil, // routine, below
			found: true, step: 10,
		},
		{
			name: "incomplete in RAM, older backup restored",
			invs: ranks(2, 20, 1),
			store: func(t *testing.T, s *testStore) {
				s.addShapedBackup(t, "job", b1, 10, tiers.Shape{Nodes: 2, Workers: 1}, slots("n0-w0", hx(1), "n1-w0", hx(2)))
			},
			found: true, step: 10, from: b1,
			errors: []string{"step 20 in the nodes' RAM is incomplete", "1 incomplete step in RAM; restoring step 10 from backup " + b1 + " instead"},
		},
		{
			name: "incomplete in RAM, the same step restored from a backup: nothing lost, no line",
			invs: ranks(2, 10, 1),
			store: func(t *testing.T, s *testStore) {
				s.addShapedBackup(t, "job", b1, 10, tiers.Shape{Nodes: 2, Workers: 1}, slots("n0-w0", hx(1), "n1-w0", hx(2)))
			},
			found: true, step: 10, from: b1,
		},
		{
			name: "incomplete in RAM below the backup restored",
			invs: ranks(2, 5, 1),
			store: func(t *testing.T, s *testStore) {
				s.addShapedBackup(t, "job", b1, 10, tiers.Shape{Nodes: 2, Workers: 1}, slots("n0-w0", hx(1), "n1-w0", hx(2)))
			},
			found: true, step: 10, from: b1,
		},
	}
	// The routine case: step 20 of rank 0 only, step 10 of both.
	routine := ranks(2, 10, 0, 1)
	routine[0].Metas[metaOf(20, 0, 0)] = hx(200)
	routine[0].Data = append(routine[0].Data, hx(200))
	tests[2].invs = routine
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var store tiers.BackupStore
			if tc.store != nil {
				s := newTestStore(t)
				tc.store(t, s)
				store = s
			}
			got, err := tiers.PlanRestore(t.Context(), planConfig(len(tc.invs), 1), tc.invs, store, tiers.PlanLimits{})
			if err != nil {
				t.Fatalf("PlanRestore: %v", err)
			}
			checkPlan(t, got, tc.found, tc.step, tc.from, tc.errors)
		})
	}
}

// downStore is a backup location that is down: every read fails with err, or, with err nil,
// hangs until its context ends (a network that drops packets).
type downStore struct {
	*testStore
	err error
}

func (s downStore) fail(ctx context.Context) error {
	if s.err != nil {
		return s.err
	}
	<-ctx.Done()
	return fmt.Errorf("read: %w", ctx.Err())
}

func (s downStore) RestoreVersion(ctx context.Context, job string) (string, bool, error) {
	return "", false, s.fail(ctx)
}

func (s downStore) Backups(ctx context.Context, job string) ([]string, error) {
	return nil, s.fail(ctx)
}

func (s downStore) CompleteSteps(ctx context.Context, job, backup string, shape tiers.Shape) ([]tiers.BackupStep, []tiers.DamagedStep, error) {
	return nil, nil, s.fail(ctx)
}

// TestPlanRestoreWithTheBackupLocationDown: with the backup location failing or not answering,
// a complete step in the nodes' RAM is restored, said in a line, and restore.version counts as
// not in force (a pin there stays for the next restore); with nothing in RAM the plan fails, in
// bounded time, saying why. Before, a location that did not answer held every restore, from RAM
// too, for 8 attempts of 60 s: longer than the job waits for its markers.
func TestPlanRestoreWithTheBackupLocationDown(t *testing.T) {
	limits := tiers.PlanLimits{PinRead: 50 * time.Millisecond, Store: 200 * time.Millisecond}
	refused := errors.New("dial tcp 127.0.0.1:1: connect: connection refused")
	for _, tc := range []struct {
		name    string
		err     error // nil: no answer
		invs    []tiers.Inventory
		want    string // in the plan's one line, or in its error when nothing is in RAM
		wantErr bool
	}{
		{name: "refused, step in RAM", err: refused, invs: []tiers.Inventory{oneNodeInv(3, 4)},
			want: "restore.version in " + "%s could not be read (" + refused.Error() + "): a backup pinned there is not applied this time; restoring step 4 from the nodes' RAM"},
		{name: "no answer, step in RAM", invs: []tiers.Inventory{oneNodeInv(4)},
			want: "could not be read (no answer within 50ms (read: context deadline exceeded)): a backup pinned there is not applied this time; restoring step 4 from the nodes' RAM"},
		{name: "refused, nothing in RAM", err: refused, invs: []tiers.Inventory{{Rank: 0}},
			want: "read restore.version: " + refused.Error(), wantErr: true},
		{name: "no answer, nothing in RAM", invs: []tiers.Inventory{{Rank: 0}},
			want: "read restore.version: the backup location %s did not answer within 200ms: read: context deadline exceeded", wantErr: true},
		// Said of the location, not of the pin alone (black-box h57: a non-root agent, the
		// backups root's 0700).
		{name: "not readable, nothing in RAM", err: &os.PathError{Op: "lstat", Path: "/b/job/restore.version", Err: syscall.EACCES}, invs: []tiers.Inventory{{Rank: 0}},
			want: "the backup location %s cannot be read by this agent (its first read, restore.version: lstat /b/job/restore.version: permission denied)", wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			store := downStore{testStore: newTestStore(t), err: tc.err}
			store.setPin(t, "job", "2030-01-01_00-01") // readable only when the location is up
			want := tc.want
			if strings.Contains(want, "%s") {
				want = fmt.Sprintf(want, store)
			}
			plan, err := tiers.PlanRestore(t.Context(), planConfig(1, 1), tc.invs, store, limits)
			if tc.wantErr {
				if err == nil || !strings.Contains(err.Error(), want) {
					t.Fatalf("PlanRestore: %v, %+v; want an error containing %q", err, plan, want)
				}
				return
			}
			if err != nil {
				t.Fatalf("PlanRestore: %v", err)
			}
			if !plan.Found || plan.Step != 4 || plan.Backup != "" || plan.Pinned != "" || plan.Data[tiers.Slot{}] != hx(4) || !plan.BackupsUnread {
				t.Errorf("plan %+v, want step 4 from RAM with no pin in force", plan)
			}
			if len(plan.Errors) != 1 || !strings.Contains(plan.Errors[0], want) {
				t.Errorf("plan errors %q, want one containing %q", plan.Errors, want)
			}
		})
	}
}
