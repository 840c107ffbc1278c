// Package layout is the checkpoint layout of mtcfs, in one place: the names of CHECKPOINT_DIR
// (SPEC §1: control files, step directories, <hash>.data, .meta/.restore/.save markers), the
// tree of a committed checkpoint (its entries, how it is walked, and the content hash that names
// it), so that sealing (tiers), replication and backups (gcsbackend) agree on what a
// checkpoint holds. It depends on nothing else in mtcfs.
package layout
