package main

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
)

// TestVCSVersion: a version set at build time is kept; the default "dev" is only ever extended
// (by the commit the toolchain recorded, when it recorded one: not with -buildvcs=false).
func TestVCSVersion(t *testing.T) {
	assert.Equal(t, "v1.2.3", vcsVersion("v1.2.3"))
	got := vcsVersion("dev")
	assert.True(t, got == "dev" || strings.HasPrefix(got, "dev+"), "vcsVersion(dev) = %q", got)
}
