package tiers

import (
	"context"
)

// Incarnation is one start of the training job: one replicator.yaml.
type Incarnation struct {
	ID     string // unique per start, random
	Config *Config
	// Superseded are the ids of the agent's earlier incarnations, the newest last (a few): it
	// gave them up for this one, and a call of theirs that reaches the coordinator late (held
	// by a stalled link, or retried as the job restarted) must neither join nor replace it.
	Superseded []string
}

// SyncReport is what a node tells the coordinator after it committed (and replicated) a step.
type SyncReport struct {
	Step int64
	// Replicated is true when every peer of this node acknowledged a verified replica of the
	// step (or the node has no peers). Only acknowledged replicas count (SPEC §4).
	Replicated bool
	// Data names the node's data of the step, by worker (comma-separated hashes; "": not
	// said). A second report of the same step naming other data is the step saved again.
	Data string
}

// SyncDecision is the coordinator's answer to a sync.
type SyncDecision struct {
	// Replicated is true when every node reported the step replicated: it survives the loss of
	// any one node.
	Replicated bool
}

// BackupReport is what a node tells the coordinator about the backup it was ordered to take.
type BackupReport struct {
	Done   string // the backup whose part of this node is complete (its .meta uploaded)
	Failed string // the backup this node could not upload its part of
	Err    string // why Failed failed
	// Hashes, with Done: the data the node's .meta files in the backup name, by worker. In
	// data-parallel mode the coordinator gives them to the node's column-mates (BackupOrder.Data).
	Hashes []string
}

// BackupOrder tells a node to upload its part of Step to Backup ("" : no order).
type BackupOrder struct {
	Backup string
	Step   int64
	// Data, when set (data-parallel mode, a node outside the last partition, SPEC §6): the data,
	// by worker, its column's last-partition node uploaded to Backup. The node uploads only its
	// .meta files, naming that data, instead of its own data.
	Data []string
	// Tell, when set (and Backup is not), is a line for the job of this node: the coordinator
	// found something wrong with the job's backups that no node's error shows (a rank that never
	// asks for orders). Only the coordinator's own node gets it.
	Tell string
}

// Coordinator runs the job-wide decisions (SPEC §4–6). The rank-0 agent coordinates, for a job
// of one node as for a job of many; every node talks to it through this interface (package
// replication implements it in process and over gRPC).
type Coordinator interface {
	// Negotiate sends this node's inventory and returns the plan once every node reported.
	Negotiate(ctx context.Context, inc Incarnation, inv Inventory) (RestorePlan, error)
	// Restored says this node holds what the plan needs; it returns once every node does
	// (the barrier before .restore markers).
	Restored(ctx context.Context, inc Incarnation) error
	// Sync reports a committed step and returns the job's decision for it.
	Sync(ctx context.Context, inc Incarnation, rep SyncReport) (SyncDecision, error)
	// Backups reports the outcome of this node's last backup order (the zero report: none) and
	// waits until there is a backup this node must take, or ctx ends (then it returns the zero
	// order and no error). Backups are due on the coordinator's clock, not only at syncs
	// (SPEC §10): a node keeps one call waiting for the life of an incarnation.
	Backups(ctx context.Context, inc Incarnation, rep BackupReport) (BackupOrder, error)
}
