package gcsbackend

import (
	"context"
	"errors"
	"fmt"
	"sort"

	"github.com/mtcfs/mtcfs/planecodec"
	"github.com/mtcfs/mtcfs/tiers"
)

// TierStore returns b as the backup tier the replicator depends on (tiers.BackupStore), for any
// ObjectStore: file:// or gs://. Package tiers knows nothing of this package; the agent wires the
// two together.
func TierStore(b *Backups) tiers.BackupStore { return tierStore{b} }

type tierStore struct{ b *Backups }

func (s tierStore) String() string { return s.b.Store.String() }

func (s tierStore) Backups(ctx context.Context, job string) ([]string, error) {
	return s.b.Names(ctx, job)
}

func (s tierStore) CompleteSteps(ctx context.Context, job, backup string, shape tiers.Shape) ([]tiers.BackupStep, []tiers.DamagedStep, error) {
	rep, err := s.b.Verify(ctx, job, backup, VerifyOptions{Nodes: shape.Nodes, Workers: shape.Workers})
	if IsNotFound(err) {
		return nil, nil, fmt.Errorf("%s: %w", backup, tiers.ErrNoBackup)
	}
	if err != nil {
		return nil, nil, err
	}
	if !shape.Restores(rep.Saved, rep.SavedRecorded) {
		return nil, nil, &tiers.ShapeError{Backup: backup, Saved: rep.Saved, Recorded: rep.SavedRecorded, Job: shape}
	}
	// A data-parallel job restores a backup of its partitions taken by another number of nodes:
	// the backup is complete as its job's shape says, and each rank takes its column's data
	// (rank r of a job of P partitions is in column r mod P, as is the backup's rank r mod P).
	// Before, the backup counted as incomplete for the ranks it never had.
	columns := 0
	if shape.DataParallelism > 0 && rep.SavedRecorded && rep.Saved.Nodes != shape.Nodes {
		columns = shape.Nodes / shape.DataParallelism
		if rep, err = s.b.Verify(ctx, job, backup, VerifyOptions{Nodes: rep.Saved.Nodes, Workers: shape.Workers}); err != nil {
			return nil, nil, err
		}
	}
	var out []tiers.BackupStep
	var damaged []tiers.DamagedStep
	for _, st := range rep.Steps { // highest first
		if st.Damaged {
			damaged = append(damaged, tiers.DamagedStep{Step: st.Step, Problems: st.Problems})
		}
		if !st.Complete {
			continue
		}
		data := make(map[tiers.Slot]string, len(st.Data))
		for slot, h := range st.Data {
			data[tiers.Slot{Rank: slot.Rank, Worker: slot.Worker}] = h
		}
		if columns > 0 {
			byColumn := data
			data = make(map[tiers.Slot]string, shape.Nodes*shape.Workers)
			for r := range shape.Nodes {
				for w := range shape.Workers {
					data[tiers.Slot{Rank: r, Worker: w}] = byColumn[tiers.Slot{Rank: r % columns, Worker: w}]
				}
			}
		}
		out = append(out, tiers.BackupStep{Step: st.Step, Data: data})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Step > out[j].Step })
	return out, damaged, nil
}

func (s tierStore) Upload(ctx context.Context, u tiers.Upload) error {
	return s.b.Upload(ctx, UploadRequest{
		Job: u.Job, Backup: u.Backup, Step: u.Step, Slot: Slot{Rank: u.Slot.Rank, Worker: u.Slot.Worker},
		Hash: u.Hash, Source: u.Source, Progress: u.Progress, Shape: u.Shape,
	})
}

func (s tierStore) Download(ctx context.Context, job, backup, hash, dest string, progress func(done, total int64)) error {
	err := s.b.Download(ctx, DownloadRequest{Job: job, Backup: backup, Hash: hash, Dest: dest, Progress: progress, Attrs: true})
	if ce := (*ChecksumError)(nil); errors.As(err, &ce) || errors.Is(err, planecodec.ErrCorrupt) {
		return fmt.Errorf("%w: %w", tiers.ErrCorruptBackup, err)
	}
	return err
}

func (s tierStore) MarkDamaged(ctx context.Context, job, backup, hash, why string) error {
	return s.b.MarkDamaged(ctx, job, backup, hash, why)
}

func (s tierStore) RestoreVersion(ctx context.Context, job string) (string, bool, error) {
	return s.b.ReadRestoreVersion(ctx, job)
}

func (s tierStore) ClearRestoreVersion(ctx context.Context, job string) error {
	return s.b.ClearRestoreVersion(ctx, job)
}

func (s tierStore) Resumable(ctx context.Context, job, backup string, step int64, data []string, shape tiers.Shape) (bool, string, error) {
	return s.b.Resumable(ctx, job, backup, step, data, shape)
}

func (s tierStore) CleanLeftovers(ctx context.Context, job string) (int, error) {
	return s.b.CleanLeftovers(ctx, job)
}

func (s tierStore) DeleteIncomplete(ctx context.Context, job, backup string) (int, error) {
	n, err := s.b.DeleteIncomplete(ctx, job, backup, true)
	if IsNotFound(err) {
		return 0, nil // nothing was written to it: nothing to remove
	}
	return n, err
}
