package main

import (
	"bytes"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

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

// TestFreedStepHeldMappedIsTold: a job that keeps the files of a step mapped (torch.load with
// mmap=True does) after the agent freed that step keeps their RAM, and its saves then fail with
// ENOSPC within a budget sized as documented; it is told once the mapping outlives the free by
// a few seconds (a black-box run: ENOSPC, and nothing in replicator.errors or status).
func TestFreedStepHeldMappedIsTold(t *testing.T) {
	needRoot(t)
	// With passthrough the mapping maps the spool file, and the kernel releases the handle at
	// the descriptor's close: only the processes' maps tell. Without, the handle stays open. A
	// descriptor kept open (a reader, no mapping) holds the handle in both.
	for _, c := range []struct {
		passthrough string
		mapped      bool
	}{{"auto", true}, {"off", true}, {"auto", false}} {
		name := "passthrough " + c.passthrough + map[bool]string{true: ", mapped", false: ", open"}[c.mapped]
		t.Run(name, func(t *testing.T) { testFreedStepHeldMappedIsTold(t, c.passthrough, c.mapped) })
	}
}

func testFreedStepHeldMappedIsTold(t *testing.T, passthrough string, mapped bool) {
	ctx := repCtx(t)
	n := newRepNode(t)
	const job = "mapped"
	a := n.start(t, "--passthrough", passthrough) // --memory 64MiB
	o := orbaxClient(t, n.dir, job, 60)
	o.Content = jobsim.Content{Files: 2, FileSize: 10 << 20} // a step: 20 of the 64 MiB
	_, _, err := o.Start(ctx)
	require.NoError(t, err)
	const told = "are still open or mapped by a process"
	const heldOpenAfter = 5 * time.Second // tiers.heldOpenAfter
	errorsText := func() string {
		b, _ := os.ReadFile(filepath.Join(n.dir, "replicator.errors"))
		return string(b)
	}

	// Steps 1 and 2: step 1 is freed with nothing holding it. (Nothing is looked for then: the
	// RAM is less than half full. What is counted, and what not, is fs's TestFreedButOpen.)
	require.NoError(t, o.Save(ctx, 1))
	waitStepSealed(t, n.dir, job, 1)
	require.NoError(t, o.Save(ctx, 2))
	waitStepSealed(t, n.dir, job, 2)
	repWait(t, 10*time.Second, "step 1 freed", func() bool { return !pathExists(metaPath(n.dir, job, 1)) })

	// The job maps the files of step 2, as torch.load(mmap=True) does, and closes their
	// descriptors.
	hash, err := os.ReadFile(metaPath(n.dir, job, 2))
	require.NoError(t, err)
	var maps, want [][]byte
	var open []*os.File
	unmap := sync.OnceFunc(func() {
		for _, m := range maps {
			unix.Munmap(m)
		}
		for _, f := range open {
			f.Close()
		}
	})
	t.Cleanup(unmap) // before the agent's cleanup: a mapping keeps the mount busy
	require.NoError(t, filepath.WalkDir(filepath.Join(n.dir, strings.TrimSpace(string(hash))+".data"), func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		f, err := os.Open(p)
		require.NoError(t, err)
		st, err := f.Stat()
		require.NoError(t, err)
		if st.Size() == 0 { // holds no RAM, and is not counted
			return f.Close()
		}
		if !mapped {
			open = append(open, f)
			return nil
		}
		defer f.Close()
		m, err := unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ, unix.MAP_SHARED)
		require.NoError(t, err)
		maps, want = append(maps, m), append(want, bytes.Clone(m))
		return nil
	}))
	held := len(maps)
	if !mapped {
		held = len(open)
	}
	require.GreaterOrEqual(t, held, 2, "step 2's files held")

	require.NoError(t, o.Save(ctx, 3))
	repWait(t, 10*time.Second, "step 2 freed", func() bool { return !pathExists(metaPath(n.dir, job, 2)) })
	repWait(t, heldOpenAfter+10*time.Second, "the job told of the mapped freed step", func() bool { return strings.Contains(errorsText(), told) })
	assert.Contains(t, errorsText(), fmt.Sprintf("%d file(s) of checkpoints this node freed or the job deleted (20.", held))
	assert.Contains(t, a.log(), told)
	for i := range maps {
		assert.True(t, bytes.Equal(want[i], maps[i]), "a mapping reads the freed file as it was")
	}
	unmap()
	stopAgent(t, a)
}
