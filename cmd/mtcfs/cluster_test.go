package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mtcfs/mtcfs/internal/jobsim"
)

// cluster is three agents on one machine sharing a backup location: a three-node job.
type cluster struct {
	nodes  []repNode
	agents []*agent
	backup string
}

func newCluster(t *testing.T, n int) *cluster { return newClusterWith(t, n, nil) }

// newClusterWith starts n agents, rank r with the extra mount flags args(r) (nil: none), e.g.
// --listen on its own loopback address or --advertise through a fault proxy.
func newClusterWith(t *testing.T, n int, args func(rank int) []string) *cluster {
	c := &cluster{backup: t.TempDir()}
	for r := range n {
		node := newRepNode(t)
		node.backupRoot = c.backup
		if args != nil {
			node.args = args(r)
		}
		c.nodes = append(c.nodes, node)
		c.agents = append(c.agents, node.start(t))
	}
	return c
}

func (c *cluster) client(t *testing.T, rank int) *jobsim.Orbax {
	o := orbaxClient(t, c.nodes[rank].dir, "trio", 60)
	o.Rank, o.Nodes = rank, len(c.nodes)
	return o
}

// restoresStep starts o's job and checks that it restores step, byte for byte.
func restoresStep(ctx context.Context, o *jobsim.Orbax, step int64) error {
	got, found, err := o.Start(ctx)
	if err == nil && (!found || got != step) {
		return fmt.Errorf("restored step %d (found %v), want %d", got, found, step)
	}
	if err == nil {
		err = o.VerifyRestored(ctx, step)
	}
	return err
}

// all runs f for every rank at once, as the job's processes do.
func (c *cluster) all(t *testing.T, f func(rank int) error) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make([]error, len(c.nodes))
	for r := range c.nodes {
		wg.Go(func() { errs[r] = f(r) })
	}
	wg.Wait()
	for r, err := range errs {
		require.NoError(t, err, "rank %d", r)
	}
}

// startAll starts a client on every rank and checks they all restore want (0: nothing).
func (c *cluster) startAll(t *testing.T, ctx context.Context, want int64) []*jobsim.Orbax {
	t.Helper()
	clients := make([]*jobsim.Orbax, len(c.nodes))
	c.all(t, func(r int) error {
		clients[r] = c.client(t, r)
		step, found, err := clients[r].Start(ctx)
		if err == nil && (step != want || found != (want > 0)) {
			t.Errorf("rank %d restored step %d (found %v), want %d", r, step, found, want)
		}
		if err == nil && want > 0 {
			err = clients[r].VerifyRestored(ctx, want)
		}
		return err
	})
	return clients
}

// TestClusterCoordination runs a three-node job on three agents that find each other through
// the shared backup location: the rank-0 agent coordinates the restore negotiation and the
// syncs over gRPC. After a job restart and after kill -9 of one agent, every node restores the
// same step, with verified bytes.
func TestClusterCoordination(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	c := newCluster(t, 3)

	clients := c.startAll(t, ctx, 0)
	for _, step := range []int64{10, 20} {
		c.all(t, func(r int) error { return clients[r].Save(ctx, step) })
	}
	for r := range c.nodes {
		meta := rankMetaPath(c.nodes[r].dir, "trio", 20, r)
		repWait(t, 10*time.Second, fmt.Sprintf("rank %d to seal step 20", r), func() bool { return pathExists(meta) })
	}
	c.startAll(t, ctx, 20) // the job restarts: every node restores 20 from its RAM

	killAgent(t, c.agents[1])
	c.agents[1] = c.nodes[1].start(t)
	require.Contains(t, c.agents[1].log(), "adopted from spool")
	c.startAll(t, ctx, 20)

	regs, err := os.ReadDir(filepath.Join(c.backup, "trio", "agents"))
	require.NoError(t, err)
	require.Len(t, regs, 3, "every rank registers in the backup location")

	// A cleanly stopped agent leaves the registry; the others stay.
	stopAgent(t, c.agents[2])
	_, err = os.Stat(filepath.Join(c.backup, "trio", "agents", "2.json"))
	require.True(t, os.IsNotExist(err), "rank 2's registration should be gone after SIGTERM: %v", err)
	_, err = os.Stat(filepath.Join(c.backup, "trio", "agents", "0.json"))
	require.NoError(t, err)
}

// TestClusterRestoreFromPeer: with peer-ranks set, every sealed step is pushed to the next
// rank over the checksummed peer transfer. A node that is replaced (agent killed, its RAM
// lost) gets its step back from the peer that holds the replica, verified, and every node
// restores the same step.
func TestClusterRestoreFromPeer(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	c := newCluster(t, 3)
	withPeers := func(o *jobsim.Orbax) *jobsim.Orbax {
		o.PeerRanks = []int{(o.Rank + 1) % 3}
		return o
	}
	clients := make([]*jobsim.Orbax, 3)
	c.all(t, func(r int) error {
		clients[r] = withPeers(c.client(t, r))
		_, _, err := clients[r].Start(ctx)
		return err
	})
	// The job waits at the hosts' barrier before its commit: the save is over, so the files
	// it closed are hashed and pushed early even on a busy machine, where both wait while the
	// job saves (tiers/yield.go). The barrier here lasts until rank 2 holds an early file of
	// rank 1 (at most 10 s; a fixed pause was too short once the machine was loaded).
	clients[1].BeforeCommit = func() {
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline) && !holdsEarlyFile(c.nodes[2].spool); {
			time.Sleep(20 * time.Millisecond)
		}
	}
	c.all(t, func(r int) error { return clients[r].Save(ctx, 10) })
	clients[1].BeforeCommit = nil
	// The replica of rank 1's step reaches rank 2: its .meta appears there once verified.
	replica := rankMetaPath(c.nodes[2].dir, "trio", 10, 1)
	repWait(t, 15*time.Second, "rank 1's replica on rank 2", func() bool { return pathExists(replica) })
	// The files were pushed as the job closed them: the sealed push reused them. (The line is
	// logged before the .meta's push; the test's reader of the agent's log may lag.)
	received := regexp.MustCompile(`peer transfer received" .*rank=1 data=D[0-9a-f]{64}\.data .*early_files=[1-9]`)
	repWait(t, 10*time.Second, "rank 2 to log rank 1's files as reaching it before the commit",
		func() bool { return received.MatchString(c.agents[2].log()) })

	// Rank 1's machine is replaced: the agent dies and its RAM is gone.
	killAgent(t, c.agents[1])
	forceUnmount(c.nodes[1].dir)
	c.nodes[1].dropSpool(t)
	c.agents[1] = c.nodes[1].start(t)

	c.all(t, func(r int) error {
		return restoresStep(ctx, withPeers(c.client(t, r)), 10)
	})
	require.Contains(t, c.agents[1].log(), "restored from a peer")
}

// TestStaleRegistrationIsNotMisrouted: rank 1's registration is replaced by a stale one that
// names rank 2's address (as when a dead agent's port is reused). Rank 0's replicas meant for
// rank 1 reach rank 2's agent, which refuses them: no replica lands on the wrong node, and the
// step is not counted as replicated. Once rank 1's true registration is back, replication
// resumes.
func TestStaleRegistrationIsNotMisrouted(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	c := newCluster(t, 3)
	withPeers := func(o *jobsim.Orbax) *jobsim.Orbax {
		o.PeerRanks = []int{(o.Rank + 1) % 3}
		return o
	}
	clients := make([]*jobsim.Orbax, 3)
	c.all(t, func(r int) error {
		clients[r] = withPeers(c.client(t, r))
		_, _, err := clients[r].Start(ctx)
		return err
	})
	regFile := func(rank int) string { return filepath.Join(c.backup, "trio", "agents", fmt.Sprintf("%d.json", rank)) }
	readReg := func(rank int) map[string]any {
		b, err := os.ReadFile(regFile(rank))
		require.NoError(t, err)
		m := map[string]any{}
		require.NoError(t, json.Unmarshal(b, &m))
		return m
	}
	orig, err := os.ReadFile(regFile(1))
	require.NoError(t, err)
	stale := readReg(1)
	stale["addr"] = readReg(2)["addr"]
	stale["instance"] = "0123456789abcdef" // the dead agent that used to be there
	b, err := json.Marshal(stale)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(regFile(1), b, 0o644))

	c.all(t, func(r int) error { return clients[r].Save(ctx, 10) })
	repWait(t, 30*time.Second, "rank 0 to report step 10 not replicated", func() bool {
		b, _ := os.ReadFile(filepath.Join(c.nodes[0].dir, "replicator.errors"))
		return strings.Contains(string(b), "replicating step 10 to rank 1 failed")
	})
	require.Contains(t, c.agents[2].log(), "stale registration", "rank 2 must refuse calls meant for rank 1's agent")
	require.NoFileExists(t, rankMetaPath(c.nodes[2].dir, "trio", 10, 0), "rank 0's replica landed on rank 2")
	require.NotRegexp(t, `peer transfer received" .*rank=0 `, c.agents[2].log())

	require.NoError(t, os.WriteFile(regFile(1), orig, 0o644))
	c.all(t, func(r int) error { return clients[r].Save(ctx, 20) })
	replica := rankMetaPath(c.nodes[1].dir, "trio", 20, 0)
	repWait(t, 30*time.Second, "rank 0's step 20 on rank 1", func() bool { return pathExists(replica) })
}

// holdsEarlyFile reports whether the spool holds a file pushed early by a peer (the receiver's
// peer-incoming/early directory, replication/early.go).
func holdsEarlyFile(spool string) bool {
	found := false
	_ = filepath.WalkDir(spool, func(path string, d os.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() && strings.Contains(path, "/peer-incoming/early/") {
			found = true
			return filepath.SkipAll
		}
		return nil
	})
	return found
}

// TestJobRestartedInAnotherShape: a three-node job saves step 10 (in RAM and in a backup) and
// restarts on two nodes. One node's data is never split across nodes, so the two-node job must
// not restore ranks 0 and 1 of the three-node checkpoint, as it did before without a word: it
// starts from scratch and every rank is told why, for the RAM (each spool recorded the job's
// shape) and for the backup (which records it too). Its own steps restore as usual; back on
// three nodes, the job passes over the two-node steps in RAM and restores step 10 from the
// backup.
func TestJobRestartedInAnotherShape(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	c := newCluster(t, 3)
	client := func(r, nodes int) *jobsim.Orbax {
		o := c.client(t, r)
		o.Nodes, o.BackupIntervalMinutes = nodes, 0.01
		return o
	}
	// start starts a job of n nodes on ranks 0..n-1 and checks what each restores.
	start := func(n int, want int64) [][]string {
		lines := make([][]string, n)
		clients := make([]*jobsim.Orbax, n)
		var wg sync.WaitGroup
		errs := make([]error, n)
		for r := range n {
			wg.Go(func() {
				clients[r] = client(r, n)
				var step int64
				step, _, errs[r] = clients[r].Start(ctx)
				if errs[r] == nil && step != want {
					errs[r] = fmt.Errorf("restored step %d, want %d", step, want)
				}
				if errs[r] == nil && want > 0 {
					errs[r] = clients[r].VerifyRestored(ctx, want)
				}
				lines[r] = clients[r].Errors()
			})
		}
		wg.Wait()
		for r, err := range errs {
			require.NoError(t, err, "rank %d of %d: %s", r, n, c.agents[0].tail(20))
		}
		return lines
	}
	save := func(n int, step int64) {
		var wg sync.WaitGroup
		errs := make([]error, n)
		for r := range n {
			wg.Go(func() { errs[r] = client(r, n).Save(ctx, step) })
		}
		wg.Wait()
		for r, err := range errs {
			require.NoError(t, err, "rank %d saving step %d", r, step)
		}
	}

	start(3, 0)
	save(3, 10)
	backup := waitCompleteBackup(t, c.nodes[0], "trio", 10)
	// Pinning the backup says the shape it restores in.
	out, code := runMtcfs(t, "restore-version", "set", backup, "--backup", "file://"+c.backup, "--job", "trio")
	require.Equal(t, 0, code, "%s", out)
	assert.Contains(t, out, "the backup was taken by a job of 3 nodes × 1 worker, and restores in a job with the same workers per node and number of partitions")
	out, code = runMtcfs(t, "restore-version", "clear", "--backup", "file://"+c.backup, "--job", "trio")
	require.Equal(t, 0, code, "%s", out)
	assert.Contains(t, out, "restore.version of job trio ("+backup+") cleared")
	// Clearing again says there is nothing to clear (before, "cleared" again, as for a job
	// that does not exist).
	out, code = runMtcfs(t, "restore-version", "clear", "--backup", "file://"+c.backup, "--job", "trio")
	require.Equal(t, 0, code, "%s", out)
	assert.Contains(t, out, "job trio has no restore.version in file://"+c.backup+": nothing to clear")

	stopAgent(t, c.agents[2])
	for r, got := range start(2, 0) {
		all := strings.Join(got, "\n")
		assert.Contains(t, all, "step 10 in the nodes' RAM was saved by a job of 3 nodes × 1 worker", "rank %d", r)
		assert.Contains(t, all, "backup "+backup+" was taken by a job of 3 nodes × 1 worker; this job has 2 nodes × 1 worker", "rank %d", r)
		assert.Contains(t, all, "2 checkpoints of a job of another shape and no intact checkpoint is left: starting from scratch", "rank %d", r)
	}
	save(2, 20)
	for r := range 2 {
		meta := rankMetaPath(c.nodes[r].dir, "trio", 20, r)
		repWait(t, 10*time.Second, "step 20 sealed", func() bool { return pathExists(meta) })
	}
	for r, got := range start(2, 20) {
		assert.Empty(t, got, "rank %d restores the two-node job's own step", r)
	}

	// Back on three nodes: rank 2's agent returns with its spool (step 10, three nodes).
	c.agents[2] = c.nodes[2].start(t)
	for r, got := range start(3, 10) {
		all := strings.Join(got, "\n")
		assert.Contains(t, all, "step 20 in the nodes' RAM was saved by a job of 2 nodes × 1 worker", "rank %d", r)
	}
}

// TestLostNodeIsNotASilentFreshStart: a two-node job without peers or a backup loses rank 0's
// machine. Rank 1 still holds its part of step 10, which cannot be completed: the job starts
// from scratch, as it must, and rank 1's part is dropped (a new timeline begins). Before, no
// line anywhere said so; now every rank is told which step was lost and why.
func TestLostNodeIsNotASilentFreshStart(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	c := newCluster(t, 2)
	c.all(t, func(r int) error {
		o := c.client(t, r)
		if _, _, err := o.Start(ctx); err != nil {
			return err
		}
		return o.Save(ctx, 10)
	})
	for r := range 2 {
		meta := rankMetaPath(c.nodes[r].dir, "trio", 10, r)
		repWait(t, 10*time.Second, "step 10 sealed", func() bool { return pathExists(meta) })
	}
	killAgent(t, c.agents[0])
	forceUnmount(c.nodes[0].dir)
	c.nodes[0].dropSpool(t)
	c.agents[0] = c.nodes[0].start(t)

	lines := make([][]string, 2)
	c.all(t, func(r int) error {
		o := c.client(t, r)
		step, found, err := o.Start(ctx)
		if err == nil && found {
			err = fmt.Errorf("restored step %d, want a fresh start", step)
		}
		lines[r] = o.Errors()
		return err
	})
	for r := range 2 {
		all := strings.Join(lines[r], "\n")
		assert.Contains(t, all, "step 10 in the nodes' RAM is incomplete and is not restored: no live node holds a .meta of rank 0 worker 0", "rank %d", r)
		assert.Contains(t, all, "1 incomplete step in RAM and no intact checkpoint is left: starting from scratch", "rank %d", r)
	}
}

// TestStepsOfAFormerShapeAreDroppedNotRelabelled: the spool records the job's shape at each
// restore plan, and vouches for the steps it holds. A two-node job (backup of step 50) runs on
// three nodes (step 30 in RAM), then on two again: the plan passes over step 30 and restores
// step 50 from the backup. Step 30 (≤ 50, so not an abandoned newer step) must not stay under the
// new record: when that restore then failed (rank 0's part of the backup rotted), the next start
// found step 30 complete for two nodes and restored half of the three-node checkpoint.
func TestStepsOfAFormerShapeAreDroppedNotRelabelled(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	c := newCluster(t, 3)
	// run starts a job of n nodes on ranks 0..n-1 (each client's context is cancelled when
	// another rank's start fails, as the job's other processes end with it) and returns what
	// each restored and its error.
	type outcome struct {
		step  int64
		found bool
		err   error
	}
	run := func(n int, then func(r int, o *jobsim.Orbax) error) []outcome {
		out := make([]outcome, n)
		runCtx, cancel := context.WithCancel(ctx)
		defer cancel()
		var wg sync.WaitGroup
		for r := range n {
			wg.Go(func() {
				o := c.client(t, r)
				o.Nodes, o.BackupIntervalMinutes = n, 0.01
				out[r].step, out[r].found, out[r].err = o.Start(runCtx)
				if out[r].err == nil && then != nil {
					out[r].err = then(r, o)
				}
				if out[r].err != nil {
					cancel()
				}
			})
		}
		wg.Wait()
		return out
	}
	stepSealed := func(n int, step int64) {
		for r := range n {
			meta := rankMetaPath(c.nodes[r].dir, "trio", step, r)
			repWait(t, 10*time.Second, fmt.Sprintf("step %d sealed on rank %d", step, r), func() bool { return pathExists(meta) })
		}
	}

	stopAgent(t, c.agents[2])
	for r, o := range run(2, func(r int, o *jobsim.Orbax) error { return o.Save(ctx, 50) }) {
		require.NoError(t, o.err, "rank %d", r)
	}
	backup := waitCompleteBackup(t, c.nodes[0], "trio", 50)

	c.agents[2] = c.nodes[2].start(t)
	for r, o := range run(3, func(r int, o *jobsim.Orbax) error { return o.Save(ctx, 30) }) {
		require.NoError(t, o.err, "rank %d", r)
		require.False(t, o.found, "rank %d: the three-node job restored step %d of the two-node one", r, o.step)
	}
	stepSealed(3, 30)

	// Rank 0's part of the backup rots: restoring step 50 fails on rank 0.
	hash, err := os.ReadFile(rankMetaPath(filepath.Join(c.backup, "trio", backup), "trio", 50, 0))
	require.NoError(t, err)
	rotFile(t, filepath.Join(c.backup, "trio", backup, strings.TrimSpace(string(hash))+".data"))
	// Rank 1, which has its part, is told at once that rank 0's restore failed; before, it
	// waited at the barrier until its job gave up (found by black-box runs).
	errs := make([]error, 2)
	var wg sync.WaitGroup
	for r := range 2 {
		wg.Go(func() {
			o := c.client(t, r)
			o.Nodes, o.BackupIntervalMinutes = 2, 0.01
			_, _, errs[r] = o.Start(ctx)
		})
	}
	wg.Wait()
	require.Error(t, errs[0], "rank 0 restores from a rotted backup")
	var fatal *jobsim.FatalError
	require.True(t, errors.As(errs[1], &fatal), "rank 1: want replicator.failed, got %v\n%s", errs[1], c.agents[1].log())
	assert.Contains(t, strings.Join(fatal.Lines, "\n"), "the restore of another node failed: rank 0: restore of step 50 failed")

	// The job starts again: step 30 is not restored (nor anything: the backup is marked damaged).
	for r, o := range run(2, nil) {
		require.NoError(t, o.err, "rank %d", r)
		assert.False(t, o.found && o.step == 30, "rank %d restored step 30 of the three-node job on two nodes", r)
		assert.False(t, o.found, "rank %d restored step %d, with the only backup of its shape damaged", r, o.step)
	}
}

// rotFile flips a byte of the first regular file under dir, keeping its mtime: bit rot a
// store's listing does not show.
func rotFile(t *testing.T, dir string) {
	t.Helper()
	var victim string
	require.NoError(t, filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && victim == "" && d.Type().IsRegular() {
			victim = p
		}
		return err
	}))
	require.NotEmpty(t, victim, "no data file under %s", dir)
	fi, err := os.Stat(victim)
	require.NoError(t, err)
	data, err := os.ReadFile(victim)
	require.NoError(t, err)
	require.NotEmpty(t, data)
	data[len(data)/2] ^= 0x10
	require.NoError(t, os.WriteFile(victim, data, fi.Mode()))
	require.NoError(t, os.Chtimes(victim, fi.ModTime(), fi.ModTime()))
}

// TestRankZeroMovesToAnotherRunningAgent: a job restarted by its scheduler on the same machines
// with the ranks reassigned (pods rescheduled on node agents), rank 0 now on a machine whose
// agent was rank 1, the former rank 0's agent still running as another rank. Before, the ranks
// that read their replicator.yaml before the new rank 0 registered negotiated with the former
// rank 0's agent, which started an incarnation of its own: two coordinators, each waiting
// for the ranks the other had, and no marker within the job's 300 s (found by a black-box
// run, 4 of 4). Every rank restores the same step, byte for byte, after the move and after
// the move back.
func TestRankZeroMovesToAnotherRunningAgent(t *testing.T) {
	needRoot(t)
	const nodes = 3
	c := newCluster(t, nodes)
	// client returns rank's client running on machine node.
	client := func(rank, node int) *jobsim.Orbax {
		o := orbaxClient(t, c.nodes[node].dir, "trio", 60)
		o.Rank, o.Nodes = rank, nodes
		o.PeerRanks = []int{(rank + 1) % nodes}
		return o
	}
	ctx := repCtx(t)
	c.all(t, func(r int) error {
		_, _, err := client(r, r).Start(ctx)
		return err
	})
	c.all(t, func(r int) error { return client(r, r).Save(ctx, 10) })
	for round, machine := range []func(rank int) int{
		func(r int) int { return (r + 1) % nodes }, // rank 0 on the machine of rank 1, ...
		func(r int) int { return r },               // and back
		func(r int) int { return (r + 2) % nodes }, // rank 0 on the machine of rank 2
	} {
		step := int64(10 * (round + 1))
		ctx := repCtx(t)
		c.all(t, func(r int) error {
			if err := restoresStep(ctx, client(r, machine(r)), step); err != nil {
				return fmt.Errorf("round %d: %w", round, err)
			}
			return nil
		})
		c.all(t, func(r int) error { return client(r, machine(r)).Save(ctx, step+10) })
	}
	// A restart cut short: ranks 0 and 1 start with rank 0 moved again, rank 2 never does, and
	// the job is killed while they wait; then it restarts in the first order. Before, that
	// second start failed FATAL on two ranks (`job coordinator closed: the incarnation is
	// over`) and a third waited its 300 s.
	short := short2(t)
	var half sync.WaitGroup
	for r := range 2 {
		half.Go(func() {
			_, _, err := client(r, (r+1)%nodes).Start(short)
			assert.Error(t, err, "rank %d restored without rank 2", r)
		})
	}
	half.Wait()
	// Rank 1's pod comes up first, half a second before the others: it reaches the agent that
	// was rank 0 of the start cut short while that agent (and rank 2's) still wait in it. Before,
	// rank 1 got markers from that dead start within milliseconds, and the others waited for it
	// until their 300 s ran out (found by a black-box run, 5 times; again on the next restarts).
	staggered := func(first int, machine func(int) int, step int64) {
		t.Helper()
		ctx := repCtx(t)
		c.all(t, func(r int) error {
			if r != first {
				time.Sleep(500 * time.Millisecond)
			}
			return restoresStep(ctx, client(r, machine(r)), step)
		})
	}
	staggered(1, func(r int) int { return r }, 40)
	// The same with the ranks where they were: a start cut short, then rank 1 first.
	for r := range 2 {
		half.Go(func() {
			_, _, err := client(r*2, r*2).Start(short2(t))
			assert.Error(t, err, "rank %d restored without rank 1", r*2)
		})
	}
	half.Wait()
	staggered(1, func(r int) int { return r }, 40)
}

// short2 is the context of a job start that is cut short after 5 s: well past the 3 s a
// coordinator must have waited for its last rank to give the job's next start a grace
// (replication's planStaleAfter). Cut short after 3 s, as it first was, a loaded machine
// answered rank 0's yaml late enough that the next start's first rank came 2.99 s after the
// coordinator began, and got the dead start's plan (a CI failure; the README says so).
func short2(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// TestRestoreFromAPeerThatDoesNotFit: a node replaced with a smaller --memory than its step
// needs gets the step's data from no backup (none was taken yet) and cannot fetch it from the
// peer that holds it. The job is told that a peer holds it and what to do; before, it was told
// the data was nowhere (found by a black-box run of a rolling upgrade).
func TestRestoreFromAPeerThatDoesNotFit(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	c := newCluster(t, 2)
	client := func(r int) *jobsim.Orbax {
		o := c.client(t, r)
		o.PeerRanks = []int{1 - r}
		o.Content = jobsim.Content{Files: 3, FileSize: 8 << 20} // 24 MiB a node
		return o
	}
	c.all(t, func(r int) error {
		o := client(r)
		if _, _, err := o.Start(ctx); err != nil {
			return err
		}
		return o.Save(ctx, 10)
	})
	replica := rankMetaPath(c.nodes[0].dir, "trio", 10, 1)
	repWait(t, 30*time.Second, "rank 1's replica on rank 0", func() bool { return pathExists(replica) })

	killAgent(t, c.agents[1])
	forceUnmount(c.nodes[1].dir)
	c.nodes[1].dropSpool(t)
	c.agents[1] = c.nodes[1].start(t, "--memory", "16MiB")

	errs := make([]error, 2)
	var wg sync.WaitGroup
	for r := range 2 {
		wg.Go(func() { errs[r] = restoresStep(ctx, client(r), 10) })
	}
	wg.Wait()
	require.Error(t, errs[1], "24 MiB cannot be restored within 16 MiB")
	assert.Contains(t, errs[1].Error(), "a peer holds it, but the fetch failed")
	assert.Contains(t, errs[1].Error(), "the checkpoint does not fit in this node's RAM budget: --memory 16.0MiB")
	assert.Contains(t, errs[1].Error(), "restart the agent with a larger --memory")
	assert.NotContains(t, errs[1].Error(), "nor a peer's")
}

// TestMistypedJobNameOnOneRank: one rank's job restarts with a mistyped job-name while the
// job's incarnation runs on the others. The coordinator refuses it, and that node keeps the
// job's checkpoints: they were freed at the handshake, before the refusal, and the job, its
// yaml fixed, restored an older step (found by a black-box run).
func TestMistypedJobNameOnOneRank(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	c := newCluster(t, 2)
	clients := c.startAll(t, ctx, 0)
	c.all(t, func(r int) error { return clients[r].Save(ctx, 10) })
	for r := range 2 {
		meta := rankMetaPath(c.nodes[r].dir, "trio", 10, r)
		repWait(t, 10*time.Second, fmt.Sprintf("rank %d to seal step 10", r), func() bool { return pathExists(meta) })
	}

	typo := c.client(t, 1)
	typo.Job = "trio-typo"
	_, _, err := typo.Start(ctx)
	require.Error(t, err, "the coordinator refuses a job-name its incarnation does not have")
	assert.FileExists(t, rankMetaPath(c.nodes[1].dir, "trio", 10, 1), "rank 1 freed the job's step")
	assert.NotContains(t, c.agents[1].log(), "freed checkpoints of other jobs")
	assert.FileExists(t, filepath.Join(c.nodes[1].spool, "shape.json"), "rank 1 forgot the job's shape, by which it keeps steps for a node's loss")

	c.startAll(t, ctx, 10) // the yaml fixed: the job restores its step
}

// TestUnreplicatedStepsFillingRAMAreTold: with its peer's agent gone, a node keeps every step
// its job saves (each waits for a newer one to replicate) until its RAM is full and the job's
// write fails with ENOSPC. The job is told before that, once, with what to do; it was told only
// that a push failed (found by a black-box run). Told when a failed push leaves no room for
// another step (a budget sized as the README says: the next save fails), or when steps pile up.
func TestUnreplicatedStepsFillingRAMAreTold(t *testing.T) {
	needRoot(t)
	for _, tc := range []struct {
		name     string
		fileSize int64 // two files a step, in a 64 MiB budget
		last     int64 // the step saved last, after the peer's loss: the first told
		warning  string
	}{
		{"sized as the README says", 8 << 20, 2, "and step 2 is kept until a newer step is replicated on every node (latest replicated: step 1)"},
		{"steps pile up", 9 << 19, 5, "and 4 steps (2 to 5) are kept until a newer step is replicated on every node (latest replicated: step 1)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := repCtx(t)
			c := newCluster(t, 2)
			clients := make([]*jobsim.Orbax, 2)
			c.all(t, func(r int) error {
				clients[r] = c.client(t, r)
				clients[r].PeerRanks = []int{1 - r}
				clients[r].Content = jobsim.Content{Files: 2, FileSize: tc.fileSize}
				_, _, err := clients[r].Start(ctx)
				return err
			})
			c.all(t, func(r int) error { return clients[r].Save(ctx, 1) })
			replica := rankMetaPath(c.nodes[0].dir, "trio", 1, 1)
			repWait(t, 20*time.Second, "rank 1's step 1 on rank 0", func() bool { return pathExists(replica) })
			repWait(t, 20*time.Second, "step 1 replicated on every node, for rank 0", func() bool {
				out, _ := runMtcfs(t, "status", c.nodes[0].dir)
				return strings.Contains(out, "latest replicated on every node 1")
			})

			killAgent(t, c.agents[1]) // rank 0's pushes fail from now on; its job saves on
			forceUnmount(c.nodes[1].dir)
			for step := int64(2); step <= tc.last; step++ {
				require.NoError(t, clients[0].Save(ctx, step), "step %d", step)
				waitStepSealed(t, c.nodes[0].dir, "trio", step)
				if step < tc.last {
					time.Sleep(2 * time.Second) // its push fails meanwhile
					assert.NotContains(t, c.agents[0].log(), "kept until a newer step is replicated", "before step %d", step)
				}
			}
			repWait(t, 15*time.Second, "the warning", func() bool { return strings.Contains(c.agents[0].log(), tc.warning) })
			require.Contains(t, c.agents[0].log(), "give the agent a larger --memory")
			b, err := os.ReadFile(filepath.Join(c.nodes[0].dir, "replicator.errors"))
			require.NoError(t, err)
			require.Contains(t, string(b)+strings.Join(clients[0].Errors(), "\n"), tc.warning)
			require.Equal(t, 1, strings.Count(c.agents[0].log(), `level=WARN msg="this node's RAM is `), "told once")
		})
	}
}

// TestNodeRefusingAReplicaForRoomTellsItsJob: rank 1's RAM (under the README's sizing) holds
// its steps 1 and 2 and rank 0's step 1, and has no room for rank 0's step 2. Rank 0's job is
// told its push failed; rank 1's steps wait for that replica, nothing is freed, and its job's
// saves fail with ENOSPC from then on. Its job was told nothing (found by a black-box run); it is
// told now, once, what fills the RAM and what to do.
func TestNodeRefusingAReplicaForRoomTellsItsJob(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	c := newClusterWith(t, 2, func(rank int) []string {
		if rank == 0 {
			return []string{"--memory", "256MiB"}
		}
		return nil // 64 MiB
	})
	clients := make([]*jobsim.Orbax, 2)
	startJob := func() { // 20 MiB per node and step: under the README's sizing on rank 1
		c.all(t, func(r int) error {
			clients[r] = c.client(t, r)
			clients[r].PeerRanks = []int{1 - r}
			clients[r].Content = jobsim.Content{Files: 2, FileSize: 10 << 20}
			_, _, err := clients[r].Start(ctx)
			return err
		})
	}
	startJob()
	c.all(t, func(r int) error { return clients[r].Save(ctx, 1) })
	repWait(t, 20*time.Second, "step 1 replicated on every node, for rank 1", func() bool {
		out, _ := runMtcfs(t, "status", c.nodes[1].dir)
		return strings.Contains(out, "latest replicated on every node 1")
	})
	c.all(t, func(r int) error { return clients[r].Save(ctx, 2) })
	const told = "a peer's replica was refused for lack of room on this node: this node's RAM is"
	repWait(t, 20*time.Second, "rank 1's job told", func() bool {
		b, _ := os.ReadFile(filepath.Join(c.nodes[1].dir, "replicator.errors"))
		return strings.Contains(string(b), told)
	})
	require.Contains(t, c.agents[1].log(), "and step 2 is kept until a newer step is replicated on every node (latest replicated: step 1)")
	repWait(t, 30*time.Second, "rank 0's job told its push failed", func() bool {
		b, _ := os.ReadFile(filepath.Join(c.nodes[0].dir, "replicator.errors"))
		return strings.Contains(string(b), "the receiving node's RAM is full")
	})
	b, _ := os.ReadFile(filepath.Join(c.nodes[0].dir, "replicator.errors"))
	require.NotContains(t, string(b), told, "rank 0 refused nothing")

	// The job restarts: rank 1's RAM still has no room for rank 0's next step, and its job is
	// told again, though no step of its own waits now (found by a black-box re-run).
	startJob()
	require.NoError(t, clients[0].Save(ctx, 3))
	clients[1].Save(ctx, 3) // fails with ENOSPC, or not: the line is what matters
	repWait(t, 30*time.Second, "rank 1's restarted job told", func() bool {
		b, _ := os.ReadFile(filepath.Join(c.nodes[1].dir, "replicator.errors"))
		return strings.Contains(string(b)+strings.Join(clients[1].Errors(), "\n"), told)
	})
}

// TestJobToldItsStepsWereFreedForAnotherJob: a one-node job restarted once under a mistyped
// job-name frees the job's steps (another job took the mount). Back under its name, the job is
// told what was freed and by which job; it restored nothing without a word (found by a
// black-box run).
func TestJobToldItsStepsWereFreedForAnotherJob(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	n := newRepNode(t)
	a := n.start(t)
	o := startedOrbax(t, ctx, n.dir, "train", 60)
	for _, step := range []int64{1, 2} {
		require.NoError(t, o.Save(ctx, step))
		waitStepSealed(t, n.dir, "train", step)
	}
	typo := orbaxClient(t, n.dir, "trian", 60)
	_, found, err := typo.Start(ctx)
	require.NoError(t, err)
	require.False(t, found)
	assert.Contains(t, strings.Join(typo.Errors(), "\n"), "this node's RAM held checkpoints of other jobs (train-s2-n0-w0.meta); they were freed") // step 1 went once 2 was saved

	stopAgent(t, a) // the record survives a restart of the agent too
	b := n.start(t)
	o = orbaxClient(t, n.dir, "train", 60)
	_, found, err = o.Start(ctx)
	require.NoError(t, err)
	require.False(t, found, "no peer nor backup holds the steps")
	told := "this node's RAM held step(s) 2 of this job; they were freed at "
	errs := strings.Join(o.Errors(), "\n")
	require.Contains(t, errs, told)
	require.Contains(t, errs, "when job trian, another job-name, restored on this mount")
	o = orbaxClient(t, n.dir, "train", 60) // told once
	_, _, err = o.Start(ctx)
	require.NoError(t, err)
	require.NotContains(t, strings.Join(o.Errors(), "\n"), told)
	stopAgent(t, b)
}
