package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// TestYAMLWrittenBeforeTheMount: a job that wrote replicator.yaml into the mount directory while
// no agent was mounted on it (a restarted job between the detach of its dead agent's mount and
// the successor's mount, or a job started before its agent) waits for its .restore, and the mount
// hides the file from it. The agent answers that yaml as if written through the mount, removes
// it from under the mount, and reports the other entries it hides; an invalid one is reported
// in replicator.failed as usual, and one older than hiddenYAMLMaxAge is only reported.
func TestYAMLWrittenBeforeTheMount(t *testing.T) {
	needRoot(t)
	n := newRepNode(t)
	yaml := "job-name: gap\nframework: orbax\nnode-rank: 0\nnodes: 1\npeer-ranks: []\nbackup-interval-minutes: 600\n"
	require.NoError(t, os.WriteFile(filepath.Join(n.dir, "replicator.yaml"), []byte(yaml), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(n.dir, "stray"), []byte("x"), 0o644))
	require.NoError(t, os.Mkdir(filepath.Join(n.dir, "lost+found"), 0o700)) // a file system's own: not told
	a := n.start(t)
	repWait(t, 10*time.Second, "the fresh-start marker", func() bool {
		return pathExists(filepath.Join(n.dir, "gap-s0-n0-w0.restore"))
	})
	assert.Contains(t, a.log(), "answering a replicator.yaml written into the mount directory")
	assert.Contains(t, a.log(), "the mount hides entries")
	assert.Contains(t, a.log(), "stray")
	// The job is told too (a run's checkpoints left there were hidden in silence: a black-box run).
	hidden, err := os.ReadFile(filepath.Join(n.dir, "replicator.errors"))
	require.NoError(t, err)
	assert.Contains(t, string(hidden), "the mount directory held 1 entry before the agent mounted on it (stray): the mount hides them from the job")
	stopAgent(t, a)
	ents, err := os.ReadDir(n.dir)
	require.NoError(t, err)
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	assert.Equal(t, []string{"lost+found", "stray"}, names, "the hidden yaml is removed once answered; other entries stay")

	// An invalid yaml written the same way is answered with replicator.failed.
	require.NoError(t, os.WriteFile(filepath.Join(n.dir, "replicator.yaml"), []byte("job-name: gap\nframework: orbax\nbackup-interval-minutes: 600\n"), 0o644))
	b := n.start(t)
	repWait(t, 10*time.Second, "replicator.failed", func() bool {
		data, err := os.ReadFile(filepath.Join(n.dir, "replicator.failed"))
		return err == nil && len(data) > 0
	})
	errs, err := os.ReadFile(filepath.Join(n.dir, "replicator.failed"))
	require.NoError(t, err)
	assert.Contains(t, string(errs), "nodes: required", "the missing key is named\n%s", b.log())
	stopAgent(t, b)
	assert.NoFileExists(t, filepath.Join(n.dir, "replicator.yaml"))

	// One left from long ago is not answered (its handshake would end the spool's job): it is
	// reported and left where it is.
	old := filepath.Join(n.dir, "replicator.yaml")
	require.NoError(t, os.WriteFile(old, []byte(strings.ReplaceAll(yaml, "gap", "ancient")), 0o644))
	long := time.Now().Add(-2 * hiddenYAMLMaxAge)
	require.NoError(t, os.Chtimes(old, long, long))
	c := n.start(t)
	assert.Contains(t, c.log(), "too old to answer")
	time.Sleep(300 * time.Millisecond)
	assert.NoFileExists(t, filepath.Join(n.dir, "ancient-s0-n0-w0.restore"))
	stopAgent(t, c)
	assert.FileExists(t, old)
}

// TestYAMLWrittenBeforeAFailedStart: an agent whose start fails after it took in a hidden
// replicator.yaml leaves that yaml under the mount, and the next agent answers it. Before, the
// yaml was removed as soon as it was taken in, so a job that wrote it while no agent was mounted
// waited for a .restore no later agent would give. Each start here fails on a spool left by a
// killed agent with a regular file where a directory belongs: spool/meta makes the replicator's
// start fail, spool/peer-incoming the peer service's.
func TestYAMLWrittenBeforeAFailedStart(t *testing.T) {
	needRoot(t)
	n := newRepNode(t)
	yaml := "job-name: again\nframework: orbax\nnode-rank: 0\nnodes: 1\npeer-ranks: []\nbackup-interval-minutes: 600\n"
	hidden := filepath.Join(n.dir, "replicator.yaml")
	for _, blocked := range []string{"meta", "peer-incoming"} {
		// A killed agent: its mount detached (as kubelet or the next agent does), its spool kept.
		a := n.start(t)
		killAgent(t, a)
		require.NoError(t, unix.Unmount(n.dir, unix.MNT_DETACH))
		require.True(t, isMounted(n.spool), "a killed agent's spool stays mounted")
		require.NoError(t, os.RemoveAll(filepath.Join(n.spool, blocked)))
		require.NoError(t, os.WriteFile(filepath.Join(n.spool, blocked), nil, 0o600))
		require.NoError(t, os.WriteFile(hidden, []byte(yaml), 0o644))

		out, code := runBounded(t, 30*time.Second, "mount", n.dir, "--spool", n.spool, "--memory", "64MiB", "--backup", n.backupURL())
		require.Equal(t, 1, code, "the start with spool/%s a file should fail\n%s", blocked, out)
		assert.Contains(t, out, "answering a replicator.yaml written into the mount directory", "the yaml was taken in before the failure")
		assert.Contains(t, out, filepath.Join(n.spool, blocked)+": not a directory")
		assert.Contains(t, out, "stays there for the next agent")
		assert.False(t, isMounted(n.dir), "the failed start unmounted")
		got, err := os.ReadFile(hidden)
		require.NoError(t, err, "the yaml must stay under the mount after a failed start (spool/%s)\n%s", blocked, out)
		assert.Equal(t, yaml, string(got))
		if isMounted(n.spool) {
			require.NoError(t, unix.Unmount(n.spool, unix.MNT_DETACH))
		}
		require.NoError(t, os.RemoveAll(n.spool))
	}

	// The next agent that starts answers the yaml and removes it from under the mount.
	c := n.start(t)
	repWait(t, 10*time.Second, "the fresh-start marker", func() bool {
		return pathExists(filepath.Join(n.dir, "again-s0-n0-w0.restore"))
	})
	stopAgent(t, c)
	assert.NoFileExists(t, hidden)
}
