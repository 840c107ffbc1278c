package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	mfs "github.com/mtcfs/mtcfs/fs"
	"github.com/mtcfs/mtcfs/tiers"
)

const mountSynopsis = "mtcfs mount DIR [--memory SIZE] [--spool DIR] [--passthrough auto|on|off] [--http HOST:PORT] [--log-format json|text]"

type mountConfig struct {
	dir         string
	budget      int64
	spoolDir    string
	passthrough mfs.PassthroughMode
	httpAddr    string
	debugFuse   bool
}

func cmdMount(args []string) int {
	fset := newFlagSet("mount", mountSynopsis)
	memory := fset.String("memory", "", "RAM budget for checkpoint bytes, e.g. 512MiB, 8GiB, 2G or bytes (default: half of physical memory)")
	spoolDir := fset.String("spool", "", "spool directory holding checkpoint bytes (default: derived from DIR, under /dev/shm/mtcfs)")
	passthrough := fset.String("passthrough", "auto", "FUSE passthrough for file data: auto, on or off")
	httpAddr := fset.String("http", "", "serve /livez and /readyz on HOST:PORT (port 0 picks a free port)")
	logFormat := fset.String("log-format", "text", "log format: json (keys severity, message) or text")
	debugFuse := fset.Bool("debug-fuse", false, "log every FUSE request (very verbose)")
	pos, err := parseFlags(fset, args)
	if err != nil {
		return flagError(fset, err)
	}
	logger, err := newLogger(os.Stderr, *logFormat)
	if err != nil {
		return flagError(fset, err)
	}
	slog.SetDefault(logger)
	if len(pos) != 1 {
		return flagError(fset, fmt.Errorf("want exactly one mount directory, got %d arguments", len(pos)))
	}
	cfg := mountConfig{dir: pos[0], spoolDir: *spoolDir, httpAddr: *httpAddr, debugFuse: *debugFuse}
	if cfg.passthrough, err = mfs.ParsePassthroughMode(*passthrough); err != nil {
		return flagError(fset, err)
	}
	if *memory == "" {
		cfg.budget = defaultBudget()
	} else if cfg.budget, err = tiers.ParseSize(*memory); err != nil {
		return flagError(fset, fmt.Errorf("--memory: %w", err))
	}
	if cfg.spoolDir == "" {
		cfg.spoolDir = tiers.DefaultSpoolDir(cfg.dir)
	}
	if err := runMount(cfg); err != nil {
		slog.Error("mtcfs mount failed", "err", err)
		fmt.Fprintf(os.Stderr, "mtcfs mount: %v\n", err)
		return 1
	}
	return 0
}

// defaultBudget is half of physical memory, what a default tmpfs gets.
func defaultBudget() int64 {
	var si unix.Sysinfo_t
	if unix.Sysinfo(&si) != nil {
		return 1 << 30
	}
	return int64(si.Totalram) * int64(si.Unit) / 2
}

func runMount(cfg mountConfig) error {
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sigs)

	if detached, err := mfs.DetachStale(cfg.dir); err != nil {
		return err
	} else if detached {
		slog.Warn("detached a stale mount left by an agent that died", "dir", cfg.dir)
	}
	if err := mfs.CheckMountable(cfg.dir); err != nil {
		return err
	}
	spool, err := tiers.OpenSpool(tiers.SpoolConfig{Dir: cfg.spoolDir, Budget: cfg.budget, MountTmpfs: os.Geteuid() == 0})
	if err != nil {
		return err
	}
	defer func() {
		if err := spool.Close(); err != nil {
			slog.Error("release spool", "err", err)
		}
	}()

	var ready atomic.Bool
	if cfg.httpAddr != "" {
		stop, err := serveHealth(cfg.httpAddr, &ready)
		if err != nil {
			return err
		}
		defer stop()
	}

	srv, err := mfs.Mount(cfg.dir, mfs.Options{Spool: spool, Passthrough: cfg.passthrough, Debug: cfg.debugFuse})
	if err != nil {
		return err
	}
	ready.Store(true)
	slog.Info("serving; stop with SIGINT or SIGTERM", "dir", srv.Dir(), "version", version)

	done := make(chan struct{})
	go func() { srv.Wait(); close(done) }()
	select {
	case sig := <-sigs:
		ready.Store(false)
		slog.Info("stopping", "signal", sig.String())
		if err := unmountBounded(srv, sigs); err != nil {
			return err
		}
	case <-done:
		slog.Warn("filesystem was unmounted from outside; exiting", "dir", srv.Dir())
	}
	slog.Info("unmounted", "dir", srv.Dir())
	return nil
}

// unmountBounded unmounts, retrying while the mount is busy for a few seconds; a second signal
// or the deadline detaches it lazily instead.
func unmountBounded(srv *mfs.Server, sigs <-chan os.Signal) error {
	errc := make(chan error, 1)
	go func() { errc <- srv.Unmount() }()
	select {
	case err := <-errc:
		return err
	case <-sigs:
		return errors.New("second signal: exiting without waiting for the unmount")
	case <-time.After(30 * time.Second):
		return errors.New("unmount did not finish within 30s")
	}
}

// serveHealth serves /livez (the process runs) and /readyz (the filesystem is mounted).
func serveHealth(addr string, ready *atomic.Bool) (stop func(), err error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("--http %s: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/livez", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, r *http.Request) {
		if !ready.Load() {
			http.Error(w, "not mounted", http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	hs := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go hs.Serve(ln)
	slog.Info("http endpoints", "addr", ln.Addr().String(), "paths", "/livez /readyz")
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		hs.Shutdown(ctx)
	}, nil
}
