package benchkit

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

// CancelOnSignal returns a context that SIGINT or SIGTERM cancels, saying so on stderr as prog.
// Later signals are swallowed until stop, so that a second Ctrl-C cannot kill the program while
// it stops its agents and unmounts.
func CancelOnSignal(prog string) (ctx context.Context, stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		select {
		case s := <-sigs:
			fmt.Fprintf(os.Stderr, "\n%s: %v: stopping the agents and unmounting\n", prog, s)
			cancel()
		case <-ctx.Done():
		}
	}()
	return ctx, func() {
		cancel()
		signal.Stop(sigs)
	}
}
