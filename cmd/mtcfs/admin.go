package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/mtcfs/mtcfs/gcsbackend"
	"github.com/mtcfs/mtcfs/internal/agents"
	"github.com/mtcfs/mtcfs/internal/report"
	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/tiers"
)

// statusReply is the /status document.
type statusReply struct {
	agents.Info
	tiers.Status
	// NotReady is why /readyz answers 503 once the agent served ("": it is ready, or still
	// starting): a mount detached, a spool unmounted from under the agent.
	NotReady string `json:"not_ready,omitempty"`
}

// cmdStatus prints what the local agents (or the one at --http) hold and do.
func cmdStatus(args []string) int {
	fset := newFlagSet("status", "mtcfs status [DIR] [--http HOST:PORT] [--json]")
	addr := fset.String("http", "", "agent HTTP address (default: every agent running on this machine)")
	asJSON := fset.Bool("json", false, "print JSON")
	pos, err := parseFlags(fset, args)
	if err != nil {
		return flagError(fset, err)
	}
	if len(pos) > 1 {
		return flagError(fset, errors.New("at most one mount directory"))
	}
	targets := []agents.Info{{HTTP: *addr}}
	if *addr == "" {
		dir := ""
		if len(pos) == 1 {
			dir = tiers.ResolveMountPath(pos[0]) // agents register the resolved path
		}
		if targets, err = agents.StatusAddrs(dir); err != nil {
			fmt.Fprintln(os.Stderr, "mtcfs status:", err)
			keptSpoolsOf(dir)
			return 1
		}
	}
	replies := []json.RawMessage{} // --json: [] when no agent answered, not null
	code := 0
	for _, a := range targets {
		if a.HTTP == "" && a.PID != 0 {
			// Started with --http "": it answers nobody (it said "http: no Host in request URL").
			fmt.Fprintf(os.Stderr, "mtcfs status: the agent of %s (pid %d) serves no HTTP endpoint (started with --http \"\"): its status is in its log; restart it with --http HOST:PORT to ask it\n", a.Dir, a.PID)
			code = 1
			continue
		}
		body, err := agents.FetchStatus(a.HTTP)
		if err != nil {
			switch {
			case a.PID == 0: // --http: nothing more is known
				fmt.Fprintf(os.Stderr, "mtcfs status: agent at %s: %v\n", a.HTTP, err)
			case agents.Stopped(a.PID):
				fmt.Fprintf(os.Stderr, "mtcfs status: the agent of %s (pid %d) is stopped (SIGSTOP, or a debugger): the job's requests in the mount wait too; kill -CONT %d resumes it after a SIGSTOP\n", a.Dir, a.PID, a.PID)
			default:
				fmt.Fprintf(os.Stderr, "mtcfs status: the agent of %s (pid %d, %s) did not answer: %v\n", a.Dir, a.PID, a.HTTP, err)
			}
			code = 1
			continue
		}
		replies = append(replies, body)
	}
	if *asJSON {
		out, _ := json.MarshalIndent(replies, "", "  ")
		fmt.Println(string(out))
		return code
	}
	for _, body := range replies {
		var st statusReply
		if err := json.Unmarshal(body, &st); err != nil {
			fmt.Fprintln(os.Stderr, "mtcfs status: bad reply:", err)
			code = 1
			continue
		}
		report.Status(os.Stdout, st.Info, st.Status)
		if st.NotReady != "" {
			fmt.Printf("  NOT READY  %s\n", st.NotReady)
			code = 1
		}
	}
	return code
}

// keptSpoolsOf names, when no agent serves dir ("": any), the spools kept for it: the RAM an
// agent that stopped (or was killed) still holds, its steps, and what to do with it. (A black-box
// run of a stopped agent whose mount directory was gone heard only "no running agent serves".)
func keptSpoolsOf(dir string) {
	spools, err := localSpools.List()
	if err != nil {
		return
	}
	for _, s := range spools {
		if s.InUse || (dir != "" && s.MountPath != dir) || len(s.Metas) == 0 {
			continue
		}
		mp := s.MountPath
		if mp == "" {
			mp = "an unknown mount directory"
		}
		what := "no step"
		if len(s.Steps) > 0 {
			what = "step(s) " + tiers.JoinSteps(s.Steps)
		}
		fmt.Fprintf(os.Stderr, "mtcfs status: spool %s, kept for %s, holds job %s's %s (%s); ", s.Dir, mp, s.Job, what, tiers.FormatSize(s.Bytes))
		switch {
		case s.Orphaned():
			fmt.Fprintf(os.Stderr, "its mount directory is %s: make it again and run mtcfs mount %s (with the same --spool, if it had one) to serve them, or free the RAM with mtcfs spool free %s (an agent starting on this machine frees it once it has been unused for 10 minutes)\n", s.MountState, mp, s.Dir)
		default:
			fmt.Fprintf(os.Stderr, "the next mtcfs mount %s (with the same --spool, if it had one) serves them; mtcfs spool free %s frees the RAM\n", mp, mp)
		}
	}
}

// backupFlags are the flags shared by the backup-location commands.
func backupFlags(name, synopsis string) (*flagSetWithBackup, error) {
	fset := newFlagSet(name, synopsis)
	f := &flagSetWithBackup{fs: fset}
	f.url = fset.String("backup", gcsbackend.DefaultURL(), "backup location: file:///abs/dir or gs://bucket[/prefix]")
	f.job = fset.String("job", "", "job name (required)")
	f.timeout = durationFlag(fset, "timeout", 0, "give up on the backup location after this `duration`, exit 1 (0: no limit; a location that does not answer is retried for several minutes)")
	return f, nil
}

type flagSetWithBackup struct {
	fs       *flag.FlagSet
	url, job *string
	timeout  *time.Duration
}

// context is the command's context: bounded by --timeout when given.
func (f *flagSetWithBackup) context() (context.Context, context.CancelFunc) {
	// Ctrl-C (or SIGTERM) ends the command's work as --timeout does, so that what it leaves is
	// cleaned up or named: an export interrupted left a hidden half-written data directory that
	// made the next export refuse the destination (a black-box run). A second one kills.
	base, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	go func() {
		<-base.Done()
		stop()
	}()
	if *f.timeout > 0 {
		ctx, cancel := context.WithTimeout(base, *f.timeout)
		return ctx, func() { cancel(); stop() }
	}
	ctx, cancel := context.WithCancel(base)
	return ctx, func() { cancel(); stop() }
}

// gaveUp says that the command stopped at --timeout (a location that does not answer, or work
// larger than the time given, an export say); it returns "" when ctx has not expired.
func (f *flagSetWithBackup) gaveUp(ctx context.Context) string {
	if !errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return ""
	}
	return fmt.Sprintf("gave up after --timeout %v, still at work with %s", *f.timeout, *f.url)
}

// fail prints err (or, past --timeout, that the command gave up) after prefix and returns 1.
func (f *flagSetWithBackup) fail(ctx context.Context, prefix string, err error) int {
	if g := f.gaveUp(ctx); g != "" {
		fmt.Fprintf(os.Stderr, "%s %s (%v)\n", prefix, g, err)
		return 1
	}
	if errors.Is(ctx.Err(), context.Canceled) {
		fmt.Fprintf(os.Stderr, "%s interrupted (%v)\n", prefix, err)
		return 1
	}
	fmt.Fprintln(os.Stderr, prefix, err)
	return 1
}

// open parses args and opens the backup location.
func (f *flagSetWithBackup) open(args []string) ([]string, *gcsbackend.Backups, int) {
	pos, err := parseFlags(f.fs, args)
	if err != nil {
		return nil, nil, flagError(f.fs, err)
	}
	if *f.job == "" {
		return nil, nil, flagError(f.fs, errors.New("--job is required"))
	}
	if *f.timeout < 0 {
		return nil, nil, flagError(f.fs, fmt.Errorf("--timeout %v: want a positive duration, or 0 for no limit", *f.timeout))
	}
	if err := layout.ValidateJobName(*f.job); err != nil {
		return nil, nil, flagError(f.fs, fmt.Errorf("--job: %w", err))
	}
	b, err := openBackups(*f.url)
	if err != nil {
		fmt.Fprintln(os.Stderr, "mtcfs:", err)
		return nil, nil, 1
	}
	// A mistyped file:// path would read as a location with no backups in it (opening it
	// refused any other error, and a file).
	if dir, ok := gcsbackend.LocalRoot(b.Store); ok {
		if _, err := os.Stat(dir); errors.Is(err, fs.ErrNotExist) {
			fmt.Fprintf(os.Stderr, "mtcfs: --backup %s: no such directory\n", *f.url)
			return nil, nil, 1
		}
	}
	return pos, b, -1
}

// jobsIn lists the jobs that have something in the backup location (its top-level names),
// to help with a mistyped --job.
func jobsIn(ctx context.Context, b *gcsbackend.Backups) []string {
	_, prefixes, err := b.Store.List(ctx, "", "/")
	if err != nil {
		return nil
	}
	var jobs []string
	for _, p := range prefixes {
		if j := strings.TrimSuffix(p, "/"); layout.ValidateJobName(j) == nil {
			jobs = append(jobs, j)
		}
	}
	return jobs
}

// slowStore says, on w, that a command is still at work with its backup location: first after
// `after`, then every `every`, until the returned stop is called. An unreachable location is
// retried (8 attempts of up to a minute each for gs://) before the command fails; before, it
// said nothing all that while.
func slowStore(w io.Writer, cmd string, store fmt.Stringer, after, every time.Duration) (stop func()) {
	done := make(chan struct{})
	finished := make(chan struct{})
	start := time.Now()
	go func() {
		defer close(finished)
		t := time.NewTimer(after)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
			}
			fmt.Fprintf(w, "mtcfs %s: still at work with %s after %v (a location that does not answer is retried for several minutes; Ctrl-C interrupts, --timeout bounds it)\n",
				cmd, store, time.Since(start).Round(time.Second))
			t.Reset(every)
		}
	}()
	return func() {
		close(done)
		<-finished
	}
}

// slowStoreAfter and slowStoreEvery time slowStore's notices in the commands.
const (
	slowStoreAfter = 10 * time.Second
	slowStoreEvery = 30 * time.Second
)

// cmdBackups lists, verifies or exports the backups of a job.
func cmdBackups(args []string) int {
	const synopsis = "mtcfs backups list|verify [NAME] --backup URL --job NAME | export NAME DIR --backup URL --job NAME | delete NAME --backup URL --job NAME [--force]"
	if len(args) > 0 && args[0] == "export" {
		return cmdBackupsExport(args[1:])
	}
	if len(args) > 0 && args[0] == "delete" {
		return cmdBackupsDelete(args[1:])
	}
	if len(args) == 0 || (args[0] != "list" && args[0] != "verify") {
		return subcommandUsage("backups", synopsis, args)
	}
	verb := args[0]
	f, _ := backupFlags("backups "+verb, synopsis)
	pos, b, code := f.open(args[1:])
	if code >= 0 {
		return code
	}
	ctx, cancel := f.context()
	defer cancel()
	defer slowStore(os.Stderr, "backups "+verb, b.Store, slowStoreAfter, slowStoreEvery)()
	job := *f.job
	names, err := b.Names(ctx, job)
	if err != nil {
		return f.fail(ctx, "mtcfs backups:", err)
	}
	if len(names) == 0 {
		fmt.Printf("no backups of job %s in %s\n", job, b.Store)
		if jobs := jobsIn(ctx, b); len(jobs) > 0 {
			fmt.Printf("jobs with something there: %s\n", strings.Join(jobs, ", "))
		}
		if g := f.gaveUp(ctx); g != "" {
			fmt.Fprintf(os.Stderr, "mtcfs backups %s: %s, looking for the jobs that have backups there\n", verb, g)
			return 1
		}
		if len(pos) > 0 {
			return 1
		}
		return 0
	}
	if len(pos) > 0 {
		missing := 0
		for _, name := range pos {
			if !slices.Contains(names, name) {
				fmt.Fprintf(os.Stderr, "mtcfs backups: no backup %s of job %s in %s (newest: %s; mtcfs backups list shows them all)\n", name, job, b.Store, names[0])
				missing++
			}
		}
		if missing > 0 {
			return 1
		}
		names = pos
	}
	pin, pinned, _ := b.ReadRestoreVersion(ctx, job)
	if !pinned {
		pin = ""
	}
	ok := report.Backups(ctx, os.Stdout, b, job, names, verb == "verify", pin)
	if g := f.gaveUp(ctx); g != "" {
		fmt.Fprintf(os.Stderr, "mtcfs backups %s: %s; the listing above is not whole\n", verb, g)
		return 1
	}
	if !ok && verb == "verify" {
		return 1
	}
	return 0
}

// cmdBackupsDelete removes an incomplete backup (an upload cut short that no agent completed),
// which `backups verify` reports for as long as it is there. A backup with a complete or damaged
// step is refused: mtcfs never deletes checkpoints.
func cmdBackupsDelete(args []string) int {
	const synopsis = "mtcfs backups delete NAME --backup URL --job NAME [--force]"
	f, _ := backupFlags("backups delete", synopsis)
	force := f.fs.Bool("force", false, fmt.Sprintf("delete also a backup written to in the last %v (an upload may still be running into it)", gcsbackend.RecentWrite))
	pos, b, code := f.open(args)
	if code >= 0 {
		return code
	}
	if len(pos) != 1 {
		return flagError(f.fs, errors.New("want one backup NAME (an INCOMPLETE one in mtcfs backups list)"))
	}
	ctx, cancel := f.context()
	defer cancel()
	defer slowStore(os.Stderr, "backups delete", b.Store, slowStoreAfter, slowStoreEvery)()
	n, err := b.DeleteIncomplete(ctx, *f.job, pos[0], *force)
	switch {
	case gcsbackend.IsNotFound(err):
		fmt.Fprintf(os.Stderr, "mtcfs backups delete: job %s has no backup %s in %s (see mtcfs backups list)\n", *f.job, pos[0], b.Store)
		return 1
	case err != nil:
		return f.fail(ctx, "mtcfs backups delete:", err)
	}
	fmt.Printf("deleted the incomplete backup %s of job %s (%d objects)\n", pos[0], *f.job, n)
	return 0
}

// cmdBackupsExport writes a backup's complete steps to DIR in the plain reference layout
// (<job>-sS-nR-wW.meta and <hash>.data with the files as the job wrote them), whatever codec the
// backup stores them in, checking every file against the manifest and every data against its hash.
func cmdBackupsExport(args []string) int {
	const synopsis = "mtcfs backups export NAME DIR --backup URL --job NAME"
	f, _ := backupFlags("backups export", synopsis)
	pos, b, code := f.open(args)
	if code >= 0 {
		return code
	}
	if len(pos) != 2 {
		return flagError(f.fs, errors.New("want a backup NAME (see mtcfs backups list) and a destination DIR"))
	}
	name, dir := pos[0], pos[1]
	if existing, _ := resolveExisting(dir); inMtcfsMount(existing) {
		// An export there lives in that agent's RAM, charged to its job's budget, and the job
		// removes what it does not know there at its next start (a black-box run).
		fmt.Fprintf(os.Stderr, "mtcfs backups export: %s is inside an mtcfs mount: the export would live in that agent's RAM, and its job removes what it does not know there at its next start; export to a directory on a disk\n", dir)
		return 1
	}
	if why := exportIntoLocation(b, *f.job, dir); why != "" {
		fmt.Fprintf(os.Stderr, "mtcfs backups export: %s is inside the backup location %s: %s; export to a directory outside it\n", dir, b.Store, why)
		return 1
	}
	ctx, cancel := f.context()
	defer cancel()
	start := time.Now()
	last := start
	progress := func(done, total int64) {
		if now := time.Now(); now.Sub(last) >= 2*time.Second && done < total {
			last = now
			fmt.Fprintf(os.Stderr, "mtcfs backups export: %s of %s (%.0f%%)\n", tiers.FormatSize(done), tiers.FormatSize(total), 100*float64(done)/float64(total))
		}
	}
	wasEmpty := emptyOrMissing(dir)
	rep, err := b.Export(ctx, gcsbackend.ExportRequest{Job: *f.job, Backup: name, Dir: dir, Progress: progress})
	if err != nil && wasEmpty && !emptyOrMissing(dir) {
		// The next export refuses a directory that is not empty (a review: the give-up line of
		// --timeout left the user to find that out).
		err = fmt.Errorf("%w; %s holds what was exported before the failure: remove it before trying again", err, dir)
	}
	if gcsbackend.IsNotFound(err) {
		fmt.Fprintf(os.Stderr, "mtcfs backups export: job %s has no backup %s in %s (see mtcfs backups list)\n", *f.job, name, b.Store)
		return 1
	}
	if err != nil {
		return f.fail(ctx, "mtcfs backups export:", err)
	}
	for _, s := range rep.Skipped {
		fmt.Fprintf(os.Stderr, "mtcfs backups export: step %d of backup %s is incomplete and was left out\n", s, name)
	}
	steps := make([]string, len(rep.Steps))
	for i, s := range rep.Steps {
		steps[i] = fmt.Sprint(s)
	}
	fmt.Printf("exported step %s of backup %s (%d data, %s) to %s in %v\n", strings.Join(steps, ","), name, len(rep.Data),
		tiers.FormatSize(rep.Bytes), dir, time.Since(start).Round(time.Millisecond))
	return 0
}

// exportIntoLocation says why an export of job's backup into dir would be taken for part of
// the file:// backup location b ("": it would not): inside the job's directory there, or named
// like a backup of any job there. (A black-box run exported into <root>/<job>/<backup-name>:
// the export was listed as a DAMAGED backup from then on, every restore said so, and only rm
// removed it.)
func exportIntoLocation(b *gcsbackend.Backups, job, dir string) string {
	root, ok := gcsbackend.LocalRoot(b.Store)
	if !ok {
		return ""
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return ""
	}
	p, rootReal := resolvedPath(abs), resolvedPath(root)
	if !within(p, rootReal) {
		return ""
	}
	rel := strings.TrimPrefix(strings.TrimPrefix(p, rootReal), "/")
	parts := strings.Split(rel, "/")
	switch {
	case rel == "":
		return "it is the location itself, whose directories are jobs"
	case parts[0] == job:
		return "it is job " + job + "'s directory there, whose directories are its backups"
	case len(parts) > 1 && layout.IsBackupName(parts[1]):
		return "it would read as backup " + parts[1] + " of job " + parts[0]
	}
	return ""
}

// emptyOrMissing reports whether dir does not exist or holds nothing.
func emptyOrMissing(dir string) bool {
	names, err := os.ReadDir(dir)
	return errors.Is(err, fs.ErrNotExist) || (err == nil && len(names) == 0)
}

// cmdRestoreVersion pins the next restore to a backup, or removes the pin (SPEC §5).
func cmdRestoreVersion(args []string) int {
	const synopsis = "mtcfs restore-version set NAME|clear --backup URL --job NAME"
	if len(args) == 0 || (args[0] != "set" && args[0] != "clear") {
		return subcommandUsage("restore-version", synopsis, args)
	}
	f, _ := backupFlags("restore-version "+args[0], synopsis)
	pos, b, code := f.open(args[1:])
	if code >= 0 {
		return code
	}
	ctx, cancel := f.context()
	defer cancel()
	defer slowStore(os.Stderr, "restore-version "+args[0], b.Store, slowStoreAfter, slowStoreEvery)()
	if args[0] == "clear" {
		if len(pos) != 0 {
			return flagError(f.fs, errors.New("clear takes no NAME"))
		}
		pin, pinned, err := b.ReadRestoreVersion(ctx, *f.job)
		if err != nil {
			return f.fail(ctx, "mtcfs restore-version:", err)
		}
		if !pinned {
			fmt.Printf("job %s has no restore.version in %s: nothing to clear (the next restore picks the newest checkpoint)\n", *f.job, b.Store)
			return 0
		}
		if err := b.ClearRestoreVersion(ctx, *f.job); err != nil {
			if f.gaveUp(ctx) != "" {
				err = fmt.Errorf("%w; the pin may have been removed all the same: mtcfs backups list marks a pinned backup", err)
			}
			return f.fail(ctx, "mtcfs restore-version:", err)
		}
		fmt.Printf("restore.version of job %s (%s) cleared: the next restore picks the newest checkpoint\n", *f.job, pin)
		return 0
	}
	if len(pos) != 1 {
		return flagError(f.fs, errors.New("set needs exactly one backup NAME (see mtcfs backups list)"))
	}
	rep, err := b.Verify(ctx, *f.job, pos[0], gcsbackend.VerifyOptions{})
	if gcsbackend.IsNotFound(err) {
		fmt.Fprintf(os.Stderr, "mtcfs restore-version: job %s has no backup %s in %s (see mtcfs backups list)\n", *f.job, pos[0], b.Store)
		return 1
	}
	if err != nil {
		return f.fail(ctx, fmt.Sprintf("mtcfs restore-version: backup %s of job %s:", pos[0], *f.job), err)
	}
	if _, ok := rep.HighestComplete(); !ok {
		fmt.Fprintf(os.Stderr, "mtcfs restore-version: backup %s has no complete step; refusing to pin it (the job would start from scratch)\n", pos[0])
		return 1
	}
	if err := b.SetRestoreVersion(ctx, *f.job, pos[0]); err != nil {
		if f.gaveUp(ctx) != "" {
			err = fmt.Errorf("%w; the pin may have been written all the same: mtcfs backups list marks the pinned backup", err)
		}
		return f.fail(ctx, "mtcfs restore-version:", err)
	}
	step, _ := rep.HighestComplete()
	fmt.Printf("job %s will restore step %d from backup %s at its next start (one-shot); the backup was taken by %s, and restores in %s\n", *f.job, step, pos[0],
		tiers.DescribeSaved(rep.Saved, rep.SavedRecorded), tiers.RestoredBy(rep.Saved, rep.SavedRecorded))
	if !rep.SavedRecorded {
		// Agents of early versions did not record the job's shape: a backup that lacks the
		// parts of its highest ranks looks complete for fewer nodes. The agents of the real job
		// then find it incomplete, and the pin starts the job from scratch (a black-box run).
		fmt.Fprintf(os.Stderr, "mtcfs restore-version: backup %s does not record its job's shape (an agent of an early version took it): it is complete for a job of %s only; if the job has more nodes, its agents find it incomplete and the pin starts the job from scratch\n",
			pos[0], rep.Saved)
	}
	return 0
}
