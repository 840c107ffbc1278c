package planecodec

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/klauspost/compress/zstd"
)

// The realistic data: weights and Adam moments of a real training run (testdata/README.md).
var trainingFiles = []struct {
	name  string
	width int // the width the sample should choose
}{
	{"weights_bf16.bin", 2},
	{"adam_m_bf16.bin", 2},
	{"adam_v_bf16.bin", 2},
	{"weights_fp32.bin", 4},
	{"adam_m_fp32.bin", 4},
	{"adam_v_fp32.bin", 4},
}

func readTestdata(t testing.TB, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name))
	if err != nil {
		t.Fatalf("%v (testdata/gen.py makes it)", err)
	}
	return b
}

func randomBytes(n int, seed uint64) []byte {
	b := make([]byte, n)
	r := rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8)})
	r.Read(b)
	return b
}

// compressedBytes is already compressed data: zstd of the fp32 testdata.
var compressedBytes = sync.OnceValue(func() []byte {
	var all []byte
	for _, name := range []string{"weights_fp32.bin", "adam_m_fp32.bin", "adam_v_fp32.bin"} {
		b, err := os.ReadFile(filepath.Join("testdata", name))
		if err != nil {
			panic(err)
		}
		all = append(all, b...)
	}
	enc, err := zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedBetterCompression),
		zstd.WithAllLitEntropyCompression(true), zstd.WithEncoderConcurrency(1))
	if err != nil {
		panic(err)
	}
	return enc.EncodeAll(all, nil)
})

// roundTrip encodes src, checks the header, decodes and compares; it returns the chunk.
func roundTrip(t *testing.T, e *Encoder, d *Decoder, src []byte) []byte {
	t.Helper()
	prefix := []byte("prefix")
	chunk, err := e.Encode(append([]byte(nil), prefix...), src)
	if err != nil {
		t.Fatalf("encode %d bytes: %v", len(src), err)
	}
	if !bytes.Equal(chunk[:len(prefix)], prefix) {
		t.Fatalf("encode %d bytes: the bytes already in dst changed", len(src))
	}
	chunk = chunk[len(prefix):]
	if len(chunk) > MaxEncodedLen(len(src)) {
		t.Fatalf("encode %d bytes: %d bytes, above MaxEncodedLen %d", len(src), len(chunk), MaxEncodedLen(len(src)))
	}
	h, err := ParseHeader(chunk)
	if err != nil {
		t.Fatalf("encode %d bytes: header: %v", len(src), err)
	}
	if h.Len != len(src) || h.Stored != len(chunk) {
		t.Fatalf("encode %d bytes: header says %d bytes, %d stored; chunk is %d", len(src), h.Len, h.Stored, len(chunk))
	}
	out, err := d.Decode(append([]byte(nil), prefix...), chunk)
	if err != nil {
		t.Fatalf("decode %d bytes (%s, width %d): %v", len(src), h.Method, h.Width, err)
	}
	if !bytes.Equal(out[:len(prefix)], prefix) || !bytes.Equal(out[len(prefix):], src) {
		t.Fatalf("decode %d bytes (%s, width %d): output differs from the input", len(src), h.Method, h.Width)
	}
	return chunk
}

func TestRoundTripTrainingData(t *testing.T) {
	e, d := new(Encoder), NewDecoder(MaxLen)
	for _, f := range trainingFiles {
		data := readTestdata(t, f.name)
		for _, chunkLen := range []int{len(data), 1 << 20, 256<<10 + 3, 32<<10 + 1} {
			t.Run(fmt.Sprintf("%s/%d", f.name, chunkLen), func(t *testing.T) {
				for off := 0; off < len(data); off += chunkLen {
					src := data[off:min(off+chunkLen, len(data))]
					chunk := roundTrip(t, e, d, src)
					h, _ := ParseHeader(chunk)
					if len(src) >= 32<<10 && (h.Method != Planes || h.Width != f.width) {
						t.Errorf("chunk at %d (%d bytes): %s width %d, want planes of width %d", off, len(src), h.Method, h.Width, f.width)
					}
				}
			})
		}
	}
}

// TestRatios holds the codec to the targets of issue 13 on the training data, in 1 MiB chunks
// (or the whole file when shorter): bf16 weights and Adam moments at least 1.30× smaller, fp32
// at least 1.10×, random and compressed bytes at most 0.5% larger.
func TestRatios(t *testing.T) {
	e := new(Encoder)
	size := func(data []byte) (stored int) {
		for off := 0; off < len(data); off += 1 << 20 {
			chunk, err := e.Encode(nil, data[off:min(off+1<<20, len(data))])
			if err != nil {
				t.Fatal(err)
			}
			stored += len(chunk)
		}
		return stored
	}
	var bf16, bf16Stored, fp32, fp32Stored int
	for _, f := range trainingFiles {
		data := readTestdata(t, f.name)
		stored := size(data)
		t.Logf("%s: %d → %d bytes, %.3f×", f.name, len(data), stored, float64(len(data))/float64(stored))
		if f.width == 2 {
			bf16, bf16Stored = bf16+len(data), bf16Stored+stored
		} else {
			fp32, fp32Stored = fp32+len(data), fp32Stored+stored
		}
	}
	if r := float64(bf16) / float64(bf16Stored); r < 1.30 {
		t.Errorf("bf16 weights and moments %.3f× smaller, want ≥ 1.30×", r)
	}
	if r := float64(fp32) / float64(fp32Stored); r < 1.10 {
		t.Errorf("fp32 weights and moments %.3f× smaller, want ≥ 1.10×", r)
	}
	for name, data := range map[string][]byte{"random": randomBytes(4<<20, 1), "compressed": compressedBytes()} {
		stored := size(data)
		chunks := (len(data) + 1<<20 - 1) >> 20
		if stored != len(data)+chunks*headerLen {
			t.Errorf("%s: %d bytes stored for %d in %d chunks, want the data and a %d-byte header per chunk", name, stored, len(data), chunks, headerLen)
		}
	}
}

func TestPlanChunk(t *testing.T) {
	for _, f := range trainingFiles {
		data := readTestdata(t, f.name)
		p := planChunk(data, 0)
		// The mantissa planes stay raw, the planes holding sign and exponent are coded.
		want := plan{width: f.width, code: [4]bool{false, true}}
		if f.width == 4 {
			want.code = [4]bool{false, false, false, true}
		}
		if p != want {
			t.Errorf("%s: plan %+v, want %+v", f.name, p, want)
		}
	}
	text := bytes.Repeat([]byte("the quick brown fox jumps over the lazy dog; "), 1000)
	for name, c := range map[string]struct {
		data  []byte
		width int
	}{
		"random":         {randomBytes(4<<20, 2), 0},
		"compressed":     {compressedBytes(), 0},
		"zeros":          {make([]byte, 1<<20), 1},
		"text":           {text, 1},
		"short bf16":     {readTestdata(t, "weights_bf16.bin")[:minTryLen-2], 0},
		"4 KiB of bf16":  {readTestdata(t, "weights_bf16.bin")[:minTryLen], 2},
		"4 KiB + 3 fp32": {readTestdata(t, "weights_fp32.bin")[:minTryLen+3], 4},
	} {
		if p := planChunk(c.data, 0); p.width != c.width {
			t.Errorf("%s: width %d, want %d", name, p.width, c.width)
		}
	}
}

// TestRoundTripEdges covers lengths around every boundary: empty, shorter than the sample
// threshold, tails of 1 to 3 bytes after the last element, one byte past a block, planes that
// are all one byte (RLE blocks) and data that only some blocks can compress.
func TestRoundTripEdges(t *testing.T) {
	e, d := new(Encoder), NewDecoder(MaxLen)
	bf16 := readTestdata(t, "weights_bf16.bin")
	fp32 := readTestdata(t, "weights_fp32.bin")
	lengths := []int{0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 100, 1023, minTryLen - 1, minTryLen, minTryLen + 1,
		minTryLen + 2, minTryLen + 3, 5001, 1 << 15, 1<<15 + 1, 1<<16 + 3, 2<<16 + 5, 3<<16 + 7, 1<<17 + 1, 1<<18 + 2, 1<<20 + 3}
	mixed := append(append(append([]byte(nil), bf16[:200<<10]...), randomBytes(200<<10, 3)...), make([]byte, 100<<10)...)
	for name, data := range map[string][]byte{
		"bf16": bf16, "fp32": fp32, "random": randomBytes(2<<20, 4), "zeros": make([]byte, 2<<20),
		"ones": bytes.Repeat([]byte{0xff}, 2<<20), "bf16 random zeros": mixed,
		"fp32 exponent only": bytes.Repeat([]byte{0x12, 0x34, 0x56, 0x3c}, 1<<19),
	} {
		for _, n := range lengths {
			if n > len(data) {
				continue
			}
			t.Run(fmt.Sprintf("%s/%d", name, n), func(t *testing.T) {
				roundTrip(t, e, d, data[:n])
				roundTrip(t, e, d, data[len(data)-n:])
			})
		}
	}
}

func TestRoundTripRandomLengths(t *testing.T) {
	e, d := new(Encoder), NewDecoder(MaxLen)
	fp32 := readTestdata(t, "adam_v_fp32.bin")
	r := rand.New(rand.NewPCG(5, 6))
	for range 200 {
		n := r.IntN(300 << 10)
		off := r.IntN(len(fp32) - n)
		src := fp32[off : off+n]
		roundTrip(t, e, d, src)
	}
}

// TestDecodeRejectsDamage damages a valid chunk of every method every way storage or transit
// can: flipped bits anywhere, truncation, bytes appended. The CRC32C catches all of them.
func TestDecodeRejectsDamage(t *testing.T) {
	e, d := new(Encoder), NewDecoder(MaxLen)
	for name, src := range map[string][]byte{
		"bf16 planes": readTestdata(t, "weights_bf16.bin")[:12000],
		"fp32 planes": readTestdata(t, "adam_v_fp32.bin")[:12003],
		"raw":         randomBytes(12000, 8),
	} {
		chunk, _ := e.Encode(nil, src)
		damaged := make([]byte, len(chunk)+1)
		for i := range len(chunk) {
			for _, bit := range []byte{1, 0x80} {
				copy(damaged, chunk)
				damaged[i] ^= bit
				if _, err := d.Decode(nil, damaged[:len(chunk)]); !errors.Is(err, ErrCorrupt) {
					t.Fatalf("%s: bit %#x of byte %d flipped: error %v, want ErrCorrupt", name, bit, i, err)
				}
			}
		}
		for n := range len(chunk) {
			if _, err := d.Decode(nil, chunk[:n]); !errors.Is(err, ErrCorrupt) {
				t.Fatalf("%s: truncated to %d of %d bytes: error %v, want ErrCorrupt", name, n, len(chunk), err)
			}
		}
		if _, err := d.Decode(nil, append(chunk, 0)); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("%s: a byte appended: error %v, want ErrCorrupt", name, err)
		}
	}
}

// withCRC recomputes a chunk's CRC, so that decoding gets past it to the structure.
func withCRC(chunk []byte) []byte {
	if len(chunk) >= headerLen {
		binary.LittleEndian.PutUint32(chunk[16:], chunkCRC(chunk))
	}
	return chunk
}

// TestDecodeRejectsBadStructure feeds chunks that carry a valid CRC but contradict themselves,
// as a buggy or hostile writer could produce.
func TestDecodeRejectsBadStructure(t *testing.T) {
	e := new(Encoder)
	src := readTestdata(t, "weights_bf16.bin")[:100001] // width 2, a tail byte, 2 blocks per plane
	valid, _ := e.Encode(nil, src)
	if h, _ := ParseHeader(valid); h.Method != Planes || h.Width != 2 {
		t.Fatalf("setup: %+v, want planes of width 2", h)
	}
	const table = headerLen              // the plane entries
	const plane1 = table + planeEntryLen // plane 1's entry
	plane0Len := int(binary.LittleEndian.Uint32(valid[table+1:]))
	firstBlock := table + 2*planeEntryLen + 1 + plane0Len // plane 1's first block header
	for _, c := range []struct {
		name   string
		damage func(c []byte) []byte
	}{
		{"magic", func(c []byte) []byte { c[0] = 'X'; return c }},
		{"version", func(c []byte) []byte { c[4] = 2; return c }},
		{"method", func(c []byte) []byte { c[5] = 7; return c }},
		{"width 3", func(c []byte) []byte { c[6] = 3; return c }},
		{"width 8", func(c []byte) []byte { c[6] = 8; return c }},
		{"block log 11", func(c []byte) []byte { c[7] = 11; return c }},
		{"block log 18", func(c []byte) []byte { c[7] = 18; return c }},
		{"block log 16", func(c []byte) []byte { c[7] = 16; return c }},
		{"length above MaxLen", func(c []byte) []byte { binary.LittleEndian.PutUint32(c[8:], MaxLen+1); return c }},
		{"length one more", func(c []byte) []byte { binary.LittleEndian.PutUint32(c[8:], uint32(len(src)+1)); return c }},
		{"length one less", func(c []byte) []byte { binary.LittleEndian.PutUint32(c[8:], uint32(len(src)-1)); return c }},
		{"length doubled", func(c []byte) []byte { binary.LittleEndian.PutUint32(c[8:], uint32(2*len(src))); return c }},
		{"payload length", func(c []byte) []byte { binary.LittleEndian.PutUint32(c[12:], uint32(len(c))); return c }},
		{"truncated", func(c []byte) []byte { return c[:len(c)-1] }},
		{"trailing byte", func(c []byte) []byte {
			c = append(c, 0)
			binary.LittleEndian.PutUint32(c[12:], uint32(len(c)-headerLen))
			return c
		}},
		{"plane coding", func(c []byte) []byte { c[table] = 9; return c }},
		{"raw plane length", func(c []byte) []byte { binary.LittleEndian.PutUint32(c[table+1:], uint32(plane0Len-1)); return c }},
		{"coded plane length", func(c []byte) []byte {
			binary.LittleEndian.PutUint32(c[plane1+1:], binary.LittleEndian.Uint32(c[plane1+1:])+1)
			return c
		}},
		{"coded plane huge", func(c []byte) []byte { binary.LittleEndian.PutUint32(c[plane1+1:], 1<<31); return c }},
		{"raw plane marked coded", func(c []byte) []byte { c[table] = planeCoded; return c }},
		{"coded plane marked raw", func(c []byte) []byte { c[plane1] = planeRaw; return c }},
		{"block kind", func(c []byte) []byte { c[firstBlock] = 3; return c }},
		{"huff0 block marked raw", func(c []byte) []byte { c[firstBlock] = blockRaw; return c }},
		{"huff0 block marked RLE", func(c []byte) []byte { c[firstBlock] = blockRLE; return c }},
		{"block length", func(c []byte) []byte { c[firstBlock+1]++; return c }},
		{"block length short", func(c []byte) []byte { c[firstBlock+1]--; return c }},
		{"huff0 table", func(c []byte) []byte { c[firstBlock+blockHeaderLen] ^= 0xff; return c }},
		{"huff0 jump table", func(c []byte) []byte { c[firstBlock+blockHeaderLen+20] ^= 0xff; return c }},
	} {
		t.Run(c.name, func(t *testing.T) {
			bad := withCRC(c.damage(append([]byte(nil), valid...)))
			out, err := NewDecoder(MaxLen).Decode(nil, bad)
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("error %v (%d bytes out), want ErrCorrupt", err, len(out))
			}
		})
	}
}

func TestDecoderLimit(t *testing.T) {
	src := readTestdata(t, "weights_bf16.bin")[:1<<16]
	chunk, _ := new(Encoder).Encode(nil, src)
	if _, err := NewDecoder(1<<16-1).Decode(nil, chunk); err == nil {
		t.Fatalf("a chunk of %d bytes decoded under a limit of %d", len(src), 1<<16-1)
	}
	if _, err := NewDecoder(1<<16).Decode(nil, chunk); err != nil {
		t.Fatalf("a chunk of %d bytes under a limit of %d: %v", len(src), 1<<16, err)
	}
}

func TestNoAllocations(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates")
	}
	e, d := new(Encoder), NewDecoder(MaxLen)
	for name, src := range map[string][]byte{
		"bf16":   readTestdata(t, "weights_bf16.bin"),
		"fp32":   readTestdata(t, "adam_v_fp32.bin")[:1<<20+3],
		"random": randomBytes(1<<20, 9),
		"zeros":  make([]byte, 1<<20),
	} {
		chunk := make([]byte, 0, MaxEncodedLen(len(src)))
		out := make([]byte, 0, len(src))
		var err error
		chunk, _ = e.Encode(chunk, src) // grow the scratch
		if allocs := testing.AllocsPerRun(10, func() { chunk, _ = e.Encode(chunk[:0], src) }); allocs != 0 {
			t.Errorf("%s: %.1f allocations per Encode, want 0", name, allocs)
		}
		if allocs := testing.AllocsPerRun(10, func() { out, err = d.Decode(out[:0], chunk) }); allocs != 0 || err != nil {
			t.Errorf("%s: %.1f allocations per Decode (error %v), want 0", name, allocs, err)
		}
		if !bytes.Equal(out, src) {
			t.Errorf("%s: decoded bytes differ", name)
		}
	}
}

func TestEncodeRefusesHugeChunk(t *testing.T) {
	// No MaxLen+1 bytes are allocated: the encoder looks at the length only.
	huge := make([]byte, 0, MaxLen+1)
	if _, err := new(Encoder).Encode(nil, huge[:MaxLen+1]); err == nil {
		t.Fatal("a chunk above MaxLen was encoded")
	}
}

// TestEncoderSettings: a forced width is used where coding pays and ignored where it does not;
// every block length round-trips; settings out of range are refused.
func TestEncoderSettings(t *testing.T) {
	d := NewDecoder(MaxLen)
	bf16 := readTestdata(t, "adam_m_bf16.bin")
	for _, c := range []struct {
		name      string
		src       []byte
		width     int
		wantWidth int
		method    Method
	}{
		{"bf16 as width 4", bf16, 4, 4, Planes},
		{"bf16 as width 1", bf16, 1, 1, Planes},
		{"fp32 as width 2", readTestdata(t, "adam_m_fp32.bin"), 2, 2, Planes},
		{"random as width 2", randomBytes(1<<20, 11), 2, 1, Raw},
	} {
		e := new(Encoder)
		e.Width = c.width
		chunk := roundTrip(t, e, d, c.src)
		if h, _ := ParseHeader(chunk); h.Method != c.method || h.Width != c.wantWidth {
			t.Errorf("%s: %s width %d, want %s width %d", c.name, h.Method, h.Width, c.method, c.wantWidth)
		}
	}
	for log := MinBlockLog; log <= MaxBlockLog; log++ {
		e := new(Encoder)
		e.BlockLog = log
		chunk := roundTrip(t, e, d, bf16)
		if h, _ := ParseHeader(chunk); h.BlockLog != log {
			t.Errorf("block log %d: header says %d", log, h.BlockLog)
		}
	}
	for _, bad := range []struct{ width, blockLog int }{{3, 0}, {8, 0}, {0, MinBlockLog - 1}, {0, MaxBlockLog + 1}} {
		e := &Encoder{Width: bad.width, BlockLog: bad.blockLog}
		if _, err := e.Encode(nil, bf16); err == nil {
			t.Errorf("width %d, block log %d: encoded, want an error", bad.width, bad.blockLog)
		}
	}
}
