package benchkit

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/mtcfs/mtcfs/internal/agents"
	"github.com/mtcfs/mtcfs/tiers"
)

// What an agent did is read from its HTTP endpoints: GET /status (the document `mtcfs status`
// shows, tiers.Status) and GET /metrics (Prometheus text, the mtcfs_* families of README's
// Metrics section), never from its log, whose wording is free to change.

var httpClient = &http.Client{Timeout: 5 * time.Second}

func (a *Agent) get(path string) (*http.Response, error) {
	if a.HTTP == "" {
		return nil, fmt.Errorf("the agent at %s serves no HTTP endpoints", a.Dir)
	}
	resp, err := httpClient.Get("http://" + a.HTTP + path)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		resp.Body.Close()
		return nil, fmt.Errorf("GET %s of the agent at %s: %s", path, a.Dir, resp.Status)
	}
	return resp, nil
}

// Status returns the agent's /status document.
func (a *Agent) Status() (tiers.Status, error) {
	var st tiers.Status
	if a.HTTP == "" {
		return st, fmt.Errorf("the agent at %s serves no HTTP endpoints", a.Dir)
	}
	raw, err := agents.FetchStatus(a.HTTP)
	if err != nil {
		return st, fmt.Errorf("/status of the agent at %s: %w", a.Dir, err)
	}
	return st, json.Unmarshal(raw, &st)
}

// Metrics is one scrape of an agent's /metrics, by family name.
type Metrics map[string]*dto.MetricFamily

// Metrics scrapes the agent's /metrics.
func (a *Agent) Metrics() (Metrics, error) {
	resp, err := a.get("/metrics")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("parse /metrics of the agent at %s: %w", a.Dir, err)
	}
	return Metrics(fams), nil
}

// metric returns the metric of family name whose labels include labels (name, value, …), or
// nil.
func (m Metrics) metric(name string, labels ...string) *dto.Metric {
	fam := m[name]
	if fam == nil {
		return nil
	}
next:
	for _, mt := range fam.GetMetric() {
		for i := 0; i+1 < len(labels); i += 2 {
			found := false
			for _, lp := range mt.GetLabel() {
				if lp.GetName() == labels[i] && lp.GetValue() == labels[i+1] {
					found = true
				}
			}
			if !found {
				continue next
			}
		}
		return mt
	}
	return nil
}

// Value returns the value of a gauge or counter (NaN if the agent does not export it).
func (m Metrics) Value(name string, labels ...string) float64 {
	mt := m.metric(name, labels...)
	switch {
	case mt == nil:
		return math.NaN()
	case mt.Gauge != nil:
		return mt.Gauge.GetValue()
	case mt.Counter != nil:
		return mt.Counter.GetValue()
	case mt.Untyped != nil:
		return mt.Untyped.GetValue()
	}
	return math.NaN()
}

// Histogram is what a Prometheus histogram of durations holds: the number of observations and
// their sum in seconds.
type Histogram struct {
	Count uint64
	Sum   float64
}

// Histogram returns a histogram's count and sum (zero if the agent has observed nothing yet).
func (m Metrics) Histogram(name string, labels ...string) Histogram {
	mt := m.metric(name, labels...)
	if mt == nil || mt.Histogram == nil {
		return Histogram{}
	}
	return Histogram{Count: mt.Histogram.GetSampleCount(), Sum: mt.Histogram.GetSampleSum()}
}

// Since returns the observations h holds beyond earlier, a scrape of the same histogram.
func (h Histogram) Since(earlier Histogram) Histogram {
	return Histogram{Count: h.Count - earlier.Count, Sum: h.Sum - earlier.Sum}
}

// Histogram scrapes one histogram of the agent.
func (a *Agent) Histogram(name string, labels ...string) (Histogram, error) {
	m, err := a.Metrics()
	if err != nil {
		return Histogram{}, err
	}
	return m.Histogram(name, labels...), nil
}

// WaitObserved polls the agent's histogram until it holds more observations than earlier, for
// up to wait, and returns the new ones (the agent records a duration when the work is done,
// which may be a moment after its visible effect).
func (a *Agent) WaitObserved(ctx context.Context, earlier Histogram, wait time.Duration, name string, labels ...string) (Histogram, error) {
	deadline := time.Now().Add(wait)
	for {
		h, err := a.Histogram(name, labels...)
		if err != nil {
			return Histogram{}, err
		}
		if h.Count > earlier.Count {
			return h.Since(earlier), nil
		}
		if time.Now().After(deadline) {
			return Histogram{}, fmt.Errorf("the agent at %s observed no %s within %v", a.Dir, name, wait)
		}
		select {
		case <-ctx.Done():
			return Histogram{}, ctx.Err()
		case <-time.After(2 * time.Millisecond):
		}
	}
}
