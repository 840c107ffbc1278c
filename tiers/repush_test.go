package tiers_test

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mtcfs/mtcfs/layout"
)

// A push that failed is tried again while its step is the newest, without a line to the job at
// each try; once the peer holds the replica the step is synced again and counts as replicated.
// Before, a job that saved once (or a restored step) stayed on one node until the next save.
func TestFailedPushIsTriedAgain(t *testing.T) {
	t.Parallel()
	hs, tr := newPair(t)
	for _, h := range hs {
		h.r.SetRePushWaits(50*time.Millisecond, 200*time.Millisecond)
	}
	setFail := func(fail bool) {
		tr.mu.Lock()
		tr.failTo[1] = fail
		tr.mu.Unlock()
	}
	calls := func() int {
		tr.mu.Lock()
		defer tr.mu.Unlock()
		return tr.calls[1]
	}
	setFail(true) // rank 0's pushes to rank 1 fail; rank 1's to rank 0 go through
	for i, h := range hs {
		h.orbaxSave(1, map[string]string{"state": fmt.Sprintf("state of rank %d", i)})
	}
	for _, h := range hs {
		h.eventually("step 1 synced", func() string {
			if st := h.r.Status(); st.Committed != 1 {
				return fmt.Sprintf("latest committed %d", st.Committed)
			}
			return ""
		})
	}
	if st := hs[0].r.Status(); st.Replicated == 1 {
		t.Fatal("step 1 replicated although every push to rank 1 failed")
	}
	failedLine := "replicating step 1 to rank 1 failed"
	errLines := func() int {
		n := 0
		for _, l := range hs[0].lines(layout.ReplicatorErrorsName) {
			if strings.Contains(l, failedLine) {
				n++
			}
		}
		return n
	}
	// Two later tries fail too (each makes at least one call), and the job heard of it once.
	after := calls()
	hs[0].eventually("two more tries", func() string {
		if n := calls() - after; n < 2 {
			return fmt.Sprintf("%d calls to rank 1 since the sync", n)
		}
		return ""
	})
	hs[0].eventually("the later try in the status", func() string {
		if rp := hs[0].r.Status().RePush; rp == nil || rp.Step != 1 || !slices.Equal(rp.To, []int{1}) || rp.Tries < 2 {
			return fmt.Sprintf("status re-push %+v, want step 1 to rank 1 after 2 or more tries", rp)
		}
		return ""
	})
	if n := errLines(); n != 1 {
		t.Fatalf("%d lines %q in replicator.errors, want 1 (the first failure only)", n, failedLine)
	}

	setFail(false)
	hs[0].eventually("step 1 replicated on a later try", func() string {
		if st := hs[0].r.Status(); st.Replicated != 1 {
			return fmt.Sprintf("latest replicated %d", st.Replicated)
		}
		return ""
	})
	if rp := hs[0].r.Status().RePush; rp != nil {
		t.Errorf("status still shows a later try once the step replicated: %+v", rp)
	}
	if !hs[1].exists(marker("job", 1, 0, 0, layout.MarkerMeta)) {
		t.Fatalf("rank 1 holds no replica of rank 0's step 1: %v", hs[1].names())
	}
	// Nothing is pushed any more: the step is replicated.
	settled := calls()
	time.Sleep(500 * time.Millisecond)
	if n := calls(); n != settled {
		t.Fatalf("%d more calls to rank 1 after the step replicated", n-settled)
	}
}
