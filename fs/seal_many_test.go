package fs

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mtcfs/mtcfs/layout"
)

// TestSealManyFiles: a directory with more files than sealPart is linked in parts by several
// goroutines, relative to the spool's files directory; the record is the same tree, every file a
// hard link (no copy), and a file open for writing among them is still copied.
func TestSealManyFiles(t *testing.T) {
	dir, srv, _, spool := mountWithEvents(t, PassthroughAuto)
	p := func(n string) string { return filepath.Join(dir, n) }
	n := sealPart*2 + 7
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
	require.Equal(t, "9/big/open", info.CopiedExample)
	require.Zero(t, openIn(t, rec), "the seal left descriptors open (a directory of several parts)")

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

// TestSealManyDirectories: the files of many directories, linked by several goroutines a part at
// a time, make the same tree, and every directory the seal opened is closed again; when a link
// fails midway, the seal reports it, leaves no partial record and no descriptor behind.
func TestSealManyDirectories(t *testing.T) {
	dir, srv, _, spool := mountWithEvents(t, PassthroughAuto)
	p := func(n string) string { return filepath.Join(dir, n) }
	build := func(top string, dirs, perDir int) {
		for d := range dirs {
			sub := p(fmt.Sprintf("%s/d%02d/inner", top, d))
			require.NoError(t, os.MkdirAll(sub, 0o755))
			for i := range perDir {
				require.NoError(t, os.WriteFile(filepath.Join(filepath.Dir(sub), fmt.Sprintf("f%d", i)), []byte(fmt.Sprint(d, i)), 0o644))
			}
			require.NoError(t, os.WriteFile(filepath.Join(sub, "x"), []byte("x"), 0o644))
		}
	}
	build("3", 40, 30)
	rec := filepath.Join(spool.Dir(), "rec3")
	info, err := srv.Namespace().Seal("3", rec)
	require.NoError(t, err)
	require.Zero(t, info.Copied)
	require.Zero(t, openIn(t, rec), "the seal left descriptors open")
	want, err := layout.ListTree(p("3"))
	require.NoError(t, err)
	got, err := layout.ListTree(rec)
	require.NoError(t, err)
	require.Len(t, got, 40*(2+30+1))
	require.ElementsMatch(t, want, got)

	// An unlink that passed its check before the commit froze its directory, and whose entry
	// go-fuse has not removed yet when the seal reaches the file: the file is left out.
	build("6", 3, 5)
	doomed := srv.Namespace().(*namespace).root.GetChild("6").GetChild("d01").GetChild("f2")
	doomed.Operations().(*fileNode).dropLink()
	rec = filepath.Join(spool.Dir(), "rec6")
	_, err = srv.Namespace().Seal("6", rec)
	require.NoError(t, err, "a file the job unlinked fails the commit")
	require.NoFileExists(t, filepath.Join(rec, "d01/f2"))
	require.FileExists(t, filepath.Join(rec, "d01/f1"))

	// A spool file gone from under the agent: its link fails, and the seal with it.
	build("5", 40, 30)
	victim, _, end, err := srv.Namespace().HoldSpoolFile(context.Background(), "5/d17/f3")
	require.NoError(t, err)
	end()
	require.NoError(t, os.Remove(victim))
	rec = filepath.Join(spool.Dir(), "rec5")
	_, err = srv.Namespace().Seal("5", rec)
	require.ErrorIs(t, err, syscall.ENOENT)
	require.Contains(t, err.Error(), "f3")
	require.NoFileExists(t, rec)
	require.NoDirExists(t, rec)
	require.Zero(t, openIn(t, rec), "the failed seal left descriptors open")
}

// openIn counts this process's descriptors open on dir or below (a removed directory's link
// reads "<path> (deleted)").
func openIn(t *testing.T, dir string) int {
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	n := 0
	for _, e := range ents {
		if target, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name())); err == nil && strings.HasPrefix(target, dir) {
			n++
		}
	}
	return n
}
