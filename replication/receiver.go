package replication

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/replication/peerpb"
)

// ReceiverConfig configures a Receiver.
type ReceiverConfig struct {
	// Dir is where transfers are assembled until they are verified: a directory inside the
	// spool, on the same file system as the sealed data so that Accept can rename. Created if
	// missing; leftovers of an earlier process are removed.
	Dir string
	// Secrets gives the shared secret of each job this agent serves (see Authenticate).
	Secrets SecretFunc
	// Instance is this agent's instance id: calls meant for another instance (see WithTarget)
	// are refused with UNAVAILABLE. Empty accepts every call.
	Instance string
	// AdmitPush, when set, is asked before a push of job's data from rank, whose incarnation
	// took part in restore generation (0: none recorded), moves any byte; an error refuses it
	// with FailedPrecondition. The agent refuses replicas while it serves no incarnation of the
	// job, or one that took part in another restore: a replica there would count as replicated
	// on a node outside the job (an agent a static --peers still names after its machine was
	// replaced).
	AdmitPush func(job string, rank int, generation int64) error
	// Accept takes a transfer that passed every check. path is the data, named dataName: a
	// directory for "D<hash>.data", a regular file otherwise (also for a .meta). Accept must
	// move it out of Dir (rename); whatever is left there is removed when it returns. An error
	// fails the transfer, and the sender's Commit gets it.
	Accept func(ctx context.Context, job string, rank int, dataName, path string) error
	// Lookup returns the local path of a "<hash>.data" this agent holds for job, for Fetch; an
	// error matching fs.ErrNotExist is reported as NotFound. The data must stay readable while
	// it is fetched. Nil: Fetch always answers NotFound.
	Lookup func(ctx context.Context, job, dataName string) (string, error)
	// Corrupt, when set, is told of data Lookup gave that fails its check when it is served:
	// the agent drops it.
	Corrupt func(job, dataName string, err error)
	// Digests, when set, supplies the digests of served files that were hashed earlier.
	Digests *layout.DigestCache
	// MaxIncoming caps the declared bytes of all transfers in progress; a header that would
	// go past it is refused with ResourceExhausted before anything is written. Required.
	MaxIncoming int64
	// Reserve, when set, is charged with the declared bytes of each new transfer (and refunded
	// when one is discarded, or accepted: from then on whoever Accept handed the data to
	// accounts for it); an error refuses it with ResourceExhausted. tiers.Spool.Reserve
	// fits.
	Reserve func(delta int64) error
	// NoRoom, when set, is called when a transfer is refused or fails for lack of room on this
	// node (ResourceExhausted): the sender's job is told, and this node's job may need to be
	// (its saves fail with ENOSPC while the RAM is full).
	NoRoom func()
	// IdleTimeout drops a transfer that received nothing for this long (a sender that died
	// between streams, or never committed). Default 2 minutes.
	IdleTimeout time.Duration
	// Compression says whether Fetch compresses the chunks it serves to a fetcher that asks for
	// it: CompressOff never does, CompressAuto and CompressOn do (the fetcher decides when to
	// ask). Compressed pushes are taken whatever it says.
	Compression Compression
	// Yield, when set, is called on each push stream once it joined its transfer and before its
	// chunks are read: the agent holds a push back there while its own job saves on a busy node
	// (tiers.Replicator.YieldToSaves), and reports whether it held it. It must return well
	// within IdleTimeout and the sender's stall timeout. Transfers that send less than
	// yieldMinBytes (a .meta, a step whose files went early) and fetches never wait.
	Yield func(ctx context.Context) bool
	// Logger receives refusals and discarded transfers. Default slog.Default().
	Logger *slog.Logger
	// asOld makes the receiver behave, on the wire, as an agent older than chunk compression:
	// no codec announced to pushers, accept_codecs of fetchers ignored. For tests.
	asOld bool
	// Now is the clock for authentication; default time.Now.
	Now func() time.Time
}

// incomingPrefix starts the name of every transfer's private directory in ReceiverConfig.Dir.
const incomingPrefix = "incoming-"

// maxStreams bounds the parallel streams of one fetch.
const maxStreams = 64

// Receiver serves the Peer service: it takes pushes into ReceiverConfig.Dir, verifies them and
// hands them to Accept, and serves fetches of the data Lookup finds. Register it on a gRPC
// server built with ServerOptions.
//
// A transfer lives from its first stream's header until Commit, Abandon, a failure, the idle
// timeout or Close. Goroutines: gRPC's, one per call; an idle timer per transfer. No goroutine
// outlives Close except calls still returning.
type Receiver struct {
	peerpb.UnimplementedPeerServer
	cfg       ReceiverConfig
	log       *slog.Logger
	manifests manifestCache
	// corruptChunks counts the pushed chunks that failed their CRC32C (the sender sends them
	// again): a link that corrupts data shows in the metrics.
	corruptChunks atomic.Int64

	// LOCK ORDERING: mu, then a sink's per-file locks (never the other way).
	mu        sync.Mutex
	transfers map[string]*transfer // GUARDED_BY(mu); by transfer id
	// dropped remembers recently failed transfers by id, so that a stream arriving late for
	// one is refused instead of starting it afresh, with the transfer's own reason (and its
	// code: the sender may hear of the late stream first). Entries older than IdleTimeout go.
	dropped  map[string]droppedTransfer // GUARDED_BY(mu)
	inFlight int64                      // GUARDED_BY(mu); declared bytes of the transfers
	closed   bool                       // GUARDED_BY(mu)
	// early holds the early files pushed before their step committed (see early.go); lastInc
	// the incarnation each sender rank last pushed from; expiry drops idle groups.
	early   map[earlyKey]*earlyGroup // GUARDED_BY(mu)
	lastInc map[rankKey]string       // GUARDED_BY(mu)
	expiry  *time.Timer
}

var _ peerpb.PeerServer = (*Receiver)(nil)

// yieldMinBytes is the smallest transfer ReceiverConfig.Yield holds back.
const yieldMinBytes = 1 << 20

// transfer is one push in progress.
type transfer struct {
	id   string
	from Identity
	addr string // the first stream's peer address, for logs
	m    *manifest
	// earlyGroup is set for an early push, consumes for a push reusing an early group whose
	// files presumed (indices into m's files) are linked instead of sent.
	earlyGroup, consumes string
	presumed             []uint32
	// reserved is the bytes charged for the transfer: the files it receives, and the early
	// files it took over (early, their paths, removed when the transfer ends).
	reserved int64    // GUARDED_BY(Receiver.mu)
	early    []string // GUARDED_BY(Receiver.mu)
	// ready is closed once sink (or err) is set; streams that join wait for it.
	ready chan struct{}
	sink  *sink // GUARDED_BY(Receiver.mu) until ready
	err   error // GUARDED_BY(Receiver.mu) until ready
	// lastActive is the Unix time in nanoseconds of the last chunk or stream.
	lastActive atomic.Int64
	streams    int         // GUARDED_BY(Receiver.mu); streams running
	committing bool        // GUARDED_BY(Receiver.mu)
	gone       bool        // GUARDED_BY(Receiver.mu); discarded or accepted
	timer      *time.Timer // GUARDED_BY(Receiver.mu); idle check
	started    time.Time
}

// droppedTransfer is when a transfer was discarded, and why.
type droppedTransfer struct {
	at     time.Time
	reason error
}

// NewReceiver checks cfg and prepares cfg.Dir.
func NewReceiver(cfg ReceiverConfig) (*Receiver, error) {
	switch {
	case cfg.Dir == "":
		return nil, errors.New("receiver: Dir is required")
	case cfg.Secrets == nil:
		return nil, errors.New("receiver: Secrets is required")
	case cfg.Accept == nil:
		return nil, errors.New("receiver: Accept is required")
	case cfg.MaxIncoming <= 0:
		return nil, errors.New("receiver: MaxIncoming must be > 0")
	}
	if cfg.IdleTimeout <= 0 {
		cfg.IdleTimeout = 2 * time.Minute
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("receiver: %w", err)
	}
	// Transfers of an earlier process were never verified: drop them.
	des, err := os.ReadDir(cfg.Dir)
	if err != nil {
		return nil, fmt.Errorf("receiver: %w", err)
	}
	for _, de := range des {
		if strings.HasPrefix(de.Name(), incomingPrefix) || de.Name() == earlyDirName {
			if err := os.RemoveAll(filepath.Join(cfg.Dir, de.Name())); err != nil {
				return nil, fmt.Errorf("receiver: remove stale transfer: %w", err)
			}
		}
	}
	if err := os.Mkdir(filepath.Join(cfg.Dir, earlyDirName), 0o700); err != nil {
		return nil, fmt.Errorf("receiver: %w", err)
	}
	r := &Receiver{cfg: cfg, log: cfg.Logger, transfers: map[string]*transfer{}, dropped: map[string]droppedTransfer{},
		early: map[earlyKey]*earlyGroup{}, lastInc: map[rankKey]string{}}
	r.mu.Lock()
	r.expiry = time.AfterFunc(earlyIdle/4, r.expireEarly)
	r.mu.Unlock()
	return r, nil
}

// Register adds the peer service to s.
func (r *Receiver) Register(s grpc.ServiceRegistrar) { peerpb.RegisterPeerServer(s, r) }

// Close discards every transfer in progress and refuses new ones. Stop the gRPC server first:
// with ServerOptions, its Stop returns once every call has.
func (r *Receiver) Close() error {
	r.mu.Lock()
	r.closed = true
	r.expiry.Stop()
	var all []*transfer
	for _, t := range r.transfers {
		all = append(all, t)
	}
	var groups []*earlyGroup
	for k, g := range r.early {
		groups = append(groups, g)
		delete(r.early, k)
	}
	r.mu.Unlock()
	r.freeEarly(groups, "receiver closed")
	var errs []error
	for _, t := range all {
		errs = append(errs, r.discard(t, errors.New("receiver closed")))
	}
	return errors.Join(errs...)
}

// CorruptChunks returns how many pushed chunks failed their CRC32C.
func (r *Receiver) CorruptChunks() int64 { return r.corruptChunks.Load() }

// authenticate checks a call's credentials and target, logging refusals with the peer address.
func (r *Receiver) authenticate(ctx context.Context) (Identity, error) {
	from, err := Authenticate(ctx, r.cfg.Secrets, r.cfg.Now())
	if err == nil {
		err = checkTarget(ctx, r.cfg.Instance)
	}
	if err != nil {
		method, _ := grpc.Method(ctx)
		r.log.Warn("peer call refused", "peer", peerAddr(ctx), "method", method, "job", from.Job, "rank", from.Rank, "err", err)
		return from, err
	}
	return from, nil
}

func peerAddr(ctx context.Context) string {
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		return p.Addr.String()
	}
	return "unknown"
}

// noRoom gives a write that found this node's RAM full (ENOSPC) the code ResourceExhausted and
// says what to do: the sender's job read a raw "no space left on device" with code Unknown
// (found by a black-box run).
func noRoom(err error) error {
	if err == nil || !errors.Is(err, syscall.ENOSPC) || status.Code(err) != codes.Unknown {
		return err
	}
	return errExhausted("the receiving node's RAM is full (%v): give its agent a larger --memory (an agent without root: more room on its spool's file system, a container's /dev/shm)", err)
}

// refused is noRoom that also tells NoRoom when err refuses a transfer for lack of room.
func (r *Receiver) refused(err error) error {
	err = noRoom(err)
	if err != nil && status.Code(err) == codes.ResourceExhausted && r.cfg.NoRoom != nil {
		r.cfg.NoRoom()
	}
	return err
}

// PushFiles receives one stream of a transfer.
func (r *Receiver) PushFiles(stream grpc.ClientStreamingServer[peerpb.PushMessage, peerpb.PushReply]) (err error) {
	defer func() { err = r.refused(err) }()
	ctx := stream.Context()
	from, err := r.authenticate(ctx)
	if err != nil {
		return err
	}
	first := inMessage{header: &peerpb.PushHeader{}}
	if err := stream.RecvMsg(&first); err == io.EOF {
		return errInvalid("stream ended before its header")
	} else if err != nil {
		return err
	}
	if !first.isHeader {
		first.chunk.release()
		return errInvalid("a stream must start with a header")
	}
	h := first.header.(*peerpb.PushHeader)
	t, err := r.join(ctx, from, h)
	if err != nil {
		r.log.Warn("peer transfer refused", "peer", peerAddr(ctx), "job", from.Job, "rank", from.Rank,
			"data", h.GetManifest().GetDataName(), "transfer", h.TransferId, "err", err)
		return err
	}
	defer func() { r.leave(t, err) }()
	held := false
	if r.cfg.Yield != nil && t.m.toSend() >= yieldMinBytes {
		// Before the codecs header: the sender measures its link from that header on, and
		// time held here is not the link's; the header says the stream was held, so that the
		// sender does not count the chunks that filled the flow-control window meanwhile.
		held = r.cfg.Yield(ctx)
		t.lastActive.Store(time.Now().UnixNano())
	}
	if !r.cfg.asOld {
		// The sender compresses only once it saw this (see codecsHeader).
		md := metadata.Pairs(codecsHeader, codecPlanesName)
		if held {
			md.Set(heldHeader, "1")
		}
		if err := stream.SendHeader(md); err != nil {
			return fmt.Errorf("transfer %s: %w", t.id, err)
		}
	}

	inf := getInflater()
	defer putInflater(inf)
	var n int64
	msg := inMessage{header: &peerpb.PushHeader{}}
	for {
		if err := stream.RecvMsg(&msg); err == io.EOF {
			break
		} else if err != nil {
			return fmt.Errorf("transfer %s: %w", t.id, err)
		}
		if msg.isHeader {
			return errInvalid("transfer %s: a second header on one stream", t.id)
		}
		written, err := t.sink.write(&msg.chunk, inf)
		n += written
		msg.chunk.release()
		if err != nil {
			return fmt.Errorf("transfer %s: %w", t.id, err)
		}
		t.lastActive.Store(time.Now().UnixNano())
	}
	return stream.SendAndClose(&peerpb.PushReply{Bytes: n})
}

// join finds or starts the transfer a stream's header names, and counts the stream.
func (r *Receiver) join(ctx context.Context, from Identity, h *peerpb.PushHeader) (*transfer, error) {
	if !isHex32(h.TransferId) {
		return nil, errInvalid("transfer id %q: want 32 lower-case hex digits", h.TransferId)
	}
	if h.Job != from.Job || h.Incarnation != from.Incarnation || int(h.SenderRank) != from.Rank || h.SenderInstance != from.Instance {
		return nil, errPermission("header names job %q incarnation %q rank %d instance %q; the call was signed as job %q incarnation %q rank %d instance %q",
			h.Job, h.Incarnation, h.SenderRank, h.SenderInstance, from.Job, from.Incarnation, from.Rank, from.Instance)
	}
	if r.cfg.AdmitPush != nil {
		if err := r.cfg.AdmitPush(from.Job, from.Rank, h.Generation); err != nil {
			return nil, errPrecondition("%v", err)
		}
	}
	m, err := checkManifest(h.Manifest, from.Job, true)
	if err != nil {
		return nil, err
	}
	r.noteIncarnation(from)
	reserve := m.total
	switch {
	case h.EarlyGroup != "" && (h.ConsumesGroup != "" || len(h.Presumed) > 0):
		return nil, errInvalid("an early push cannot consume a group")
	case h.EarlyGroup != "":
		if err := checkGroup(h.EarlyGroup); err != nil {
			return nil, err
		}
		if m.kind != kindFile {
			return nil, errInvalid("early push of %s: only single files (<hash>.data) are pushed early", m.pb.DataName)
		}
	case h.ConsumesGroup != "":
		if err := checkGroup(h.ConsumesGroup); err != nil {
			return nil, err
		}
		if err := m.presume(h.Presumed); err != nil {
			return nil, err
		}
		reserve = m.sendTotal
	case len(h.Presumed) > 0:
		return nil, errInvalid("presumed files without a group to take them from")
	}

	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return nil, withCode(codes.Unavailable, "receiver is closing")
	}
	if t := r.transfers[h.TransferId]; t != nil {
		if err := t.admits(from, h); err != nil {
			r.mu.Unlock()
			return nil, err
		}
		t.streams++
		t.lastActive.Store(time.Now().UnixNano())
		r.mu.Unlock()
		if err := r.waitReady(ctx, t); err != nil {
			r.leave(t, nil)
			return nil, err
		}
		return t, nil
	}
	if d, ok := r.dropped[h.TransferId]; ok {
		r.mu.Unlock()
		code := status.Code(d.reason)
		if code == codes.OK || code == codes.Unknown {
			code = codes.Aborted
		}
		return nil, withCode(code, "transfer %s failed already: %v", h.TransferId, d.reason)
	}
	if free := r.cfg.MaxIncoming - r.inFlight; reserve > free {
		r.mu.Unlock()
		return nil, errExhausted("%s: %d bytes declared, only %d of %d free for incoming transfers", m.pb.DataName, reserve, max(free, 0), r.cfg.MaxIncoming)
	}
	if r.cfg.Reserve != nil {
		if err := r.cfg.Reserve(reserve); err != nil {
			r.mu.Unlock()
			return nil, errExhausted("%s: %d bytes declared: %v", m.pb.DataName, reserve, err)
		}
	}
	t := &transfer{id: h.TransferId, from: from, addr: peerAddr(ctx), m: m, ready: make(chan struct{}), streams: 1, started: time.Now(),
		earlyGroup: h.EarlyGroup, consumes: h.ConsumesGroup, presumed: h.Presumed, reserved: reserve}
	t.lastActive.Store(time.Now().UnixNano())
	r.inFlight += reserve
	r.transfers[t.id] = t
	t.timer = time.AfterFunc(r.cfg.IdleTimeout, func() { r.expire(t) })
	r.mu.Unlock()

	s, err := newSink(r.cfg.Dir, incomingPrefix, m)
	if s != nil {
		s.corrupt = &r.corruptChunks
	}
	if err == nil && len(t.presumed) > 0 {
		if err = r.adoptEarly(t, h, s); err != nil {
			s.discard(err)
		}
	}
	r.mu.Lock()
	switch {
	case err != nil:
		t.err = err
	case t.gone: // discarded meanwhile
		s.discard(errors.New("abandoned while it was being created"))
		t.err = errAborted("transfer %s was abandoned", t.id)
	default:
		t.sink = s
	}
	close(t.ready)
	r.mu.Unlock()
	if t.err != nil {
		r.leave(t, t.err)
		return nil, t.err
	}
	return t, nil
}

// admits checks that another stream with header h may join t.
func (t *transfer) admits(from Identity, h *peerpb.PushHeader) error { // REQUIRES Receiver.mu
	switch {
	case t.from != from:
		return errPermission("transfer %s belongs to another sender", t.id)
	case t.committing:
		return errPrecondition("transfer %s is being committed", t.id)
	case !proto.Equal(t.m.pb, h.Manifest) || t.earlyGroup != h.EarlyGroup || t.consumes != h.ConsumesGroup ||
		!slices.Equal(t.presumed, h.Presumed):
		return errInvalid("transfer %s: this stream's header differs from the first stream's", t.id)
	}
	return nil
}

func (r *Receiver) waitReady(ctx context.Context, t *transfer) error {
	select {
	case <-t.ready:
	case <-ctx.Done():
		return ctx.Err()
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return t.err
}

// leave uncounts a stream; a stream that failed takes its whole transfer down, since the bytes
// it carried are lost.
func (r *Receiver) leave(t *transfer, err error) {
	r.mu.Lock()
	t.streams--
	r.mu.Unlock()
	if err != nil {
		r.discard(t, err)
	}
}

// expire drops t if it has been idle for IdleTimeout, else checks again later.
func (r *Receiver) expire(t *transfer) {
	idle := time.Since(time.Unix(0, t.lastActive.Load()))
	r.mu.Lock()
	if t.gone || t.committing {
		r.mu.Unlock()
		return
	}
	if idle < r.cfg.IdleTimeout {
		t.timer.Reset(r.cfg.IdleTimeout - idle)
		r.mu.Unlock()
		return
	}
	r.mu.Unlock()
	r.discard(t, fmt.Errorf("nothing received for %v", idle.Round(time.Second)))
}

// discard drops t and everything received for it; reason is logged. It is safe to call more
// than once.
func (r *Receiver) discard(t *transfer, reason error) error {
	reason = noRoom(reason)
	r.mu.Lock()
	if t.gone {
		r.mu.Unlock()
		return nil
	}
	t.gone = true
	delete(r.transfers, t.id)
	r.inFlight -= t.reserved
	reserved, early := t.reserved, t.early
	t.timer.Stop()
	now := time.Now()
	for id, d := range r.dropped {
		if now.Sub(d.at) > r.cfg.IdleTimeout {
			delete(r.dropped, id)
		}
	}
	r.dropped[t.id] = droppedTransfer{now, reason}
	s := t.sink
	r.mu.Unlock()
	if r.cfg.Reserve != nil {
		r.cfg.Reserve(-reserved)
	}
	for _, p := range early {
		os.Remove(p)
	}
	r.log.Warn("peer transfer discarded", "peer", t.addr, "job", t.from.Job, "rank", t.from.Rank,
		"data", t.m.pb.DataName, "transfer", t.id, "reason", reason)
	if s == nil {
		return nil // still being created: join discards it
	}
	return s.discard(reason)
}

// Commit verifies a transfer whose streams have all ended and hands it to Accept.
func (r *Receiver) Commit(ctx context.Context, req *peerpb.CommitRequest) (_ *peerpb.CommitReply, err error) {
	defer func() { err = r.refused(err) }()
	from, err := r.authenticate(ctx)
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	t := r.transfers[req.TransferId]
	switch {
	case t == nil:
		err = errNotFound("no transfer %q here: it failed, was abandoned or never started", req.TransferId)
	case t.from != from:
		err = errPermission("transfer %s belongs to another sender", t.id)
	case t.committing:
		err = errPrecondition("transfer %s is already being committed", t.id)
	case t.streams > 0:
		err = errPrecondition("transfer %s still has %d open streams", t.id, t.streams)
	default:
		t.committing = true
		t.timer.Stop()
	}
	r.mu.Unlock()
	if err != nil {
		return nil, err
	}

	if err := t.sink.verify(ctx); err != nil {
		r.discard(t, err)
		return nil, err
	}
	accept := func() error { return r.cfg.Accept(ctx, t.from.Job, t.from.Rank, t.m.pb.DataName, t.sink.root) }
	if t.earlyGroup != "" {
		accept = func() error { return r.keepEarly(t, t.earlyGroup) }
	}
	if err := accept(); err != nil {
		err = fmt.Errorf("accept %s: %w", t.m.pb.DataName, err)
		r.discard(t, err)
		return nil, err
	}
	r.mu.Lock()
	t.gone = true
	delete(r.transfers, t.id)
	r.inFlight -= t.reserved
	early, reserved := t.early, t.reserved
	r.mu.Unlock()
	for _, p := range early {
		os.Remove(p) // the accepted data holds its own links
	}
	if t.earlyGroup == "" && r.cfg.Reserve != nil {
		// Accepted data is accounted for by whoever Accept handed it to (tiers: the
		// namespace charges the files it imports); kept here too, it was counted twice and
		// never refunded. An early file's charge went to its group (keepEarly).
		r.cfg.Reserve(-reserved)
	}
	if t.consumes != "" {
		r.consumeEarly(t, t.consumes)
	}
	if err := t.sink.discard(errFinished); err != nil { // what Accept left behind
		r.log.Warn("peer transfer: cleanup after accept", "transfer", t.id, "err", err)
	}
	if t.earlyGroup != "" {
		r.log.Debug("early file received", "peer", t.addr, "job", t.from.Job, "rank", t.from.Rank,
			"group", t.earlyGroup, "bytes", t.m.total, "took", time.Since(t.started).Round(time.Millisecond))
		return &peerpb.CommitReply{}, nil
	}
	r.log.Info("peer transfer received", "peer", t.addr, "job", t.from.Job, "rank", t.from.Rank,
		"data", t.m.pb.DataName, "bytes", t.m.total, "files", len(t.m.pb.Files), "early_files", len(t.presumed),
		"bytes_received", t.reserved, "took", time.Since(t.started).Round(time.Millisecond))
	return &peerpb.CommitReply{}, nil
}

// Abandon drops a transfer of the caller's, unless it is being committed.
func (r *Receiver) Abandon(ctx context.Context, req *peerpb.AbandonRequest) (*peerpb.AbandonReply, error) {
	from, err := r.authenticate(ctx)
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	t := r.transfers[req.TransferId]
	drop := t != nil && t.from == from && !t.committing
	r.mu.Unlock()
	if drop {
		r.discard(t, errors.New("abandoned by the sender"))
	}
	return &peerpb.AbandonReply{}, nil
}

// Fetch sends the caller's share of a "<hash>.data" this agent holds.
func (r *Receiver) Fetch(req *peerpb.FetchRequest, stream grpc.ServerStreamingServer[peerpb.FetchMessage]) error {
	ctx := stream.Context()
	from, err := r.authenticate(ctx)
	if err != nil {
		return err
	}
	if _, _, err := parseDataName(req.DataName, from.Job, false); err != nil {
		return err
	}
	if req.StreamCount == 0 || req.StreamCount > maxStreams || req.StreamIndex >= req.StreamCount {
		return errInvalid("stream %d of %d: want 0 ≤ index < count ≤ %d", req.StreamIndex, req.StreamCount, maxStreams)
	}
	chunk := clampChunkSize(int(req.ChunkSize))
	if r.cfg.Lookup == nil {
		return errNotFound("%s is not held here", req.DataName)
	}
	p, err := r.cfg.Lookup(ctx, from.Job, req.DataName)
	if errors.Is(err, fs.ErrNotExist) {
		return errNotFound("%s is not held here", req.DataName)
	}
	if err != nil {
		return fmt.Errorf("look up %s: %w", req.DataName, err)
	}
	// The manifest is shared by every stream (and fetcher) of the same data, so it is built on a
	// context no single caller's end cancels.
	m, release, err := r.manifests.get(ctx, p+"\x00"+req.DataName, func() (*manifest, error) {
		return buildManifest(context.WithoutCancel(ctx), p, req.DataName, from.Job, r.cfg.Digests)
	})
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if err != nil {
		r.log.Error("peer fetch: local data cannot be served", "data", req.DataName, "path", p, "err", err)
		switch status.Code(err) {
		case codes.Unknown:
			err = errCorrupt("%s cannot be served: %v", req.DataName, err)
		case codes.DataLoss: // the data fails its check
			if r.cfg.Corrupt != nil {
				r.cfg.Corrupt(from.Job, req.DataName, err)
			}
		}
		return err
	}
	defer release()
	if err := stream.Send(&peerpb.FetchMessage{Kind: &peerpb.FetchMessage_Manifest{Manifest: m.pb}}); err != nil {
		return err
	}
	out := chunkOut{send: func(c *outChunk) error { return stream.SendMsg(c) }}
	defer out.release()
	if !r.cfg.asOld && r.cfg.Compression != CompressOff && slices.Contains(req.AcceptCodecs, peerpb.ChunkCodec_CHUNK_CODEC_PLANES) {
		out.compress = func() bool { return true }
	}
	_, err = sendShare(ctx, p, m, m.share(int(req.StreamIndex), int(req.StreamCount)), chunk, &out)
	return err
}

func clampChunkSize(n int) int {
	if n == 0 {
		return DefaultChunkSize
	}
	return min(max(n, minChunkSize), MaxChunkSize)
}

func isHex32(s string) bool {
	return len(s) == 32 && strings.Trim(s, "0123456789abcdef") == ""
}

// manifestCache shares the manifest of data being served between the parallel streams of one
// fetch, so that its files are hashed once. An entry lives while a stream uses it.
type manifestCache struct {
	mu      sync.Mutex
	entries map[string]*cachedManifest // GUARDED_BY(mu)
}

type cachedManifest struct {
	ready chan struct{}
	m     *manifest // set before ready is closed
	err   error     // set before ready is closed
	refs  int       // GUARDED_BY(manifestCache.mu)
}

// get returns the manifest for key, building it once for concurrent callers; release must be
// called when done (only when err is nil).
func (c *manifestCache) get(ctx context.Context, key string, build func() (*manifest, error)) (*manifest, func(), error) {
	c.mu.Lock()
	if c.entries == nil {
		c.entries = map[string]*cachedManifest{}
	}
	e := c.entries[key]
	first := e == nil
	if first {
		e = &cachedManifest{ready: make(chan struct{})}
		c.entries[key] = e
	}
	e.refs++
	c.mu.Unlock()
	release := func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		if e.refs--; e.refs == 0 {
			delete(c.entries, key)
		}
	}
	if first {
		e.m, e.err = build()
		close(e.ready)
	}
	select {
	case <-e.ready:
	case <-ctx.Done():
		release()
		return nil, nil, ctx.Err()
	}
	if e.err != nil {
		release()
		return nil, nil, e.err
	}
	return e.m, release, nil
}
