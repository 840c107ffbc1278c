// Package gcsbackend is mtcfs's backup tier: the durable copy of checkpoints
// outside the cluster (SPEC §6, §7).
//
// It has two layers.
//
// ObjectStore is a small object-store interface shaped after Google Cloud
// Storage (flat names with "/", CRC32C per object, create-if-absent
// preconditions, ranged reads, listing by prefix and delimiter). Open turns a
// --backup URL into a store: file:///abs/dir (localDir, localdir.go) or
// gs://bucket[/prefix] (gcsStore, gcs.go: cloud.google.com/go/storage with
// Application Default Credentials, or the emulator named by
// STORAGE_EMULATOR_HOST). Every store passes the same conformance test
// (conformance_test.go; the GCS one against an in-process fake-gcs-server, and
// against a real bucket when MTCFS_TEST_GCS_BUCKET is set). The guarantees
// every implementation gives:
//
//   - Put is atomic: readers see the old object, the complete new one, or
//     nothing — never a partial object. It checks the number of bytes it was
//     given and, when the caller supplies one, their CRC32C; on a mismatch
//     nothing becomes visible.
//   - Put with IfAbsent is a safe retry: writing the same bytes again (same
//     size and CRC32C) succeeds, different bytes fail with *PreconditionError.
//   - Missing objects are reported as *NotFoundError, use errors.As.
//   - Stat and List report each object's CRC32C without the caller reading it.
//
// Backups lays the reference system's backup layout on top of any ObjectStore:
//
//	<job>/restore.version                        optional pin: a backup name
//	<job>/<YYYY-MM-DD_HH-MM>/<job>-sS-nR-wW.meta content: <hash> (no newline)
//	<job>/<YYYY-MM-DD_HH-MM>/<hash>.data/<files…> a checkpoint directory, or
//	<job>/<YYYY-MM-DD_HH-MM>/<hash>.data          a single-file checkpoint
//	<job>/<YYYY-MM-DD_HH-MM>/<hash>.data.manifest mtcfs's sidecar (below)
//	<job>/<YYYY-MM-DD_HH-MM>/<hash>.data.long/<h> files whose names cannot be objects (below)
//	<job>/<YYYY-MM-DD_HH-MM>/<hash>.data.attrs    owners and modes of the entries (layout.Attrs)
//
// The first four are exactly what the reference system writes, so existing
// tools can read mtcfs backups. An object store cannot say whether a
// directory tree is complete, so mtcfs adds one sidecar object per data,
// <hash>.data.manifest: JSON listing every directory, every file's relative
// path, size and CRC32C, and what an object store cannot hold: symlinks
// (path and verbatim target) and FIFOs, sockets and device nodes (path,
// type, device number). Its format (manifest.go) is "mtcfs-manifest-v1" for
// a tree of plain files and directories stored under their own names, and
// "mtcfs-manifest-v2" when it holds more, which a v1 reader refuses instead
// of calling the tree complete. It is deterministic — two nodes uploading identical data to one store write
// identical manifests, so their create-if-absent uploads do not conflict. A
// backup written without manifests (by another tool) is reported
// incomplete, because its completeness cannot be proven.
//
// Compression (SPEC §6, opt-in: Backups.Compress, mtcfs mount
// --backup-compress auto). By default every data object holds a file's bytes
// as they are. With CompressAuto, Upload cuts each file into chunks of
// DefaultChunkLen (4 MiB) bytes and encodes each with planecodec (byte
// planes, huff0; a chunk that does not pay is kept raw behind its 20-byte
// header). If the whole file saves at least 1/64 its object, under its usual
// name, is the concatenation of the encoded chunks:
//
//	chunk 0 | chunk 1 | … | chunk n-1   each one planecodec chunk: 20-byte header
//	                                    ("MTPC", version, method, width, block log,
//	                                    original length, payload length, CRC32C of
//	                                    the stored bytes), then the payload
//
// chunk i holding the file's bytes [i·chunk_len, (i+1)·chunk_len). Otherwise
// the object stays plain. The manifest entry of a compressed file keeps
// "size" and "crc32c" of the file's bytes and adds "codec":"planecodec",
// "stored_size", "stored_crc32c" (the object's own, which the store reports
// and checks), "chunk_len" and "chunks" (the stored length of every chunk,
// so that a restore reads ranges of whole chunks in parallel); a manifest
// holding one is "mtcfs-manifest-v3", which older readers refuse. Upload
// encodes each file once to learn the object's size and CRC32Cs, which the
// store needs before the first byte (the GCS store takes its parts' CRC32Cs
// from the chunks'), at most one file per CPU at once; that first pass keeps
// up to 2 encoded chunks per request in flight (64 MiB at the defaults) for
// the store to send as they are (a file whose size or times changed during
// that pass is refused, not sent torn), and the chunks beyond that budget,
// those of large files, are encoded again as the store reads them and checked
// against the first pass, a few kept in cache for its small reads. Reads take ranges of 8 whole
// chunks (32 MiB of file bytes), several in parallel. Download and Verify with Deep decode every
// chunk (its header against the manifest, its CRC32C) and check the
// decoded file's size and CRC32C against the manifest; tiers then checks the
// data's BLAKE3 tree hash. Export writes a backup's complete steps in the
// plain reference layout to a local directory, for tools that read backups
// directly.
//
// Upload reads the source with layout.Dir, the walk the tree hash uses:
// paths of any length (beyond PATH_MAX once prefixed with the spool), no
// symlink followed. Download rebuilds the tree the same way under a
// temporary directory: directories, files, then symlinks and special files
// (device nodes need CAP_MKNOD), so the restored tree has the source's tree
// hash.
//
// Names (SPEC §10): a file whose object name <job>/<backup>/<hash>.data/<path>
// cannot be stored as it is — longer than 1024 bytes with the gs:// prefix,
// not UTF-8, holding a control character or a segment with the reserved
// ".mtcfs-tmp-" prefix — is stored as <hash>.data.long/<64 hex digits of
// BLAKE3-256(path)>, and its manifest entry records that object name
// ("object"); Verify, Download and `mtcfs backups verify` read it from
// there. The sibling prefix cannot collide with a path of the tree. Tools
// that do not read manifests see such files only under their mapped names.
//
// Leftovers: writes that go through temporary names (file:// temporary files,
// gs:// composite-upload parts, kept under <job>/.mtcfs-tmp-…/) name their
// writer: host (boot id and pid namespace), pid and process start time.
// CleanLeftovers removes a job's temporaries whose writer is provably gone
// (same host, pid gone or reused) at once, and those whose writer it cannot
// check once idle for LeftoverAge (default 1 h); it never removes a live
// writer's temporaries, nor any object (leftovers.go). Temporaries are
// hidden from listings and never change what Verify or List report.
//
// Ordering is what makes partial backups harmless: Upload writes the data
// objects, then the manifest, then the .meta last. A .meta therefore only
// exists once the data it names is fully present, and Verify (a step is
// complete when every rank×worker .meta is present and names data whose every
// manifest file is present with the right size and CRC32C; symlinks and
// special files are present by virtue of the manifest) never mistakes an
// interrupted upload for a checkpoint. Download verifies every byte against
// the manifest before the restored tree appears under its final name.
//
// On GCS (see gcsStore and gcs_transfer.go) every upload sends its CRC32C
// before the first byte, so the server refuses damaged bytes; every request
// is retried with backoff (408, 429, 5xx, broken connections, and attempts
// that move no byte for GCSOptions.StallTimeout) under preconditions that
// make a retry of our own write idempotent: create-if-absent uploads carry
// ifGenerationMatch=0 and accept a 412 only when the object already holds
// the same size and CRC32C, so they never overwrite anything; replacing
// uploads carry the generation they replace, so a retry recognises its own
// earlier write, but against a concurrent replacing writer the last writer
// wins (a 412 caused by another writer's version is answered by replacing
// that version). Files of at least GCSOptions.ParallelThreshold move in parts
// of GCSOptions.PartSize, several at a time (Backups.Parallelism requests in
// flight per call): uploads as parallel composite uploads (the parts'
// CRC32Cs taken in parallel and combined into the file's, then temporary
// part objects under <job>/.mtcfs-tmp-<writer>-<random>/, composed into the
// final name with its CRC32C, then deleted), downloads as ranged reads of
// one pinned generation written in place, whose CRC32Cs are combined
// (crc32cCombine) and checked against the manifest. Memory stays at one copy
// buffer per request in flight. Both are methods of ObjectStore (PutFile,
// GetFile), which Backups calls for every data file; file:// streams a file
// in one request.
//
// What the client library (cloud.google.com/go/storage v1.70.0) does here,
// and what the store does itself, decided by the fault tests
// (gcs_fault_test.go) run with the library's mechanism in place of the
// store's:
//
//   - Requests, CRC32C and preconditions go through the library; so does the
//     choice of errors worth retrying (storage.ShouldRetry) and the backoff
//     (gax.Backoff, the library's own).
//   - The retry loop is the store's: with the library's policy
//     (Retryer, WithPolicy(RetryAlways), WithMaxAttempts, WithErrorFunc)
//     a single-request upload (Writer.ChunkSize 0, which streams without a
//     buffer) is never retried, so TestGCSFaultServerErrorBursts,
//     TestGCSFaultLostAcknowledgement and TestGCSFaultCorruptUpload fail.
//     Resumable uploads (a ChunkSize buffer per request in flight) are
//     retried, but a 400 for a CRC32C damaged on the way still is not
//     (TestGCSFaultCorruptUpload), and the 412 of a retry whose first attempt
//     landed needs the store's Stat either way.
//   - Stalls are the store's watchdog's: Writer.ChunkTransferTimeout applies
//     only to the chunks of resumable uploads, not to single-request ones
//     nor to metadata calls (TestGCSFaultStallForever's upload waits the
//     stall out instead of failing, and so do TestGCSFaultStall's requests),
//     and experimental.WithReadStallTimeout is not implemented for the JSON
//     API and bounds only the wait for response headers, while the library's
//     reader reopens a body that breaks after them without limit or backoff
//     (TestGCSFaultBodyCutEveryTime and TestGCSFaultOpenBodyCutEveryTime
//     never end; TestGCSNoGoroutineLeak's read that never answers does not
//     fail).
//   - Parallel transfers are the store's: transfermanager (a preview API)
//     only downloads, inherits the reader's endless reconnects
//     (TestGCSFaultBodyCutEveryTime, ranged), has no stall detection (its
//     WithPerOpTimeout cancels every download in v1.70.0) and reports no
//     bytes, only finished objects; the library's parallel composite upload
//     (Writer.ParallelUploadConfig) is experimental and gRPC-only.
package gcsbackend
