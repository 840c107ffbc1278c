package layout

import (
	"bytes"
	"context"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"lukechampine.com/blake3"
)

// TestArrivalHashIsBLAKE3WithConcurrentAdds: whatever ranges the bytes arrive in, in whatever order, cut into
// whatever pieces, with some ranges never added (Finish reads them back), the digest is the
// file's plain BLAKE3.
func TestArrivalHashIsBLAKE3WithConcurrentAdds(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 12))
	sizes := []int64{0, 1, 1023, 1024, 1025, 2048, 16<<10 - 1, 16 << 10, 16<<10 + 1, 16<<10 + 1024, 16<<10 + 1025,
		48 << 10, 64<<10 - 1, 64 << 10, 64<<10 + 1, 128 << 10, 3<<20 + 12345, 4 << 20, 9<<20 + 1}
	for range 20 {
		sizes = append(sizes, rng.Int64N(6<<20))
	}
	for _, size := range sizes {
		data := make([]byte, size)
		for i := range data {
			data[i] = byte(rng.Uint32())
		}
		want := FileDigest(blake3.Sum256(data))
		for trial := range 4 {
			h := NewArrivalHash(size)
			// Cut the file into ranges: aligned chunks of a push (trial 0), or random ones.
			var cuts []int64
			for off := int64(0); off < size; {
				n := int64(4 << 20)
				if trial > 0 {
					n = 1 + rng.Int64N(300<<10)
				}
				n = min(n, size-off)
				cuts = append(cuts, off)
				off += n
			}
			cuts = append(cuts, size)
			order := rng.Perm(len(cuts) - 1)
			var wg sync.WaitGroup
			for _, k := range order {
				lo, hi := cuts[k], cuts[k+1]
				if trial == 3 && k%3 == 1 {
					continue // never arrives through Add: written some other way
				}
				// The range's bytes as several buffers, like gRPC's.
				var pieces [][]byte
				for p := lo; p < hi; {
					n := min(hi-p, 1+rng.Int64N(100<<10))
					if trial == 0 {
						n = hi - p
					}
					pieces = append(pieces, data[p:p+n])
					p += n
				}
				wg.Go(func() { h.Add(pieces, lo) })
			}
			wg.Wait()
			got, err := h.Finish(context.Background(), bytes.NewReader(data))
			require.NoError(t, err)
			require.Equal(t, want, got, "%d bytes, trial %d", size, trial)
			if trial == 0 && size > 0 {
				require.Zero(t, h.missing(), "%d bytes in aligned 4 MiB ranges: nothing to read back", size)
			}
		}
	}
}

// TestArrivalHashReadsBackOnlyWhatItMissed: a range that splits a segment leaves that segment to
// Finish, and only that one; a short file fails Finish.
func TestArrivalHashReadsBackOnlyWhatItMissed(t *testing.T) {
	size := int64(1 << 20)
	data := bytes.Repeat([]byte("0123456789abcdef"), int(size/16))
	h := NewArrivalHash(size)
	h.Add([][]byte{data[:100_000]}, 0)
	h.Add([][]byte{data[100_000:]}, 100_000)
	require.Equal(t, int64(arrivalSegment), h.missing(), "only the segment split at 100,000 is missing")
	got, err := h.Finish(context.Background(), bytes.NewReader(data))
	require.NoError(t, err)
	require.Equal(t, FileDigest(blake3.Sum256(data)), got)

	h = NewArrivalHash(size)
	h.Add([][]byte{data[:500_000]}, 0)
	_, err = h.Finish(context.Background(), bytes.NewReader(data[:600_000]))
	require.ErrorContains(t, err, "read")
}

func BenchmarkArrivalHash(b *testing.B) {
	data := make([]byte, 4<<20)
	for i := range data {
		data[i] = byte(i * 7)
	}
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		h := NewArrivalHash(int64(len(data)))
		h.Add([][]byte{data}, 0)
		if _, err := h.Finish(context.Background(), bytes.NewReader(nil)); err != nil {
			b.Fatal(err)
		}
	}
}

// TestArrivalHashMemoryFollowsWhatArrived: the hash holds what arrived, merged into aligned
// blocks, not a slot for every segment the sender declared. A peer that declares a file of 1 PiB
// and sends one 4 MiB chunk costs one chaining value (at first the hash allocated 512 GiB at the
// first chunk, and the agent died); a run of chunks, in order or from the middle of the file,
// costs at most two per level of the tree.
func TestArrivalHashMemoryFollowsWhatArrived(t *testing.T) {
	blocks := func(h *ArrivalHash) int {
		h.mu.Lock()
		defer h.mu.Unlock()
		return len(h.blocks)
	}
	chunk := make([]byte, 4<<20)
	h := NewArrivalHash(1 << 50)
	h.Add([][]byte{chunk}, 1<<40)
	require.Equal(t, 1, blocks(h), "64 aligned segments are one block")

	// 1 GiB in order, and 1 GiB from an offset that is not a power of two (a stream's share).
	for _, start := range []int64{0, 3 << 30} {
		h = NewArrivalHash(8 << 30)
		for off := start; off < start+1<<30; off += 4 << 20 {
			h.Add([][]byte{chunk}, off)
			require.LessOrEqual(t, blocks(h), 2*18, "from %d, at %d", start, off)
		}
	}
	// Out of order: two runs, merged once the gap closes.
	h = NewArrivalHash(12<<20 + 1)
	h.Add([][]byte{chunk}, 4<<20)
	h.Add([][]byte{chunk}, 0)
	require.Equal(t, 1, blocks(h), "segments 0-127 are one block")
}
