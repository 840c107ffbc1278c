package tiers_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/replication"
	"github.com/mtcfs/mtcfs/tiers"
)

// memTransport connects the replicators of in-process harnesses: pushes land in the target's
// AcceptReplica, early pushes and drops are recorded. failTo makes every call to a rank fail.
type memTransport struct {
	mu     sync.Mutex
	nodes  map[int]*harness
	failTo map[int]bool
	block  map[int]chan struct{}          // pushes to a rank wait until its channel is closed
	early  map[string][]layout.FileDigest // "rank/group" → digests pushed early
	// failEarly makes that many next early pushes fail (a peer briefly unreachable).
	failEarly int
	// fetchFaults makes that many next fetches move a byte, wait fetchFaultAfter and fail: for
	// want of an answer if fetchFaultMoves (a connection reset in the middle of a transfer),
	// else with data that fails its check; fetches counts the fetches tried.
	fetchFaults     int
	fetchFaultAfter time.Duration
	fetchFaultMoves bool
	fetches         int
	consum          []string       // "rank/group:acked" of each consuming push
	drops           []string       // "rank/group"
	calls           map[int]int    // calls to each rank, failed or not
	pushed          map[string]int // "rank/name" → pushes of name that reached rank
	blocked         int            // pushes that waited on a block channel
}

var _ tiers.EarlyTransport = (*memTransport)(nil)

func (m *memTransport) target(rank int) (*harness, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.calls == nil {
		m.calls = map[int]int{}
	}
	m.calls[rank]++
	if m.failTo[rank] {
		return nil, errors.New("injected: peer unreachable")
	}
	return m.nodes[rank], nil
}

func (m *memTransport) Push(ctx context.Context, inc tiers.Incarnation, rank int, name, path string) error {
	m.mu.Lock()
	block := m.block[rank]
	if block != nil {
		m.blocked++
	}
	m.mu.Unlock()
	if block != nil {
		select {
		case <-block:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	h, err := m.target(rank)
	if err != nil {
		return err
	}
	dst := filepath.Join(h.spool.Dir(), "incoming", fmt.Sprintf("%d-%s", time.Now().UnixNano(), name))
	if err := os.MkdirAll(filepath.Dir(dst), 0o700); err != nil {
		return err
	}
	if info, err := os.Stat(path); err != nil {
		return err
	} else if info.IsDir() {
		err = os.CopyFS(dst, os.DirFS(path))
		if err != nil {
			return err
		}
	} else if b, err := os.ReadFile(path); err != nil {
		return err
	} else if err := os.WriteFile(dst, b, 0o644); err != nil {
		return err
	}
	m.mu.Lock()
	if m.pushed == nil {
		m.pushed = map[string]int{}
	}
	m.pushed[fmt.Sprintf("%d/%s", rank, name)]++
	m.mu.Unlock()
	return h.r.AcceptReplica(ctx, inc.Config.JobName, inc.Config.NodeRank, name, dst)
}

// pushes counts the pushes of name that reached rank.
func (m *memTransport) pushes(rank int, name string) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.pushed[fmt.Sprintf("%d/%s", rank, name)]
}

func (m *memTransport) Fetch(ctx context.Context, inc tiers.Incarnation, rank int, name, dir string, progress func(done, total int64)) error {
	m.mu.Lock()
	m.fetches++
	fault, after, moves := m.fetchFaults > 0, m.fetchFaultAfter, m.fetchFaultMoves
	if fault {
		m.fetchFaults--
	}
	m.mu.Unlock()
	if fault {
		progress(1, 2)
		time.Sleep(after)
		if moves { // the link: a reset
			return noAnswerErr{errors.New("injected: connection reset by peer, after a byte")}
		}
		return errors.New("injected: the data fails its check")
	}
	h, err := m.target(rank)
	if err != nil {
		return err
	}
	src, err := h.r.SealedPath(name)
	if err != nil {
		return err
	}
	return os.CopyFS(filepath.Join(dir, name), os.DirFS(src))
}

func (m *memTransport) PushEarly(ctx context.Context, inc tiers.Incarnation, rank int, group, path string) (layout.FileDigest, error) {
	if _, err := m.target(rank); err != nil {
		return layout.FileDigest{}, err
	}
	m.mu.Lock()
	fail := m.failEarly > 0
	if fail {
		m.failEarly--
	}
	m.mu.Unlock()
	if fail {
		return layout.FileDigest{}, errors.New("injected: early push failed")
	}
	f, err := os.Open(path)
	if err != nil {
		return layout.FileDigest{}, err
	}
	defer f.Close()
	info, err := f.Stat()
	if err != nil {
		return layout.FileDigest{}, err
	}
	d, err := layout.HashFile(ctx, f, info.Size())
	if err != nil {
		return d, err
	}
	m.mu.Lock()
	k := fmt.Sprintf("%d/%s", rank, group)
	m.early[k] = append(m.early[k], d)
	m.mu.Unlock()
	return d, nil
}

func (m *memTransport) PushConsuming(ctx context.Context, inc tiers.Incarnation, rank int, name, path, group string, acked map[layout.FileDigest]bool) error {
	m.mu.Lock()
	m.consum = append(m.consum, fmt.Sprintf("%d/%s:%d", rank, group, len(acked)))
	m.mu.Unlock()
	return m.Push(ctx, inc, rank, name, path)
}

func (m *memTransport) DropEarly(ctx context.Context, inc tiers.Incarnation, rank int, group string) error {
	m.mu.Lock()
	m.drops = append(m.drops, fmt.Sprintf("%d/%s", rank, group))
	m.mu.Unlock()
	return nil
}

// earlyTo returns how many early pushes of group reached rank.
func (m *memTransport) earlyTo(rank int, group string) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.early[fmt.Sprintf("%d/%s", rank, group)])
}

// waitEarlyTo waits until exactly n early pushes of group have reached rank.
func (h *harness) waitEarlyTo(tr *memTransport, rank int, group string, n int, what string) {
	h.t.Helper()
	h.eventually(what, func() string {
		if got := tr.earlyTo(rank, group); got != n {
			return fmt.Sprintf("%d early pushes, want %d", got, n)
		}
		return ""
	})
}

// consuming returns the consuming pushes so far ("rank/group:acked").
func (m *memTransport) consuming() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Clone(m.consum)
}

// newPair starts the agents of a two-node job whose ranks replicate to each other, coordinated
// by an in-process replication.Job.
func newPair(t *testing.T) ([]*harness, *memTransport) { return newPairWith(t, harnessConfig{}) }

// newPairWith is newPair with both harnesses made from cfg (its coordinator and transport
// are the pair's).
func newPairWith(t *testing.T, cfg harnessConfig) ([]*harness, *memTransport) {
	job := replication.NewJob(replication.Options{LagTimeout: 10 * time.Second})
	tr := &memTransport{nodes: map[int]*harness{}, failTo: map[int]bool{}, early: map[string][]layout.FileDigest{}}
	var hs []*harness
	for rank := range 2 {
		cfg.coord, cfg.peers = replication.LocalClient{Job: job}, tr
		h := newHarness(t, cfg)
		tr.nodes[rank] = h
		hs = append(hs, h)
	}
	var wg sync.WaitGroup
	for rank, h := range hs {
		wg.Go(func() {
			h.yamlOrbax(withKeys("nodes: 2", fmt.Sprintf("node-rank: %d", rank), fmt.Sprintf("peer-ranks: [%d]", 1-rank)))
		})
	}
	wg.Wait()
	for _, h := range hs {
		h.waitExists(layout.PrerestoreName)
	}
	return hs, tr
}

// Files closed inside a step directory are pushed before the step commits, and the sealed push
// reuses them; a step directory removed without a commit is dropped on the peer.
func TestEarlyPushBeforeCommit(t *testing.T) {
	t.Parallel()
	hs, tr := newPair(t)
	files := checkpointFiles("early")
	var wg sync.WaitGroup
	for _, h := range hs {
		wg.Go(func() {
			tmp := "1" + layout.OrbaxTmpSuffix
			h.makeTree(tmp, files)
			// Before the commit, the closed files reach the peer; checkpointFiles has three
			// identical "ok" files, whose content crosses once: 5 distinct digests.
			h.eventually("early pushes", func() string {
				if n := tr.earlyTo(1-rank(h, hs), tmp); n < 5 {
					return fmt.Sprintf("%d of 5 contents pushed early", n)
				}
				return ""
			})
			h.rename(tmp, "1")
		})
	}
	wg.Wait()
	for r, h := range hs {
		h.waitExists(fmt.Sprintf("job-s1-n%d-w0.meta", r))
		// The peer's replica arrives: data and .meta.
		h.waitExists(fmt.Sprintf("job-s1-n%d-w0.meta", 1-r))
	}
	for _, h := range hs {
		h.eventually("step 1 replicated", func() string {
			if st := h.r.Status(); st.Replicated != 1 {
				return fmt.Sprintf("latest_replicated_step %d", st.Replicated)
			}
			return ""
		})
	}
	consum := tr.consuming()
	slices.Sort(consum)
	want := []string{"0/1" + layout.OrbaxTmpSuffix + ":5", "1/1" + layout.OrbaxTmpSuffix + ":5"}
	if !slices.Equal(consum, want) {
		t.Fatalf("consuming pushes %q, want %q", consum, want)
	}

	// An abandoned save: rank 0 writes step 2's files, removes the directory, saves step 3.
	h := hs[0]
	h.makeTree("2"+layout.OrbaxTmpSuffix, checkpointFiles("abandoned"))
	h.eventually("early pushes of step 2", func() string {
		if tr.earlyTo(1, "2"+layout.OrbaxTmpSuffix) == 0 {
			return "none yet"
		}
		return ""
	})
	if err := os.RemoveAll(h.path("2" + layout.OrbaxTmpSuffix)); err != nil {
		t.Fatal(err)
	}
	wg = sync.WaitGroup{}
	for _, h := range hs {
		wg.Go(func() { h.orbaxSave(3, checkpointFiles("three")) })
	}
	wg.Wait()
	h.eventually("the abandoned group dropped on rank 1", func() string {
		tr.mu.Lock()
		defer tr.mu.Unlock()
		if !slices.Contains(tr.drops, "1/2"+layout.OrbaxTmpSuffix) {
			return fmt.Sprintf("drops %q", tr.drops)
		}
		return ""
	})
}

func rank(h *harness, hs []*harness) int { return slices.Index(hs, h) }

// Pushes wait while the job saves on a node without an idle CPU: the early pushes of a step
// whose files the job closed, and a committed step's push, go once the save is over (the job's
// last file closed), and at once when a CPU idles.
func TestPushesYieldToTheJobsSave(t *testing.T) {
	t.Parallel()
	idle := tiers.NewIdleClock(0)
	hs, tr := newPairWith(t, harnessConfig{cpuIdle: idle.Read})
	h := hs[0]
	tmp := "1" + layout.OrbaxTmpSuffix
	release := h.holdOpen(tmp+"/state/held", "held") // the job writes a large file meanwhile
	h.makeTree(tmp, checkpointFiles("yield"))
	time.Sleep(300 * time.Millisecond)
	if n := tr.earlyTo(1, tmp); n != 0 {
		t.Fatalf("%d early pushes while the job was saving on a busy node", n)
	}
	release()
	h.waitEarlyTo(tr, 1, tmp, 6, "the early pushes once the save is over") // 5 contents and held's

	// The commit's push waits for the next save, and goes when a CPU idles.
	release = h.holdOpen("2"+layout.OrbaxTmpSuffix+"/a", "a")
	h.rename(tmp, "1")
	h.waitExists("job-s1-n0-w0.meta")
	replica := "job-s1-n0-w0.meta"
	time.Sleep(300 * time.Millisecond)
	if hs[1].exists(replica) {
		t.Fatal("step 1 was pushed while the job was saving on a busy node")
	}
	idle.Set(2)
	hs[1].waitExists(replica)
	release()
}

// A step whose push fails on any node is synced but not counted as replicated, on every node.
func TestReplicationFailureIsNotCounted(t *testing.T) {
	t.Parallel()
	hs, tr := newPair(t)
	save := func(step int64) {
		var wg sync.WaitGroup
		for _, h := range hs {
			wg.Go(func() { h.orbaxSave(step, checkpointFiles(fmt.Sprint(step))) })
		}
		wg.Wait()
		for r, h := range hs {
			h.waitExists(fmt.Sprintf("job-s%d-n%d-w0.meta", step, r))
		}
	}
	replicated := func(want int64) {
		for r, h := range hs {
			h.eventually(fmt.Sprintf("rank %d latest_replicated_step %d", r, want), func() string {
				if st := h.r.Status(); st.Replicated != want {
					return fmt.Sprintf("latest_replicated_step %d", st.Replicated)
				}
				return ""
			})
		}
	}
	save(1)
	replicated(1)

	tr.mu.Lock()
	tr.failTo[1] = true // rank 0 cannot reach rank 1
	tr.mu.Unlock()
	save(2)
	hs[0].eventually("the failure reported to the job", func() string {
		for _, l := range hs[0].lines(layout.ReplicatorErrorsName) {
			if errLineRE("replicating step 2 to rank 1 failed").MatchString(l) {
				return ""
			}
		}
		return "no error line yet"
	})
	time.Sleep(100 * time.Millisecond)
	replicated(1) // step 2 synced, not replicated

	tr.mu.Lock()
	tr.failTo[1] = false
	tr.mu.Unlock()
	save(3)
	replicated(3)
}

// A peer that does not answer holds up the replication and sync of steps, not their sealing:
// the job's later steps are sealed (their .meta published) while the first push waits.
func TestSlowPeerDoesNotHoldUpSealing(t *testing.T) {
	t.Parallel()
	hs, tr := newPair(t)
	release := make(chan struct{})
	tr.mu.Lock()
	tr.block = map[int]chan struct{}{1: release}
	tr.mu.Unlock()
	for _, step := range []int64{1, 2, 3} {
		var wg sync.WaitGroup
		for _, h := range hs {
			wg.Go(func() { h.orbaxSave(step, checkpointFiles(fmt.Sprint(step))) })
		}
		wg.Wait()
		hs[0].waitExists(fmt.Sprintf("job-s%d-n0-w0.meta", step))
	}
	if st := hs[0].r.Status(); st.Replicated >= 1 {
		t.Fatalf("step %d reported replicated while its push still waits", st.Replicated)
	}
	close(release)
	for r, h := range hs {
		h.eventually(fmt.Sprintf("rank %d: step 3 replicated", r), func() string {
			if st := h.r.Status(); st.Replicated != 3 {
				return fmt.Sprintf("latest replicated %d", st.Replicated)
			}
			return ""
		})
	}
}

// countingCoordinator counts the syncs of each step and what they reported.
type countingCoordinator struct {
	tiers.Coordinator
	mu    sync.Mutex
	syncs map[int64][]tiers.SyncReport // GUARDED_BY(mu)
}

func (c *countingCoordinator) Sync(ctx context.Context, inc tiers.Incarnation, rep tiers.SyncReport) (tiers.SyncDecision, error) {
	c.mu.Lock()
	c.syncs[rep.Step] = append(c.syncs[rep.Step], rep)
	c.mu.Unlock()
	return c.Coordinator.Sync(ctx, inc, rep)
}

// With two workers per node, a step syncs once, after both workers' data replicated — not once
// per worker, and not before the second worker's (slow) push. Worker 1's push fails here, so
// the one sync must report the step not replicated.
func TestMultiWorkerStepSyncsOnceAfterEveryPush(t *testing.T) {
	t.Parallel()
	job := replication.NewJob(replication.Options{LagTimeout: 10 * time.Second})
	tr := &memTransport{nodes: map[int]*harness{}, failTo: map[int]bool{}, early: map[string][]layout.FileDigest{}}
	counter := &countingCoordinator{Coordinator: replication.LocalClient{Job: job}, syncs: map[int64][]tiers.SyncReport{}}
	h := newHarness(t, harnessConfig{coord: counter, peers: tr})
	// A second node that never answers pushes: rank 0's pushes of worker 1's data fail slowly.
	other := newHarness(t, harnessConfig{coord: replication.LocalClient{Job: job}, peers: tr})
	tr.nodes[0], tr.nodes[1] = h, other
	doc := func(rank int) string {
		return fmt.Sprintf("job-name: pt\nframework: pytorch\nnode-rank: %d\nnodes: 2\npeer-ranks: [%d]\nworkers-per-node: 2\nbackup-interval-minutes: 30", rank, 1-rank)
	}
	var wg sync.WaitGroup
	wg.Go(func() { h.yamlNemo(doc(0)) })
	wg.Go(func() { other.yamlNemo(doc(1)) })
	wg.Wait()
	h.waitExists(layout.PrerestoreName)
	other.waitExists(layout.PrerestoreName)

	release := make(chan struct{})
	tr.mu.Lock()
	tr.block = map[int]chan struct{}{1: release}
	tr.mu.Unlock()
	for w := range 2 {
		h.writeFile(fmt.Sprintf("pt-s3-n0-w%d.save", w), fmt.Sprintf("tensor of worker %d", w))
		other.writeFile(fmt.Sprintf("pt-s3-n1-w%d.save", w), fmt.Sprintf("other tensor of worker %d", w))
	}
	h.waitMeta("pt", 3, 0)
	h.waitMeta("pt", 3, 1)
	time.Sleep(50 * time.Millisecond) // both sealed; the pushes to rank 1 wait
	counter.mu.Lock()
	early := len(counter.syncs[3])
	counter.mu.Unlock()
	if early != 0 {
		t.Fatalf("step 3 synced %d time(s) before its pushes finished", early)
	}
	tr.mu.Lock()
	tr.failTo[1] = true // when released, the pushes fail
	tr.mu.Unlock()
	close(release)
	h.eventually("step 3 synced", func() string {
		if c := h.r.SyncedCommitted(); c != 3 {
			return fmt.Sprintf("latest synced %d", c)
		}
		return ""
	})
	time.Sleep(50 * time.Millisecond)
	counter.mu.Lock()
	defer counter.mu.Unlock()
	if got := counter.syncs[3]; len(got) != 1 || got[0].Replicated {
		t.Fatalf("syncs of step 3: %+v, want exactly one, not replicated", got)
	}
}

// A file the job closed right before the commit, and still being hashed when the committed
// step is pushed, crosses to the peer once: the sealed push waits for its early push instead
// of sending it as well. (It went twice: clusterbench's peers held one 16 MiB state file in
// both an early group of the old name, which nothing consumed, and the sealed push.)
func TestLateEarlyFileIsNotSentTwice(t *testing.T) {
	t.Parallel()
	hs, tr := newPair(t)
	h := hs[0]
	tmp := "1" + layout.OrbaxTmpSuffix
	files := map[string]string{"a": "alpha", "b": "bravo", "c": "charlie"}
	hashing, release := make(chan struct{}), make(chan struct{})
	h.ns.mu.Lock()
	h.ns.spoolFiles = func(name string) {
		if name == tmp+"/c" {
			close(hashing)
			<-release // the hasher resolved the file and hashes it for a while
		}
	}
	h.ns.mu.Unlock()
	h.writeFile(tmp+"/a", files["a"])
	h.writeFile(tmp+"/b", files["b"])
	h.waitEarlyTo(tr, 1, tmp, 2, "a and b pushed early")
	h.writeFile(tmp+"/c", files["c"])
	<-hashing
	h.rename(tmp, "1")
	h.waitExists("job-s1-n0-w0.meta") // sealed: the sealer hashed c itself
	// Give the replication the time it takes to reach the peer without waiting for c (it did
	// before the fix, within milliseconds), then let the hash finish.
	deadline := time.Now().Add(2 * time.Second)
	for time.Now().Before(deadline) && !hs[1].exists("job-s1-n0-w0.meta") {
		time.Sleep(10 * time.Millisecond)
	}
	close(release)
	hs[1].waitExists("job-s1-n0-w0.meta")
	h.eventually("step 1 pushed", func() string {
		if len(tr.consuming()) == 0 {
			return "no consuming push yet"
		}
		return ""
	})
	time.Sleep(100 * time.Millisecond) // a late early push of c would come now
	if got, want := tr.consuming(), []string{"1/" + tmp + ":3"}; !slices.Equal(got, want) {
		t.Errorf("consuming pushes %q, want %q (c acknowledged early, not sent with the sealed data)", got, want)
	}
	if n := tr.earlyTo(1, tmp); n != 3 {
		t.Errorf("%d early pushes of the step's files, want 3 (each file once)", n)
	}
}

// A writer that closes a temporary name and renames it onto the final one (tensorstore, and
// jobsim's Orbax) reports the file at the close and again at the rename: its bytes are pushed
// early once (they crossed twice, and the peer held the second copy beside the first).
func TestEarlyFileRenamedByTheWriterIsPushedOnce(t *testing.T) {
	t.Parallel()
	hs, tr := newPair(t)
	h := hs[0]
	tmp := "1" + layout.OrbaxTmpSuffix
	h.writeFile(tmp+"/state/a.__lock", "alpha")
	h.waitEarlyTo(tr, 1, tmp, 1, "a pushed early")
	h.rename(tmp+"/state/a.__lock", tmp+"/state/a")
	h.writeFile(tmp+"/state/b", "bravo") // queued after the rename's report: once b is pushed, so would a have been
	h.waitEarlyTo(tr, 1, tmp, 2, "b pushed early")
	h.rename(tmp, "1")
	hs[1].waitExists("job-s1-n0-w0.meta")
	if n := tr.earlyTo(1, tmp); n != 2 {
		t.Errorf("%d early pushes for two files, want 2", n)
	}
	if got, want := tr.consuming(), []string{"1/" + tmp + ":2"}; !slices.Equal(got, want) {
		t.Errorf("consuming pushes %q, want %q", got, want)
	}
}

// The early hash and push of a closed file read it under a hold (HoldSpoolFile): when the job
// deletes the file during the read, the hold's context ends and the read stops, so that the
// agent lets go of the bytes the job's next write needs (a black-box run: ENOSPC right after
// deleting a file that filled the budget, while its early hash still read it). Every hold ends.
func TestEarlyReadsStopWhenTheFileIsDeleted(t *testing.T) {
	t.Parallel()
	hs, tr := newPair(t)
	h := hs[0]
	tmp := "1" + layout.OrbaxTmpSuffix
	h.ns.mu.Lock()
	h.ns.cancelHold = func(name string, nth int) bool {
		return (name == tmp+"/hashed-while-deleted" && nth == 1) || // the hasher's
			(name == tmp+"/pushed-while-deleted" && nth == 2) // the pusher's
	}
	h.ns.mu.Unlock()
	h.writeFile(tmp+"/a", "alpha")
	h.waitEarlyTo(tr, 1, tmp, 1, "a pushed early")
	h.writeFile(tmp+"/hashed-while-deleted", "bravo")
	h.writeFile(tmp+"/pushed-while-deleted", "charlie")
	h.writeFile(tmp+"/d", "delta") // hashed and pushed after the two: once d is pushed, they were tried
	h.waitEarlyTo(tr, 1, tmp, 2, "d pushed early")
	// The pushes run side by side: the push of pushed-while-deleted may come after d's.
	h.eventually("every read held, and every hold ended", func() string {
		h.ns.mu.Lock()
		holds := maps.Clone(h.ns.holdsOf)
		h.ns.mu.Unlock()
		if holds[tmp+"/pushed-while-deleted"] != 2 || holds[tmp+"/d"] != 2 {
			return fmt.Sprintf("holds %v: want the hash and the push of each file held", holds)
		}
		if n := h.ns.openHolds.Load(); n != 0 {
			return fmt.Sprintf("%d holds open", n)
		}
		return ""
	})
	h.ns.mu.Lock()
	if n := h.ns.holdsOf[tmp+"/hashed-while-deleted"]; n != 1 {
		t.Errorf("%d holds of hashed-while-deleted, want 1: no push after its hash stopped", n)
	}
	h.ns.mu.Unlock()
	if n := tr.earlyTo(1, tmp); n != 2 {
		t.Errorf("%d early pushes, want 2 (a and d: the reads of the deleted files stop)", n)
	}
}

// The early push of a file fails, and the writer then renames the file (a second report of the
// same bytes, not pushed again): the file goes with the sealed data, and the replica is whole.
func TestFailedEarlyFileGoesWithTheSealedData(t *testing.T) {
	t.Parallel()
	hs, tr := newPair(t)
	h := hs[0]
	tmp := "1" + layout.OrbaxTmpSuffix
	tr.mu.Lock()
	tr.failEarly = 1
	tr.mu.Unlock()
	h.writeFile(tmp+"/state/a.__lock", "alpha")
	h.eventually("a's early push failed", func() string {
		tr.mu.Lock()
		defer tr.mu.Unlock()
		if tr.failEarly != 0 {
			return "not tried yet"
		}
		return ""
	})
	h.writeFile(tmp+"/state/b", "bravo")
	h.waitEarlyTo(tr, 1, tmp, 1, "b pushed early")
	h.rename(tmp+"/state/a.__lock", tmp+"/state/a")
	h.eventually("the rename's report hashed", func() string {
		if !slices.Contains(h.ns.opLog(), "spoolfile "+tmp+"/state/a") {
			return "not yet"
		}
		return ""
	})
	h.rename(tmp, "1")
	hs[1].waitExists("job-s1-n0-w0.meta")
	if got, want := tr.consuming(), []string{"1/" + tmp + ":1"}; !slices.Equal(got, want) {
		t.Errorf("consuming pushes %q, want %q (only b acknowledged early)", got, want)
	}
	data, err := os.ReadFile(hs[1].path("job-s1-n0-w0.meta"))
	if err != nil {
		t.Fatal(err)
	}
	replica, err := hs[1].r.SealedPath(string(data) + ".data")
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]string{"state/a": "alpha", "state/b": "bravo"} {
		if got, err := os.ReadFile(filepath.Join(replica, name)); err != nil || string(got) != want {
			t.Errorf("replica %s: %q, %v; want %q", name, got, err, want)
		}
	}
}

// The hashing of the files the job closes waits while the job uses the mount (saving, or
// reading) on a node without an idle CPU: done meanwhile, it took a third of the job's
// small-file write rate (bench/RESULTS.md). It catches up once the job stops, goes at once when
// a CPU idles, and a step committed meanwhile is sealed with its files hashed by the sealer.
func TestEarlyHashYieldsToTheJob(t *testing.T) {
	t.Parallel()
	idle := tiers.NewIdleClock(0)
	h := newHarness(t, harnessConfig{cpuIdle: idle.Read})
	// The reads below come every 10 ms; on a loaded machine (CI: -race beside other packages)
	// one may come later than savingGap, which would rightly let the hasher go. So the reads
	// count for an hour here (a stall of the reader cannot end them) until the test stops them
	// and narrows the gap back. (Writes keep the default gap: the reads phase needs the save
	// over.)
	h.r.SetReadGap(time.Hour)
	h.start(withKeys(), "job")
	hashed := func() int { return h.r.Digests().Len() }
	stillNone := func(what string) {
		t.Helper()
		time.Sleep(300 * time.Millisecond)
		if n := hashed(); n != 0 {
			t.Fatalf("%d files hashed %s", n, what)
		}
	}

	// Saving: a file held open for writing while others are closed.
	tmp := "1" + layout.OrbaxTmpSuffix
	release := h.holdOpen(tmp+"/state/held", "held")
	h.makeTree(tmp, checkpointFiles("hash"))
	stillNone("while the job was saving on a busy node")
	// A step committed meanwhile is sealed: the sealer hashes its files itself.
	h.rename(tmp, "1")
	h.waitExists("job-s1-n0-w0.meta")
	// Reading: the job opens files for reading, every 10 ms, while a file it closed waits. The
	// first read comes before the save ends, so that the hasher has no moment without the job
	// on the mount (it would rightly hash then, and might still be at it below).
	h.r.Opened(false)
	release()
	stop := make(chan struct{})
	reader := make(chan struct{})
	var stopOnce sync.Once
	stopReader := func() { stopOnce.Do(func() { close(stop); <-reader }) }
	t.Cleanup(stopReader) // also when the test fails meanwhile
	go func() {
		defer close(reader)
		for {
			h.r.Opened(false)
			select {
			case <-stop:
				return
			case <-time.After(10 * time.Millisecond):
			}
		}
	}()
	time.Sleep(200 * time.Millisecond) // the save above is over: only the reads go on
	before := hashed()
	h.writeFile("2"+layout.OrbaxTmpSuffix+"/a", "read while")
	time.Sleep(300 * time.Millisecond)
	if n := hashed(); n != before {
		t.Fatalf("%d files hashed while the job was reading on a busy node", n-before)
	}
	stopReader()
	h.r.SetReadGap(50 * time.Millisecond) // savingGap: the reads are over
	h.eventually("the file hashed once the job stopped reading", func() string {
		if n := hashed(); n <= before {
			return fmt.Sprintf("%d files hashed", n-before)
		}
		return ""
	})

	// With a CPU idle, files are hashed while the job saves.
	release = h.holdOpen("3"+layout.OrbaxTmpSuffix+"/held", "held")
	defer release()
	idle.Set(2)
	time.Sleep(100 * time.Millisecond) // a window of idle CPUs
	before = hashed()
	h.writeFile("3"+layout.OrbaxTmpSuffix+"/b", "idle CPUs")
	h.eventually("a file hashed during a save with CPUs idle", func() string {
		if n := hashed(); n <= before {
			return "none yet"
		}
		return ""
	})
}

// nextSave writes a file under dir every 10 ms, counting them in opens (from 0; -1 once
// stopped), until the returned func is called (or the test ends, also on failure: before its
// directories are removed).
func (h *harness) nextSave(dir string, opens *atomic.Int64) (stop func()) {
	opens.Store(0)
	done := make(chan struct{})
	stopped := make(chan struct{})
	var once sync.Once
	go func() {
		defer close(stopped)
		for i := 0; ; i++ {
			h.writeFile(fmt.Sprintf("%s/f%d", dir, i), "next")
			opens.Add(1)
			select {
			case <-done:
				return
			case <-time.After(10 * time.Millisecond):
			}
		}
	}()
	stop = func() {
		once.Do(func() {
			close(done)
			<-stopped
			opens.Store(-1)
		})
	}
	h.t.Cleanup(stop)
	return stop
}

// sealYieldingToTheNextSave starts a job on a busy node that commits step 1 and goes on writing
// a next save (until stop, or the test's end), and checks that step 1's seal yields to it, with
// nothing to hurry it (no commit behind it, the RAM nearly empty).
func sealYieldingToTheNextSave(t *testing.T) (h *harness, stop func()) {
	t.Helper()
	idle := tiers.NewIdleClock(0)
	var opens atomic.Int64
	h = newHarness(t, harnessConfig{cpuIdle: idle.Read, beforeSeal: func(step int64) {
		// Step 1's seal starts once the next save opened a file after the commit.
		for deadline := time.Now().Add(time.Minute); step == 1 && opens.Load() < 2 && time.Now().Before(deadline); {
			time.Sleep(time.Millisecond)
		}
	}})
	h.r.SetNextSaveGap(time.Hour)
	h.start(withKeys(), "job")
	stop = h.nextSave("9"+layout.OrbaxTmpSuffix, &opens) // also stopped at the test's end
	tmp := "1" + layout.OrbaxTmpSuffix
	h.makeTree(tmp, checkpointFiles("1"))
	h.rename(tmp, "1")
	time.Sleep(300 * time.Millisecond)
	if h.exists(marker("job", 1, 0, 0, layout.MarkerMeta)) {
		t.Fatal("step 1 was sealed while the next save went on, on a busy node, with nothing to hurry it")
	}
	return h, stop
}

// TestSealHurriesWithACommitBehind: a seal yielding to the job's next save goes on once another
// commit waits behind it: a job saving back to back kept the sealer yielding, its committed
// steps piled up unsealed, and a save failed with ENOSPC (found by a black-box run).
func TestSealHurriesWithACommitBehind(t *testing.T) {
	t.Parallel()
	h, stop := sealYieldingToTheNextSave(t)
	h.orbaxSave(2, checkpointFiles("2"))
	h.waitSealed("job", 1, "1") // while the next save goes on
	stop()                      // step 2, with nothing behind it, yields until then
	h.r.SetNextSaveGap(50 * time.Millisecond)
	h.waitSealed("job", 2, "2")
}

// Sealing hashes the files the early hasher left while the job saved the step; a save the job
// starts right after the commit, on a node without an idle CPU, goes first (it would otherwise
// pay for that hashing: clusterbench's save started the moment the previous step committed).
// Files opened for writing before the commit do not hold the seal.
func TestSealYieldsToTheNextSave(t *testing.T) {
	t.Parallel()
	idle := tiers.NewIdleClock(0)
	// The sealer notices a next save by an open made after the commit was recorded. A step of a
	// few files is hashed within the 10 ms between two of the test's opens, so the seal waits
	// here (BeforeSeal) until the running next save has written two more files: the first may
	// have been opened before the commit was recorded (CI once sealed step 3 so, its mark
	// taken while the next save's first file was being written); the second was opened after.
	var opens atomic.Int64 // the next save's files written; -1: no next save running
	opens.Store(-1)
	beforeSeal := func(int64) {
		n := opens.Load()
		for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
			if m := opens.Load(); n < 0 || m < 0 || m >= n+2 { // no next save, or it stopped, or two more files
				break
			}
		}
	}
	h := newHarness(t, harnessConfig{cpuIdle: idle.Read, beforeSeal: beforeSeal})
	// The next save below writes a file every 10 ms; on a loaded machine (CI runs this with
	// -race beside other packages) one of its writes may take longer than savingGap, which
	// would rightly end the seal's wait. So while it runs, its opens count for an hour (once
	// one came after the commit, the seal waits whatever the writer's timing), and the test
	// narrows the gap back once it stopped it.
	h.r.SetNextSaveGap(time.Hour)
	h.start(withKeys(), "job")
	release := h.holdOpen("log/held", "a descriptor open since before the commit")
	defer release()
	nextSave := func(dir string) (stop func()) { return h.nextSave(dir, &opens) }

	tmp := "1" + layout.OrbaxTmpSuffix
	h.makeTree(tmp, checkpointFiles("seal"))
	stop := nextSave("2" + layout.OrbaxTmpSuffix)
	h.rename(tmp, "1")
	time.Sleep(500 * time.Millisecond)
	sealed := h.exists("job-s1-n0-w0.meta")
	stop()
	if sealed {
		t.Fatal("step 1 was sealed while the next save went on, on a busy node")
	}
	// The next save is over: with the gap narrowed back to savingGap, the seal goes on.
	h.r.SetNextSaveGap(50 * time.Millisecond)
	h.waitExists("job-s1-n0-w0.meta")

	// The agent's stop ends the wait: a committed step is sealed before Close returns. (The
	// gap is wide again: only the stop can end the wait.)
	h.r.SetNextSaveGap(time.Hour)
	tmp = "3" + layout.OrbaxTmpSuffix
	h.makeTree(tmp, checkpointFiles("stop"))
	stop = nextSave("4" + layout.OrbaxTmpSuffix)
	h.rename(tmp, "3")
	time.Sleep(200 * time.Millisecond)
	if h.exists("job-s3-n0-w0.meta") {
		t.Fatal("step 3 was sealed while the next save went on, on a busy node")
	}
	closed := make(chan struct{})
	go func() { h.close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("the agent's stop waits for the next save")
	}
	stop()
	if !h.exists("job-s3-n0-w0.meta") {
		t.Fatal("step 3, committed, was not sealed by the agent's stop")
	}
}

// TestSealHurriesWithTheRAMHalfUsed: a seal yielding to the job's next save goes on once the RAM
// budget is half used, with no commit behind it: the unsealed step holds RAM that retention
// frees only once a newer step is sealed, and the next save needs it.
func TestSealHurriesWithTheRAMHalfUsed(t *testing.T) {
	t.Parallel()
	h, _ := sealYieldingToTheNextSave(t)
	// The job's files are charged by package fs as they are written; the harness's namespace
	// charges nothing, so the next save's bytes are charged here.
	total, used := h.spool.Usage()
	charge := total/2 - used
	h.spool.Charge(charge)
	defer h.spool.Charge(-charge)
	h.waitSealed("job", 1, "1") // while the next save goes on
}

// restartWithRank0Replaced saves step 1 on a pair, replicated both ways, replaces rank 0's
// machine (its RAM gone) and restarts the job, rank 0's first faults fetches failing after
// faultAfter (moves: having moved bytes, as a link cut; else data that fails its check). It
// returns rank 0's new harness, the transport, the two ranks' data names and files.
func restartWithRank0Replaced(t *testing.T, faults int, faultAfter time.Duration, moves bool) (*harness, *memTransport, []string, []map[string]string) {
	t.Helper()
	hs, tr := newPair(t)
	files := []map[string]string{checkpointFiles("rank0"), checkpointFiles("rank1")}
	data := make([]string, 2)
	var wg sync.WaitGroup
	for r, h := range hs {
		wg.Go(func() { data[r] = h.orbaxSave(1, files[r]) })
	}
	wg.Wait()
	for r, h := range hs {
		h.waitExists(fmt.Sprintf("job-s1-n%d-w0.meta", 1-r)) // replicated both ways
	}
	hs[0].close()
	fresh := newHarness(t, harnessConfig{coord: hs[1].cfg.coord, peers: tr})
	fresh.r.SetFetchRetryWithin(10 * time.Millisecond)
	tr.mu.Lock()
	tr.nodes[0] = fresh
	tr.fetchFaults, tr.fetchFaultAfter, tr.fetchFaultMoves = faults, faultAfter, moves
	tr.mu.Unlock()
	hs[0] = fresh
	for r, h := range hs {
		wg.Go(func() {
			h.yamlOrbax(withKeys("nodes: 2", fmt.Sprintf("node-rank: %d", r), fmt.Sprintf("peer-ranks: [%d]", 1-r), "job-name: job # the restart"))
		})
	}
	wg.Wait()
	return fresh, tr, data, files
}

// noAnswerErr is a peer that did not answer, as the peer transport marks it (tiers.NoAnswer).
type noAnswerErr struct{ error }

func (noAnswerErr) NoAnswer() bool { return true }

// A restore's fetch from the peer holding the data is cut by the link (a reset) later than the
// quick-failure window (a reset 14 s into a fetch, in a black-box run on a link that was fine a
// second later): it is tried again, and the node restores, rather than fail the job's restore.
// A fetch that fails as late for another reason (data that fails its check: each try would
// move it all again) is not: the backup is next.
func TestPeerFetchCutLateByTheLinkIsTriedAgain(t *testing.T) {
	t.Parallel()
	for _, linkCut := range []bool{true, false} {
		t.Run(fmt.Sprintf("linkCut=%v", linkCut), func(t *testing.T) {
			fresh, tr, data, files := restartWithRank0Replaced(t, 1, 50*time.Millisecond, linkCut)
			if linkCut {
				fresh.waitMarkers("job-s1-n0-w0.restore")
				fresh.checkRestoreLink("job-s1-n0-w0.restore", strings.TrimSuffix(data[0], ".data"), files[0])
				tr.mu.Lock()
				defer tr.mu.Unlock()
				if tr.fetches != 2 {
					t.Errorf("%d fetches, want 2: the one cut short, and its second try", tr.fetches)
				}
				return
			}
			fresh.waitExists(layout.ReplicatorFailedName)
			tr.mu.Lock()
			defer tr.mu.Unlock()
			if tr.fetches != 1 {
				t.Errorf("%d fetches, want 1: a late failure of the data is not tried again", tr.fetches)
			}
		})
	}
}

// TestLastHolderThatDoesNotAnswerIsWaitedFor: the only peer holding a node's data, with no
// backup holding it, that does not answer for longer than three tries last (paused: SIGSTOP, a
// frozen VM) is tried again, for up to 2 minutes, rather than fail every rank's restore. Three
// tries in 36 s failed the job for a peer paused 47 s, whose data was whole (black-box h61).
func TestLastHolderThatDoesNotAnswerIsWaitedFor(t *testing.T) {
	t.Parallel()
	// Rank 0's RAM is gone; rank 1 alone holds its data, and no backup does: four tries find
	// no answer.
	fresh, tr, data, files := restartWithRank0Replaced(t, 4, 20*time.Millisecond, true)
	fresh.waitMarkers("job-s1-n0-w0.restore")
	fresh.checkRestoreLink("job-s1-n0-w0.restore", strings.TrimSuffix(data[0], ".data"), files[0])
	// The job is told it waits, once (it heard nothing until the give-up: black-box h63).
	n := 0
	for _, l := range fresh.lines(layout.ReplicatorErrorsName) {
		if strings.Contains(l, "restoring step 1: rank 1, the only node holding this node's data (no backup holds it), does not answer") {
			n++
		}
	}
	if n != 1 {
		t.Errorf("replicator.errors = %q, want one line of the wait", fresh.lines(layout.ReplicatorErrorsName))
	}
	tr.mu.Lock()
	defer tr.mu.Unlock()
	if tr.fetches != 5 {
		t.Errorf("%d fetches, want 5: four tries that found no answer, then the one that restored", tr.fetches)
	}
}
