package fusectl

import (
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestAbortOfNoMount: a directory that is not a FUSE mount is left alone, and no fusectl mount
// stays behind. (Aborting a live connection is exercised by the agent tests' cleanup.)
func TestAbortOfNoMount(t *testing.T) {
	count := func() int { // systemd mounts one at boot on most distributions
		data, err := os.ReadFile("/proc/self/mounts")
		require.NoError(t, err)
		return strings.Count(string(data), " fusectl ")
	}
	before := count()
	require.NoError(t, Abort(t.TempDir()))
	require.Equal(t, before, count(), "fusectl mounts before and after")
}

// TestConnectionOfAnEscapedPath: mountinfo writes a space in a mount point as \040; the
// connection of a mount at such a path is found all the same.
func TestConnectionOfAnEscapedPath(t *testing.T) {
	info := "36 35 0:43 / /tmp/a\\040b rw,nosuid - fuse.mtcfs mtcfs rw\n" +
		"37 35 0:44 / /tmp/plain rw - fuse.mtcfs mtcfs rw\n" +
		"38 35 0:45 / /tmp/a\\134c rw - tmpfs tmpfs rw\n"
	minor, ok := connectionIn(parseMounts(info), "/tmp/a b")
	require.True(t, ok)
	require.Equal(t, "43", minor)
	minor, ok = connectionIn(parseMounts(info), "/tmp/plain")
	require.True(t, ok)
	require.Equal(t, "44", minor)
	_, ok = connectionIn(parseMounts(info), `/tmp/a\c`)
	require.False(t, ok, "not a FUSE mount")
	_, ok = connectionIn(parseMounts(info), `/tmp/a\040b`)
	require.False(t, ok, "the escaped form is not the path")
	// The mount ID (field 1) names a mount wherever it is moved (fs.Server.Where).
	m := parseMounts(info)
	require.Equal(t, []string{"36", "37", "38"}, []string{m[0].ID, m[1].ID, m[2].ID})
}

// TestByHand: the commands for an operator mount fusectl first (often not mounted), and name the
// directory; without a FUSE mount there, they say where the connection number comes from.
func TestByHand(t *testing.T) {
	dir := t.TempDir()
	cmd := ByHand(dir)
	require.Contains(t, cmd, "mount -t fusectl none /sys/fs/fuse/connections; echo 1 > /sys/fs/fuse/connections/<its device minor")
	require.Contains(t, cmd, "umount -l "+dir)
}

// TestMountOwner: a FUSE mount's user_id and allow_other come from its super options.
func TestMountOwner(t *testing.T) {
	info := "36 35 0:43 / /tmp/u rw,nosuid - fuse.mtcfs mtcfs rw,user_id=1000,group_id=1000,default_permissions\n" +
		"37 35 0:44 / /tmp/r rw - fuse.mtcfs mtcfs rw,user_id=0,group_id=0,default_permissions,allow_other\n" +
		"38 35 0:45 / /tmp/t rw - tmpfs tmpfs rw\n"
	m := parseMounts(info)
	uid, others, ok := m[0].Owner()
	require.True(t, ok)
	require.Equal(t, uint32(1000), uid)
	require.False(t, others)
	uid, others, ok = m[1].Owner()
	require.True(t, ok && others)
	require.Equal(t, uint32(0), uid)
	_, _, ok = m[2].Owner()
	require.False(t, ok, "no user_id")
}
