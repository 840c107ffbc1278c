// Package fusectl aborts the FUSE connection of a mount, as `echo 1 >
// /sys/fs/fuse/connections/N/abort` does: every request waiting on it, and every later one, fails
// with ENOTCONN. Tests use it before detaching a mount whose agent they killed, so that no
// process (their own included) can stay blocked on it if the kernel kept the connection open.
// It also reads the mount table (Mounts), for the packages that look for their mounts in it.
package fusectl

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

const connections = "/sys/fs/fuse/connections"

// Abort aborts the FUSE connection of the mount at dir (absolute, as /proc/self/mountinfo shows
// it). It does nothing when dir is not a FUSE mount. If the fusectl filesystem is not mounted,
// it mounts it for the call and unmounts it again.
func Abort(dir string) error {
	minor, ok, err := connectionOf(dir)
	if err != nil || !ok {
		return err
	}
	return AbortConnection(minor)
}

// AbortConnection aborts the FUSE connection numbered minor (the minor of its mounts' device,
// "0:<minor>" in the mount table); a connection that is gone already is not an error. A server
// aborting its own connection names it so: the mount at its directory may no longer be its own.
func AbortConnection(minor string) error {
	if ents, _ := os.ReadDir(connections); len(ents) == 0 {
		// Not mounted (a mounted fusectl lists this connection at least).
		if err := unix.Mount("fusectl", connections, "fusectl", 0, ""); err != nil {
			return fmt.Errorf("mount fusectl: %w", err)
		}
		defer unix.Unmount(connections, 0)
	}
	err := os.WriteFile(filepath.Join(connections, minor, "abort"), []byte("1"), 0)
	if errors.Is(err, os.ErrNotExist) {
		return nil // the connection is gone already
	}
	return err
}

// ByHand returns the shell commands that abort the connection of the FUSE mount at dir and
// detach it, as root, with its connection number filled in when the mount table has it.
func ByHand(dir string) string {
	minor, ok, _ := connectionOf(dir)
	if !ok {
		minor = "<its device minor, the second number of its device in /proc/self/mountinfo>"
	}
	return fmt.Sprintf("mountpoint -q %s || mount -t fusectl none %s; echo 1 > %s/%s/abort; umount -l %s",
		connections, connections, connections, minor, dir)
}

// Mount is a line of the mount table.
type Mount struct {
	ID     string // the mount's ID (mountinfo field 1): kept when a directory above is renamed
	Point  string // the mount point, unescaped
	Device string // major:minor
	FSType string // "tmpfs", "fuse.mtcfs", …
	Source string
	Super  string // the super options ("rw,user_id=1000,group_id=1000,allow_other")
}

// Owner returns the uid a FUSE mount was made for (its user_id option), and whether processes of
// other users may use it (allow_other); ok is false when the options do not say.
func (m Mount) Owner() (uid uint32, allowOther, ok bool) {
	for _, o := range strings.Split(m.Super, ",") {
		if v, found := strings.CutPrefix(o, "user_id="); found {
			n, err := strconv.ParseUint(v, 10, 32)
			uid, ok = uint32(n), err == nil
		}
		allowOther = allowOther || o == "allow_other"
	}
	return uid, allowOther, ok
}

// IsFUSE tells whether the mount is a FUSE file system (fuse, fuse.NAME, fuseblk).
func (m Mount) IsFUSE() bool { return strings.HasPrefix(m.FSType, "fuse") }

// Mounts returns the mount table of this process's mount namespace (/proc/self/mountinfo), in its
// order: of mounts stacked on one point, the last is on top.
func Mounts() ([]Mount, error) {
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	return parseMounts(string(data)), nil
}

// parseMounts reads the text of a mountinfo file, whose mount points escape a space, tab, newline
// and backslash in octal (\040).
func parseMounts(mountinfo string) []Mount {
	var out []Mount
	for _, line := range strings.Split(mountinfo, "\n") {
		// 36 35 0:43 / /mnt rw,... shared:1 - fuse.mtcfs mtcfs rw,...
		pre, post, found := strings.Cut(line, " - ")
		f, g := strings.Fields(pre), strings.Fields(post)
		if !found || len(f) < 5 || len(g) < 2 {
			continue
		}
		m := Mount{ID: f[0], Point: UnescapePath(f[4]), Device: f[2], FSType: g[0], Source: g[1]}
		if len(g) > 2 {
			m.Super = g[2]
		}
		out = append(out, m)
	}
	return out
}

// connectionOf returns the connection number (the device minor) of the FUSE mount at dir.
func connectionOf(dir string) (string, bool, error) {
	mounts, err := Mounts()
	if err != nil {
		return "", false, err
	}
	minor, ok := connectionIn(mounts, dir)
	return minor, ok, nil
}

// connectionIn finds dir's FUSE connection in a mount table.
func connectionIn(mounts []Mount, dir string) (string, bool) {
	for _, m := range mounts {
		if m.Point == dir && m.IsFUSE() {
			_, minor, ok := strings.Cut(m.Device, ":")
			return minor, ok
		}
	}
	return "", false
}

// UnescapePath undoes the octal escapes (\040 for a space, \011, \012, \134) of a path in
// /proc/self/mountinfo or /proc/self/mounts.
func UnescapePath(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
