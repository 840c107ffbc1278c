package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
)

// parseFlags parses flags that may appear before, between or after positional arguments
// ("mtcfs mount ./ckpt --memory 2GiB" and "mtcfs mount --memory 2GiB ./ckpt" both work).
func parseFlags(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		args = fs.Args()
		if len(args) == 0 {
			return pos, nil
		}
		if args[0] == "--" {
			return append(pos, args[1:]...), nil
		}
		pos = append(pos, args[0])
		args = args[1:]
	}
}

// usages prints each flag set's usage. The flag package calls a set's Usage itself when it
// fails to parse: that one prints nothing, so that flagError prints the usage once, with the
// problem last (it was printed between two copies of the usage, 111 lines for mount).
var usages = map[*flag.FlagSet]func(){}

func newFlagSet(name, synopsis string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	usages[fs] = func() {
		fmt.Fprintf(os.Stderr, "Usage: %s\n\nFlags:\n", synopsis)
		fs.SetOutput(os.Stderr)
		fs.PrintDefaults()
		fs.SetOutput(io.Discard)
	}
	return fs
}

// flagError prints a flag problem after the command's usage and returns exit status 2.
func flagError(fs *flag.FlagSet, err error) int {
	usages[fs]()
	if err == flag.ErrHelp {
		return 0
	}
	fmt.Fprintf(os.Stderr, "\nmtcfs %s: %s\n", fs.Name(), strings.TrimSpace(err.Error()))
	return 2
}

// flagSet reports whether the command line gave the flag name.
func flagSet(fset *flag.FlagSet, name string) bool {
	set := false
	fset.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}
