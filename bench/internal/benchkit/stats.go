package benchkit

import (
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
)

// Median of xs; NaN for none.
func Median(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := slices.Sorted(slices.Values(xs))
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// Percentile by nearest rank: the smallest value with at least q of the samples at or below it;
// NaN for none.
func Percentile(xs []float64, q float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := slices.Sorted(slices.Values(xs))
	i := int(float64(len(s))*q+0.999999) - 1
	return s[max(0, min(i, len(s)-1))]
}

// Samples are the measurements of a run: key → one value per measured repetition, in order.
// A key says what it measures and in which unit ("commit → .meta in the mount, ms"): the table
// of raw samples lists the keys as they are. Add may be called from several goroutines; the rest
// once they are done.
type Samples struct {
	mu    sync.Mutex
	m     map[string][]float64 // GUARDED_BY(mu)
	order []string             // GUARDED_BY(mu): the keys, in the order of their first value
}

// Add records one value of key.
func (s *Samples) Add(key string, v float64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m == nil {
		s.m = map[string][]float64{}
	}
	if _, ok := s.m[key]; !ok {
		s.order = append(s.order, key)
	}
	s.m[key] = append(s.m[key], v)
}

// Of returns the values of key, in the order recorded.
func (s *Samples) Of(key string) []float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.m[key]
}

// Median of key's values; NaN for none.
func (s *Samples) Median(key string) float64 { return Median(s.Of(key)) }

// Max of key's values; NaN for none.
func (s *Samples) Max(key string) float64 {
	if vs := s.Of(key); len(vs) > 0 {
		return slices.Max(vs)
	}
	return math.NaN()
}

// RawTable renders every key's values, keys in the order of their first value, as a collapsed
// Markdown table under summary.
func (s *Samples) RawTable(summary string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var b strings.Builder
	fmt.Fprintf(&b, "\n<details><summary>%s</summary>\n\n| Measurement | Samples |\n|---|---|\n", summary)
	for _, k := range s.order {
		fmt.Fprintf(&b, "| %s | %s |\n", k, FormatSamples(s.m[k]))
	}
	b.WriteString("\n</details>\n")
	return b.String()
}
