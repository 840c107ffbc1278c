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
