// Package planecodec compresses chunks of checkpoint bytes where that pays: it splits a chunk's
// bytes into byte planes by element width and entropy codes each plane with huff0
// (github.com/klauspost/compress/huff0), or keeps the chunk as it is.
//
// Checkpoints are mostly float tensors. The low bytes of a float's mantissa are close to random,
// but the byte holding the sign and the exponent is highly skewed, and a general-purpose
// compressor sees the two interleaved. With the bytes of each width-w element dealt into w planes
// (plane k holds byte k of every element), the exponent plane of bf16 weights takes about a third
// of its size under an order-0 entropy coder and the mantissa planes are stored as they are.
//
// # Choices
//
//   - Width: 1, 2 or 4, chosen per chunk from a sample (a 2-byte width for bf16/fp16, 4 for fp32,
//     1 for int8/fp8 or bytes). Planes are plain byte positions of the little-endian elements;
//     moving the sign bit next to the mantissa (so that one byte holds the whole exponent) gained
//     under 1% on real training data and is not done.
//   - Coder: huff0 4X on blocks of 32 KiB of a plane, each block with its own table. zstd on a
//     plane compressed the exponent planes of the weights and first moments less well than
//     huff0, and of the second moments better (its matches exploit neighbours with equal
//     exponents), at three times huff0's CPU to compress and up to twice to decompress; huff0
//     meets the size targets on its own. Smaller blocks follow the statistics of neighbouring
//     tensors more closely but decode more slowly: 32 KiB stays within 1% of the best size
//     (4 KiB blocks) and decodes about as fast as larger blocks. The numbers: bench/RESULTS.md
//     (codecbench).
//   - Sample first: 8 windows of 2 KiB spread over the chunk are counted by byte position; the
//     order-0 entropy of each candidate plane estimates its coded size. A plane is coded only if
//     the estimate saves 1/32 of it, a wider width is taken only if it beats a narrower one by 1%,
//     and the chunk is stored raw unless the estimate saves 1/64 of it. Random or already
//     compressed data costs a 16 KiB histogram, a copy and a CRC. Chunks under 4 KiB are stored
//     raw. If the coded form still comes out no smaller than the raw form, the raw form is
//     stored: a chunk never takes more than a 20-byte header beyond its length.
//
// # Format
//
// Every chunk starts with a 20-byte header; integers are little-endian.
//
//	offset size
//	0      4    magic "MTPC"
//	4      1    format version, 1
//	5      1    method: 0 raw, 1 planes
//	6      1    element width: 1 for raw; 1, 2 or 4 for planes
//	7      1    planes: log2 of the block length (12–17); raw: 0
//	8      4    original length L (at most MaxLen)
//	12     4    payload length P: the chunk is 20 + P bytes
//	16     4    CRC32C (Castagnoli) of header bytes 0–15 followed by the payload
//
// A raw chunk's payload is the L original bytes.
//
// A planes chunk with width w has n = L / w elements; its payload is
//
//	w plane entries of 5 bytes: coding (0 raw, 1 coded), stored length S_k (uint32)
//	the L mod w trailing bytes of the original, as they are
//	plane 0 (S_0 bytes), plane 1, … plane w−1
//
// A raw plane is its n bytes. A coded plane is a sequence of ⌈n / B⌉ blocks, B = 1 << block log,
// every block B bytes of the plane except a shorter last one; each block is a 1-byte kind, a
// 3-byte stored length and that many bytes:
//
//	kind 0 (raw):   the block's bytes as they are
//	kind 1 (huff0): a huff0 table and four streams (huff0.Compress4X; huff0.ReadTable and
//	                Decoder.Decompress4X read it)
//	kind 2 (RLE):   one byte, repeated for the whole block
//
// The original element i is byte i of planes 0 … w−1 in order, and the trailing bytes follow
// the last element.
//
// # Integrity
//
// The CRC32C covers the stored bytes (header and payload), so a chunk damaged in storage or in
// transit is refused before it is decoded. It says nothing about the original bytes: callers keep
// those bytes' BLAKE3 and check it after decoding (restores verify the original content).
// Decoding checks every length against the header and the input and refuses anything
// inconsistent with an error wrapping ErrCorrupt (it never panics on bad input). It allocates
// the output, of the declared original length, which the Decoder bounds by its limit, and one
// block per plane of scratch, nothing else: blocks are decoded and joined one range at a time.
//
// # Use
//
// An Encoder and a Decoder each keep scratch buffers and serve one goroutine. Callers pass dst
// buffers (MaxEncodedLen gives the room an encoded chunk needs); in steady state neither encoding
// nor decoding allocates. Chunks are independent: a stream or an object is a sequence of them,
// and ParseHeader gives each one's length.
package planecodec
