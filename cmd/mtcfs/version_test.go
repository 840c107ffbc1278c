package main

import (
	"runtime/debug"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
)

// TestVCSVersion: a version set at build time is kept; the default "dev" is only ever extended
// (by the commit the toolchain recorded, when it recorded one: not with -buildvcs=false).
func TestVCSVersion(t *testing.T) {
	assert.Equal(t, "v1.2.3", vcsVersion("v1.2.3"))
	got := vcsVersion("dev")
	assert.True(t, got == "dev" || strings.HasPrefix(got, "v"), "vcsVersion(dev) = %q", got)
	// What the toolchain records, made up (a test binary records no VCS stamp).
	stamped := &debug.BuildInfo{Main: debug.Module{Version: "v0.0.0-20261205145920-2e5ab63eef9f+dirty"}}
	assert.Equal(t, "v0.0.0-20261205145920-2e5ab63eef9f+dirty", versionFrom("dev", stamped, true))
	assert.Equal(t, "v1.2.3", versionFrom("v1.2.3", stamped, true), "a version set at build time wins")
	assert.Equal(t, "dev", versionFrom("dev", &debug.BuildInfo{Main: debug.Module{Version: "(devel)"}}, true), "-buildvcs=false")
	assert.Equal(t, "dev", versionFrom("dev", nil, false), "no build info")
}
