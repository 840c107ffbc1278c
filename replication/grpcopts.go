package replication

import (
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/experimental"
	"google.golang.org/grpc/keepalive"
)

// Transport settings of the peer service, shared by both ends so that they agree.
const (
	// maxMessage is the largest message either end takes: a chunk plus room for the fields
	// around it, or a PushHeader with its manifest.
	maxMessage = MaxChunkSize + messageOverhead
	// streamWindow is the HTTP/2 flow-control window of one stream: how many bytes a sender may
	// have in flight on a stream before the receiving program has taken them. One default chunk:
	// a receiver holds at most the chunk it is writing plus this much per stream. Fixing it also
	// turns off gRPC's BDP probing, which on a fast link grows windows to 16 MiB per stream.
	streamWindow = DefaultChunkSize
	// connWindow is the window of a whole connection, shared by its streams.
	connWindow = 4 * streamWindow
	// ioBuffer is the size of gRPC's socket read and write buffers. Measured with
	// bench/peerbench: 256 KiB pushes ~10% faster than 1 MiB (the buffer stays in the L2
	// cache between the copy into it and the write), and no slower than 64 KiB.
	ioBuffer = 256 << 10
	// Keepalive: a connection that answers no ping for keepaliveTime+keepaliveTimeout is closed,
	// which fails its calls, so a peer that vanished (power loss, partition) is noticed even
	// while a call waits for its answer.
	keepaliveTime    = 15 * time.Second
	keepaliveTimeout = 10 * time.Second
	// redialMax caps the wait between two tries to connect to a peer that refused or did not
	// answer. gRPC's default grows to 120 s: ranks that waited minutes for rank 0's agent to
	// come back reached it 40 to 125 s after it did, and their jobs gave up at their 300 s (a
	// black-box run). A try to a dead address costs one SYN.
	redialMax = 5 * time.Second
)

// ServerOptions are the options of a gRPC server that serves the peer service: message size
// limits, flow-control windows, keepalive and the codec of chunk messages (peerCodec, which
// serves other services' messages as gRPC's own proto codec does). Transport credentials are the caller's:
// none (plain TCP) or the server side of TLSConfigs.TransportCredentials (mutual TLS).
func ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.MaxRecvMsgSize(maxMessage),
		grpc.MaxSendMsgSize(maxMessage),
		grpc.InitialWindowSize(streamWindow),
		grpc.InitialConnWindowSize(connWindow),
		grpc.ReadBufferSize(ioBuffer),
		grpc.WriteBufferSize(ioBuffer),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: keepaliveTime, Timeout: keepaliveTimeout}),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: keepaliveTime / 2, PermitWithoutStream: true}),
		// Stop returns only after every handler did: a transfer's files are gone by then.
		grpc.WaitForHandlers(true),
		// Chunks are encoded and decoded without copies; other messages as usual.
		grpc.ForceServerCodecV2(peerCodec{}),
		// The buffers HTTP/2 DATA frames are read into come from chunkBuffers, which does not
		// clear them: the frame is read over the whole buffer. gRPC's own pool clears every
		// buffer it hands out, a pass over every received byte (5 % of a push's CPU).
		experimental.BufferPool(chunkBuffers),
	}
}

// redialBackoff is gRPC's default backoff (1 s, ×1.6, ±20 %) capped at redialMax.
var redialBackoff = backoff.Config{BaseDelay: time.Second, Multiplier: 1.6, Jitter: 0.2, MaxDelay: redialMax}

// DialOptions are the options of a client connection to a peer, matching ServerOptions. The
// caller adds transport credentials: insecure.NewCredentials() for plain TCP, or the client side
// of TLSConfigs.TransportCredentials for mutual TLS.
func DialOptions() []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxMessage), grpc.MaxCallSendMsgSize(maxMessage)),
		grpc.WithInitialWindowSize(streamWindow),
		grpc.WithInitialConnWindowSize(connWindow),
		grpc.WithReadBufferSize(ioBuffer),
		grpc.WithWriteBufferSize(ioBuffer),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: keepaliveTime, Timeout: keepaliveTimeout, PermitWithoutStream: true}),
		grpc.WithConnectParams(grpc.ConnectParams{Backoff: redialBackoff, MinConnectTimeout: 20 * time.Second}),
		experimental.WithBufferPool(chunkBuffers), // see ServerOptions
	}
}
