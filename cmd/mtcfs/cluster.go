package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/mtcfs/mtcfs/gcsbackend"
	"github.com/mtcfs/mtcfs/replication"
	"github.com/mtcfs/mtcfs/tiers"
)

// clusterCoordinator is the tiers.Coordinator the replicator uses. The rank-0 agent coordinates
// in process (a one-node job is just that) and serves the coordinator to the other ranks over
// gRPC; they find it through the agent registry in the
// backup location, so nothing but a shared --backup needs configuring (SPEC §4, §7).
//
// peerService (below) moves the data: replicas pushed to peers, early files, fetches for a
// restore.
type clusterCoordinator struct {
	objects  gcsbackend.ObjectStore
	job      *replication.Job
	addr     string         // what this agent registers: --advertise, else where its gRPC server listens
	static   map[int]string // --peers: rank → address, used instead of registry lookups; nil: registry
	instance string         // random per agent process
	secrets  *secrets
	dial     credentials.TransportCredentials // of every call to a peer: mutual TLS or plain TCP

	mu         sync.Mutex
	remotes    map[string]*replication.RemoteCoordinator // GUARDED_BY(mu); per job
	registered map[string]gcsbackend.Registration        // GUARDED_BY(mu); this agent's, per job
}

var _ tiers.Coordinator = (*clusterCoordinator)(nil)

func newInstanceID() string {
	var b [8]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// secrets holds the per-job shared secret: the --peer-secret-file for every job, or the one the
// first agent of the job created in the backup location.
type secrets struct {
	fixed   []byte
	objects gcsbackend.ObjectStore

	mu    sync.Mutex
	byJob map[string][]byte // GUARDED_BY(mu)
}

func newSecrets(file string, objects gcsbackend.ObjectStore) (*secrets, error) {
	s := &secrets{objects: objects, byJob: map[string][]byte{}}
	if file != "" {
		data, err := os.ReadFile(file)
		if err != nil {
			return nil, fmt.Errorf("--peer-secret-file: %w", err)
		}
		if s.fixed = []byte(strings.TrimSpace(string(data))); len(s.fixed) < 16 {
			return nil, fmt.Errorf("--peer-secret-file %s: the secret must be at least 16 bytes", file)
		}
	}
	return s, nil
}

func (s *secrets) get(ctx context.Context, job string) ([]byte, error) {
	if s.fixed != nil {
		return s.fixed, nil
	}
	s.mu.Lock()
	sec, ok := s.byJob[job]
	s.mu.Unlock()
	if ok {
		return sec, nil
	}
	// Not under mu: the store may be slow, and every peer call asks. Concurrent first calls
	// all get the one secret EnsureSecret creates (create-if-absent).
	sec, err := gcsbackend.EnsureSecret(ctx, s.objects, job)
	if err != nil {
		return nil, fmt.Errorf("per-job secret in %s: %w", s.objects, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if prev, ok := s.byJob[job]; ok {
		return prev, nil
	}
	s.byJob[job] = sec
	return sec, nil
}

// lookup serves the gRPC side, which asks without a context.
func (s *secrets) lookup(job string) ([]byte, bool) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	sec, err := s.get(ctx, job)
	return sec, err == nil
}

// peerService is this agent's side of a multi-node job: the gRPC server other agents call (the
// coordinator when this agent is rank 0, and the receiver of replicas and fetches), and the
// client side that pushes replicas to peers and fetches from them (tiers.PeerTransport).
type peerService struct {
	coord   *clusterCoordinator
	ln      net.Listener
	srv     *grpc.Server
	objects gcsbackend.ObjectStore
	sender  *replication.Sender
	recv    *replication.Receiver

	mu      sync.Mutex
	conns   map[string]*grpc.ClientConn // GUARDED_BY(mu); by address
	targets map[rankKey]peerTarget      // GUARDED_BY(mu); looked-up addresses, until a call fails
}

// rankKey names one agent of a job; peerTarget is where it was found.
type rankKey struct {
	job  string
	rank int
}

type peerTarget struct{ addr, instance string }

var _ tiers.PeerTransport = (*peerService)(nil)

// peerAddrs says where this agent listens and how it finds the others (mount flags).
type peerAddrs struct {
	listen     string
	advertise  string         // registered for the other agents; "": the listen address as bound
	static     map[int]string // --peers; nil: the registry
	lagTimeout time.Duration  // the coordinator's sync lag timeout; 0: the default
}

// peerAuth says how peer calls are authenticated (mount flags): every call carries a MAC keyed
// by the job's secret (--peer-secret-file, else the one in the backup location), and with tls
// the connections are mutual TLS too (--peer-tls-cert/-key/-ca, see replication.LoadTLS).
type peerAuth struct {
	secretFile string
	tls        *replication.TLSConfigs // nil: plain TCP
}

// newPeerService listens on listen and prepares the coordinator; start serves.
func newPeerService(addrs peerAddrs, objects gcsbackend.ObjectStore, store tiers.BackupStore, auth peerAuth) (*peerService, error) {
	sec, err := newSecrets(auth.secretFile, objects)
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", addrs.listen)
	if err != nil {
		return nil, fmt.Errorf("--listen %s: %w", addrs.listen, err)
	}
	addr := ln.Addr().String()
	if addrs.advertise != "" {
		addr = addrs.advertise
	}
	opts := replication.ServerOptions()
	dial := insecure.NewCredentials()
	if auth.tls != nil {
		var server credentials.TransportCredentials
		server, dial = auth.tls.TransportCredentials(slog.Default())
		opts = append(opts, grpc.Creds(server))
	}
	c := &clusterCoordinator{objects: objects, addr: addr, static: addrs.static, instance: newInstanceID(),
		secrets: sec, dial: dial, remotes: map[string]*replication.RemoteCoordinator{}, registered: map[string]gcsbackend.Registration{},
		job: replication.NewJob(replication.Options{Store: store, Log: slog.Default(), LagTimeout: addrs.lagTimeout})}
	svc, err := replication.NewCoordinatorService(replication.CoordinatorServiceConfig{Job: c.job, Secrets: sec.lookup, Instance: c.instance})
	if err != nil {
		ln.Close()
		return nil, err
	}
	p := &peerService{coord: c, ln: ln, srv: grpc.NewServer(opts...), objects: objects,
		conns: map[string]*grpc.ClientConn{}, targets: map[rankKey]peerTarget{}}
	svc.Register(p.srv)
	return p, nil
}

// start adds the receiver of replicas (into rep's spool) and serves.
func (p *peerService) start(rep *tiers.Replicator, spool *tiers.Spool) error {
	recv, err := replication.NewReceiver(replication.ReceiverConfig{
		Dir:         filepath.Join(spool.Dir(), "peer-incoming"),
		Secrets:     p.coord.secrets.lookup,
		Instance:    p.coord.instance,
		Accept:      rep.AcceptReplica,
		Lookup:      func(ctx context.Context, job, name string) (string, error) { return rep.SealedPath(name) },
		Digests:     rep.Digests(),
		MaxIncoming: spool.Budget(),
		Reserve:     spool.Reserve,
	})
	if err != nil {
		return err
	}
	p.recv = recv
	p.sender = &replication.Sender{Instance: p.coord.instance, Secrets: p.coord.secrets.lookup, Digests: rep.Digests()}
	recv.Register(p.srv)
	go p.srv.Serve(p.ln)
	slog.Info("peer service", "addr", p.ln.Addr().String(), "advertised", p.coord.addr, "static_peers", len(p.coord.static) > 0,
		"tls", p.coord.dial.Info().SecurityProtocol == "tls")
	return nil
}

func (p *peerService) stop() {
	p.srv.Stop()
	if p.recv != nil {
		p.recv.Close()
	}
	p.mu.Lock()
	for _, c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.coord.mu.Lock()
	for _, r := range p.coord.remotes {
		r.Close()
	}
	regs := p.coord.registered
	p.coord.mu.Unlock()
	// Leave the registry: a peer must not keep calling an agent that stopped. (A killed agent
	// cannot; its successor's registration supersedes it.)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, reg := range regs {
		if err := gcsbackend.Unregister(ctx, p.objects, reg); err != nil {
			slog.Warn("leave the agent registry", "job", reg.Job, "err", err)
		}
	}
}

// lookup returns the address of rank's agent of job and, when it comes from the registry, the
// agent's instance id, which calls carry so that an agent now at that address but not that
// instance refuses them (replication.WithTarget).
func (c *clusterCoordinator) lookup(ctx context.Context, job string, rank int) (addr, instance string, err error) {
	if c.static != nil {
		addr, ok := c.static[rank]
		if !ok {
			return "", "", fmt.Errorf("rank %d of job %s is not in --peers", rank, job)
		}
		return addr, "", nil
	}
	regs, err := gcsbackend.Lookup(ctx, c.objects, job)
	if err != nil {
		return "", "", err
	}
	reg, ok := regs[rank]
	if !ok {
		return "", "", fmt.Errorf("rank %d of job %s has not registered in %s", rank, job, c.objects)
	}
	return reg.Addr, reg.InstanceID, nil
}

// call runs f on a connection to rank's agent of job, with ctx naming that agent as the call's
// target (replication.WithTarget). Where the agent is comes from lookup once and is reused —
// every closed file is pushed, and a registry lookup reads every rank's registration — until
// a call fails for want of the peer (UNAVAILABLE, also a refusal as the wrong instance, or a
// stall): then the next call looks again, and dials at once instead of after gRPC's reconnect
// backoff, so a peer that restarted, moved or re-registered is found.
func (p *peerService) call(ctx context.Context, job string, rank int, f func(context.Context, *grpc.ClientConn) error) error {
	key := rankKey{job, rank}
	p.mu.Lock()
	t, ok := p.targets[key]
	p.mu.Unlock()
	if !ok {
		var err error
		if t.addr, t.instance, err = p.coord.lookup(ctx, job, rank); err != nil {
			return err
		}
	}
	p.mu.Lock()
	p.targets[key] = t
	conn, ok := p.conns[t.addr]
	if !ok {
		var err error
		conn, err = grpc.NewClient(t.addr, append(replication.DialOptions(), grpc.WithTransportCredentials(p.coord.dial))...)
		if err != nil {
			p.mu.Unlock()
			return err
		}
		p.conns[t.addr] = conn
	}
	p.mu.Unlock()
	err := f(replication.WithTarget(ctx, t.instance), conn)
	if status.Code(err) == codes.Unavailable || errors.Is(err, replication.ErrStalled) {
		conn.ResetConnectBackoff()
		p.mu.Lock()
		delete(p.targets, key)
		p.mu.Unlock()
	}
	return err
}

func (p *peerService) Push(ctx context.Context, inc tiers.Incarnation, rank int, name, path string) error {
	return p.call(ctx, inc.Config.JobName, rank, func(ctx context.Context, conn *grpc.ClientConn) error {
		return p.sender.Push(ctx, conn, replication.PushRequest{Job: inc.Config.JobName, Incarnation: inc.ID,
			Rank: inc.Config.NodeRank, DataName: name, Source: path})
	})
}

func (p *peerService) Fetch(ctx context.Context, inc tiers.Incarnation, rank int, name, dir string, progress func(done, total int64)) error {
	return p.call(ctx, inc.Config.JobName, rank, func(ctx context.Context, conn *grpc.ClientConn) error {
		return p.sender.Fetch(ctx, conn, replication.FetchRequest{Job: inc.Config.JobName, Incarnation: inc.ID,
			Rank: inc.Config.NodeRank, DataName: name, Dir: dir, Progress: progress})
	})
}

// pick returns the coordinator for inc: the in-process job on rank 0 (the only rank of a
// one-node job), the rank-0 agent over gRPC otherwise.
func (c *clusterCoordinator) pick(ctx context.Context, inc tiers.Incarnation) (tiers.Coordinator, error) {
	cfg := inc.Config
	if cfg.NodeRank == 0 {
		return replication.LocalClient{Job: c.job}, nil
	}
	c.mu.Lock()
	r, ok := c.remotes[cfg.JobName]
	c.mu.Unlock()
	if ok {
		return r, nil
	}
	secret, err := c.secrets.get(ctx, cfg.JobName) // store I/O: not under mu
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if r, ok := c.remotes[cfg.JobName]; ok {
		return r, nil
	}
	job := cfg.JobName
	r, err = replication.NewRemoteCoordinator(replication.RemoteCoordinatorConfig{
		Secret: secret, Instance: c.instance,
		DialOptions: append(replication.DialOptions(), grpc.WithTransportCredentials(c.dial)),
		Target:      func(ctx context.Context) (string, string, error) { return c.lookup(ctx, job, 0) },
	})
	if err != nil {
		return nil, err
	}
	c.remotes[job] = r
	return r, nil
}

func (c *clusterCoordinator) Negotiate(ctx context.Context, inc tiers.Incarnation, inv tiers.Inventory) (tiers.RestorePlan, error) {
	co, err := c.pick(ctx, inc)
	if err != nil {
		return tiers.RestorePlan{}, err
	}
	if cfg := inc.Config; cfg.Nodes > 1 {
		// Every agent of the job registers where it listens, for this incarnation. A rank that
		// reaches rank 0 before rank 0 started the incarnation is told to retry.
		if _, err := c.secrets.get(ctx, cfg.JobName); err != nil {
			return tiers.RestorePlan{}, err
		}
		reg := gcsbackend.Registration{Job: cfg.JobName, Incarnation: inc.ID, InstanceID: c.instance,
			Rank: cfg.NodeRank, Addr: c.addr, Updated: time.Now()}
		if err := gcsbackend.Register(ctx, c.objects, reg); err != nil {
			return tiers.RestorePlan{}, fmt.Errorf("register in %s: %w", c.objects, err)
		}
		c.mu.Lock()
		c.registered[cfg.JobName] = reg
		c.mu.Unlock()
	}
	return co.Negotiate(ctx, inc, inv)
}

func (c *clusterCoordinator) Restored(ctx context.Context, inc tiers.Incarnation) error {
	co, err := c.pick(ctx, inc)
	if err != nil {
		return err
	}
	return co.Restored(ctx, inc)
}

func (c *clusterCoordinator) Sync(ctx context.Context, inc tiers.Incarnation, rep tiers.SyncReport) (tiers.SyncDecision, error) {
	co, err := c.pick(ctx, inc)
	if err != nil {
		return tiers.SyncDecision{}, err
	}
	return co.Sync(ctx, inc, rep)
}

func (c *clusterCoordinator) Backups(ctx context.Context, inc tiers.Incarnation, rep tiers.BackupReport) (tiers.BackupOrder, error) {
	co, err := c.pick(ctx, inc)
	if err != nil {
		return tiers.BackupOrder{}, err
	}
	return co.Backups(ctx, inc, rep)
}
