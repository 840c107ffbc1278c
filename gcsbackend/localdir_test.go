package gcsbackend

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestOpenURL(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "plain-file")
	require.NoError(t, os.WriteFile(file, nil, 0o600))

	for _, tc := range []struct {
		url     string
		want    string // the store's String(); "" when an error is expected
		wantErr string // substring of the error
	}{
		{url: "file://" + dir, want: "file://" + dir},
		{url: "file://" + dir + "/sub/../x/", want: "file://" + dir + "/x"},
		{url: "file://localhost" + dir, want: "file://" + dir},
		{url: "file:///with%20space", want: "file:///with%20space"},
		{url: "file://relative/dir", wantErr: "absolute path"},
		{url: "file:relative", wantErr: "absolute path"},
		{url: "file://" + file, wantErr: "not a directory"},
		{url: "gs://bucket/prefix", want: "gs://bucket/prefix"},
		{url: "gs://bucket", want: "gs://bucket"},
		{url: "gs://bucket/", want: "gs://bucket"},
		{url: "gs://my-bucket/a/b/", want: "gs://my-bucket/a/b"},
		{url: "gs://Bucket/x", wantErr: "bucket name"},
		{url: "gs://bucket/a/../b", wantErr: "prefix"},
		{url: "gs://bucket/a//b", wantErr: "prefix"},
		{url: "gs://bucket:80/x", wantErr: "without user or port"},
		{url: "gs:///prefix", wantErr: "missing bucket"},
		{url: "s3://bucket", wantErr: "gs://bucket[/prefix] or file:///absolute/dir"},
		{url: "/abs/dir", wantErr: "gs://bucket[/prefix] or file:///absolute/dir"},
		{url: "", wantErr: "gs://bucket[/prefix] or file:///absolute/dir"},
		{url: "file:///x?y=1", wantErr: "query"},
	} {
		s, err := Open(tc.url)
		if tc.wantErr != "" {
			if assert.Error(t, err, "Open(%q)", tc.url) {
				assert.Contains(t, err.Error(), tc.wantErr, "Open(%q)", tc.url)
			}
			continue
		}
		if assert.NoError(t, err, "Open(%q)", tc.url) {
			assert.Equal(t, tc.want, s.String(), "Open(%q).String()", tc.url)
			again, err := Open(s.String())
			require.NoError(t, err, "String() must be accepted by Open")
			assert.Equal(t, s.String(), again.String())
		}
	}
}

func TestDefaultURL(t *testing.T) {
	t.Setenv("XDG_DATA_HOME", "/xdg/data")
	assert.Equal(t, "file:///xdg/data/mtcfs/backups", DefaultURL())

	t.Setenv("XDG_DATA_HOME", "relative/is/ignored")
	t.Setenv("HOME", "/home/user")
	assert.Equal(t, "file:///home/user/.local/share/mtcfs/backups", DefaultURL())

	t.Setenv("XDG_DATA_HOME", "")
	assert.Equal(t, "file:///home/user/.local/share/mtcfs/backups", DefaultURL())

	// The default works with nothing prepared: the directory appears on
	// the first write.
	t.Setenv("HOME", t.TempDir())
	s, err := Open(DefaultURL())
	require.NoError(t, err)
	put(t, s, "job/restore.version", "x")
	fi, err := os.Stat(filepath.Join(os.Getenv("HOME"), ".local/share/mtcfs/backups/job/restore.version"))
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(filePerm), fi.Mode().Perm(), "objects are private to the user")
}

func TestLocalDirLeavesNoTemporaryFiles(t *testing.T) {
	s := newTestLocalDir(t).(*localDir)
	ctx := context.Background()
	wrong := uint32(1)
	_ = s.Put(ctx, PutRequest{Name: "a/x", Body: strings.NewReader("abc"), Size: 3, CRC32C: &wrong})
	_ = s.Put(ctx, PutRequest{Name: "a/y", Body: strings.NewReader("abc"), Size: 4})
	put(t, s, "a/z", "z")
	require.NoError(t, PutBytes(ctx, s, "a/z", []byte("z"), true)) // safe retry: the link's temp name goes
	require.Error(t, PutBytes(ctx, s, "a/z", []byte("zz"), true))  // conflict: likewise
	entries, err := os.ReadDir(filepath.Join(s.root, "a"))
	require.NoError(t, err)
	var got []string
	for _, e := range entries {
		got = append(got, e.Name())
	}
	assert.Equal(t, []string{"z"}, got, "failed and conditional Puts must remove their temporary files")
}

func TestLocalDirHidesTemporaryFiles(t *testing.T) {
	s := newTestLocalDir(t).(*localDir)
	// What a crash in the middle of a Put leaves behind.
	require.NoError(t, os.MkdirAll(filepath.Join(s.root, "job/only-temp"), 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(s.root, "job/only-temp", tempPrefix+"0011223344556677"), []byte("partial"), 0o600))
	require.NoError(t, os.WriteFile(filepath.Join(s.root, "job", tempPrefix+"8899aabbccddeeff"), []byte("partial"), 0o600))
	put(t, s, "job/real", "r")

	objs, prefixes, err := s.List(context.Background(), "job/", "/")
	require.NoError(t, err)
	assert.Equal(t, []string{"job/real"}, names(objs))
	assert.Empty(t, prefixes, "a directory holding only temporary files is not a prefix")
	assert.Equal(t, []string{"job/real"}, listAll(t, s))
}

func TestLocalDirCRC(t *testing.T) {
	ctx := context.Background()
	s := newTestLocalDir(t).(*localDir)
	put(t, s, "obj", "original")
	p := s.path("obj")

	var buf [64]byte
	n, err := syscall.Getxattr(p, crcXattr, buf[:])
	if errors.Is(err, syscall.ENOTSUP) {
		t.Skip("filesystem of t.TempDir has no user xattrs; the conformance suite covers that case")
	}
	require.NoError(t, err, "Put must record the CRC32C in %s", crcXattr)
	fi, err := os.Stat(p)
	require.NoError(t, err)
	assert.Equal(t, crcRecord(crcOf([]byte("original")), fi), string(buf[:n]))

	// A foreign tool rewrites the file in place: the record no longer
	// matches size and mtime, so Stat recomputes and re-records.
	require.NoError(t, os.WriteFile(p, []byte("rewritten"), 0o600))
	require.NoError(t, os.Chtimes(p, time.Now(), fi.ModTime().Add(time.Second)))
	a, err := s.Stat(ctx, "obj")
	require.NoError(t, err)
	assert.Equal(t, crcOf([]byte("rewritten")), a.CRC32C, "a stale record must not be trusted")
	fi, err = os.Stat(p)
	require.NoError(t, err)
	n, err = syscall.Getxattr(p, crcXattr, buf[:])
	require.NoError(t, err)
	assert.Equal(t, crcRecord(a.CRC32C, fi), string(buf[:n]), "the recomputed CRC32C is cached")

	// A file copied in without any record.
	require.NoError(t, os.WriteFile(filepath.Join(s.root, "foreign"), []byte("copied in"), 0o600))
	a, err = s.Stat(ctx, "foreign")
	require.NoError(t, err)
	assert.Equal(t, crcOf([]byte("copied in")), a.CRC32C)
}

func TestLocalDirPermissions(t *testing.T) {
	s := newTestLocalDir(t).(*localDir)
	put(t, s, "job/sub/obj", "secret")
	for p, want := range map[string]os.FileMode{"job": dirPerm, "job/sub": dirPerm, "job/sub/obj": filePerm} {
		fi, err := os.Stat(s.path(p))
		require.NoError(t, err)
		assert.Equal(t, want, fi.Mode().Perm(), "mode of %s", p)
	}
}

func TestLocalDirDeletePrunesEmptyDirectories(t *testing.T) {
	s := newTestLocalDir(t).(*localDir)
	ctx := context.Background()
	put(t, s, "a/b/c/obj", "x")
	put(t, s, "a/keep", "k")
	require.NoError(t, s.Delete(ctx, "a/b/c/obj"))
	_, err := os.Stat(s.path("a/b"))
	assert.True(t, errors.Is(err, os.ErrNotExist), "emptied directories are removed, got %v", err)
	_, err = os.Stat(s.path("a/keep"))
	assert.NoError(t, err)
	require.NoError(t, s.Delete(ctx, "a/keep"))
	_, err = os.Stat(s.root)
	assert.NoError(t, err, "the root itself stays")
}
