package main

import (
	"flag"
	"io"
	"testing"
)

// Without --heap-huge-pages, a Go memory limit (a container's) caps the marked heap at a
// quarter of it; a given value stands as given.
func TestDefaultHeapHugePages(t *testing.T) {
	for _, c := range []struct{ def, goLimit, want int64 }{
		{128 << 20, 0, 128 << 20},
		{128 << 20, 8 << 30, 128 << 20},
		{128 << 20, 256 << 20, 64 << 20},
		{128 << 20, 4 << 20, 1 << 20},
	} {
		if got := defaultHeapHugePages(c.def, c.goLimit); got != c.want {
			t.Errorf("defaultHeapHugePages(%d, %d) = %d, want %d", c.def, c.goLimit, got, c.want)
		}
	}
	for _, c := range []struct {
		args []string
		want bool
	}{
		{nil, false},
		{[]string{"dir"}, false},
		{[]string{"dir", "--heap-huge-pages", "128MiB"}, true},
		{[]string{"--heap-huge-pages=off", "dir"}, true},
	} {
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		fs.String("heap-huge-pages", "128MiB", "")
		if _, err := parseFlags(fs, c.args); err != nil {
			t.Fatal(err)
		}
		if got := flagSet(fs, "heap-huge-pages"); got != c.want {
			t.Errorf("flagSet after %q = %v, want %v", c.args, got, c.want)
		}
	}
}
