package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/mtcfs/mtcfs/bench/internal/benchkit"
	"github.com/mtcfs/mtcfs/internal/jobsim"
)

// The data-parallel phase measures the spool a node needs when column-mates hold
// interchangeable data (SPEC §4, assume-data-parallelism): two agents, nodes 2,
// assume-data-parallelism 2, each the other's peer, so only .meta files travel. Each rank saves
// dpSteps in turn (the next once the previous step's .meta reached the peer); the figure is the
// peak spool use above the start ÷ one node's checkpoint bytes.

var dpSteps = []int64{10, 20, 30}

const kSpoolDP = "peak spool ÷ checkpoint bytes, data-parallel pair, worst node, ×"

func (b *bench) dpClient(n node, job string) *jobsim.Orbax {
	o := b.clientNoPeers(n, job)
	o.Nodes, o.DataParallelism = 2, 2
	o.PeerRanks = []int{1 - n.rank}
	return o
}

// spoolSampler records the peak used bytes of some spools, every spoolPoll.
type spoolSampler struct {
	mu   sync.Mutex
	peak []int64 // GUARDED_BY(mu)
	stop func()
}

func startSpoolSampler(ctx context.Context, spools []string) *spoolSampler {
	s := &spoolSampler{peak: make([]int64, len(spools))}
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(spoolPoll)
		defer t.Stop()
		for {
			for i, dir := range spools {
				if u, err := spoolUsed(dir); err == nil {
					s.mu.Lock()
					s.peak[i] = max(s.peak[i], u)
					s.mu.Unlock()
				}
			}
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	})
	s.stop = func() { cancel(); wg.Wait() }
	return s
}

// take returns the peak of each spool since the start or the previous take, and starts over.
func (s *spoolSampler) take() []int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	peak := slices.Clone(s.peak)
	clear(s.peak)
	return peak
}

// dpPhase runs the data-parallel pair of one repetition in ws, below dir.
func (b *bench) dpPhase(ctx context.Context, ws *benchkit.Workspace, dir string, rep int) error {
	nodes := nodes(dir, 2)
	job := fmt.Sprintf("dp%s-%d", b.runID, rep+1)
	stepBytes := treeBytes(b.dpClient(nodes[0], job).Tree(dpSteps[0]))
	for _, n := range nodes {
		if _, err := b.startAgent(ctx, ws, dir, n, b.cfg.memory); err != nil {
			return err
		}
	}
	clients := make([]*jobsim.Orbax, 2)
	if err := allRanks(2, func(r int) error {
		clients[r] = b.dpClient(nodes[r], job)
		_, _, err := clients[r].Start(ctx)
		return err
	}); err != nil {
		return err
	}
	var base [2]int64
	for r, n := range nodes {
		var err error
		if base[r], err = spoolUsed(n.spool); err != nil {
			return err
		}
	}
	sampler := startSpoolSampler(ctx, []string{nodes[0].spool, nodes[1].spool})
	defer sampler.stop()
	for _, step := range dpSteps {
		if err := allRanks(2, func(r int) error {
			if err := clients[r].Save(ctx, step); err != nil {
				return err
			}
			meta := filepath.Join(nodes[1-r].dir, fmt.Sprintf("%s-s%d-n%d-w0.meta", job, step, r))
			_, err := waitFile(ctx, meta, replWaitMax)
			return err
		}); err != nil {
			return err
		}
	}
	time.Sleep(500 * time.Millisecond)
	sampler.stop()
	peak := sampler.take()
	worst := 0.0
	for r := range 2 {
		worst = max(worst, float64(peak[r]-base[r])/float64(stepBytes))
	}
	b.res.Add(kSpoolDP, worst)
	fmt.Fprintf(os.Stderr, "clusterbench:   data-parallel pair: peak spool use ÷ checkpoint bytes, worst rank: %.2f\n", worst)
	return nil
}
