package tiers_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/replication"
	"github.com/mtcfs/mtcfs/tiers"
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
			if c := h.r.SyncedCommitted(); c != 1 {
				return fmt.Sprintf("latest synced %d", c)
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
		if rp := hs[0].r.Status().RePush; rp == nil || rp.Step != 1 || !slices.Equal(rp.To, []int{1}) || rp.Failed < 2 {
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

// rePushPair is newPair with short waits between later tries, and a switch for rank 0's pushes
// to rank 1.
func rePushPair(t *testing.T, doc func(rank int) string) ([]*harness, *memTransport, func(fail bool)) {
	t.Helper()
	job := replication.NewJob(replication.Options{LagTimeout: 10 * time.Second})
	tr := &memTransport{nodes: map[int]*harness{}, failTo: map[int]bool{}, early: map[string][]layout.FileDigest{}}
	var hs []*harness
	for rank := range 2 {
		h := newHarness(t, harnessConfig{coord: replication.LocalClient{Job: job}, peers: tr})
		h.r.SetRePushWaits(50*time.Millisecond, 200*time.Millisecond)
		tr.nodes[rank] = h
		hs = append(hs, h)
	}
	var wg sync.WaitGroup
	for rank, h := range hs {
		wg.Go(func() { h.yamlNemo(doc(rank)) })
	}
	wg.Wait()
	for _, h := range hs {
		h.waitExists(layout.PrerestoreName)
	}
	return hs, tr, func(fail bool) {
		tr.mu.Lock()
		tr.failTo[1] = fail
		tr.mu.Unlock()
	}
}

func waitCommitted(h *harness, step int64) {
	h.t.Helper()
	h.eventually(fmt.Sprintf("step %d synced", step), func() string {
		if c := h.r.SyncedCommitted(); c != step {
			return fmt.Sprintf("latest synced %d", c)
		}
		return ""
	})
}

// A pytorch job saves step 3 again (same name, new content) after its first save's push
// failed: the new save supersedes the later tries of the first. Before, they went on, pushing
// data retention had freed, and the status said step 3 was not replicated although it was
// (found by a review).
func TestRePushEndsWhenTheSameStepIsSavedAgain(t *testing.T) {
	t.Parallel()
	hs, tr, setFail := rePushPair(t, func(rank int) string {
		return fmt.Sprintf("job-name: pt\nframework: pytorch\nnode-rank: %d\nnodes: 2\npeer-ranks: [%d]\nbackup-interval-minutes: 30", rank, 1-rank)
	})
	setFail(true)
	for r, h := range hs {
		h.writeFile(fmt.Sprintf("pt-s3-n%d-w0.save", r), fmt.Sprintf("first save of rank %d", r))
	}
	for _, h := range hs {
		waitCommitted(h, 3)
	}
	hs[0].eventually("a later try pending", func() string {
		if hs[0].r.Status().RePush == nil {
			return "no re-push in the status"
		}
		return ""
	})
	setFail(false)
	hs[0].waitGone("pt-s3-n0-w0.save") // sealed: the name is free again
	hs[0].writeFile("pt-s3-n0-w0.save", "second save of rank 0")
	hs[0].eventually("step 3 replicated after the second save", func() string {
		if st := hs[0].r.Status(); st.Replicated != 3 || st.RePush != nil {
			return fmt.Sprintf("latest replicated %d, re-push %+v", st.Replicated, st.RePush)
		}
		return ""
	})
	tr.mu.Lock()
	settled := tr.calls[1]
	tr.mu.Unlock()
	time.Sleep(500 * time.Millisecond) // two or more periods of the later tries
	tr.mu.Lock()
	defer tr.mu.Unlock()
	if n := tr.calls[1]; n != settled {
		t.Fatalf("%d calls to rank 1 after the second save replicated: the first save's tries went on", n-settled)
	}
}

// A later try that is running when the next step comes is cancelled: the next step is pushed
// and synced without waiting for it. Before, every rank's sync of the next step waited for the
// try, which may take minutes for a large step on a failing link (found by a review).
func TestNewerStepCancelsARunningRePush(t *testing.T) {
	t.Parallel()
	hs, tr, setFail := rePushPair(t, func(rank int) string {
		return withKeys("job-name: job", "nodes: 2", fmt.Sprintf("node-rank: %d", rank), fmt.Sprintf("peer-ranks: [%d]", 1-rank))
	})
	setFail(true)
	for r, h := range hs {
		h.orbaxSave(1, map[string]string{"state": fmt.Sprintf("step 1 of rank %d", r)})
	}
	for _, h := range hs {
		waitCommitted(h, 1)
	}
	// The next try of step 1 hangs (a peer that takes the bytes slowly).
	hang := make(chan struct{})
	t.Cleanup(func() { close(hang) })
	tr.mu.Lock()
	tr.block = map[int]chan struct{}{1: hang}
	tr.failTo[1] = false
	tr.mu.Unlock()
	hs[0].eventually("a later try of step 1 hanging", func() string {
		tr.mu.Lock()
		defer tr.mu.Unlock()
		if tr.blocked == 0 {
			return "no push waiting"
		}
		return ""
	})
	if rp := hs[0].r.Status().RePush; rp == nil || !rp.Trying {
		t.Errorf("status while the try runs: %+v, want trying", rp)
	}
	tr.mu.Lock()
	tr.block = nil // pushes from now on go through
	tr.mu.Unlock()
	for r, h := range hs {
		h.orbaxSave(2, map[string]string{"state": fmt.Sprintf("step 2 of rank %d", r)})
	}
	hs[0].eventually("step 2 replicated while the try of step 1 hangs", func() string {
		if st := hs[0].r.Status(); st.Replicated != 2 {
			return fmt.Sprintf("latest committed %d, replicated %d", st.Committed, st.Replicated)
		}
		return ""
	})
}

// A sync waiting for the other nodes when the job restarts is abandoned quietly: the job's
// restart is no error. Before, every restart logged "error of an earlier incarnation … sync of
// step N failed: context canceled" at ERROR (found by a black-box soak).
func TestSyncAbandonedAtARestartIsNoError(t *testing.T) {
	t.Parallel()
	doc := func(rank int) string {
		return withKeys("job-name: job", "nodes: 2", fmt.Sprintf("node-rank: %d", rank), fmt.Sprintf("peer-ranks: [%d]", 1-rank))
	}
	hs, _, _ := rePushPair(t, doc)
	hs[0].orbaxSave(1, map[string]string{"state": "step 1"}) // rank 1 does not save: the sync waits
	waitCommitted(hs[0], 1)
	hs[0].yamlOrbax(doc(0)) // the job restarts
	hs[0].eventually("the old sync abandoned", func() string {
		if !strings.Contains(hs[0].logs.String(), `msg="sync abandoned: the incarnation ended" step=1`) {
			return "no line"
		}
		return ""
	})
	if logs := hs[0].logs.String(); strings.Contains(logs, "sync of step 1 failed") || strings.Contains(logs, "level=ERROR") {
		t.Errorf("the abandoned sync was logged as an error:\n%s", logs)
	}
}

// TestStepsSavedWhileTheRestoreWaitsArePushedAgain: a two-node job that saves step 3 on both
// ranks while their restore waits for the negotiation pushed it to the peer, whose own restore
// then dropped the replica as above the step restored; the step is pushed again once the
// restore is done, and counts as replicated only then. Before, the peer lost the replica, and
// the step was reported replicated on every node all the same (a review).
func TestStepsSavedWhileTheRestoreWaitsArePushedAgain(t *testing.T) {
	t.Parallel()
	job := replication.NewJob(replication.Options{LagTimeout: 10 * time.Second})
	gate := make(chan struct{})
	tr := &memTransport{nodes: map[int]*harness{}, failTo: map[int]bool{}, early: map[string][]layout.FileDigest{}}
	var hs []*harness
	var gateds []*gatedCoordinator
	for rank := range 2 {
		gated := &gatedCoordinator{Coordinator: replication.LocalClient{Job: job}}
		gated.gate.Store(&gate)
		h := newHarness(t, harnessConfig{coord: gated, peers: tr})
		tr.nodes[rank] = h
		hs, gateds = append(hs, h), append(gateds, gated)
	}
	for rank, h := range hs { // the job starts; the negotiation is held
		h.yamlOrbax(withKeys("nodes: 2", fmt.Sprintf("node-rank: %d", rank), fmt.Sprintf("peer-ranks: [%d]", 1-rank)))
		h.waitGone(layout.ReplicatorYAMLName)
		gateds[rank].waitHeld(t)
	}
	for rank, h := range hs { // and saves step 3 without waiting for its markers
		h.orbaxSave(3, map[string]string{"state": fmt.Sprintf("state of rank %d", rank)})
	}
	for rank, h := range hs { // the replicas reach the peers while the restores wait
		h.eventually("the peer's replica", func() string {
			if !h.exists(marker("job", 3, 1-rank, 0, layout.MarkerMeta)) {
				return fmt.Sprintf("names %v", h.names())
			}
			return ""
		})
	}
	close(gate)
	for rank, h := range hs {
		h.waitMarkers(marker("job", 0, rank, 0, layout.MarkerRestore))
	}
	for rank, h := range hs {
		h.eventually("step 3 replicated", func() string {
			if st := h.r.Status(); st.Replicated != 3 {
				return fmt.Sprintf("latest replicated %d", st.Replicated)
			}
			return ""
		})
		require.True(t, h.exists(marker("job", 3, 1-rank, 0, layout.MarkerMeta)), "rank %d holds no replica of rank %d's step 3: %v", rank, 1-rank, h.names())
		require.True(t, h.exists(marker("job", 3, rank, 0, layout.MarkerMeta)), "rank %d's own step 3", rank)
	}
}

// TestWorkerSavingAgainAfterALaterTrySucceeded: on a pytorch node of two workers, worker 1's
// push of step 3 failed and succeeded on a later try; then worker 0 saves step 3 again. The step
// is synced again with both workers' data, and worker 1's data, which its peer holds, is not
// pushed again: the sync kept the failure of worker 1's first try, reported the step not
// replicated, and pushed worker 1's data once more (a review of the sync kept for saves again).
func TestWorkerSavingAgainAfterALaterTrySucceeded(t *testing.T) {
	t.Parallel()
	hs, tr, setFail := rePushPair(t, pytorchTwoWorkers)
	save := func(rank, w int, content string) string { return hs[rank].workerSave(3, rank, w, content) }
	setFail(true) // rank 0's pushes to rank 1 fail
	var w1 string
	for rank := range 2 {
		for w := range 2 {
			if d := save(rank, w, fmt.Sprintf("rank %d worker %d", rank, w)); rank == 0 && w == 1 {
				w1 = d
			}
		}
	}
	waitCommitted(hs[0], 3)
	setFail(false)
	hs[0].eventually("step 3 replicated on a later try", func() string {
		if st := hs[0].r.Status(); st.Replicated != 3 {
			return fmt.Sprintf("latest replicated %d", st.Replicated)
		}
		return ""
	})
	require.Equal(t, 1, tr.pushes(1, w1), "worker 1's data reached rank 1 once, on the later try")

	again := save(0, 0, "rank 0 worker 0, saved again")
	hs[0].eventually("the save again pushed to rank 1", func() string {
		if n := tr.pushes(1, again); n != 1 {
			return fmt.Sprintf("%d pushes of it", n)
		}
		return ""
	})
	time.Sleep(500 * time.Millisecond) // later tries come after 50 ms
	assert.Equal(t, 1, tr.pushes(1, w1), "worker 1's data, which rank 1 holds, pushed again")
	assert.Nil(t, hs[0].r.Status().RePush, "a later try pending after the save again replicated")
}

// pytorchTwoWorkers is the replicator.yaml of rank of a two-node pytorch job with two workers
// per node, each node the other's peer.
func pytorchTwoWorkers(rank int) string {
	return fmt.Sprintf("job-name: job\nframework: pytorch\nnode-rank: %d\nnodes: 2\npeer-ranks: [%d]\nworkers-per-node: 2\nbackup-interval-minutes: 30", rank, 1-rank)
}

// workerSave saves step of worker w (on rank) as PyTorch does, a .save file closed, and returns
// the data name its .meta names once it is sealed.
func (h *harness) workerSave(step int64, rank, w int, content string) string {
	h.t.Helper()
	name := marker("job", step, rank, w, layout.MarkerSave)
	h.r.Opened(true)
	require.NoError(h.t, os.WriteFile(h.path(name), []byte(content), 0o644))
	h.r.Flushed(name)
	h.r.Closed(name)
	meta := marker("job", step, rank, w, layout.MarkerMeta)
	var data string
	h.eventually("the save sealed", func() string {
		data = strings.TrimSpace(h.read(meta)) + ".data"
		if h.read(data) != content {
			return fmt.Sprintf("%s names %q, not the data of %q", meta, data, content)
		}
		return ""
	})
	return data
}

// blockPushesTo makes the pushes to rank wait until release (called at the test's end too).
func blockPushesTo(t *testing.T, tr *memTransport, rank int) (release func()) {
	block := make(chan struct{})
	tr.mu.Lock()
	tr.block = map[int]chan struct{}{rank: block}
	tr.mu.Unlock()
	release = sync.OnceFunc(func() { close(block) })
	t.Cleanup(release)
	return release
}

// earlySave saves step on each rank of the pair as orbaxSave does, with its file pushed early to
// the other rank before the commit, and returns each rank's data name.
func earlySave(hs []*harness, tr *memTransport, step int64) []string {
	var data []string
	for rank, h := range hs {
		h.t.Helper()
		tmp := fmt.Sprintf("%d%s", step, layout.OrbaxTmpSuffix)
		h.makeTree(tmp, map[string]string{"state": fmt.Sprintf("step %d of rank %d", step, rank)})
		h.waitEarlyTo(tr, 1-rank, tmp, 1, "the step's file pushed early")
		hash, err := layout.HashDir(context.Background(), h.path(tmp))
		require.NoError(h.t, err)
		h.rename(tmp, fmt.Sprint(step))
		data = append(data, "D"+hash+".data")
	}
	return data
}

// waitPushWaiting waits until h sealed step sealed while a push to its peer waits (blockPushesTo).
func waitPushWaiting(h *harness, tr *memTransport, sealed int64) {
	h.t.Helper()
	h.eventually(fmt.Sprintf("step %d sealed, and a push waiting", sealed), func() string {
		tr.mu.Lock()
		blocked := tr.blocked
		tr.mu.Unlock()
		if st := h.r.Status(); st.Sealed != sealed || blocked == 0 {
			return fmt.Sprintf("sealed %d, %d pushes waiting", st.Sealed, blocked)
		}
		return ""
	})
}

// Steps saved while an earlier step's push is still running are not all pushed in turn: only the
// newest is, and the files of the others pushed early are dropped on the peer. Pushed in turn
// over a link slower than the job's saves, every step waiting for its push was kept in RAM until
// the RAM was full; the job's saves then failed with ENOSPC and the peers, just as full, refused
// every push, also once the link was fast again (a black-box run).
func TestStepsSupersededBeforeTheirPushAreNotPushed(t *testing.T) {
	t.Parallel()
	hs, tr := newPair(t)
	release := blockPushesTo(t, tr, 1) // rank 0's pushes to rank 1 wait
	// rank 0's data, by step
	data := map[int64]string{}
	for step := int64(1); step <= 4; step++ {
		data[step] = earlySave(hs, tr, step)[0]
	}
	waitPushWaiting(hs[0], tr, 4)
	release()
	for _, h := range hs {
		h.eventually("step 4 replicated", func() string {
			if st := h.r.Status(); st.Replicated != 4 || st.Committed != 4 {
				return fmt.Sprintf("latest committed %d, replicated %d", st.Committed, st.Replicated)
			}
			return ""
		})
	}
	assert.Equal(t, 1, tr.pushes(1, data[1]), "step 1, whose push was running")
	assert.Equal(t, 0, tr.pushes(1, data[2]), "step 2, superseded before its push")
	assert.Equal(t, 0, tr.pushes(1, data[3]), "step 3, superseded before its push")
	assert.Equal(t, 1, tr.pushes(1, data[4]), "step 4, the newest")
	tr.mu.Lock()
	drops := slices.Clone(tr.drops)
	tr.mu.Unlock()
	for _, step := range []int64{2, 3} {
		group := fmt.Sprintf("1/%d%s", step, layout.OrbaxTmpSuffix)
		assert.Contains(t, drops, group, "the files of step %d pushed early, dropped on rank 1", step)
	}
	time.Sleep(300 * time.Millisecond) // later tries of a failed push would come after 50 ms
	assert.Nil(t, hs[0].r.Status().RePush, "a skipped push is not tried again")
	assert.Equal(t, 0, tr.pushes(1, data[2])+tr.pushes(1, data[3]))
	for _, l := range hs[0].lines(layout.ReplicatorErrorsName) {
		assert.NotContains(t, l, "replicating step", "a skipped push is no failure told to the job")
	}
}

// With the RAM filling, the steps between the latest replicated one and the newest step every
// node committed are freed: the latest replicated survives a node's loss, and every node holds
// the newer one. Kept while no push got through (peers whose RAM was full refused them), they
// filled the RAM for good: the job's saves failed with ENOSPC (a black-box run).
func TestStepsBetweenTheReplicatedAndTheCommittedOneGoWhenRAMFills(t *testing.T) {
	t.Parallel()
	hs, tr := newPair(t)
	ownSteps := func(h *harness) []int64 {
		var steps []int64
		for _, s := range h.r.Status().Steps {
			if s.Rank == rank(h, hs) {
				steps = append(steps, s.Step)
			}
		}
		slices.Sort(steps)
		return steps
	}
	save := func(step int64) {
		var wg sync.WaitGroup
		for r, h := range hs {
			wg.Go(func() { h.orbaxSave(step, map[string]string{"state": fmt.Sprintf("step %d of rank %d", step, r)}) })
		}
		wg.Wait()
		for _, h := range hs {
			waitCommitted(h, step)
		}
	}
	save(1)
	for _, h := range hs {
		h.eventually("step 1 replicated", func() string {
			if st := h.r.Status(); st.Replicated != 1 {
				return fmt.Sprintf("latest replicated %d", st.Replicated)
			}
			return ""
		})
	}
	tr.mu.Lock()
	tr.failTo[0], tr.failTo[1] = true, true // no push gets through any more
	tr.mu.Unlock()
	for step := int64(2); step <= 4; step++ {
		save(step)
	}
	// With room to spare, every step newer than the latest replicated one stays.
	for _, h := range hs {
		assert.Equal(t, []int64{1, 2, 3, 4}, ownSteps(h), "rank %d's steps in RAM, the RAM nearly empty", rank(h, hs))
	}
	// The RAM 3/4 full (the harness's namespace charges nothing itself): the next step's sync
	// frees the steps between step 1, the latest replicated, and it.
	charges := make([]int64, len(hs))
	chargeTo := func(num, den int64) {
		for i, h := range hs {
			total, used := h.spool.Usage()
			c := total/den*num - used
			h.spool.Charge(c)
			charges[i] += c
		}
	}
	defer func() {
		for i, h := range hs {
			h.spool.Charge(-charges[i])
		}
	}()
	want := func(what string, steps ...int64) {
		for _, h := range hs {
			h.eventually(what, func() string {
				if got := ownSteps(h); !slices.Equal(got, steps) {
					return fmt.Sprintf("steps in RAM %v, want %v", got, steps)
				}
				return ""
			})
			if st := h.r.Status(); st.Replicated != 1 {
				t.Errorf("rank %d: latest replicated %d, want 1", rank(h, hs), st.Replicated)
			}
		}
	}
	chargeTo(3, 4)
	save(5)
	want("steps 2 to 4 freed", 1, 5)
	// Still more than half full: the RAM still counts as filling, and step 5 goes at the next
	// sync. (Freed only while 3/4 full, the steps a push's time brought filled it again.)
	chargeTo(5, 8)
	save(6)
	want("step 5 freed", 1, 6)
	// Less than half full: the steps stay again.
	chargeTo(1, 4)
	save(7)
	want("step 6 kept, the RAM filling no more", 1, 6, 7)
}

// A failed push of a step that a newer step of the node supersedes is not tried again: the newer
// step is pushed at once. The tries (three, 0.5 s and 1 s apart) held the newer step back, and
// the syncs behind it, while a peer whose RAM was full refused every push (a black-box run).
func TestFailedPushOfASupersededStepIsNotTriedAgain(t *testing.T) {
	t.Parallel()
	hs, tr := newPair(t)
	release := blockPushesTo(t, tr, 1) // rank 0's pushes to rank 1 wait
	for step := int64(1); step <= 2; step++ {
		earlySave(hs, tr, step)
	}
	waitPushWaiting(hs[0], tr, 2)
	tr.mu.Lock()
	tr.failTo[1] = true
	before := tr.calls[1]
	tr.mu.Unlock()
	release()
	waitCommitted(hs[0], 2)
	tr.mu.Lock()
	calls := tr.calls[1] - before
	tr.mu.Unlock()
	// Step 1: its one try; step 2: the tries of a peer found down (2).
	assert.Equal(t, 3, calls, "calls to rank 1 once its pushes failed")
}

// Whether a step is pushed is decided once for all the workers of a node: a step whose first
// worker's push started before a newer step was saved is pushed for every worker. Decided per
// worker, with pushes slower than the saves, worker 0 of each step was pushed and worker 1 was
// not (its next step was queued by then): no step was ever replicated (a review).
func TestEveryWorkerOfAStepBeingPushedIsPushed(t *testing.T) {
	t.Parallel()
	hs, tr, _ := rePushPair(t, pytorchTwoWorkers)
	release := blockPushesTo(t, tr, 1) // rank 0's pushes to rank 1 wait
	save := func(rank, w int, step int64) string {
		return hs[rank].workerSave(step, rank, w, fmt.Sprintf("step %d rank %d worker %d", step, rank, w))
	}
	data := map[[2]int64]string{} // rank 0's, by step and worker
	for rank := range 2 {
		for w := range 2 {
			if d := save(rank, w, 1); rank == 0 {
				data[[2]int64{1, int64(w)}] = d
			}
		}
	}
	hs[0].eventually("worker 0's push of step 1 waiting", func() string {
		tr.mu.Lock()
		defer tr.mu.Unlock()
		if tr.blocked == 0 {
			return "no push waiting"
		}
		return ""
	})
	// Step 2 is saved, by both workers, while worker 0's push of step 1 runs.
	for rank := range 2 {
		for w := range 2 {
			if d := save(rank, w, 2); rank == 0 {
				data[[2]int64{2, int64(w)}] = d
			}
		}
	}
	release()
	hs[0].eventually("step 2 replicated", func() string {
		if st := hs[0].r.Status(); st.Replicated != 2 {
			return fmt.Sprintf("latest replicated %d", st.Replicated)
		}
		return ""
	})
	assert.Equal(t, 1, tr.pushes(1, data[[2]int64{1, 0}]), "step 1 worker 0")
	assert.Equal(t, 1, tr.pushes(1, data[[2]int64{1, 1}]), "step 1 worker 1: its step was being pushed")
	assert.Equal(t, 1, tr.pushes(1, data[[2]int64{2, 0}]), "step 2 worker 0")
	assert.Equal(t, 1, tr.pushes(1, data[[2]int64{2, 1}]), "step 2 worker 1")
}

// A sync that waits shows in the status once it has waited SyncWaitShown: the steps committed
// after it wait behind it, their pushes too (a black-box run: during a partition from rank 0, a
// step committed meanwhile got no push for minutes, and the status said nothing of it).
func TestALongSyncShowsInTheStatus(t *testing.T) {
	t.Parallel()
	clock := newFakeClock(baseTime)
	hs, _ := newPairWith(t, harnessConfig{clock: clock})
	hs[0].orbaxSave(1, map[string]string{"state": "rank 0"}) // rank 1 does not save: the sync waits
	hs[0].eventually("step 1 committed, its sync waiting", func() string {
		if c := hs[0].r.SyncedCommitted(); c != 1 {
			return fmt.Sprintf("latest synced %d", c)
		}
		return ""
	})
	clock.Set(baseTime.Add(tiers.SyncWaitShown - time.Second))
	assert.Nil(t, hs[0].r.Status().Syncing, "shown before it waited long")
	clock.Set(baseTime.Add(tiers.SyncWaitShown))
	hs[0].eventually("the sync in the status", func() string {
		if s := hs[0].r.Status().Syncing; s == nil || s.Step != 1 {
			return fmt.Sprintf("syncing %+v", s)
		}
		return ""
	})
	// It names the rank it waits for (it said "every node's report": black-box h58).
	assert.Contains(t, hs[0].r.Status().Syncing.WaitingFor, "1 of 2 nodes reported it to the coordinator (rank 0); not yet rank 1")
	hs[1].orbaxSave(1, map[string]string{"state": "rank 1"})
	hs[0].eventually("the sync done", func() string {
		if st := hs[0].r.Status(); st.Syncing != nil || st.Replicated != 1 {
			return fmt.Sprintf("syncing %+v, latest replicated %d", st.Syncing, st.Replicated)
		}
		return ""
	})
}

// TestALongSyncIsToldToTheJob: a sync that waits long is told to the job once, with the ranks
// it waits for: one stuck on a lost rank said nothing anywhere (black-box h58).
func TestALongSyncIsToldToTheJob(t *testing.T) {
	t.Parallel()
	hs, _ := newPairWith(t, harnessConfig{})
	hs[0].r.SetSyncLineAfter(200 * time.Millisecond)
	hs[0].orbaxSave(1, map[string]string{"state": "rank 0"}) // rank 1 does not save: the sync waits
	want := "step 1's sync with the coordinator (rank 0) has waited 200ms: 1 of 2 nodes reported it to the coordinator (rank 0); not yet rank 1"
	hs[0].eventually("the line", func() string {
		for _, l := range hs[0].lines(layout.ReplicatorErrorsName) {
			if strings.Contains(l, want) {
				return ""
			}
		}
		return fmt.Sprintf("replicator.errors = %q", hs[0].lines(layout.ReplicatorErrorsName))
	})
	hs[0].orbaxSave(2, map[string]string{"state": "rank 0"})
	time.Sleep(400 * time.Millisecond)
	n := 0
	for _, l := range hs[0].lines(layout.ReplicatorErrorsName) {
		if strings.Contains(l, "sync with the coordinator (rank 0) has waited") {
			n++
		}
	}
	assert.Equal(t, 1, n, "told once per incarnation")
}
