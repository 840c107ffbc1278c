// Package jobsim replays, operation by operation, what unmodified training clients do against
// CHECKPOINT_DIR (SPEC §9): Orbax/MaxText's ReplicatorCheckpointManager ([Orbax]) and NeMo's
// InClusterLocalCheckpointIO ([NeMo]). Integration tests and the demo drive a real mtcfs mount
// with them; they talk to the agent only through files in the directory, exactly as the real
// clients do.
//
// Guarantees:
//   - Faithful: every wait polls (once a second by default, like the real clients) and gives up
//     after the client's timeout (300 s by default); file names, YAML layout, write patterns
//     (O_EXCL temp files, pwrite, fsync, renames) and the strict marker-name check follow the
//     real clients. Where a real client would silently load a wrong checkpoint, jobsim fails
//     instead with an error naming what was wrong (documented on each method).
//   - Deterministic: checkpoint bytes are a pure function of (job, writer rank, step, path)
//     ([Content]), so a restore is verified byte by byte without keeping a copy.
//   - Honest errors: a wait that ends reports what it waited for ([ErrTimeout] or the context's
//     error); a line in replicator.failed ends the client with a [*FatalError]; a wrong byte is a
//     [*MismatchError] naming the file, the offset and the kind of read that saw it.
//
// jobsim deliberately shares no code with the agent (package tiers): names and regexes are
// spelled out again here, as the clients spell them, so a mistake on either side shows up as a
// test failure instead of agreeing with itself.
//
// A client value is used by one goroutine at a time. Each node of a simulated job gets its own
// client value and directory.
package jobsim
