package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// toolsScript runs the everyday tools of the acceptance list in the current directory
// and prints what they produced, so the same script can run on tmpfs and on mtcfs and the two
// outputs be compared.
const toolsScript = `
set -e
dd if=/dev/urandom of=src.bin bs=1M count=8 status=none
dd if=src.bin of=copy.bin bs=64k status=none
mkdir -p tree/a/b && printf hello > tree/a/b/f && dd if=src.bin of=tree/big bs=1M count=3 status=none
cp -r tree tree2
mv tree2 dir2
mkdir dir3 && touch dir3/old
mv -T dir2 dir3 2>/dev/null || { rm -rf dir3; mv dir2 dir3; }
ln -s dir3/a/b/f link
ln -s dir3 dirlink
python3 - <<'PY'
import mmap, os
with open("mm.bin", "w+b") as f:
    f.truncate(1 << 20)
    m = mmap.mmap(f.fileno(), 1 << 20)
    m[4096:4101] = b"abcde"
    m.flush(); m.close()
with open("mm.bin", "rb") as f:
    f.seek(4096); print("mmap read back:", f.read(5).decode())
m = mmap.mmap(os.open("copy.bin", os.O_RDONLY), 0, prot=mmap.PROT_READ)
print("mmap shared read ok:", m[:1 << 20] == open("src.bin", "rb").read(1 << 20))
PY
cat link; echo
readlink link
ls dirlink/a/b
cmp src.bin copy.bin && echo "dd copy identical"
find . -printf '%y %s %p\n' | grep -v '^d' | sort
md5sum src.bin copy.bin dir3/big mm.bin | awk '{print $1}' | sort | uniq -c | awk '{print $1}' | sort -n
`

// TestEverydayTools runs dd, cp -r, mv of directories, ln -s and Python mmap on a real mount
// and on tmpfs, and requires identical results.
func TestEverydayTools(t *testing.T) {
	needRoot(t)
	if _, err := exec.LookPath("python3"); err != nil {
		t.Skip("python3 not installed")
	}
	run := func(dir string) string {
		cmd := exec.Command("bash", "-c", toolsScript)
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "script failed in %s:\n%s", dir, out)
		return string(out)
	}
	ref, err := os.MkdirTemp("/dev/shm", "mtcfs-tools")
	require.NoError(t, err)
	defer os.RemoveAll(ref)

	base := t.TempDir()
	dir := filepath.Join(base, "mnt")
	require.NoError(t, os.Mkdir(dir, 0o755))
	startAgent(t, dir, filepath.Join(base, "spool"))

	want, got := run(ref), run(dir)
	require.Contains(t, got, "mmap read back: abcde")
	require.Contains(t, got, "dd copy identical")
	// md5 of the src, its dd copy and its cp -r copy agree: one distinct pair of counts.
	require.Equal(t, strings.TrimSpace(want), strings.TrimSpace(got), "mtcfs and tmpfs differ")
}
