package tiers

import (
	"fmt"
	"slices"

	"github.com/mtcfs/mtcfs/layout"
)

// CutStaleTimelines numbers a restore of the job (the generation after the newest any node took
// part in or knew of, Timeline.Floor) and takes out of invs what nodes that missed restores hold above the step restored at
// the first of those: the job continued from that step and saved the steps above it again, so
// theirs are of a timeline the job left. Before, such a node (its agent away, its spool kept,
// while a replacement took its rank and the job restored) came back with its own save of a step
// the others had saved again, and the plan combined the two into one checkpoint (found by a
// black-box run). A restore these nodes' records do not tell the step of counts as none: all
// they hold of the job is passed over. Nodes whose timeline is unknown are left alone.
//
// It returns invs with those .meta entries removed (the slice and the changed maps are copies),
// the generation, the step above which each such node drops what it holds, and a line for the
// job when anything was taken out.
func CutStaleTimelines(cfg *Config, invs []Inventory) (out []Inventory, gen int64, above map[int]int64, lines []string) {
	restored := map[int64]int64{}
	floor := int64(0) // numbers are never given again, also by nodes that forgot theirs
	for _, inv := range invs {
		gen = max(gen, inv.Timeline.Generation)
		floor = max(floor, inv.Timeline.Floor)
		for g, step := range inv.Timeline.Restores {
			if s, ok := restored[g]; !ok || step < s {
				restored[g] = step
			}
		}
	}
	out = invs
	for i, inv := range invs {
		g := inv.Timeline.Generation
		if g == 0 || g >= gen {
			continue
		}
		bound := int64(-1)
		if gen-g <= maxTimelineRestores {
			bound = int64(1<<63 - 1)
			for missed := g + 1; missed <= gen; missed++ {
				step, ok := restored[missed]
				if !ok {
					step = -1
				}
				bound = min(bound, step)
			}
		}
		if above == nil {
			above = map[int]int64{}
		}
		above[inv.Rank] = bound
		var steps []int64
		kept := make(map[string]string, len(inv.Metas))
		for name, hash := range inv.Metas {
			if m, ok := layout.ParseMarkerName(name); ok && m.Kind == layout.MarkerMeta && m.Job == cfg.JobName && m.Step > bound {
				if !slices.Contains(steps, m.Step) {
					steps = append(steps, m.Step)
				}
				continue
			}
			kept[name] = hash
		}
		if len(steps) == 0 {
			continue
		}
		if len(out) > 0 && &out[0] == &invs[0] {
			out = slices.Clone(invs)
		}
		out[i].Metas = kept
		slices.Sort(steps)
		since := "started from scratch"
		if bound >= 0 {
			since = fmt.Sprintf("restored step %d", bound)
		}
		lines = append(lines, fmt.Sprintf("the RAM of rank %d holds step(s) %s of a timeline the job left: its agent took no part when the job %s and went on from there (it was away, or not a node of the job then); they are not restored, and are dropped", inv.Rank, JoinSteps(steps), since))
	}
	return out, max(gen, floor) + 1, above, lines
}
