// Package fusectl aborts the FUSE connection of a mount, as `echo 1 >
// /sys/fs/fuse/connections/N/abort` does: every request waiting on it, and every later one, fails
// with ENOTCONN. Tests use it before detaching a mount whose agent they killed, so that no
// process (their own included) can stay blocked on it if the kernel kept the connection open.
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
	if ents, _ := os.ReadDir(connections); len(ents) == 0 {
		// Not mounted (a mounted fusectl lists this connection at least).
		if err := unix.Mount("fusectl", connections, "fusectl", 0, ""); err != nil {
			return fmt.Errorf("mount fusectl: %w", err)
		}
		defer unix.Unmount(connections, 0)
	}
	err = os.WriteFile(filepath.Join(connections, minor, "abort"), []byte("1"), 0)
	if errors.Is(err, os.ErrNotExist) {
		return nil // the connection is gone already
	}
	return err
}

// connectionOf returns the connection number (the device minor) of the FUSE mount at dir.
func connectionOf(dir string) (string, bool, error) {
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return "", false, err
	}
	minor, ok := connectionIn(string(data), dir)
	return minor, ok, nil
}

// connectionIn finds dir's FUSE connection in the text of a mountinfo file, whose mount points
// escape a space, tab, newline and backslash in octal (\040).
func connectionIn(mountinfo, dir string) (string, bool) {
	for _, line := range strings.Split(mountinfo, "\n") {
		// 36 35 0:43 / /mnt rw,... shared:1 - fuse.mtcfs mtcfs rw,...
		pre, post, found := strings.Cut(line, " - ")
		f, g := strings.Fields(pre), strings.Fields(post)
		if !found || len(f) < 5 || len(g) < 1 || UnescapePath(f[4]) != dir || !strings.HasPrefix(g[0], "fuse") {
			continue
		}
		_, minor, ok := strings.Cut(f[2], ":")
		return minor, ok
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
