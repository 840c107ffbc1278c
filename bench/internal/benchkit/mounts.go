package benchkit

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// MountType returns the filesystem type mounted exactly at dir (the topmost), or "".
func MountType(dir string) string {
	t := ""
	for _, m := range readMounts() {
		if m.dir == dir {
			t = m.fstype
		}
	}
	return t
}

// MountsUnder lists the mount points at or below dir, outermost first.
func MountsUnder(dir string) []string {
	var out []string
	for _, m := range readMounts() {
		if m.dir == dir || strings.HasPrefix(m.dir, dir+"/") {
			out = append(out, m.dir)
		}
	}
	return out
}

// Unmount unmounts what is mounted at dir, if anything. A busy mount is detached lazily
// (umount -l), which is reported as an error: something still used it.
func Unmount(dir string) error {
	if MountType(dir) == "" {
		return nil
	}
	if unix.Unmount(dir, 0) == nil {
		return nil
	}
	if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
		return fmt.Errorf("umount -l %s: %w", dir, err)
	}
	return fmt.Errorf("%s was busy; detached it lazily", dir)
}

// RemoveAllUnlessMounted removes dir and everything below it, unless something is still mounted
// at or below it: removing through a live mount would delete its files.
func RemoveAllUnlessMounted(dir string) error {
	if left := MountsUnder(dir); len(left) > 0 {
		return fmt.Errorf("still mounted, not removing %s: %s", dir, strings.Join(left, ", "))
	}
	return os.RemoveAll(dir)
}

type mountEntry struct{ dir, fstype string }

// readMounts parses /proc/mounts; later entries (mounts on top) come last.
func readMounts() []mountEntry {
	data, err := os.ReadFile("/proc/mounts")
	if err != nil {
		return nil
	}
	unescape := strings.NewReplacer(`\040`, " ", `\011`, "\t", `\012`, "\n", `\134`, `\`)
	var out []mountEntry
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) >= 3 {
			out = append(out, mountEntry{dir: unescape.Replace(f[1]), fstype: f[2]})
		}
	}
	return out
}
