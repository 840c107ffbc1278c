package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/internal/jobsim"
)

const clusterJob = "trio-run"

// runCluster is the multi-node part: three agents on this machine, one per node of a
// three-node job, finding each other through their shared backup location.
func (d *demo) runCluster(ctx context.Context) error {
	const n = 3
	root := filepath.Join(d.base, "cluster")
	backups := filepath.Join(root, "backups")
	dirs, spools := make([]string, n), make([]string, n)
	for r := range n {
		dirs[r], spools[r] = filepath.Join(root, fmt.Sprintf("node%d", r)), filepath.Join(root, fmt.Sprintf("spool%d", r))
		if err := os.MkdirAll(dirs[r], 0o755); err != nil {
			return err
		}
	}
	d.cluster = make([]*agentProc, n)
	start := func(r int) error {
		var err error
		d.cluster[r], err = startProc(d.bin, dirs[r], spools[r], backups)
		return err
	}
	client := func(r int) *jobsim.Orbax {
		return &jobsim.Orbax{Dir: dirs[r], Job: clusterJob, Rank: r, Nodes: n, PeerRanks: []int{(r + 1) % n},
			BackupIntervalMinutes: 0.02, Poll: 50 * time.Millisecond, Timeout: 60 * time.Second, Content: d.content}
	}
	// all runs f on every rank at once, as the job's processes do.
	all := func(f func(r int) error) error {
		var wg sync.WaitGroup
		errs := make([]error, n)
		for r := range n {
			wg.Go(func() { errs[r] = f(r) })
		}
		wg.Wait()
		return errors.Join(errs...)
	}
	restoreAll := func(want int64, what string) error {
		begin := time.Now()
		err := all(func(r int) error {
			c := client(r)
			step, found, err := c.Start(ctx)
			if err == nil && (!found || step != want) {
				err = fmt.Errorf("rank %d restored step %d (found %v), want %d", r, step, found, want)
			}
			if err == nil {
				err = c.VerifyRestored(ctx, want)
			}
			return err
		})
		if err == nil {
			note("all 3 ranks restored step %d %s and verified every byte, in %v", want, what, time.Since(begin).Round(time.Millisecond))
		}
		return err
	}

	say("7. a three-node job: three agents sharing file://%s; rank 0 coordinates, each rank replicates to the next", backups)
	for r := range n {
		if err := start(r); err != nil {
			return err
		}
	}
	clients := make([]*jobsim.Orbax, n)
	if err := all(func(r int) error {
		clients[r] = client(r)
		_, _, err := clients[r].Start(ctx)
		return err
	}); err != nil {
		return err
	}
	note("fresh start on all ranks (the agents registered in %s/%s/agents)", backups, clusterJob)
	if err := all(func(r int) error { return clients[r].Save(ctx, 100) }); err != nil {
		return err
	}
	note("all ranks saved step 100")
	if err := waitFor(30*time.Second, "a complete backup of step 100", func() bool {
		out, err := exec.Command(d.bin, "backups", "list", "--backup", "file://"+backups, "--job", clusterJob).Output()
		return err == nil && completeBackupOf(string(out), 100) != ""
	}); err != nil {
		return err
	}
	note("rank 0's clock ordered a backup of step 100; every node uploaded its part")
	d.show("mtcfs backups list", d.bin, "backups", "list", "--backup", "file://"+backups, "--job", clusterJob)
	if err := all(func(r int) error { return clients[r].Save(ctx, 200) }); err != nil {
		return err
	}
	note("all ranks saved step 200")
	replica := filepath.Join(dirs[2], clusterJob+"-s200-n1-w0.meta")
	if err := waitFor(30*time.Second, "rank 1's replica of step 200 on rank 2", func() bool {
		_, err := os.Stat(replica)
		return err == nil
	}); err != nil {
		return err
	}

	say("8. node 1 is lost: its agent is killed with SIGKILL and its RAM is gone; a new agent starts")
	d.cluster[1].kill()
	unix.Unmount(dirs[1], unix.MNT_DETACH)
	unix.Unmount(spools[1], unix.MNT_DETACH)
	os.RemoveAll(spools[1])
	if err := start(1); err != nil {
		return err
	}
	if err := restoreAll(200, "(rank 1 fetched its data from rank 2, the others from their RAM)"); err != nil {
		return err
	}

	say("9. every agent is lost: all RAM is gone; new agents start")
	for r := range n {
		d.cluster[r].stop() // a running backup gets --drain-timeout to finish
		unix.Unmount(spools[r], unix.MNT_DETACH)
		os.RemoveAll(spools[r])
	}
	// The restored step 200 is in no backup, so the coordinator ordered one at once — in the
	// next UTC minute at the earliest, since this one already has the backup of step 100.
	want, how := int64(100), "from the backup of step 100, the newest complete one (the backup ordered for the restored step 200 waits for a new UTC minute, or was cut short by the stop: incomplete backups are never restored)"
	if out, err := exec.Command(d.bin, "backups", "list", "--backup", "file://"+backups, "--job", clusterJob).Output(); err == nil && completeBackupOf(string(out), 200) != "" {
		want, how = 200, "from the backup the coordinator ordered for the restored step 200"
	}
	d.show("mtcfs backups list", d.bin, "backups", "list", "--backup", "file://"+backups, "--job", clusterJob)
	for r := range n {
		if err := start(r); err != nil {
			return err
		}
	}
	if err := restoreAll(want, how); err != nil {
		return err
	}
	for r := range n {
		d.cluster[r].stop()
		d.cluster[r] = nil
	}
	return nil
}

func waitFor(d time.Duration, what string, cond func() bool) error {
	for deadline := time.Now().Add(d); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if cond() {
			return nil
		}
	}
	return fmt.Errorf("no %s within %v", what, d)
}
