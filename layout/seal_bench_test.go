package layout

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// BenchmarkHashDirCached is the seal's hash of a step of 100,000 small files in 100 directories
// whose digests the cache holds (the job's closes hashed them): a listing with one stat per
// file, the cache's lookups and the tree hash. Stages are reported as ms/op metrics.
func BenchmarkHashDirCached(b *testing.B) {
	if testing.Short() {
		b.Skip("writes 100,000 files")
	}
	root := benchTmpfs(b, "mtcfs-hashdircached-bench-*")
	const dirs, perDir = 100, 1000
	data := randomBytes(5, 4096)
	for i := range dirs {
		sub := filepath.Join(root, fmt.Sprintf("d%03d", i))
		if err := os.Mkdir(sub, 0o755); err != nil {
			b.Fatal(err)
		}
		for j := range perDir {
			if err := os.WriteFile(filepath.Join(sub, fmt.Sprintf("f%04d", j)), data, 0o644); err != nil {
				b.Fatal(err)
			}
		}
	}
	cache := &DigestCache{}
	want, err := hashDirCached(b.Context(), root, cache) // fills the cache
	if err != nil {
		b.Fatal(err)
	}
	var list, lookup, tree time.Duration
	for b.Loop() {
		t0 := time.Now()
		d, err := OpenDir(root)
		if err != nil {
			b.Fatal(err)
		}
		entries, keys, err := d.listKeyed()
		if err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		if err := d.hashEntries(b.Context(), entries, keys, cache, false); err != nil {
			b.Fatal(err)
		}
		t2 := time.Now()
		got, err := TreeHash(entries)
		if err != nil {
			b.Fatal(err)
		}
		t3 := time.Now()
		d.Close()
		if got != want {
			b.Fatalf("hash %s, want %s", got, want)
		}
		list, lookup, tree = list+t1.Sub(t0), lookup+t2.Sub(t1), tree+t3.Sub(t2)
	}
	n := float64(b.N) * float64(time.Millisecond)
	b.ReportMetric(float64(list)/n, "list-ms/op")
	b.ReportMetric(float64(lookup)/n, "lookup-ms/op")
	b.ReportMetric(float64(tree)/n, "treehash-ms/op")
}
