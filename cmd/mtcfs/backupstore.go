package main

import (
	"context"
	"fmt"
	"sort"

	"github.com/mtcfs/mtcfs/gcsbackend"
	"github.com/mtcfs/mtcfs/tiers"
)

// backupStore adapts gcsbackend.Backups (any ObjectStore: file:// or gs://) to the interface
// the replicator depends on.
type backupStore struct{ b *gcsbackend.Backups }

var _ tiers.BackupStore = backupStore{}

func openBackups(url string) (*gcsbackend.Backups, error) {
	store, err := gcsbackend.Open(url)
	if err != nil {
		return nil, fmt.Errorf("--backup %s: %w", url, err)
	}
	return &gcsbackend.Backups{Store: store}, nil
}

func (s backupStore) String() string { return s.b.Store.String() }

func (s backupStore) Backups(ctx context.Context, job string) ([]string, error) {
	return s.b.Names(ctx, job)
}

func (s backupStore) CompleteSteps(ctx context.Context, job, backup string, nodes, workers int) ([]tiers.BackupStep, error) {
	rep, err := s.b.Verify(ctx, job, backup, gcsbackend.VerifyOptions{Nodes: nodes, Workers: workers})
	if gcsbackend.IsNotFound(err) {
		return nil, fmt.Errorf("%s: %w", backup, tiers.ErrNoBackup)
	}
	if err != nil {
		return nil, err
	}
	var out []tiers.BackupStep
	for _, st := range rep.Steps {
		if !st.Complete {
			continue
		}
		data := make(map[tiers.Slot]string, len(st.Data))
		for slot, h := range st.Data {
			data[tiers.Slot{Rank: slot.Rank, Worker: slot.Worker}] = h
		}
		out = append(out, tiers.BackupStep{Step: st.Step, Data: data})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Step > out[j].Step })
	return out, nil
}

func (s backupStore) Upload(ctx context.Context, u tiers.Upload) error {
	return s.b.Upload(ctx, gcsbackend.UploadRequest{
		Job: u.Job, Backup: u.Backup, Step: u.Step, Slot: gcsbackend.Slot{Rank: u.Slot.Rank, Worker: u.Slot.Worker},
		Hash: u.Hash, Source: u.Source, Progress: u.Progress, Nodes: u.Nodes, Workers: u.Workers,
	})
}

func (s backupStore) Download(ctx context.Context, job, backup, hash, dest string, progress func(done, total int64)) error {
	return s.b.Download(ctx, gcsbackend.DownloadRequest{Job: job, Backup: backup, Hash: hash, Dest: dest, Progress: progress})
}

func (s backupStore) RestoreVersion(ctx context.Context, job string) (string, bool, error) {
	return s.b.ReadRestoreVersion(ctx, job)
}

func (s backupStore) ClearRestoreVersion(ctx context.Context, job string) error {
	return s.b.ClearRestoreVersion(ctx, job)
}

func (s backupStore) CleanLeftovers(ctx context.Context, job string) (int, error) {
	return s.b.CleanLeftovers(ctx, job)
}
