package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/mtcfs/mtcfs/internal/agents"
	"github.com/mtcfs/mtcfs/internal/report"
	"github.com/mtcfs/mtcfs/tiers"
)

// mtcfs spool list|free: the kept spools (tiers.Spools, SPEC §10).

const spoolSynopsis = "mtcfs spool list [--json] | mtcfs spool free PATH|--orphaned"

// localSpools are this machine's spools, with the running agents from the local agent registry.
var localSpools = tiers.Spools{Users: func() ([]tiers.SpoolUser, error) {
	list, err := agents.Local()
	if err != nil {
		return nil, fmt.Errorf("agent registry %s: %w", agents.Dir(), err)
	}
	users := make([]tiers.SpoolUser, 0, len(list))
	for _, a := range list {
		users = append(users, tiers.SpoolUser{PID: a.PID, SpoolDir: a.SpoolDir})
	}
	return users, nil
}}

func cmdSpool(args []string) int {
	if len(args) == 0 || (args[0] != "list" && args[0] != "free") {
		return subcommandUsage("spool", spoolSynopsis, args)
	}
	if args[0] == "list" {
		return cmdSpoolList(args[1:])
	}
	return cmdSpoolFree(args[1:])
}

func cmdSpoolList(args []string) int {
	fset := newFlagSet("spool list", "mtcfs spool list [--json]")
	asJSON := fset.Bool("json", false, "print JSON")
	pos, err := parseFlags(fset, args)
	if err != nil {
		return flagError(fset, err)
	}
	if len(pos) != 0 {
		return flagError(fset, fmt.Errorf("unexpected argument %q", pos[0]))
	}
	spools, err := localSpools.List()
	if err != nil {
		fmt.Fprintln(os.Stderr, "mtcfs spool list:", err)
		return 1
	}
	if *asJSON {
		if spools == nil {
			spools = []tiers.SpoolInfo{}
		}
		out, _ := json.MarshalIndent(spools, "", "  ")
		fmt.Println(string(out))
		return 0
	}
	report.Spools(os.Stdout, spools)
	return 0
}

func cmdSpoolFree(args []string) int {
	fset := newFlagSet("spool free", "mtcfs spool free PATH|--orphaned")
	orphaned := fset.Bool("orphaned", false, "free every spool not in use whose mount directory no longer exists")
	pos, err := parseFlags(fset, args)
	if err != nil {
		return flagError(fset, err)
	}
	switch {
	case *orphaned && len(pos) > 0:
		return flagError(fset, errors.New("give a PATH or --orphaned, not both"))
	case !*orphaned && len(pos) != 1:
		return flagError(fset, errors.New("want one PATH (a mount path or a spool directory), or --orphaned"))
	}
	spools, err := localSpools.List()
	if err != nil {
		fmt.Fprintln(os.Stderr, "mtcfs spool free:", err)
		return 1
	}
	var targets []tiers.SpoolInfo
	if *orphaned {
		for _, s := range spools {
			if s.Orphaned() && !s.InUse {
				targets = append(targets, s)
			}
		}
		if len(targets) == 0 {
			fmt.Println("no orphaned spools: every kept spool's mount directory still exists (mtcfs spool list shows them)")
			return 0
		}
	} else if targets, err = localSpools.Find(pos[0], spools); err != nil {
		fmt.Fprintln(os.Stderr, "mtcfs spool free:", err)
		return 1
	}
	code := 0
	for _, s := range targets {
		s = localSpools.Settle(s, 10*time.Second) // an agent killed a moment ago is still exiting
		owner, _ := tiers.ReadOwner(s.Dir)
		if err := tiers.FreeSpool(s); err != nil {
			fmt.Fprintln(os.Stderr, "mtcfs spool free:", err)
			code = 1
			continue
		}
		fmt.Printf("freed spool %s (%s)\n", s.Dir, s.Describe())
		if len(s.Steps) > 0 {
			// The newest step may have been in no backup yet (a black-box run freed its only
			// copy and was told nothing).
			fmt.Printf("note: step(s) %s of job %s were in it: only a peer's replica or a backup, if any, holds them now (mtcfs backups list --backup URL --job %s shows the backups)\n",
				tiers.JoinSteps(s.Steps), s.Job, s.Job)
		}
		if run := owner.Running; run != nil && s.MountState == tiers.MountExists {
			// The record went with the spool: the next agent cannot tell the job.
			fmt.Printf("note: the agent of %s last answered job %s (incarnation %s, rank %d, since %s): if that job still runs, restart it; the next agent does not checkpoint its saves, and no longer knows to tell it\n",
				owner.MountPath, owner.Job, run.Incarnation, run.Rank, run.Since.Format(time.RFC3339))
		}
	}
	return code
}
