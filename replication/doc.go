// Package replication moves checkpoint data between the agents of one job (SPEC §4): the Peer
// gRPC service (proto in peerpb/), its server side Receiver, and its client side Sender, which
// pushes a committed "<hash>.data" or ".meta" to a peer and fetches a "<hash>.data" from one for a
// restore. It also holds the job coordinator: the rank-0 state machine (coordinator.go) and its
// gRPC transport (coordinator_service.go: the Coordinator service rank 0 serves, and
// RemoteCoordinator, the tiers.Coordinator other ranks use); the transfer code depends on neither.
// Node (node.go) puts them together as an agent's end of the cluster: the server other agents
// call, and the replicator's peer transport and coordinator; it finds the other agents through a
// Discovery — StaticPeers, or the Registry of agents in the backup location (registry.go, which
// also keeps each job's secret) — and can be driven without the CLI (node_test.go).
//
// # Guarantees
//
//   - Nothing unverified becomes visible. A push is assembled in a private directory under the
//     receiver's incoming directory. Every chunk's CRC-32C is checked on arrival, and its bytes
//     are hashed then, into their file's BLAKE3 (layout.ArrivalHash: from the buffers they
//     arrived in, before they are written; bytes that no single chunk held whole are read back
//     once the file is complete). At Commit every file's size and BLAKE3 digest, and the tree on
//     disk hashed with layout.TreeHash, must match the name it was sent under; a file changed
//     on disk after its last chunk (its mtime moved) is read and hashed again. Only then is Accept called, and only Accept's success makes
//     Commit succeed: that success is the acknowledgement that a replica exists. A transfer that
//     fails any check, loses a stream, is abandoned or stays idle is discarded with its directory.
//     Fetch verifies the same way before the data is renamed into place.
//   - Names from peers are validated before anything is written: data names must match
//     ^D?[0-9a-f]{64}\.data$, .meta names must parse (layout.ParseMarkerName) and name the
//     caller's job; paths are relative without empty, "." or ".." elements, elements of at most
//     NAME_MAX bytes, paths of at most maxPathLen (8 × PATH_MAX: longer than PATH_MAX is legal,
//     see below); no path is listed twice or below a non-directory; symlink targets are
//     non-empty; special entries have a known type. Symlink targets are otherwise kept verbatim
//     (absolute, dangling or leading out of the tree, as the job made them).
//   - Nothing is ever written outside the transfer's directory. Every entry is created and every
//     file opened relative to a descriptor of its parent directory, itself opened from its own
//     parent without following a symlink (layout.Dir: openat2 RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS,
//     or O_NOFOLLOW element by element): a symlink inside a tree is never followed, whatever its
//     target, and paths longer than PATH_MAX once prefixed with where the tree lives work. The
//     sender reads its tree the same way.
//   - Trees carry every entry type layout.TreeHash covers: regular files, directories, symlinks,
//     FIFOs, sockets and device nodes (type and device number; no content). A receiver or
//     fetcher that cannot create a device node (mknod needs CAP_MKNOD outside a user namespace)
//     refuses the whole transfer with FailedPrecondition before any byte moves, rather than
//     accept a tree it cannot hold.
//   - Every call is authenticated with an HMAC-SHA256 over the caller's job, incarnation, rank,
//     instance, the time and the method, keyed by the job's shared secret (see Authenticate);
//     refusals are Unauthenticated and logged with the peer's address. A Node's server checks it
//     from the headers, before the message is read (admitCall), with the secrets it holds;
//     a call of a job it has not joined is refused as Unavailable. Refusals there are logged up
//     to refusalBurst a minute, the others counted.
//   - With mutual TLS (LoadTLS; mtcfs mount --peer-tls-cert/--peer-tls-key/--peer-tls-ca),
//     connections are TLS 1.3, both ends present a certificate of the job's CA and verify the
//     other's against it (server names are not checked, see tls.go), and refused handshakes are
//     logged with the peer's address; the MAC stays on. Without it, calls travel in clear text
//     and message bodies are not covered by the MAC: a man in the middle can read checkpoint
//     bytes or make a transfer fail, though not make a receiver accept data under a name it does
//     not hash to.
//   - Memory is bounded per stream: the receiver writes each chunk (pwritev, from the buffers
//     it arrived in) before it reads the next, and HTTP/2 flow control lets a sender have at
//     most one default chunk (4 MiB) more in flight per stream. Messages are limited to MaxChunkSize plus 8 MiB, and the
//     declared size of all transfers in progress to ReceiverConfig.MaxIncoming (and whatever
//     ReceiverConfig.Reserve allows): a header past it is refused with ResourceExhausted.
//   - A transfer that stops moving (a peer that hangs, a black-holed link) fails after
//     Sender.StallTimeout with ErrStalled; a reset connection fails at once. Progress is a
//     chunk; a fetch on a Node's connection also counts bytes arriving (connmeter.go), so that
//     a link slower than a chunk per stall timeout does not fail a restore. A push on such a
//     link still stalls (its written bytes sit in buffers), and is tried again later.
//   - A receiver may hold a push stream of 1 MiB or more before it reads a chunk
//     (ReceiverConfig.Yield: the agent's job is saving on a busy node), for less than the
//     idle and stall timeouts; it announces its codecs only after that, saying it held the
//     stream (header mtcfs-held), so the sender measures its link neither by the wait nor by
//     the chunks that filled the flow-control window meanwhile.
//
// # Early files
//
// A file the job closes while its step is still being written is pushed at once, as single-file
// data whose header names its step directory (PushHeader.early_group); the receiver verifies it
// and keeps it aside, unpublished. The push of the sealed step names the group
// (consumes_group) and lists the files the peer acknowledged (presumed): the receiver hard-links
// them into the transfer instead of receiving them, and the transfer is verified whole as any
// other. Groups are released when consumed, dropped by the sender (Drop) when the job abandons
// the directory, dropped when a push shows the sender's incarnation changed, after 10 idle
// minutes (checked every 2.5), and on Close. See early.go.
//
// # Wire format
//
// A push of one data name is one transfer: a sender-chosen id, one or more PushFiles streams that
// each start with the same PushHeader (identity + Manifest: files with sizes and digests,
// directories, symlinks with targets, special entries with type and device number), then
// Chunks {file index, offset, bytes, CRC-32C, codec}. The bytes of all files, concatenated in manifest order, are cut into as many
// contiguous shares as there are streams, so one large file is spread over all of them and each
// stream reads sequentially. When all streams ended, Commit verifies and accepts. Fetch streams
// carry the Manifest and then the chunks of the share the fetcher asked for. Chunk messages
// are encoded and decoded by peerCodec (codec.go) in that same protobuf format, without the
// copies gRPC's proto codec makes: gRPC copies the sender's pread buffer straight into its
// socket buffer, and the receiver writes from gRPC's receive buffers with pwritev.
//
// # Compression
//
// A chunk may travel compressed: Chunk.codec = CHUNK_CODEC_PLANES says its data is one
// planecodec chunk (byte planes of the floats, entropy coded; package planecodec has the format)
// that decodes to the piece's original bytes at Chunk.offset. Chunk.crc32c is the CRC-32C of
// the bytes on the wire, compressed or not; the planecodec chunk carries its own CRC-32C of its
// stored bytes, checked again before decoding, and its declared length must fit the file before
// anything is decoded. At Commit (or at the end of a fetch) every file's BLAKE3 of the original
// bytes and the tree hash are checked as for any transfer. PushReply.bytes counts original
// bytes. A chunk whose coding would not pay goes as it is (codec 0), so the receiver neither
// copies nor decodes it. The receiver gathers a compressed chunk out of gRPC's buffers into one
// buffer and decodes it into another, both per stream, at most a chunk each, and pooled.
//
// Negotiation, so that agents older than the codec keep working in both directions: a
// receiver announces the codecs it decodes in the response header "mtcfs-chunk-codecs"
// ("planes"), which it sends as soon as a PushFiles stream joined its transfer; a sender
// compresses only on streams where it arrived, and waits for it (up to a second, or a quarter of
// the stall timeout) before its first chunk, unless that peer's last stream went through
// without one. An older receiver sends its headers only with its reply, so it only ever gets
// chunks as they are. A fetcher lists the codecs it takes in FetchRequest.accept_codecs; the
// server compresses only then (and not with Compression off), and an older server ignores the
// field.
//
// When (Compression, mtcfs mount --peer-compress): off never compresses; on compresses every
// chunk where planecodec's sample says it pays; auto, the default, per peer: each transfer of at
// least 4 MiB measures the link (wire bytes ÷ time from the receiver being ready to the last
// stream's end; for a fetch, from the first manifest), and the decision is revised against one
// core's compression speed c, measured once on this machine (Sender.CodecRate overrides it).
// Uncompressed, compression turns on when r·L < 0.7·c (L the link's rate, r the ratio of the
// earlier compressed transfers to that peer, 1.3 before there were any): the link is slower
// than the codec even carrying compressed bytes. Compressed, it turns off when the original
// bytes moved faster than 0.9·c, or the sender waited for the network less than a tenth of its
// time (the codec was the bottleneck). Loopback and fast NICs stay uncompressed; a 1 GbE link
// is compressed. A transfer follows the decision in force when it starts, for all its chunks,
// so the first transfer to a peer goes uncompressed and measures the link. A fetch asks for
// compression when the decision for that peer, learnt from pushes to it and earlier fetches,
// says so. Sender.PeerLinks and Node.PeerStats report the measurements, decisions and bytes.
//
// The generated code in peerpb is committed; after editing peerpb/peer.proto or
// peerpb/coordinator.proto, run `make proto` from the module root. It needs protoc (apt-get
// install protobuf-compiler: 3.21.12 on Debian 12) and the plugins at the versions named at the
// top of the generated files (go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
// google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.6.2), and formats the result with goimports.
//
// Field 6 of Manifest (specials) was added after the first release: an older receiver ignores
// it, and then refuses a tree holding specials as not hashing to its name (DataLoss); trees
// without specials travel as before in both directions.
package replication
