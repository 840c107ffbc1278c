package tiers_test

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/mtcfs/mtcfs/gcsbackend"
	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/tiers"
)

// completeStep reports whether store holds a complete backup of step, and its name.
func completeStep(t *testing.T, store *testStore, job string, step int64) (string, bool) {
	names, _ := store.Backups(context.Background(), job)
	for _, n := range names {
		steps, _, _ := store.CompleteSteps(context.Background(), job, n, tiers.Shape{Nodes: 1, Workers: 1})
		for _, s := range steps {
			if s.Step == step {
				return n, true
			}
		}
	}
	return "", false
}

// waitBackedUp waits until store holds a complete backup of the job's step (one node, workers
// workers) and returns its name.
func (h *harness) waitBackedUp(store *testStore, job string, step int64, workers int) string {
	h.t.Helper()
	var name string
	h.eventually(fmt.Sprintf("the backup of step %d", step), func() string {
		names, _ := store.Backups(context.Background(), job)
		for _, n := range names {
			steps, _, _ := store.CompleteSteps(context.Background(), job, n, tiers.Shape{Nodes: 1, Workers: workers})
			for _, s := range steps {
				if s.Step == step {
					name = n
					return ""
				}
			}
		}
		return fmt.Sprintf("step %d is in no complete backup", step)
	})
	return name
}

// A job that saves once gets its backup one interval after the commit, without saving again
// (SPEC §10: backups run on their clock).
func TestBackupOfAJobThatSavesOnce(t *testing.T) {
	t.Parallel()
	store := newTestStore(t)
	clock := newFakeClock(baseTime)
	h := newHarness(t, harnessConfig{store: store, clock: clock})
	h.start(withKeys("backup-interval-minutes: 5"), "job")
	h.orbaxSave(3, checkpointFiles("3"))
	h.waitSealed("job", 3, "3")
	h.eventually("step 3's sync", func() string {
		if syncs, _ := h.coord.syncLog(); len(syncs) != 1 {
			return "not synced"
		}
		return ""
	})
	time.Sleep(20 * time.Millisecond)
	if _, ok := completeStep(t, store, "job", 3); ok {
		t.Fatal("backed up before the interval passed")
	}
	clock.Set(baseTime.Add(5 * time.Minute))
	h.eventually("the backup of step 3", func() string {
		if name, ok := completeStep(t, store, "job", 3); !ok || name != "2030-01-02_03-05" {
			return "no complete backup 2030-01-02_03-05 of step 3"
		}
		return ""
	})
}

// On a stop, a running backup is given the drain time to finish (SPEC §10).
func TestCloseDrainsTheRunningBackup(t *testing.T) {
	t.Parallel()
	store := newTestStore(t)
	h := newHarness(t, harnessConfig{store: store, drain: time.Minute})
	started, release := make(chan struct{}), make(chan struct{})
	store.setBeforeUpload(func(ctx context.Context, u tiers.Upload) error {
		close(started)
		select {
		case <-release:
			return nil
		case <-ctx.Done(): // the stop cut the upload short
			return ctx.Err()
		}
	})
	h.start(withKeys("backup-interval-steps: 1", "-backup-interval-minutes"), "job")
	h.orbaxSave(1, checkpointFiles("1"))
	<-started
	closed := make(chan struct{})
	go func() { h.close(); close(closed) }()
	select {
	case <-closed:
		t.Fatal("Close returned while the backup was still running")
	case <-time.After(100 * time.Millisecond):
	}
	close(release)
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return once the backup finished")
	}
	if _, ok := completeStep(t, store, "job", 1); !ok {
		t.Fatal("the drained backup is not complete")
	}
}

// A backup still running when the drain time is over is cut short and left incomplete (its
// .meta, uploaded last, is missing); the next agent backs the step up again.
func TestBackupCutShortIsRetriedByTheNextAgent(t *testing.T) {
	t.Parallel()
	store := newTestStore(t)
	cfg := harnessConfig{store: store, drain: 50 * time.Millisecond}
	h := newHarness(t, cfg)
	started := make(chan struct{}, 1)
	store.setBeforeUpload(func(ctx context.Context, u tiers.Upload) error {
		select {
		case started <- struct{}{}:
		default:
		}
		<-ctx.Done()
		return ctx.Err()
	})
	doc := withKeys("backup-interval-steps: 100", "-backup-interval-minutes")
	h.start(doc, "job")
	h.orbaxSave(1, checkpointFiles("1")) // not due (every 100 steps)...
	h.waitSealed("job", 1, "1")
	h.close()
	store.setBeforeUpload(nil)

	// ... but after a restart the restored step is in no backup: backed up at once.
	h2 := newHarness(t, harnessConfig{root: h.cfg.root, store: store, drain: 50 * time.Millisecond})
	store.setBeforeUpload(func(ctx context.Context, u tiers.Upload) error {
		select {
		case started <- struct{}{}:
		default:
		}
		<-ctx.Done()
		return ctx.Err()
	})
	h2.yamlOrbax(doc)
	h2.waitMarkers(marker("job", 1, 0, 0, layout.MarkerRestore))
	<-started
	h2.close() // cut short after 50ms
	if _, ok := completeStep(t, store, "job", 1); ok {
		t.Fatal("a cut-short backup looks complete")
	}
	store.setBeforeUpload(nil)
	h3 := newHarness(t, harnessConfig{root: h.cfg.root, store: store})
	h3.yamlOrbax(doc)
	h3.waitMarkers(marker("job", 1, 0, 0, layout.MarkerRestore))
	h3.eventually("the retried backup of step 1", func() string {
		if _, ok := completeStep(t, store, "job", 1); !ok {
			return "step 1 is in no complete backup"
		}
		return ""
	})
	if errs := h3.lines(layout.ReplicatorErrorsName); len(errs) != 0 && !strings.Contains(strings.Join(errs, "\n"), "backup") {
		t.Errorf("replicator.errors = %q", errs)
	}
}

// A negative drain time (--drain-timeout 0s) cuts a running backup short at once.
func TestCloseWithoutDrain(t *testing.T) {
	t.Parallel()
	store := newTestStore(t)
	h := newHarness(t, harnessConfig{store: store, drain: -1})
	started := make(chan struct{})
	store.setBeforeUpload(func(ctx context.Context, u tiers.Upload) error {
		close(started)
		<-ctx.Done()
		return ctx.Err()
	})
	h.start(withKeys("backup-interval-steps: 1", "-backup-interval-minutes"), "job")
	h.orbaxSave(1, checkpointFiles("1"))
	<-started
	begin := time.Now()
	h.close()
	if took := time.Since(begin); took > 5*time.Second {
		t.Fatalf("Close took %v with no drain time", took)
	}
	if _, ok := completeStep(t, store, "job", 1); ok {
		t.Fatal("the backup cut short looks complete")
	}
}

// Data-parallel mode: a node told to name its column's data in the backup (BackupOrder.Data)
// uploads only its .meta. When that data is not in the backup after all, or the order names
// another number of workers, the node uploads its own data instead: the backup completes, its
// .meta names data beside it, and the node reports what it named.
func TestBackupNamingMissingColumnDataUploadsOwn(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		data []string
	}{
		{"not in the backup", []string{"D" + strings.Repeat("0", 64)}},
		{"two workers named for one", []string{strings.Repeat("1", 64), strings.Repeat("2", 64)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			store := newTestStore(t)
			h := newHarness(t, harnessConfig{store: store, backupOrder: func(o *tiers.BackupOrder) { o.Data = tc.data }})
			h.start(withKeys("backup-interval-steps: 1", "-backup-interval-minutes"), "job")
			h.orbaxSave(1, checkpointFiles("1"))
			own := h.waitSealed("job", 1, "1")
			h.waitBackedUp(store, "job", 1, 1)
			uploads, errs := store.uploadLog()
			if len(errs) != 0 {
				t.Fatal(errs)
			}
			var sources []string
			for _, u := range uploads {
				sources = append(sources, u.Hash+" from "+u.Source)
			}
			last := uploads[len(uploads)-1]
			if last.Hash != own || last.Source == "" {
				t.Fatalf("uploads %q: want the node's own data %s last", sources, own)
			}
			if len(tc.data) == 1 && (len(uploads) != 2 || uploads[0].Source != "" || uploads[0].Hash != tc.data[0]) {
				t.Fatalf("uploads %q: want the .meta naming %s first", sources, tc.data[0])
			}
			h.eventually("the report of the backup", func() string {
				for _, r := range h.coord.backupReports() {
					if r.Done != "" && slices.Equal(r.Hashes, []string{own}) {
						return ""
					}
				}
				return fmt.Sprintf("reports %+v: none done naming %s", h.coord.backupReports(), own)
			})
		})
	}
}

// A node outside the last partition names its column's data without its own copy of the step:
// the job may have saved a newer step, and retention freed the ordered one, while the column's
// uploader uploaded. Before, its order failed ("no longer in this node's RAM"), the coordinator
// ordered the newer step instead, and with saves more frequent than uploads no data-parallel
// backup ever completed (found by a review).
func TestNamingTheColumnsDataNeedsNoOwnCopy(t *testing.T) {
	t.Parallel()
	store := newTestStore(t)
	var h1 string
	proceed := make(chan struct{})
	h := newHarness(t, harnessConfig{store: store, backupOrder: func(o *tiers.BackupOrder) {
		if o.Step == 1 {
			<-proceed
			o.Data = []string{h1}
		}
	}})
	h.start(withKeys("backup-interval-steps: 1", "-backup-interval-minutes"), "job")
	h.orbaxSave(1, checkpointFiles("1"))
	h1 = h.waitSealed("job", 1, "1")
	// The column's uploader's data: step 1's, uploaded to the backup under another step.
	copyDir := filepath.Join(t.TempDir(), "copy")
	if out, err := exec.Command("cp", "-a", h.spoolGlob(h1 + ".data")[0], copyDir).CombinedOutput(); err != nil {
		t.Fatalf("cp: %v %s", err, out)
	}
	h.orbaxSave(2, checkpointFiles("2"))
	h.waitSealed("job", 2, "2")
	h.eventually("step 1 freed", func() string {
		if len(h.spoolGlob(h1+".data")) != 0 {
			return "step 1's data is still in RAM"
		}
		return ""
	})
	name := "2030-01-02_03-00"
	if err := store.BackupStore.Upload(t.Context(), tiers.Upload{Job: "job", Backup: name, Step: 99, Hash: h1, Source: copyDir,
		Shape: tiers.Shape{Nodes: 1, Workers: 1}}); err != nil {
		t.Fatal(err)
	}
	close(proceed)
	h.eventually("the backup of step 1, naming the column's data", func() string {
		for _, r := range h.coord.backupReports() {
			if r.Failed == name {
				return "failed: " + r.Err
			}
			if r.Done == name && slices.Equal(r.Hashes, []string{h1}) {
				return ""
			}
		}
		return fmt.Sprintf("reports %+v", h.coord.backupReports())
	})
	if b, ok := completeStep(t, store, "job", 1); !ok || b != name {
		t.Fatalf("step 1 is not complete in %s", name)
	}
}

// A transient failure naming the column's data (a 503, a timeout) fails the order, which is
// given again: the node does not upload its own data for it, which would bring back the
// traffic data-parallel mode saves.
func TestNamingTheColumnsDataRetriesATransientFailure(t *testing.T) {
	t.Parallel()
	store := newTestStore(t)
	column := []string{"D" + strings.Repeat("3", 64)}
	h := newHarness(t, harnessConfig{store: store, backupOrder: func(o *tiers.BackupOrder) { o.Data = column }})
	store.setBeforeUpload(func(ctx context.Context, u tiers.Upload) error {
		if u.Source == "" {
			return errors.New("googleapi: Error 503: backend unavailable")
		}
		return nil
	})
	h.start(withKeys("backup-interval-steps: 1", "-backup-interval-minutes"), "job")
	h.orbaxSave(1, checkpointFiles("1"))
	h.eventually("the failed order", func() string {
		for _, r := range h.coord.backupReports() {
			if r.Failed != "" && strings.Contains(r.Err, "503") {
				return ""
			}
		}
		return fmt.Sprintf("reports %+v", h.coord.backupReports())
	})
	uploads, _ := store.uploadLog()
	for _, u := range uploads {
		if u.Source != "" {
			t.Fatalf("the node uploaded its own data (%s) after a transient failure", u.Hash)
		}
	}
}

// One upload at a time on a node, across incarnations (SPEC §6: never while the previous backup
// is still running): a job restarted while its step uploads gets the restored step's backup
// once that upload ended. Before, each restart during a long upload started another full upload
// of the same step beside it (found by a black-box run: three at once on a slow link, none
// complete after 7 minutes).
func TestBackupOfTheNextIncarnationWaitsForTheRunningUpload(t *testing.T) {
	t.Parallel()
	store := newTestStore(t)
	clock := newFakeClock(baseTime)
	second := make(chan struct{})
	h := newHarness(t, harnessConfig{store: store, clock: clock, backupOrder: func(o *tiers.BackupOrder) {
		if o.Backup == "2030-01-02_03-01" {
			close(second)
		}
	}})
	var (
		mu               sync.Mutex
		inFlight, most   int
		release, started = make(chan struct{}), make(chan struct{}, 4)
	)
	store.setBeforeUpload(func(ctx context.Context, u tiers.Upload) error {
		mu.Lock()
		inFlight++
		most = max(most, inFlight)
		first := most == 1 && inFlight == 1 && len(started) == 0
		mu.Unlock()
		started <- struct{}{}
		if first {
			<-release
		}
		mu.Lock()
		inFlight--
		mu.Unlock()
		return nil
	})
	doc := withKeys("backup-interval-steps: 1", "-backup-interval-minutes")
	h.start(doc, "job")
	h.orbaxSave(1, checkpointFiles("1"))
	<-started // the upload of step 1 runs, and is slow

	// The job restarts: the restored step 1 is in no complete backup, and is ordered in the
	// next minute.
	h.yamlOrbax(doc)
	h.waitMarkers(marker("job", 1, 0, 0, layout.MarkerRestore))
	clock.Set(baseTime.Add(time.Minute))
	<-second
	time.Sleep(200 * time.Millisecond) // time enough for a second upload to start beside the first
	close(release)
	h.eventually("both backups of step 1", func() string {
		names, _ := store.Backups(t.Context(), "job")
		n := 0
		for _, name := range names {
			if steps, _, _ := store.CompleteSteps(t.Context(), "job", name, tiers.Shape{Nodes: 1, Workers: 1}); len(steps) > 0 {
				n++
			}
		}
		if n < 2 {
			return fmt.Sprintf("%d complete backups of %q", n, names)
		}
		return ""
	})
	mu.Lock()
	defer mu.Unlock()
	if most != 1 {
		t.Fatalf("%d uploads ran at once on the node", most)
	}
}

// The next incarnation completes a backup cut short under its name; when the upload of that
// backup still runs on the node (a job restart does not cut it short), the order waits for it
// and, once it completed, is done without uploading again.
func TestResumedBackupStillRunningIsNotUploadedTwice(t *testing.T) {
	t.Parallel()
	store := newTestStore(t)
	const name = "2030-01-02_03-00"
	release, started := make(chan struct{}), make(chan struct{})
	var calls atomic.Int32
	store.setBeforeUpload(func(ctx context.Context, u tiers.Upload) error {
		if calls.Add(1) == 1 {
			// The upload has begun: the backup exists, with no complete step yet.
			shape := `{"format":"mtcfs-backup-v1","nodes":1,"workers":1,"data-parallelism":0}`
			if err := gcsbackend.PutBytes(ctx, store.objects, "job/"+name+"/mtcfs-backup.json", []byte(shape), true); err != nil {
				return err
			}
			close(started)
			<-release
		}
		return nil
	})
	var orders atomic.Int32
	resumed := make(chan struct{})
	h := newHarness(t, harnessConfig{store: store, backupOrder: func(o *tiers.BackupOrder) {
		if o.Backup == name && orders.Add(1) == 2 {
			close(resumed) // the next incarnation's order
		}
	}})
	doc := withKeys("backup-interval-steps: 1", "-backup-interval-minutes")
	h.start(doc, "job")
	h.orbaxSave(1, checkpointFiles("1"))
	<-started
	h.yamlOrbax(doc) // the job restarts during the upload
	h.waitMarkers(marker("job", 1, 0, 0, layout.MarkerRestore))
	<-resumed
	time.Sleep(100 * time.Millisecond) // time enough for the order to reach the slot
	close(release)
	// The earlier incarnation's upload ends after its incarnation: only the resumed order
	// reports (to the coordinator of the new one).
	h.eventually("the order done", func() string {
		for _, r := range h.coord.backupReports() {
			if r.Done == name {
				return ""
			}
		}
		return fmt.Sprintf("reports %+v", h.coord.backupReports())
	})
	if b, ok := completeStep(t, store, "job", 1); !ok || b != name {
		t.Fatalf("step 1 is not complete in %s", name)
	}
	if n := calls.Load(); n != 1 {
		t.Fatalf("%d uploads of one backup", n)
	}
}

// waitBackupFailures waits for each of n failed attempts of a backup that keeps failing to be
// reported to the coordinator, moving clock past the retry's backoff after each.
func (h *harness) waitBackupFailures(clock *fakeClock, n int) {
	h.t.Helper()
	failures := func() int {
		n := 0
		for _, r := range h.coord.backupReports() {
			if r.Failed != "" {
				n++
			}
		}
		return n
	}
	for attempt := 1; attempt <= n; attempt++ {
		h.eventually(fmt.Sprintf("failure %d", attempt), func() string {
			if n := failures(); n < attempt {
				return fmt.Sprintf("%d failures reported", n)
			}
			return ""
		})
		clock.Set(clock.Now().Add(time.Minute)) // the retry's backoff
	}
}

// A backup that keeps failing is told to the job once, not at every retry (a location that
// refused every upload wrote a 500-character line per retry, 1 s to a minute apart; found by a
// black-box run). The coordinator hears of every failure.
func TestBackupFailureIsToldOnce(t *testing.T) {
	t.Parallel()
	store := newTestStore(t)
	clock := newFakeClock(baseTime)
	store.setBeforeUpload(func(context.Context, tiers.Upload) error { return errors.New("403 Forbidden") })
	h := newHarness(t, harnessConfig{store: store, clock: clock})
	h.start(withKeys("backup-interval-steps: 1", "-backup-interval-minutes"), "job")
	h.orbaxSave(1, checkpointFiles("1"))
	h.waitBackupFailures(clock, 3)
	n := 0
	for _, l := range h.lines(layout.ReplicatorErrorsName) {
		if strings.Contains(l, "backup 2030-01-02_03-00 of step 1 failed") {
			n++
		}
	}
	if n != 1 {
		t.Fatalf("%d lines for one failing backup, want 1: %q", n, h.lines(layout.ReplicatorErrorsName))
	}
	if errs := h.read(layout.ReplicatorErrorsName); strings.Contains(errs, "location is full") {
		t.Errorf("a refused upload is called a full location: %q", errs)
	}
}

// A backup whose names hold other bytes (another agent writes this job's backups: two jobs of
// one job-name on one location) says so: the job was told only "precondition failed", retried
// for ever, and after a reboot one job restored the other's step (found by a black-box run).
func TestBackupWrittenByAnotherAgentSaysSo(t *testing.T) {
	t.Parallel()
	store := newTestStore(t)
	clock := newFakeClock(baseTime)
	store.setBeforeUpload(func(context.Context, tiers.Upload) error {
		return &gcsbackend.PreconditionError{Name: "job/2030-01-02_03-00/job-s1-n0-w0.meta", Err: fmt.Errorf("exists with different content: %w", fs.ErrExist)}
	})
	h := newHarness(t, harnessConfig{store: store, clock: clock})
	h.start(withKeys("backup-interval-steps: 1", "-backup-interval-minutes"), "job")
	h.orbaxSave(1, checkpointFiles("1"))
	h.waitBackupFailures(clock, 2)
	if errs := h.read(layout.ReplicatorErrorsName); !strings.Contains(errs, "another agent wrote other bytes under this backup's names: two jobs, or two nodes, with job-name job and node-rank 0 use this backup location?") {
		t.Errorf("replicator.errors does not say another agent writes there: %q", errs)
	}
}

// A backup location out of space (a file:// disk) is named as such in the job's line, with
// what to do: the bare "no space left on device" ended a long line and read as one more
// transient failure, retried for ever (found by a black-box run). Found full after a transient
// failure of the same backup, it is told too, once (a review: the line was told once per backup,
// so the first failure's kind decided it).
func TestBackupToAFullLocationSaysSo(t *testing.T) {
	t.Parallel()
	store := newTestStore(t)
	clock := newFakeClock(baseTime)
	var attempts atomic.Int32
	store.setBeforeUpload(func(context.Context, tiers.Upload) error {
		if attempts.Add(1) == 1 {
			return errors.New("503 Service Unavailable")
		}
		return fmt.Errorf("put x: %w", &os.PathError{Op: "write", Path: "/backups/x/.mtcfs-tmp-1", Err: syscall.ENOSPC})
	})
	h := newHarness(t, harnessConfig{store: store, clock: clock})
	h.start(withKeys("backup-interval-steps: 1", "-backup-interval-minutes"), "job")
	h.orbaxSave(1, checkpointFiles("1"))
	h.waitBackupFailures(clock, 4)
	var generic, full int
	for _, l := range h.lines(layout.ReplicatorErrorsName) {
		switch {
		case strings.Contains(l, "of step 1 failed (it is retried, and told here once): the backup location is full (free space there, or point --backup at a larger one") &&
			strings.HasSuffix(l, "no space left on device"):
			full++
		case strings.Contains(l, "of step 1 failed (it is retried, and told here once): 503 Service Unavailable"):
			generic++
		}
	}
	if generic != 1 || full != 1 {
		t.Fatalf("%d lines of the first failure and %d of the full location, want 1 and 1: %q", generic, full, h.lines(layout.ReplicatorErrorsName))
	}
}

// Close while an order waits for the upload running on the node: once that upload ended, the
// waiting order does not start another (before, it did, after Close began: Close waited its
// whole drain time and cut it short, leaving an incomplete backup; found by a review).
func TestCloseDropsAnOrderWaitingForTheRunningUpload(t *testing.T) {
	t.Parallel()
	store := newTestStore(t)
	clock := newFakeClock(baseTime)
	second := make(chan struct{})
	h := newHarness(t, harnessConfig{store: store, clock: clock, drain: time.Minute, backupOrder: func(o *tiers.BackupOrder) {
		if o.Backup == "2030-01-02_03-01" {
			close(second)
		}
	}})
	var calls atomic.Int32
	release, started := make(chan struct{}), make(chan struct{})
	var releaseOnce sync.Once
	releaseUpload := func() { releaseOnce.Do(func() { close(release) }) }
	store.setBeforeUpload(func(ctx context.Context, u tiers.Upload) error {
		if calls.Add(1) == 1 {
			close(started)
			<-release
		}
		return nil
	})
	t.Cleanup(releaseUpload) // before the harness's Close, also when the test fails meanwhile
	doc := withKeys("backup-interval-steps: 1", "-backup-interval-minutes")
	h.start(doc, "job")
	h.orbaxSave(1, checkpointFiles("1"))
	<-started
	h.yamlOrbax(doc)
	h.waitMarkers(marker("job", 1, 0, 0, layout.MarkerRestore))
	clock.Set(baseTime.Add(time.Minute))
	<-second
	time.Sleep(100 * time.Millisecond) // time enough for the order to reach the slot
	closed := make(chan struct{})
	go func() { h.close(); close(closed) }()
	// The upload ends only once Close has begun stopping the backups: released earlier, the
	// waiting order would rightly take the slot (Close had not begun yet).
	h.eventually("Close stopping the backups", func() string {
		if !h.r.BackupsStopping() {
			return "not stopping yet"
		}
		return ""
	})
	releaseUpload()
	select {
	case <-closed:
	case <-time.After(30 * time.Second):
		t.Fatal("Close did not return once the running upload ended")
	}
	if n := calls.Load(); n != 1 {
		t.Fatalf("%d uploads: the waiting order started one after Close began", n)
	}
}
