package tiers

import (
	"os"
	"sync/atomic"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are what a replicator exports to Prometheus (SPEC §10), all prefixed mtcfs_. Gauges
// are read from the replicator's state when scraped; durations, bytes and errors are recorded as
// they happen. A nil *Metrics records nothing.
type Metrics struct {
	seal      prometheus.Histogram
	replicate prometheus.Histogram
	backup    prometheus.Histogram
	restore   *prometheus.HistogramVec // source: ram, peer, backup
	bytes     *prometheus.CounterVec   // tier: peer, backup; direction: in, out
	errors    *prometheus.CounterVec   // kind
	commits   prometheus.Counter
	// fuseRequests reads the mount's request counts (see ObserveFUSERequests); nil until set.
	fuseRequests atomic.Pointer[func() map[string]uint64]
}

// Error kinds of mtcfs_errors_total.
const (
	errKindSeal        = "seal"
	errKindReplication = "replication"
	errKindSync        = "sync"
	errKindBackup      = "backup"
	errKindRestore     = "restore"
	errKindVerify      = "verify"
	errKindConfig      = "config"
)

// durationBuckets span a small step sealed in milliseconds to a large backup over minutes.
var durationBuckets = prometheus.ExponentialBuckets(0.005, 3, 12) // 5 ms … ~15 min

// NewMetrics creates the replicator's metrics and registers them, with gauges that read r, on
// reg.
func NewMetrics(reg prometheus.Registerer, r *Replicator) *Metrics {
	hist := func(name, help string) prometheus.Histogram {
		return prometheus.NewHistogram(prometheus.HistogramOpts{Name: name, Help: help, Buckets: durationBuckets})
	}
	m := &Metrics{
		seal:      hist("mtcfs_seal_duration_seconds", "Time from a step's commit to its .meta (hashing and naming the data)."),
		replicate: hist("mtcfs_replication_duration_seconds", "Time to push one step (data and .meta) to one peer, acknowledged."),
		backup:    hist("mtcfs_backup_duration_seconds", "Time to upload this node's part of one backup."),
		restore: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "mtcfs_restore_duration_seconds",
			Help: "Time to bring one worker's data of the restored step into RAM, by source.", Buckets: durationBuckets}, []string{"source"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "mtcfs_transferred_bytes_total",
			Help: "Checkpoint bytes moved, by tier (peer, backup) and direction (out: sent or uploaded, in: received or downloaded)."}, []string{"tier", "direction"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "mtcfs_errors_total",
			Help: "Errors by kind (seal, replication, sync, backup, restore, verify, config)."}, []string{"kind"}),
		commits: prometheus.NewCounter(prometheus.CounterOpts{Name: "mtcfs_commits_total", Help: "Steps the job committed on this node (per worker)."}),
	}
	for _, k := range []string{errKindSeal, errKindReplication, errKindSync, errKindBackup, errKindRestore, errKindVerify, errKindConfig} {
		m.errors.WithLabelValues(k) // every kind shows, at 0
	}
	for _, t := range []string{"peer", "backup"} {
		for _, d := range []string{"in", "out"} {
			m.bytes.WithLabelValues(t, d)
		}
	}
	gauge := func(name, help string, f func(Status) float64) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help}, func() float64 { return f(r.Status()) })
	}
	for state, f := range map[string]func(Status) int64{
		"committed":  func(s Status) int64 { return s.Committed },
		"sealed":     func(s Status) int64 { return s.Sealed },
		"replicated": func(s Status) int64 { return s.Replicated },
		"backed_up":  func(s Status) int64 { return s.BackedUp },
	} {
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "mtcfs_latest_step",
			Help:        "The newest step on this node that is committed, sealed, replicated on every node or in a complete backup (-1: none in this incarnation).",
			ConstLabels: prometheus.Labels{"state": state}}, func() float64 { return float64(f(r.Status())) }))
	}
	reg.MustRegister(m.seal, m.replicate, m.backup, m.restore, m.bytes, m.errors, m.commits,
		gauge("mtcfs_ram_budget_bytes", "The RAM tier's budget (--memory).", func(s Status) float64 { return float64(s.Spool.Budget) }),
		gauge("mtcfs_ram_used_bytes", "Bytes in use in the RAM tier.", func(s Status) float64 { return float64(s.Spool.Used) }),
		gauge("mtcfs_seal_retrying", "1 while a committed step's record or hash, failed on a shortage (open files, memory, the RAM tier's room), is tried again (mtcfs status names the step); 0 otherwise.",
			func(s Status) float64 {
				if s.Sealing != nil {
					return 1
				}
				return 0
			}),
		fuseRequestsCollector{m},
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "mtcfs_replication_yield_seconds_total",
			Help: "Time pushes to peers waited before starting, and pushes from peers before they were read, because the job was saving on a busy node."}, r.node.yield.waitedSeconds),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "mtcfs_early_hash_yield_seconds_total",
			Help: "Time the hashing of files the job closed waited because the job was using the mount, and sealing because the job was writing a next save, on a busy node."}, r.node.yield.hashWaitedSeconds),
	)
	return m
}

// ObserveFUSERequests makes the metrics export the mount's FUSE requests by operation as
// mtcfs_fuse_requests_total{op}; fs.Mount calls it with a func that reads its counters.
func (r *Replicator) ObserveFUSERequests(counts func() map[string]uint64) {
	if m := r.node.metrics; m != nil {
		m.fuseRequests.Store(&counts)
	}
}

var fuseRequestsDesc = prometheus.NewDesc("mtcfs_fuse_requests_total",
	"FUSE requests the mount served, by operation (lookup, getattr, create, release, …).", []string{"op"}, nil)

// fuseRequestsCollector exports the counts the mount keeps itself (an atomic add per request).
type fuseRequestsCollector struct{ m *Metrics }

func (c fuseRequestsCollector) Describe(ch chan<- *prometheus.Desc) { ch <- fuseRequestsDesc }

func (c fuseRequestsCollector) Collect(ch chan<- prometheus.Metric) {
	f := c.m.fuseRequests.Load()
	if f == nil {
		return
	}
	for op, n := range (*f)() {
		ch <- prometheus.MustNewConstMetric(fuseRequestsDesc, prometheus.CounterValue, float64(n), op)
	}
}

func (m *Metrics) sealed(seconds float64) {
	if m != nil {
		m.seal.Observe(seconds)
	}
}

func (m *Metrics) replicated(seconds float64) {
	if m != nil {
		m.replicate.Observe(seconds)
	}
}

func (m *Metrics) backedUp(seconds float64, bytes int64) {
	if m != nil {
		m.backup.Observe(seconds)
		m.bytes.WithLabelValues("backup", "out").Add(float64(bytes))
	}
}

func (m *Metrics) restored(source string, seconds float64) {
	if m != nil {
		m.restore.WithLabelValues(source).Observe(seconds)
	}
}

func (m *Metrics) moved(tier, direction string, bytes int64) {
	if m != nil && bytes > 0 {
		m.bytes.WithLabelValues(tier, direction).Add(float64(bytes))
	}
}

func (m *Metrics) error(kind string) {
	if m != nil {
		m.errors.WithLabelValues(kind).Inc()
	}
}

func (m *Metrics) committed() {
	if m != nil {
		m.commits.Inc()
	}
}

// treeBytes is the number of bytes of the regular files of the data at p (a tree or a file).
func treeBytes(p string) int64 {
	if fi, err := os.Lstat(p); err == nil && fi.Mode().IsRegular() {
		return fi.Size()
	}
	entries, err := layout.ListTree(p)
	if err != nil {
		return 0
	}
	var n int64
	for _, e := range entries {
		n += e.Size
	}
	return n
}
