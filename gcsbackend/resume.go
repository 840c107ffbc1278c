package gcsbackend

import (
	"context"
	"fmt"
	"strings"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/tiers"
)

// Resumable reports whether backup is an upload of step that was cut short (a crash, a stop past
// the drain time) and that completing it with data (the step's hashes, every slot's) leaves
// nothing else in it, and if not, why. It must hold no complete or damaged step and no .meta of
// another step or naming other data; every data object, manifest and attrs in it must belong to
// one of data; the shape it recorded, if any, must be shape. Temporaries and the shape record do
// not count. A job restarted with that step then completes the backup under its name, rather than
// leaving it incomplete beside a new one (SPEC §10).
//
// Cost: one recursive listing more than Verify's.
func (b *Backups) Resumable(ctx context.Context, job, backup string, step int64, data []string, shape tiers.Shape) (bool, string, error) {
	if err := validateJob(job); err != nil {
		return false, "", err
	}
	if err := validateBackupName(backup); err != nil {
		return false, "", err
	}
	allowed := make(map[string]bool, len(data))
	for _, h := range data {
		allowed[h] = true
	}
	dir := backupDir(job, backup)
	objs, _, err := b.Store.List(ctx, dir, "")
	if err != nil {
		return false, "", fmt.Errorf("list %s: %w", dir, err)
	}
	for _, o := range objs {
		rel := strings.TrimPrefix(o.Name, dir)
		if rel == shapeName || rel == dpName || strings.Contains("/"+rel, "/"+tempPrefix) {
			continue
		}
		if m, ok := layout.ParseMarkerName(rel); ok && m.Kind == layout.MarkerMeta && m.Job == job {
			if m.Step != step {
				return false, fmt.Sprintf("it holds a .meta of step %d", m.Step), nil
			}
			continue // what it names is checked below
		}
		hash, rest, ok := strings.Cut(rel, ".data")
		if !ok || validateHash(hash) != nil || rest == ".damaged" {
			return false, fmt.Sprintf("it holds %s", rel), nil
		}
		if !allowed[hash] {
			return false, fmt.Sprintf("it holds data of another step (%s)", dataName(hash)), nil
		}
	}
	rep, err := b.Verify(ctx, job, backup, VerifyOptions{Nodes: shape.Nodes, Workers: shape.Workers})
	if IsNotFound(err) {
		return false, "it is empty", nil
	}
	if err != nil {
		return false, "", err
	}
	if rep.SavedRecorded && !sameShape(backupShape{Shape: rep.Saved}, shape) {
		return false, fmt.Sprintf("it was taken by a job of %s", rep.Saved), nil
	}
	for _, s := range rep.Steps {
		switch {
		case s.Complete:
			return false, fmt.Sprintf("step %d in it is complete", s.Step), nil
		case s.Damaged:
			return false, fmt.Sprintf("step %d in it is damaged", s.Step), nil
		}
		for slot, h := range s.Data {
			if slot.Rank >= shape.Nodes || slot.Worker >= shape.Workers || !allowed[h] {
				return false, fmt.Sprintf("its .meta of %s names other data", slot), nil
			}
		}
	}
	return true, "", nil
}
