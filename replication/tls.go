package replication

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"syscall"
	"time"

	"google.golang.org/grpc/credentials"
)

// Mutual TLS between the agents of a job (SPEC §4: peer traffic is authenticated with a per-job
// secret or mutual TLS; mtcfs mount --peer-tls-cert/--peer-tls-key/--peer-tls-ca).
//
// Every agent holds a certificate and key issued by the job's CA, and the CA certificate. Its
// server requires a client certificate that verifies against the CA (RequireAndVerifyClientCert),
// and its client presents its certificate and verifies the server's chain against the CA. Both
// ends insist on TLS 1.3. The per-call HMAC (Authenticate) stays on: TLS adds encryption and
// integrity of the bodies, and proves that the other end holds a key the CA signed.
//
// Server names are not checked. Agents dial each other by the address they registered (or
// --peers), usually an IP:port assigned when the job was scheduled, which a certificate issued
// ahead of time cannot name; and the CA is the job's own, so a certificate it signed is what
// makes an agent a member of the job, whatever names it carries. The client therefore verifies
// the server's chain against the CA only (any SAN, any common name), with the server-auth
// extended key usage; the server verifies clients the standard way, with client-auth. A
// certificate used by an agent must allow both (extended key usages serverAuth and clientAuth,
// or none). When one CA serves several jobs, its certificates do not keep the jobs apart; the
// per-job secret does.

// TLSConfigs are the TLS configurations of an agent's peer service (server) and of its calls to
// other agents (client).
type TLSConfigs struct {
	Server, Client *tls.Config
}

// LoadTLS reads a PEM certificate (chain) and its key, and the PEM CA certificates peers are
// verified against, and returns the TLS configurations of both ends. Errors name the file and
// the problem.
func LoadTLS(certFile, keyFile, caFile string) (TLSConfigs, error) {
	certPEM, err := os.ReadFile(certFile)
	if err != nil {
		return TLSConfigs{}, fmt.Errorf("certificate: %w", err)
	}
	keyPEM, err := os.ReadFile(keyFile)
	if err != nil {
		return TLSConfigs{}, fmt.Errorf("key: %w", err)
	}
	caPEM, err := os.ReadFile(caFile)
	if err != nil {
		return TLSConfigs{}, fmt.Errorf("CA: %w", err)
	}
	cfgs, err := NewTLS(certPEM, keyPEM, caPEM)
	if err != nil {
		return TLSConfigs{}, fmt.Errorf("%w (certificate %s, key %s, CA %s)", err, certFile, keyFile, caFile)
	}
	return cfgs, nil
}

// NewTLS is LoadTLS on the files' contents.
func NewTLS(certPEM, keyPEM, caPEM []byte) (TLSConfigs, error) {
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return TLSConfigs{}, fmt.Errorf("certificate and key: %w", err)
	}
	roots, err := parseCAs(caPEM)
	if err != nil {
		return TLSConfigs{}, err
	}
	// An agent's own certificate must verify against the CA it verifies its peers with;
	// otherwise every peer would refuse it, which is better said at start.
	var chain []*x509.Certificate
	for _, der := range cert.Certificate {
		c, err := x509.ParseCertificate(der)
		if err != nil {
			return TLSConfigs{}, fmt.Errorf("certificate: %w", err)
		}
		chain = append(chain, c)
	}
	for _, usage := range []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth} {
		if err := verifyChain(chain, roots, usage); err != nil {
			return TLSConfigs{}, fmt.Errorf("the certificate does not verify against the CA as peers check it: %w", err)
		}
	}
	server := &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{cert},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    roots,
	}
	client := &tls.Config{
		MinVersion: tls.VersionTLS13,
		// Always present the certificate, also when the server names CAs that did not sign it
		// (crypto/tls would then send none): the server's log then says what is wrong with it.
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &cert, nil },
		// The chain is verified by VerifyConnection, against the CA but without a server name
		// (see above). InsecureSkipVerify only turns off the standard verification, which
		// would insist on the dialed address.
		InsecureSkipVerify: true,
		VerifyConnection: func(cs tls.ConnectionState) error {
			if err := verifyChain(cs.PeerCertificates, roots, x509.ExtKeyUsageServerAuth); err != nil {
				return fmt.Errorf("peer server: %w", err)
			}
			return nil
		},
	}
	return TLSConfigs{Server: server, Client: client}, nil
}

// parseCAs reads every CERTIFICATE block of caPEM; at least one is required.
func parseCAs(caPEM []byte) (*x509.CertPool, error) {
	pool := x509.NewCertPool()
	n := 0
	for rest := caPEM; ; {
		var b *pem.Block
		b, rest = pem.Decode(rest)
		if b == nil {
			break
		}
		if b.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			return nil, fmt.Errorf("CA: %w", err)
		}
		pool.AddCert(c)
		n++
	}
	if n == 0 {
		return nil, errors.New("CA: no PEM CERTIFICATE block")
	}
	return pool, nil
}

// verifyChain verifies the peer's certificate chain against roots, for usage, without a name.
func verifyChain(chain []*x509.Certificate, roots *x509.CertPool, usage x509.ExtKeyUsage) error {
	if len(chain) == 0 {
		return errors.New("no certificate presented")
	}
	inter := x509.NewCertPool()
	for _, c := range chain[1:] {
		inter.AddCert(c)
	}
	if _, err := chain[0].Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{usage}}); err != nil {
		return fmt.Errorf("certificate of %q: %w", chain[0].Subject.String(), err)
	}
	return nil
}

// TransportCredentials returns the gRPC credentials of both ends: the server's log every
// refused handshake (a client without a certificate, with one the CA did not sign, or not
// speaking TLS 1.3) with the client's address, on log (nil: slog.Default()).
func (c TLSConfigs) TransportCredentials(log *slog.Logger) (server, client credentials.TransportCredentials) {
	if log == nil {
		log = slog.Default()
	}
	return loggingServerCreds{TransportCredentials: credentials.NewTLS(c.Server), log: log}, alertingClientCreds{credentials.NewTLS(c.Client)}
}

// alertingClientCreds make a refused client certificate show in the call's error. Under TLS 1.3
// the server verifies the client's certificate after the client's side of the handshake is done:
// the client's handshake succeeds, the server sends an alert and closes, and gRPC's first
// writes (its preface) race that alert. When a write loses the race it fails with a broken pipe
// or a reset, and the call's error said nothing about TLS (half of the calls of
// TestTLSRefusalSaysWhy before this); the server's alert is then read and reported with it.
type alertingClientCreds struct {
	credentials.TransportCredentials
}

func (c alertingClientCreds) ClientHandshake(ctx context.Context, authority string, raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn, info, err := c.TransportCredentials.ClientHandshake(ctx, authority, raw)
	if err != nil {
		return conn, info, err
	}
	return &alertConn{Conn: conn}, info, nil
}

func (c alertingClientCreds) Clone() credentials.TransportCredentials {
	return alertingClientCreds{c.TransportCredentials.Clone()}
}

// alertWait bounds the wait for the alert behind a failed write: it is already in the socket's
// receive queue when the write fails (the server sent it before closing).
const alertWait = time.Second

// alertConn is a client's TLS connection whose failed writes carry the server's TLS alert, when
// the server sent one before closing.
type alertConn struct {
	net.Conn
}

func (c *alertConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	if err == nil || !(errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET)) {
		return n, err
	}
	// The connection is dead: reading from it cannot take bytes anyone still wants. gRPC's own
	// reader may hold the connection's read side; the deadline ends its wait too.
	_ = c.Conn.SetReadDeadline(time.Now().Add(alertWait))
	var one [1]byte
	_, rerr := c.Conn.Read(one[:])
	var op *net.OpError
	if errors.As(rerr, &op) && op.Op == "remote error" {
		return n, fmt.Errorf("%w, after the server's TLS alert: %w", err, rerr)
	}
	return n, err
}

// loggingServerCreds logs the handshakes the server refuses: gRPC itself drops them with no more
// than a transport-level log line.
type loggingServerCreds struct {
	credentials.TransportCredentials
	log *slog.Logger
}

func (s loggingServerCreds) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	c, info, err := s.TransportCredentials.ServerHandshake(conn)
	if err != nil {
		s.log.Warn("peer connection refused: TLS handshake failed", "peer", conn.RemoteAddr().String(), "err", err)
	}
	return c, info, err
}

func (s loggingServerCreds) Clone() credentials.TransportCredentials {
	return loggingServerCreds{TransportCredentials: s.TransportCredentials.Clone(), log: s.log}
}
