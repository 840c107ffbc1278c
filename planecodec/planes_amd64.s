//go:build amd64 && !purego

#include "textflag.h"

// The plane shuffles with SSE2 (every amd64 CPU has it), 16 elements per iteration; n is the
// number of elements, a multiple of 16. Interleaving is PUNPCKL/H; deinterleaving keeps the
// even bytes of each 16-bit word (PAND with 0x00ff) or shifts the odd ones down (PSRLW $8) and
// packs two registers' words into one register's bytes (PACKUSWB).

// func join2SSE2(dst, p0, p1 *byte, n int)
TEXT ·join2SSE2(SB), NOSPLIT, $0-32
	MOVQ dst+0(FP), DI
	MOVQ p0+8(FP), SI
	MOVQ p1+16(FP), DX
	MOVQ n+24(FP), CX
	SHRQ $4, CX
	JZ   done2j

loop2j:
	MOVOU     (SI), X0
	MOVOU     (DX), X1
	MOVO      X0, X2
	PUNPCKLBW X1, X0
	PUNPCKHBW X1, X2
	MOVOU     X0, (DI)
	MOVOU     X2, 16(DI)
	ADDQ      $16, SI
	ADDQ      $16, DX
	ADDQ      $32, DI
	DECQ      CX
	JNZ       loop2j

done2j:
	RET

// func split2SSE2(p0, p1, src *byte, n int)
TEXT ·split2SSE2(SB), NOSPLIT, $0-32
	MOVQ    p0+0(FP), DI
	MOVQ    p1+8(FP), DX
	MOVQ    src+16(FP), SI
	MOVQ    n+24(FP), CX
	SHRQ    $4, CX
	JZ      done2s
	PCMPEQW X7, X7
	PSRLW   $8, X7   // 0x00ff in every word

loop2s:
	MOVOU    (SI), X0
	MOVOU    16(SI), X1
	MOVO     X0, X2
	MOVO     X1, X3
	PAND     X7, X0
	PAND     X7, X1
	PACKUSWB X1, X0  // bytes 0 of the 16 elements
	PSRLW    $8, X2
	PSRLW    $8, X3
	PACKUSWB X3, X2  // bytes 1
	MOVOU    X0, (DI)
	MOVOU    X2, (DX)
	ADDQ     $32, SI
	ADDQ     $16, DI
	ADDQ     $16, DX
	DECQ     CX
	JNZ      loop2s

done2s:
	RET

// func join4SSE2(dst, p0, p1, p2, p3 *byte, n int)
TEXT ·join4SSE2(SB), NOSPLIT, $0-48
	MOVQ dst+0(FP), DI
	MOVQ p0+8(FP), R8
	MOVQ p1+16(FP), R9
	MOVQ p2+24(FP), R10
	MOVQ p3+32(FP), R11
	MOVQ n+40(FP), CX
	SHRQ $4, CX
	JZ   done4j

loop4j:
	MOVOU     (R8), X0
	MOVOU     (R9), X1
	MOVOU     (R10), X2
	MOVOU     (R11), X3
	MOVO      X0, X4
	PUNPCKLBW X1, X0     // bytes 0 and 1 of elements 0–7
	PUNPCKHBW X1, X4     // of elements 8–15
	MOVO      X2, X5
	PUNPCKLBW X3, X2     // bytes 2 and 3 of elements 0–7
	PUNPCKHBW X3, X5     // of elements 8–15
	MOVO      X0, X1
	PUNPCKLWL X2, X0     // elements 0–3
	PUNPCKHWL X2, X1     // elements 4–7
	MOVO      X4, X3
	PUNPCKLWL X5, X4     // elements 8–11
	PUNPCKHWL X5, X3     // elements 12–15
	MOVOU     X0, (DI)
	MOVOU     X1, 16(DI)
	MOVOU     X4, 32(DI)
	MOVOU     X3, 48(DI)
	ADDQ      $16, R8
	ADDQ      $16, R9
	ADDQ      $16, R10
	ADDQ      $16, R11
	ADDQ      $64, DI
	DECQ      CX
	JNZ       loop4j

done4j:
	RET

// func split4SSE2(p0, p1, p2, p3, src *byte, n int)
TEXT ·split4SSE2(SB), NOSPLIT, $0-48
	MOVQ    p0+0(FP), R8
	MOVQ    p1+8(FP), R9
	MOVQ    p2+16(FP), R10
	MOVQ    p3+24(FP), R11
	MOVQ    src+32(FP), SI
	MOVQ    n+40(FP), CX
	SHRQ    $4, CX
	JZ      done4s
	PCMPEQW X7, X7
	PSRLW   $8, X7           // 0x00ff in every word

loop4s:
	MOVOU    (SI), X0        // elements 0–3
	MOVOU    16(SI), X1      // 4–7
	MOVOU    32(SI), X2      // 8–11
	MOVOU    48(SI), X3      // 12–15
	// Round 1: bytes 0 and 2 of every element (even bytes), bytes 1 and 3 (odd bytes).
	MOVO     X0, X4
	MOVO     X1, X5
	PAND     X7, X0
	PAND     X7, X1
	PACKUSWB X1, X0          // bytes 0, 2 of elements 0–7
	PSRLW    $8, X4
	PSRLW    $8, X5
	PACKUSWB X5, X4          // bytes 1, 3 of elements 0–7
	MOVO     X2, X5
	MOVO     X3, X6
	PAND     X7, X2
	PAND     X7, X3
	PACKUSWB X3, X2          // bytes 0, 2 of elements 8–15
	PSRLW    $8, X5
	PSRLW    $8, X6
	PACKUSWB X6, X5          // bytes 1, 3 of elements 8–15
	// Round 2: the same on the results gives one byte position per register.
	MOVO     X0, X1
	MOVO     X2, X3
	PAND     X7, X0
	PAND     X7, X2
	PACKUSWB X2, X0          // bytes 0
	PSRLW    $8, X1
	PSRLW    $8, X3
	PACKUSWB X3, X1          // bytes 2
	MOVO     X4, X2
	MOVO     X5, X3
	PAND     X7, X4
	PAND     X7, X5
	PACKUSWB X5, X4          // bytes 1
	PSRLW    $8, X2
	PSRLW    $8, X3
	PACKUSWB X3, X2          // bytes 3
	MOVOU    X0, (R8)
	MOVOU    X4, (R9)
	MOVOU    X1, (R10)
	MOVOU    X2, (R11)
	ADDQ     $64, SI
	ADDQ     $16, R8
	ADDQ     $16, R9
	ADDQ     $16, R10
	ADDQ     $16, R11
	DECQ     CX
	JNZ      loop4s

done4s:
	RET
