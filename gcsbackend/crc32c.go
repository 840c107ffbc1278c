package gcsbackend

// crc32cCombine returns the CRC32C of A‖B from crcA = CRC32C(A), crcB =
// CRC32C(B) and lenB = len(B), without the bytes: zlib's crc32_combine with
// the Castagnoli polynomial. Appending lenB zero bits to A is a linear map
// over GF(2), applied by repeated squaring of the one-zero-bit operator, so the
// cost is O(log lenB) 32×32 bit-matrix products (about a microsecond).
//
// It lets ranged and parallel transfers check a whole object against one
// CRC32C: each part's CRC is taken as its bytes stream past, and the parts'
// CRCs are combined in order.
func crc32cCombine(crcA, crcB uint32, lenB int64) uint32 {
	if lenB <= 0 {
		return crcA
	}
	var even, odd [32]uint32 // operators for 2^k zero bits, alternating
	odd[0] = 0x82f63b78      // reflected Castagnoli polynomial: one zero bit
	row := uint32(1)
	for n := 1; n < 32; n++ {
		odd[n] = row
		row <<= 1
	}
	gf2Square(&even, &odd) // two zero bits
	gf2Square(&odd, &even) // four zero bits
	// The first squaring in the loop gives one zero byte (eight bits).
	for {
		gf2Square(&even, &odd)
		if lenB&1 != 0 {
			crcA = gf2Times(&even, crcA)
		}
		lenB >>= 1
		if lenB == 0 {
			break
		}
		gf2Square(&odd, &even)
		if lenB&1 != 0 {
			crcA = gf2Times(&odd, crcA)
		}
		lenB >>= 1
		if lenB == 0 {
			break
		}
	}
	return crcA ^ crcB
}

func gf2Times(mat *[32]uint32, vec uint32) uint32 {
	var sum uint32
	for i := 0; vec != 0; i, vec = i+1, vec>>1 {
		if vec&1 != 0 {
			sum ^= mat[i]
		}
	}
	return sum
}

func gf2Square(square, mat *[32]uint32) {
	for n := range 32 {
		square[n] = gf2Times(mat, mat[n])
	}
}
