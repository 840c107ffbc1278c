package replication

import (
	"bytes"
	"io/fs"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/mtcfs/mtcfs/replication/peerpb"
)

// TestCallsAreCheckedBeforeTheirMessageIsRead: the agent's peer server refuses a call whose
// credentials are missing or wrong, or name a job whose secret it does not hold (a job it has
// not joined), from the call's headers, before its message is read, and never makes a secret
// for a job a caller names. Checked only in the handlers, a stranger's 25 MB messages were read
// whole first (40 of them took the agent to 1.45 GB), and a call naming any job made the agent
// create that job's secret in the backup location (a black-box run).
func TestCallsAreCheckedBeforeTheirMessageIsRead(t *testing.T) {
	objects := dirObjects(t, t.TempDir())
	a := startTestAgent(t, objects, t.TempDir())
	client := coordinatorClient(t, a.node.Addr())
	// A message larger than any request a job makes: refused all the same, from the headers.
	big := &peerpb.NegotiateRequest{Caller: &peerpb.Caller{Incarnation: strings.Repeat("x", 8<<20)}}
	call := func(opts ...grpc.CallOption) error {
		_, err := client.Negotiate(t.Context(), big, opts...)
		return err
	}
	as := func(job string, secret []byte) grpc.CallOption {
		return grpc.PerRPCCredentials(Credentials(Identity{Job: job, Incarnation: "inc", Rank: 1, Instance: "stranger"}, secret))
	}
	noSecret := func(job string) {
		t.Helper()
		_, err := objects.Get(t.Context(), job+"/"+secretName, secretLimit)
		assert.ErrorIs(t, err, fs.ErrNotExist, "a secret of job %s made for a caller", job)
	}

	err := call()
	assert.Equal(t, codes.Unauthenticated, status.Code(err), "%v", err)
	err = call(as("stranger", bytes.Repeat([]byte{7}, SecretSize)))
	assert.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
	assert.Contains(t, status.Convert(err).Message(), `has not joined job "stranger"`)
	noSecret("stranger")

	// The job this agent joined (its secret read from the location): the right secret gets
	// through to the service, which finds the request wanting; another secret does not.
	const job = "mine"
	secret, err := a.node.secrets.get(t.Context(), job)
	require.NoError(t, err)
	err = call(as(job, bytes.Repeat([]byte{7}, SecretSize)))
	assert.Equal(t, codes.Unauthenticated, status.Code(err), "%v", err)
	assert.Contains(t, status.Convert(err).Message(), "wrong MAC")
	_, err = client.Negotiate(t.Context(), &peerpb.NegotiateRequest{}, as(job, secret))
	assert.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
	assert.Contains(t, a.log.String(), "peer call refused")
	assert.EqualValues(t, 3, a.node.PeerStats().CallsRefused, "the refusals counted (mtcfs_peer_calls_refused_total)")
}

// coordinatorClient calls the coordinator service at addr with no credentials of its own.
func coordinatorClient(t *testing.T, addr string) peerpb.CoordinatorClient {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	return peerpb.NewCoordinatorClient(conn)
}

// TestRefusalsAreLoggedAFewAMinute: the refused calls of a minute are logged one by one up to
// refusalBurst, then counted in one line at the minute's end (a line per refusal made 20,000
// lines in 3.5 s of a stranger's calls).
func TestRefusalsAreLoggedAFewAMinute(t *testing.T) {
	t.Parallel()
	var out logBuffer
	l := &refusalLog{log: slog.New(slog.NewTextHandler(&out, nil)), every: 200 * time.Millisecond}
	now := time.Now()
	for i := range 3 * refusalBurst {
		l.note(now, "n", i)
	}
	assert.Equal(t, refusalBurst, strings.Count(out.String(), "peer call refused"))
	require.Eventually(t, func() bool {
		return strings.Contains(out.String(), "more peer calls refused, not logged one by one")
	}, 10*time.Second, 10*time.Millisecond)
	assert.Contains(t, out.String(), "count=20")
	assert.Contains(t, out.String(), "call.n=29", "the last one")
	// A new window logs again.
	l.note(now.Add(time.Second), "n", 100)
	assert.Equal(t, refusalBurst+1, strings.Count(out.String(), "peer call refused"))
}

// TestAWrongMACHasTheSecretCheckedAgain: a call refused for a wrong MAC has the agent check the
// job's secret against the location (when the last check is a minute old): one made anew there
// is taken. The services' lookup did so for every call; refused before it, a stale secret kept
// refusing the job's calls (a review).
func TestAWrongMACHasTheSecretCheckedAgain(t *testing.T) {
	objects := dirObjects(t, t.TempDir())
	a := startTestAgent(t, objects, t.TempDir())
	client := coordinatorClient(t, a.node.Addr())
	const job = "mine"
	_, err := a.node.secrets.get(t.Context(), job)
	require.NoError(t, err)
	a.node.secrets.mu.Lock()
	a.node.secrets.recheck = 0 // every refusal finds the check due
	a.node.secrets.mu.Unlock()
	fresh := bytes.Repeat([]byte{9}, SecretSize)
	require.NoError(t, objects.Put(t.Context(), job+"/"+secretName, fresh))
	as := grpc.PerRPCCredentials(Credentials(Identity{Job: job, Incarnation: "inc", Rank: 1, Instance: "other"}, fresh))
	require.Eventually(t, func() bool {
		_, err := client.Negotiate(t.Context(), &peerpb.NegotiateRequest{}, as)
		return status.Code(err) == codes.InvalidArgument // through to the service
	}, 10*time.Second, 50*time.Millisecond)
	a.node.secrets.checks.Wait()
	assert.Contains(t, a.log.String(), "this agent uses it from now on")
}
