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

func newFlagSet(name, synopsis string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {
		fmt.Fprintf(os.Stderr, "Usage: %s\n\nFlags:\n", synopsis)
		fs.SetOutput(os.Stderr)
		fs.PrintDefaults()
		fs.SetOutput(io.Discard)
	}
	return fs
}

// flagError prints a flag problem with the command's usage and returns exit status 2.
func flagError(fs *flag.FlagSet, err error) int {
	if err == flag.ErrHelp {
		fs.Usage()
		return 0
	}
	fmt.Fprintf(os.Stderr, "mtcfs %s: %s\n", fs.Name(), strings.TrimSpace(err.Error()))
	fs.Usage()
	return 2
}

// flagSet reports whether the command line gave the flag name.
func flagSet(fset *flag.FlagSet, name string) bool {
	set := false
	fset.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}
