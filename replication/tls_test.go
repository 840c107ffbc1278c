package replication

import (
	"bytes"
	"context"
	"crypto/tls"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/mtcfs/mtcfs/internal/syncbuf"
	"github.com/mtcfs/mtcfs/internal/testpki"
	"github.com/mtcfs/mtcfs/replication/peerpb"
)

// tlsPeer is a Receiver served with mutual TLS; refused handshakes are logged into log.
type tlsPeer struct {
	addr   string
	sealed string
	log    *syncbuf.Buffer
}

func startTLSPeer(t *testing.T, cfgs TLSConfigs) *tlsPeer {
	t.Helper()
	p := &tlsPeer{sealed: t.TempDir(), log: &syncbuf.Buffer{}}
	logger := slog.New(slog.NewTextHandler(p.log, nil))
	r, err := NewReceiver(ReceiverConfig{
		Dir:         filepath.Join(t.TempDir(), "incoming"),
		Secrets:     StaticSecret(peerJob, peerSecret),
		MaxIncoming: 1 << 30,
		Logger:      logger,
		Accept: func(_ context.Context, job string, rank int, dataName, path string) error {
			return os.Rename(path, filepath.Join(p.sealed, dataName))
		},
		Lookup: func(_ context.Context, job, dataName string) (string, error) {
			return filepath.Join(p.sealed, dataName), nil
		},
	})
	require.NoError(t, err)
	server, _ := cfgs.TransportCredentials(logger)
	srv := grpc.NewServer(append(ServerOptions(), grpc.Creds(server))...)
	r.Register(srv)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p.addr = ln.Addr().String()
	go srv.Serve(ln)
	t.Cleanup(func() {
		srv.Stop()
		r.Close()
	})
	return p
}

func newTestTLS(t *testing.T, ca *testpki.CA, cn string) TLSConfigs {
	t.Helper()
	certPEM, keyPEM := ca.Issue(t, cn)
	cfgs, err := NewTLS(certPEM, keyPEM, ca.PEM)
	require.NoError(t, err)
	return cfgs
}

// abandon makes one authenticated unary call to the peer at addr over creds and returns its
// error.
func abandon(t *testing.T, addr string, creds credentials.TransportCredentials, secret []byte) error {
	t.Helper()
	conn, err := grpc.NewClient(addr, append(DialOptions(), grpc.WithTransportCredentials(creds))...)
	require.NoError(t, err)
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	id := Identity{Job: peerJob, Incarnation: "inc-1", Rank: 1, Instance: "instance-1"}
	_, err = peerpb.NewPeerClient(conn).Abandon(ctx, &peerpb.AbandonRequest{TransferId: "none"},
		grpc.PerRPCCredentials(Credentials(id, secret)))
	return err
}

// TestTLSPushAndFetch: two agents with certificates of the job's CA push and fetch a tree over
// mutual TLS, with the per-call MAC still checked; certificates name no address (the server
// name is not verified, see tls.go).
func TestTLSPushAndFetch(t *testing.T) {
	ca := testpki.NewCA(t, "job CA")
	p := startTLSPeer(t, newTestTLS(t, ca, "agent-0"))
	_, client := newTestTLS(t, ca, "agent-1").TransportCredentials(nil)
	conn, err := grpc.NewClient(p.addr, append(DialOptions(), grpc.WithTransportCredentials(client))...)
	require.NoError(t, err)
	defer conn.Close()

	ctx := context.Background()
	src, name := makeTree(t, rand.New(rand.NewPCG(1, 2)), 3*peerChunk+5)
	s := testSender(2)
	require.NoError(t, s.Push(ctx, conn, pushReq(name, src)))
	requireHashesTo(t, filepath.Join(p.sealed, name), name)

	dir := t.TempDir()
	require.NoError(t, s.Fetch(ctx, conn, FetchRequest{Job: peerJob, Incarnation: "inc-1", Rank: 1, DataName: name, Dir: dir}))
	requireHashesTo(t, filepath.Join(dir, name), name)

	// TLS does not replace the MAC: a call signed with another secret is refused.
	err = abandon(t, p.addr, client, []byte("some other job's secret"))
	require.Equal(t, codes.Unauthenticated, status.Code(err), "%v", err)
	require.NoError(t, abandon(t, p.addr, client, peerSecret))
	require.NotContains(t, p.log.String(), "TLS handshake failed")
}

// TestTLSRefusals: the server refuses (and logs) a client without a certificate, with one from
// another CA, or speaking plain text; a client refuses a server whose certificate another CA
// signed. Every such call fails with UNAVAILABLE before any request is read.
func TestTLSRefusals(t *testing.T) {
	ca := testpki.NewCA(t, "job CA")
	other := testpki.NewCA(t, "another CA")
	p := startTLSPeer(t, newTestTLS(t, ca, "agent-0"))

	otherCert, otherKey := other.Issue(t, "intruder")
	otherPair, err := tls.X509KeyPair(otherCert, otherKey)
	require.NoError(t, err)
	// A client that accepts any server, so that the server's verdict on the client is tested.
	trustJob := func(certs ...tls.Certificate) credentials.TransportCredentials {
		return credentials.NewTLS(&tls.Config{MinVersion: tls.VersionTLS13, InsecureSkipVerify: true,
			GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
				if len(certs) == 0 {
					return &tls.Certificate{}, nil
				}
				return &certs[0], nil
			}})
	}
	good := newTestTLS(t, ca, "agent-1")
	tls12 := good.Client.Clone()
	tls12.MinVersion, tls12.MaxVersion = tls.VersionTLS12, tls.VersionTLS12

	for _, tc := range []struct {
		name  string
		creds credentials.TransportCredentials
		log   string // in the server's log
	}{
		{"no client certificate", trustJob(), "client didn't provide a certificate"},
		{"certificate of another CA", trustJob(otherPair), "certificate signed by unknown authority"},
		{"plain text", insecure.NewCredentials(), "TLS handshake failed"},
		{"TLS 1.2", credentials.NewTLS(tls12), "unsupported versions"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := len(p.log.String())
			err := abandon(t, p.addr, tc.creds, peerSecret)
			require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
			require.Eventually(t, func() bool {
				l := p.log.String()[before:]
				return bytes.Contains([]byte(l), []byte("peer connection refused: TLS handshake failed")) &&
					bytes.Contains([]byte(l), []byte(tc.log))
			}, 5*time.Second, 10*time.Millisecond, "server log:\n%s", p.log.String()[before:])
		})
	}

	t.Run("server of another CA", func(t *testing.T) {
		impostor := startTLSPeer(t, newTestTLS(t, other, "impostor"))
		_, client := good.TransportCredentials(nil)
		err := abandon(t, impostor.addr, client, peerSecret)
		require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
		require.Contains(t, err.Error(), "certificate signed by unknown authority")
	})
}

// TestLoadTLSErrors: unreadable files, PEM without the expected blocks, a key of another
// certificate and a certificate the CA did not sign are refused with the reason.
func TestLoadTLSErrors(t *testing.T) {
	ca := testpki.NewCA(t, "job CA")
	other := testpki.NewCA(t, "another CA")
	dir := t.TempDir()
	good := ca.WriteFiles(t, dir, "agent")
	foreign := other.WriteFiles(t, dir, "foreign")
	junk := filepath.Join(dir, "junk.pem")
	require.NoError(t, os.WriteFile(junk, []byte("not PEM at all\n"), 0o600))

	cfgs, err := LoadTLS(good.Cert, good.Key, good.CA)
	require.NoError(t, err)
	require.EqualValues(t, tls.VersionTLS13, cfgs.Server.MinVersion)
	require.EqualValues(t, tls.VersionTLS13, cfgs.Client.MinVersion)
	require.Equal(t, tls.RequireAndVerifyClientCert, cfgs.Server.ClientAuth)

	for _, tc := range []struct {
		name           string
		cert, key, caf string
		want           string
	}{
		{"missing certificate", filepath.Join(dir, "nope.crt"), good.Key, good.CA, "certificate: open"},
		{"missing key", good.Cert, filepath.Join(dir, "nope.key"), good.CA, "key: open"},
		{"missing CA", good.Cert, good.Key, filepath.Join(dir, "nope.crt"), "CA: open"},
		{"certificate not PEM", junk, good.Key, good.CA, "certificate and key"},
		{"key not PEM", good.Cert, junk, good.CA, "certificate and key"},
		{"key of another certificate", good.Cert, foreign.Key, good.CA, "private key does not match public key"},
		{"CA not PEM", good.Cert, good.Key, junk, "CA: no PEM CERTIFICATE block"},
		{"certificate of another CA", foreign.Cert, foreign.Key, good.CA, "does not verify against the CA"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := LoadTLS(tc.cert, tc.key, tc.caf)
			require.ErrorContains(t, err, tc.want)
		})
	}
}
