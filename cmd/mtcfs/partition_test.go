package main

// A network partition between real agents: every agent runs in a network namespace of its own
// (nsenter --net, so that its FUSE mount stays in the test's mount namespace, which `ip netns
// exec` would not: it unshares the mount namespace and remounts /sys), and the namespaces are
// wired to a bridge in a hub namespace by veth pairs. Cutting one node's veth on the hub side
// partitions it from the others.

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mtcfs/mtcfs/internal/jobsim"
	"github.com/mtcfs/mtcfs/tiers"
)

// netLab is a hub namespace with a bridge and one namespace per node, 10.77.0.(i+1)/24.
type netLab struct {
	t     *testing.T
	hub   string
	nodes []string // namespace names
	hubIf []string // each node's veth end on the bridge
}

func ipCmd(args ...string) error {
	out, err := exec.Command("ip", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// newNetLab builds the namespaces, or skips the test when that is not possible here. Cleanup
// deletes them (veth pairs go with them) also when the test fails; register it before the
// agents so that it runs after they are killed.
func newNetLab(t *testing.T, n int) *netLab {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root for network namespaces and mounts")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("needs the ip command (iproute2) for network namespaces")
	}
	if _, err := exec.LookPath("nsenter"); err != nil {
		t.Skip("needs nsenter (util-linux) to run agents in a network namespace")
	}
	id := fmt.Sprintf("%d", os.Getpid()%100000)
	lab := &netLab{t: t, hub: "mtcfs-hub-" + id}
	if err := ipCmd("netns", "add", lab.hub); err != nil {
		t.Skipf("ip netns is not available here: %v", err)
	}
	t.Cleanup(lab.destroy)
	must := func(args ...string) {
		t.Helper()
		require.NoError(t, ipCmd(args...))
	}
	must("-n", lab.hub, "link", "add", "br0", "type", "bridge")
	must("-n", lab.hub, "link", "set", "br0", "up")
	for i := range n {
		ns := fmt.Sprintf("mtcfs-n%d-%s", i, id)
		hubIf, nodeIf := fmt.Sprintf("mth%d-%s", i, id), fmt.Sprintf("mtn%d-%s", i, id)
		must("netns", "add", ns)
		lab.nodes = append(lab.nodes, ns)
		lab.hubIf = append(lab.hubIf, hubIf)
		must("link", "add", hubIf, "netns", lab.hub, "type", "veth", "peer", "name", nodeIf, "netns", ns)
		must("-n", lab.hub, "link", "set", hubIf, "master", "br0")
		must("-n", lab.hub, "link", "set", hubIf, "up")
		must("-n", ns, "addr", "add", lab.addr(i)+"/24", "dev", nodeIf)
		must("-n", ns, "link", "set", nodeIf, "up")
		must("-n", ns, "link", "set", "lo", "up")
	}
	return lab
}

func (l *netLab) addr(i int) string { return fmt.Sprintf("10.77.0.%d", i+1) }

// prefix runs a command in node i's network namespace, in the test's mount namespace.
func (l *netLab) prefix(i int) []string {
	return []string{"nsenter", "--net=/var/run/netns/" + l.nodes[i], "--"}
}

// cut and heal take node i's link to the bridge down and up.
func (l *netLab) cut(i int) {
	require.NoError(l.t, ipCmd("-n", l.hub, "link", "set", l.hubIf[i], "down"))
}
func (l *netLab) heal(i int) {
	require.NoError(l.t, ipCmd("-n", l.hub, "link", "set", l.hubIf[i], "up"))
}

func (l *netLab) destroy() {
	for _, ns := range append([]string{l.hub}, l.nodes...) {
		if err := ipCmd("netns", "del", ns); err != nil {
			l.t.Logf("cleanup: %v", err)
		}
	}
}

// nsStatus asks agent a, running in node i's namespace, for its status (its HTTP endpoint is
// only reachable there).
func (l *netLab) nsStatus(t *testing.T, i int, a *agent) tiers.Status {
	t.Helper()
	argv := append(l.prefix(i), binPath, "status", "--json", "--http", agentHTTPAddr(t, a))
	out, err := exec.Command(argv[0], argv[1:]...).CombinedOutput()
	require.NoError(t, err, "mtcfs status in %s: %s", l.nodes[i], out)
	var replies []statusReply
	require.NoError(t, json.Unmarshal(out, &replies), "status --json: %s", out)
	require.Len(t, replies, 1)
	return replies[0].Status
}

// TestPartition: a three-node job on three network namespaces. Rank 2's link is cut mid-run:
// the job keeps saving (every rank still commits and seals its steps locally), the steps saved
// during the partition are reported not replicated (their sync fails after the lag timeout,
// shortened with MTCFS_SYNC_LAG_TIMEOUT), and latest_replicated_step stays at the last step
// before the cut. After healing, later steps replicate again, and a job restart restores the
// same verified step on every node.
func TestPartition(t *testing.T) {
	lab := newNetLab(t, 3)
	t.Setenv(syncLagTimeoutEnv, "3s")
	const job = "part"
	c := &cluster{backup: t.TempDir()}
	for i := range 3 {
		node := newRepNode(t)
		node.backupRoot = c.backup
		node.prefix = lab.prefix(i)
		node.args = []string{"--listen", lab.addr(i) + ":0", "--http", "127.0.0.1:0"}
		c.nodes = append(c.nodes, node)
		c.agents = append(c.agents, node.start(t))
	}
	client := func(r int) *jobsim.Orbax {
		o := orbaxClient(t, c.nodes[r].dir, job, 60)
		o.Rank, o.Nodes = r, 3
		o.PeerRanks = []int{(r + 1) % 3}
		return o
	}
	// Longer than repCtx: the pushes of step 20 are tried again only 30 s after they failed.
	ctx, cancel := context.WithTimeout(context.Background(), 240*time.Second)
	defer cancel()
	clients := make([]*jobsim.Orbax, 3)
	c.all(t, func(r int) error {
		clients[r] = client(r)
		_, found, err := clients[r].Start(ctx)
		if err == nil && found {
			err = fmt.Errorf("a fresh job restored something")
		}
		return err
	})
	replicated := func(step int64) func() bool {
		return func() bool {
			for i, a := range c.agents {
				if lab.nsStatus(t, i, a).Replicated < step {
					return false
				}
			}
			return true
		}
	}
	save := func(step int64) {
		t.Helper()
		c.all(t, func(r int) error { return clients[r].Save(ctx, step) })
	}
	save(10)
	repWait(t, 30*time.Second, "step 10 replicated on every node", replicated(10))

	// Partition rank 2. Saves go on and commit locally.
	const cut = 2
	lab.cut(cut)
	save(20)
	for r := range 3 {
		meta := filepath.Join(c.nodes[r].dir, fmt.Sprintf("%s-s20-n%d-w0.meta", job, r))
		repWait(t, 60*time.Second, fmt.Sprintf("rank %d to seal step 20 during the partition", r), func() bool { return pathExists(meta) })
	}
	// The coordinator gives step 20 up: rank 2 never reports it (or its peers never got it).
	failed := regexp.MustCompile(`msg="(sync failed|step not replicated)" step=20 `)
	repWait(t, 60*time.Second, "the coordinator to fail step 20", func() bool { return failed.MatchString(c.agents[0].log()) })
	for _, i := range []int{0, 1} {
		// latest_committed_step moves only once the step's replication attempts are over.
		repWait(t, 60*time.Second, fmt.Sprintf("rank %d to report step 20 committed", i), func() bool {
			return lab.nsStatus(t, i, c.agents[i]).Committed >= 20
		})
		require.EqualValues(t, 10, lab.nsStatus(t, i, c.agents[i]).Replicated, "rank %d: step 20 was saved during the partition", i)
	}
	repWait(t, 60*time.Second, "rank 0 to report the failed sync or replication in replicator.errors", func() bool {
		errs := strings.Join(lab.nsStatus(t, 0, c.agents[0]).Errors, "\n")
		return strings.Contains(errs, "step 20")
	})

	// Heal. Before the job saves again, the pushes of step 20 that failed are tried again
	// (30 s after the first try, then less often): the peers of rank 2 and of rank 1 get the
	// replicas they lacked, though the coordinator gave step 20 up.
	lab.heal(cut)
	for _, r := range []int{1, 2} {
		peer := (r + 1) % 3
		replica := filepath.Join(c.nodes[peer].dir, fmt.Sprintf("%s-s20-n%d-w0.meta", job, r))
		// 150 s: on a loaded machine the heal may come after the first later try (30 s), so
		// the one after it (60 s later) brings the replica.
		repWait(t, 150*time.Second, fmt.Sprintf("rank %d's push of step 20 to rank %d tried again after healing", r, peer),
			func() bool { return pathExists(replica) })
	}

	// Later steps replicate again (the first ones may still meet connections in backoff).
	var last int64
	deadline := time.Now().Add(60 * time.Second)
	for step := int64(30); ; step += 10 {
		save(step)
		last = step
		ok := false
		wait := time.Now().Add(8 * time.Second)
		for time.Now().Before(wait) && !ok {
			ok = replicated(step)()
			time.Sleep(100 * time.Millisecond)
		}
		if ok {
			break
		}
		require.True(t, time.Now().Before(deadline), "no step replicated within 60s after healing the partition (last tried %d)\nrank 0:\n%s", step, c.agents[0].log())
	}
	t.Logf("step %d replicated after healing", last)

	// The job restarts: every node restores the same step, at least the replicated one.
	steps := make([]int64, 3)
	c.all(t, func(r int) error {
		o := client(r)
		step, found, err := o.Start(ctx)
		if err != nil {
			return err
		}
		if !found {
			return fmt.Errorf("nothing restored")
		}
		steps[r] = step
		return o.VerifyRestored(ctx, step)
	})
	require.Equal(t, []int64{steps[0], steps[0], steps[0]}, steps, "every rank restores the same step")
	require.GreaterOrEqual(t, steps[0], last)
}
