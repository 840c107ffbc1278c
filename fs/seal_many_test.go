package fs

import (
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mtcfs/mtcfs/layout"
)

// TestSealManyFiles: a directory with more files than sealParallelFrom is linked by several
// goroutines, relative to the spool's files directory; the record is the same tree, every file a
// hard link (no copy), and a file open for writing among them is still copied.
func TestSealManyFiles(t *testing.T) {
	dir, srv, _, spool := mountWithEvents(t, PassthroughAuto)
	p := func(n string) string { return filepath.Join(dir, n) }
	n := sealParallelFrom*2 + 7
	require.NoError(t, os.MkdirAll(p("9/big"), 0o755))
	require.NoError(t, os.MkdirAll(p("9/small/empty"), 0o755))
	for i := range n {
		require.NoError(t, os.WriteFile(p(fmt.Sprintf("9/big/f%04d", i)), []byte(fmt.Sprint(i)), 0o644))
	}
	require.NoError(t, os.WriteFile(p("9/small/x"), []byte("x"), 0o644))
	require.NoError(t, os.Symlink("../small/x", p("9/big/link")))
	w, err := os.OpenFile(p("9/big/open"), os.O_CREATE|os.O_WRONLY, 0o644)
	require.NoError(t, err)
	defer w.Close()
	_, err = w.WriteString("open")
	require.NoError(t, err)

	rec := filepath.Join(spool.Dir(), "rec")
	info, err := srv.Namespace().Seal("9", rec)
	require.NoError(t, err)
	require.Equal(t, 1, info.Copied, "the file open for writing is copied")

	want, err := layout.ListTree(p("9"))
	require.NoError(t, err)
	got, err := layout.ListTree(rec)
	require.NoError(t, err)
	require.ElementsMatch(t, want, got)
	for i := range n {
		name := fmt.Sprintf("big/f%04d", i)
		var st syscall.Stat_t
		require.NoError(t, syscall.Stat(filepath.Join(rec, name), &st))
		require.Equal(t, uint64(2), uint64(st.Nlink), "%s is linked, not copied", name)
		data, err := os.ReadFile(filepath.Join(rec, name))
		require.NoError(t, err)
		require.Equal(t, fmt.Sprint(i), string(data))
	}
	var st syscall.Stat_t
	require.NoError(t, syscall.Stat(filepath.Join(rec, "big/open"), &st))
	require.Equal(t, uint64(1), uint64(st.Nlink), "the open file is a copy")
}
