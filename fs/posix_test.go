package fs

import (
	"sort"
	"testing"

	"github.com/hanwen/go-fuse/v2/posixtest"
)

// posixSkips lists go-fuse posixtest cases that do not apply, with the reason.
var posixSkips = map[string]string{
	// The case expects a second F_SETLK from the same process to fail, but POSIX record locks
	// belong to the process, so it succeeds on tmpfs and ext4 too (checked by hand on
	// /dev/shm); go-fuse's own run of the suite skips it for the same reason.
	"FcntlFlockLocksFile": "expects non-POSIX lock semantics; fails on tmpfs as well",
}

// TestPosix runs go-fuse's POSIX conformance suite unchanged against a real mount, for both
// data paths.
func TestPosix(t *testing.T) {
	names := make([]string, 0, len(posixtest.All))
	for n := range posixtest.All {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, mode := range modes {
		t.Run(string(mode), func(t *testing.T) {
			for _, name := range names {
				t.Run(name, func(t *testing.T) {
					if why, ok := posixSkips[name]; ok {
						t.Skip(why)
					}
					// Extended attributes are off by default (see Options.Xattrs); the suite
					// checks them with them on.
					dir, _ := testMount(t, mode, 256<<20, func(o *Options) { o.Xattrs = true })
					posixtest.All[name](t, dir)
				})
			}
		})
	}
}
