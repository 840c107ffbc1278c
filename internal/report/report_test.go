package report

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mtcfs/mtcfs/gcsbackend"
	"github.com/mtcfs/mtcfs/internal/agents"
	"github.com/mtcfs/mtcfs/tiers"
)

func TestStatus(t *testing.T) {
	info := agents.Info{PID: 42, Dir: "/ckpt", HTTP: "127.0.0.1:9100", Version: "v1", Passthrough: true}
	spool := tiers.SpoolStatus{Dir: "/dev/shm/s", Budget: 4 << 30, Used: 1 << 30}

	var idle strings.Builder
	Status(&idle, info, tiers.Status{Spool: spool, Replicated: -1})
	assert.Equal(t, `agent pid 42, v1, mount /ckpt (passthrough true), http 127.0.0.1:9100
  spool      /dev/shm/s: 1GiB of 4GiB used
  backups    none
  job        none yet (waiting for replicator.yaml)
`, idle.String())

	var running strings.Builder
	Status(&running, info, tiers.Status{Incarnation: "inc", Job: "j", Framework: "orbax", Rank: 1, Nodes: 2, Phase: "running",
		Restored: 10, Committed: 30, Replicated: 20, Spool: spool, BackupStore: "file:///b", LastBackup: "2026-12-02_10-00",
		Steps:  []tiers.StepInRAM{{Step: 30, Rank: 1, Data: "Dabc.data"}},
		Backup: &tiers.ProgressView{Kind: "backup", Step: 30, Backup: "2026-12-02_11-00", Started: time.Now(), Done: 1 << 20, Total: 4 << 20},
		RePush: &tiers.RePushView{Step: 30, To: []int{0, 3}, Failed: 2, Next: time.Now().Add(61 * time.Second)},
		Pushing: []tiers.PushView{{Step: 30, Rank: 0, Started: time.Now().Add(-12 * time.Second), Attempt: 1},
			{Step: 30, Rank: 3, Started: time.Now().Add(-3 * time.Second), Attempt: 2}},
		Syncing: &tiers.SyncingView{Step: 31, Since: time.Now().Add(-72 * time.Second)},
		Errors:  []string{"step 20: sync failed"}})
	out := running.String()
	for _, want := range []string{
		"  backups    file:///b (last: 2026-12-02_10-00)\n",
		"  job        j (orbax), node 1/2, incarnation inc, running\n",
		"  steps      restored 10, latest committed 30, latest replicated on every node 20\n",
		"  in RAM     step 30 node 1: Dabc.data\n",
		"  backup     step 30 to 2026-12-02_11-00: 1.0MiB of 4.0MiB (25%), running 0s\n",
		"  re-push    step 30 to rank 0, 3: 2 tries failed, next in 1m1s\n",
		"  replicate  step 30 to rank 0: running 12s\n",
		"  replicate  step 30 to rank 3: running 3s, try 2\n",
		"  syncing    step 31 with the coordinator (rank 0): waiting 1m12s for every node's report of it; the steps committed since wait behind it, their pushes too\n",
		"  error      step 20: sync failed\n",
	} {
		assert.Contains(t, out, want)
	}

	// The newest step in no backup yet: said on the backups line (a job that saved once, its
	// interval not over, had it in RAM only, with no word anywhere).
	for _, inRAMOnly := range []*int64{new(int64(12)), nil} {
		var b strings.Builder
		Status(&b, info, tiers.Status{Spool: spool, BackupStore: "file:///b", InRAMOnly: inRAMOnly, Committed: -1, Replicated: -1})
		assert.Equal(t, inRAMOnly != nil, strings.Contains(b.String(), "  backups    file:///b; step 12 in RAM only, not in a backup yet\n"), "%v:\n%s", inRAMOnly, b.String())
	}

	// A job that has committed nothing yet: not "latest committed 0", which is a step.
	var fresh strings.Builder
	Status(&fresh, info, tiers.Status{Incarnation: "inc", Job: "j", Framework: "orbax", Rank: 0, Nodes: 1, Phase: "running",
		Committed: -1, Replicated: -1, Spool: spool})
	assert.Contains(t, fresh.String(), "  steps      restored 0, latest committed none yet, latest replicated on every node none yet\n")

	// A sync that knows the ranks it waits for names them (black-box h58).
	var named strings.Builder
	Status(&named, info, tiers.Status{Spool: spool, Replicated: -1,
		Syncing: &tiers.SyncingView{Step: 57, Since: time.Now().Add(-73 * time.Second), WaitingFor: "2 of 3 nodes reported it to the coordinator (rank 0); not yet rank 2"}})
	assert.Contains(t, named.String(), "  syncing    step 57 with the coordinator (rank 0): waiting 1m13s: 2 of 3 nodes reported it to the coordinator (rank 0); not yet rank 2; the steps committed since wait behind it, their pushes too\n")

	// A backup whose size is not known yet (its files not listed): no "0B of 0B (0%)".
	var starting strings.Builder
	Status(&starting, info, tiers.Status{Spool: spool, Replicated: -1,
		Backup: &tiers.ProgressView{Kind: "backup", Step: 30, Backup: "2026-12-02_11-00", Started: time.Now()}})
	assert.Contains(t, starting.String(), "  backup     step 30 to 2026-12-02_11-00: 0B so far, running 0s\n")

	// A restore whose source stopped answering says so (black-box h58: a peer stopped mid-transfer
	// showed "60.0MiB of 100.1MiB (60%), running 15s", nothing more).
	var stalled strings.Builder
	Status(&stalled, info, tiers.Status{Spool: spool, Replicated: -1,
		Restore: &tiers.ProgressView{Kind: "restore", Step: 31, Source: "peer 1", Started: time.Now().Add(-30 * time.Second),
			Done: 60 << 20, Total: 100 << 20, LastMoved: time.Now().Add(-20 * time.Second)}})
	assert.Contains(t, stalled.String(), "  restore    step 31 peer 1: 60.0MiB of 100.0MiB (60%), no byte moved for 20s (the source may not answer), running 30s\n")

	// A committed step whose record is tried again, then one recorded whose hash is.
	for recorded, want := range map[bool]string{
		false: "  sealing    step 31 worker 1, committed 12s ago: its record could not be written (open x: too many open files), 5 tries; " +
			"tried again for 1m48s more (then it is lost: a restart restores the step before it)\n",
		true: "  sealing    step 31 worker 1, committed 12s ago: recorded, its hash failed (open x: too many open files), 5 tries; " +
			"tried again for 1m48s more (then its record waits for the agent's next start)\n",
	} {
		var b strings.Builder
		now := time.Now()
		Status(&b, info, tiers.Status{Spool: spool, Replicated: -1, Sealing: &tiers.SealTryView{Step: 31, Worker: 1,
			Committed: now.Add(-12 * time.Second), Recorded: recorded, Tries: 5, Err: "open x: too many open files", Until: now.Add(108*time.Second + 400*time.Millisecond)}})
		assert.Contains(t, b.String(), want)
	}
}

func TestSpools(t *testing.T) {
	var none strings.Builder
	Spools(&none, nil)
	assert.Equal(t, "no mtcfs spools on this machine\n", none.String())

	var b strings.Builder
	Spools(&b, []tiers.SpoolInfo{
		{Dir: "/dev/shm/a", MountPath: "/ckpt", Job: "j", Steps: []int64{10, 20}, Bytes: 2 << 20, InUse: true, AgentPID: 7, MountState: tiers.MountExists},
		{Dir: "/dev/shm/b", Bytes: 0, MountState: tiers.MountUnknown},
	})
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	require.Len(t, lines, 4)
	assert.Equal(t, []string{"SPOOL", "MOUNT", "PATH", "JOB", "STEPS", "USED", "AGENT", "MOUNT", "DIR"}, strings.Fields(lines[0]))
	assert.Equal(t, []string{"/dev/shm/a", "/ckpt", "j", "10,20", "2.0MiB", "serving", "(pid", "7)", "exists"}, strings.Fields(lines[1]))
	assert.Equal(t, []string{"/dev/shm/b", "?", "-", "-", "0B", "none", "unknown"}, strings.Fields(lines[2]))
	assert.Contains(t, lines[3], "mtcfs spool free --orphaned", "a spool no agent serves can be freed: the hint says how")
}

// stoppedStore is a backup location whose every listing fails with its context's error: a
// command given up (--timeout) or interrupted (Ctrl-C) while it verifies.
type stoppedStore struct{ gcsbackend.ObjectStore }

func (stoppedStore) List(ctx context.Context, prefix, delimiter string) ([]gcsbackend.ObjectAttrs, []string, error) {
	return nil, nil, ctx.Err()
}

// TestBackupsStopsWhenItsContextEnds: verify interrupted reports not-ok and prints no row for
// the backups it did not reach (it printed "error … context canceled" for each, which said
// nothing about them; a black-box run); the command says it was interrupted.
func TestBackupsStopsWhenItsContextEnds(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	var out strings.Builder
	ok := Backups(ctx, &out, &gcsbackend.Backups{Store: stoppedStore{}}, "train", []string{"2026-12-05_10-00", "2026-12-05_11-00"}, true, "")
	assert.False(t, ok, "an interrupted verify does not pass")
	assert.NotContains(t, out.String(), "context canceled")
	assert.NotContains(t, out.String(), "2026-12-05_10-00")
}
