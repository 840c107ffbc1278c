package benchkit

import (
	"math"
	"testing"
)

func TestMedianAndPercentile(t *testing.T) {
	for _, tc := range []struct {
		xs          []float64
		median, p99 float64
		p50         float64
	}{
		{nil, math.NaN(), math.NaN(), math.NaN()},
		{[]float64{3}, 3, 3, 3},
		{[]float64{4, 1, 3}, 3, 4, 3},
		{[]float64{4, 1, 3, 2}, 2.5, 4, 2},
	} {
		same := func(a, b float64) bool { return a == b || math.IsNaN(a) && math.IsNaN(b) }
		if got := Median(tc.xs); !same(got, tc.median) {
			t.Errorf("Median(%v) = %v, want %v", tc.xs, got, tc.median)
		}
		if got := Percentile(tc.xs, 0.99); !same(got, tc.p99) {
			t.Errorf("Percentile(%v, 0.99) = %v, want %v", tc.xs, got, tc.p99)
		}
		if got := Percentile(tc.xs, 0.5); !same(got, tc.p50) {
			t.Errorf("Percentile(%v, 0.5) = %v, want %v", tc.xs, got, tc.p50)
		}
	}
}

func TestSamples(t *testing.T) {
	var s Samples
	s.Add("b, ms", 3)
	s.Add("a, ×", 1.5)
	s.Add("b, ms", 1)
	s.Add("b, ms", 2)
	if got := s.Median("b, ms"); got != 2 {
		t.Errorf("Median = %v, want 2", got)
	}
	if got := s.Max("b, ms"); got != 3 {
		t.Errorf("Max = %v, want 3", got)
	}
	if got := s.Median("none"); !math.IsNaN(got) {
		t.Errorf("Median of no values = %v, want NaN", got)
	}
	want := "\n<details><summary>Raw</summary>\n\n| Measurement | Samples |\n|---|---|\n| b, ms | 3.00 1.00 2.00 |\n| a, × | 1.50 |\n\n</details>\n"
	if got := s.RawTable("Raw"); got != want {
		t.Errorf("RawTable =\n%q\nwant (keys in the order of their first value, values as recorded)\n%q", got, want)
	}
}
