// Package buildstamp reads what the Go toolchain recorded about the source of a build, for
// `mtcfs version` and for the benchmarks' record of the binary they measured.
package buildstamp

import "runtime/debug"

// VCS returns the commit the build was made from ("" when the toolchain recorded none, as with
// -buildvcs=false) and whether the working tree had uncommitted changes.
func VCS(info *debug.BuildInfo) (revision string, modified bool) {
	if info == nil {
		return "", false
	}
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			revision = s.Value
		case "vcs.modified":
			modified = s.Value == "true"
		}
	}
	return revision, modified
}
