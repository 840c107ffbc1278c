package tiers

import (
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// fakeCgroup writes a /proc/self/cgroup and a cgroup tree with the given limit file content.
func fakeCgroup(t *testing.T, v2 bool, limit string) (string, string) {
	t.Helper()
	dir := t.TempDir()
	self := filepath.Join(dir, "cgroup")
	root := filepath.Join(dir, "fs")
	var line, file string
	if v2 {
		line, file = "0::/kubepods/pod1/c1\n", filepath.Join(root, "kubepods/pod1/c1/memory.max")
	} else {
		line, file = "4:memory:/kubepods/pod1/c1\n3:cpu:/\n", filepath.Join(root, "memory/kubepods/pod1/c1/memory.limit_in_bytes")
	}
	require.NoError(t, os.WriteFile(self, []byte(line), 0o644))
	require.NoError(t, os.MkdirAll(filepath.Dir(file), 0o755))
	require.NoError(t, os.WriteFile(file, []byte(limit+"\n"), 0o644))
	return self, root
}

func TestCgroupMemoryLimit(t *testing.T) {
	for _, tc := range []struct {
		v2    bool
		limit string
		want  int64
	}{
		{true, "8589934592", 8 << 30},
		{true, "max", 0},
		{false, "4294967296", 4 << 30},
		{false, "9223372036854771712", 0}, // v1's "no limit"
	} {
		self, root := fakeCgroup(t, tc.v2, tc.limit)
		assert.Equal(t, tc.want, cgroupMemoryLimit(self, root), "v2 %v limit %s", tc.v2, tc.limit)
	}
	// In a cgroup namespace the path is "/" and the limit sits at the root.
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "cgroup"), []byte("0::/\n"), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "memory.max"), []byte("1073741824\n"), 0o644))
	assert.Equal(t, int64(1<<30), cgroupMemoryLimit(filepath.Join(dir, "cgroup"), dir))
}

// --memory above what the machine or the container has is refused, saying which.
func TestBudgetChecks(t *testing.T) {
	l := MemoryLimits{Machine: 16 << 30, Cgroup: 4 << 30}
	assert.NoError(t, l.CheckBudget(2<<30))
	err := l.CheckBudget(8 << 30)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "cgroup limit (4GiB")
	err = l.CheckBudget(32 << 30)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "this machine's memory (16GiB)")
	assert.Equal(t, int64(2<<30), l.DefaultBudget(), "half of the container's limit")
	assert.Equal(t, int64(8<<30), MemoryLimits{Machine: 16 << 30}.DefaultBudget())
}

func TestGoMemoryLimit(t *testing.T) {
	if os.Getenv("GOMEMLIMIT") != "" {
		t.Skip("GOMEMLIMIT is set in the environment")
	}
	defer debug.SetMemoryLimit(debug.SetMemoryLimit(-1))
	l := MemoryLimits{Machine: 16 << 30, Cgroup: 4 << 30}
	got, why, err := l.SetGoMemoryLimit("auto", 2<<30)
	require.NoError(t, err)
	assert.Equal(t, int64(2<<30)/10*9, got, why)
	assert.Equal(t, got, debug.SetMemoryLimit(-1))
	got, _, err = MemoryLimits{Machine: 16 << 30}.SetGoMemoryLimit("auto", 2<<30)
	require.NoError(t, err)
	assert.Zero(t, got, "no cgroup limit: none")
	_, _, err = l.SetGoMemoryLimit("auto", 4<<30-10<<20)
	require.Error(t, err)
	assert.True(t, strings.Contains(err.Error(), "leaves less than 64MiB"), err)
	got, _, err = l.SetGoMemoryLimit("512MiB", 2<<30)
	require.NoError(t, err)
	assert.Equal(t, int64(512<<20), got)
	_, _, err = l.SetGoMemoryLimit("lots", 2<<30)
	require.Error(t, err)
	_, _, err = l.SetGoMemoryLimit("1KiB", 2<<30)
	require.ErrorContains(t, err, "--go-memory-limit 1KiB is less than the agent's own heap needs (at least 32.0MiB)")
}

// TestFormatSize: sizes print short; a GiB count exactly when it is short (a budget as given).
func TestFormatSize(t *testing.T) {
	for n, want := range map[int64]string{
		512:            "512B",
		1536:           "1.5KiB",
		64 << 20:       "64.0MiB",
		8 << 30:        "8GiB",
		3 << 29:        "1.5GiB",
		1<<30 + 1<<28:  "1.25GiB",
		4299227136:     "4100.1MiB", // 4.00384521484375GiB, as status once printed it; "4.00GiB" looks whole
		1<<30 + 11<<20: "1.01GiB",
		2_000_000_000:  "1.86GiB",
		25276200000:    "23.54GiB",
	} {
		if got := FormatSize(n); got != want {
			t.Errorf("FormatSize(%d) = %q, want %q", n, got, want)
		}
	}
}
