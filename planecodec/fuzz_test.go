package planecodec

import (
	"bytes"
	"errors"
	"testing"
)

// fuzzMaxLen bounds what a fuzzed header can make the decoder allocate.
const fuzzMaxLen = 8 << 20

// addEncodedSeeds gives a fuzz target valid chunks of every method, width and block kind.
func addEncodedSeeds(f *testing.F) {
	e := new(Encoder)
	e.BlockLog = MinBlockLog // several blocks per plane in a small chunk
	bf16 := readTestdata(f, "weights_bf16.bin")
	fp32 := readTestdata(f, "adam_v_fp32.bin")
	for _, src := range [][]byte{
		nil, {1}, randomBytes(100, 10), bf16[:5000], bf16[:9001], fp32[:6003], fp32[:20000],
		make([]byte, 5000), bytes.Repeat([]byte("abcdefgh"), 1000),
		append(append([]byte(nil), bf16[:4096]...), make([]byte, 4096)...),
	} {
		chunk, _ := e.Encode(nil, src)
		f.Add(chunk)
	}
}

// FuzzDecode decodes arbitrary input, once as it is and once with its CRC made to match, so that
// mutations reach the structure behind the CRC. Decoding must not panic, must fail with
// ErrCorrupt or a length above the limit, and must give exactly the declared length when it
// succeeds.
func FuzzDecode(f *testing.F) {
	addEncodedSeeds(f)
	d := NewDecoder(fuzzMaxLen)
	f.Fuzz(func(t *testing.T, chunk []byte) {
		for _, in := range [][]byte{chunk, withCRC(append([]byte(nil), chunk...))} {
			out, err := d.Decode(nil, in)
			if err != nil {
				if h, herr := ParseHeader(in); !errors.Is(err, ErrCorrupt) && (herr != nil || h.Len <= fuzzMaxLen) {
					t.Fatalf("error %v does not wrap ErrCorrupt", err)
				}
				continue
			}
			if h, _ := ParseHeader(in); len(out) != h.Len {
				t.Fatalf("decoded %d bytes, header says %d", len(out), h.Len)
			}
		}
	})
}

// FuzzRoundTrip encodes arbitrary input and decodes it back.
func FuzzRoundTrip(f *testing.F) {
	bf16 := readTestdata(f, "weights_bf16.bin")
	f.Add(bf16[:5000])
	f.Add(readTestdata(f, "adam_m_fp32.bin")[:8003])
	f.Add(make([]byte, 4097))
	e, d := new(Encoder), NewDecoder(MaxLen)
	f.Fuzz(func(t *testing.T, src []byte) {
		chunk, err := e.Encode(nil, src)
		if err != nil {
			t.Fatal(err)
		}
		if len(chunk) > MaxEncodedLen(len(src)) {
			t.Fatalf("%d bytes encoded to %d, above MaxEncodedLen", len(src), len(chunk))
		}
		out, err := d.Decode(nil, chunk)
		if err != nil {
			t.Fatalf("decode: %v", err)
		}
		if !bytes.Equal(out, src) {
			t.Fatal("decoded bytes differ from the input")
		}
	})
}
