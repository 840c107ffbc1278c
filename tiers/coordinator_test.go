package tiers_test

import (
	"errors"
	"testing"
	"time"

	"github.com/mtcfs/mtcfs/tiers"
)

// at is a time on baseTime's day: at(3, 1, 30) is 03:01:30 UTC.
func at(h, m, s int) time.Time { return time.Date(2030, 1, 2, h, m, s, 0, time.UTC) }

func TestBackupSchedule(t *testing.T) {
	t.Parallel()
	type sync struct {
		now     time.Time
		running bool   // a backup is still uploading
		want    string // "" or the backup's HH-MM
	}
	tests := []struct {
		name  string
		every time.Duration
		steps int
		syncs []sync
	}{
		{
			name: "every 2 steps", steps: 2,
			syncs: []sync{{at(3, 0, 0), false, ""}, {at(3, 0, 10), false, "03-00"}, {at(3, 1, 10), false, ""}, {at(3, 1, 20), false, "03-01"}},
		},
		{
			name: "every step, at most one per UTC minute", steps: 1,
			syncs: []sync{
				{at(3, 0, 0), false, "03-00"},
				{at(3, 0, 30), false, ""}, // due, but 03-00 exists: waits for the next minute
				{at(3, 0, 59), false, ""},
				{at(3, 1, 0), false, "03-01"},
				{at(3, 1, 0), false, ""},
			},
		},
		{
			name: "never while the previous backup runs", steps: 1,
			syncs: []sync{
				{at(3, 0, 0), true, ""},
				{at(3, 1, 0), false, "03-01"},
				{at(3, 2, 0), true, ""},
				{at(3, 2, 30), false, "03-02"}, // still due once the upload finished
			},
		},
		{
			name: "minutes: the clock starts at the first sync", every: 5 * time.Minute,
			syncs: []sync{
				{at(3, 2, 0), false, ""}, // first sync: not due, however late it comes
				{at(3, 6, 59), false, ""},
				{at(3, 7, 0), false, "03-07"},
				{at(3, 11, 0), false, ""},
				{at(3, 12, 0), false, "03-12"},
			},
		},
		{
			name: "minutes: due while running waits for the upload", every: time.Minute,
			syncs: []sync{{at(3, 0, 0), false, ""}, {at(3, 1, 0), true, ""}, {at(3, 1, 30), false, "03-01"}, {at(3, 2, 0), false, ""}, {at(3, 2, 30), false, "03-02"}},
		},
		{
			name: "fractional minutes: still one per UTC minute", every: 30 * time.Second,
			syncs: []sync{
				{at(3, 0, 0), false, ""},
				{at(3, 0, 30), false, "03-00"},
				{at(3, 1, 0), false, "03-01"},
				{at(3, 1, 30), false, ""}, // due, but 03-01 exists
				{at(3, 2, 0), false, "03-02"},
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := tiers.BackupSchedule{Every: tc.every, Steps: tc.steps}
			for i, sy := range tc.syncs {
				want := ""
				if sy.want != "" {
					want = "2030-01-02_" + sy.want
				}
				if got := s.Due(sy.now, sy.running); got != want {
					t.Fatalf("sync %d at %s (running %v): Due = %q, want %q", i, sy.now.Format(time.TimeOnly), sy.running, got, want)
				}
			}
		})
	}
}

func TestBackupNameIsTheUTCMinute(t *testing.T) {
	t.Parallel()
	local := time.Date(2030, 1, 2, 8, 34, 59, 999, time.FixedZone("UTC+5:30", 5*3600+1800))
	if got := tiers.BackupName(local); got != "2030-01-02_03-04" {
		t.Errorf("BackupName(%v) = %q, want 2030-01-02_03-04", local, got)
	}
}

// oneNodeConfig is a valid one-node job backing up every steps steps.
func oneNodeConfig(steps int) *tiers.Config {
	return &tiers.Config{JobName: "job", Framework: tiers.FrameworkOrbax, Nodes: 1, PeerRanks: []int{},
		BackupIntervalSteps: steps, WorkersPerNode: 1}
}

func TestLocalCoordinatorRefusesMultiNodeJobs(t *testing.T) {
	t.Parallel()
	for _, nodes := range []int{2, 4} {
		cfg := oneNodeConfig(1)
		cfg.Nodes, cfg.NodeRank, cfg.PeerRanks = nodes, 1, []int{0}
		c := &tiers.LocalCoordinator{}
		_, err := c.Negotiate(t.Context(), tiers.Incarnation{ID: "a", Config: cfg}, tiers.Inventory{Rank: 1})
		if !errors.Is(err, tiers.ErrNeedsPeers) {
			t.Errorf("nodes %d: Negotiate error %v, want ErrNeedsPeers", nodes, err)
		}
	}
}

func TestLocalCoordinatorSync(t *testing.T) {
	t.Parallel()
	clock := newFakeClock(at(3, 0, 0))
	store := newFakeStore(t)
	c := &tiers.LocalCoordinator{Store: store, Now: clock.Now}
	inc := tiers.Incarnation{ID: "a", Config: oneNodeConfig(2)}
	plan, err := c.Negotiate(t.Context(), inc, tiers.Inventory{Rank: 0})
	if err != nil || plan.Found {
		t.Fatalf("Negotiate = %+v, %v; want a fresh start", plan, err)
	}
	if err := c.Restored(t.Context(), inc); err != nil {
		t.Fatalf("Restored: %v", err)
	}
	want := []string{"", "2030-01-02_03-01", "", "2030-01-02_03-03"} // every 2 steps, one step a minute
	for i, w := range want {
		clock.Set(at(3, i, 0))
		dec, err := c.Sync(t.Context(), inc, tiers.SyncReport{Step: int64(i + 1)})
		if err != nil || dec.Backup != w {
			t.Errorf("sync of step %d: %+v, %v; want backup %q", i+1, dec, err, w)
		}
	}
	if _, err := c.Sync(t.Context(), tiers.Incarnation{ID: "stale", Config: inc.Config}, tiers.SyncReport{Step: 9}); err == nil {
		t.Errorf("a sync from an incarnation the coordinator does not coordinate must fail")
	}

	// Without a backup tier nothing is ever due.
	nb := &tiers.LocalCoordinator{Now: clock.Now}
	inc1 := tiers.Incarnation{ID: "b", Config: oneNodeConfig(1)}
	if _, err := nb.Negotiate(t.Context(), inc1, tiers.Inventory{Rank: 0}); err != nil {
		t.Fatal(err)
	}
	if dec, err := nb.Sync(t.Context(), inc1, tiers.SyncReport{Step: 1}); err != nil || dec.Backup != "" {
		t.Errorf("sync without a store = %+v, %v; want no backup", dec, err)
	}
}

func TestLocalCoordinatorPinIsOneShot(t *testing.T) {
	t.Parallel()
	const b1 = "2030-01-01_00-01"
	tests := []struct {
		name      string
		pin       string
		restored  int64   // the plan's step
		syncs     []int64 // steps synced in order
		clearedAt int     // index of the sync after which restore.version is gone
	}{
		{"missing pin: cleared by the first sync", "2000-01-01_00-00", 0, []int64{1, 2}, 0},
		{"pinned step re-synced keeps the pin until a new step", b1, 3, []int64{3, 4, 5}, 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			store := newFakeStore(t)
			store.addBackup(t, "job", b1, 3, slots("n0-w0", hx(3)))
			store.setPin(tc.pin)
			c := &tiers.LocalCoordinator{Store: store, Now: newFakeClock(at(3, 0, 0)).Now}
			inc := tiers.Incarnation{ID: "a", Config: oneNodeConfig(1000)}
			plan, err := c.Negotiate(t.Context(), inc, tiers.Inventory{Rank: 0})
			if err != nil || plan.Step != tc.restored || plan.Pinned != tc.pin {
				t.Fatalf("Negotiate = %+v, %v; want step %d pinned %q", plan, err, tc.restored, tc.pin)
			}
			for i, step := range tc.syncs {
				if _, err := c.Sync(t.Context(), inc, tiers.SyncReport{Step: step}); err != nil {
					t.Fatal(err)
				}
				_, ok, _ := store.RestoreVersion(t.Context(), "job")
				_, _, clears := store.counts()
				if wantGone := i >= tc.clearedAt; ok == wantGone {
					t.Errorf("after the sync of step %d restore.version exists = %v, want %v", step, ok, !wantGone)
				}
				if wantClears := min(1, max(0, i-tc.clearedAt+1)); clears != wantClears {
					t.Errorf("after the sync of step %d restore.version was deleted %d times, want %d", step, clears, wantClears)
				}
			}
		})
	}
}

// Regression (coordinator.go, LocalCoordinator.Negotiate): every incarnation got a fresh
// BackupSchedule, which forgets the minute of the last backup. A job that restarts within the
// minute of its last backup reuses that backup's name, so two steps land in one backup
// directory; SPEC §6: "names are unique, so a backup due in a minute that already has one waits
// for the next minute".
func TestLocalCoordinatorBackupNamesStayUniqueAcrossIncarnations(t *testing.T) {
	t.Parallel()
	clock := newFakeClock(at(3, 0, 10))
	c := &tiers.LocalCoordinator{Store: newFakeStore(t), Now: clock.Now}
	inc1 := tiers.Incarnation{ID: "first", Config: oneNodeConfig(1)}
	if _, err := c.Negotiate(t.Context(), inc1, tiers.Inventory{Rank: 0}); err != nil {
		t.Fatal(err)
	}
	dec, err := c.Sync(t.Context(), inc1, tiers.SyncReport{Step: 1})
	if err != nil || dec.Backup != "2030-01-02_03-00" {
		t.Fatalf("first sync = %+v, %v; want backup 2030-01-02_03-00", dec, err)
	}
	// The job restarts in the same minute and commits its next step.
	clock.Set(at(3, 0, 40))
	inc2 := tiers.Incarnation{ID: "second", Config: oneNodeConfig(1)}
	if _, err := c.Negotiate(t.Context(), inc2, tiers.Inventory{Rank: 0}); err != nil {
		t.Fatal(err)
	}
	if dec, err := c.Sync(t.Context(), inc2, tiers.SyncReport{Step: 2}); err != nil || dec.Backup != "" {
		t.Errorf("sync in the minute of the previous backup = %+v, %v; want no backup (the name 2030-01-02_03-00 is taken)", dec, err)
	}
}
