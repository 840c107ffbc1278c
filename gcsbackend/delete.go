package gcsbackend

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
)

// RecentWrite is how recent a write in a backup makes DeleteIncomplete refuse it: an upload may
// still be running into it.
const RecentWrite = 10 * time.Minute

// ErrNotIncomplete refuses to delete a backup that holds a complete or damaged step: mtcfs never
// deletes checkpoints (SPEC §6, the user owns retention).
var ErrNotIncomplete = errors.New("it holds a complete (or damaged) step: mtcfs deletes only incomplete backups")

// DeleteIncomplete removes an incomplete backup of job, one that holds no complete and no
// damaged step (an upload cut short that no agent completed), object by object, and returns how
// many objects it removed. It refuses a backup holding a complete or damaged step
// (ErrNotIncomplete), the backup restore.version pins, and, unless force, a backup written to in
// the last RecentWrite (an upload may still be running into it).
func (b *Backups) DeleteIncomplete(ctx context.Context, job, backup string, force bool) (int, error) {
	if err := validateJob(job); err != nil {
		return 0, err
	}
	if err := validateBackupName(backup); err != nil {
		return 0, err
	}
	rep, err := b.Verify(ctx, job, backup, VerifyOptions{})
	if err != nil {
		return 0, err
	}
	for _, s := range rep.Steps {
		if s.Complete || s.Damaged {
			return 0, fmt.Errorf("backup %s: %w", backup, ErrNotIncomplete)
		}
	}
	if pin, ok, err := b.ReadRestoreVersion(ctx, job); err != nil {
		return 0, err
	} else if ok && pin == backup {
		return 0, fmt.Errorf("backup %s is pinned by restore.version: clear the pin first (mtcfs restore-version clear)", backup)
	}
	dir := backupDir(job, backup)
	objs, _, err := b.Store.List(ctx, dir, "")
	if err != nil {
		return 0, fmt.Errorf("list %s: %w", dir, err)
	}
	now := time.Now()
	if b.now != nil {
		now = b.now()
	}
	if last := newestWrite(objs); !force && now.Sub(last) < RecentWrite {
		return 0, fmt.Errorf("backup %s was written to %v ago: an upload may still be running into it; stop the job's agents or wait, or give --force",
			backup, now.Sub(last).Round(time.Second))
	}
	// The .meta files go first: a delete cut short (kill -9) then leaves data without .meta, an
	// incomplete backup that the next delete removes, never a .meta naming missing data, which
	// reads as damage and would be refused.
	var metas, rest []string
	for _, o := range objs {
		if strings.HasSuffix(o.Name, ".meta") {
			metas = append(metas, o.Name)
		} else {
			rest = append(rest, o.Name)
		}
	}
	del := func(names []string) error {
		return forEach(ctx, b.parallelism(), len(names), func(ctx context.Context, i int) error {
			if err := b.Store.Delete(ctx, names[i]); err != nil && !IsNotFound(err) {
				return err
			}
			return nil
		})
	}
	if err := del(metas); err != nil {
		return 0, err
	}
	if err := del(rest); err != nil {
		return len(metas), err
	}
	return len(objs), nil
}

// newestWrite returns the latest Updated of objs (the zero time: none).
func newestWrite(objs []ObjectAttrs) time.Time {
	var last time.Time
	for _, o := range objs {
		if o.Updated.After(last) {
			last = o.Updated
		}
	}
	return last
}

// LastWrite returns when an object of job's backup was last written (the zero time: it holds
// none): for `backups list` to tell an upload that may still run from one cut short.
func (b *Backups) LastWrite(ctx context.Context, job, backup string) (time.Time, error) {
	if err := validateJob(job); err != nil {
		return time.Time{}, err
	}
	objs, _, err := b.Store.List(ctx, backupDir(job, backup), "")
	if err != nil {
		return time.Time{}, err
	}
	return newestWrite(objs), nil
}
