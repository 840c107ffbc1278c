package tiers

import (
	"fmt"
	"math"
	"strconv"
	"strings"
)

var sizeUnits = []struct {
	suffix string
	mult   float64
}{
	{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40},
	{"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12},
	// Single letters follow Kubernetes' convention for memory: G is 10^9, Gi is 2^30.
	{"Ki", 1 << 10}, {"Mi", 1 << 20}, {"Gi", 1 << 30}, {"Ti", 1 << 40},
	{"K", 1e3}, {"M", 1e6}, {"G", 1e9}, {"T", 1e12},
	{"B", 1},
}

// ParseSize reads sizes like "512MiB", "8GiB", "2G", "1.5Gi" or a plain number of bytes.
func ParseSize(s string) (int64, error) {
	t := strings.TrimSpace(s)
	mult := 1.0
	for _, u := range sizeUnits {
		if strings.HasSuffix(t, u.suffix) {
			t, mult = strings.TrimSpace(strings.TrimSuffix(t, u.suffix)), u.mult
			break
		}
	}
	v, err := strconv.ParseFloat(t, 64)
	if err != nil || v < 0 || math.IsInf(v, 0) || math.IsNaN(v) {
		return 0, fmt.Errorf("invalid size %q: want a number of bytes or a number with a unit such as 512MiB, 8GiB or 2G", s)
	}
	b := v * mult
	if b > math.MaxInt64/2 {
		return 0, fmt.Errorf("invalid size %q: too large", s)
	}
	return int64(b), nil
}

// FormatSize prints a byte count with a binary unit, for messages and status output.
func FormatSize(n int64) string {
	switch {
	case n >= 1<<30:
		// Exact when short (8GiB, 1.5GiB: a budget as given), else two decimals: full precision
		// printed 4.00384521484375GiB (found by a black-box run).
		v := float64(n) / (1 << 30)
		s := strconv.FormatFloat(v, 'f', -1, 64)
		if _, frac, ok := strings.Cut(s, "."); ok && len(frac) > 2 {
			s = strconv.FormatFloat(v, 'f', 2, 64)
			if strings.HasSuffix(s, ".00") {
				// Not whole, but it would look whole: "4.00GiB is more than 4GiB" (a review).
				return strconv.FormatFloat(float64(n)/(1<<20), 'f', 1, 64) + "MiB"
			}
		}
		return s + "GiB"
	case n >= 1<<20:
		return strconv.FormatFloat(float64(n)/(1<<20), 'f', 1, 64) + "MiB"
	case n >= 1<<10:
		return strconv.FormatFloat(float64(n)/(1<<10), 'f', 1, 64) + "KiB"
	}
	return strconv.FormatInt(n, 10) + "B"
}
