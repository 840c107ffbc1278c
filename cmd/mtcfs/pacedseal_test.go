package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/internal/jobsim"
)

// TestKillWhileSealWaitsForNextSave: kill -9 of the agent while the seal of a committed step is
// paused for the job's next save on a busy node (tiers/yield.go waitForNextSave): the next agent
// adopts the committed record (and the one after it, killed again at once), and the job restores
// the step, every byte verified. Whether the seal was still paused at the kill is logged, not
// required (it depends on the machine's timing; on the 2-CPU development VM it was, in 5 runs of
// 5 with the SCHED_IDLE spinners): the restore must hold either way.
func TestKillWhileSealWaitsForNextSave(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	n := newRepNode(t)
	n.args = []string{"--memory", "160MiB"} // room for the next save beside the restored 47 MiB (else the job is told it has none)
	const job = "paced"
	a := n.start(t)
	o := orbaxClient(t, n.dir, job, 60)
	o.Content = jobsim.Content{Files: 3000, FileSize: 16 << 10}
	_, _, err := o.Start(ctx)
	require.NoError(t, err)

	// Busy CPUs, so that less than a CPU idles (busyCPUs).
	stopSpinning := busyCPUs(t)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var once sync.Once
	halt := func() { once.Do(func() { close(stop); wg.Wait(); stopSpinning() }) }
	t.Cleanup(halt)
	require.NoError(t, o.Save(ctx, 10))
	// The next save, at once: a file every millisecond.
	wg.Go(func() {
		next := filepath.Join(n.dir, "20.orbax-checkpoint-tmp")
		_ = os.Mkdir(next, 0o755)
		for i := 0; ; i++ {
			_ = os.WriteFile(filepath.Join(next, fmt.Sprintf("f%d", i)), []byte("next"), 0o644)
			select {
			case <-stop:
				return
			case <-time.After(time.Millisecond):
			}
		}
	})
	time.Sleep(300 * time.Millisecond)
	meta := filepath.Join(n.dir, fmt.Sprintf("%s-s10-n0-w0.meta", job))
	t.Logf("step 10 sealed before the kill: %v", pathExists(meta))
	killAgent(t, a)
	halt()

	b := n.start(t)
	require.Contains(t, b.log(), "adopted from spool")
	// A second failure right after the first recovery: the next agent adopts again.
	killAgent(t, b)
	c := n.start(t)
	require.Contains(t, c.log(), "adopted from spool")
	o2 := orbaxClient(t, n.dir, job, 60)
	o2.Content = o.Content
	step, found, err := o2.Start(ctx)
	require.NoError(t, err)
	require.True(t, found && step == 10, "restored step %d (found %v), want 10", step, found)
	require.NoError(t, o2.VerifyRestored(ctx, 10))
	require.Empty(t, o2.Errors())
}

// busyCPUs starts a spinning process per CPU at SCHED_IDLE and returns what stops them (also
// called at the test's end). /proc/stat counts their time as busy, so the agent sees less than a
// CPU idle, but every other task runs first: spinning threads of the test process itself took
// its Ps and starved the packages CI tests beside it, opening the timing windows of their tests.
func busyCPUs(t *testing.T) (stop func()) {
	var cmds []*exec.Cmd
	var once sync.Once
	stop = func() {
		once.Do(func() {
			for _, c := range cmds {
				_ = c.Process.Kill()
				_ = c.Wait()
			}
		})
	}
	t.Cleanup(stop)
	for range runtime.NumCPU() {
		c := exec.Command("sh", "-c", "while :; do :; done")
		// Killed with the test binary too (a -timeout panic runs no cleanup).
		c.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		require.NoError(t, c.Start())
		cmds = append(cmds, c)
		require.NoError(t, unix.SchedSetAttr(c.Process.Pid, &unix.SchedAttr{Policy: unix.SCHED_IDLE}, 0))
	}
	return stop
}
