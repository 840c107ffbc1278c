package benchkit

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"slices"
)

// Main runs a bench program once its flags are parsed: a usage problem (invalid, or arguments
// left after the flags) exits with 2, an error of run with 1, each printed as "prog: …". The
// context run gets is cancelled by SIGINT or SIGTERM (CancelOnSignal), after which run is to
// stop its agents and unmount.
func Main(prog string, invalid error, run func(ctx context.Context) error) {
	if invalid == nil && flag.NArg() != 0 {
		invalid = fmt.Errorf("unexpected arguments %q", flag.Args())
	}
	if invalid != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", prog, invalid)
		os.Exit(2)
	}
	ctx, stop := CancelOnSignal(prog)
	err := run(ctx)
	stop()
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", prog, err)
		os.Exit(1)
	}
}

// RequireRoot is the error of a program that must run as root, nil for root.
func RequireRoot(why string) error {
	if os.Geteuid() != 0 {
		return errors.New("run as root: " + why)
	}
	return nil
}

// A Workspace is what a bench run sets up: temporary directories, the agents started in them and
// other things to undo (a tmpfs mount). Close undoes them all. Its methods are for one goroutine.
type Workspace struct {
	dirs    []string
	closers []func() error // undone last first
}

// TempDir creates a new directory in parent (os.MkdirTemp) that Close removes.
func (w *Workspace) TempDir(parent, pattern string) (string, error) {
	dir, err := os.MkdirTemp(parent, pattern)
	if err == nil {
		w.dirs = append(w.dirs, dir)
	}
	return dir, err
}

// StartAgent starts an agent (StartAgent) that Close stops, unless it was killed.
func (w *Workspace) StartAgent(ctx context.Context, cfg AgentConfig) (*Agent, error) {
	a, err := StartAgent(ctx, cfg)
	if err == nil {
		w.Defer(a.Stop)
	}
	return a, err
}

// Defer has Close call undo, before what was set up earlier is undone.
func (w *Workspace) Defer(undo func() error) { w.closers = append(w.closers, undo) }

// Close stops the agents and undoes the rest, last set up first, then detaches whatever is
// still mounted below the directories (innermost first; an error, since something was left
// behind) and removes them unless something could not be detached: removing through a live
// mount would delete its files. It may be called more than once.
func (w *Workspace) Close() error {
	var errs []error
	for i := len(w.closers) - 1; i >= 0; i-- {
		errs = append(errs, w.closers[i]())
	}
	w.closers = nil
	for i := len(w.dirs) - 1; i >= 0; i-- {
		left := MountsUnder(w.dirs[i])
		slices.Reverse(left)
		for _, m := range left {
			errs = append(errs, fmt.Errorf("%s was still mounted at the end", m), Unmount(m))
		}
		errs = append(errs, RemoveAllUnlessMounted(w.dirs[i]))
	}
	w.dirs = nil
	return errors.Join(errs...)
}
