package tiers_test

import (
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/replication"
)

// TestStressReplicatedStepsSurvive is a seeded model-based test of three in-process agents in a
// ring (each replicates to the next rank) under random saves, push failures, agent restarts and
// the loss of a node's RAM. The invariant: a step the coordinator reported replicated (the
// highest latest_replicated_step any node showed) is always restorable after losing any one
// node, and every node restores the same step with exactly the bytes its rank saved for it.
// MTCFS_SEED=n replays one seed; MTCFS_STRESS_OPS sets the operations per seed.
func TestStressReplicatedStepsSurvive(t *testing.T) {
	t.Parallel()
	seeds := []uint64{1, 2, 3}
	if s := os.Getenv("MTCFS_SEED"); s != "" {
		n, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("MTCFS_SEED=%q: %v", s, err)
		}
		seeds = []uint64{n}
	}
	ops := 14
	if s := os.Getenv("MTCFS_STRESS_OPS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil {
			t.Fatalf("MTCFS_STRESS_OPS=%q: %v", s, err)
		}
		ops = n
	}
	for _, seed := range seeds {
		t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) {
			t.Parallel()
			runStress(t, seed, ops)
		})
	}
}

const stressNodes = 3

type stressCluster struct {
	t    *testing.T
	rnd  *rand.Rand
	job  *replication.Job
	tr   *memTransport
	hs   []*harness
	gen  int // incarnation counter, for the YAML
	next int64
	// saved[step][rank] is the data name rank committed for step, and its files.
	saved      map[int64]map[int]savedStep
	replicated int64 // the highest step any node reported replicated, -1 for none
}

type savedStep struct {
	data  string
	files map[string]string
}

func runStress(t *testing.T, seed uint64, ops int) {
	c := &stressCluster{t: t, rnd: rand.New(rand.NewPCG(seed, 99)), job: replication.NewJob(replication.Options{LagTimeout: 20 * time.Second}),
		saved: map[int64]map[int]savedStep{}, replicated: -1, next: 1}
	c.tr = &memTransport{nodes: map[int]*harness{}, failTo: map[int]bool{}, early: map[string][]layout.FileDigest{}}
	for r := range stressNodes {
		c.hs = append(c.hs, c.newNode(t.TempDir()))
		c.tr.nodes[r] = c.hs[r]
	}
	c.startJob(-1)
	for i := range ops {
		switch p := c.rnd.IntN(10); {
		case p < 6:
			fail := -1
			if c.rnd.IntN(4) == 0 {
				fail = c.rnd.IntN(stressNodes)
			}
			t.Logf("op %d: save step %d (pushes to rank %d fail)", i, c.next, fail)
			c.save(fail)
		case p < 8:
			r := c.rnd.IntN(stressNodes)
			t.Logf("op %d: agent %d restarts (RAM kept), the job restarts", i, r)
			c.hs[r] = c.hs[r].restart()
			c.setNode(r, c.hs[r])
			c.startJob(-1)
		default:
			r := c.rnd.IntN(stressNodes)
			t.Logf("op %d: node %d is replaced (RAM lost), the job restarts", i, r)
			c.hs[r].close()
			c.setNode(r, c.newNode(t.TempDir()))
			c.startJob(r)
		}
	}
}

func (c *stressCluster) newNode(root string) *harness {
	return newHarness(c.t, harnessConfig{root: root, coord: replication.LocalClient{Job: c.job}, peers: c.tr})
}

func (c *stressCluster) setNode(r int, h *harness) {
	c.hs[r] = h
	c.tr.mu.Lock()
	c.tr.nodes[r] = h
	c.tr.mu.Unlock()
}

// startJob writes a new replicator.yaml on every node and checks the restore: every node the
// same step, at least the highest step reported replicated, with the bytes saved for it. lost is
// the rank whose RAM is gone (-1: none).
func (c *stressCluster) startJob(lost int) {
	c.t.Helper()
	c.gen++
	var wg sync.WaitGroup
	for r, h := range c.hs {
		wg.Go(func() {
			h.yamlOrbax(withKeys("nodes: 3", fmt.Sprintf("node-rank: %d", r), fmt.Sprintf("peer-ranks: [%d]", (r+1)%stressNodes),
				fmt.Sprintf("job-name: job # incarnation %d", c.gen)))
		})
	}
	wg.Wait()
	restored := make([]int64, stressNodes)
	for r, h := range c.hs {
		h.waitGone(layout.ReplicatorYAMLName) // answered: the previous incarnation's markers are gone
		h.waitExists(layout.PrerestoreName)
		h.eventually("a .restore marker", func() string {
			if len(h.markers()) == 0 {
				return "no marker yet"
			}
			return ""
		})
		m := h.markers()
		if len(m) != 1 {
			c.t.Fatalf("rank %d: markers %q, want one", r, m)
		}
		mk, ok := layout.ParseMarkerName(m[0])
		if !ok {
			c.t.Fatalf("rank %d: bad marker %q", r, m[0])
		}
		if mk.Node != r {
			c.t.Fatalf("rank %d: marker %q names node %d", r, m[0], mk.Node)
		}
		restored[r] = mk.Step
		if fi, err := os.Lstat(h.path(m[0])); err == nil && fi.Mode().IsRegular() {
			restored[r] = 0 // nothing to restore
		}
	}
	for r := range restored {
		if restored[r] != restored[0] {
			c.t.Fatalf("nodes restore different steps: %v", restored)
		}
	}
	step := restored[0]
	if step < c.replicated {
		c.t.Fatalf("restored step %d (node %d lost), but step %d was reported replicated on every node", step, lost, c.replicated)
	}
	if step > 0 {
		for r, h := range c.hs {
			want := c.saved[step][r]
			h.checkRestoreLink(fmt.Sprintf("job-s%d-n%d-w0.restore", step, r), want.data, want.files)
		}
	}
	c.t.Logf("  restored step %d everywhere (replicated so far: %d)", step, c.replicated)
	c.next = max(c.next, step+1)
	// A restarted job starts its own count: only what this incarnation reports counts next.
	c.replicated = -1
}

// save commits the next step on every node; pushes to rank fail (-1: none) during it.
func (c *stressCluster) save(fail int) {
	c.t.Helper()
	step := c.next
	c.next++
	c.tr.mu.Lock()
	if fail >= 0 {
		c.tr.failTo[fail] = true
	}
	c.tr.mu.Unlock()
	c.saved[step] = map[int]savedStep{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for r, h := range c.hs {
		files := checkpointFiles(fmt.Sprintf("s%d-r%d-%d", step, r, c.rnd.Int()))
		wg.Go(func() {
			data := h.orbaxSave(step, files)
			mu.Lock()
			c.saved[step][r] = savedStep{data: strings.TrimSuffix(data, ".data"), files: files}
			mu.Unlock()
		})
	}
	wg.Wait()
	// Every node syncs the step (the coordinator's barrier), replicated or not.
	for r, h := range c.hs {
		h.eventually(fmt.Sprintf("rank %d to sync step %d", r, step), func() string {
			if st := h.r.Status(); st.Committed < step {
				return fmt.Sprintf("latest committed %d", st.Committed)
			}
			return ""
		})
	}
	c.tr.mu.Lock()
	c.tr.failTo[fail] = false
	c.tr.mu.Unlock()
	for _, h := range c.hs {
		c.replicated = max(c.replicated, h.r.Status().Replicated)
	}
	if fail < 0 && c.replicated != step {
		// Nothing failed: the step must count as replicated (wait for the last node's decision).
		for r, h := range c.hs {
			h.eventually(fmt.Sprintf("rank %d: step %d replicated", r, step), func() string {
				if st := h.r.Status(); st.Replicated != step {
					return fmt.Sprintf("latest replicated %d", st.Replicated)
				}
				return ""
			})
		}
		c.replicated = step
	}
}
