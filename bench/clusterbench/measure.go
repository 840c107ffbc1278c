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

// Result keys.
const (
	kRepl         = "repl"          // commit → replica .meta on the peer, ms (all ranks and steps)
	kReplAgent    = "repl-agent"    // agent: replicated took, ms
	kSave         = "save"          // Save of one step on one rank, ms
	kSaveIdle     = "save-idle"     // Save with no replication anywhere (job without peers), ms
	kSaveBusy     = "save-busy"     // Save of busyStep started when prevStep committed, ms
	kSpoolPeak    = "spool-peak"    // peak spool used above the start, ÷ checkpoint bytes; max over nodes (steps 1-20)
	kSpoolBusy    = "spool-busy"    // the same during the save-while-replicating phase (steps 30-40)
	kRestore      = "restore"       // rank 1: Start → VerifyRestored done, ms
	kRestoreStart = "restore-start" // rank 1: Start returned, ms after Start began
	kRestoreAgent = "restore-agent" // agent: restored from a peer took, ms
	kRestoreOther = "restore-other" // ranks 0 and 2: Start → VerifyRestored done, ms
	kTCP          = "tcp"           // plain TCP copy of the checkpoint bytes on loopback, ms
	kBound        = "bound"         // bytes ÷ TCP rate × 1.5 + 1 s, ms
)

func kSpoolNode(r int) string  { return fmt.Sprintf("spool-peak-n%d", r) }
func kReplStep(s int64) string { return fmt.Sprintf("repl-s%d", s) }

type results struct {
	mu        sync.Mutex           // add is called from every rank's goroutine
	samples   map[string][]float64 // GUARDED_BY(mu) while ranks run
	stepBytes int64                // one node's checkpoint bytes per step
	pairBytes int64                // rank 0's step in the pair phase
}

func newResults() *results { return &results{samples: map[string][]float64{}} }

func (r *results) add(key string, v float64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.samples[key] = append(r.samples[key], v)
}

func (r *results) median(key string) float64 { return benchkit.Median(r.samples[key]) }

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

func (b *bench) repetition(ctx context.Context, rep int) error {
	stepBytes := treeBytes(b.client(node{rank: replacedRank}, "x").Tree(busyStep))
	b.res.stepBytes = stepBytes

	// Baseline first, while nothing else runs: the same number of bytes over loopback TCP.
	tcp, err := tcpCopy(stepBytes)
	if err != nil {
		return fmt.Errorf("tcp copy: %w", err)
	}
	b.res.add(kTCP, ms(tcp))
	bound := tcp.Seconds()*1.5 + 1 // bytes ÷ TCP rate × 1.5 + 1 s
	b.res.add(kBound, bound*1e3)
	fmt.Fprintf(os.Stderr, "clusterbench:   TCP copy of %s: %.0f ms (%.2f GB/s); restore bound %.2f s\n",
		benchkit.FormatBytes(stepBytes), ms(tcp), float64(stepBytes)/tcp.Seconds()/1e9, bound)

	nodes := b.nodes(rep)
	job := fmt.Sprintf("cb%s-%d", b.runID, rep+1)
	agents := make([]*agent, 3)
	for _, n := range nodes { // rank 0 first: it coordinates
		if agents[n.rank], err = b.startAgent(ctx, rep, n); err != nil {
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
		b.res.add(kSaveIdle, ms(time.Since(start)))
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

	for _, step := range steps {
		lat := make([]float64, 3)
		if err := allRanks(3, func(r int) error {
			peer := nodes[(r+1)%3]
			replica := filepath.Join(peer.dir, fmt.Sprintf("%s-s%d-n%d-w0.meta", job, step, r))
			start := time.Now()
			if err := clients[r].Save(ctx, step); err != nil {
				return err
			}
			commit := time.Now()
			b.res.add(kSave, ms(commit.Sub(start)))
			if _, err := waitFile(ctx, replica, replWaitMax); err != nil {
				return fmt.Errorf("%w; log of rank %d's agent:\n%s", err, r, agents[r].Log())
			}
			lat[r] = ms(time.Since(commit))
			return nil
		}); err != nil {
			return err
		}
		for r := range 3 {
			b.res.add(kRepl, lat[r])
			b.res.add(kReplStep(step), lat[r])
			if d, ok := agents[r].replicatedTook(step, 2*time.Second); ok {
				b.res.add(kReplAgent, d)
			}
		}
		fmt.Fprintf(os.Stderr, "clusterbench:   step %d: commit → replica .meta on the peer, ranks 0-2: %.0f %.0f %.0f ms\n", step, lat[0], lat[1], lat[2])
	}
	// The peak so far covers sequential saves (step N+1 written while N is held and replicated);
	// the busy phase below is measured on its own.
	peak := sampler.take()
	worst := 0.0
	for r := range 3 {
		f := float64(peak[r]-base[r]) / float64(stepBytes)
		b.res.add(kSpoolNode(r), f)
		worst = max(worst, f)
	}
	b.res.add(kSpoolPeak, worst)
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
		b.res.add(kSaveBusy, busy[r])
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
	b.res.add(kSpoolBusy, busyWorst)
	fmt.Fprintf(os.Stderr, "clusterbench:   peak spool use ÷ checkpoint bytes, steps 30-40 (save while replicating), worst rank: %.2f\n", busyWorst)

	// Node replacement of rank 1.
	if err := agents[replacedRank].kill(); err != nil {
		return err
	}
	if agents[replacedRank], err = b.startAgent(ctx, rep, nodes[replacedRank]); err != nil {
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
	d, ok := agents[replacedRank].peerRestoreTook(2 * time.Second)
	if !ok {
		return fmt.Errorf("rank %d did not restore from a peer; its log:\n%s", replacedRank, agents[replacedRank].Log())
	}
	b.res.add(kRestore, took[replacedRank])
	b.res.add(kRestoreStart, startTook[replacedRank])
	b.res.add(kRestoreAgent, d)
	for r := range 3 {
		if r != replacedRank {
			b.res.add(kRestoreOther, took[r])
		}
	}
	fmt.Fprintf(os.Stderr, "clusterbench:   replaced rank %d: Start → verified %.0f ms (Start %.0f ms, agent's peer restore %.0f ms); ranks 0, 2 from RAM: %.0f %.0f ms\n",
		replacedRank, took[replacedRank], startTook[replacedRank], d, took[0], took[2])

	// End of the repetition: stop the agents, remove its directories.
	var errs []error
	for _, a := range agents {
		errs = append(errs, a.stop())
	}
	b.agents = b.agents[:0]
	if err := errors.Join(errs...); err != nil {
		return err
	}
	return benchkit.RemoveAllUnlessMounted(b.repDir(rep))
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
