package main

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mtcfs/mtcfs/internal/jobsim"
)

var transferReceivedRE = regexp.MustCompile(`msg="peer transfer received" .*? rank=(\d+) data=(\S+) `)

// TestClusterDataParallel: a four-node job with assume-data-parallelism 2 (SPEC §4): P = 2
// columns, ranks r and r+2 hold interchangeable data, and each rank's peer is its column-mate.
// Only .meta files are exchanged — no data crosses the wire while saving. When rank 1's machine
// is replaced (agent killed, RAM gone), every node restores the same step, and rank 1 restores
// its column-mate rank 3's data, fetched from rank 3 and verified byte for byte.
func TestClusterDataParallel(t *testing.T) {
	needRoot(t)
	const (
		job      = "dp"
		nodes    = 4
		dp       = 2
		part     = nodes / dp
		replaced = 1
	)
	c, client := dataParallelCluster(t, job, nodes, dp, 60)
	ctx := repCtx(t)
	clients := make([]*jobsim.Orbax, nodes)
	c.all(t, func(r int) error {
		clients[r] = client(r)
		_, found, err := clients[r].Start(ctx)
		if err == nil && found {
			err = fmt.Errorf("a fresh job restored a step")
		}
		return err
	})
	for _, step := range []int64{10, 20} {
		c.all(t, func(r int) error { return clients[r].Save(ctx, step) })
	}
	for r := range nodes {
		mate := (r + part) % nodes
		meta := filepath.Join(c.nodes[mate].dir, fmt.Sprintf("%s-s20-n%d-w0.meta", job, r))
		repWait(t, 20*time.Second, fmt.Sprintf("rank %d's .meta of step 20 on rank %d", r, mate), func() bool { return pathExists(meta) })
		// The .meta names rank r's own data, which stays on rank r: column-mates' data differ
		// (per-process file names), and none was pushed.
		hash, err := os.ReadFile(meta)
		require.NoError(t, err)
		require.False(t, pathExists(filepath.Join(c.nodes[mate].dir, string(hash)+".data")),
			"rank %d's data of step 20 reached its column-mate %d", r, mate)
		require.True(t, replicaHeld(c.nodes[r], job, 20, r), "rank %d holds its own step 20", r)
	}
	requireOnlyMetas := func() {
		t.Helper()
		n := 0
		for r, a := range c.agents {
			for _, m := range transferReceivedRE.FindAllStringSubmatch(a.log(), -1) {
				require.Regexp(t, `\.meta$`, m[2], "rank %d received a data push from rank %s in data-parallel mode", r, m[1])
				n++
			}
			require.NotContains(t, a.log(), "early file", "rank %d: no early pushes in data-parallel mode", r)
		}
		require.Positive(t, n, "the column-mates' .meta files should have been pushed")
	}
	requireOnlyMetas()

	// Rank 1's machine is replaced: the agent dies and its RAM is gone.
	killAgent(t, c.agents[replaced])
	forceUnmount(c.nodes[replaced].dir)
	c.nodes[replaced].dropSpool(t)
	c.agents[replaced] = c.nodes[replaced].start(t)

	ctx = repCtx(t)
	c.all(t, func(r int) error {
		o := client(r)
		step, found, err := o.Start(ctx)
		if err == nil && (!found || step != 20) {
			return fmt.Errorf("restored step %d (found %v), want 20", step, found)
		}
		if err == nil {
			err = o.VerifyRestored(ctx, 20) // the bytes of the writer, own or column-mate
		}
		return err
	})
	// Who wrote each node's restored step: its own data, except the replaced node, which
	// restored its column-mate's.
	for r := range nodes {
		writer := r
		if r == replaced {
			writer = (r + part) % nodes
		}
		require.Equal(t, []string{fmt.Sprintf("ocdbt.process_%d", writer)}, stateWriters(t, c.nodes[r].dir, 20), "rank %d restored the data of the wrong writer", r)
	}
	// The coordinator inferred the replaced rank's .meta from its column-mate's.
	require.Regexp(t, `msg="restore plan" nodes=4 found=true step=20 .*inferred_metas=1 `, c.agents[0].log())
	require.Regexp(t, fmt.Sprintf(`msg="restored from a peer" data=D[0-9a-f]{64}\.data peer=%d `, (replaced+part)%nodes),
		c.agents[replaced].log())
	requireOnlyMetas()
}

// TestDataParallelBackup: SPEC §6 — in data-parallel mode only the last partition (ranks ≥
// nodes − P) uploads data, and every node's .meta names the data its column uploaded. A four-node
// job with data-parallelism 2 backs up two .data, not four; the backup verifies; when every
// node's RAM is lost, every rank restores its column's data from the backup, byte-exact. Before,
// every node uploaded its own data: D× the traffic and the storage.
func TestDataParallelBackup(t *testing.T) {
	needRoot(t)
	const (
		job   = "dpbk"
		nodes = 4
		dp    = 2
		part  = nodes / dp
	)
	c, client := dataParallelCluster(t, job, nodes, dp, 0.01)
	ctx := repCtx(t)
	c.all(t, func(r int) error {
		_, _, err := client(r).Start(ctx)
		return err
	})
	c.all(t, func(r int) error { return client(r).Save(ctx, 10) })
	name := waitCompleteBackup(t, c.nodes[0], job, 10)
	dir := filepath.Join(c.backup, job, name)
	datas, err := filepath.Glob(filepath.Join(dir, "*.data"))
	require.NoError(t, err)
	require.Len(t, datas, part, "one .data per column, uploaded by the last partition: %v", datas)
	named := func(r int) string {
		b, err := os.ReadFile(filepath.Join(dir, fmt.Sprintf("%s-s10-n%d-w0.meta", job, r)))
		require.NoError(t, err)
		return string(b)
	}
	for r := range nodes {
		uploader := nodes - part + r%part
		require.Equal(t, named(uploader), named(r), "rank %d's .meta names its column's data", r)
		require.FileExists(t, filepath.Join(dir, named(r)+".data.manifest"), "rank %d's .meta names data in the backup", r)
	}
	require.NotEqual(t, named(2), named(3), "the columns' data differ")
	out, code := runMtcfs(t, "backups", "verify", "--backup", c.nodes[0].backupURL(), "--job", job)
	require.Equal(t, 0, code, "backups verify: %s", out)
	for r := range nodes {
		require.Contains(t, c.agents[r].log(), "backup complete", "rank %d", r)
		if r < nodes-part {
			require.Contains(t, c.agents[r].log(), `msg="backup: named the column's data"`, "rank %d", r)
		}
	}

	// An agent restarts (SIGTERM) and the job with it: its spool holds its column-mate's .meta
	// without the data, as in data-parallel mode it should; the restart says nothing of it.
	// Before, every such restart told the job that .meta "was dropped when the agent restarted"
	// (found by a black-box run).
	stopAgent(t, c.agents[1])
	c.agents[1] = c.nodes[1].start(t)
	ctx = repCtx(t)
	clients := make([]*jobsim.Orbax, nodes)
	c.all(t, func(r int) error {
		clients[r] = client(r)
		return restoresStep(ctx, clients[r], 10)
	})
	for r, o := range clients {
		for _, l := range o.Errors() {
			require.NotContains(t, l, "dropped", "rank %d", r)
		}
	}

	// Every node's RAM is lost: the job restores step 10 from the backup, each rank its
	// column's data.
	for r := range nodes {
		stopAgent(t, c.agents[r])
		c.nodes[r].dropSpool(t)
	}
	for r := range nodes {
		c.agents[r] = c.nodes[r].start(t)
	}
	ctx = repCtx(t)
	c.all(t, func(r int) error {
		return restoresStep(ctx, client(r), 10)
	})
	for r := range nodes {
		require.Equal(t, []string{fmt.Sprintf("ocdbt.process_%d", nodes-part+r%part)}, stateWriters(t, c.nodes[r].dir, 10), "rank %d restored another column's data", r)
	}
}

// TestDataParallelPeersOtherThanColumns: Orbax computes peer-ranks from process indices mapped
// to node ranks (multihost.runtime_to_distributed_ids), which may differ: here ranks 0 and 1,
// and 2 and 3, hold equivalent data, while mtcfs's columns are the ranks equal mod P (0 and 2,
// 1 and 3). A black-box run of the upstream code restored rank 1 with rank 3's data (another
// partition's) after rank 1's RAM was lost, without a word, and the backup held only ranks 2
// and 3's data. Now every node whose peers are outside its column backs up its own data, and
// rank 0 takes the columns from the .meta replicas the nodes hold: rank 1 restores the data of
// rank 0, its column-mate for the job; with every node's RAM lost, each restores its own data
// from the backup.
func TestDataParallelPeersOtherThanColumns(t *testing.T) {
	needRoot(t)
	const (
		job      = "dpperm"
		nodes    = 4
		dp       = 2
		replaced = 1
	)
	c, dpClient := dataParallelCluster(t, job, nodes, dp, 0.01)
	client := func(r int) *jobsim.Orbax {
		o := dpClient(r)
		o.PeerRanks = []int{r ^ 1}
		return o
	}
	ctx := repCtx(t)
	c.all(t, func(r int) error {
		_, _, err := client(r).Start(ctx)
		return err
	})
	c.all(t, func(r int) error { return client(r).Save(ctx, 10) })
	name := waitCompleteBackup(t, c.nodes[0], job, 10)
	datas, err := filepath.Glob(filepath.Join(c.backup, job, name, "*.data"))
	require.NoError(t, err)
	require.Len(t, datas, nodes, "every node's own data: %v", datas)
	for r := range nodes {
		require.Contains(t, c.agents[r].log(), "peer-ranks name ranks outside this node's data-parallel column", "rank %d", r)
	}

	// Rank 1's machine is replaced: the agent dies and its RAM is gone.
	killAgent(t, c.agents[replaced])
	forceUnmount(c.nodes[replaced].dir)
	c.nodes[replaced].dropSpool(t)
	c.agents[replaced] = c.nodes[replaced].start(t)
	ctx = repCtx(t)
	c.all(t, func(r int) error { return restoresStep(ctx, client(r), 10) })
	for r := range nodes {
		writer := r
		if r == replaced {
			writer = r ^ 1
		}
		require.Equal(t, []string{fmt.Sprintf("ocdbt.process_%d", writer)}, stateWriters(t, c.nodes[r].dir, 10), "rank %d restored the data of the wrong writer", r)
	}
	require.Contains(t, c.agents[0].log(), "the job's peer-ranks are not mtcfs's data-parallel columns")
	require.Regexp(t, `msg="restore plan" nodes=4 found=true step=10 .*inferred_metas=1 `, c.agents[0].log())

	// Every node's RAM is lost: each rank restores its own data from the backup.
	for r := range nodes {
		stopAgent(t, c.agents[r])
		c.nodes[r].dropSpool(t)
	}
	for r := range nodes {
		c.agents[r] = c.nodes[r].start(t)
	}
	ctx = repCtx(t)
	c.all(t, func(r int) error { return restoresStep(ctx, client(r), 10) })
	for r := range nodes {
		require.Equal(t, []string{fmt.Sprintf("ocdbt.process_%d", r)}, stateWriters(t, c.nodes[r].dir, 10), "rank %d restored another rank's data from the backup", r)
	}
}

// dataParallelCluster starts nodes agents (rank r listening on 127.0.0.r+1) and returns them with
// rank r's client of a job with data-parallelism dp, whose peer is its column-mate.
func dataParallelCluster(t *testing.T, job string, nodes, dp int, backupMinutes float64) (*cluster, func(rank int) *jobsim.Orbax) {
	c := newClusterWith(t, nodes, func(r int) []string {
		return []string{"--listen", fmt.Sprintf("127.0.0.%d:0", r+1)}
	})
	return c, func(r int) *jobsim.Orbax {
		o := orbaxClient(t, c.nodes[r].dir, job, backupMinutes)
		o.Rank, o.Nodes, o.DataParallelism = r, nodes, dp
		o.PeerRanks = []int{(r + nodes/dp) % nodes}
		return o
	}
}

// stateWriters returns the process directories in step's state under dir: whose data it is.
func stateWriters(t *testing.T, dir string, step int64) []string {
	ents, err := os.ReadDir(filepath.Join(dir, fmt.Sprint(step), "state"))
	require.NoError(t, err)
	var procs []string
	for _, e := range ents {
		if e.IsDir() {
			procs = append(procs, e.Name())
		}
	}
	return procs
}
