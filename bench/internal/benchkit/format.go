package benchkit

import (
	"fmt"
	"math"
	"strconv"
	"strings"
)

// FormatValue prints a measured value with three significant digits or so; NaN is "n/a".
func FormatValue(v float64) string {
	switch {
	case math.IsNaN(v):
		return "n/a"
	case v >= 100:
		return strconv.FormatFloat(v, 'f', 0, 64)
	case v >= 10:
		return strconv.FormatFloat(v, 'f', 1, 64)
	}
	return strconv.FormatFloat(v, 'f', 2, 64)
}

// FormatBytes prints n in whole GiB, MiB or KiB when it is a multiple of one (with one decimal in
// GiB from 1 GiB up otherwise), else in bytes: "1 GiB", "1.5 GiB", "64 MiB", "4 KiB", "100 B".
func FormatBytes(n int64) string {
	switch {
	case n >= 1<<30 && n%(1<<30) == 0:
		return fmt.Sprintf("%d GiB", n>>30)
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d B", n)
}

// FormatSamples writes raw samples for a results table cell, space-separated.
func FormatSamples(vs []float64) string {
	out := make([]string, len(vs))
	for i, v := range vs {
		out[i] = FormatValue(v)
	}
	return strings.Join(out, " ")
}
