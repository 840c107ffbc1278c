package layout

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestDigestCache checks that a digest computed early is reused at seal time for the same
// file version, and that a later write (new mtime) is hashed again.
func TestDigestCache(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	p := filepath.Join(dir, "tree", "w")
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte("version one"), 0o644); err != nil {
		t.Fatal(err)
	}
	var c DigestCache
	if _, err := c.HashFileCached(ctx, p); err != nil {
		t.Fatal(err)
	}
	want, _ := HashDir(ctx, filepath.Join(dir, "tree"))

	// Same size, new bytes, old mtime restored: only a cache hit can still give the old hash,
	// which proves the early digest is what sealing uses (and shows why mtime is in the key).
	fi, _ := os.Stat(p)
	if err := os.WriteFile(p, []byte("version two"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Chtimes(p, fi.ModTime(), fi.ModTime()); err != nil {
		t.Fatal(err)
	}
	got, _, err := HashDataCached(ctx, filepath.Join(dir, "tree"), &c)
	if err != nil || got != want {
		t.Fatalf("cached hash = %s, %v; want the early digest's tree hash %s", got, err, want)
	}

	// A normal write moves mtime: the cache misses and the new content is hashed.
	if err := os.Chtimes(p, time.Now(), time.Now().Add(time.Second)); err != nil {
		t.Fatal(err)
	}
	fresh, _ := HashDir(ctx, filepath.Join(dir, "tree"))
	got, _, err = HashDataCached(ctx, filepath.Join(dir, "tree"), &c)
	if err != nil || got != fresh || got == want {
		t.Fatalf("after a write: cached hash = %s, %v; want the fresh %s (old %s)", got, err, fresh, want)
	}
}
