package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/bench/internal/benchkit"
	"github.com/mtcfs/mtcfs/internal/jobsim"
)

const (
	replPoll     = time.Millisecond
	spoolPoll    = 10 * time.Millisecond
	clientPoll   = 5 * time.Millisecond
	replWaitMax  = 120 * time.Second
	replacedRank = 1
)

var steps = []int64{10, 20}

// Steps of the save-while-replicating phase: busyStep is saved right after prevStep committed,
// while prevStep replicates; idleStep is saved first, in a job without peers.
const (
	idleStep = 1
	prevStep = 30
	busyStep = 40
)

// Keys of the recorded samples: what each measures, and its unit, as the table of raw samples
// shows them.
const (
	kRepl         = "commit → replica .meta on the peer (every repetition: step 10 ranks 0-2, step 20 ranks 0-2), ms"
	kReplAgent    = "sender: mtcfs_replication_duration_seconds of the step, ms"
	kSave         = "Save of one step on one rank, ms"
	kSaveIdle     = "idle Save (job without peers: nothing replicates anywhere), ms"
	kSaveBusy     = "Save of step 40 started when step 30 committed (step 30 replicating), ms"
	kSpoolPeak    = "peak spool ÷ checkpoint bytes, steps 1-20, worst node, ×"
	kSpoolBusy    = "peak spool ÷ checkpoint bytes, steps 30-40 (save while replicating), worst node, ×"
	kRestore      = "replaced rank 1: Start → VerifyRestored done, ms"
	kRestoreStart = "replaced rank 1: Start returned, ms"
	kRestoreAgent = "replaced rank 1: mtcfs_restore_duration_seconds{source=\"peer\"}, ms"
	kRestoreOther = "ranks 0 and 2 from RAM: Start → VerifyRestored done, ms"
	kTCP          = "plain TCP copy of one node's step on loopback, ms"
	kBound        = "restore bound: bytes ÷ TCP rate × 1.5 + 1 s, ms"
)

func kSpoolNode(r int) string {
	return fmt.Sprintf("peak spool ÷ checkpoint bytes, steps 1-20, rank %d, ×", r)
}
func kReplStep(s int64) string {
	return fmt.Sprintf("commit → replica .meta on the peer, step %d, ms", s)
}

type results struct {
	benchkit.Samples       // Add is called from every rank's goroutine
	stepBytes        int64 // one node's checkpoint bytes per step
	pairBytes        int64 // rank 0's step in the pair phase
}

func (b *bench) client(n node, job string) *jobsim.Orbax {
	o := b.clientNoPeers(n, job)
	o.PeerRanks = []int{(n.rank + 1) % 3}
	return o
}

// clientNoPeers is a client of the same job whose nodes replicate nothing.
func (b *bench) clientNoPeers(n node, job string) *jobsim.Orbax {
	return &jobsim.Orbax{
		Dir: n.dir, Job: job, Rank: n.rank, Nodes: 3,
		BackupIntervalMinutes: 60,
		Poll:                  clientPoll, Timeout: 120 * time.Second,
		Content: jobsim.Content{Files: b.cfg.files, FileSize: b.cfg.fileSize},
	}
}

// allRanks runs f for ranks 0 to n-1 at once, as the job's processes do, and joins their errors.
func allRanks(n int, f func(r int) error) error {
	var wg sync.WaitGroup
	errs := make([]error, n)
	for r := range n {
		wg.Go(func() {
			if err := f(r); err != nil {
				errs[r] = fmt.Errorf("rank %d: %w", r, err)
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// waitFile polls path with lstat every replPoll until it exists and returns how long that took;
// an error after maxWait or when ctx is done.
func waitFile(ctx context.Context, path string, maxWait time.Duration) (time.Duration, error) {
	start := time.Now()
	for {
		if _, err := os.Lstat(path); err == nil {
			return time.Since(start), nil
		}
		if time.Since(start) > maxWait {
			return 0, fmt.Errorf("no %s after %v", path, maxWait)
		}
		if err := ctx.Err(); err != nil {
			return 0, err
		}
		time.Sleep(replPoll)
	}
}

func treeBytes(files []jobsim.File) int64 {
	var n int64
	for _, f := range files {
		n += f.Size
	}
	return n
}

// spoolUsed is the used bytes of the filesystem at dir, from statfs.
func spoolUsed(dir string) (int64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, err
	}
	return int64(st.Blocks-st.Bfree) * st.Bsize, nil
}

// repetition runs the three-node job of one repetition in ws, below dir.
func (b *bench) repetition(ctx context.Context, ws *benchkit.Workspace, dir string, rep int) error {
	stepBytes := treeBytes(b.client(node{rank: replacedRank}, "x").Tree(busyStep))
	b.res.stepBytes = stepBytes

	// Baseline first, while nothing else runs: the same number of bytes over loopback TCP.
	tcp, err := tcpCopy(stepBytes)
	if err != nil {
		return fmt.Errorf("tcp copy: %w", err)
	}
	b.res.Add(kTCP, ms(tcp))
	bound := tcp.Seconds()*1.5 + 1 // bytes ÷ TCP rate × 1.5 + 1 s
	b.res.Add(kBound, bound*1e3)
	fmt.Fprintf(os.Stderr, "clusterbench:   TCP copy of %s: %.0f ms (%.2f GB/s); restore bound %.2f s\n",
		benchkit.FormatBytes(stepBytes), ms(tcp), float64(stepBytes)/tcp.Seconds()/1e9, bound)

	nodes := nodes(dir, 3)
	job := fmt.Sprintf("cb%s-%d", b.runID, rep+1)
	agents := make([]*benchkit.Agent, 3)
	for _, n := range nodes { // rank 0 first: it coordinates
		if agents[n.rank], err = b.startAgent(ctx, ws, dir, n, b.cfg.memory); err != nil {
			return err
		}
	}
	// Spool use before anything was saved.
	var base [3]int64
	for r, n := range nodes {
		if base[r], err = spoolUsed(n.spool); err != nil {
			return err
		}
	}

	// Idle save: the job runs without peers first, so nothing replicates anywhere.
	if err := allRanks(3, func(r int) error {
		o := b.clientNoPeers(nodes[r], job)
		step, found, err := o.Start(ctx)
		if err == nil && found {
			return fmt.Errorf("fresh job restored step %d", step)
		}
		start := time.Now()
		if err := o.Save(ctx, idleStep); err != nil {
			return err
		}
		b.res.Add(kSaveIdle, ms(time.Since(start)))
		return nil
	}); err != nil {
		return err
	}
	// The job restarts with peers and restores the idle step from RAM.
	clients := make([]*jobsim.Orbax, 3)
	if err := allRanks(3, func(r int) error {
		clients[r] = b.client(nodes[r], job)
		step, found, err := clients[r].Start(ctx)
		if err == nil && (!found || step != idleStep) {
			err = fmt.Errorf("restarted job restored step %d (found %v), want %d", step, found, idleStep)
		}
		return err
	}); err != nil {
		return err
	}

	// Peak spool use, sampled from here (step 1 saved and restored) in two phases: steps 10-20,
	// then steps 30-40; base (before step 1) is subtracted from both.
	sampler := startSpoolSampler(ctx, []string{nodes[0].spool, nodes[1].spool, nodes[2].spool})
	defer sampler.stop()

	// The restored step is pushed to the peers again: once every node's peers hold it, each
	// agent's next replication observation is of the step measured.
	if err := waitReplicated(ctx, agents, idleStep); err != nil {
		return err
	}
	for _, step := range steps {
		lat := make([]float64, 3)
		before := make([]benchkit.Histogram, 3)
		for r, a := range agents {
			if before[r], err = a.Histogram(replSeconds); err != nil {
				return err
			}
		}
		if err := allRanks(3, func(r int) error {
			peer := nodes[(r+1)%3]
			replica := filepath.Join(peer.dir, fmt.Sprintf("%s-s%d-n%d-w0.meta", job, step, r))
			start := time.Now()
			if err := clients[r].Save(ctx, step); err != nil {
				return err
			}
			commit := time.Now()
			b.res.Add(kSave, ms(commit.Sub(start)))
			if _, err := waitFile(ctx, replica, replWaitMax); err != nil {
				return fmt.Errorf("%w; log of rank %d's agent:\n%s", err, r, agents[r].Log())
			}
			lat[r] = ms(time.Since(commit))
			return nil
		}); err != nil {
			return err
		}
		for r, a := range agents {
			b.res.Add(kRepl, lat[r])
			b.res.Add(kReplStep(step), lat[r])
			// The sender records the push once the peer acknowledged it, which may come after the
			// replica's .meta is visible.
			push, err := a.WaitObserved(ctx, before[r], 5*time.Second, replSeconds)
			if err != nil {
				return fmt.Errorf("rank %d, step %d: %w", r, step, err)
			}
			if push.Count != 1 {
				return fmt.Errorf("rank %d, step %d: %d pushes observed, want 1", r, step, push.Count)
			}
			b.res.Add(kReplAgent, push.Sum*1e3)
		}
		if err := waitReplicated(ctx, agents, step); err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "clusterbench:   step %d: commit → replica .meta on the peer, ranks 0-2: %.0f %.0f %.0f ms\n", step, lat[0], lat[1], lat[2])
	}
	// The peak so far covers sequential saves (step N+1 written while N is held and replicated);
	// the busy phase below is measured on its own.
	peak := sampler.take()
	worst := 0.0
	for r := range 3 {
		f := float64(peak[r]-base[r]) / float64(stepBytes)
		b.res.Add(kSpoolNode(r), f)
		worst = max(worst, f)
	}
	b.res.Add(kSpoolPeak, worst)
	fmt.Fprintf(os.Stderr, "clusterbench:   peak spool use ÷ checkpoint bytes, steps 1-20, worst rank: %.2f\n", worst)

	// Save while the previous step replicates: busyStep starts the moment prevStep committed.
	busy := make([]float64, 3)
	if err := allRanks(3, func(r int) error {
		if err := clients[r].Save(ctx, prevStep); err != nil {
			return err
		}
		start := time.Now()
		if err := clients[r].Save(ctx, busyStep); err != nil {
			return err
		}
		busy[r] = ms(time.Since(start))
		b.res.Add(kSaveBusy, busy[r])
		replica := filepath.Join(nodes[(r+1)%3].dir, fmt.Sprintf("%s-s%d-n%d-w0.meta", job, busyStep, r))
		if _, err := waitFile(ctx, replica, replWaitMax); err != nil {
			return fmt.Errorf("%w; log of rank %d's agent:\n%s", err, r, agents[r].Log())
		}
		return nil
	}); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "clusterbench:   save of step %d while step %d replicates, ranks 0-2: %.0f %.0f %.0f ms\n", busyStep, prevStep, busy[0], busy[1], busy[2])
	time.Sleep(500 * time.Millisecond)
	sampler.stop()
	peak = sampler.take()
	busyWorst := 0.0
	for r := range 3 {
		busyWorst = max(busyWorst, float64(peak[r]-base[r])/float64(stepBytes))
	}
	b.res.Add(kSpoolBusy, busyWorst)
	fmt.Fprintf(os.Stderr, "clusterbench:   peak spool use ÷ checkpoint bytes, steps 30-40 (save while replicating), worst rank: %.2f\n", busyWorst)

	// Node replacement of rank 1.
	if err := agents[replacedRank].Kill(); err != nil {
		return err
	}
	if agents[replacedRank], err = b.startAgent(ctx, ws, dir, nodes[replacedRank], b.cfg.memory); err != nil {
		return err
	}
	want := int64(busyStep)
	took := make([]float64, 3)
	startTook := make([]float64, 3)
	if err := allRanks(3, func(r int) error {
		o := b.client(nodes[r], job)
		start := time.Now()
		step, found, err := o.Start(ctx)
		if err != nil {
			return err
		}
		startTook[r] = ms(time.Since(start))
		if !found || step != want {
			return fmt.Errorf("restored step %d (found %v), want %d", step, found, want)
		}
		if err := o.VerifyRestored(ctx, want); err != nil {
			return err
		}
		took[r] = ms(time.Since(start))
		return nil
	}); err != nil {
		return err
	}
	// A fresh agent: its one restore from a peer (one worker) is the one observation.
	fetch, err := agents[replacedRank].WaitObserved(ctx, benchkit.Histogram{}, 2*time.Second, restoreSeconds, "source", "peer")
	if err != nil {
		return fmt.Errorf("rank %d did not restore from a peer (%w); its log:\n%s", replacedRank, err, agents[replacedRank].Log())
	}
	d := fetch.Sum * 1e3
	b.res.Add(kRestore, took[replacedRank])
	b.res.Add(kRestoreStart, startTook[replacedRank])
	b.res.Add(kRestoreAgent, d)
	for r := range 3 {
		if r != replacedRank {
			b.res.Add(kRestoreOther, took[r])
		}
	}
	fmt.Fprintf(os.Stderr, "clusterbench:   replaced rank %d: Start → verified %.0f ms (Start %.0f ms, agent's peer restore %.0f ms); ranks 0, 2 from RAM: %.0f %.0f ms\n",
		replacedRank, took[replacedRank], startTook[replacedRank], d, took[0], took[2])

	return nil
}

// waitReplicated waits until every agent's /status reports step replicated on every node's
// peers (or a newer one).
func waitReplicated(ctx context.Context, agents []*benchkit.Agent, step int64) error {
	deadline := time.Now().Add(replWaitMax)
	for r, a := range agents {
		for {
			st, err := a.Status()
			if err != nil {
				return err
			}
			if st.Replicated >= step {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("rank %d: /status reports step %d replicated, want %d", r, st.Replicated, step)
			}
			if err := ctx.Err(); err != nil {
				return err
			}
			time.Sleep(clientPoll)
		}
	}
	return nil
}

func ms(d time.Duration) float64 { return float64(d) / 1e6 }

// tcpCopy sends n bytes over one loopback TCP connection with 1 MiB writes and reads them on
// the other side; timed from the dial to the receiver having read them all.
func tcpCopy(n int64) (time.Duration, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	got := make(chan error, 1)
	var received int64
	go func() {
		c, err := ln.Accept()
		if err != nil {
			got <- err
			return
		}
		defer c.Close()
		buf := make([]byte, 1<<20)
		received, err = io.CopyBuffer(io.Discard, c, buf)
		got <- err
	}()
	buf := make([]byte, 1<<20)
	for i := range buf {
		buf[i] = byte(i*7 + i>>8)
	}
	start := time.Now()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		return 0, err
	}
	for left := n; left > 0; {
		k := min(left, int64(len(buf)))
		if _, err := c.Write(buf[:k]); err != nil {
			c.Close()
			return 0, err
		}
		left -= k
	}
	c.Close()
	if err := <-got; err != nil {
		return 0, err
	}
	d := time.Since(start)
	if received != n {
		return 0, fmt.Errorf("received %d of %d bytes", received, n)
	}
	return d, nil
}
