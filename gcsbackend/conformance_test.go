package gcsbackend

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestStoreConformance runs the one ObjectStore suite against every
// implementation. A new backend adds one line here.
func TestStoreConformance(t *testing.T) {
	t.Run("file", func(t *testing.T) { runStoreConformance(t, newTestLocalDir) })
	t.Run("file-without-xattrs", func(t *testing.T) {
		runStoreConformance(t, func(t *testing.T) ObjectStore {
			s := newTestLocalDir(t).(*localDir)
			s.noXattr = true
			return s
		})
	})
	t.Run("gcs-fake", func(t *testing.T) { runStoreConformance(t, newTestFakeGCS) })
	t.Run("gcs-real", func(t *testing.T) {
		skipWithoutRealGCS(t)
		runStoreConformance(t, newTestRealGCS)
	})
}

func newTestLocalDir(t *testing.T) ObjectStore {
	t.Helper()
	s, err := Open(fileURL(t.TempDir()))
	require.NoError(t, err)
	return s
}

func crcOf(b []byte) uint32 { return crc32.Checksum(b, crcTable) }

func put(t *testing.T, s ObjectStore, name, content string) {
	t.Helper()
	require.NoError(t, PutBytes(context.Background(), s, name, []byte(content), false), "put %s", name)
}

func readRange(t *testing.T, s ObjectStore, name string, off, length int64) string {
	t.Helper()
	r, err := s.Open(context.Background(), name, off, length)
	require.NoError(t, err, "open %s [%d,+%d)", name, off, length)
	defer r.Close()
	b, err := io.ReadAll(r)
	require.NoError(t, err)
	return string(b)
}

func names(objs []ObjectAttrs) []string {
	out := []string{}
	for _, o := range objs {
		out = append(out, o.Name)
	}
	return out
}

// listAll returns every object name and checks the listing reports nothing
// else (no prefixes without a delimiter).
func listAll(t *testing.T, s ObjectStore) []string {
	t.Helper()
	objs, prefixes, err := s.List(context.Background(), "", "")
	require.NoError(t, err)
	require.Empty(t, prefixes)
	return names(objs)
}

// runStoreConformance is the behaviour every ObjectStore must show; newStore
// returns an empty store that lives as long as t.
func runStoreConformance(t *testing.T, newStore func(t *testing.T) ObjectStore) {
	ctx := context.Background()

	t.Run("PutStatOpen", func(t *testing.T) {
		s := newStore(t)
		data := []byte("hello, checkpoint")
		require.NoError(t, PutBytes(ctx, s, "job/a/b.txt", data, false))
		a, err := s.Stat(ctx, "job/a/b.txt")
		require.NoError(t, err)
		assert.Equal(t, "job/a/b.txt", a.Name)
		assert.Equal(t, int64(len(data)), a.Size)
		assert.Equal(t, crcOf(data), a.CRC32C, "Stat must report the CRC32C of the content")
		assert.False(t, a.Updated.IsZero(), "Updated must be set")
		assert.NotZero(t, a.Generation, "Generation must be set")
		assert.Equal(t, string(data), readRange(t, s, "job/a/b.txt", 0, -1))
	})

	t.Run("EmptyObject", func(t *testing.T) {
		s := newStore(t)
		put(t, s, "empty", "")
		a, err := s.Stat(ctx, "empty")
		require.NoError(t, err)
		assert.Zero(t, a.Size)
		assert.Equal(t, crcOf(nil), a.CRC32C)
		assert.Equal(t, "", readRange(t, s, "empty", 0, -1))
	})

	t.Run("Overwrite", func(t *testing.T) {
		s := newStore(t)
		put(t, s, "x", "first")
		put(t, s, "x", "second, longer")
		a, err := s.Stat(ctx, "x")
		require.NoError(t, err)
		assert.Equal(t, crcOf([]byte("second, longer")), a.CRC32C)
		assert.Equal(t, "second, longer", readRange(t, s, "x", 0, -1))
		assert.Equal(t, []string{"x"}, listAll(t, s), "replacing must leave no temporary object")
	})

	t.Run("RangedOpen", func(t *testing.T) {
		s := newStore(t)
		put(t, s, "r", "0123456789")
		for _, tc := range []struct {
			off, length int64
			want        string
		}{
			{0, -1, "0123456789"},
			{0, 0, ""},
			{3, 4, "3456"},
			{7, -1, "789"},
			{7, 100, "789"}, // past the end: cut short
			{10, -1, ""},    // at the end: empty
			{9, 1, "9"},
		} {
			assert.Equal(t, tc.want, readRange(t, s, "r", tc.off, tc.length), "range [%d,+%d)", tc.off, tc.length)
		}
		_, err := s.Open(ctx, "r", 11, -1)
		assert.Error(t, err, "an offset beyond the size must fail")
		assert.False(t, IsNotFound(err), "an offset beyond the size is not a missing object: %v", err)
		_, err = s.Open(ctx, "r", -1, -1)
		assert.Error(t, err, "a negative offset must fail")
	})

	t.Run("LargeStreamed", func(t *testing.T) {
		s := newStore(t)
		data := bytes.Repeat([]byte("0123456789abcdef"), 3<<16) // 3 MiB: several copy buffers
		require.NoError(t, PutBytes(ctx, s, "big", data, false))
		a, err := s.Stat(ctx, "big")
		require.NoError(t, err)
		assert.Equal(t, crcOf(data), a.CRC32C)
		got := readRange(t, s, "big", 1<<20+5, 1<<20)
		assert.True(t, got == string(data[1<<20+5:2<<20+5]), "ranged read across buffer boundaries differs")
	})

	t.Run("UnseekableBody", func(t *testing.T) {
		// A body that can be read only once, larger than a GCS upload chunk (onceChunkSize):
		// it is sent in several requests, and published only whole.
		s := newStore(t)
		data := randomBytes(2*onceChunkSize+12345, 3)
		crc := crcOf(data)
		for _, tc := range []struct {
			name string
			crc  *uint32
		}{{"without-crc", nil}, {"with-crc", &crc}} {
			err := s.Put(ctx, PutRequest{Name: "once/" + tc.name, Body: io.MultiReader(bytes.NewReader(data)), Size: int64(len(data)), CRC32C: tc.crc})
			require.NoError(t, err, tc.name)
			a, err := s.Stat(ctx, "once/"+tc.name)
			require.NoError(t, err)
			assert.Equal(t, crc, a.CRC32C, tc.name)
			assert.True(t, readRange(t, s, "once/"+tc.name, 0, -1) == string(data), "%s: content differs", tc.name)
		}
		wrong := crc ^ 1
		err := s.Put(ctx, PutRequest{Name: "once/wrong", Body: io.MultiReader(bytes.NewReader(data)), Size: int64(len(data)), CRC32C: &wrong})
		var ce *ChecksumError
		assert.True(t, errors.As(err, &ce), "want *ChecksumError, got %v", err)
		_, err = s.Stat(ctx, "once/wrong")
		assert.True(t, IsNotFound(err), "nothing may be visible after a CRC mismatch, got %v", err)
	})

	t.Run("List", func(t *testing.T) {
		s := newStore(t)
		for _, n := range []string{"j/2025-01-01_00-00/a.meta", "j/2025-01-01_00-00/D1.data/x/y", "j/2025-01-01_00-00/D1.data/z",
			"j/2025-01-02_00-00/b.meta", "j/restore.version", "j.x", "k/other"} {
			put(t, s, n, n)
		}
		objs, prefixes, err := s.List(ctx, "j/", "/")
		require.NoError(t, err)
		assert.Equal(t, []string{"j/restore.version"}, names(objs))
		assert.Equal(t, []string{"j/2025-01-01_00-00/", "j/2025-01-02_00-00/"}, prefixes)

		objs, prefixes, err = s.List(ctx, "j/2025-01-01_00-00/", "")
		require.NoError(t, err)
		assert.Empty(t, prefixes)
		assert.Equal(t, []string{"j/2025-01-01_00-00/D1.data/x/y", "j/2025-01-01_00-00/D1.data/z", "j/2025-01-01_00-00/a.meta"}, names(objs))
		for _, o := range objs {
			assert.Equal(t, crcOf([]byte(o.Name)), o.CRC32C, "List must report CRC32C of %s", o.Name)
			assert.Equal(t, int64(len(o.Name)), o.Size, "List must report size of %s", o.Name)
		}

		// A prefix is a string prefix, not a directory: "j" matches "j.x"
		// and "j/…", sorted by name ("j.x" < "j/").
		objs, prefixes, err = s.List(ctx, "j", "/")
		require.NoError(t, err)
		assert.Equal(t, []string{"j.x"}, names(objs))
		assert.Equal(t, []string{"j/"}, prefixes)
		objs, _, err = s.List(ctx, "j/2025-01-0", "")
		require.NoError(t, err)
		assert.Len(t, objs, 4)
		objs, prefixes, err = s.List(ctx, "j/2025-01-01_00-00/D1.data/", "/")
		require.NoError(t, err)
		assert.Equal(t, []string{"j/2025-01-01_00-00/D1.data/z"}, names(objs))
		assert.Equal(t, []string{"j/2025-01-01_00-00/D1.data/x/"}, prefixes)

		all := listAll(t, s)
		assert.Len(t, all, 7)
		assert.IsIncreasing(t, all, "recursive listing must be sorted by name")

		objs, prefixes, err = s.List(ctx, "nothing/", "/")
		require.NoError(t, err, "listing an absent prefix is not an error")
		assert.Empty(t, objs)
		assert.Empty(t, prefixes)
	})

	t.Run("Delete", func(t *testing.T) {
		s := newStore(t)
		put(t, s, "d/1/a", "a")
		put(t, s, "d/2/b", "b")
		require.NoError(t, s.Delete(ctx, "d/1/a"))
		_, err := s.Stat(ctx, "d/1/a")
		assert.True(t, IsNotFound(err), "deleted object: want NotFoundError, got %v", err)
		_, prefixes, err := s.List(ctx, "d/", "/")
		require.NoError(t, err)
		assert.Equal(t, []string{"d/2/"}, prefixes, "a prefix without objects must not be listed")
		put(t, s, "d/1/a", "again") // the emptied "directory" is usable again
		assert.Equal(t, "again", readRange(t, s, "d/1/a", 0, -1))
	})

	t.Run("NotFound", func(t *testing.T) {
		s := newStore(t)
		put(t, s, "present/x", "x")
		for _, name := range []string{"absent", "present/absent", "present/x/below", "present"} {
			_, err := s.Stat(ctx, name)
			assertNotFound(t, err, "Stat", name)
			_, err = s.Open(ctx, name, 0, -1)
			assertNotFound(t, err, "Open", name)
			assertNotFound(t, s.Delete(ctx, name), "Delete", name)
		}
	})

	t.Run("IfAbsent", func(t *testing.T) {
		s := newStore(t)
		require.NoError(t, PutBytes(ctx, s, "once", []byte("v1"), true), "create-if-absent of a new name")
		require.NoError(t, PutBytes(ctx, s, "once", []byte("v1"), true), "same bytes again must succeed (safe retry)")

		err := PutBytes(ctx, s, "once", []byte("v2"), true)
		var pe *PreconditionError
		require.True(t, errors.As(err, &pe), "different bytes: want *PreconditionError, got %v", err)
		assert.Equal(t, "once", pe.Name)
		err = PutBytes(ctx, s, "once", []byte("v1 "), true)
		assert.True(t, errors.As(err, &pe), "different size: want *PreconditionError, got %v", err)
		assert.Equal(t, "v1", readRange(t, s, "once", 0, -1), "a failed precondition must leave the object alone")
		assert.Equal(t, []string{"once"}, listAll(t, s))
	})

	t.Run("IfAbsentRace", func(t *testing.T) {
		s := newStore(t)
		const writers = 8
		var wg sync.WaitGroup
		errs := make([]error, writers)
		for i := range writers {
			wg.Go(func() { errs[i] = PutBytes(ctx, s, "race", []byte(fmt.Sprint("writer ", i)), true) })
		}
		wg.Wait()
		won := 0
		for _, err := range errs {
			var pe *PreconditionError
			if err == nil {
				won++
			} else {
				assert.True(t, errors.As(err, &pe), "losers must see *PreconditionError, got %v", err)
			}
		}
		assert.Equal(t, 1, won, "exactly one create-if-absent must win")
		assert.Equal(t, []string{"race"}, listAll(t, s))
	})

	t.Run("ChecksumMismatch", func(t *testing.T) {
		s := newStore(t)
		data := []byte("payload")
		wrong := crcOf(data) ^ 1
		for _, ifAbsent := range []bool{false, true} {
			err := s.Put(ctx, PutRequest{Name: "c/obj", Body: bytes.NewReader(data), Size: int64(len(data)), CRC32C: &wrong, IfAbsent: ifAbsent})
			var ce *ChecksumError
			require.True(t, errors.As(err, &ce), "want *ChecksumError, got %v", err)
			assert.Equal(t, wrong, ce.Want)
			assert.Equal(t, crcOf(data), ce.Got)
			_, err = s.Stat(ctx, "c/obj")
			assert.True(t, IsNotFound(err), "nothing may be visible after a CRC mismatch, got %v", err)
			assert.Empty(t, listAll(t, s), "nothing may be listed after a CRC mismatch")
		}
		// A mismatch must not damage an existing object either.
		put(t, s, "c/obj", "old")
		err := s.Put(ctx, PutRequest{Name: "c/obj", Body: bytes.NewReader(data), Size: int64(len(data)), CRC32C: &wrong})
		require.Error(t, err)
		assert.Equal(t, "old", readRange(t, s, "c/obj", 0, -1))
	})

	t.Run("SizeMismatch", func(t *testing.T) {
		s := newStore(t)
		for _, tc := range []struct {
			body string
			size int64
		}{{"short", 10}, {"longer than said", 4}} {
			err := s.Put(ctx, PutRequest{Name: "s", Body: strings.NewReader(tc.body), Size: tc.size})
			assert.Error(t, err, "body %q with size %d must fail", tc.body, tc.size)
			assert.Empty(t, listAll(t, s), "nothing may be visible after a size mismatch")
		}
	})

	t.Run("BodyError", func(t *testing.T) {
		s := newStore(t)
		boom := errors.New("source disk failed")
		body := io.MultiReader(strings.NewReader("partial"), &failingReader{boom})
		err := s.Put(ctx, PutRequest{Name: "b", Body: body, Size: 100})
		assert.ErrorIs(t, err, boom)
		assert.Empty(t, listAll(t, s), "a failed upload must leave nothing visible")
	})

	t.Run("Cancelled", func(t *testing.T) {
		s := newStore(t)
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		err := PutBytes(cctx, s, "never", []byte("x"), false)
		assert.ErrorIs(t, err, context.Canceled)
		assert.Empty(t, listAll(t, s))
	})

	t.Run("Names", func(t *testing.T) {
		s := newStore(t)
		for _, bad := range []string{"", "/abs", "a//b", "a/", "../x", "a/../b", "a/./b", ".", "..", "a\x00b",
			strings.Repeat("n", 1025), tempPrefix + "0123", "a/" + tempPrefix + "x/b"} {
			assert.Error(t, PutBytes(ctx, s, bad, []byte("x"), false), "Put of %q must be rejected", bad)
			_, err := s.Stat(ctx, bad)
			assert.Error(t, err, "Stat of %q must be rejected", bad)
			assert.False(t, IsNotFound(err), "an invalid name %q is not a missing object", bad)
			_, err = s.Open(ctx, bad, 0, -1)
			assert.Error(t, err, "Open of %q must be rejected", bad)
			assert.Error(t, s.Delete(ctx, bad), "Delete of %q must be rejected", bad)
		}
		for _, bad := range []string{"/", "/abs/", "../", "a//"} {
			_, _, err := s.List(ctx, bad, "")
			assert.Error(t, err, "List of prefix %q must be rejected", bad)
		}
		assert.Empty(t, listAll(t, s))
		for _, good := range []string{"a", "a b/c", ".hidden/.metadata", "x/__0_0.distcp", "ünï/cödé", "a..b"} {
			put(t, s, good, good)
			assert.Equal(t, good, readRange(t, s, good, 0, -1))
		}
	})
}

func assertNotFound(t *testing.T, err error, op, name string) {
	t.Helper()
	var nf *NotFoundError
	if assert.True(t, errors.As(err, &nf), "%s(%q): want *NotFoundError, got %v", op, name, err) {
		assert.Equal(t, name, nf.Name, "%s: NotFoundError.Name", op)
	}
}

type failingReader struct{ err error }

func (r *failingReader) Read([]byte) (int, error) { return 0, r.err }
