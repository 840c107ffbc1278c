package replication

import (
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mtcfs/mtcfs/internal/testpki"
)

// TestTLSRefusalSaysWhy: a client whose certificate the server's CA did not sign learns so from
// its call's error, every time. Under TLS 1.3 the server verifies the client's certificate after
// the client's side of the handshake is done; its alert then races the client's first writes,
// which fail with a broken pipe when the server has already closed. The error must still carry
// the server's alert (the intruder's agent warns "refused by TLS" from it).
func TestTLSRefusalSaysWhy(t *testing.T) {
	ca := testpki.NewCA(t, "job CA")
	other := testpki.NewCA(t, "another CA")
	p := startTLSPeer(t, newTestTLS(t, ca, "agent-0"))
	certPEM, keyPEM := other.Issue(t, "intruder")
	// Signed by another CA; trusts it and the job's CA.
	cfgs, err := NewTLS(certPEM, keyPEM, append(append([]byte(nil), other.PEM...), ca.PEM...))
	require.NoError(t, err)
	_, client := cfgs.TransportCredentials(nil)
	var unclear []string
	for i := range 40 {
		err := abandon(t, p.addr, client, peerSecret)
		require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
		if i < 3 {
			t.Logf("call error: %v", err)
		}
		if !isTLSRefusal(err) {
			unclear = append(unclear, err.Error())
		}
	}
	require.Empty(t, unclear, "calls refused by TLS whose error does not say so")
}
