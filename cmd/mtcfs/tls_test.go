package main

import (
	"context"
	"errors"
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
	"github.com/mtcfs/mtcfs/internal/testpki"
)

// TestPeerTLSFlagErrors: the three --peer-tls-* flags go together, and unreadable files, files
// without the PEM they should hold, a key of another certificate and a certificate the CA did
// not sign end with a message and exit status 2, before anything is mounted.
func TestPeerTLSFlagErrors(t *testing.T) {
	base := t.TempDir()
	spool := filepath.Join(base, "spool")
	pki := t.TempDir()
	ca := testpki.NewCA(t, "job CA")
	good := ca.WriteFiles(t, pki, "agent")
	foreign := testpki.NewCA(t, "another CA").WriteFiles(t, pki, "foreign")
	junk := filepath.Join(pki, "junk.pem")
	require.NoError(t, os.WriteFile(junk, []byte("-----BEGIN NOTHING-----\n"), 0o600))
	missing := filepath.Join(pki, "missing.pem")
	tlsArgs := func(cert, key, ca string) []string {
		return []string{"--peer-tls-cert", cert, "--peer-tls-key", key, "--peer-tls-ca", ca}
	}
	const together = "--peer-tls-cert, --peer-tls-key and --peer-tls-ca go together"
	cases := []struct {
		name string
		args []string
		want string
	}{
		{"cert alone", []string{"--peer-tls-cert", good.Cert}, together},
		{"key alone", []string{"--peer-tls-key", good.Key}, together},
		{"no CA", []string{"--peer-tls-cert", good.Cert, "--peer-tls-key", good.Key}, together},
		{"CA alone", []string{"--peer-tls-ca", good.CA}, together},
		{"unreadable cert", tlsArgs(missing, good.Key, good.CA), "--peer-tls-*: certificate: open " + missing},
		{"unreadable key", tlsArgs(good.Cert, missing, good.CA), "--peer-tls-*: key: open " + missing},
		{"unreadable CA", tlsArgs(good.Cert, good.Key, missing), "--peer-tls-*: CA: open " + missing},
		{"cert not PEM", tlsArgs(junk, good.Key, good.CA), "certificate and key: tls: failed to find any PEM data in certificate input"},
		{"CA not PEM", tlsArgs(good.Cert, good.Key, junk), "CA: no PEM CERTIFICATE block"},
		{"key of another cert", tlsArgs(good.Cert, foreign.Key, good.CA), "private key does not match public key"},
		{"cert of another CA", tlsArgs(foreign.Cert, foreign.Key, good.CA), "does not verify against the CA"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			out, err := exec.Command(binPath, append([]string{"mount", base, "--spool", spool}, tc.args...)...).CombinedOutput()
			var ee *exec.ExitError
			require.True(t, errors.As(err, &ee), "want a failing exit, got %v\n%s", err, out)
			require.Equal(t, 2, ee.ExitCode(), "%s", out)
			require.Contains(t, string(out), tc.want)
			require.Contains(t, string(out), "Usage: mtcfs mount", "a flag error shows the usage")
			require.False(t, isMounted(base), "nothing is mounted after a flag error")
		})
	}

	out, code := runMtcfs(t, "mount", "--help")
	require.Equal(t, 0, code, out)
	for _, want := range []string{"-peer-tls-cert", "-peer-tls-key", "-peer-tls-ca", "[--peer-tls-cert F --peer-tls-key F --peer-tls-ca F]"} {
		require.Contains(t, out, want)
	}
}

// TestClusterMutualTLS: three agents with certificates of the job's CA (naming no address)
// run a job over mutual TLS: the ranks negotiate, replicate to their peers and restore. An
// agent whose certificate another CA signed — though it trusts the job's CA and shares the
// backup location, so it has the per-job secret — cannot join: the rank-0 agent refuses its
// handshakes and logs why, and its start-up never gets a restore marker. The job goes on.
func TestClusterMutualTLS(t *testing.T) {
	needRoot(t)
	pki := t.TempDir()
	ca := testpki.NewCA(t, "job trio CA")
	c := newClusterWith(t, 3, func(r int) []string {
		files := ca.WriteFiles(t, pki, fmt.Sprintf("agent-%d", r))
		return append([]string{"--listen", fmt.Sprintf("127.0.0.%d:0", r+1)}, files.Args()...)
	})
	for r, a := range c.agents {
		require.Regexp(t, `msg="peer service" .*tls=true`, a.log(), "rank %d", r)
	}
	withPeers := func(o *jobsim.Orbax) *jobsim.Orbax {
		o.PeerRanks = []int{(o.Rank + 1) % 3}
		return o
	}
	ctx := repCtx(t)
	clients := make([]*jobsim.Orbax, 3)
	c.all(t, func(r int) error {
		clients[r] = withPeers(c.client(t, r))
		_, _, err := clients[r].Start(ctx)
		return err
	})
	c.all(t, func(r int) error { return clients[r].Save(ctx, 10) })
	for r := range 3 {
		peer := (r + 1) % 3
		repWait(t, 20*time.Second, fmt.Sprintf("rank %d's replica on rank %d", r, peer), func() bool {
			return replicaHeld(c.nodes[peer], "trio", 10, r)
		})
		received := regexp.MustCompile(fmt.Sprintf(`peer transfer received" .*rank=%d data=D[0-9a-f]{64}\.data `, r))
		repWait(t, 10*time.Second, fmt.Sprintf("rank %d to log the transfer from rank %d", peer, r),
			func() bool { return received.MatchString(c.agents[peer].log()) })
	}
	for r, a := range c.agents {
		require.NotContains(t, a.log(), "TLS handshake failed", "rank %d", r)
	}

	// Rank 2's agent dies; an intruder takes its place with a certificate of another CA. It
	// trusts the job's CA too, so the refusal is the rank-0 agent's verdict on its certificate.
	killAgent(t, c.agents[2])
	other := testpki.NewCA(t, "another CA")
	intruderNode := newRepNode(t)
	intruderNode.backupRoot = c.backup
	intruderNode.args = append([]string{"--listen", "127.0.0.4:0"}, other.WriteFiles(t, pki, "intruder", ca.PEM).Args()...)
	intruder := intruderNode.start(t)
	o := withPeers(orbaxClient(t, intruderNode.dir, "trio", 60))
	o.Rank, o.Nodes = 2, 3
	ictx, cancel := context.WithTimeout(context.Background(), 6*time.Second)
	defer cancel()
	_, _, err := o.Start(ictx)
	require.Error(t, err, "the intruder's start-up must not get a restore marker")
	repWait(t, 10*time.Second, "the rank-0 agent to log the intruder's refused handshake", func() bool {
		return strings.Contains(c.agents[0].log(), "peer connection refused: TLS handshake failed")
	})
	require.Regexp(t, `msg="peer connection refused: TLS handshake failed" peer=\S+ err=.*certificate signed by unknown authority`, c.agents[0].log())
	// The intruder says why it cannot join: its calls are refused by TLS (a warning, retried).
	require.Contains(t, intruder.log(), "coordinator call refused by TLS, retrying")
	require.NotContains(t, c.agents[0].log(), "peer call refused", "the intruder's calls never got past TLS")
	require.NotContains(t, c.agents[0].log(), "coordinator call refused", "the intruder's calls never got past TLS")
	killAgent(t, intruder)

	// Rank 2's own agent comes back (adopting its spool): the job restarts and every rank
	// restores step 10, verified.
	c.agents[2] = c.nodes[2].start(t)
	ctx = repCtx(t)
	c.all(t, func(r int) error {
		return restoresStep(ctx, withPeers(c.client(t, r)), 10)
	})
}
