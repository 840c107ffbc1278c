// Command mtcfs is the multi-tier checkpointing agent: one process per node mounts a FUSE
// filesystem at the job's CHECKPOINT_DIR and keeps checkpoints in RAM. This package only turns
// flags into configuration and wires the packages together; signals are handled here and
// nowhere else.
package main

import (
	"fmt"
	"os"
	"runtime/debug"
	"runtime/pprof"
)

const usage = `mtcfs — multi-tier checkpointing filesystem

Usage:
  mtcfs mount DIR [--backup URL] [--backup-compress auto|off] [--memory SIZE] [--spool DIR] [--passthrough auto|on|off]
                  [--listen HOST:PORT] [--advertise HOST:PORT] [--peers RANK=HOST:PORT,...]
                  [--peer-secret-file F] [--peer-tls-cert F --peer-tls-key F --peer-tls-ca F] [--peer-compress auto|on|off]
                  [--rank N --jax-coordinator HOST:PORT] [--http HOST:PORT] [--log-format json|text]
                  [--xattrs] [--debug-fuse] [--drain-timeout DURATION] [--takeover-after DURATION] [--go-memory-limit auto|off|SIZE]
                  [--heap-huge-pages SIZE|off]
                  [--uid N --gid N --mode OCTAL]
  mtcfs status [DIR] [--http HOST:PORT] [--json]
  mtcfs backups list|verify [NAME] --backup URL --job NAME
  mtcfs backups export NAME DIR --backup URL --job NAME   a backup's plain files, for other tools
  mtcfs backups delete NAME --backup URL --job NAME [--force]   remove an INCOMPLETE backup
  mtcfs restore-version set NAME|clear --backup URL --job NAME
                                          (backups and restore-version: --timeout DURATION gives up after that long)
  mtcfs spool list [--json]               kept RAM spools: mount path, job, steps, bytes, agent
  mtcfs spool free PATH|--orphaned        free a mount's (or a spool directory's) kept spool,
                                          or every spool whose mount directory is gone
  mtcfs version

Run "mtcfs COMMAND --help" for the flags of a command.
`

// version is set at build time with -ldflags "-X main.version=..."; otherwise main completes it
// from what the Go toolchain recorded (vcsVersion), so that a log or a bug report names the
// build.
var version = "dev"

func main() {
	version = vcsVersion(version)
	os.Exit(profiled(func() int { return run(os.Args[1:]) }))
}

// vcsVersion completes the default version "dev" with the module version the build recorded:
// v1.2.3 for `go install …@v1.2.3`, and in a git checkout (Go 1.24 and later) a pseudo-version
// naming the commit, with "+dirty" for a tree with changes; nothing with -buildvcs=false.
func vcsVersion(v string) string {
	info, ok := debug.ReadBuildInfo()
	return versionFrom(v, info, ok)
}

func versionFrom(v string, info *debug.BuildInfo, ok bool) string {
	if v != "dev" || !ok {
		return v
	}
	if mv := info.Main.Version; mv != "" && mv != "(devel)" {
		return mv
	}
	return v
}

// profiled runs f with a CPU profile written to $MTCFS_CPUPROFILE.<pid> when that variable is
// set (for benchmarks that run agents as children; not a supported interface).
func profiled(f func() int) int {
	p := os.Getenv("MTCFS_CPUPROFILE")
	if p == "" {
		return f()
	}
	out, err := os.Create(fmt.Sprintf("%s.%d", p, os.Getpid()))
	if err != nil {
		fmt.Fprintln(os.Stderr, "mtcfs: MTCFS_CPUPROFILE:", err)
		return f()
	}
	defer out.Close()
	if err := pprof.StartCPUProfile(out); err != nil {
		fmt.Fprintln(os.Stderr, "mtcfs: MTCFS_CPUPROFILE:", err)
		return f()
	}
	defer pprof.StopCPUProfile()
	return f()
}

func run(args []string) int {
	if len(args) == 0 {
		fmt.Fprint(os.Stderr, usage)
		return 2
	}
	switch args[0] {
	case "mount":
		return cmdMount(args[1:])
	case "status":
		return cmdStatus(args[1:])
	case "backups":
		return cmdBackups(args[1:])
	case "restore-version":
		return cmdRestoreVersion(args[1:])
	case "spool":
		return cmdSpool(args[1:])
	case "version", "--version":
		fmt.Println("mtcfs", version)
		return 0
	case "help", "-h", "--help":
		fmt.Print(usage)
		return 0
	}
	fmt.Fprintf(os.Stderr, "mtcfs: unknown command %q\n\n%s", args[0], usage)
	return 2
}
