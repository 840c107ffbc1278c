//go:build !amd64 || purego

package planecodec

func split2(p0, p1, src []byte)         { split2Go(p0, p1, src) }
func join2(dst, p0, p1 []byte)          { join2Go(dst, p0, p1) }
func split4(p0, p1, p2, p3, src []byte) { split4Go(p0, p1, p2, p3, src) }
func join4(dst, p0, p1, p2, p3 []byte)  { join4Go(dst, p0, p1, p2, p3) }
