package tiers

import (
	"context"
	"fmt"
	"slices"
	"sync"
)

// RememberDamage wraps store so that data a restore of this agent found damaged, but could not
// mark so in the backup (a read-only or full location), is still passed over by the agent's
// later restore plans, as a marked one is: without it each start of the job failed on the same
// data although an older backup was intact (found by a black-box test). The memory lasts as
// long as the agent; the coordinator plans with it only when it is the agent that found the
// damage (a single node, or rank 0's own data). nil stays nil.
func RememberDamage(store BackupStore) BackupStore {
	if store == nil {
		return nil
	}
	return &damageMemo{BackupStore: store, bad: map[damageKey]string{}}
}

type damageKey struct{ job, backup, hash string }

type damageMemo struct {
	BackupStore
	mu  sync.Mutex
	bad map[damageKey]string // why, as given to MarkDamaged
}

func (d *damageMemo) MarkDamaged(ctx context.Context, job, backup, hash, why string) error {
	err := d.BackupStore.MarkDamaged(ctx, job, backup, hash, why)
	if err != nil {
		d.mu.Lock()
		d.bad[damageKey{job, backup, hash}] = why
		d.mu.Unlock()
	}
	return err
}

// CompleteSteps moves the complete steps that name data remembered damaged to the damaged ones.
func (d *damageMemo) CompleteSteps(ctx context.Context, job, backup string, shape Shape) ([]BackupStep, []DamagedStep, error) {
	complete, damaged, err := d.BackupStore.CompleteSteps(ctx, job, backup, shape)
	if err != nil {
		return complete, damaged, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if len(d.bad) == 0 {
		return complete, damaged, nil
	}
	var kept []BackupStep
	moved := false
	for _, s := range complete {
		var problems []string
		for _, h := range s.Data {
			if why, ok := d.bad[damageKey{job, backup, h}]; ok {
				problems = append(problems, fmt.Sprintf("%s.data failed its check at a restore by this agent (%s); the backup location refused the record of it", h, why))
			}
		}
		if problems == nil {
			kept = append(kept, s)
			continue
		}
		slices.Sort(problems)
		damaged = append(damaged, DamagedStep{Step: s.Step, Problems: slices.Compact(problems)})
		moved = true
	}
	if moved {
		slices.SortFunc(damaged, func(a, b DamagedStep) int { return int(b.Step - a.Step) })
	}
	return kept, damaged, nil
}
