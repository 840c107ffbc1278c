// Package crashsim is the crash-consistency test of issue 9 (SPEC §10): seeded random saves,
// commits, replications, backups and job restarts on real mtcfs agents (subprocesses, so that
// kill -9 is real) with real FUSE mounts, tmpfs spools and file:// backups, driven through the
// unmodified client protocol by internal/jobsim's Orbax client, with agents killed at chosen
// moments and the invariant checked after every recovery.
//
// Two programs run it: `make test` runs a short run (cmd/mtcfs TestCrashConsistency, Short),
// bench/crashbench the long one (≥ 200 kills, Long) whose result goes into bench/RESULTS.md.
// Both call Run; the scenarios, the kill moments and the checks exist once, here. (A package
// rather than the bench running the test binary with a flag: the bench needs the counts as
// data for its table, and Run must clean up by itself on Ctrl-C, neither of which a test
// binary's output gives.)
//
// # Decisions
//
// Every decision — the episodes (jobs of one to three nodes, peer-ranks the next rank), their
// scripts of saves, job restarts and kills, each kill's kind, victim, delay and whether the
// node is replaced (its spool dropped), each step's shape (a few small files, a few large ones,
// or hundreds to thousands of tiny ones) — is drawn by a Planner from the seed alone, before
// and independently of what the agents do. MTCFS_SEED=n (the test) or -seed n (the bench)
// replays a run's decisions; the agents' timing may still differ between replays.
//
// # Kill moments
//
// The moment of a kill is found from the agent's own state where possible: a listing of the
// step directory being written (mid-write), the client's rename returning (after-commit), a
// commit record in the spool's commits/ (mid-seal), an incoming-* transfer in the receiver's
// spool (mid-push, killing the receiver or its sender), backup temporaries named after the
// agent's pid or its /status (mid-backup), its /status during the job's restart
// (mid-restore); otherwise a drawn delay (random-delay, all-agents). After the kill the dead
// agent's spool is frozen and is read as evidence of what it was doing.
//
// # Invariant
//
// After each recovery (the killed agents restarted on their spools, or on new ones after a
// node replacement) the job restarts on every node with a new replicator.yaml, and:
//   - every node restores the same step, and its bytes are exactly those of a save of that step
//     (VerifyRestored: sequential reads, preads, mmap), the same save on every node;
//   - the step is at least the bound: the newest step whose commit returned on every rank
//     while the rank's RAM survived (or that the rank restored since), where a rank that lost
//     its RAM counts only if the step was claimed replicated (/status latest_replicated_step,
//     checked against the peers' namespaces) before and the peer kept its RAM; or the newest
//     step of a complete backup (mtcfs backups list, every rank's data read back byte by byte);
//   - never a fresh start when something is owed. A failure that replicator.errors explains is
//     recorded as a finding; one it does not is a violation;
//   - after a restore, every node reports the restored step replicated again (SPEC §10).
//
// Also checked: a new agent never stacks a mount on a stale one; `mtcfs backups verify`
// never shows a step complete whose bytes do not match; temporaries of a killed agent's
// upload are gone once a later backup started; at the end of an episode every agent stops
// cleanly, every kept spool is listed by `mtcfs spool list` with its mount path and job and is
// freed by `mtcfs spool free`, and nothing stays mounted.
package crashsim
