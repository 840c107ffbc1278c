package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	mfs "github.com/mtcfs/mtcfs/fs"
	"github.com/mtcfs/mtcfs/gcsbackend"
	"github.com/mtcfs/mtcfs/internal/agents"
	"github.com/mtcfs/mtcfs/internal/fusectl"
	"github.com/mtcfs/mtcfs/replication"
	"github.com/mtcfs/mtcfs/tiers"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/sys/unix"
)

const mountSynopsis = "mtcfs mount DIR [--backup URL] [--backup-compress auto|off] [--listen HOST:PORT] [--advertise HOST:PORT] [--peers 0=HOST:PORT,1=HOST:PORT,...] [--peer-secret-file F] [--peer-tls-cert F --peer-tls-key F --peer-tls-ca F] [--peer-compress auto|on|off] [--memory SIZE] [--spool DIR] [--passthrough auto|on|off] [--rank N --jax-coordinator HOST:PORT] [--http HOST:PORT] [--log-format json|text] [--xattrs] [--debug-fuse] [--drain-timeout DURATION] [--takeover-after DURATION] [--go-memory-limit auto|off|SIZE] [--heap-huge-pages SIZE|off] [--uid N --gid N --mode OCTAL]"

type mountConfig struct {
	dir           string
	budget        int64
	spoolDir      string
	spoolDefault  bool // spoolDir is the default one, not --spool
	passthrough   mfs.PassthroughMode
	httpAddr      string
	debugFuse     bool
	xattrs        bool
	backupURL     string
	compress      gcsbackend.Compression
	jaxInit       *tiers.JaxInit
	listen        string
	advertise     string
	peers         replication.Discovery // --peers; nil: the registry
	lagTimeout    time.Duration
	sealDelay     time.Duration
	restoreWait   time.Duration
	yamlHeldWait  time.Duration
	secretFile    string
	peerTLS       *replication.TLSConfigs
	peerCompress  replication.Compression
	drain         time.Duration
	takeover      time.Duration
	heapHugePages int64 // --heap-huge-pages: bytes of the Go heap to mark, 0: off
	owner         mfs.RootOwner
}

// parseOwner turns --uid, --gid and --mode (-1 and "": not given) into the mount root's owner.
func parseOwner(uid, gid int, mode string) (mfs.RootOwner, error) {
	var o mfs.RootOwner
	for _, f := range []struct {
		name string
		v    int
		dst  **uint32
	}{{"--uid", uid, &o.UID}, {"--gid", gid, &o.GID}} {
		switch {
		case f.v == -1:
		case f.v < 0 || f.v > 1<<32-2:
			return o, fmt.Errorf("%s %d: want a numeric id from 0 to 4294967294", f.name, f.v)
		default:
			v := uint32(f.v)
			*f.dst = &v
		}
	}
	if mode != "" {
		m, err := strconv.ParseUint(mode, 8, 32)
		if err != nil || m > 0o7777 {
			return o, fmt.Errorf("--mode %q: want octal permission bits such as 0755 or 0770", mode)
		}
		v := uint32(m)
		o.Mode = &v
	}
	return o, nil
}

// syncLagTimeoutEnv overrides the coordinator's sync lag timeout (replication.DefaultLagTimeout),
// e.g. "5s". Hidden: tests use it to see a partitioned node's step fail its sync quickly.
const syncLagTimeoutEnv = "MTCFS_SYNC_LAG_TIMEOUT"

// sealDelayEnv delays the sealing of each committed step, e.g. "2s". Hidden: tests use it to
// kill -9 the agent between a commit and its seal without depending on timing.
const sealDelayEnv = "MTCFS_SEAL_DELAY"

// yamlHeldWaitEnv overrides how long a replicator.yaml held open for writing waits before it is
// answered as it is (30 s), e.g. "1s". Hidden: tests use it.
const yamlHeldWaitEnv = "MTCFS_YAML_HELD_WAIT"

// restoreWaitEnv overrides how long after its handshake an Orbax job is taken to wait for its
// restore markers (tiers.DefaultRestoreWait), e.g. "20s". Hidden: tests use it to see the
// notice of an agent restarted in that window withdrawn.
const restoreWaitEnv = "MTCFS_RESTORE_WAIT"

func cmdMount(args []string) int {
	fset := newFlagSet("mount", mountSynopsis)
	memory := fset.String("memory", "", "RAM budget for checkpoint bytes, e.g. 512MiB, 8GiB, 2G or bytes (default: half of physical memory)")
	spoolDir := fset.String("spool", "", "spool directory holding checkpoint bytes (default: derived from DIR, under /dev/shm/mtcfs)")
	passthrough := fset.String("passthrough", "auto", "FUSE passthrough for file data: auto, on or off")
	httpAddr := fset.String("http", "127.0.0.1:0", "serve /livez, /readyz, /status (for mtcfs status) and /metrics (Prometheus) on HOST:PORT (port 0 picks a free port; \"\" turns it off)")
	backup := fset.String("backup", gcsbackend.DefaultURL(), "backup location: file:///abs/dir or gs://bucket[/prefix]")
	peerCompress := replication.CompressAuto
	fset.Var(&peerCompress, "peer-compress", "compress checkpoint chunks sent to peers: auto (only when the link to a peer is measured slower than this machine's codec; loopback and fast NICs stay uncompressed), on or off (default auto)")
	compress := fset.String("backup-compress", "off", "backup data: auto stores files compressed where that pays (float tensors; Orbax cannot open such objects directly, see mtcfs backups export), off keeps every object as the job wrote it; use the same on every agent of a job")
	rank := fset.Int("rank", -1, "this node's rank, written to jax-init-info.txt with --jax-coordinator")
	jaxCoord := fset.String("jax-coordinator", "", "JAX coordinator HOST:PORT for jax-init-info.txt (with --rank)")
	listen := fset.String("listen", "127.0.0.1:0", "peer service address HOST:PORT, registered in the backup location for the other agents of a job (port 0 picks one)")
	advertise := fset.String("advertise", "", "peer service address HOST:PORT registered for the other agents, when it differs from --listen (NAT, proxies) (default: the --listen address as bound)")
	peers := fset.String("peers", "", "static peer addresses RANK=HOST:PORT,... used instead of discovery through the backup location (the registry is still written)")
	secretFile := fset.String("peer-secret-file", "", "file holding the job's shared secret for peer calls (default: one created in the backup location)")
	tlsCert := fset.String("peer-tls-cert", "", "PEM certificate (chain) of this agent for mutual TLS between peers (with --peer-tls-key and --peer-tls-ca; usable as TLS server and client)")
	tlsKey := fset.String("peer-tls-key", "", "PEM private key of --peer-tls-cert")
	tlsCA := fset.String("peer-tls-ca", "", "PEM certificate(s) of the job's CA: peers must present a certificate it signed; server names are not checked (default: no TLS, plain TCP with per-call MACs)")
	logFormat := fset.String("log-format", "text", "log format: json (keys severity, message) or text")
	debugFuse := fset.Bool("debug-fuse", false, "log every FUSE request (very verbose)")
	xattrs := fset.Bool("xattrs", false, "support extended attributes (costs a round trip to the agent per write)")
	uid := fset.Int("uid", -1, "owner of the mount root (default: the mount point directory's owner)")
	gid := fset.Int("gid", -1, "group of the mount root (default: the mount point directory's group)")
	mode := fset.String("mode", "", "permission bits of the mount root in octal, e.g. 0770 (default: the mount point directory's)")
	hugeHeap := fset.String("heap-huge-pages", "128MiB", "how much of the agent's Go heap asks the kernel for transparent huge pages (a restart builds its metadata, some 1 KB per adopted file, in fresh memory; 4 KiB page faults were a sixth of its CPU): a size, or off; resident memory may exceed the Go runtime's count by up to that much; without the flag, a quarter of the Go memory limit where that is less")
	goMem := fset.String("go-memory-limit", "auto", "the Go runtime's soft memory limit: auto (90% of what a memory cgroup limit leaves beside --memory; none without one), off, or a size; GOMEMLIMIT wins")
	drain := durationFlag(fset, "drain-timeout", tiers.DefaultDrainTimeout, "on SIGTERM/SIGINT, the `duration` a running backup may take to finish before it is cut short (left incomplete, retried by the next agent)")
	takeover := durationFlag(fset, "takeover-after", mfs.DefaultTakeoverAfter, "the `duration` a mount already at DIR may leave a request unanswered before it is taken over (its connection aborted, as root) when no mtcfs mount process for DIR runs")
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
	if pos[0] == "" {
		return flagError(fset, errors.New("the mount directory is empty (an unset variable?): give its path"))
	}
	if *drain < 0 {
		return flagError(fset, fmt.Errorf("--drain-timeout %v: want a duration ≥ 0, such as 30s", *drain))
	}
	if *drain == 0 {
		*drain = -1 // tiers reads 0 as "the default": 0s means no drain at all
	}
	if *takeover <= 0 {
		return flagError(fset, fmt.Errorf("--takeover-after %v: want a duration > 0, such as 30s", *takeover))
	}
	cfg := mountConfig{peerCompress: peerCompress, dir: pos[0], spoolDir: *spoolDir, httpAddr: *httpAddr, debugFuse: *debugFuse, backupURL: *backup, xattrs: *xattrs, listen: *listen, secretFile: *secretFile, drain: *drain, takeover: *takeover}
	if cfg.compress, err = gcsbackend.ParseCompression(*compress); err != nil {
		return flagError(fset, fmt.Errorf("--backup-compress: %w", err))
	}
	if cfg.owner, err = parseOwner(*uid, *gid, *mode); err != nil {
		return flagError(fset, err)
	}
	if os.Geteuid() != 0 && ((*uid >= 0 && *uid != os.Geteuid()) || (*gid >= 0 && *gid != os.Getegid()) || flagSet(fset, "mode")) {
		// Without root the mount has no allow_other: the kernel lets no other user in,
		// whatever the root's owner and mode say (found by a black-box run).
		slog.Warn("without root, only this user can use the mount (no allow_other): --uid, --gid and --mode change what the root shows, not who may enter; run the agent as root to serve another user's job",
			"uid", os.Geteuid())
	}
	switch {
	case flagSet(fset, "rank") && *rank < 0:
		return flagError(fset, fmt.Errorf("--rank %d: want a rank ≥ 0", *rank))
	case (*rank >= 0) != (*jaxCoord != ""):
		return flagError(fset, errors.New("--rank and --jax-coordinator go together"))
	case *rank >= 0:
		if _, _, err := net.SplitHostPort(*jaxCoord); err != nil {
			return flagError(fset, fmt.Errorf("--jax-coordinator %q: want HOST:PORT", *jaxCoord))
		}
		cfg.jaxInit = &tiers.JaxInit{Rank: *rank, Coordinator: *jaxCoord}
	}
	if *advertise != "" {
		if err := replication.CheckAddr(*advertise); err != nil {
			return flagError(fset, fmt.Errorf("--advertise %q: %w", *advertise, err))
		}
		cfg.advertise = *advertise
	}
	if *peers != "" {
		static, err := replication.ParseStaticPeers(*peers)
		if err != nil {
			return flagError(fset, fmt.Errorf("--peers: %w", err))
		}
		cfg.peers = static
	}
	if *tlsCert != "" || *tlsKey != "" || *tlsCA != "" {
		if *tlsCert == "" || *tlsKey == "" || *tlsCA == "" {
			return flagError(fset, errors.New("--peer-tls-cert, --peer-tls-key and --peer-tls-ca go together: give all three or none"))
		}
		tc, err := replication.LoadTLS(*tlsCert, *tlsKey, *tlsCA)
		if err != nil {
			return flagError(fset, fmt.Errorf("--peer-tls-*: %w", err))
		}
		cfg.peerTLS = &tc
	}
	if v := os.Getenv(syncLagTimeoutEnv); v != "" {
		if cfg.lagTimeout, err = time.ParseDuration(v); err != nil || cfg.lagTimeout <= 0 {
			return flagError(fset, fmt.Errorf("%s=%q: want a positive duration such as 30s", syncLagTimeoutEnv, v))
		}
	}
	if v := os.Getenv(sealDelayEnv); v != "" {
		if cfg.sealDelay, err = time.ParseDuration(v); err != nil || cfg.sealDelay <= 0 {
			return flagError(fset, fmt.Errorf("%s=%q: want a positive duration such as 2s", sealDelayEnv, v))
		}
	}
	if v := os.Getenv(yamlHeldWaitEnv); v != "" {
		if cfg.yamlHeldWait, err = time.ParseDuration(v); err != nil || cfg.yamlHeldWait <= 0 {
			return flagError(fset, fmt.Errorf("%s=%q: want a positive duration such as 1s", yamlHeldWaitEnv, v))
		}
	}
	if v := os.Getenv(restoreWaitEnv); v != "" {
		if cfg.restoreWait, err = time.ParseDuration(v); err != nil || cfg.restoreWait <= 0 {
			return flagError(fset, fmt.Errorf("%s=%q: want a positive duration such as 20s", restoreWaitEnv, v))
		}
	}
	if cfg.passthrough, err = mfs.ParsePassthroughMode(*passthrough); err != nil {
		return flagError(fset, err)
	}
	limits := tiers.ReadMemoryLimits("/proc/self/cgroup", "/sys/fs/cgroup")
	if *memory == "" {
		cfg.budget = limits.DefaultBudget()
	} else if cfg.budget, err = tiers.ParseSize(*memory); err != nil {
		return flagError(fset, fmt.Errorf("--memory: %w", err))
	}
	if err := limits.CheckBudget(cfg.budget); err != nil {
		return flagError(fset, err)
	}
	goLimit, why, err := limits.SetGoMemoryLimit(*goMem, cfg.budget)
	if err != nil {
		return flagError(fset, err)
	} else if goLimit > 0 {
		slog.Info("Go memory limit", "limit", tiers.FormatSize(goLimit), "from", why)
	}
	if *hugeHeap != "off" {
		if cfg.heapHugePages, err = tiers.ParseSize(*hugeHeap); err != nil {
			return flagError(fset, fmt.Errorf("--heap-huge-pages %q: want a size such as 128MiB, or off", *hugeHeap))
		}
		// The agent allocates that much address space at start: more than the machine has is a
		// typo, and would end the process in the runtime instead of here.
		if limits.Machine > 0 && cfg.heapHugePages > limits.Machine {
			return flagError(fset, fmt.Errorf("--heap-huge-pages %s: more than this machine's memory (%s)", *hugeHeap, tiers.FormatSize(limits.Machine)))
		}
		if !flagSet(fset, "heap-huge-pages") {
			cfg.heapHugePages = defaultHeapHugePages(cfg.heapHugePages, goLimit)
		}
	}
	if cfg.spoolDir == "" {
		cfg.spoolDir = tiers.DefaultSpoolDir(cfg.dir)
		cfg.spoolDefault = true
	}
	if err := runMount(cfg); err != nil {
		slog.Error("mtcfs mount failed", "err", err)
		if *logFormat != "json" { // a plain line among JSON ones breaks the operator's log parser
			fmt.Fprintf(os.Stderr, "mtcfs mount: %v\n", err)
		}
		return 1
	}
	return 0
}

// defaultHeapHugePages is --heap-huge-pages when it is not given: def, or a quarter of the Go
// memory limit (goLimit, 0: none) when that is less. The marked range may stay resident in
// whole huge pages; in a small container it must not take the room the limit leaves the heap.
func defaultHeapHugePages(def, goLimit int64) int64 {
	if goLimit > 0 {
		return min(def, goLimit/4)
	}
	return def
}

// readSecretFile reads --peer-secret-file ("": none, every job's secret is in the backup location).
func readSecretFile(file string) ([]byte, error) {
	if file == "" {
		return nil, nil
	}
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("--peer-secret-file: %w", err)
	}
	secret := []byte(strings.TrimSpace(string(data)))
	if len(secret) < 16 {
		return nil, fmt.Errorf("--peer-secret-file %s: the secret must be at least 16 bytes", file)
	}
	return secret, nil
}

// checkSpoolOfAnotherMount refuses a --spool that is the kept spool of another mount directory
// that still exists: its checkpoints are that mount's job's, and this agent would adopt or drop
// them (a black-box run: a mistyped --spool freed another job's only copy of its newest step at
// this job's start). A kept spool whose mount directory is gone is the documented way to take its
// checkpoints to another mount, and is served.
func checkSpoolOfAnotherMount(dir, spool string) error {
	o, state := tiers.OwnerMountState(spool)
	if o.MountPath == "" || o.MountPath == dir || state != tiers.MountExists {
		return nil
	}
	f, err := tiers.LockSpool(spool)
	if err != nil {
		return nil // in use (a live agent's: opening it says so) or unreadable: as before
	}
	f.Close()
	job := ""
	if o.Job != "" {
		job = fmt.Sprintf(" (job %s)", o.Job)
	}
	return fmt.Errorf("--spool %s is the kept spool of the mount directory %s%s, which still exists: its checkpoints are that mount's, and this agent would drop them; give this mount its own --spool (or none: the default is one per mount directory), or serve %s with it. To take its checkpoints to this mount on purpose, move or remove %s first",
		spool, o.MountPath, job, o.MountPath, o.MountPath)
}

func openBackups(url string) (*gcsbackend.Backups, error) {
	store, err := gcsbackend.Open(url)
	if err != nil && url == gcsbackend.DefaultURL() {
		// The user gave no --backup: the line named a flag they had not given, and not where
		// the default came from (black-box h57: HOME=/root for a non-root user).
		return nil, fmt.Errorf("the default backup location %s (--backup not given: it is $XDG_DATA_HOME/mtcfs/backups, or ~/.local/share/mtcfs/backups from $HOME) cannot be used: %w; give --backup file:///DIR (a directory the agent's user may write to) or gs://BUCKET", url, err)
	}
	if err != nil {
		return nil, fmt.Errorf("--backup %s: %w", url, err)
	}
	return &gcsbackend.Backups{Store: store}, nil
}

// lowFDLimit is the descriptor limit below which the agent warns at start. Go raises the soft
// limit to the hard one when the process starts, so only a low hard limit is reported.
const lowFDLimit = 16384

// warnLowFDLimit warns when the agent's descriptor limit is low: the agent holds a descriptor
// for every file open in the mount, so the limit caps how many the job can hold open at once
// (beyond it the job sees "Too many open files", fs logs why).
//
// As root it first raises a low limit, hard one included, to the system's ceiling
// (fs.nr_open, at most 1Mi): out of descriptors while the job held many files open, the agent
// could not record a commit (found by a black-box run with a limit of 256).
func warnLowFDLimit() {
	var rl unix.Rlimit
	if unix.Getrlimit(unix.RLIMIT_NOFILE, &rl) != nil {
		return
	}
	var raiseErr error
	if rl.Cur != unix.RLIM_INFINITY && rl.Cur < lowFDLimit && os.Geteuid() == 0 {
		ceiling := uint64(1 << 20)
		if b, err := os.ReadFile("/proc/sys/fs/nr_open"); err == nil {
			if n, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64); err == nil && n > 0 {
				ceiling = min(ceiling, n)
			}
		}
		if ceiling > rl.Cur {
			raised := unix.Rlimit{Cur: ceiling, Max: max(ceiling, rl.Max)}
			if raiseErr = unix.Setrlimit(unix.RLIMIT_NOFILE, &raised); raiseErr == nil {
				slog.Info("raised the agent's file descriptor limit: it holds one for each file open in the mount", "from", rl.Cur, "to", ceiling)
				rl = raised
			}
		}
	}
	if rl.Cur != unix.RLIM_INFINITY && rl.Cur < lowFDLimit {
		args := []any{"limit", rl.Cur}
		if raiseErr != nil {
			args = append(args, "raise_err", raiseErr.Error()) // root without CAP_SYS_RESOURCE (a container)
		}
		slog.Warn("low file descriptor limit: the agent holds one for each file open in the mount, so the job can hold at most about this many open at once; raise it (ulimit -n, systemd LimitNOFILE, the container's nofile limit)",
			args...)
	}
}

// warnSmallSpoolFS warns when the agent accounts for the budget itself (a spool without a tmpfs
// of its own: an agent that is not root) and the spool's file system has less room than the
// budget leaves: the job's writes then fail (no space left) before the budget is used, while df
// on the mount still shows room. A container's /dev/shm is 64 MiB by default.
func warnSmallSpoolFS(s *tiers.Spool) {
	if s.KernelEnforced() {
		return
	}
	var st unix.Statfs_t
	if unix.Statfs(s.Dir(), &st) != nil {
		return
	}
	total, used := s.Usage()
	if avail := int64(st.Bavail) * st.Bsize; avail < total-used {
		slog.Warn("the spool's file system has less room than --memory leaves: the job's writes will fail (no space left on device) before the budget is used; give a smaller --memory, or the file system more room",
			"spool", s.Dir(), "available", tiers.FormatSize(avail), "budget_left", tiers.FormatSize(total-used))
	}
}

// mountLockWait bounds how long an agent waits for another one starting on the same directory.
const mountLockWait = 30 * time.Second

// lockMountDir takes the lock (flock) of the mount directory dir, open as f before the mount, for
// the agent's start: it is released when f is closed, once the agent runs or its start failed.
// Agents in other containers that see the same directory contend for the same lock.
func lockMountDir(f *os.File, dir string) error {
	deadline := time.Now().Add(mountLockWait)
	noticed := false
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			return fmt.Errorf("lock the mount directory %s: %w", dir, err)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("another agent has been starting on %s for %v; stop it, or wait until it serves", dir, mountLockWait)
		}
		if !noticed && time.Until(deadline) < mountLockWait-time.Second {
			slog.Warn("waiting for another agent starting on the same directory", "dir", dir)
			noticed = true
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// backupProbeTimeout bounds the start's look at the backup location.
const backupProbeTimeout = 30 * time.Second

// probeBackups reads the backup location once, in the background, and warns when it cannot:
// missing credentials or a wrong bucket would otherwise show only when a job starts (its restore
// reads the location first, and fails). The agent serves either way: the location may come back.
// It returns the function that ends the probe.
func probeBackups(b *gcsbackend.Backups, rawURL string, timeout time.Duration, loc backupPlace) (stop func()) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	done := make(chan struct{})
	go func() { // ends with ctx
		defer close(done)
		// A prefix nothing has: one request checks the credentials and the bucket, however
		// many objects the location holds.
		_, _, err := b.Store.List(ctx, ".mtcfs-probe/", "/")
		switch {
		case err == nil && loc.missing:
			// Warned of above: "can be read" would reassure a user whose path is mistyped.
		case err == nil:
			if loc.readOnly {
				slog.Info("the backup location can be read, not written (above)", "backup", rawURL)
			} else {
				slog.Info("the backup location can be read", "backup", rawURL)
			}
		case errors.Is(err, context.DeadlineExceeded):
			slog.Warn("the backup location did not answer within "+timeout.String()+": a job's restore, and every backup, will wait on it",
				"backup", rawURL, "err", err)
		case !errors.Is(err, context.Canceled):
			slog.Warn("the backup location cannot be read: a job's restore, and every backup, will fail until it can",
				"backup", rawURL, "err", err)
		}
	}()
	return func() {
		cancel()
		<-done
	}
}

// backupPlace is what the start found of a file:// backup location (warnVolatileBackups).
type backupPlace struct {
	readOnly bool // the agent may not write there
	missing  bool // the directory does not exist yet
}

// warnVolatileBackups warns when a file:// backup location is in RAM (tmpfs, ramfs): the backups
// are what restores a job after its nodes are lost, and these would be lost with them; when
// the agent may not write there; and when the directory does not exist (a mistyped path, or the
// disk it is on not mounted: the start said "can be read", found by a review).
func warnVolatileBackups(rawURL string) (loc backupPlace) {
	path, ok := fileBackupDir(rawURL)
	if !ok {
		return
	}
	var st unix.Statfs_t // of the directory, or of the ancestor it will be made in
	existing, rest := resolveExisting(path)
	if loc.missing = rest != ""; loc.missing && rawURL == gcsbackend.DefaultURL() {
		slog.Info("the default backup directory is made at the first backup", "backup", rawURL)
	} else if loc.missing {
		slog.Warn("the backup directory does not exist yet: the first backup makes it, and a restore finds no backup there; "+
			"if it should exist (a mistyped path, the disk it is on not mounted), stop the agent and fix --backup",
			"backup", rawURL, "missing", rest, "under", existing)
	}
	if unix.Statfs(existing, &st) != nil {
		return
	}
	if err := unix.Faccessat(unix.AT_FDCWD, existing, unix.W_OK|unix.X_OK, unix.AT_EACCESS); err != nil {
		// The probe only reads: a location its user may not write to said "can be read", and
		// the first backup failed (found by a black-box run).
		slog.Warn("the backup location cannot be written by this agent: every backup will fail until it can; give a directory its user may write to",
			"backup", rawURL, "dir", existing, "err", err)
		loc.readOnly = true
	}
	switch {
	case st.Type == unix.TMPFS_MAGIC || st.Type == unix.RAMFS_MAGIC:
		slog.Warn("the backup location is in RAM (tmpfs): its backups do not survive a reboot or the node's loss; give a directory on a disk, or gs://", "backup", rawURL)
	}
	return loc
}

// inMtcfsMount reports whether the path p is inside an mtcfs mount: the deepest mount point at
// or above it is a fuse.mtcfs one.
func inMtcfsMount(p string) bool {
	mounts, err := fusectl.Mounts()
	if err != nil {
		return false
	}
	best := ""
	mtcfs := false
	for _, m := range mounts { // in mount order: of stacked mounts, the last is on top
		if within(p, m.Point) && len(m.Point) >= len(best) {
			best, mtcfs = m.Point, m.FSType == "fuse.mtcfs"
		}
	}
	return mtcfs
}

// checkSpoolPlacement refuses a spool at or below the mount directory dir (the agent would reach
// its spool through its own mount, which hides it: the job's first write failed), and a mount
// directory inside the spool. Both paths are compared with their symlinks resolved.
func checkSpoolPlacement(dir, spool string) error {
	d, sp := resolvedPath(dir), resolvedPath(spool)
	switch {
	case within(sp, d):
		return fmt.Errorf("--spool %s is inside the mount directory %s, which the mount hides from the agent too: give a directory outside it", spool, dir)
	case within(d, sp):
		return fmt.Errorf("the mount directory %s is inside the spool %s: give a spool directory outside it", dir, spool)
	}
	return nil
}

// checkNoMountsBelow refuses a mount directory that holds other mounts: the mount would hide
// them from their users. An agent started on the parent of another agent's mount took the
// other job's CHECKPOINT_DIR away, with only a warning of hidden entries (found by a black-box
// run).
func checkNoMountsBelow(dir string) error {
	mounts, err := fusectl.Mounts()
	if err != nil {
		return nil // nothing to tell by: the kernel's table is unreadable
	}
	var below []string
	for _, m := range mounts {
		if m.Point != dir && within(m.Point, dir) && !slices.Contains(below, m.Point) {
			below = append(below, m.Point)
		}
	}
	if len(below) == 0 {
		return nil
	}
	more := ""
	if len(below) > 3 {
		below, more = below[:3], fmt.Sprintf(" and %d more", len(below)-3)
	}
	return fmt.Errorf("%s holds other mounts (%s%s): a mount on it would hide them from their users (another agent's job would lose its directory); give another directory, or unmount them first", dir, strings.Join(below, ", "), more)
}

// checkBackupPlacement refuses a file:// backup location at or below the mount directory dir.
// The agent would write its backups through its own mount: they would live in the RAM they are
// meant to outlive, be hidden from every other agent and tool, and be removed with the job's
// namespace; the agent must never touch its own mount either.
func checkBackupPlacement(dir, rawURL string) error {
	path, ok := fileBackupDir(rawURL)
	if !ok {
		return nil
	}
	if within(resolvedPath(path), resolvedPath(dir)) {
		return fmt.Errorf("--backup %s is inside the mount directory %s: backups written there would live in the agent's RAM, behind its own mount, and be lost with it; give a directory outside it, on a disk, or gs://", rawURL, dir)
	}
	// Another agent's mount: it was only warned of, and that agent's job removed the backups
	// at its next start, as names of its namespace it did not know (found by a black-box run).
	if existing, _ := resolveExisting(path); inMtcfsMount(existing) {
		return fmt.Errorf("--backup %s is inside another agent's mtcfs mount: its files live in that agent's RAM, and that agent's job removes what it does not know there at its next start; give a directory on a disk, or gs://", rawURL)
	}
	return nil
}

// backupJobCheck refuses a job whose directory in a file:// backup location (<root>/<job>) holds
// the mount directory dir: a location above the mount is fine for other jobs, but a job named
// like the directory on the way backed up into its own mount, the agent's RAM, and said
// "backup complete" (found by a black-box run). nil for other locations.
func backupJobCheck(dir, rawURL string) func(*tiers.Config) error {
	path, ok := fileBackupDir(rawURL)
	if !ok {
		return nil
	}
	root := resolvedPath(path)
	if !within(dir, root) {
		return nil
	}
	return func(cfg *tiers.Config) error {
		jobDir := filepath.Join(root, cfg.JobName)
		if !within(dir, jobDir) {
			return nil
		}
		what, holds, why := "backups would go to", ", which holds", "they would live in the agent's RAM, behind its own mount, and be lost with it"
		if dir != jobDir {
			// Its backups go beside the mount, but the agents walk and clean that directory
			// (leftovers of backups cut short) and would reach into the mount (a review).
			what, holds, why = "backup directory", " holds", "the agents walk and clean that directory and would reach into the mount, the agent's RAM"
		}
		return fmt.Errorf("job-name: %s: this job's %s %s%s the mount directory %s: %s; give the job another name, or the agents a --backup directory that does not hold the mount",
			cfg.JobName, what, jobDir, holds, dir, why)
	}
}

// backupJobWarning returns WarnJob for a file:// backup location: the line a job gets at each
// handshake while the agent may not write there, or while the directory does not exist (but for
// the default location, made at the first backup), as its start logged.
func backupJobWarning(rawURL string) func(*tiers.Config) string {
	path, ok := fileBackupDir(rawURL)
	if !ok {
		return nil
	}
	return func(*tiers.Config) string {
		existing, rest := resolveExisting(path)
		if err := unix.Faccessat(unix.AT_FDCWD, existing, unix.W_OK|unix.X_OK, unix.AT_EACCESS); err != nil {
			return fmt.Sprintf("the backup location %s cannot be written by this node's agent (%s: %v): every backup of this job fails until it can; give the agent a --backup directory its user may write to", rawURL, existing, err)
		}
		if rest != "" && rawURL != gcsbackend.DefaultURL() {
			return fmt.Sprintf("the backup location %s does not exist (%s is missing under %s): the first backup makes it, and a restore finds no backup there; if it should exist (a mistyped --backup, the disk it is on not mounted), stop the agent and fix --backup", rawURL, rest, existing)
		}
		return ""
	}
}

// checkBackupBesideSpool refuses a file:// backup location at or below the spool: the backups
// took the job's RAM budget, and freeing the spool deleted them (found by a black-box run).
func checkBackupBesideSpool(spool, rawURL string) error {
	path, ok := fileBackupDir(rawURL)
	if !ok {
		return nil
	}
	if within(resolvedPath(path), resolvedPath(spool)) {
		return fmt.Errorf("--backup %s is inside the spool %s: backups written there would take the job's RAM budget and go when the spool is freed; give a directory outside it, on a disk, or gs://", rawURL, spool)
	}
	return nil
}

// fileBackupDir returns the directory of a file:// backup location, cleaned (false: another
// kind of location, or none).
func fileBackupDir(rawURL string) (string, bool) {
	u, err := url.Parse(rawURL)
	if err != nil || u.Scheme != "file" || u.Path == "" {
		return "", false
	}
	return filepath.Clean(u.Path), true
}

// within reports whether the clean absolute path p is parent or below it.
func within(p, parent string) bool {
	return p == parent || strings.HasPrefix(p, strings.TrimSuffix(parent, "/")+"/")
}

// resolvedPath is the absolute path p with the symlinks of its existing ancestors resolved.
func resolvedPath(p string) string {
	existing, rest := resolveExisting(p)
	return filepath.Join(existing, rest)
}

// resolveExisting splits the absolute path p into its longest existing ancestor, with symlinks
// resolved, and the rest, which does not exist yet ("" if p exists).
func resolveExisting(p string) (existing, rest string) {
	for cur := p; ; {
		if r, err := filepath.EvalSymlinks(cur); err == nil {
			return r, rest
		}
		parent := filepath.Dir(cur)
		if parent == cur {
			return p, ""
		}
		rest = filepath.Join(filepath.Base(cur), rest)
		cur = parent
	}
}

// stoppingWait bounds how long a new agent waits for a stopping one on its directory: that one
// lets a running backup finish (its --drain-timeout, 30 s by default) and then waits up to 30 s
// for the processes that use its mount.
const stoppingWait = 2 * time.Minute

// waitForStoppingAgent waits, when the agent serving dir on this machine is stopping (a restart
// typed right after a Ctrl-C, while a backup drains or a shell still has its working directory
// in the mount), until it is gone, or limit passes, or a stop signal comes. Before, the new agent
// failed at once: "already a live FUSE mount", or "spool in use".
func waitForStoppingAgent(dir string, limit time.Duration, sigs <-chan stopSignal) error {
	old, ok := agents.Stopping(dir)
	if !ok {
		return nil
	}
	slog.Info("waiting for the agent that is stopping on this directory to finish (it lets a running backup finish, then waits for the processes that use its mount; its log names them)",
		"pid", old.PID, "dir", dir, "up_to", limit.String())
	start := time.Now()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	deadline := time.After(limit)
	for !agents.Gone(old) {
		select {
		case s := <-sigs:
			return fmt.Errorf("%s while waiting for the stopping agent pid %d", s.sig, old.PID)
		case <-deadline:
			slog.Warn("the stopping agent is still there; going on", "pid", old.PID, "waited", time.Since(start).Round(time.Millisecond).String())
			return nil
		case <-tick.C:
		}
	}
	slog.Info("the stopping agent is gone", "pid", old.PID, "waited", time.Since(start).Round(time.Millisecond).String())
	return nil
}

// waitForStoppingSpoolHolder waits, when the spool is held by an agent that is stopping for the
// same mount path, until it lets the spool go, or limit passes, or a stop signal comes. That
// agent is not in this machine's registry of agents when it runs in another mount namespace: a
// Kubernetes Job's replacement pod starts while the old pod still terminates (its agent draining
// a backup), with the same mount path in its own emptyDir and the node's spool. The new agent
// failed at once with "spool … is in use", and was restarted with back-off until the old one was
// gone (80 s in a black-box run).
func waitForStoppingSpoolHolder(dir, spoolDir string, limit time.Duration, sigs <-chan stopSignal) error {
	o, err := tiers.ReadOwner(spoolDir)
	if err != nil || !o.Stopping || o.MountPath != dir {
		return nil
	}
	free := func() bool {
		f, err := tiers.LockSpool(spoolDir)
		if err == nil {
			f.Close()
		}
		return !errors.Is(err, tiers.ErrSpoolInUse)
	}
	if free() {
		return nil
	}
	slog.Info("waiting for the agent that is stopping with this spool to let it go (it lets a running backup finish, then waits for the processes that use its mount; it may run in another mount namespace, a pod that terminates)",
		"spool", spoolDir, "pid", o.PID, "mount", o.MountPath, "up_to", limit.String())
	start := time.Now()
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	deadline := time.After(limit)
	for !free() {
		select {
		case s := <-sigs:
			return fmt.Errorf("%s while waiting for the stopping agent pid %d to let spool %s go", s.sig, o.PID, spoolDir)
		case <-deadline:
			slog.Warn("the stopping agent still holds the spool; going on", "pid", o.PID, "waited", time.Since(start).Round(time.Millisecond).String())
			return nil
		case <-tick.C:
		}
	}
	slog.Info("the stopping agent let the spool go", "pid", o.PID, "waited", time.Since(start).Round(time.Millisecond).String())
	return nil
}

func runMount(cfg mountConfig) error {
	// Before anything large is allocated: a restart's adoption is what the marked pages are for.
	if cfg.heapHugePages > 0 {
		if n, err := tiers.HugePageHeap(cfg.heapHugePages); err != nil {
			slog.Info("Go heap huge pages not available", "err", err)
		} else if n > 0 {
			slog.Debug("Go heap huge pages", "marked", tiers.FormatSize(n), "thp", tiers.TransparentHugePages())
		}
	}
	sigs, stopSignals := notifyStop()
	defer stopSignals()
	warnLowFDLimit()

	if err := waitForStoppingAgent(tiers.ResolveMountPath(cfg.dir), stoppingWait, sigs); err != nil {
		return err
	}
	if detached, err := mfs.DetachStale(cfg.dir, cfg.takeover); err != nil {
		return err
	} else if detached {
		slog.Warn("detached a stale mount left by an agent that died", "dir", tiers.ResolveMountPath(cfg.dir))
	}
	if err := mfs.CheckMountable(cfg.dir); err != nil {
		return err
	}
	// The directory the mount lands on: a symlink is followed, so a mount reached through a
	// link is the same mount (refused above while live; same default spool).
	cfg.dir = tiers.ResolveMountPath(cfg.dir)
	if err := checkNoMountsBelow(cfg.dir); err != nil {
		return err
	}
	if err := checkBackupPlacement(cfg.dir, cfg.backupURL); err != nil {
		return err
	}
	backups, err := openBackups(cfg.backupURL)
	if err != nil {
		return err
	}
	loc := warnVolatileBackups(cfg.backupURL)
	defer probeBackups(backups, cfg.backupURL, backupProbeTimeout, loc)()
	backups.Compress = cfg.compress
	if abs, err := filepath.Abs(cfg.spoolDir); err == nil && abs == tiers.DefaultSpoolDir(cfg.dir) {
		cfg.spoolDefault = true // --spool naming the default one
	}
	if _, err := os.Lstat(cfg.spoolDir); cfg.spoolDefault && errors.Is(err, os.ErrNotExist) {
		// A mount moved while its agent served it (a directory above renamed) left its spool,
		// with its checkpoints, recording the new path under the old path's name. Looked for
		// after the wait for a stopping agent: it records the move as it stops.
		if kept, ok := localSpools.KeptFor(cfg.dir); ok {
			slog.Info("using the kept spool that records this mount directory (the mount was moved here while an agent served it)", "spool", kept.Dir, "mount", kept.MountPath, "job", kept.Job, "steps", kept.Steps)
			cfg.spoolDir = kept.Dir
		}
	}
	if abs, err := filepath.Abs(cfg.spoolDir); err == nil {
		cfg.spoolDir = abs
	}
	if err := checkSpoolPlacement(cfg.dir, cfg.spoolDir); err != nil {
		return err
	}
	if err := waitForStoppingSpoolHolder(cfg.dir, cfg.spoolDir, stoppingWait, sigs); err != nil {
		return err
	}
	if err := checkSpoolOfAnotherMount(cfg.dir, cfg.spoolDir); err != nil {
		return err
	}
	if err := checkBackupBesideSpool(cfg.spoolDir, cfg.backupURL); err != nil {
		return err
	}
	reapAgain := localSpools.ReapOrphaned(cfg.spoolDir, slog.Default())
	spool, err := tiers.OpenSpool(tiers.SpoolConfig{Dir: cfg.spoolDir, Budget: cfg.budget, MountTmpfs: os.Geteuid() == 0, MountPath: cfg.dir})
	if err != nil {
		return err
	}
	defer spool.Release(slog.Default())
	warnSmallSpoolFS(spool)
	if g := spool.Grown(); g > 0 {
		slog.Warn("the kept spool holds more than --memory allows, its records of a step committed with the budget full included: its tmpfs is made that much larger so that the agent can start; the job's saves fail with ENOSPC until a step is freed (--memory needs room for two steps)",
			"spool", spool.Dir(), "memory", tiers.FormatSize(cfg.budget), "larger_by", tiers.FormatSize(g))
	}

	store := tiers.RememberDamage(gcsbackend.TierStore(backups))
	secret, err := readSecretFile(cfg.secretFile)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", cfg.listen)
	if err != nil {
		return fmt.Errorf("--listen %s: %w", cfg.listen, err)
	}
	node, err := replication.NewNode(replication.NodeConfig{Listener: ln, Advertise: cfg.advertise, Objects: gcsbackend.SmallObjects{Store: backups.Store},
		Peers: cfg.peers, Secret: secret, TLS: cfg.peerTLS, Store: store, LagTimeout: cfg.lagTimeout, Compression: cfg.peerCompress})
	if err != nil {
		ln.Close()
		return err
	}
	metrics := prometheus.NewRegistry()
	metrics.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "mtcfs_build_info", Help: "Always 1; the agent's version is a label.",
			ConstLabels: prometheus.Labels{"version": version}}, func() float64 { return 1 }),
		node.Collector())
	var beforeSeal func(int64)
	if d := cfg.sealDelay; d > 0 {
		beforeSeal = func(int64) { time.Sleep(d) }
	}
	rep := tiers.NewReplicator(tiers.ReplicatorConfig{Spool: spool, Store: store, Coordinator: node, Peers: node, JaxInit: cfg.jaxInit,
		DrainTimeout: cfg.drain, Registerer: metrics, BeforeSeal: beforeSeal, RestoreWait: cfg.restoreWait, YAMLHeldWait: cfg.yamlHeldWait, KeptSpools: func() ([]tiers.SpoolInfo, error) { return localSpools.OrphanedOrOf(cfg.dir, cfg.spoolDir) },
		CheckJob: backupJobCheck(cfg.dir, cfg.backupURL), WarnJob: backupJobWarning(cfg.backupURL)})
	var ready atomic.Bool
	var served atomic.Pointer[mfs.Server]
	var toldUnready sync.Once
	var toldReadOnly atomic.Bool // logged once per read-only spell
	// /readyz: mounted, and still reachable. A mount detached lazily (umount -l) while a process
	// held it, or a spool tmpfs unmounted from under the agent, left the probes at 200 and
	// status at "running" while no job could use the node (a black-box run of an operator).
	readyz := func() string {
		if !ready.Load() {
			return "not mounted"
		}
		why := ""
		if s := served.Load(); s != nil && !s.Attached() {
			why = "the mount at " + cfg.dir + " was detached (umount -l) while a process held it: no job can reach it; stop the agent (the spool is kept) and start it again"
		} else if spool.Detached() {
			why = "the spool's tmpfs at " + spool.Dir() + " was unmounted from under the agent: the checkpoints it held are out of reach; stop the agent and start it again"
		} else if spool.ReadOnly() {
			// A black-box run remounted it read-only for a second: the seals failed, and
			// status said nothing.
			why = "the spool at " + spool.Dir() + " is read-only (remounted under the agent): the job's commits cannot be sealed, nor its reports written; remount it read-write (mount -o remount,rw " + spool.Dir() + ")"
			if toldReadOnly.CompareAndSwap(false, true) {
				slog.Error(why)
			}
			return why
		}
		if why != "" {
			toldUnready.Do(func() { slog.Error(why) })
		}
		toldReadOnly.Store(false)
		return why
	}
	info := agents.Info{PID: os.Getpid(), Version: version, SpoolDir: spool.Dir()}
	var shown atomic.Pointer[agents.Info] // what /status shows; info is completed below
	shown.Store(&agents.Info{PID: info.PID, Version: info.Version})
	if cfg.httpAddr != "" {
		addr, stop, err := agents.Serve(cfg.httpAddr, readyz, func() any {
			r := statusReply{Info: *shown.Load(), Status: rep.Status()}
			if served.Load() != nil {
				r.NotReady = readyz()
			}
			return r
		},
			// A collector that fails (the process collector reads /proc, which needs descriptors a
			// job holding many files open took) leaves its metrics out, not every metric.
			promhttp.HandlerFor(metrics, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError}), slog.Default())
		if err != nil {
			return fmt.Errorf("--http %s: %w", cfg.httpAddr, err)
		}
		defer stop()
		info.HTTP = addr
	}

	// What the job may have written into the directory while no agent was mounted on it (see
	// answerHidden): opened before the mount hides it, looked at before the replicator starts
	// (its control loop then takes a hidden yaml's close before any event of the job's, and a
	// yaml the job writes through the mount meanwhile wins). A yaml taken in is removed from
	// under the mount only once the agent runs: a start that fails leaves it to the next agent.
	under, uerr := os.Open(cfg.dir)
	if uerr == nil {
		// Two agents started on DIR at the same moment both passed the checks above, and both
		// mounted, one hiding the other. The directory's lock makes them take turns: the later
		// one finds the other's mount here and refuses.
		if err := lockMountDir(under, cfg.dir); err != nil {
			under.Close()
			return err
		}
		if _, err := mfs.DetachStale(cfg.dir, cfg.takeover); err != nil {
			under.Close()
			return err
		}
	}
	srv, err := mfs.Mount(cfg.dir, mfs.Options{Spool: spool, Passthrough: cfg.passthrough, Events: rep, Debug: cfg.debugFuse, Xattrs: cfg.xattrs, Owner: cfg.owner})
	var removeHidden func()
	if uerr != nil {
		slog.Warn("cannot open the mount directory before mounting", "err", uerr)
	} else {
		if err == nil {
			removeHidden = answerHidden(under, srv.Namespace(), rep)
		}
		defer under.Close() // also closed below once the agent runs
	}
	if err != nil {
		return err
	}
	failed := func(err error) error {
		srv.Unmount()
		if removeHidden != nil {
			slog.Warn("the replicator.yaml written under the mount stays there for the next agent to answer")
		}
		return err
	}
	info.Dir, info.Passthrough = srv.Dir(), srv.Passthrough()
	shown.Store(&info)
	ctx, cancel := context.WithCancel(context.Background())
	go localSpools.ReapOrphanedLater(ctx, cfg.spoolDir, reapAgain, slog.Default())
	defer cancel()
	if err := rep.Start(ctx, srv.Namespace()); err != nil {
		return failed(fmt.Errorf("start replicator: %w", err))
	}
	defer rep.Close()
	// Replicas are taken only once the replicator runs (see replication.Node.Start).
	if err := node.Start(rep, spool); err != nil {
		return failed(err)
	}
	defer node.Close()
	if removeHidden != nil {
		removeHidden()
	}
	if under != nil {
		under.Close()
	}
	unregister := agents.Register(info)
	defer unregister()
	served.Store(srv)
	ready.Store(true)
	slog.Info("serving; stop with SIGINT or SIGTERM", "dir", srv.Dir(), "backup", store.String(), "version", version)

	done := make(chan struct{})
	go func() { srv.Wait(); close(done) }()
	where := srv.Dir() // where the mount is when it goes: a directory above may be renamed
	select {
	case first := <-sigs:
		ready.Store(false)
		slog.Info("stopping", "signal", first.sig.String())
		where = srv.Where()
		if where != srv.Dir() {
			// The spool is kept for the next agent at the new path (spool.Release), which finds
			// it by this record (Spools.KeptFor). Recorded before the unmount: a busy mount's
			// stop may end at its 30 s limit, and the spool was then freed as orphaned (found by
			// a review).
			if err := spool.MountMoved(where); err != nil {
				slog.Warn("record the moved mount directory in the spool's owner record", "err", err)
			}
		}
		stopping := info
		stopping.Stopping = true
		stopping.Dir = where      // an agent started there meanwhile waits for this one
		agents.Register(stopping) // the same file; the deferred unregister removes it
		if err := spool.MarkStopping(); err != nil {
			slog.Debug("record the stop in the spool's owner record", "err", err)
		}
		rep.Close()
		if err := unmountBounded(srv, sigs, first); err != nil {
			return err
		}
	case <-done:
		// Exit 1: a supervisor that restarts on failure only (systemd's Restart=on-failure)
		// left the node without its agent after an exit 0 (an operator's black-box run).
		slog.Info("unmounted", "dir", where)
		return fmt.Errorf("the filesystem at %s was unmounted from outside the agent (umount, or its last holder gone after umount -l): it no longer serves; exiting", srv.Dir())
	}
	slog.Info("unmounted", "dir", where)
	return nil
}
