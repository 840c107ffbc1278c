// Package report prints what the mtcfs commands show people: an agent's status, the kept
// spools and the backups of a job. The commands in cmd/mtcfs parse flags and fetch; the text
// lives here, where its tests are.
package report

import (
	"context"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/mtcfs/mtcfs/gcsbackend"
	"github.com/mtcfs/mtcfs/internal/agents"
	"github.com/mtcfs/mtcfs/tiers"
)

// Status prints an agent's /status document (mtcfs status).
func Status(w io.Writer, info agents.Info, st tiers.Status) {
	fmt.Fprintf(w, "agent pid %d, %s, mount %s (passthrough %v), http %s\n", info.PID, info.Version, info.Dir, info.Passthrough, info.HTTP)
	fmt.Fprintf(w, "  spool      %s: %s of %s used\n", st.Spool.Dir, tiers.FormatSize(st.Spool.Used), tiers.FormatSize(st.Spool.Budget))
	store := st.BackupStore
	if store == "" {
		store = "none"
	}
	fmt.Fprintf(w, "  backups    %s", store)
	if st.LastBackup != "" {
		fmt.Fprintf(w, " (last: %s)", st.LastBackup)
	}
	if st.InRAMOnly != nil {
		// Until a backup takes it, the newest step lives in RAM only (a job that saved once, an
		// agent stopped before the interval: a black-box run found no word of it anywhere).
		fmt.Fprintf(w, "; step %d in RAM only, not in a backup yet", *st.InRAMOnly)
	}
	fmt.Fprintln(w)
	if st.Incarnation == "" {
		fmt.Fprintln(w, "  job        none yet (waiting for replicator.yaml)")
	} else {
		fmt.Fprintf(w, "  job        %s (%s), node %d/%d, incarnation %s, %s\n", st.Job, st.Framework, st.Rank, st.Nodes, st.Incarnation, st.Phase)
		if st.Waiting != "" {
			fmt.Fprintf(w, "  waiting    %s\n", st.Waiting)
		}
		fmt.Fprintf(w, "  steps      restored %d, latest committed %s, latest replicated on every node %s\n", st.Restored, stepOrNone(st.Committed), stepOrNone(st.Replicated))
	}
	for _, s := range st.Steps {
		fmt.Fprintf(w, "  in RAM     step %d node %d: %s\n", s.Step, s.Rank, s.Data)
	}
	for _, p := range []*tiers.ProgressView{st.Restore, st.Backup} {
		if p == nil {
			continue
		}
		what := p.Source
		if p.Kind == "backup" {
			what = "to " + p.Backup
		}
		// The size is known once the step's files are listed; before, "0B of 0B (0%)".
		moved := fmt.Sprintf("%s so far", tiers.FormatSize(p.Done))
		if p.Total > 0 {
			moved = fmt.Sprintf("%s of %s (%.0f%%)", tiers.FormatSize(p.Done), tiers.FormatSize(p.Total), 100*float64(p.Done)/float64(p.Total))
		}
		if stalled := tiers.Stalled(p.LastMoved, time.Now()); stalled != "" && !p.LastMoved.IsZero() {
			moved += ", " + stalled
		}
		fmt.Fprintf(w, "  %-10s step %d %s: %s, running %v\n", p.Kind, p.Step, what, moved, time.Since(p.Started).Round(time.Second))
	}
	if sv := st.Sealing; sv != nil {
		what, then := "its record could not be written", "then it is lost: a restart restores the step before it"
		if sv.Recorded {
			what, then = "recorded, its hash failed", "then its record waits for the agent's next start"
		}
		fmt.Fprintf(w, "  sealing    step %d worker %d, committed %v ago: %s (%s), %d tries; tried again for %v more (%s)\n",
			sv.Step, sv.Worker, time.Since(sv.Committed).Round(time.Second), what, sv.Err, sv.Tries, max(time.Until(sv.Until), 0).Round(time.Second), then)
	}
	for _, p := range st.Pushing {
		try := ""
		if p.Attempt > 1 {
			try = fmt.Sprintf(", try %d", p.Attempt)
		}
		fmt.Fprintf(w, "  %-10s step %d to rank %d: running %v%s\n", "replicate", p.Step, p.Rank, time.Since(p.Started).Round(time.Second), try)
	}
	if rp := st.RePush; rp != nil {
		tries := fmt.Sprintf("%d tries failed", rp.Failed)
		if rp.Failed == 1 {
			tries = "1 try failed"
		}
		next := fmt.Sprintf("next in %v", max(time.Until(rp.Next), 0).Round(time.Second))
		if rp.Trying {
			next = "trying again now"
		}
		fmt.Fprintf(w, "  re-push    step %d to rank %s: %s, %s\n", rp.Step, joinInts(rp.To), tries, next)
	}
	if s := st.Syncing; s != nil {
		what := " for every node's report of it"
		if s.WaitingFor != "" {
			what = ": " + s.WaitingFor
		}
		fmt.Fprintf(w, "  syncing    step %d with the coordinator (rank 0): waiting %v%s; the steps committed since wait behind it, their pushes too\n",
			s.Step, time.Since(s.Since).Round(time.Second), what)
	}
	for _, e := range st.Errors {
		fmt.Fprintf(w, "  error      %s\n", e)
	}
}

// Spools prints the kept spools of this machine (mtcfs spool list).
func Spools(w io.Writer, spools []tiers.SpoolInfo) {
	if len(spools) == 0 {
		fmt.Fprintln(w, "no mtcfs spools on this machine")
		return
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "SPOOL\tMOUNT PATH\tJOB\tSTEPS\tUSED\tAGENT\tMOUNT DIR")
	freeable := false
	for _, s := range spools {
		mp, job, steps, agent := s.MountPath, s.Job, "-", "none"
		if mp == "" {
			mp = "?"
		}
		if job == "" {
			job = "-"
		}
		if len(s.Steps) > 0 {
			parts := make([]string, len(s.Steps))
			for i, st := range s.Steps {
				parts[i] = strconv.FormatInt(st, 10)
			}
			steps = strings.Join(parts, ",")
		}
		switch {
		case s.InUse && s.AgentPID > 0:
			agent = fmt.Sprintf("serving (pid %d)", s.AgentPID)
		case s.InUse:
			agent = "serving"
		default:
			freeable = true
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", s.Dir, mp, job, steps, tiers.FormatSize(s.Bytes), agent, s.MountState)
	}
	tw.Flush()
	if freeable {
		fmt.Fprintln(w, "free one with: mtcfs spool free MOUNT-PATH|SPOOL; all whose mount directory is gone: mtcfs spool free --orphaned")
	}
}

// Backups verifies the named backups of job (deep: every chunk read and checked, as mtcfs
// backups verify does) and prints one row each, with the problems found when deep; pinned
// names the backup restore.version pins (""). It reports whether every backup was complete
// and readable.
func Backups(ctx context.Context, w io.Writer, b *gcsbackend.Backups, job string, names []string, deep bool, pinned string) bool {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "BACKUP\tSTATUS\tSTEPS\tNODES×WORKERS\tNOTE")
	ok := true
	var problems []string // printed below the table, so that they do not widen its columns
	for _, name := range names {
		rep, err := b.Verify(ctx, job, name, gcsbackend.VerifyOptions{Deep: deep})
		if err != nil && ctx.Err() != nil {
			// Given up (--timeout) or interrupted: the caller says so below the table; a row of
			// "context canceled" said nothing about the backup.
			ok = false
			break
		}
		if err != nil {
			fmt.Fprintf(tw, "%s\terror\t\t\t%v\n", name, err)
			ok = false
			continue
		}
		status := "complete"
		switch {
		case rep.Damaged():
			status, ok = "DAMAGED", false
		case !rep.Complete():
			status, ok = "INCOMPLETE", false
		}
		var steps []string
		for _, s := range rep.Steps {
			mark := ""
			switch {
			case s.Damaged:
				mark = "(damaged)"
			case !s.Complete:
				mark = "(incomplete)"
			}
			steps = append(steps, fmt.Sprintf("%d%s", s.Step, mark))
			if deep || s.Damaged {
				probs := append([]string(nil), s.Problems...)
				sort.Strings(probs)
				for _, p := range probs {
					problems = append(problems, fmt.Sprintf("%s step %d: %s", name, s.Step, p))
				}
			}
		}
		var notes []string
		if pinned != "" && pinned == name {
			notes = append(notes, "pinned by restore.version")
		}
		if status == "INCOMPLETE" {
			// An upload still running looks like one cut short: say which it may be.
			if last, err := b.LastWrite(ctx, job, name); err == nil && !last.IsZero() {
				if age := time.Since(last); age < gcsbackend.RecentWrite {
					notes = append(notes, fmt.Sprintf("written %v ago: an upload may still be running, or was cut short (the agents' logs say)", age.Round(time.Second)))
				} else {
					notes = append(notes, "an upload cut short (mtcfs backups delete "+name+" removes it)")
				}
			}
		}
		note := strings.Join(notes, "; ")
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d×%d\t%s\n", name, status, strings.Join(steps, ","), rep.Nodes, rep.Workers, note)
	}
	tw.Flush()
	if len(problems) > 0 {
		fmt.Fprintln(w)
		for _, p := range problems {
			fmt.Fprintln(w, p)
		}
	}
	return ok
}

// joinInts renders ranks as "1, 2".
func joinInts(ns []int) string {
	parts := make([]string, len(ns))
	for i, n := range ns {
		parts[i] = strconv.Itoa(n)
	}
	return strings.Join(parts, ", ")
}

// stepOrNone writes a step, or "none yet" for -1 (no step yet: step 0 is a step).
func stepOrNone(step int64) string {
	if step < 0 {
		return "none yet"
	}
	return fmt.Sprint(step)
}
