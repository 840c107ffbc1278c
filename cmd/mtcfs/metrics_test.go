package main

import (
	"net/http"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// scrape reads the agent's /metrics.
func scrape(t *testing.T, addr string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(resp.Body)
	require.NoError(t, err)
	return fams
}

// value returns the value of the metric of fam whose labels include want (a gauge, a counter,
// or a histogram's count).
func value(t *testing.T, fams map[string]*dto.MetricFamily, fam string, want map[string]string) float64 {
	t.Helper()
	f, ok := fams[fam]
	require.True(t, ok, "no metric family %s", fam)
next:
	for _, m := range f.GetMetric() {
		for k, v := range want {
			found := false
			for _, l := range m.GetLabel() {
				found = found || (l.GetName() == k && l.GetValue() == v)
			}
			if !found {
				continue next
			}
		}
		switch {
		case m.Gauge != nil:
			return m.GetGauge().GetValue()
		case m.Counter != nil:
			return m.GetCounter().GetValue()
		case m.Histogram != nil:
			return float64(m.GetHistogram().GetSampleCount())
		}
	}
	t.Fatalf("no %s with labels %v", fam, want)
	return 0
}

// TestMetrics: /metrics serves the families of SPEC §10 with values that follow the job.
func TestMetrics(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	n := newRepNode(t)
	const job = "metered"
	a := n.start(t, "--http", "127.0.0.1:0")
	addr := agentHTTPAddr(t, a)

	fams := scrape(t, addr)
	assert.EqualValues(t, 64<<20, value(t, fams, "mtcfs_ram_budget_bytes", nil))
	assert.EqualValues(t, -1, value(t, fams, "mtcfs_latest_step", map[string]string{"state": "sealed"}))
	assert.EqualValues(t, 1, value(t, fams, "mtcfs_build_info", nil))
	for _, fam := range []string{"mtcfs_replication_yield_seconds_total", "mtcfs_early_hash_yield_seconds_total"} {
		assert.GreaterOrEqual(t, value(t, fams, fam, nil), 0.0, fam) // exported (value fails the test if not)
	}

	o := orbaxClient(t, n.dir, job, fastBackupMinutes)
	_, _, err := o.Start(ctx)
	require.NoError(t, err)
	require.NoError(t, o.Save(ctx, 0))
	require.NoError(t, o.Save(ctx, 10))
	waitCompleteBackup(t, n, job, 10)
	repWait(t, 10*time.Second, "the backup in the metrics", func() bool {
		fams = scrape(t, addr)
		return value(t, fams, "mtcfs_latest_step", map[string]string{"state": "backed_up"}) == 10
	})
	for state, want := range map[string]float64{"committed": 10, "sealed": 10, "replicated": 10, "backed_up": 10} {
		assert.Equal(t, want, value(t, fams, "mtcfs_latest_step", map[string]string{"state": state}), "latest %s step", state)
	}
	assert.EqualValues(t, 2, value(t, fams, "mtcfs_commits_total", nil))
	assert.EqualValues(t, 2, value(t, fams, "mtcfs_seal_duration_seconds", nil), "two seals observed")
	assert.EqualValues(t, 1, value(t, fams, "mtcfs_backup_duration_seconds", nil))
	assert.Positive(t, value(t, fams, "mtcfs_ram_used_bytes", nil))
	assert.Zero(t, value(t, fams, "mtcfs_seal_retrying", nil), "no step in its seal tries")
	assert.Positive(t, value(t, fams, "mtcfs_transferred_bytes_total", map[string]string{"tier": "backup", "direction": "out"}))
	assert.Zero(t, value(t, fams, "mtcfs_transferred_bytes_total", map[string]string{"tier": "peer", "direction": "out"}), "a one-node job pushes nothing")
	for _, kind := range []string{"seal", "replication", "sync", "backup", "restore", "verify", "config"} {
		assert.Zero(t, value(t, fams, "mtcfs_errors_total", map[string]string{"kind": kind}), "errors of kind %s", kind)
	}

	// A bad replicator.yaml counts as a config error.
	o2 := orbaxClient(t, n.dir, job, fastBackupMinutes)
	o2.Nodes = 0
	_, _, err = o2.Start(ctx)
	require.Error(t, err)
	assert.EqualValues(t, 1, value(t, scrape(t, addr), "mtcfs_errors_total", map[string]string{"kind": "config"}))
}
