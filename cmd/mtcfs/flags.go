package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"
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

// usages prints each flag set's usage (its synopsis, and with all, every flag). The flag
// package calls a set's Usage itself when it fails to parse: that one prints nothing, so that
// flagError prints the usage once, with the problem last (it was printed between two copies of
// the usage, 111 lines for mount).
var usages = map[*flag.FlagSet]func(all bool){}

func newFlagSet(name, synopsis string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	usages[fs] = func(all bool) {
		fmt.Fprintf(os.Stderr, "Usage: %s\n", synopsis)
		if !all {
			fmt.Fprintf(os.Stderr, "(mtcfs %s --help describes the flags)\n", fs.Name())
			return
		}
		fmt.Fprintf(os.Stderr, "\nFlags:\n")
		fs.SetOutput(os.Stderr)
		fs.PrintDefaults()
		fs.SetOutput(io.Discard)
	}
	return fs
}

// flagError prints a flag problem after the command's synopsis and returns exit status 2; for
// --help, the usage with every flag, and 0. (A bad value printed every flag first, 55 lines for
// mount, the problem below them: found by a review.)
func flagError(fs *flag.FlagSet, err error) int {
	usages[fs](err == flag.ErrHelp)
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

// subcommandUsage answers a command given no subcommand, or one it does not know: the synopsis,
// and exit 0 for a request of help, else the word it did not know and exit 2. (An unknown word
// printed the synopsis alone, and --help of backups and restore-version exited 2, of spool 0.)
func subcommandUsage(cmd, synopsis string, args []string) int {
	fmt.Fprintf(os.Stderr, "Usage: %s\n(mtcfs %s SUBCOMMAND --help describes its flags)\n", synopsis, cmd)
	switch {
	case len(args) == 0:
		fmt.Fprintf(os.Stderr, "\nmtcfs %s: a subcommand is needed\n", cmd)
		return 2
	case args[0] == "-h" || args[0] == "--help" || args[0] == "-help" || args[0] == "help":
		return 0
	default:
		fmt.Fprintf(os.Stderr, "\nmtcfs %s: unknown subcommand %q\n", cmd, args[0])
		return 2
	}
}

// durationValue is a flag.Value for a duration whose parse error says what is wanted: the flag
// package's own said only "parse error" for "--drain-timeout 30" (a black-box run).
type durationValue struct{ d *time.Duration }

func (v durationValue) String() string {
	if v.d == nil {
		return "0s" // the zero value's: a default of 0 is not printed
	}
	return v.d.String()
}

func (v durationValue) Set(s string) error {
	d, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("%q is not a duration: want a number with a unit (ms, s, m, h), e.g. 30s or 2m", s)
	}
	*v.d = d
	return nil
}

// durationFlag defines a duration flag with durationValue's errors.
func durationFlag(fs *flag.FlagSet, name string, def time.Duration, usage string) *time.Duration {
	d := def
	fs.Var(durationValue{&d}, name, usage)
	return &d
}
