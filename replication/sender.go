package replication

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/replication/peerpb"
)

// Defaults of a Sender, measured with bench/peerbench (bench/RESULTS.md).
const (
	// DefaultStreams is how many parallel streams one transfer uses.
	DefaultStreams = 4
	// DefaultStallTimeout is how long a transfer may make no progress before it fails.
	DefaultStallTimeout = 30 * time.Second
	// minVerifyRate is the slowest a receiver is assumed to hash data at Commit (files it could
	// not hash as they arrived are read back)
	// (bytes/s); Commit's deadline allows for it on top of the stall timeout.
	minVerifyRate = 64 << 20
)

// ErrStalled is the cause of a transfer that made no progress for the stall timeout: the peer
// or the network stopped moving bytes without closing the connection.
var ErrStalled = errors.New("peer transfer stalled")

// Sender is this agent's side of calls to a peer: it pushes data to a peer and fetches data from
// one. The zero value needs Instance and Secrets; the other fields have defaults. A Sender is
// safe for concurrent use; each call owns the goroutines it starts, one per stream, and ends
// them before it returns.
type Sender struct {
	Instance string     // this agent process's instance id (see Identity)
	Secrets  SecretFunc // the job's shared secret
	// ChunkSize is the bytes per chunk (DefaultChunkSize; clamped to [64 KiB, MaxChunkSize]).
	ChunkSize int
	// Streams is the parallel streams per transfer (DefaultStreams; at most 64). A small
	// transfer uses fewer: no stream carries less than a chunk.
	Streams int
	// StallTimeout fails a transfer that moved no chunk for this long (DefaultStallTimeout).
	StallTimeout time.Duration
	// Digests supplies file digests computed earlier (when the files were closed), so that a
	// push does not read its files twice.
	Digests *layout.DigestCache
	// Compress says when chunks pushed to a peer, and asked of a peer in a fetch, are
	// compressed (default CompressAuto: when the link to that peer is slower than the codec).
	Compress Compression
	// CodecRate is what one core compresses, in bytes/s, for CompressAuto's comparison; 0: measured
	// on this machine on first use.
	CodecRate float64

	// bytesSent counts the chunk bytes pushed (not fetched) by this sender, as read; wireSent
	// the same chunks as they went on the wire, codedChunks those sent compressed.
	bytesSent, wireSent, codedChunks atomic.Int64
	// fetched, wireFetched and codedFetched count the same for the chunks fetched.
	fetched, wireFetched, codedFetched atomic.Int64
	// corruptChunks counts the fetched chunks that failed their CRC32C.
	corruptChunks atomic.Int64

	linksMu sync.Mutex
	links   map[string]*linkMeter // GUARDED_BY(linksMu); by connection target
}

// BytesSent returns the chunk bytes this sender pushed so far.
func (s *Sender) BytesSent() int64 { return s.bytesSent.Load() }

// WireBytesSent returns the bytes on the wire of the chunks this sender pushed so far: BytesSent
// less what compression saved.
func (s *Sender) WireBytesSent() int64 { return s.wireSent.Load() }

// ChunksCompressed returns how many of the chunks this sender pushed went compressed.
func (s *Sender) ChunksCompressed() int64 { return s.codedChunks.Load() }

// Fetched returns the chunk bytes this sender fetched so far as written (original), as they
// came on the wire, and how many chunks came compressed.
func (s *Sender) Fetched() (bytes, wireBytes, chunksCompressed int64) {
	return s.fetched.Load(), s.wireFetched.Load(), s.codedFetched.Load()
}

// CorruptChunks returns how many fetched chunks failed their CRC32C.
func (s *Sender) CorruptChunks() int64 { return s.corruptChunks.Load() }

// PushRequest names the data to push and who pushes it.
type PushRequest struct {
	Job         string
	Incarnation string
	Rank        int    // the sender's rank
	DataName    string // "<hash>.data", "D<hash>.data" or a .meta name of Job
	Source      string // the data in the spool: a directory for "D<hash>.data", else a file
	// EarlyGroup makes this an early push: Source is one file the job closed inside the
	// top-level directory EarlyGroup before its step committed, DataName its "<hash>.data". The
	// peer keeps it aside until a push that consumes the group (see peerpb.PushHeader).
	EarlyGroup string
	// ConsumesGroup names the early group whose files this push of sealed data may reuse;
	// Presumed holds the digests of the files the peer acknowledged in that group. Files with
	// those digests are not sent; if the peer no longer has them, the push is repeated whole.
	ConsumesGroup string
	Presumed      map[layout.FileDigest]bool
	// Generation is the restore generation of the sender's incarnation (0: none recorded), for
	// the receiver to check (peerpb.PushHeader.generation).
	Generation int64
}

// FetchRequest names the data to fetch, who fetches it, and where it goes.
type FetchRequest struct {
	Job         string
	Incarnation string
	Rank        int    // the fetcher's rank
	DataName    string // "<hash>.data" or "D<hash>.data"
	// Dir is the directory (in the spool) where the data appears as Dir/DataName once verified.
	Dir string
	// MaxBytes refuses data larger than this (ResourceExhausted); 0 means no limit.
	MaxBytes int64
	// Progress, if set, is called with the bytes received so far and the data's total, from
	// the streams' goroutines (concurrently; done may arrive out of order).
	Progress func(done, total int64)
}

func (s *Sender) chunkSize() int { return clampChunkSize(s.ChunkSize) }

func (s *Sender) streams() int {
	if s.Streams <= 0 {
		return DefaultStreams
	}
	return min(s.Streams, maxStreams)
}

// announceWait is how long the first chunk of a compressed push waits for the receiver's
// announcement of the codec.
func (s *Sender) announceWait() time.Duration { return min(time.Second, s.stallTimeout()/4) }

func (s *Sender) stallTimeout() time.Duration {
	if s.StallTimeout <= 0 {
		return DefaultStallTimeout
	}
	return s.StallTimeout
}

// callOptions authenticates calls as id.
func (s *Sender) callOptions(id Identity) ([]grpc.CallOption, error) {
	if s.Secrets == nil {
		return nil, errors.New("sender has no Secrets")
	}
	secret, ok := s.Secrets(id.Job)
	if !ok {
		return nil, fmt.Errorf("no shared secret for job %q", id.Job)
	}
	return []grpc.CallOption{grpc.PerRPCCredentials(Credentials(id, secret)), grpc.ForceCodecV2(peerCodec{})}, nil
}

// Push sends the data at req.Source to the peer behind conn, over parallel streams, and commits
// it. It returns nil only when the peer verified every byte and its Accept took the data. On
// failure the peer discards what it received. conn should be dialled with DialOptions.
func (s *Sender) Push(ctx context.Context, conn grpc.ClientConnInterface, req PushRequest) error {
	m, err := buildManifest(ctx, req.Source, req.DataName, req.Job, s.Digests)
	if err == nil {
		err = s.push(ctx, conn, req, m)
	}
	if err != nil && len(req.Presumed) > 0 && status.Code(err) == codes.NotFound {
		// The peer dropped early files it acknowledged (it restarted, or timed them out).
		req.Presumed, m.presumed = nil, nil
		err = s.push(ctx, conn, req, m)
	}
	if err != nil {
		return fmt.Errorf("push %s: %w", req.DataName, err)
	}
	return nil
}

// Drop asks the peer behind conn to discard the early files of group this sender pushed (the
// step was abandoned).
func (s *Sender) Drop(ctx context.Context, conn grpc.ClientConnInterface, id Identity, group string) error {
	opts, err := s.callOptions(id)
	if err != nil {
		return err
	}
	if _, err := peerpb.NewPeerClient(conn).Drop(ctx, &peerpb.DropRequest{Group: group}, opts...); err != nil {
		return fmt.Errorf("drop early group %q: %w", group, err)
	}
	return nil
}

// push sends one transfer of m, the manifest of req.Source.
func (s *Sender) push(ctx context.Context, conn grpc.ClientConnInterface, req PushRequest, m *manifest) error {
	opts, err := s.callOptions(Identity{Job: req.Job, Incarnation: req.Incarnation, Rank: req.Rank, Instance: s.Instance})
	if err != nil {
		return err
	}
	id := make([]byte, 16)
	rand.Read(id)
	header := &peerpb.PushHeader{TransferId: hex.EncodeToString(id), Job: req.Job, Incarnation: req.Incarnation,
		SenderRank: int32(req.Rank), SenderInstance: s.Instance, Manifest: m.pb,
		EarlyGroup: req.EarlyGroup, ConsumesGroup: req.ConsumesGroup, Generation: req.Generation}
	if req.ConsumesGroup != "" && len(req.Presumed) > 0 {
		for i, f := range m.pb.Files {
			if f.Size > 0 && req.Presumed[layout.FileDigest(f.Blake3)] {
				header.Presumed = append(header.Presumed, uint32(i))
			}
		}
		if err := m.presume(header.Presumed); err != nil {
			return err
		}
	}
	client := peerpb.NewPeerClient(conn)
	chunk := s.chunkSize()
	send := m.toSend()
	n := int(min(int64(s.streams()), max(1, (send+int64(chunk)-1)/int64(chunk))))

	key := linkKey(conn)
	compress := s.Compress != CompressOff && s.compressTo(key) // decided once per transfer
	stats := make([]streamStats, n)
	// Not the connection's meter: what a push writes sits in buffers before it crosses, and it
	// would count another transfer's bytes on the connection (connmeter.go).
	w := startWatchdog(withConnMeter(ctx, nil), s.stallTimeout())
	peer := s.meter(key)
	err = runStreams(w.ctx, n, func(ctx context.Context, i int) error {
		return pushStream(ctx, client, opts, header, req.Source, m, i, n, chunk, w.progress, compress, peer, s.announceWait(), &stats[i])
	})
	w.stop()
	var total streamStats
	for _, st := range stats {
		total.add(st)
	}
	// From when the receiver was ready (its transfer directory made) to the last stream's end.
	elapsed := total.end.Sub(total.ready)
	s.bytesSent.Add(total.orig)
	s.wireSent.Add(total.wire)
	s.codedChunks.Add(total.coded)
	if err == nil {
		waitFrac := 0.0
		if total.busy > 0 {
			waitFrac = total.sampleWait.Seconds() / total.busy.Seconds()
		}
		s.measure(key, linkSample{orig: total.sampleOrig, wire: total.sampleWire, elapsed: elapsed, waitFrac: waitFrac,
			compressed: compress && total.announced > 0})
	}
	if err != nil {
		err = w.explain(err)
		// The receiver drops the transfer when a stream fails; Abandon covers streams that
		// never reached it. Best effort, bounded, and not on the caller's (maybe cancelled) context.
		actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), min(2*time.Second, s.stallTimeout()))
		client.Abandon(actx, &peerpb.AbandonRequest{TransferId: header.TransferId}, opts...)
		cancel()
		return err
	}
	// The receiver checks every digest (and hashes what it could not as it arrived) before it answers.
	cctx, cancel := context.WithTimeout(ctx, s.stallTimeout()+time.Duration(m.total/minVerifyRate)*time.Second)
	defer cancel()
	if _, err := client.Commit(cctx, &peerpb.CommitRequest{TransferId: header.TransferId}, opts...); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	return nil
}

// streamStats is what one stream of a push counted.
type streamStats struct {
	orig, wire, coded int64
	// sampleOrig, sampleWire and sampleWait are what the link is measured by: the bytes and the
	// time waiting for the network from ready on. busy is the stream's time from ready on.
	sampleOrig, sampleWire int64
	sampleWait, busy       time.Duration
	announced              int // streams on which the receiver announced the codec
	// ready is when the receiver announced itself (set up to take the chunks), or the stream
	// opened if it did not; end when it confirmed the bytes.
	ready, end time.Time
}

func (t *streamStats) add(o streamStats) {
	t.orig += o.orig
	t.wire += o.wire
	t.coded += o.coded
	t.sampleOrig += o.sampleOrig
	t.sampleWire += o.sampleWire
	t.sampleWait += o.sampleWait
	t.busy += o.busy
	t.announced += o.announced
	if t.ready.IsZero() || o.ready.Before(t.ready) {
		t.ready = o.ready
	}
	if o.end.After(t.end) {
		t.end = o.end
	}
}

// pushStream sends the header and share i of n on one PushFiles stream, and checks that the
// receiver wrote all of it. With compress, chunks go compressed once the receiver announced the
// codec: the first waits for the announcement up to wait, unless peer is known not to make it
// (an older agent sends its header only with its reply; chunks then go as they are). It fills
// stats once the receiver confirmed the bytes.
func pushStream(ctx context.Context, client peerpb.PeerClient, opts []grpc.CallOption, header *peerpb.PushHeader,
	src string, m *manifest, i, n, chunk int, progress func(), compress bool, peer *linkMeter, wait time.Duration,
	stats *streamStats) error {
	start := time.Now()
	ctx, cancel := context.WithCancel(ctx)
	var heard sync.WaitGroup
	defer func() { cancel(); heard.Wait() }()
	stream, err := client.PushFiles(ctx, opts...)
	if err != nil {
		return err
	}
	out := chunkOut{send: func(c *outChunk) error { return stream.SendMsg(c) }, progress: progress}
	defer out.release()
	var announced, held atomic.Bool
	var readyAt atomic.Int64 // Unix nanoseconds of the announcement
	heardCh := make(chan struct{})
	heard.Go(func() {
		defer close(heardCh)
		if md, err := stream.Header(); err == nil && slices.Contains(md.Get(codecsHeader), codecPlanesName) {
			held.Store(len(md.Get(heldHeader)) > 0)
			readyAt.Store(time.Now().UnixNano())
			announced.Store(true)
			peer.setAnnounces(true)
		}
	})
	out.announced = announced.Load
	if compress {
		out.compress = announced.Load
	}
	sent, err := func() (int64, error) {
		if err := stream.Send(&peerpb.PushMessage{Kind: &peerpb.PushMessage_Header{Header: header}}); err != nil {
			return 0, err
		}
		if compress && peer.mayAnnounce() {
			t := time.NewTimer(wait)
			select {
			case <-heardCh:
			case <-t.C:
			case <-ctx.Done():
			}
			t.Stop()
		}
		return sendShare(ctx, src, m, m.share(i, n), chunk, &out)
	}()
	// io.EOF from Send means the receiver ended the stream: its status comes with the reply.
	if err != nil && !errors.Is(err, io.EOF) {
		return err
	}
	waitStart := time.Now()
	reply, rerr := stream.CloseAndRecv()
	heard.Wait()
	if rerr != nil {
		return rerr
	}
	if err != nil {
		return err
	}
	if reply.Bytes != sent {
		return fmt.Errorf("stream %d: receiver wrote %d bytes, %d were sent", i, reply.Bytes, sent)
	}
	if !announced.Load() {
		peer.setAnnounces(false) // a stream that went through without it: an older agent
	}
	end := time.Now()
	*stats = streamStats{orig: out.orig, wire: out.wire, coded: out.coded,
		sampleOrig: out.orig, sampleWire: out.wire, sampleWait: out.wait + end.Sub(waitStart),
		busy: end.Sub(start), ready: start, end: end}
	if announced.Load() {
		stats.announced = 1
		stats.ready = time.Unix(0, readyAt.Load())
		stats.busy = end.Sub(stats.ready)
		if held.Load() {
			// Only what crossed after the announcement: the receiver held the stream before
			// it while the flow-control window filled. (All of it before: nothing to measure.)
			b := out.before
			if !b.taken {
				b.orig, b.wire, b.wait = out.orig, out.wire, out.wait
			}
			stats.sampleOrig, stats.sampleWire, stats.sampleWait = out.orig-b.orig, out.wire-b.wire, stats.sampleWait-b.wait
		}
	}
	return nil
}

// Fetch copies a "<hash>.data" that the peer behind conn holds into req.Dir, over parallel
// streams, and verifies it exactly as a receiver verifies a push before it appears (renamed) as
// req.Dir/req.DataName. On failure nothing is left in req.Dir.
func (s *Sender) Fetch(ctx context.Context, conn grpc.ClientConnInterface, req FetchRequest) error {
	if err := s.fetch(ctx, conn, req); err != nil {
		return fmt.Errorf("fetch %s: %w", req.DataName, err)
	}
	return nil
}

func (s *Sender) fetch(ctx context.Context, conn grpc.ClientConnInterface, req FetchRequest) (err error) {
	if _, _, err := parseDataName(req.DataName, req.Job, false); err != nil {
		return err
	}
	opts, err := s.callOptions(Identity{Job: req.Job, Incarnation: req.Incarnation, Rank: req.Rank, Instance: s.Instance})
	if err != nil {
		return err
	}
	client := peerpb.NewPeerClient(conn)
	n, chunk := s.streams(), s.chunkSize()
	key := linkKey(conn)
	var accept []peerpb.ChunkCodec
	if s.Compress != CompressOff && s.compressTo(key) {
		accept = []peerpb.ChunkCodec{peerpb.ChunkCodec_CHUNK_CODEC_PLANES}
	}
	var orig, wire, coded atomic.Int64

	// The first manifest to arrive creates the sink; the others must equal it.
	var (
		mu    sync.Mutex
		first *peerpb.Manifest
		sk    *sink // GUARDED_BY(mu) until every stream ended
		total int64 // GUARDED_BY(mu) until every stream ended
		// started is when the first manifest arrived; GUARDED_BY(mu) until every stream ended
		started time.Time
		done    atomic.Int64
	)
	open := func(pb *peerpb.Manifest) (*sink, error) {
		mu.Lock()
		defer mu.Unlock()
		if first != nil {
			if !proto.Equal(first, pb) {
				return nil, errInvalid("streams sent different manifests")
			}
			return sk, nil
		}
		m, err := checkManifest(pb, req.Job, false)
		if err != nil {
			return nil, err
		}
		if pb.DataName != req.DataName {
			return nil, errInvalid("asked for %s, got %s", req.DataName, pb.DataName)
		}
		if req.MaxBytes > 0 && m.total > req.MaxBytes {
			return nil, errExhausted("%d bytes, at most %d allowed", m.total, req.MaxBytes)
		}
		if sk, err = newSink(req.Dir, ".fetch-", m); err == nil {
			sk.corrupt = &s.corruptChunks
		}
		if err != nil {
			return nil, err
		}
		first, total, started = pb, m.total, time.Now()
		if req.Progress != nil {
			req.Progress(0, total)
		}
		return sk, nil
	}
	defer func() {
		if sk != nil {
			if derr := sk.discard(errFinished); err == nil {
				err = derr
			}
		}
	}()

	w := startWatchdog(ctx, s.stallTimeout())
	err = runStreams(w.ctx, n, func(ctx context.Context, i int) error {
		stream, err := client.Fetch(ctx, &peerpb.FetchRequest{DataName: req.DataName, StreamIndex: uint32(i),
			StreamCount: uint32(n), ChunkSize: uint32(chunk), AcceptCodecs: accept}, opts...)
		if err != nil {
			return err
		}
		inf := getInflater()
		defer putInflater(inf)
		msg := inMessage{header: &peerpb.Manifest{}}
		if err := stream.RecvMsg(&msg); err != nil {
			return err
		}
		if !msg.isHeader {
			msg.chunk.release()
			return errInvalid("a stream must start with the manifest")
		}
		into, err := open(msg.header.(*peerpb.Manifest))
		if err != nil {
			return err
		}
		for {
			if err := stream.RecvMsg(&msg); err == io.EOF {
				return nil
			} else if err != nil {
				return err
			}
			if msg.isHeader {
				return errInvalid("a second manifest on one stream")
			}
			size, codec := int64(msg.chunk.size), msg.chunk.codec
			n, err := into.write(&msg.chunk, inf)
			msg.chunk.release()
			if err != nil {
				return err
			}
			orig.Add(n)
			wire.Add(size)
			if codec != 0 {
				coded.Add(1)
			}
			w.progress()
			if req.Progress != nil {
				mu.Lock()
				t := total
				mu.Unlock()
				req.Progress(done.Add(n), t)
			}
		}
	})
	w.stop()
	elapsed := time.Since(started) // from the first manifest: the server may have hashed the data first
	s.fetched.Add(orig.Load())
	s.wireFetched.Add(wire.Load())
	s.codedFetched.Add(coded.Load())
	if err != nil {
		return w.explain(err)
	}
	s.measure(key, linkSample{orig: orig.Load(), wire: wire.Load(), elapsed: elapsed, waitFrac: -1,
		compressed: coded.Load() > 0})
	if err := sk.verify(ctx); err != nil {
		return err
	}
	dst := filepath.Join(req.Dir, req.DataName)
	if _, err := os.Lstat(dst); err == nil {
		return fmt.Errorf("%s already exists", dst)
	}
	return layout.RenameWithAttrs(sk.root, dst)
}

// runStreams runs fn for streams 0..n-1 concurrently and returns the first error; the first
// failure cancels the others.
func runStreams(ctx context.Context, n int, fn func(ctx context.Context, i int) error) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var (
		wg    sync.WaitGroup
		once  sync.Once
		first error
	)
	for i := range n {
		wg.Go(func() {
			if err := fn(ctx, i); err != nil {
				once.Do(func() { first = err; cancel(err) })
			}
		})
	}
	wg.Wait()
	return first
}

// watchdog cancels a transfer's context when no progress was reported for a timeout.
type watchdog struct {
	ctx    context.Context
	cancel context.CancelCauseFunc
	last   atomic.Int64 // Unix nanoseconds of the last progress
	link   *connMeter   // the transfer's connection (nil: not metered)
	done   chan struct{}
	wg     sync.WaitGroup
}

func startWatchdog(parent context.Context, timeout time.Duration) *watchdog {
	w := &watchdog{done: make(chan struct{}), link: connMeterFrom(parent)}
	w.ctx, w.cancel = context.WithCancelCause(parent)
	w.progress()
	w.wg.Go(func() {
		tick := time.NewTicker(timeout / 8)
		defer tick.Stop()
		for {
			select {
			case <-w.done:
				return
			case <-w.ctx.Done():
				return
			case <-tick.C:
				last := time.Unix(0, w.last.Load())
				if moved := w.link.lastMoved(); moved.After(last) {
					last = moved // the connection moves bytes: a chunk is on its way (connmeter.go)
				}
				if idle := time.Since(last); idle >= timeout {
					w.cancel(fmt.Errorf("%w: no chunk and no bytes moved for %v", ErrStalled, idle.Round(time.Millisecond)))
					return
				}
			}
		}
	})
	return w
}

func (w *watchdog) progress() { w.last.Store(time.Now().UnixNano()) }

// stop ends the watchdog and releases its context; explain still tells a stall apart.
func (w *watchdog) stop() {
	close(w.done)
	w.wg.Wait()
	w.cancel(nil)
}

// explain returns the stall as the error when the watchdog caused err.
func (w *watchdog) explain(err error) error {
	if cause := context.Cause(w.ctx); errors.Is(cause, ErrStalled) {
		return cause
	}
	return err
}
