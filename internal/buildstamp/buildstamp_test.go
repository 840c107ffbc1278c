package buildstamp

import (
	"runtime/debug"
	"testing"
)

func TestVCS(t *testing.T) {
	info := &debug.BuildInfo{Settings: []debug.BuildSetting{
		{Key: "vcs", Value: "git"}, {Key: "vcs.revision", Value: "2e4cbe6abc"}, {Key: "vcs.modified", Value: "true"}}}
	if rev, mod := VCS(info); rev != "2e4cbe6abc" || !mod {
		t.Errorf("VCS = %q, %v; want 2e4cbe6abc, true", rev, mod)
	}
	if rev, mod := VCS(&debug.BuildInfo{}); rev != "" || mod {
		t.Errorf("VCS of a build without a stamp = %q, %v", rev, mod)
	}
	if rev, mod := VCS(nil); rev != "" || mod {
		t.Errorf("VCS(nil) = %q, %v", rev, mod)
	}
}
