package tiers_test

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/tiers"
)

// stalledCoordinator holds every Negotiate until release is closed, as rank 0 does while a node
// of the job never reports, and says so as the real coordinator does.
type stalledCoordinator struct {
	tiers.Coordinator // Sync only; no test here saves
	release           chan struct{}
	planning          bool // rank 0 reads the backups rather than waiting for ranks
}

// Negotiate returns a fresh start once released, for a job of any size (no other node exists).
func (c *stalledCoordinator) Negotiate(ctx context.Context, inc tiers.Incarnation, inv tiers.Inventory) (tiers.RestorePlan, error) {
	select {
	case <-c.release:
		return tiers.RestorePlan{}, nil
	case <-ctx.Done():
		return tiers.RestorePlan{}, ctx.Err()
	}
}

func (c *stalledCoordinator) Restored(context.Context, tiers.Incarnation) error { return nil }

func (c *stalledCoordinator) Backups(ctx context.Context, _ tiers.Incarnation, _ tiers.BackupReport) (tiers.BackupOrder, error) {
	<-ctx.Done()
	return tiers.BackupOrder{}, nil
}

func (c *stalledCoordinator) WaitingFor(tiers.Incarnation) (string, bool) {
	if c.planning {
		return "the coordinator (rank 0) is reading the backup location to plan the restore", false
	}
	return "not yet rank 1", true
}

// TestRestoreTellsOfAWaitForOtherNodes: a restore negotiation that waits for a node that never
// reports is shown in mtcfs status at once and told to the job once, with whom it waits for and
// what to check, before the job's own 300 s run out; the restore goes on once the node reports.
func TestRestoreTellsOfAWaitForOtherNodes(t *testing.T) {
	t.Parallel()
	coord := &stalledCoordinator{release: make(chan struct{})}
	h := newHarness(t, harnessConfig{coord: coord})
	h.r.SetWaitNotices(50*time.Millisecond, time.Hour, 300*time.Millisecond)
	h.yamlOrbax(withKeys("nodes: 2", "peer-ranks: [1]"))

	h.eventually("the wait in mtcfs status", func() string {
		if w := h.r.Status().Waiting; !strings.Contains(w, "in the restore negotiation: not yet rank 1") {
			return "status waiting = " + w
		}
		return ""
	})
	h.eventually("the wait told to the job", func() string {
		if l := h.lines(layout.ReplicatorErrorsName); len(l) != 1 {
			return fmt.Sprintf("replicator.errors = %q, want one line", l)
		}
		return ""
	})
	line := h.lines(layout.ReplicatorErrorsName)[0]
	for _, want := range []string{"the restore negotiation has waited", "not yet rank 1", "every node's agent must be running, with the same job-name, backup location and peer secret"} {
		if !strings.Contains(line, want) {
			t.Errorf("replicator.errors line %q does not say %q", line, want)
		}
	}
	time.Sleep(400 * time.Millisecond) // more than another lineAfter: the job is told once
	if l := h.lines(layout.ReplicatorErrorsName); len(l) != 1 {
		t.Errorf("replicator.errors = %q, want the one line", l)
	}

	close(coord.release)
	h.waitMarkers(marker("job", 0, 0, 0, layout.MarkerRestore))
	h.eventually("the wait gone from mtcfs status", func() string { return h.r.Status().Waiting })
}

// TestRestoreTellsOfASlowPlan: a wait that is not for other nodes (rank 0 reading a large backup
// location, in a one-node job) is told as what it is, without the advice about other agents.
func TestRestoreTellsOfASlowPlan(t *testing.T) {
	t.Parallel()
	coord := &stalledCoordinator{release: make(chan struct{}), planning: true}
	h := newHarness(t, harnessConfig{coord: coord})
	h.r.SetWaitNotices(50*time.Millisecond, time.Hour, 300*time.Millisecond)
	h.yamlOrbax(baseYAML)
	h.eventually("the wait told to the job", func() string {
		if l := h.lines(layout.ReplicatorErrorsName); len(l) != 1 {
			return fmt.Sprintf("replicator.errors = %q, want one line", l)
		}
		return ""
	})
	line := h.lines(layout.ReplicatorErrorsName)[0]
	if !strings.Contains(line, "the restore negotiation has waited") || !strings.Contains(line, "is reading the backup location") ||
		strings.Contains(line, "other nodes") || strings.Contains(line, "agent must be running") {
		t.Errorf("replicator.errors line %q: want the slow plan, and no word of other nodes", line)
	}
	close(coord.release)
	h.waitMarkers(marker("job", 0, 0, 0, layout.MarkerRestore))
}

// A restore transfer that lasts is told of: in the log, with bytes, rate and what is left, and
// once in replicator.errors. Before, a download from a slow backup location said nothing
// between its start and its end, and the job's wait for its markers ran out without a word
// (found by a black-box run: 357 s on a 2.5 MB/s link).
func TestRestoreTellsOfASlowTransfer(t *testing.T) {
	t.Parallel()
	store, doc, _ := backedUpThenGone(t)

	// The node's RAM is lost (a new spool); the download is slow.
	release := make(chan struct{})
	store.mu.Lock()
	store.afterDownload = func(int, string) { <-release }
	store.mu.Unlock()
	h2 := newHarness(t, harnessConfig{store: store})
	h2.r.SetWaitNotices(50*time.Millisecond, time.Hour, 300*time.Millisecond)
	h2.yamlOrbax(doc)
	h2.eventually("the transfer told to the job", func() string {
		for _, l := range h2.lines(layout.ReplicatorErrorsName) {
			if strings.Contains(l, "restoring step 1 from backup 2030-01-02_03-00: ") && strings.Contains(l, "may run out first") {
				return ""
			}
		}
		return fmt.Sprintf("replicator.errors = %q", h2.lines(layout.ReplicatorErrorsName))
	})
	close(release)
	h2.waitMarkers(marker("job", 1, 0, 0, layout.MarkerRestore))
}

// A restore of several workers' data, each transfer slow, tells the job once, not once per
// worker.
func TestRestoreTellsOfSlowTransfersOnce(t *testing.T) {
	t.Parallel()
	store := newTestStore(t)
	h := newHarness(t, harnessConfig{store: store})
	doc := withKeys("framework: pytorch", "workers-per-node: 2", "backup-interval-steps: 1", "-backup-interval-minutes")
	h.yamlNemo(doc)
	h.waitMarkers(marker("job", 0, 0, 0, layout.MarkerRestore), marker("job", 0, 0, 1, layout.MarkerRestore))
	for w := range 2 {
		h.writeFile(marker("job", 1, 0, w, layout.MarkerSave), fmt.Sprintf("torch state of worker %d", w))
	}
	h.waitBackedUp(store, "job", 1, 2)
	h.close()
	// The workers' data is downloaded one after the other; each download is held until the
	// test releases it, so that each transfer lasts past lineAfter whatever the scheduling.
	var downloads atomic.Int32
	first, second, ended := make(chan struct{}), make(chan struct{}), make(chan struct{})
	store.mu.Lock()
	store.afterDownload = func(int, string) {
		hold := second
		if downloads.Add(1) == 1 {
			hold = first
		}
		select {
		case <-hold:
		case <-ended:
		}
	}
	store.mu.Unlock()
	h2 := newHarness(t, harnessConfig{store: store})
	t.Cleanup(func() { close(ended) }) // before h2's Close: also when the test fails meanwhile
	h2.r.SetWaitNotices(50*time.Millisecond, time.Hour, 300*time.Millisecond)
	h2.yamlNemo(doc)
	told := func() int {
		n := 0
		for _, l := range h2.lines(layout.ReplicatorErrorsName) {
			if strings.Contains(l, "restoring step 1 from backup") {
				n++
			}
		}
		return n
	}
	// Worker 0's transfer is told once it lasted lineAfter.
	h2.eventually("the first transfer told to the job", func() string {
		if told() == 0 {
			return fmt.Sprintf("replicator.errors = %q", h2.lines(layout.ReplicatorErrorsName))
		}
		return ""
	})
	close(first)
	// Worker 1's transfer lasts three times lineAfter (its notices tick every 50 ms), or less
	// should it be told again (that fails below at once).
	h2.eventually("the second download", func() string {
		if downloads.Load() < 2 {
			return "worker 1's download not begun"
		}
		return ""
	})
	for deadline := time.Now().Add(900 * time.Millisecond); told() < 2 && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
	}
	close(second)
	h2.waitMarkers(marker("job", 1, 0, 0, layout.MarkerRestore), marker("job", 1, 0, 1, layout.MarkerRestore))
	if n := told(); n != 1 {
		t.Fatalf("%d lines of slow transfers, want 1: %q", n, h2.lines(layout.ReplicatorErrorsName))
	}
}

// TestTransferDetail: what is left is estimated once a transfer moved 1% of its bytes; before,
// a slow link's first chunk not yet in gave "81B of 16.0MiB after 1m10s (1B/s), about 4027h
// left" for a transfer that took 82 s (a black-box run).
func TestTransferDetail(t *testing.T) {
	const mib = 1 << 20
	for _, tc := range []struct {
		moved, total int64
		took         time.Duration
		want         string
	}{
		{81, 16 * mib, 70 * time.Second, "81B of 16.0MiB after 1m10s (1B/s)"},
		{8 * mib, 16 * mib, 40 * time.Second, "8.0MiB of 16.0MiB after 40s (204.8KiB/s), about 40s left"},
		{0, 0, time.Second, "0B so far after 1s (0B/s)"}, // the size not known yet (black-box h58: "0B of 0B")
	} {
		if got := tiers.TransferDetail(tc.moved, tc.total, tc.took); got != tc.want {
			t.Errorf("TransferDetail(%d, %d, %v) = %q, want %q", tc.moved, tc.total, tc.took, got, tc.want)
		}
	}
}
