package main

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	mfs "github.com/mtcfs/mtcfs/fs"
)

// repeatWindow is how soon after the first stop signal the same signal counts as part of the
// same request to stop rather than as a second one. Some senders deliver one stop twice: GNU
// timeout(1) signals the command and then its whole process group, which holds the command, so
// the agent gets two SIGTERMs microseconds apart. A person pressing Ctrl-C again to force the
// exit does so later than this.
const repeatWindow = 500 * time.Millisecond

// stopSignal is a SIGINT, SIGTERM or SIGHUP with the time it arrived.
type stopSignal struct {
	sig os.Signal
	at  time.Time
}

// notifyStop delivers SIGINT, SIGTERM and SIGHUP, each stamped when it arrived (a signal may
// wait in the channel while the agent stops its replicator); stop ends the delivery.
//
// SIGHUP (the terminal of an agent started by hand was closed, an ssh session dropped) stops the
// agent as SIGTERM does; before, it killed the agent where it stood, leaving a dead mount. And
// SIGPIPE is caught and dropped, so that a write to a log pipe whose reader went away (a
// journald restart, `mtcfs mount … 2>&1 | head`, a tee stopped by Ctrl-C) fails instead of
// ending the agent the same way: Go exits on SIGPIPE from a write to fd 1 or 2 unless the
// program asks for the signal. (Caught, not ignored: an ignored signal would stay ignored in the
// processes the agent starts.)
func notifyStop() (sigs <-chan stopSignal, stop func()) {
	pipes := make(chan os.Signal, 1) // never read: a full channel drops the signal
	signal.Notify(pipes, syscall.SIGPIPE)
	raw := make(chan os.Signal, 4)
	signal.Notify(raw, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	out := make(chan stopSignal, 4)
	done := make(chan struct{})
	go func() {
		for {
			select {
			case s := <-raw:
				select {
				case out <- stopSignal{sig: s, at: time.Now()}:
				default: // four are waiting already: the agent is stopping
				}
			case <-done:
				return
			}
		}
	}()
	return out, func() {
		signal.Stop(raw) // SIGPIPE stays caught: the last log lines are written after this
		close(done)
	}
}

// unmounter is what unmountBounded stops: the mount (mfs.Server).
type unmounter interface {
	Stop(giveUp <-chan struct{}) error
}

// stopWait bounds how long a stop waits for the processes that use the mount.
const stopWait = 30 * time.Second

// unmountBounded unmounts, trying again while the mount is in use, for up to stopWait; a second
// signal (not a repeat of the first within repeatWindow) or the deadline gives up: the mount is
// then left in place, unserved (see mfs.Server.Stop), and the agent exits 1.
func unmountBounded(srv unmounter, sigs <-chan stopSignal, first stopSignal) error {
	giveUp := make(chan struct{})
	errc := make(chan error, 1)
	go func() { errc <- srv.Stop(giveUp) }()
	deadline := time.After(stopWait)
	var why string
	for why == "" {
		select {
		case err := <-errc:
			return err
		case s := <-sigs:
			if sameStop(first, s) {
				slog.Info("repeated stop signal ignored", "signal", s.sig.String(), "after", s.at.Sub(first.at).String())
				continue
			}
			why = "second signal: exiting without waiting for the processes that use the mount"
		case <-deadline:
			why = fmt.Sprintf("the mount was still in use after %v", stopWait)
		}
	}
	close(giveUp)
	switch err := <-errc; {
	case err == nil:
		return nil // unmounted as the stop gave up: its users left at that moment
	case errors.Is(err, mfs.ErrDetachedOutside):
		return fmt.Errorf("%s: %w", why, err)
	case !errors.Is(err, mfs.ErrLeftInPlace):
		return fmt.Errorf("%s; unmount: %w", why, err)
	}
	return fmt.Errorf("%s: it is left in place, unserved (its users get \"Transport endpoint is not connected\"), so that nothing lands in the directory below it; the next agent started on it detaches it and serves, or umount -l (fusermount3 -u -z as a user) removes it; a shell whose working directory is in it must cd out by an absolute path", why)
}

// sameStop reports whether s repeats first: the same signal, within repeatWindow.
func sameStop(first, s stopSignal) bool {
	return s.sig == first.sig && s.at.Sub(first.at) < repeatWindow
}
