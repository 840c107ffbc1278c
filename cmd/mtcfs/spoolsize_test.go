package main

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mtcfs/mtcfs/internal/jobsim"
)

// TestRestartWithASmallerMemoryBudget: an agent restarted with a --memory below what its kept
// spool holds (a pod given less memory) refuses to start, saying how much the spool holds and
// the two ways on (it said "resize spool tmpfs …: invalid argument (is more already in use?)").
// Starting would leave no room for the job's next save, since the restored step stays in RAM
// until a newer one is complete. Nothing is lost: the next agent with enough memory restores
// the step from RAM.
func TestRestartWithASmallerMemoryBudget(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	n := newRepNode(t)
	const job = "shrink"
	big := jobsim.Content{Files: 4, FileSize: 10 << 20}

	a := n.start(t) // --memory 64MiB
	o := orbaxClient(t, n.dir, job, 30)
	o.Content = big
	_, found, err := o.Start(ctx)
	require.NoError(t, err)
	require.False(t, found)
	require.NoError(t, o.Save(ctx, 1))
	waitStepSealed(t, n.dir, job, 1)
	stopAgent(t, a)
	require.True(t, isMounted(n.spool), "the spool holding step 1 is kept")

	out, code := runBounded(t, 30*time.Second, "mount", n.dir, "--spool", n.spool, "--memory", "24MiB", "--backup", n.backupURL())
	require.Equal(t, 1, code, out)
	assert.Contains(t, out, "the kept spool at "+n.spool+" holds 40.")
	assert.Contains(t, out, "more than the memory budget (--memory) of 24.0MiB")
	assert.Contains(t, out, "start with --memory 81.0MiB or more (twice what it holds")
	assert.Contains(t, out, "mtcfs spool free "+n.dir)
	assert.False(t, isMounted(n.dir), "nothing is served")
	require.True(t, isMounted(n.spool), "the spool is kept")

	b := n.start(t, "--memory", "81MiB") // what the message advised
	o = orbaxClient(t, n.dir, job, 30)
	o.Content = big
	step, found, err := o.Start(ctx)
	require.NoError(t, err)
	require.True(t, found, "nothing restored\n%s", b.log())
	require.EqualValues(t, 1, step)
	require.NoError(t, o.VerifyRestored(ctx, 1))
	require.NoError(t, o.Save(ctx, 2), "the advised budget leaves room for the next save\n%s", b.log())
	stopAgent(t, b)
}
