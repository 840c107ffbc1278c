//go:build amd64 && !purego

package planecodec

// The SSE2 loops of planes_amd64.s do the bulk, 16 elements at a time; the Go loops do the rest.

//go:noescape
func join2SSE2(dst, p0, p1 *byte, n int)

//go:noescape
func split2SSE2(p0, p1, src *byte, n int)

//go:noescape
func join4SSE2(dst, p0, p1, p2, p3 *byte, n int)

//go:noescape
func split4SSE2(p0, p1, p2, p3, src *byte, n int)

func split2(p0, p1, src []byte) {
	n := len(src) / 2
	p0, p1 = p0[:n], p1[:n] // the assembly writes n bytes to each
	bulk := n &^ 15
	if bulk > 0 {
		split2SSE2(&p0[0], &p1[0], &src[0], bulk)
	}
	split2Go(p0[bulk:], p1[bulk:], src[2*bulk:])
}

func join2(dst, p0, p1 []byte) {
	n := len(p0)
	p1, dst = p1[:n], dst[:2*n]
	bulk := n &^ 15
	if bulk > 0 {
		join2SSE2(&dst[0], &p0[0], &p1[0], bulk)
	}
	join2Go(dst[2*bulk:], p0[bulk:], p1[bulk:])
}

func split4(p0, p1, p2, p3, src []byte) {
	n := len(src) / 4
	p0, p1, p2, p3 = p0[:n], p1[:n], p2[:n], p3[:n]
	bulk := n &^ 15
	if bulk > 0 {
		split4SSE2(&p0[0], &p1[0], &p2[0], &p3[0], &src[0], bulk)
	}
	split4Go(p0[bulk:], p1[bulk:], p2[bulk:], p3[bulk:], src[4*bulk:])
}

func join4(dst, p0, p1, p2, p3 []byte) {
	n := len(p0)
	p1, p2, p3, dst = p1[:n], p2[:n], p3[:n], dst[:4*n]
	bulk := n &^ 15
	if bulk > 0 {
		join4SSE2(&dst[0], &p0[0], &p1[0], &p2[0], &p3[0], bulk)
	}
	join4Go(dst[4*bulk:], p0[bulk:], p1[bulk:], p2[bulk:], p3[bulk:])
}
