package planecodec

import "math"

// The encoder decides from a sample whether a chunk is worth coding, with which element width,
// and which of its planes: it counts the bytes of a few small windows spread over the chunk by
// their position in a 4-byte word, and estimates each plane's coded size by its order-0 entropy.
// Random or already compressed data is then stored raw after reading about 16 KiB of it.
const (
	sampleWindows   = 8
	sampleWindowLen = 2 << 10
	sampleLen       = sampleWindows * sampleWindowLen

	// minTryLen: shorter chunks are stored raw; plane tables and huff0 tables would eat most
	// of what coding saves.
	minTryLen = 4 << 10

	// A plane is coded only if its estimate saves at least 1/planeGainDiv of it (below that,
	// entropy decoding costs more than the bytes are worth), and a chunk only if the estimate
	// saves 1/chunkGainDiv of it. The estimate corrects the entropy of the sample for its bias
	// (counted from a sample, the entropy of random bytes comes out up to 2% short of 8 bits).
	planeGainDiv = 32
	chunkGainDiv = 64

	// A wider element must beat a narrower one's estimate by 1/widerGainDiv: more planes cost
	// more tables and a slower split.
	widerGainDiv = 100
)

// plan is what the sample decided.
type plan struct {
	width int     // 0: store raw
	code  [4]bool // plane k is entropy coded
}

// planChunk samples src and decides how to encode it: with which of the widths 1, 2 and 4, or
// with width only if that is not 0.
func planChunk(src []byte, width int) plan {
	if len(src) < minTryLen {
		return plan{}
	}
	// hist[j] counts the bytes at positions ≡ j mod 4; every window starts at a multiple of 4,
	// so hist[j] is plane j for width 4, hist[j]+hist[j+2] plane j for width 2, and their sum
	// the only plane of width 1.
	var hist [4][256]uint32
	if len(src) <= sampleLen {
		countBytes(&hist, src[:len(src)&^3])
	} else {
		step := (len(src) - sampleWindowLen) / (sampleWindows - 1) &^ 3
		for i := range sampleWindows {
			countBytes(&hist, src[i*step:i*step+sampleWindowLen])
		}
	}
	// Width 4 first: a plane of width 2 or 1 mixes planes of width 4, and the entropy of a
	// mixture is at least the mean of its parts', so when no plane of width 4 pays, none of the
	// narrower ones does either (up to the bias correction), and random data costs no more
	// estimates.
	var plans [5]plan
	var sizes [5]float64
	for _, w := range []int{4, 2, 1} {
		if width != 0 && w != width {
			continue
		}
		plans[w], sizes[w] = planWidth(&hist, w)
		if width == 0 && w == 4 && plans[w].code == [4]bool{} {
			return plan{}
		}
	}
	best, bestSize := plan{}, math.Inf(1)
	for _, w := range []int{1, 2, 4} {
		if plans[w].width != 0 && sizes[w] < bestSize*(1-1.0/widerGainDiv) {
			best, bestSize = plans[w], sizes[w]
		}
	}
	var total float64
	for _, c := range hist[0] {
		total += 4 * float64(c)
	}
	if bestSize > total*(1-1.0/chunkGainDiv) {
		return plan{}
	}
	return best
}

// planWidth estimates the sample's size split into planes of width w, each plane coded if its
// estimate pays.
func planWidth(hist *[4][256]uint32, w int) (plan, float64) {
	p := plan{width: w}
	size := 0.0
	for k := range w {
		var counts [256]uint32
		for j := k; j < 4; j += w {
			for s, c := range hist[j] {
				counts[s] += c
			}
		}
		raw, coded := planeEstimate(&counts)
		if coded <= raw*(1-1.0/planeGainDiv) {
			p.code[k] = true
			size += coded
		} else {
			size += raw
		}
	}
	return p, size
}

// countBytes adds the bytes of b (a multiple of 4 long) to hist by position modulo 4.
func countBytes(hist *[4][256]uint32, b []byte) {
	for i := 0; i+4 <= len(b); i += 4 {
		hist[0][b[i]]++
		hist[1][b[i+1]]++
		hist[2][b[i+2]]++
		hist[3][b[i+3]]++
	}
}

// planeEstimate gives a plane sample's size in bytes as it is and entropy coded (order 0).
func planeEstimate(counts *[256]uint32) (raw, coded float64) {
	var n, sumCLogC float64
	seen := 0
	for _, c := range counts {
		if c > 0 {
			seen++
			f := float64(c)
			n += f
			sumCLogC += f * math.Log2(f)
		}
	}
	if n == 0 {
		return 0, 0
	}
	// n × the entropy of the sample, plus the Miller–Madow correction for the bias of an
	// entropy estimated from counts: (symbols seen − 1) / 2 nats.
	bits := n*math.Log2(n) - sumCLogC + float64(seen-1)/(2*math.Ln2)
	return n, bits / 8
}
