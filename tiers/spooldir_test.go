package tiers

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// TestSpoolRefusesAForeignDirectory: a spool directory that is not empty and has no agent's owner
// record is refused, untouched, even when its entries have a spool's names (a user's directory
// holding just "files"); a directory that does not exist or is empty is taken, and so is a spool
// an agent left; freeing a spool removes its own entries and leaves anything else, with the
// directory. Before, --spool naming an existing directory (a typo such as --spool /data) hid it
// under the spool's tmpfs, and the stop that freed the spool removed it with everything in it.
func TestSpoolRefusesAForeignDirectory(t *testing.T) {
	base := t.TempDir()
	precious := filepath.Join(base, "precious")
	require.NoError(t, os.MkdirAll(filepath.Join(precious, "sub"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(precious, "notes.txt"), []byte("mine"), 0o644))
	named := filepath.Join(base, "named") // a spool's names, not a spool
	require.NoError(t, os.MkdirAll(filepath.Join(named, "files"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(named, "files", "mine.txt"), []byte("mine"), 0o644))
	for _, c := range []struct{ dir, file, holds string }{
		{precious, "notes.txt", "it holds notes.txt, sub"},
		{named, filepath.Join("files", "mine.txt"), "it holds files"},
	} {
		for _, tmpfs := range []bool{false, true} {
			if tmpfs && os.Geteuid() != 0 {
				continue // mounting the spool's tmpfs needs root; the plain case ran
			}
			_, err := OpenSpool(SpoolConfig{Dir: c.dir, Budget: MinBudget, MountTmpfs: tmpfs, MountPath: filepath.Join(base, "mnt")})
			require.Error(t, err, "%s, tmpfs=%v", c.dir, tmpfs)
			assert.Contains(t, err.Error(), "is not empty and not an mtcfs spool")
			assert.Contains(t, err.Error(), c.holds)
			assert.False(t, isTmpfsMount(c.dir), "nothing is mounted over a refused directory")
			data, err := os.ReadFile(filepath.Join(c.dir, c.file))
			require.NoError(t, err)
			assert.Equal(t, "mine", string(data))
			assert.NoFileExists(t, filepath.Join(c.dir, OwnerFile))
		}
	}

	// A spool an agent left (released, not freed) is taken again.
	kept := filepath.Join(base, "kept")
	s, err := OpenSpool(SpoolConfig{Dir: kept, Budget: MinBudget, MountPath: filepath.Join(base, "mnt")})
	require.NoError(t, err)
	require.NoError(t, s.Detach())
	s, err = OpenSpool(SpoolConfig{Dir: kept, Budget: MinBudget, MountPath: filepath.Join(base, "mnt")})
	require.NoError(t, err, "a spool left by an agent")
	require.NoError(t, s.Close())
	assert.NoDirExists(t, kept)

	// An empty directory is taken, and freed with the spool.
	empty := filepath.Join(base, "empty")
	require.NoError(t, os.Mkdir(empty, 0o700))
	s, err = OpenSpool(SpoolConfig{Dir: empty, Budget: MinBudget, MountPath: filepath.Join(base, "mnt")})
	require.NoError(t, err)
	require.NoError(t, s.Close())
	assert.NoDirExists(t, empty)

	// Something put into a spool while it is used stays when the spool is freed, and so does
	// the directory; the spool's own entries go.
	used := filepath.Join(base, "used")
	s, err = OpenSpool(SpoolConfig{Dir: used, Budget: MinBudget, MountPath: filepath.Join(base, "mnt")})
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(used, "stray"), []byte("x"), 0o644))
	err = s.Close()
	require.Error(t, err)
	assert.Contains(t, err.Error(), "holds entries that are not a spool's (stray)")
	ents, err := os.ReadDir(used)
	require.NoError(t, err)
	require.Len(t, ents, 1)
	assert.Equal(t, "stray", ents[0].Name())
}

// TestSpoolRefusesAForeignTmpfs: a tmpfs mounted by someone else (such as /dev/shm) is refused as
// a spool and left as it was: mounted, its size and content unchanged. Before, the agent resized
// it to its budget, and a stop that freed the spool unmounted it and removed the directory.
func TestSpoolRefusesAForeignTmpfs(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting a tmpfs needs root")
	}
	dir := filepath.Join(t.TempDir(), "theirs")
	require.NoError(t, os.Mkdir(dir, 0o755))
	require.NoError(t, unix.Mount("theirs", dir, "tmpfs", 0, "size=8m"))
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	require.NoError(t, os.WriteFile(filepath.Join(dir, "keep"), []byte("k"), 0o644))
	var before unix.Statfs_t
	require.NoError(t, unix.Statfs(dir, &before))

	_, err := OpenSpool(SpoolConfig{Dir: dir, Budget: MinBudget, MountTmpfs: true, MountPath: filepath.Join(t.TempDir(), "mnt")})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "is a tmpfs mounted by someone else")
	var after unix.Statfs_t
	require.NoError(t, unix.Statfs(dir, &after))
	assert.Equal(t, before.Blocks, after.Blocks, "its size is unchanged")
	assert.True(t, isTmpfsMount(dir))
	assert.FileExists(t, filepath.Join(dir, "keep"))
}

// TestSpoolHeadroom: a spool tmpfs holds HeadroomSize beyond the budget that the job cannot
// take and Usage does not show; the agent frees it when a record of its own finds no room,
// takes it back once there is room again, and a kept spool leaves it behind.
func TestSpoolHeadroom(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting a tmpfs needs root")
	}
	dir := filepath.Join(t.TempDir(), "spool")
	s, err := OpenSpool(SpoolConfig{Dir: dir, Budget: MinBudget, MountTmpfs: true, MountPath: filepath.Join(t.TempDir(), "mnt")})
	require.NoError(t, err)
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	total, used := s.Usage()
	assert.EqualValues(t, MinBudget, total, "the budget, without the headroom")
	assert.Less(t, used, int64(64<<10), "the headroom is not shown as used")
	fi, err := os.Stat(filepath.Join(dir, HeadroomFile))
	require.NoError(t, err)
	assert.EqualValues(t, HeadroomSize, fi.Size())

	// The job fills the budget: its next write finds no room.
	job := filepath.Join(s.FilesDir(), "job")
	f, err := os.Create(job)
	require.NoError(t, err)
	chunk := make([]byte, 64<<10)
	for {
		if _, err = f.Write(chunk); err != nil {
			break
		}
	}
	require.ErrorIs(t, err, unix.ENOSPC)
	require.NoError(t, f.Close())
	_, used = s.Usage()
	assert.Greater(t, used, int64(MinBudget-(128<<10)), "the budget is used up")
	record := func() error {
		return os.WriteFile(filepath.Join(dir, "record"), []byte("a record of the agent"), 0o600)
	}
	err = record()
	require.ErrorIs(t, err, unix.ENOSPC, "no room left for the agent either")
	require.True(t, s.UseHeadroom(err))
	require.NoError(t, record(), "a chunk of the headroom makes room for the record")
	fi, err = os.Stat(filepath.Join(dir, HeadroomFile))
	require.NoError(t, err)
	assert.EqualValues(t, HeadroomSize-HeadroomChunk, fi.Size(), "one chunk used")
	// The job can take what the record left of the chunk, and no more.
	f, err = os.OpenFile(job, os.O_WRONLY|os.O_APPEND, 0)
	require.NoError(t, err)
	taken := 0
	for {
		n, err := f.Write(make([]byte, 4096))
		taken += n
		if err != nil {
			require.ErrorIs(t, err, unix.ENOSPC)
			break
		}
	}
	require.NoError(t, f.Close())
	assert.Less(t, taken, HeadroomChunk, "the job took the rest of the chunk at most")
	s.FillHeadroom()
	fi, err = os.Stat(filepath.Join(dir, HeadroomFile))
	require.NoError(t, err)
	assert.EqualValues(t, HeadroomSize-HeadroomChunk, fi.Size(), "no room to take it back while the budget is full")
	for s.UseHeadroom(unix.ENOSPC) { // every chunk, then no more
	}
	fi, err = os.Stat(filepath.Join(dir, HeadroomFile))
	require.NoError(t, err)
	assert.Zero(t, fi.Size())

	require.NoError(t, os.Remove(job)) // the job's bytes are freed
	s.FillHeadroom()
	fi, err = os.Stat(filepath.Join(dir, HeadroomFile))
	require.NoError(t, err)
	assert.EqualValues(t, HeadroomSize, fi.Size(), "taken back")
	assert.True(t, s.UseHeadroom(fmt.Errorf("write: %w", unix.ENOSPC)))
	assert.False(t, s.UseHeadroom(errors.New("another error")))

	require.NoError(t, s.Detach()) // kept for the next agent
	assert.NoFileExists(t, filepath.Join(dir, HeadroomFile))
	assert.True(t, isSpoolEntry(HeadroomFile))
}

// A plain spool (an agent without root) that another user made, or in a default root others
// can write to, is refused: a local user who made /dev/shm/mtcfs-UID (0777) before the victim's
// first agent swapped a kept spool for one of theirs, and the victim's job restored the other
// user's bytes (found by a black-box run). For a tmpfs spool (root), the default root is taken
// back (root's, 0700), a planted symlink refused, and a spool directory a user made taken: its
// tmpfs hides whatever was planted below it.
func TestSpoolOfAnotherUserIsRefused(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: to give directories to another user")
	}
	root := filepath.Join(t.TempDir(), "mtcfs-0")
	dir := filepath.Join(root, "ckpt-0123456789ab")
	require.NoError(t, checkSpoolOwnership(dir, root, true), "nothing made yet")
	require.NoError(t, os.MkdirAll(dir, 0o700))
	require.NoError(t, checkSpoolOwnership(dir, root, true))

	require.NoError(t, os.Chmod(root, 0o777))
	err := checkSpoolOwnership(dir, root, true)
	require.ErrorContains(t, err, "the spool root "+root+" is writable by others (mode 0777)")
	require.NoError(t, checkSpoolOwnership(dir, root, false), "a tmpfs spool's root is taken back")
	fi, err := os.Stat(root)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o700), fi.Mode().Perm())

	require.NoError(t, os.Chown(root, 1000, 1000))
	require.ErrorContains(t, checkSpoolOwnership(dir, root, true), "the spool root "+root+" belongs to uid 1000, not to this agent's user (uid 0)")
	require.NoError(t, checkSpoolOwnership(dir, root, false), "a tmpfs spool's root is taken back")
	var st syscall.Stat_t
	require.NoError(t, syscall.Stat(root, &st))
	require.Equal(t, uint32(0), st.Uid)

	require.NoError(t, os.Chown(dir, 1000, 1000))
	require.NoError(t, checkSpoolOwnership(dir, root, false), "a tmpfs spool's own directory: its tmpfs hides what is below")
	_, err = OpenSpool(SpoolConfig{Dir: dir, Budget: MinBudget, MountPath: filepath.Join(t.TempDir(), "mnt")})
	require.ErrorContains(t, err, "the spool "+dir+" belongs to uid 1000")
	require.NoError(t, os.Remove(dir))
	require.NoError(t, os.Symlink(t.TempDir(), dir))
	for _, plain := range []bool{true, false} {
		require.ErrorContains(t, checkSpoolOwnership(dir, root, plain), "is not a directory (a symlink?)")
	}
}

// TestSpoolGrownForRecords: a kept spool that holds more than the budget by the agent's records
// (a step committed with the budget full to the last page) is reopened with the same budget in
// a tmpfs larger by what the records took, plus room for the start. The extra is headroom: the
// headroom takes what is free at once and the rest once a step is freed, and the job's part
// (Usage, and what it can write) stays the budget (found by a black-box run and two reviews).
func TestSpoolGrownForRecords(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting a tmpfs needs root")
	}
	dir, mnt := filepath.Join(t.TempDir(), "spool"), filepath.Join(t.TempDir(), "mnt")
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	open := func() *Spool {
		s, err := OpenSpool(SpoolConfig{Dir: dir, Budget: MinBudget, MountTmpfs: true, MountPath: mnt})
		require.NoError(t, err)
		return s
	}
	fill := func(p string) (written int64) {
		f, err := os.Create(p)
		require.NoError(t, err)
		defer f.Close()
		chunk := make([]byte, 64<<10)
		for {
			n, err := f.Write(chunk)
			written += int64(n)
			if err != nil {
				require.ErrorIs(t, err, unix.ENOSPC)
				return written
			}
		}
	}
	s := open()
	assert.Zero(t, s.Grown(), "a new spool")
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "sealed"), 0o700))
	step := filepath.Join(dir, "sealed", "step")
	fill(step) // a committed step that takes the whole budget
	// The agent's records, in the headroom.
	for i := range 3 {
		write := func() error {
			return os.WriteFile(filepath.Join(dir, fmt.Sprintf("record%d", i)), make([]byte, 64<<10), 0o600)
		}
		err := write()
		for s.UseHeadroom(err) {
			err = write()
		}
		require.NoError(t, err)
	}
	require.NoError(t, s.Detach())

	s = open()
	assert.Positive(t, s.Grown(), "the tmpfs is made larger for the records")
	total, _ := s.Usage()
	assert.EqualValues(t, MinBudget, total, "the job's part stays the budget")
	fi, err := os.Stat(filepath.Join(dir, HeadroomFile))
	require.NoError(t, err)
	assert.Positive(t, fi.Size(), "the headroom takes what is free")
	assert.Less(t, fi.Size(), s.headroomSize, "not all of its target while the step holds the rest")

	require.NoError(t, os.Remove(step)) // the step is freed
	s.FillHeadroom()
	fi, err = os.Stat(filepath.Join(dir, HeadroomFile))
	require.NoError(t, err)
	assert.Equal(t, s.headroomSize, fi.Size(), "the whole target once there is room")
	written := fill(filepath.Join(s.FilesDir(), "job"))
	assert.LessOrEqual(t, written, int64(MinBudget), "the job writes no more than the budget")
	assert.Greater(t, written, int64(MinBudget-(1<<20)), "and about all of it (the records keep a little)")
	require.NoError(t, s.Detach())
}

// TestSpoolTmpfsStaysNosuidNodev: the spool tmpfs is mounted nosuid and nodev, and stays so when
// a restarted agent takes it back and resizes it (a remount sets the mount's flags anew: the
// resize dropped both, found by a review of the documentation against the binary).
func TestSpoolTmpfsStaysNosuidNodev(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting a tmpfs needs root")
	}
	dir, mnt := filepath.Join(t.TempDir(), "spool"), filepath.Join(t.TempDir(), "mnt")
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	for i, budget := range []int64{MinBudget, 2 * MinBudget} {
		s, err := OpenSpool(SpoolConfig{Dir: dir, Budget: budget, MountTmpfs: true, MountPath: mnt})
		require.NoError(t, err)
		var st unix.Statfs_t
		require.NoError(t, unix.Statfs(dir, &st))
		assert.NotZero(t, st.Flags&unix.ST_NOSUID, "open %d: mount flags %#x: want nosuid", i, st.Flags)
		assert.NotZero(t, st.Flags&unix.ST_NODEV, "open %d: mount flags %#x: want nodev", i, st.Flags)
		total, _ := s.Usage()
		assert.EqualValues(t, budget, total, "open %d: the budget", i)
		require.NoError(t, s.Detach()) // kept, as by an agent that stops with a step in RAM
	}
}

// TestSpoolGivenAsASymlinkStays: a --spool given as a symlink to a directory of the user's is
// used through it, and freeing the spool leaves the link and the directory: the link was
// removed, and the next start made a plain directory in its place (found by a review).
func TestSpoolGivenAsASymlinkStays(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting a tmpfs needs root")
	}
	shm, err := os.MkdirTemp("/dev/shm", "mtcfs-spool-link-test-") // another file system than the link's, a tmpfs
	require.NoError(t, err)
	t.Cleanup(func() { unix.Unmount(shm, unix.MNT_DETACH); os.RemoveAll(shm) })
	for i, tmpfs := range []bool{true, false, true} {
		target, link := t.TempDir(), filepath.Join(t.TempDir(), "spool")
		if i == 2 {
			target = shm // a new directory on /dev/shm was taken for a kept spool tmpfs (a review)
		}
		require.NoError(t, os.Symlink(target, link))
		t.Cleanup(func() { unix.Unmount(target, unix.MNT_DETACH) })
		for i := range 2 {
			s, err := OpenSpool(SpoolConfig{Dir: link, Budget: MinBudget, MountTmpfs: tmpfs, MountPath: filepath.Join(t.TempDir(), "mnt")})
			require.NoError(t, err, "tmpfs %v, open %d", tmpfs, i)
			require.NoError(t, s.Close(), "tmpfs %v, open %d", tmpfs, i)
			fi, err := os.Lstat(link)
			require.NoError(t, err, "tmpfs %v, open %d: the link stays", tmpfs, i)
			assert.NotZero(t, fi.Mode()&os.ModeSymlink, "tmpfs %v, open %d: still a symlink", tmpfs, i)
			assert.DirExists(t, target, "tmpfs %v, open %d: the user's directory stays", tmpfs, i)
		}
	}
}
