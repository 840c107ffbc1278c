package planecodec

import "encoding/binary"

// splitPlanes writes byte k of every w-byte element of src to planes[k] (len(src)/w bytes each);
// src's tail of len(src)%w bytes is left to the caller.
func splitPlanes(planes [][]byte, src []byte, w int) {
	switch w {
	case 1:
		copy(planes[0], src)
	case 2:
		split2(planes[0], planes[1], src)
	case 4:
		split4(planes[0], planes[1], planes[2], planes[3], src)
	}
}

// joinPlanes is the inverse of splitPlanes: element i of dst is byte i of every plane.
func joinPlanes(dst []byte, planes [][]byte, w int) {
	switch w {
	case 1:
		copy(dst, planes[0])
	case 2:
		join2(dst, planes[0], planes[1])
	case 4:
		join4(dst, planes[0], planes[1], planes[2], planes[3])
	}
}

// The portable loops below move eight elements per iteration through 64-bit words (SWAR):
// gathering every other byte of a word and spreading a word's bytes apart are three
// shift-and-mask steps each. On amd64 they only finish what the SSE2 loops of planes_amd64.s
// leave (fewer than 16 elements), since Go's register allocation holds them near 2 GB/s.

// evenBytes packs bytes 0, 2, 4, 6 of x into the low 32 bits.
func evenBytes(x uint64) uint64 {
	x &= 0x00ff00ff00ff00ff
	x = (x | x>>8) & 0x0000ffff0000ffff
	return (x | x>>16) & 0x00000000ffffffff
}

// spreadBytes is the inverse of evenBytes: the low four bytes of x go to bytes 0, 2, 4, 6.
func spreadBytes(x uint64) uint64 {
	x &= 0x00000000ffffffff
	x = (x | x<<16) & 0x0000ffff0000ffff
	return (x | x<<8) & 0x00ff00ff00ff00ff
}

func split2Go(p0, p1, src []byte) {
	n := len(src) / 2
	i := 0
	for ; i+8 <= n; i += 8 {
		a := binary.LittleEndian.Uint64(src[2*i:])
		b := binary.LittleEndian.Uint64(src[2*i+8:])
		binary.LittleEndian.PutUint64(p0[i:], evenBytes(a)|evenBytes(b)<<32)
		binary.LittleEndian.PutUint64(p1[i:], evenBytes(a>>8)|evenBytes(b>>8)<<32)
	}
	for ; i < n; i++ {
		p0[i], p1[i] = src[2*i], src[2*i+1]
	}
}

func join2Go(dst, p0, p1 []byte) {
	n := len(p0)
	i := 0
	for ; i+8 <= n; i += 8 {
		a := binary.LittleEndian.Uint64(p0[i:])
		b := binary.LittleEndian.Uint64(p1[i:])
		binary.LittleEndian.PutUint64(dst[2*i:], spreadBytes(a)|spreadBytes(b)<<8)
		binary.LittleEndian.PutUint64(dst[2*i+8:], spreadBytes(a>>32)|spreadBytes(b>>32)<<8)
	}
	for ; i < n; i++ {
		dst[2*i], dst[2*i+1] = p0[i], p1[i]
	}
}

func split4Go(p0, p1, p2, p3, src []byte) {
	n := len(src) / 4
	i := 0
	for ; i+8 <= n; i += 8 {
		// Four words hold eight elements; two rounds of even/odd byte gathering sort their
		// bytes by position in the element.
		w0 := binary.LittleEndian.Uint64(src[4*i:])
		w1 := binary.LittleEndian.Uint64(src[4*i+8:])
		w2 := binary.LittleEndian.Uint64(src[4*i+16:])
		w3 := binary.LittleEndian.Uint64(src[4*i+24:])
		// Bytes 0 and 2 of each element, then bytes 1 and 3.
		e01 := evenBytes(w0) | evenBytes(w1)<<32
		e23 := evenBytes(w2) | evenBytes(w3)<<32
		o01 := evenBytes(w0>>8) | evenBytes(w1>>8)<<32
		o23 := evenBytes(w2>>8) | evenBytes(w3>>8)<<32
		binary.LittleEndian.PutUint64(p0[i:], evenBytes(e01)|evenBytes(e23)<<32)
		binary.LittleEndian.PutUint64(p2[i:], evenBytes(e01>>8)|evenBytes(e23>>8)<<32)
		binary.LittleEndian.PutUint64(p1[i:], evenBytes(o01)|evenBytes(o23)<<32)
		binary.LittleEndian.PutUint64(p3[i:], evenBytes(o01>>8)|evenBytes(o23>>8)<<32)
	}
	for ; i < n; i++ {
		p0[i], p1[i], p2[i], p3[i] = src[4*i], src[4*i+1], src[4*i+2], src[4*i+3]
	}
}

func join4Go(dst, p0, p1, p2, p3 []byte) {
	n := len(p0)
	i := 0
	for ; i+8 <= n; i += 8 {
		a := binary.LittleEndian.Uint64(p0[i:])
		b := binary.LittleEndian.Uint64(p1[i:])
		c := binary.LittleEndian.Uint64(p2[i:])
		d := binary.LittleEndian.Uint64(p3[i:])
		// Bytes 0 and 2 of each element interleaved, then bytes 1 and 3.
		e01 := spreadBytes(a) | spreadBytes(c)<<8
		e23 := spreadBytes(a>>32) | spreadBytes(c>>32)<<8
		o01 := spreadBytes(b) | spreadBytes(d)<<8
		o23 := spreadBytes(b>>32) | spreadBytes(d>>32)<<8
		binary.LittleEndian.PutUint64(dst[4*i:], spreadBytes(e01)|spreadBytes(o01)<<8)
		binary.LittleEndian.PutUint64(dst[4*i+8:], spreadBytes(e01>>32)|spreadBytes(o01>>32)<<8)
		binary.LittleEndian.PutUint64(dst[4*i+16:], spreadBytes(e23)|spreadBytes(o23)<<8)
		binary.LittleEndian.PutUint64(dst[4*i+24:], spreadBytes(e23>>32)|spreadBytes(o23>>32)<<8)
	}
	for ; i < n; i++ {
		dst[4*i], dst[4*i+1], dst[4*i+2], dst[4*i+3] = p0[i], p1[i], p2[i], p3[i]
	}
}
