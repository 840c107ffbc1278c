package layout

import (
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestAttrsListOnlyWhatDiffersAndRoundTrip(t *testing.T) {
	b := NewAttrsBuilder(Attr{Mode: 0o700, UID: 1000, GID: 100}, true)
	asked := map[string]bool{}
	add := func(typ EntryType, at Attr, p string) {
		b.Add(typ, at, func() string { asked[p] = true; return p })
	}
	add(EntryFile, Attr{0o600, 1000, 100}, "state/a") // most files' mode is the file mode
	add(EntryFile, Attr{0o600, 1000, 100}, "state/b")
	add(EntryDir, Attr{0o700, 1000, 100}, "state")
	add(EntryFile, Attr{0o4755, 1000, 100}, "bin/tool")
	add(EntryFile, Attr{0o600, 0, 0}, "root-owned")
	add(EntrySymlink, Attr{0o777, 1000, 100}, "latest")   // a symlink's mode is not kept
	add(EntryFIFO, Attr{0o644, 1000, 100}, "fifo")        // specials take the file mode
	add(EntryDir, Attr{0o755, 1000, 100}, "a\nb\xff/c d") // any legal name
	a := b.Attrs()
	assert.Equal(t, map[string]bool{"bin/tool": true, "root-owned": true, "fifo": true, "a\nb\xff/c d": true}, asked)
	enc := a.Encode()
	assert.Equal(t, "mtcfs attrs v1\ndefault 1000 100 0600 0700\n"+
		"0755 1000 100 \"a\\nb\\xff/c d\"\n4755 1000 100 \"bin/tool\"\n0644 1000 100 \"fifo\"\n0600 0 0 \"root-owned\"\n", string(enc))
	got, err := DecodeAttrs(enc)
	require.NoError(t, err)
	assert.Equal(t, a, got)
	assert.Equal(t, Attr{0o700, 1000, 100}, got.Of("", EntryDir))
	assert.Equal(t, Attr{0o600, 1000, 100}, got.Of("state/a", EntryFile))
	assert.Equal(t, Attr{0o4755, 1000, 100}, got.Of("bin/tool", EntryFile))
	assert.Equal(t, Attr{0, 1000, 100}, got.Of("latest", EntrySymlink))

	// A single file: its own mode and owner are the defaults.
	f := NewAttrsBuilder(Attr{Mode: 0o640, UID: 7, GID: 8}, false).Attrs()
	assert.Equal(t, "mtcfs attrs v1\ndefault 7 8 0640 0755\n", string(f.Encode()))
	assert.Equal(t, Attr{0o640, 7, 8}, f.Of("", EntryFile))
}

func TestDecodeAttrsRefusesWhatEncodeDoesNotWrite(t *testing.T) {
	for _, in := range []string{
		"",
		"mtcfs attrs v2\ndefault 0 0 0644 0755\n",
		"mtcfs attrs v1\n",
		"mtcfs attrs v1\ndefault 0 0 0644\n",
		"mtcfs attrs v1\ndefault 0 0 10644 0755\n",
		"mtcfs attrs v1\ndefault -1 0 0644 0755\n",
		"mtcfs attrs v1\ndefault 0 0 0644 0755\n0644 0 0 state\n",
		"mtcfs attrs v1\ndefault 0 0 0644 0755\n0644 0 0 \"../x\"\n",
		"mtcfs attrs v1\ndefault 0 0 0644 0755\n0644 0 0 \"a//b\"\n",
		"mtcfs attrs v1\ndefault 0 0 0644 0755\n0644 0 0 \"a\"\n0600 0 0 \"a\"\n",
		"mtcfs attrs v1\ndefault 0 0 0644 0755\n0644 4294967296 0 \"a\"\n",
		"mtcfs attrs v1\ndefault 0 0 0644 0755\n0844 0 0 \"a\"\n",
		"mtcfs attrs v1\ndefault 0 0 0644 0755 junk\n",
		"mtcfs attrs v1\ndefault  0 0 0644 0755\n",
		"mtcfs attrs v1\nfault 0 0 0644 0755\n",
		"mtcfs attrs v1\ndefault 0 0 644 0755\n",
		"mtcfs attrs v1\ndefault 0 0 0644 0755\n0600 0 0 \"b\"\n0600 0 0 \"a\"\n",
		"mtcfs attrs v1\ndefault 0 0 0644 0755\n0600 0 0 `a`\n",
		"mtcfs attrs v1\ndefault 0 0 0644 0755\n0600 0 0 \"a\xff\"\n",
	} {
		_, err := DecodeAttrs([]byte(in))
		assert.Error(t, err, "%q", in)
	}
}

// WriteAttrs refuses what DecodeAttrs would: a record past MaxAttrsSize.
func TestWriteAttrsRefusesWhatReadersWould(t *testing.T) {
	b := NewAttrsBuilder(Attr{Mode: 0o755}, true)
	long := strings.Repeat("n", 255)
	for i := 0; i*270 <= MaxAttrsSize; i++ {
		b.Add(EntryFile, Attr{Mode: 0o600, UID: uint32(i + 1)}, func() string { return fmt.Sprintf("%08d/%s", i, long) })
	}
	p := filepath.Join(t.TempDir(), "D.data")
	assert.ErrorIs(t, WriteAttrs(p, b.Attrs()), ErrAttrsTooLarge)
	assert.NoFileExists(t, AttrsFile(p))
	require.NoError(t, WriteAttrs(p, NewAttrsBuilder(Attr{Mode: 0o700}, true).Attrs()))
	got, err := ReadAttrs(p)
	require.NoError(t, err)
	assert.Equal(t, uint32(0o700), got.DirMode)
}

// The file mode is the one most of the top owner's files have: files written through mkstemp
// (0600) into 0755 directories are not each listed (before, a tree of them listed every file,
// and its attrs could outgrow a peer push's header); on a tie, the top's mode without x.
func TestAttrsFileModeIsTheMostCommon(t *testing.T) {
	top := Attr{Mode: 0o755, UID: 1000, GID: 1000}
	b := NewAttrsBuilder(top, true)
	for _, p := range []string{"a", "b", "c"} {
		b.Add(EntryFile, Attr{0o600, 1000, 1000}, func() string { return p })
	}
	b.Add(EntryFile, Attr{0o644, 1000, 1000}, func() string { return "d" })
	b.Add(EntryFile, Attr{0o600, 0, 0}, func() string { return "root" })
	b.Add(EntryDir, Attr{0o755, 1000, 1000}, func() string { return "dir" })
	assert.Equal(t, "mtcfs attrs v1\ndefault 1000 1000 0600 0755\n0644 1000 1000 \"d\"\n0600 0 0 \"root\"\n", string(b.Attrs().Encode()))

	tie := NewAttrsBuilder(top, true)
	tie.Add(EntryFile, Attr{0o600, 1000, 1000}, func() string { return "a" })
	tie.Add(EntryFile, Attr{0o644, 1000, 1000}, func() string { return "b" })
	assert.Equal(t, "mtcfs attrs v1\ndefault 1000 1000 0644 0755\n0600 1000 1000 \"a\"\n", string(tie.Attrs().Encode()))
	tie2 := NewAttrsBuilder(top, true)
	tie2.Add(EntryFile, Attr{0o640, 1000, 1000}, func() string { return "a" })
	tie2.Add(EntryFile, Attr{0o600, 1000, 1000}, func() string { return "b" })
	assert.Equal(t, "mtcfs attrs v1\ndefault 1000 1000 0600 0755\n0640 1000 1000 \"a\"\n", string(tie2.Attrs().Encode()), "else the lowest")
}
