package tiers

import (
	"fmt"
	"strings"

	"github.com/mtcfs/mtcfs/layout"
)

// Shape is how a job lays out a checkpoint: one slot of data per node and worker, and with
// data-parallel mode on (SPEC §4) DataParallelism replicas of each of Nodes/DataParallelism
// partitions. A checkpoint can only be restored by a job whose slots hold the same data: the
// same workers per node and the same number of partitions (without data-parallel mode every
// node is its own partition). One node's data is never split or merged across nodes, so a job
// that shrank or grew cannot use the checkpoints of its former shape.
type Shape struct {
	Nodes   int `json:"nodes"`
	Workers int `json:"workers"`
	// DataParallelism is 0 with data-parallel mode off, and -1 in a recorded shape that does not
	// say (the record of a backup taken before mtcfs recorded it, which held nodes and workers).
	DataParallelism int `json:"data-parallelism"`
}

// Shape returns the job's shape.
func (c *Config) Shape() Shape {
	return Shape{Nodes: c.Nodes, Workers: c.WorkersPerNode, DataParallelism: c.AssumeDataParallelism}
}

// valid reports whether a job can have shape s (a record that is not is no record).
func (s Shape) valid() bool { return s.Nodes > 0 && s.Workers > 0 && s.DataParallelism >= 0 }

// partitions returns how many different slots of data a node-wide checkpoint of s holds per
// worker: Nodes, or Nodes/DataParallelism in data-parallel mode.
func (s Shape) partitions() int {
	if s.DataParallelism > 0 {
		return s.Nodes / s.DataParallelism
	}
	return s.Nodes
}

func (s Shape) String() string {
	b := new(strings.Builder)
	fmt.Fprintf(b, "%d node%s × %d worker%s", s.Nodes, plural(s.Nodes), s.Workers, plural(s.Workers))
	if s.DataParallelism > 0 {
		fmt.Fprintf(b, ", data-parallelism %d", s.DataParallelism)
	}
	return b.String()
}

func plural(n int) string {
	if n == 1 {
		return ""
	}
	return "s"
}

// Restores reports whether a job of shape s can restore a checkpoint saved by a job of shape
// saved. When recorded is false, saved comes from the .meta names found (highest rank and
// worker + 1) and is a lower bound: it proves a larger job only.
//
// A data-parallel job declares its column-mates interchangeable, so more nodes than it has are
// replicas it can do without; only a shape recorded with the checkpoint (data-parallelism
// included) tells that its partitions differ.
func (s Shape) Restores(saved Shape, recorded bool) bool {
	if !recorded {
		if saved.Workers > s.Workers {
			return false
		}
		return s.DataParallelism > 0 || saved.Nodes <= s.Nodes
	}
	if saved.DataParallelism < 0 {
		// Its partitions are unknown: the same nodes and workers restore it, as they always did.
		return saved.Workers == s.Workers && saved.Nodes == s.Nodes
	}
	return saved.Workers == s.Workers && saved.partitions() == s.partitions()
}

// ShapeError says that a backup holds checkpoints of a job of another shape: the job restoring
// cannot use them (Shape.Restores).
type ShapeError struct {
	Backup   string
	Saved    Shape // as recorded, or at least (Recorded false) as its .meta names show
	Recorded bool
	Job      Shape
}

func (e *ShapeError) Error() string {
	return fmt.Sprintf("backup %s was taken by %s; this job has %s", e.Backup, DescribeSaved(e.Saved, e.Recorded), e.Job)
}

// DescribeSaved says what job saved a checkpoint of shape saved (recorded false: the lower
// bound its .meta names show).
func DescribeSaved(saved Shape, recorded bool) string {
	if !recorded {
		return "a job of at least " + saved.String() + " (its .meta names)"
	}
	return "a job of " + saved.String()
}

// RestoredBy says which jobs restore a checkpoint DescribeSaved describes (Restores).
func RestoredBy(saved Shape, recorded bool) string {
	switch {
	case !recorded:
		return "a job with as many nodes as its .meta names and as many workers per node (a job of more nodes, not data-parallel, finds it incomplete), or a data-parallel one"
	case saved.DataParallelism < 0:
		return "a job of the same nodes and workers per node (its data-parallelism was not recorded)"
	default:
		return "a job with the same workers per node and number of partitions (nodes, or nodes / assume-data-parallelism)"
	}
}

// JobMeta parses name as a .meta of the job of cfg; inShape tells whether its slot is one of
// the job's (a rank below nodes, a worker below workers-per-node).
func JobMeta(cfg *Config, name string) (m layout.MarkerName, inShape, ok bool) {
	m, ok = layout.ParseMarkerName(name)
	if !ok || m.Kind != layout.MarkerMeta || m.Job != cfg.JobName {
		return m, false, false
	}
	return m, m.Node < cfg.Nodes && m.Worker < cfg.WorkersPerNode, true
}

// OtherShapeSteps maps each step in the nodes' RAM that the job cannot restore to what shows
// it: a node's spool recorded the job's shape as one that cannot restore its steps, or, on a
// node without a record, a .meta of the job names a slot outside the job's shape (the highest
// such slot). A record this shape restores vouches for its node's .meta entries: those of a
// data-parallel job's column-mates past this job's nodes are replicas it can do without.
func OtherShapeSteps(cfg *Config, invs []Inventory) map[int64]string {
	shape := cfg.Shape()
	out := map[int64]string{}
	outside := map[int64]Slot{}
	for _, inv := range invs {
		recorded := inv.Shape.Nodes > 0
		incompatible := recorded && !shape.Restores(inv.Shape, true)
		for name := range inv.Metas {
			m, _, ok := JobMeta(cfg, name)
			switch {
			case !ok:
			case incompatible:
				out[m.Step] = fmt.Sprintf("was saved by a job of %s (as rank %d's spool recorded it)", inv.Shape, inv.Rank)
			case recorded:
			case !shape.Restores(Shape{Nodes: m.Node + 1, Workers: m.Worker + 1}, false):
				if prev, seen := outside[m.Step]; !seen || m.Node > prev.Rank || (m.Node == prev.Rank && m.Worker > prev.Worker) {
					outside[m.Step] = Slot{m.Node, m.Worker}
				}
			}
		}
	}
	for step, slot := range outside {
		if _, known := out[step]; !known {
			out[step] = fmt.Sprintf("was saved by a job with a rank %d worker %d", slot.Rank, slot.Worker)
		}
	}
	return out
}
