package main

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestPeerFlagErrors: bad --advertise and --peers values (and a bad MTCFS_SYNC_LAG_TIMEOUT) end
// with a message naming the flag and the problem, and exit status 2, before anything is
// mounted.
func TestPeerFlagErrors(t *testing.T) {
	base := t.TempDir()
	spool := filepath.Join(base, "spool")
	cases := []struct {
		name string
		args []string
		env  string
		want string
	}{
		{"advertise without port", []string{"--advertise", "10.0.0.1"}, "", `--advertise "10.0.0.1": want HOST:PORT`},
		{"advertise without host", []string{"--advertise", ":8470"}, "", "with a host other agents can reach"},
		{"advertise port 0", []string{"--advertise", "10.0.0.1:0"}, "", `port "0": want a number from 1 to 65535`},
		{"advertise port not a number", []string{"--advertise", "10.0.0.1:http"}, "", `port "http"`},
		{"peers without =", []string{"--peers", "0=127.0.0.1:1,127.0.0.2:2"}, "", `entry "127.0.0.2:2": want RANK=HOST:PORT`},
		{"peers negative rank", []string{"--peers", "-1=127.0.0.1:1"}, "", `rank "-1" is not a number ≥ 0`},
		{"peers rank not a number", []string{"--peers", "one=127.0.0.1:1"}, "", `rank "one" is not a number ≥ 0`},
		{"peers duplicate rank", []string{"--peers", "0=127.0.0.1:1,1=127.0.0.2:2,0=127.0.0.3:3"}, "", "rank 0 is given twice"},
		{"peers bad address", []string{"--peers", "0=127.0.0.1:1,1=127.0.0.2"}, "", `entry "1=127.0.0.2": address "127.0.0.2": want HOST:PORT`},
		{"peers port out of range", []string{"--peers", "0=127.0.0.1:70000"}, "", `port "70000": want a number from 1 to 65535`},
		{"peers empty entry", []string{"--peers", "0=127.0.0.1:1,,1=127.0.0.2:2"}, "", "empty entry"},
		{"lag timeout", nil, "MTCFS_SYNC_LAG_TIMEOUT=soon", `MTCFS_SYNC_LAG_TIMEOUT="soon": want a positive duration`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cmd := exec.Command(binPath, append([]string{"mount", base, "--spool", spool}, tc.args...)...)
			if tc.env != "" {
				cmd.Env = append(cmd.Environ(), tc.env)
			}
			out, err := cmd.CombinedOutput()
			var ee *exec.ExitError
			require.True(t, errors.As(err, &ee), "want a failing exit, got %v\n%s", err, out)
			require.Equal(t, 2, ee.ExitCode(), "%s", out)
			require.Contains(t, string(out), tc.want)
			require.Contains(t, string(out), "Usage: mtcfs mount", "a flag error shows the usage")
			require.False(t, isMounted(base), "nothing is mounted after a flag error")
		})
	}
}

// TestHelpShowsPeerFlags: --help documents both flags.
func TestHelpShowsPeerFlags(t *testing.T) {
	out, code := runMtcfs(t, "mount", "--help")
	require.Equal(t, 0, code, out)
	for _, want := range []string{"-advertise", "-peers", "RANK=HOST:PORT", "[--advertise HOST:PORT]"} {
		require.Contains(t, out, want)
	}
}

// freeAddrs reserves n free ports on host and returns them as HOST:PORT (released at once; a
// test that races another process for one fails visibly at --listen).
func freeAddrs(t *testing.T, hosts ...string) []string {
	t.Helper()
	var addrs []string
	for _, h := range hosts {
		ln, err := net.Listen("tcp", h+":0")
		require.NoError(t, err)
		addrs = append(addrs, ln.Addr().String())
		ln.Close()
	}
	return addrs
}

// TestStaticPeers: agents given --peers find each other without the registry: each has a
// backup location of its own (so no registration is visible to the others) and the secret
// comes from --peer-secret-file. The job negotiates, replicates to peers and restores.
func TestStaticPeers(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	secret := filepath.Join(t.TempDir(), "secret")
	require.NoError(t, os.WriteFile(secret, []byte("static-peers-test-secret-0123456789\n"), 0o600))
	// Loopback addresses no other test binds: between freeAddrs and the agents' --listen, a
	// port of 127.0.0.1 could be taken by any test of another package.
	addrs := freeAddrs(t, "127.0.0.21", "127.0.0.22", "127.0.0.23")
	var peers []string
	for r, a := range addrs {
		peers = append(peers, fmt.Sprintf("%d=%s", r, a))
	}
	c := &cluster{}
	for r := range 3 {
		node := newRepNode(t) // its own backup location
		node.args = []string{"--listen", addrs[r], "--peers", strings.Join(peers, ","), "--peer-secret-file", secret}
		c.nodes = append(c.nodes, node)
		c.agents = append(c.agents, node.start(t))
	}
	start := func(want int64) {
		c.all(t, func(r int) error {
			o := c.client(t, r)
			o.PeerRanks = []int{(r + 1) % 3}
			step, found, err := o.Start(ctx)
			if err == nil && (found != (want >= 0) || (found && step != want)) {
				err = fmt.Errorf("restored step %d (found %v), want %d", step, found, want)
			}
			if err == nil && found {
				err = o.VerifyRestored(ctx, want)
			}
			if err == nil && want < 0 {
				err = o.Save(ctx, 10)
			}
			return err
		})
	}
	start(-1)
	for r := range 3 {
		replica := filepath.Join(c.nodes[(r+1)%3].dir, fmt.Sprintf("trio-s10-n%d-w0.meta", r))
		repWait(t, 20*time.Second, fmt.Sprintf("rank %d's replica on its peer", r), func() bool { return pathExists(replica) })
	}
	start(10)
	for r := range 3 {
		// Each agent still registers itself, in its own backup location.
		require.FileExists(t, filepath.Join(c.nodes[r].backupRoot, "trio", "agents", fmt.Sprintf("%d.json", r)))
		require.NoFileExists(t, filepath.Join(c.nodes[r].backupRoot, "trio", "agents", fmt.Sprintf("%d.json", (r+1)%3)))
	}
}

// TestFlagErrorIsSaidOnceAndLast: a bad flag prints the command's usage once and the problem as
// the last line. Before, the problem sat between two copies of the usage (line 56 of 111 for
// mount; found by a black-box run).
func TestFlagErrorIsSaidOnceAndLast(t *testing.T) {
	for _, args := range [][]string{
		{"mount", t.TempDir(), "--drain-timeout", "5"},
		{"mount", t.TempDir(), "--bogus"},
		{"backups", "list", "--job", "j", "--nope"},
		{"mount", ""},
	} {
		out, code := runMtcfs(t, args...)
		require.Equal(t, 2, code, "%v\n%s", args, out)
		assert.Equal(t, 1, strings.Count(out, "Usage: mtcfs "), "%v: the usage once\n%s", args, out)
		assert.NotContains(t, out, "Flags:", "%v: the synopsis, not every flag before the problem", args)
		assert.Contains(t, out, "--help describes the flags", args)
		lines := strings.Split(strings.TrimSpace(out), "\n")
		assert.Regexp(t, `^mtcfs (mount|backups list): .*(invalid value "5" for flag -drain-timeout|flag provided but not defined: -bogus|flag provided but not defined: -nope|the mount directory is empty \(an unset variable\?\))`, lines[len(lines)-1], "%v: the problem last", args)
	}
	out, code := runMtcfs(t, "mount", "-h")
	assert.Equal(t, 0, code)
	assert.Equal(t, 1, strings.Count(out, "Usage: mtcfs mount"), out)
	assert.Contains(t, out, "Flags:\n", "--help describes every flag")
	assert.Contains(t, out, "-peer-compress", "--help describes every flag")
}

// TestUnknownSubcommandIsNamed: a command with subcommands names a word it does not know (it
// printed only its synopsis), asks for one when none is given, and its --help exits 0 (backups
// and restore-version exited 2, spool 0) and says where the flags are described.
func TestUnknownSubcommandIsNamed(t *testing.T) {
	for _, cmd := range []string{"backups", "spool", "restore-version"} {
		out, code := runMtcfs(t, cmd, "bogus")
		assert.Equal(t, 2, code, out)
		assert.Contains(t, out, "mtcfs "+cmd+": unknown subcommand \"bogus\"")
		out, code = runMtcfs(t, cmd)
		assert.Equal(t, 2, code, out)
		assert.Contains(t, out, "mtcfs "+cmd+": a subcommand is needed")
		out, code = runMtcfs(t, cmd, "--help")
		assert.Equal(t, 0, code, out)
		assert.Contains(t, out, "Usage: mtcfs "+cmd)
		// It printed the synopsis alone: where the flags are described was left to guess.
		assert.Contains(t, out, "(mtcfs "+cmd+" SUBCOMMAND --help describes its flags)")
	}
}
