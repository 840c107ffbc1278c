package planecodec

import (
	"bytes"
	"fmt"
	"testing"
)

// TestSplitJoin checks the plane shuffles against the definition, for the implementation in
// use (assembly on amd64) and for the portable Go loops, at every length up to 1,000 bytes.
func TestSplitJoin(t *testing.T) {
	src := randomBytes(1000, 7)
	type impl struct {
		split func(planes [][]byte, src []byte, w int)
		join  func(dst []byte, planes [][]byte, w int)
	}
	portable := impl{
		split: func(p [][]byte, src []byte, w int) {
			switch w {
			case 1:
				copy(p[0], src)
			case 2:
				split2Go(p[0], p[1], src)
			case 4:
				split4Go(p[0], p[1], p[2], p[3], src)
			}
		},
		join: func(dst []byte, p [][]byte, w int) {
			switch w {
			case 1:
				copy(dst, p[0])
			case 2:
				join2Go(dst, p[0], p[1])
			case 4:
				join4Go(dst, p[0], p[1], p[2], p[3])
			}
		},
	}
	for name, im := range map[string]impl{"in use": {splitPlanes, joinPlanes}, "portable": portable} {
		for _, w := range []int{1, 2, 4} {
			for n := 0; n <= len(src); n++ {
				elems := n / w
				planes := make([][]byte, w)
				for k := range planes {
					planes[k] = make([]byte, elems)
				}
				im.split(planes, src[:n], w)
				for i := range elems {
					for k := range w {
						if planes[k][i] != src[i*w+k] {
							t.Fatalf("%s, width %d, %d bytes: plane %d byte %d is %#x, want byte %d of the input, %#x", name, w, n, k, i, planes[k][i], i*w+k, src[i*w+k])
						}
					}
				}
				joined := make([]byte, elems*w)
				im.join(joined, planes, w)
				if !bytes.Equal(joined, src[:elems*w]) {
					t.Fatalf("%s, width %d, %d bytes: joined planes differ from the input", name, w, n)
				}
			}
		}
	}
}

// BenchmarkSplitJoin measures the plane shuffles alone on 1 MiB.
func BenchmarkSplitJoin(b *testing.B) {
	src := randomBytes(1<<20, 1)
	dst := make([]byte, len(src))
	for _, w := range []int{2, 4} {
		planes := make([][]byte, w)
		for k := range planes {
			planes[k] = make([]byte, len(src)/w)
		}
		b.Run(fmt.Sprintf("split%d", w), func(b *testing.B) {
			b.SetBytes(int64(len(src)))
			for b.Loop() {
				splitPlanes(planes, src, w)
			}
		})
		b.Run(fmt.Sprintf("join%d", w), func(b *testing.B) {
			b.SetBytes(int64(len(src)))
			for b.Loop() {
				joinPlanes(dst, planes, w)
			}
		})
	}
}
