package replication

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/tiers"
)

// NodeConfig configures a Node.
type NodeConfig struct {
	// Listener is where the node serves the other agents; Close closes it. Required.
	Listener net.Listener
	// Advertise is the address the other agents are told to call; "": the listener's address.
	Advertise string
	// Objects is the backup location. The node registers there (Registry) for every job of more
	// than one node, and without Secret each job's secret is kept there (EnsureSecret). Nil: no
	// registration; Peers and Secret are then required.
	Objects Objects
	// Peers finds the other agents; nil: the Registry in Objects.
	Peers Discovery
	// Secret, when set, is the shared secret of every job (at least 16 bytes); nil: each job's
	// own, from Objects.
	Secret []byte
	// TLS, when set, makes every connection between agents mutual TLS; nil: plain TCP (calls
	// still carry a MAC keyed by the job's secret).
	TLS *TLSConfigs
	// Store is the backup tier the coordinator consults when this node is rank 0 (nil: no
	// backups).
	Store tiers.BackupStore
	// LagTimeout is the coordinator's sync lag timeout; 0: DefaultLagTimeout.
	LagTimeout time.Duration
	// Compression says when the chunks this node pushes, and asks for in fetches, travel
	// compressed (mtcfs mount --peer-compress); the zero value is CompressAuto. A node always
	// takes compressed chunks, and with CompressOff never serves them.
	Compression Compression
	// Log receives the node's lines; nil: slog.Default().
	Log *slog.Logger
}

// Node is one agent's end of the cluster its jobs run on. It serves the gRPC services the other
// agents call — the job coordinator, when this agent is rank 0, and the receiver of replicas
// and fetches — and is the client side of the replicator: the peer transport
// (tiers.PeerTransport, tiers.EarlyTransport: pushes to peers, fetches from them) and the
// coordinator (tiers.Coordinator: in process on rank 0, which is the only rank of a one-node
// job, and over gRPC from every other rank). It finds the other agents through its Discovery and
// registers itself in the backup location, and keeps each job's secret.
//
// Life cycle: NewNode, then tiers.NewReplicator with the node as its Coordinator and Peers, then
// Start once the replicator runs, and Close. Goroutines: gRPC's, stopped by Close.
type Node struct {
	cfg      NodeConfig
	log      *slog.Logger
	peers    Discovery
	registry *Registry // nil: no backup location
	addr     string    // what the other agents are told: Advertise, else the listener's address
	instance string    // random per process
	secrets  *jobSecrets
	refusals *refusalLog              // of the calls admitCall refuses
	receiver atomic.Pointer[Receiver] // recv, once Start made it
	// notJoined: of those it refuses because this agent has not joined their job (yet), which
	// a job's start makes (a rank that reaches rank 0's agent first)
	notJoined *refusalLog
	dial      credentials.TransportCredentials // of every call to a peer: mutual TLS or plain TCP
	job       *Job                             // the coordinator, when this node is rank 0
	srv       *grpc.Server

	sender atomic.Pointer[Sender]           // set by Start
	rep    atomic.Pointer[tiers.Replicator] // set by Start
	recv   *Receiver                        // set by Start; read by Close after srv.Stop

	mu         sync.Mutex
	conns      map[string]*grpc.ClientConn   // GUARDED_BY(mu); by address
	meters     map[string]*connMeter         // GUARDED_BY(mu); by address, of conns
	targets    targetCache                   // found peers, until a call fails
	remotes    map[string]*RemoteCoordinator // GUARDED_BY(mu); per job
	registered map[string]Registration       // GUARDED_BY(mu); this node's, per job
	// joining says, per job, what Negotiate is doing in the backup location before it reaches
	// the coordinator (reading the job's secret, registering); "" or absent: nothing there.
	joining map[string]string // GUARDED_BY(mu)
	// joinLimit bounds that part of a Negotiate: a location that does not answer fails the
	// restore with a line the job reads before its 300 s wait for markers ends.
	joinLimit time.Duration
	// claims holds, per job, what the latest look at this node's own registration found (see
	// rankClaimedElsewhere).
	claims map[string]*rankClaim // GUARDED_BY(mu)
	// claimEvery bounds how often a waiting node reads its own registration again
	// (claimCheckEvery; tests shorten it).
	claimEvery time.Duration // GUARDED_BY(mu)
	// life ends at Close: the background reads of rankClaimedElsewhere stop with it, and
	// checks counts them (Close waits).
	life    context.Context
	endLife context.CancelFunc
	checks  sync.WaitGroup
}

// rankClaim is what rankClaimedElsewhere last found for one job.
type rankClaim struct {
	incarnation string
	checked     time.Time
	checking    bool
	other       string // "": the registration is this node's
}

// claimCheckEvery bounds how often a waiting node reads its own registration again.
const claimCheckEvery = 10 * time.Second

var (
	_ tiers.Coordinator    = (*Node)(nil)
	_ tiers.PeerTransport  = (*Node)(nil)
	_ tiers.EarlyTransport = (*Node)(nil)
)

// peerKey names one agent of a job.
type peerKey struct {
	job  string
	rank int
}

// errNodeNotStarted fails a transfer asked for before Start.
var errNodeNotStarted = status.Error(codes.Unavailable, "the peer service has not started yet")

// NewNode prepares the node's server (the coordinator service) on cfg.Listener; Start serves.
func NewNode(cfg NodeConfig) (*Node, error) {
	if cfg.Listener == nil {
		return nil, errors.New("node: Listener is required")
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	n := &Node{cfg: cfg, log: cfg.Log, peers: cfg.Peers, addr: cfg.Listener.Addr().String(), instance: newInstanceID(),
		dial: insecure.NewCredentials(), conns: map[string]*grpc.ClientConn{},
		remotes: map[string]*RemoteCoordinator{}, registered: map[string]Registration{}, joining: map[string]string{},
		joinLimit: defaultJoinLimit}
	n.life, n.endLife = context.WithCancel(context.Background())
	if cfg.Advertise != "" {
		n.addr = cfg.Advertise
	}
	if cfg.Objects != nil {
		n.registry = &Registry{Objects: cfg.Objects}
		if n.peers == nil {
			n.peers = *n.registry
		}
	}
	switch {
	case n.peers == nil:
		return nil, errors.New("node: Peers is required without Objects")
	case cfg.Secret == nil && cfg.Objects == nil:
		return nil, errors.New("node: Secret is required without Objects")
	case cfg.Secret != nil && len(cfg.Secret) < minSecretSize:
		return nil, fmt.Errorf("node: the secret must be at least %d bytes", minSecretSize)
	}
	n.secrets = &jobSecrets{fixed: cfg.Secret, objects: cfg.Objects, log: n.log, recheck: secretRecheck,
		byJob: map[string][]byte{}, checked: map[string]time.Time{}}
	n.refusals = &refusalLog{log: n.log, level: slog.LevelWarn}
	n.notJoined = &refusalLog{log: n.log, level: slog.LevelInfo}
	opts := append(ServerOptions(), grpc.InTapHandle(n.admitCall))
	if cfg.TLS != nil {
		var server credentials.TransportCredentials
		server, n.dial = cfg.TLS.TransportCredentials(n.log)
		opts = append(opts, grpc.Creds(server))
	}
	n.job = NewJob(Options{Store: cfg.Store, Log: n.log, LagTimeout: cfg.LagTimeout})
	svc, err := NewCoordinatorService(CoordinatorServiceConfig{Job: n.job, Secrets: n.secrets.lookup, Instance: n.instance, Logger: n.log})
	if err != nil {
		return nil, err
	}
	n.srv = grpc.NewServer(opts...)
	svc.Register(n.srv)
	return n, nil
}

func newInstanceID() string {
	var b [8]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// Start adds the receiver of replicas (into rep's spool) and serves. Until then the other
// agents' calls wait in the listen queue: replicas are taken only once the replicator runs (it
// publishes them in the namespace), and rank 0's own agent reaches its coordinator in process.
func (n *Node) Start(rep *tiers.Replicator, spool *tiers.Spool) error {
	recv, err := NewReceiver(ReceiverConfig{
		Dir:         filepath.Join(spool.Dir(), "peer-incoming"),
		Secrets:     n.secrets.lookup,
		Instance:    n.instance,
		Accept:      rep.AcceptReplica,
		AdmitPush:   rep.AdmitReplica,
		Lookup:      func(ctx context.Context, job, name string) (string, error) { return rep.SealedPath(name) },
		Corrupt:     func(job, name string, err error) { rep.DropCorrupt(name, err) },
		Digests:     rep.Digests(),
		MaxIncoming: spool.Budget(),
		Reserve:     spool.Reserve,
		NoRoom:      rep.RefusedForRoom,
		Compression: n.cfg.Compression,
		Yield:       rep.YieldToSaves,
		Logger:      n.log,
	})
	if err != nil {
		return err
	}
	n.recv = recv
	n.receiver.Store(recv) // for PeerStats, which may run meanwhile
	n.rep.Store(rep)
	n.sender.Store(&Sender{Instance: n.instance, Secrets: n.secrets.lookup, Digests: rep.Digests(), Compress: n.cfg.Compression})
	recv.Register(n.srv)
	go n.srv.Serve(n.cfg.Listener)
	_, static := n.peers.(StaticPeers)
	n.log.Info("peer service", "addr", n.cfg.Listener.Addr().String(), "advertised", n.addr, "static_peers", static,
		"tls", n.dial.Info().SecurityProtocol == "tls", "compression", n.cfg.Compression.String())
	return nil
}

// PeerStats is what this node's pushes moved, and what it measured of the link to each peer.
type PeerStats struct {
	Compression      string // the mode: auto, on or off
	BytesSent        int64  // chunk bytes pushed, as read
	WireBytesSent    int64  // the same chunks' bytes on the wire
	ChunksCompressed int64  // chunks pushed compressed
	// ChunksCorrupt counts the chunks received (pushed to this node, or fetched by it) that
	// failed their CRC32C: dropped, and sent again.
	ChunksCorrupt int64
	// CallsRefused counts the calls the peer server refused before reading them: wrong or
	// missing credentials, or a job this agent has not joined.
	CallsRefused int64
	Links        []PeerLink
}

// PeerStats returns the counters and link measurements of this node's sender (zero before
// Start).
func (n *Node) PeerStats() PeerStats {
	st := PeerStats{Compression: n.cfg.Compression.String()}
	if s := n.sender.Load(); s != nil {
		st.BytesSent, st.WireBytesSent, st.ChunksCompressed = s.BytesSent(), s.WireBytesSent(), s.ChunksCompressed()
		st.Links = s.PeerLinks()
		st.ChunksCorrupt += s.CorruptChunks()
	}
	if r := n.receiver.Load(); r != nil {
		st.ChunksCorrupt += r.CorruptChunks()
	}
	st.CallsRefused = n.refusals.total.Load() + n.notJoined.total.Load()
	return st
}

// Addr is the address the other agents are told to call.
func (n *Node) Addr() string { return n.addr }

// Close stops serving, closes every connection and leaves the registry: a peer must not keep
// calling an agent that stopped. (A killed agent cannot; its successor's registration
// supersedes it.)
func (n *Node) Close() {
	n.mu.Lock()
	n.endLife() // under mu: rankClaimedElsewhere adds to checks under mu only while life lasts
	n.mu.Unlock()
	n.checks.Wait()
	n.srv.Stop()
	n.cfg.Listener.Close() // if Start never served it
	if n.recv != nil {
		n.recv.Close()
	}
	n.mu.Lock()
	for _, c := range n.conns {
		c.Close()
	}
	for _, r := range n.remotes {
		r.Close()
	}
	regs := n.registered
	n.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, reg := range regs {
		if err := n.registry.Unregister(ctx, reg); err != nil {
			n.log.Warn("leave the agent registry", "job", reg.Job, "err", err)
		}
	}
}

// --- the peer transport -------------------------------------------------------------------

// call runs f on a connection to rank's agent of job, with ctx naming that agent as the call's
// target (WithTarget). Where the agent is comes from Discovery once and is reused — every
// closed file is pushed, and a registry lookup reads every rank's registration — until a call
// fails for want of the peer (UNAVAILABLE, also a refusal as the wrong instance, or a stall):
// then the next call looks again, and dials at once instead of after gRPC's reconnect backoff,
// so a peer that restarted, moved or re-registered is found.
func (n *Node) call(ctx context.Context, job string, rank int, f func(context.Context, *Sender, *grpc.ClientConn) error) error {
	sender := n.sender.Load()
	if sender == nil {
		return errNodeNotStarted
	}
	key := peerKey{job, rank}
	p, cached, gen := n.targets.get(key)
	if !cached {
		var err error
		if p, err = n.peers.Find(ctx, job, rank); err != nil {
			return err
		}
		n.targets.put(key, p, gen)
	}
	n.mu.Lock()
	conn, ok := n.conns[p.Addr]
	meter := n.meters[p.Addr]
	if !ok {
		var err error
		meter = &connMeter{}
		conn, err = grpc.NewClient(p.Addr, append(DialOptions(), grpc.WithTransportCredentials(n.dial), grpc.WithContextDialer(meteredDialer(meter)))...)
		if err != nil {
			n.mu.Unlock()
			return err
		}
		n.conns[p.Addr] = conn
		if n.meters == nil {
			n.meters = map[string]*connMeter{}
		}
		n.meters[p.Addr] = meter
	}
	n.mu.Unlock()
	err := f(WithTarget(withConnMeter(ctx, meter), p.Instance), sender, conn)
	switch code := status.Code(err); {
	case code == codes.Unavailable || errors.Is(err, ErrStalled):
		conn.ResetConnectBackoff()
		if noAnswer(err) {
			// gRPC's own words name a socket, not the peer (a black-box run: "error reading
			// server preface: … use of closed network connection" was all the job read).
			err = &noAnswerError{rank: rank, addr: p.Addr, err: err}
		}
		n.targets.drop(key, p)
	case code == codes.NotFound: // "not held here": perhaps an agent that had the rank before
		n.targets.drop(key, p)
	}
	return err
}

// noAnswerError is a call that got no answer from the peer's agent: a transport failure, which a
// later try may not meet (tiers restores try a fetch again on it, tiers.NoAnswer).
type noAnswerError struct {
	rank int
	addr string
	err  error
}

func (e *noAnswerError) Error() string {
	return fmt.Sprintf("no answer from the agent of rank %d at %s (stopped, gone, or the network between is down): %v", e.rank, e.addr, e.err)
}
func (e *noAnswerError) Unwrap() error  { return e.err }
func (e *noAnswerError) NoAnswer() bool { return true }

// noAnswer reports whether err is gRPC's transport failing to reach or hear the peer, rather than
// an answer of the peer's (which may be UNAVAILABLE too: a wrong instance, a receiver closing).
func noAnswer(err error) bool {
	st, ok := status.FromError(err)
	if !ok || st.Code() != codes.Unavailable {
		return false
	}
	msg := st.Message()
	// A reset met while writing a stream is told in the socket's words alone ("write tcp …:
	// write: connection reset by peer": a clean-clone CI run).
	for _, s := range []string{"connection error", "error reading from server", "keepalive", "transport is closing", "connection closed",
		"connection reset by peer", "broken pipe"} {
		if strings.Contains(msg, s) {
			return true
		}
	}
	return false
}

// forgetTargets drops the agents found for job's ranks: a new incarnation may put its ranks on
// other machines (a job rescheduled), and its agents register again before they negotiate.
// Before, a fetch of the new incarnation went to the agent that had the rank before, which
// answered that it did not hold the data: the restore failed.
func (n *Node) forgetTargets(job string) { n.targets.forget(job) }

// targetCache keeps the peer found for each job's rank. forget drops a job's, and a lookup that
// began before it (get's gen) is not kept by put: a call of an earlier incarnation in flight
// does not put back the agent that had the rank before.
type targetCache struct {
	mu    sync.Mutex
	peers map[peerKey]Peer  // GUARDED_BY(mu)
	gen   map[string]uint64 // GUARDED_BY(mu); forgets by job
}

func (c *targetCache) get(key peerKey) (p Peer, ok bool, gen uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	p, ok = c.peers[key]
	return p, ok, c.gen[key.job]
}

// put keeps p for key unless the job's targets were forgotten since get returned gen.
func (c *targetCache) put(key peerKey, p Peer, gen uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.gen[key.job] != gen {
		return
	}
	if c.peers == nil {
		c.peers = map[peerKey]Peer{}
	}
	c.peers[key] = p
}

// drop forgets key's peer if it is still p.
func (c *targetCache) drop(key peerKey, p Peer) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.peers[key] == p {
		delete(c.peers, key)
	}
}

func (c *targetCache) forget(job string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.gen == nil {
		c.gen = map[string]uint64{}
	}
	c.gen[job]++
	for k := range c.peers {
		if k.job == job {
			delete(c.peers, k)
		}
	}
}

// generation is the restore generation inc took part in, for its pushes (0: none recorded, or
// the node not started).
func (n *Node) generation(inc tiers.Incarnation) int64 {
	if rep := n.rep.Load(); rep != nil {
		return rep.RestoreGeneration(inc.Config.JobName, inc.ID)
	}
	return 0
}

func (n *Node) Push(ctx context.Context, inc tiers.Incarnation, rank int, name, path string) error {
	return n.call(ctx, inc.Config.JobName, rank, func(ctx context.Context, s *Sender, conn *grpc.ClientConn) error {
		return s.Push(ctx, conn, PushRequest{Job: inc.Config.JobName, Incarnation: inc.ID, Generation: n.generation(inc),
			Rank: inc.Config.NodeRank, DataName: name, Source: path})
	})
}

func (n *Node) Fetch(ctx context.Context, inc tiers.Incarnation, rank int, name, dir string, progress func(done, total int64)) error {
	return n.call(ctx, inc.Config.JobName, rank, func(ctx context.Context, s *Sender, conn *grpc.ClientConn) error {
		return s.Fetch(ctx, conn, FetchRequest{Job: inc.Config.JobName, Incarnation: inc.ID,
			Rank: inc.Config.NodeRank, DataName: name, Dir: dir, Progress: progress})
	})
}

// The early side of the transport: files pushed while their step is still being written, and
// the sealed push that reuses them (see "Early files" in the package doc).

func (n *Node) PushEarly(ctx context.Context, inc tiers.Incarnation, rank int, group, path string) (layout.FileDigest, error) {
	var d layout.FileDigest
	sender := n.sender.Load()
	if sender == nil {
		return d, errNodeNotStarted
	}
	hash, _, err := layout.HashDataCached(ctx, path, sender.Digests)
	if err != nil {
		return d, err
	}
	if _, err := hex.Decode(d[:], []byte(hash)); err != nil {
		return d, err
	}
	return d, n.call(ctx, inc.Config.JobName, rank, func(ctx context.Context, s *Sender, conn *grpc.ClientConn) error {
		return s.Push(ctx, conn, PushRequest{Job: inc.Config.JobName, Incarnation: inc.ID, Generation: n.generation(inc),
			Rank: inc.Config.NodeRank, DataName: layout.DataName(hash, false), Source: path, EarlyGroup: group})
	})
}

func (n *Node) PushConsuming(ctx context.Context, inc tiers.Incarnation, rank int, name, path, group string, acked map[layout.FileDigest]bool) error {
	return n.call(ctx, inc.Config.JobName, rank, func(ctx context.Context, s *Sender, conn *grpc.ClientConn) error {
		return s.Push(ctx, conn, PushRequest{Job: inc.Config.JobName, Incarnation: inc.ID, Generation: n.generation(inc),
			Rank: inc.Config.NodeRank, DataName: name, Source: path, ConsumesGroup: group, Presumed: acked})
	})
}

func (n *Node) DropEarly(ctx context.Context, inc tiers.Incarnation, rank int, group string) error {
	return n.call(ctx, inc.Config.JobName, rank, func(ctx context.Context, s *Sender, conn *grpc.ClientConn) error {
		return s.Drop(ctx, conn, Identity{Job: inc.Config.JobName, Incarnation: inc.ID,
			Rank: inc.Config.NodeRank, Instance: n.instance}, group)
	})
}

// --- the coordinator ----------------------------------------------------------------------

// coordinator returns the coordinator for inc: the in-process job on rank 0 (the only rank of
// a one-node job), the rank-0 agent over gRPC otherwise.
func (n *Node) coordinator(ctx context.Context, inc tiers.Incarnation) (tiers.Coordinator, error) {
	job := inc.Config.JobName
	if inc.Config.NodeRank == 0 {
		return LocalClient{Job: n.job}, nil
	}
	n.mu.Lock()
	r, ok := n.remotes[job]
	n.mu.Unlock()
	if ok {
		return r, nil
	}
	secret, err := n.secrets.get(ctx, job) // store I/O: not under mu
	if err != nil {
		return nil, err
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if r, ok := n.remotes[job]; ok {
		return r, nil
	}
	r, err = NewRemoteCoordinator(RemoteCoordinatorConfig{
		Secret: secret, Secrets: n.secrets.lookup, Instance: n.instance, Logger: n.log,
		DialOptions: append(DialOptions(), grpc.WithTransportCredentials(n.dial)),
		Target: func(ctx context.Context) (string, string, error) {
			p, err := n.peers.Find(ctx, job, 0)
			return p.Addr, p.Instance, err
		},
	})
	if err != nil {
		return nil, err
	}
	n.remotes[job] = r
	return r, nil
}

var _ tiers.WaitDescriber = (*Node)(nil)

var _ tiers.JobChecker = (*Node)(nil)

// CheckJob refuses a job of more than one node that a static --peers map cannot serve: every
// rank of the job must be in it (the coordinator, rank 0, and every peer are found there).
func (n *Node) CheckJob(cfg *tiers.Config) error {
	static, ok := n.peers.(StaticPeers)
	if !ok || cfg.Nodes <= 1 {
		return nil
	}
	shown, missing := someRanks(cfg.Nodes, func(r int) bool { _, listed := static[r]; return !listed })
	if missing == 0 {
		return nil
	}
	return fmt.Errorf("nodes: %d, but this node's agent was started with --peers lacking rank %s: every rank of the job must be listed (or leave --peers out: the agents then find each other through the backup location)",
		cfg.Nodes, rankList(shown, missing))
}

// WaitingFor says what inc's pending Negotiate or Restored waits for: on rank 0, the ranks not
// heard from; elsewhere, rank 0, or why it cannot be reached.
// SyncWaitingFor says what inc's pending sync of step waits for: the ranks missing, on rank
// 0; rank 0's answer, elsewhere.
func (n *Node) SyncWaitingFor(inc tiers.Incarnation, step int64) string {
	if inc.Config == nil {
		return ""
	}
	if inc.Config.NodeRank == 0 {
		return LocalClient{Job: n.job}.SyncWaitingFor(inc, step)
	}
	n.mu.Lock()
	r := n.remotes[inc.Config.JobName]
	n.mu.Unlock()
	if r == nil {
		return ""
	}
	return r.SyncWaitingFor(inc, step)
}

var _ tiers.SyncWaitDescriber = (*Node)(nil)

func (n *Node) WaitingFor(inc tiers.Incarnation) (string, bool) {
	if inc.Config == nil {
		return "", false
	}
	n.mu.Lock()
	joining := n.joining[inc.Config.JobName]
	n.mu.Unlock()
	if joining != "" {
		return joining, false
	}
	var what string
	var nodes bool
	if inc.Config.NodeRank == 0 {
		what, nodes = LocalClient{Job: n.job}.WaitingFor(inc)
	} else {
		n.mu.Lock()
		r := n.remotes[inc.Config.JobName]
		n.mu.Unlock()
		if r == nil {
			return "", false
		}
		what, nodes = r.WaitingFor(inc)
	}
	if what != "" {
		if other := n.rankClaimedElsewhere(inc); other != "" {
			what += "; " + other
		}
	}
	return what, nodes
}

// rankClaimedElsewhere says, while inc waits for the other nodes, whether another agent has
// registered as this node's rank of the job since this node did: two nodes that claim one rank
// (a wrong node-rank in a node's replicator.yaml) each wait for a rank that never comes, and the
// other ranks talk to the one registered last. It answers from what it last found and reads the
// registration again in the background at most every claimCheckEvery, so that it never makes a
// caller (mtcfs status) wait on the backup location.
func (n *Node) rankClaimedElsewhere(inc tiers.Incarnation) string {
	if n.registry == nil {
		return ""
	}
	job, rank := inc.Config.JobName, inc.Config.NodeRank
	n.mu.Lock()
	defer n.mu.Unlock()
	if reg, ok := n.registered[job]; !ok || reg.Incarnation != inc.ID {
		return ""
	}
	if n.claims == nil {
		n.claims = map[string]*rankClaim{}
	}
	c := n.claims[job]
	if c == nil || c.incarnation != inc.ID {
		c = &rankClaim{incarnation: inc.ID}
		n.claims[job] = c
	}
	every := n.claimEvery
	if every == 0 {
		every = claimCheckEvery
	}
	if !c.checking && time.Since(c.checked) >= every && n.life.Err() == nil {
		c.checking = true
		n.checks.Add(1)
		go func() {
			defer n.checks.Done()
			ctx, cancel := context.WithTimeout(n.life, 5*time.Second)
			defer cancel()
			other := ""
			reg, err := n.registry.current(ctx, job, rank)
			switch {
			case errors.Is(err, fs.ErrNotExist):
				other = fmt.Sprintf("this node's registration as rank %d of job %s (%s in %s) is gone, removed by another agent that had taken the rank and stopped?: the other ranks cannot find this node until the job restarts",
					rank, job, n.registry.registrationName(job, rank), n.registry.Objects)
			case err == nil && reg.InstanceID != n.instance:
				other = fmt.Sprintf("another agent (at %s) registered as rank %d of job %s after this one, at %s: two nodes claim rank %d (check node-rank in each node's replicator.yaml)",
					reg.Addr, rank, job, reg.Updated.UTC().Format(time.RFC3339), rank)
			}
			n.mu.Lock()
			c.checking, c.checked, c.other = false, time.Now(), other
			n.mu.Unlock()
		}()
	}
	return c.other
}

// locationMustAnswer says why a multi-node job's agents wait for the backup location.
const locationMustAnswer = "(the agents of a multi-node job find each other there: it must answer, unless they run with --peers and --peer-secret-file)"

// defaultJoinLimit is NodeConfig's bound on a Negotiate's use of the backup location before it
// reaches the coordinator; the job waits 300 s for its markers.
const defaultJoinLimit = 4 * time.Minute

// Negotiate registers this node for inc (a job of more than one node) and negotiates. Every
// agent of the job registers where it listens, for this incarnation; a rank that reaches rank 0
// before rank 0 started the incarnation is told to retry.
func (n *Node) Negotiate(ctx context.Context, inc tiers.Incarnation, inv tiers.Inventory) (tiers.RestorePlan, error) {
	if inc.Config.NodeRank != 0 {
		// Another rank now: the coordinator this agent ran as rank 0 ends, and the agents that
		// still find it look up the new rank 0 (Job.Resign).
		n.job.Resign()
	}
	n.forgetTargets(inc.Config.JobName)
	if cfg := inc.Config; cfg.Nodes > 1 && n.registry != nil {
		if err := n.join(ctx, inc); err != nil {
			return tiers.RestorePlan{}, err
		}
	}
	co, err := n.coordinator(ctx, inc) // after join, which read the job's secret
	if err != nil {
		return tiers.RestorePlan{}, err
	}
	plan, err := co.Negotiate(ctx, inc, inv)
	// Every rank registered for this incarnation before it negotiated: what an earlier
	// incarnation's pushes looked up meanwhile goes.
	n.forgetTargets(inc.Config.JobName)
	return plan, err
}

// join does Negotiate's part in the backup location: the job's secret, then this node's
// registration, within joinLimit, saying what it does to WaitingFor meanwhile.
func (n *Node) join(ctx context.Context, inc tiers.Incarnation) error {
	job, objects := inc.Config.JobName, n.registry.Objects
	ctx, cancel := context.WithTimeoutCause(ctx, n.joinLimit, fmt.Errorf("the backup location %s did not answer within %v", objects, n.joinLimit))
	defer cancel()
	doing := func(what string) {
		n.mu.Lock()
		n.joining[job] = what
		n.mu.Unlock()
	}
	defer doing("")
	if n.cfg.Secret == nil {
		doing(fmt.Sprintf("reading the job's secret in the backup location %s %s", objects, locationMustAnswer))
	}
	if _, err := n.secrets.get(ctx, job); err != nil {
		return tiers.CauseFirst(ctx, err)
	}
	reg := Registration{Job: job, Incarnation: inc.ID, InstanceID: n.instance,
		Rank: inc.Config.NodeRank, Addr: n.addr, Updated: time.Now()}
	if _, static := n.peers.(StaticPeers); static {
		n.registerAside(reg)
		return nil
	}
	doing(fmt.Sprintf("registering this node in the backup location %s %s", objects, locationMustAnswer))
	if err := n.registry.Register(ctx, reg); err != nil {
		return fmt.Errorf("register in %s: %w", objects, tiers.CauseFirst(ctx, err))
	}
	n.mu.Lock()
	n.registered[job] = reg
	n.mu.Unlock()
	return nil
}

// registerAside registers reg in the background, for an agent whose peers are static: the
// registration is then for status tools only, and the backup location must not hold up the
// restore. A failure is logged.
func (n *Node) registerAside(reg Registration) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.life.Err() != nil {
		return
	}
	n.checks.Add(1) // under mu while life lasts: Close waits for it
	go func() {
		defer n.checks.Done()
		ctx, cancel := context.WithTimeout(n.life, n.joinLimit)
		defer cancel()
		if err := n.registry.Register(ctx, reg); err != nil {
			if n.life.Err() == nil {
				n.log.Warn("registering in the backup location failed: only status tools miss it, the agents find each other through --peers",
					"backup", n.registry.Objects, "job", reg.Job, "rank", reg.Rank, "err", err)
			}
			return
		}
		n.mu.Lock()
		n.registered[reg.Job] = reg
		n.mu.Unlock()
	}()
}

func (n *Node) Restored(ctx context.Context, inc tiers.Incarnation) error {
	co, err := n.coordinator(ctx, inc)
	if err != nil {
		return err
	}
	return co.Restored(ctx, inc)
}

var _ tiers.RestoreFailureReporter = (*Node)(nil)

// RestoreFailed tells the job's coordinator that this node's restore failed.
func (n *Node) RestoreFailed(ctx context.Context, inc tiers.Incarnation, reason string) error {
	co, err := n.coordinator(ctx, inc)
	if err != nil {
		return err
	}
	rep, ok := co.(tiers.RestoreFailureReporter)
	if !ok {
		return nil
	}
	return rep.RestoreFailed(ctx, inc, reason)
}

func (n *Node) Sync(ctx context.Context, inc tiers.Incarnation, rep tiers.SyncReport) (tiers.SyncDecision, error) {
	co, err := n.coordinator(ctx, inc)
	if err != nil {
		return tiers.SyncDecision{}, err
	}
	return co.Sync(ctx, inc, rep)
}

func (n *Node) Backups(ctx context.Context, inc tiers.Incarnation, rep tiers.BackupReport) (tiers.BackupOrder, error) {
	co, err := n.coordinator(ctx, inc)
	if err != nil {
		return tiers.BackupOrder{}, err
	}
	return co.Backups(ctx, inc, rep)
}

// --- secrets ------------------------------------------------------------------------------

// jobSecrets holds the per-job shared secrets: the fixed one for every job, or the one the first
// agent of the job created in the backup location.
//
// A secret taken from the location is checked against it again now and then (recheck, on a
// use): deleted there (by hand, or by a lifecycle rule on old objects), an agent started
// afterwards created a new one while the running agents kept theirs, and every restart of the
// job failed on a wrong MAC until every agent was restarted (found by a black-box run). A
// secret gone is put back; one that is not the one in use (made anew meanwhile) is taken, so
// that every agent of the job comes to use the one in the location.
type jobSecrets struct {
	fixed   []byte
	objects Objects
	log     *slog.Logger
	recheck time.Duration // how often a job's secret is checked against the location

	mu      sync.Mutex
	byJob   map[string][]byte    // GUARDED_BY(mu)
	checked map[string]time.Time // GUARDED_BY(mu); when each job's secret was last checked
	checks  sync.WaitGroup       // the checks running (tests wait for them)
}

// secretRecheck is how often an agent checks a job's secret against the backup location.
const secretRecheck = time.Minute

func (s *jobSecrets) get(ctx context.Context, job string) ([]byte, error) {
	if s.fixed != nil {
		return s.fixed, nil
	}
	if sec, ok := s.recheckIfDue(job); ok {
		return sec, nil
	}
	// Not under mu: the store may be slow, and every peer call asks. Concurrent first calls
	// all get the one secret EnsureSecret creates (create-if-absent).
	sec, err := EnsureSecret(ctx, s.objects, job)
	if err != nil {
		return nil, fmt.Errorf("per-job secret in %s: %w", s.objects, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if prev, ok := s.byJob[job]; ok {
		return prev, nil
	}
	s.byJob[job] = sec
	s.checked[job] = time.Now()
	return sec, nil
}

// recheckIfDue returns job's secret if this agent holds it, and checks it against the location
// in the background when the last check is recheck old.
func (s *jobSecrets) recheckIfDue(job string) ([]byte, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	sec, ok := s.byJob[job]
	if ok && time.Since(s.checked[job]) >= s.recheck {
		s.checked[job] = time.Now()
		s.checks.Go(func() { s.check(job, sec) }) // store I/O, off the caller's path
	}
	return sec, ok
}

// check compares job's secret in the location with sec, the one in use: it puts it back when it
// is gone, and takes the one there when it differs.
func (s *jobSecrets) check(job string, sec []byte) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	stored, created, err := ensureSecret(ctx, s.objects, job, sec)
	if err != nil {
		s.log.Warn("the job's peer secret could not be checked against the backup location", "job", job, "err", err)
		return
	}
	if created {
		s.log.Warn("the job's peer secret was gone from the backup location: put back (an agent started without it would make another, and the job's restarts would fail on a wrong MAC)",
			"job", job, "location", s.objects.String())
	}
	if bytes.Equal(stored, sec) {
		return
	}
	s.mu.Lock()
	if bytes.Equal(s.byJob[job], sec) {
		s.byJob[job] = stored
	}
	s.mu.Unlock()
	s.log.Warn("the job's peer secret in the backup location is not the one this agent used (it was made anew, by an agent started while it was gone): this agent uses it from now on",
		"job", job, "location", s.objects.String())
}

// cached returns job's secret if this agent holds it already (the fixed one, or one read from
// the location), without store I/O.
func (s *jobSecrets) cached(job string) ([]byte, bool) {
	if s.fixed != nil {
		return s.fixed, true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	sec, ok := s.byJob[job]
	return sec, ok
}

// lookup serves the gRPC side (a SecretFunc), which asks without a context.
func (s *jobSecrets) lookup(job string) ([]byte, bool) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	sec, err := s.get(ctx, job)
	return sec, err == nil
}
