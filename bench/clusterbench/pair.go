package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/mtcfs/mtcfs/bench/internal/benchkit"
	"github.com/mtcfs/mtcfs/internal/jobsim"
)

// The pair phase measures the replication target like for like: a two-node job in which
// rank 0 saves a large step (cfg.pairFiles × cfg.pairFileSize, 1 GiB by default) and rank 1 a
// small one, each replicating to the other; the time from rank 0's commit to its replica's .meta
// in rank 1's mount. The job writes its files one after the other, closing each, so they stream
// to the peer while the rest is written.

var pairSteps = []int64{10, 20, 30}

const (
	kPair     = "pair phase: rank 0's commit → replica .meta on rank 1, large step, ms"
	kPairSave = "pair phase: rank 0's Save of the large step, ms"
	kPairTCP  = "pair phase: plain TCP copy of the large step, ms"
)

func (b *bench) pairClient(n node, job string) *jobsim.Orbax {
	o := b.clientNoPeers(n, job)
	o.Nodes = 2
	o.PeerRanks = []int{1 - n.rank}
	o.Content = jobsim.Content{Files: b.cfg.pairFiles, FileSize: b.cfg.pairFileSize}
	if n.rank == 1 {
		o.Content = jobsim.Content{Files: 1, FileSize: 4 << 10}
	}
	return o
}

// pairPhase runs the pair of one repetition in ws, below dir.
func (b *bench) pairPhase(ctx context.Context, ws *benchkit.Workspace, dir string, rep int) error {
	nodes := nodes(dir, 2)
	big := treeBytes(b.pairClient(nodes[0], "x").Tree(pairSteps[0]))
	b.res.pairBytes = big
	tcp, err := tcpCopy(big)
	if err != nil {
		return err
	}
	b.res.Add(kPairTCP, ms(tcp))
	job := fmt.Sprintf("pair%s-%d", b.runID, rep+1)
	agents := make([]*benchkit.Agent, 2)
	for _, n := range nodes {
		if agents[n.rank], err = b.startAgent(ctx, ws, dir, n, b.cfg.pairMemory); err != nil {
			return err
		}
	}
	clients := make([]*jobsim.Orbax, 2)
	if err := allRanks(2, func(r int) error {
		clients[r] = b.pairClient(nodes[r], job)
		_, _, err := clients[r].Start(ctx)
		return err
	}); err != nil {
		return err
	}
	for _, step := range pairSteps {
		var lat float64
		replica := filepath.Join(nodes[1].dir, fmt.Sprintf("%s-s%d-n0-w0.meta", job, step))
		if err := allRanks(2, func(r int) error {
			start := time.Now()
			if err := clients[r].Save(ctx, step); err != nil {
				return err
			}
			if r == 1 {
				return nil
			}
			commit := time.Now()
			b.res.Add(kPairSave, ms(commit.Sub(start)))
			if _, err := waitFile(ctx, replica, replWaitMax); err != nil {
				return fmt.Errorf("%w; rank 0's log:\n%s", err, agents[0].Log())
			}
			lat = ms(time.Since(commit))
			return nil
		}); err != nil {
			return err
		}
		b.res.Add(kPair, lat)
		fmt.Fprintf(os.Stderr, "clusterbench:   pair, step %d (%s on rank 0): commit → replica .meta on rank 1: %.0f ms\n", step, benchkit.FormatBytes(big), lat)
	}
	return nil
}
