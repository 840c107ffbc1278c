// Package tiers is the node agent's checkpoint brain, between the mount (package fs) and the
// other tiers: peers' RAM (package replication) and backups (package gcsbackend). It answers
// the job's replicator.yaml, records and seals the checkpoints the job commits, replicates them
// to peers, negotiates restores, backs up on the coordinator's orders and frees RAM the job no
// longer needs; it also keeps the RAM tier itself (Spool) and reads the job's configuration
// (Config). It imports neither go-fuse nor gRPC: it sees the mount through Namespace and Events,
// and the other tiers through PeerTransport, EarlyTransport, Coordinator and BackupStore, which
// cmd wires.
//
// Start reading at Replicator (replicator.go): its doc comment names each stage and its file,
// the goroutines and the lock order.
package tiers
