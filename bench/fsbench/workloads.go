package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/bench/internal/benchkit"
)

// ioBufSize is the size of every read and write the sequential workloads issue.
const ioBufSize = 1 << 20

// Metric keys; report.go holds their titles, units and targets.
const (
	seqWriteNew     = "seq-write-new"
	seqOverwrite    = "seq-overwrite"
	seqReadFirst    = "seq-read-first"
	seqReread       = "seq-reread"
	createMedian    = "create-median"
	createP99       = "create-p99"
	createPinned    = "create-pinned-median"
	statCached      = "stat-cached"
	statNewMedian   = "stat-new-median"
	statNewP99      = "stat-new-p99"
	statColdMedian  = "stat-cold-median"
	statColdP99     = "stat-cold-p99"
	smallWriteFiles = "small-write-files"
	smallWriteMBps  = "small-write-mbps"
	smallReadFiles  = "small-read-files"
	smallReadMBps   = "small-read-mbps"
	// FUSE requests per create+close, from the agent's mtcfs_fuse_requests_total: the
	// synchronous ones (the caller waits for each) and some ops one by one.
	createSyncRequests = "create-sync-requests"
	createRequestsOp   = "create-requests-" // + op
	// FUSE requests per 1,000 stat(2) calls of the stat rows: 0 shows that the kernel answered
	// them from its caches, so that no server, mtcfs or the anchor, can make that row faster or
	// slower. (Per 1,000: the stats right after the creates cost the directory one GETATTR.)
	statCachedRequests = "stat-cached-requests"
	statNewRequests    = "stat-new-requests"
	statColdRequests   = "stat-cold-requests"
)

// createOps are the operations whose requests per create+close get a row of their own.
var createOps = []string{"getattr", "lookup", "create", "flush", "release"}

// asyncOps are the requests the caller does not wait for.
var asyncOps = map[string]bool{"release": true, "releasedir": true, "forget": true}

// statCachedBatchOf stats are timed together, so that reading the clock does not count per op.
const statCachedBatchOf = 100

// record receives one measured value of a metric.
type record func(metric string, value float64)

// A workload measures one target once; it must leave the target as empty as it found it, so
// that memory does not pile up across rounds.
type workload struct {
	name string
	run  func(ctx context.Context, t *target, rec record) error
}

// bench holds what the workloads share.
type bench struct {
	cfg config
	buf []byte // ioBufSize bytes of non-zero data
	seq int    // numbers fresh directories
}

func newBench(cfg config) *bench {
	buf := make([]byte, ioBufSize)
	for i := range buf {
		buf[i] = byte(i*7 + 1)
	}
	return &bench{cfg: cfg, buf: buf}
}

// workloads returns the workloads in the order they run; their names are what -workloads selects.
func (b *bench) workloads() []workload {
	return []workload{
		{"sequential", b.sequential},
		{"create", b.createAndStat},
		{"stat", b.statCached},
		{"small", b.smallFiles},
	}
}

// selectWorkloads keeps the workloads named in the comma-separated list (all for "").
func selectWorkloads(all []workload, list string) ([]workload, error) {
	if list == "" {
		return all, nil
	}
	var out []workload
	for _, name := range strings.Split(list, ",") {
		i := slices.IndexFunc(all, func(w workload) bool { return w.name == name })
		if i < 0 {
			return nil, fmt.Errorf("-workloads: unknown workload %q", name)
		}
		out = append(out, all[i])
	}
	return out, nil
}

// runWorkloads runs each workload for the warm-up and measured rounds; each round visits every
// target, starting one target later than the round before.
func runWorkloads(ctx context.Context, ws []workload, targets []*target, cfg config, res *results) error {
	rounds := cfg.warmup + cfg.reps
	for _, w := range ws {
		for r := range rounds {
			for i := range targets {
				t := targets[(i+r)%len(targets)]
				if t.skip[w.name] {
					continue
				}
				if err := ctx.Err(); err != nil {
					return err
				}
				var got []string
				rec := func(metric string, v float64) {
					got = append(got, metric+"="+benchkit.FormatValue(v))
					if r >= cfg.warmup {
						res.add(metric, t.name, v)
					}
				}
				start := time.Now()
				if err := w.run(ctx, t, rec); err != nil {
					return fmt.Errorf("%s on %s: %w", w.name, t.name, err)
				}
				phase := "round " + fmt.Sprint(r-cfg.warmup+1)
				if r < cfg.warmup {
					phase = "warm-up"
				}
				fmt.Fprintf(os.Stderr, "fsbench: %-10s %-8s %-11s %5.1fs  %s\n", w.name, phase, t.name,
					time.Since(start).Seconds(), strings.Join(got, " "))
			}
		}
	}
	return nil
}

// freshDir creates a new, empty directory below dir.
func (b *bench) freshDir(dir, prefix string) (string, error) {
	b.seq++
	d := filepath.Join(dir, fmt.Sprintf("%s-%d", prefix, b.seq))
	return d, os.Mkdir(d, 0o755)
}

// sequential writes a new file, reads it twice, then overwrites it in place.
func (b *bench) sequential(ctx context.Context, t *target, rec record) error {
	dir := t.dir
	p := filepath.Join(dir, "seq.dat")
	// Removing it frees the memory before the next target runs.
	defer os.Remove(p)
	size := b.cfg.fileSize
	steps := []struct {
		metric string
		io     func() error
	}{
		{seqWriteNew, func() error { return writeFile(p, unix.O_CREAT|unix.O_EXCL, size, b.buf) }},
		{seqReadFirst, func() error { return readFile(p, size, b.buf) }},
		{seqReread, func() error { return readFile(p, size, b.buf) }},
		{seqOverwrite, func() error { return writeFile(p, 0, size, b.buf) }},
	}
	for _, s := range steps {
		if err := ctx.Err(); err != nil {
			return err
		}
		start := time.Now()
		if err := s.io(); err != nil {
			return err
		}
		rec(s.metric, float64(size)/time.Since(start).Seconds()/1e9)
	}
	return nil
}

// createAndStat creates empty files in a fresh directory, timing each open(O_CREAT|O_EXCL) and
// close; then stats each of them once right away, and once more after mtcfs's kernel cache for
// entries and attributes has expired.
func (b *bench) createAndStat(ctx context.Context, t *target, rec record) error {
	d, err := b.freshDir(t.dir, "create")
	if err != nil {
		return err
	}
	defer os.RemoveAll(d)
	paths := numberedPaths(d, b.cfg.creates)
	lat := make([]float64, len(paths))
	before, err := t.requests()
	if err != nil {
		return err
	}
	if err := timeCreates(ctx, paths, lat); err != nil {
		return err
	}
	rec(createMedian, benchkit.Median(lat))
	rec(createP99, benchkit.Percentile(lat, 0.99))
	if before != nil {
		if err := recordRequests(t, before, len(paths), rec); err != nil {
			return err
		}
	}

	statEach := func(medianKey, p99Key, requestsKey string) error {
		before, err := t.requests()
		if err != nil {
			return err
		}
		var st unix.Stat_t
		for i, p := range paths {
			start := time.Now()
			err := unix.Stat(p, &st)
			lat[i] = micros(time.Since(start))
			if err != nil {
				return fmt.Errorf("stat %s: %w", p, err)
			}
		}
		rec(medianKey, benchkit.Median(lat))
		rec(p99Key, benchkit.Percentile(lat, 0.99))
		return recordSyncRequests(t, before, len(paths), 1000, requestsKey, rec)
	}
	if err := statEach(statNewMedian, statNewP99, statNewRequests); err != nil {
		return err
	}
	if err := b.createPinned(ctx, t, rec); err != nil {
		return err
	}
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(b.cfg.cacheWait):
	}
	return statEach(statColdMedian, statColdP99, statColdRequests)
}

// createPinned times create+close again with this thread and every thread of the target's
// FUSE server on one CPU. Unpinned, the kernel places the server's reader threads on the job's
// CPU or on the other one, and the same build measures 15 µs or 40 µs from one round to the
// next (bench/RESULTS.md, "Observations on create+close and CPU placement"); pinned, each
// request is served on the CPU that sent it, and what remains is what the server does.
func (b *bench) createPinned(ctx context.Context, t *target, rec record) error {
	d, err := b.freshDir(t.dir, "create-pinned")
	if err != nil {
		return err
	}
	defer os.RemoveAll(d)
	paths := numberedPaths(d, b.cfg.creates)
	lat := make([]float64, len(paths))
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var own, one unix.CPUSet
	if err := unix.SchedGetaffinity(0, &own); err != nil {
		return fmt.Errorf("pinned create: %w", err)
	}
	one.Set(pinCPU)
	if err := unix.SchedSetaffinity(0, &one); err != nil {
		return fmt.Errorf("pinned create: %w", err)
	}
	defer unix.SchedSetaffinity(0, &own)
	if t.server != 0 {
		var was unix.CPUSet
		if err := unix.SchedGetaffinity(t.server, &was); err != nil {
			return fmt.Errorf("pinned create: %w", err)
		}
		if err := setProcessAffinity(t.server, &one); err != nil {
			return fmt.Errorf("pinned create: %w", err)
		}
		defer setProcessAffinity(t.server, &was)
	}
	if err := timeCreates(ctx, paths, lat); err != nil {
		return err
	}
	rec(createPinned, benchkit.Median(lat))
	return nil
}

// timeCreates creates each of paths empty (open(O_CREAT|O_EXCL), close) and stores each one's
// time in microseconds in lat.
func timeCreates(ctx context.Context, paths []string, lat []float64) error {
	for i, p := range paths {
		if i%256 == 0 && ctx.Err() != nil {
			return ctx.Err()
		}
		start := time.Now()
		fd, err := unix.Open(p, unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_CLOEXEC, 0o644)
		if err == nil {
			err = unix.Close(fd)
		}
		lat[i] = micros(time.Since(start))
		if err != nil {
			return fmt.Errorf("create %s: %w", p, err)
		}
	}
	return nil
}

// pinCPU is the CPU of the pinned create pass.
const pinCPU = 0

// setProcessAffinity sets the CPU mask of every thread of process pid (a Go server starts threads
// at any time: a thread started during the call inherits the mask of the thread that made it).
// Twice: a thread that a thread not yet moved starts during the first pass is moved by the second.
func setProcessAffinity(pid int, set *unix.CPUSet) error {
	for range 2 {
		tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
		if err != nil {
			return err
		}
		for _, task := range tasks {
			tid, err := strconv.Atoi(task.Name())
			if err != nil {
				continue
			}
			if err := unix.SchedSetaffinity(tid, set); err != nil && !errors.Is(err, unix.ESRCH) {
				return fmt.Errorf("set the CPUs of thread %d of %d: %w", tid, pid, err)
			}
		}
	}
	return nil
}

// statCached stats one file in a loop for cfg.statFor; the per-op time of each batch of
// statCachedBatchOf calls is one sample, and the median sample is recorded.
func (b *bench) statCached(ctx context.Context, t *target, rec record) error {
	p := filepath.Join(t.dir, "stat-me")
	if err := writeFile(p, unix.O_CREAT|unix.O_EXCL, 0, nil); err != nil {
		return err
	}
	defer os.Remove(p)
	// The file's entry and attributes reach the kernel's cache with the first stat, before the
	// count of requests starts.
	var st unix.Stat_t
	if err := unix.Stat(p, &st); err != nil {
		return fmt.Errorf("stat %s: %w", p, err)
	}
	before, err := t.requests()
	if err != nil {
		return err
	}
	var perOp []float64
	for end := time.Now().Add(b.cfg.statFor); time.Now().Before(end); {
		start := time.Now()
		for range statCachedBatchOf {
			if err := unix.Stat(p, &st); err != nil {
				return fmt.Errorf("stat %s: %w", p, err)
			}
		}
		perOp = append(perOp, micros(time.Since(start))/statCachedBatchOf)
	}
	rec(statCached, benchkit.Median(perOp))
	if err := recordSyncRequests(t, before, len(perOp)*statCachedBatchOf, 1000, statCachedRequests, rec); err != nil {
		return err
	}
	return ctx.Err()
}

// smallFiles writes many small files (create, one write, close) into a fresh directory, then
// reads each back (open, read to EOF, close).
func (b *bench) smallFiles(ctx context.Context, t *target, rec record) error {
	d, err := b.freshDir(t.dir, "small")
	if err != nil {
		return err
	}
	defer os.RemoveAll(d)
	paths := numberedPaths(d, b.cfg.smallFiles)
	size := int64(b.cfg.smallSize)
	totalBytes := float64(size) * float64(len(paths))
	phases := []struct {
		filesKey, mbpsKey string
		io                func(p string) error
	}{
		{smallWriteFiles, smallWriteMBps, func(p string) error { return writeFile(p, unix.O_CREAT|unix.O_EXCL, size, b.buf) }},
		{smallReadFiles, smallReadMBps, func(p string) error { return readFile(p, size, b.buf) }},
	}
	for _, ph := range phases {
		start := time.Now()
		for i, p := range paths {
			if i%256 == 0 && ctx.Err() != nil {
				return ctx.Err()
			}
			if err := ph.io(p); err != nil {
				return err
			}
		}
		secs := time.Since(start).Seconds()
		rec(ph.filesKey, float64(len(paths))/secs)
		rec(ph.mbpsKey, totalBytes/secs/1e6)
	}
	return nil
}

// recordRequests records the FUSE requests per file the agent of t served since before, n
// create+close calls ago. RELEASE is asynchronous: the last ones may still be under way, so the
// agent is given a moment for them.
func recordRequests(t *target, before map[string]float64, n int, rec record) error {
	var after map[string]float64
	for range 50 {
		var err error
		if after, err = t.requests(); err != nil {
			return err
		}
		if after["release"]-before["release"] >= float64(n) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	rec(createSyncRequests, syncRequests(before, after)/float64(n))
	for _, op := range createOps {
		rec(createRequestsOp+op, (after[op]-before[op])/float64(n))
	}
	return nil
}

// recordSyncRequests records under key the synchronous FUSE requests per per calls that the
// agent of t served since before, over n calls; nothing for a target without an agent's count.
func recordSyncRequests(t *target, before map[string]float64, n, per int, key string, rec record) error {
	if before == nil {
		return nil
	}
	after, err := t.requests()
	if err != nil {
		return err
	}
	rec(key, syncRequests(before, after)*float64(per)/float64(n))
	return nil
}

// syncRequests is how many requests the caller waited for (asyncOps aside) from before to after.
func syncRequests(before, after map[string]float64) float64 {
	sync := 0.0
	for op, v := range after {
		if !asyncOps[op] {
			sync += v - before[op]
		}
	}
	return sync
}

// writeFile opens path for writing with extra flags, writes size bytes from buf in chunks of
// len(buf), and closes it. Without O_CREAT|O_EXCL it overwrites an existing file in place.
func writeFile(path string, flags int, size int64, buf []byte) error {
	fd, err := unix.Open(path, unix.O_WRONLY|unix.O_CLOEXEC|flags, 0o644)
	if err != nil {
		return fmt.Errorf("open %s: %w", path, err)
	}
	for off := int64(0); off < size; {
		n, err := unix.Write(fd, buf[:min(int64(len(buf)), size-off)])
		if err != nil {
			unix.Close(fd)
			return fmt.Errorf("write %s at %d: %w", path, off, err)
		}
		off += int64(n)
	}
	if err := unix.Close(fd); err != nil {
		return fmt.Errorf("close %s: %w", path, err)
	}
	return nil
}

// readFile reads path to EOF in chunks of len(buf) and checks that it held want bytes.
func readFile(path string, want int64, buf []byte) error {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %s: %w", path, err)
	}
	var got int64
	for {
		n, err := unix.Read(fd, buf)
		if err != nil {
			unix.Close(fd)
			return fmt.Errorf("read %s at %d: %w", path, got, err)
		}
		if n == 0 {
			break
		}
		got += int64(n)
	}
	if err := unix.Close(fd); err != nil {
		return fmt.Errorf("close %s: %w", path, err)
	}
	if got != want {
		return fmt.Errorf("read %s: got %d bytes, want %d", path, got, want)
	}
	return nil
}

// numberedPaths names n files in dir; built before timing so the loops allocate little.
func numberedPaths(dir string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = filepath.Join(dir, fmt.Sprintf("f%06d", i))
	}
	return out
}

func micros(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
