package tiers_test

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/replication"
)

// A node pushes a step to all its peers at once: a peer that does not answer holds up neither
// the replica on another peer nor, once it answers, its own.
func TestPushesToPeersRunInParallel(t *testing.T) {
	t.Parallel()
	job := replication.NewJob(replication.Options{LagTimeout: 10 * time.Second})
	tr := &memTransport{nodes: map[int]*harness{}, failTo: map[int]bool{}, early: map[string][]layout.FileDigest{}}
	var hs []*harness
	for rank := range 3 {
		h := newHarness(t, harnessConfig{coord: replication.LocalClient{Job: job}, peers: tr})
		tr.nodes[rank] = h
		hs = append(hs, h)
	}
	peers := []string{"[1, 2]", "[0]", "[0]"} // rank 0 pushes to rank 1 first, then rank 2
	var wg sync.WaitGroup
	for rank, h := range hs {
		wg.Go(func() {
			h.yamlOrbax(withKeys("nodes: 3", fmt.Sprintf("node-rank: %d", rank), "peer-ranks: "+peers[rank]))
		})
	}
	wg.Wait()
	for _, h := range hs {
		h.waitExists(layout.PrerestoreName)
	}
	release := make(chan struct{})
	tr.mu.Lock()
	tr.block = map[int]chan struct{}{1: release}
	tr.mu.Unlock()

	hs[0].orbaxSave(1, checkpointFiles("1"))
	meta := marker("job", 1, 0, 0, layout.MarkerMeta)
	hs[2].waitExists(meta) // while the push to rank 1 waits
	if hs[1].exists(meta) {
		t.Fatalf("rank 1 holds %s while its pushes are blocked", meta)
	}
	// The push running shows in status (a long one showed nothing; found by a black-box run).
	hs[0].eventually("the running push in status", func() string {
		if p := hs[0].r.Status().Pushing; len(p) != 1 || p[0].Step != 1 || p[0].Rank != 1 || p[0].Attempt != 1 || p[0].Started.IsZero() {
			return fmt.Sprintf("status shows pushes %+v, want step 1 to rank 1", p)
		}
		return ""
	})
	close(release)
	hs[1].waitExists(meta)
	hs[0].eventually("no push in status once done", func() string {
		if p := hs[0].r.Status().Pushing; len(p) != 0 {
			return fmt.Sprintf("status shows pushes %+v once done", p)
		}
		return ""
	})
}
