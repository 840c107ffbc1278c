package tiers

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"
)

// WaitDescriber is implemented by a Coordinator that can say what a node's pending Negotiate or
// Restored call waits for: the ranks not heard from yet, or why the coordinator cannot be
// reached. The restorer shows it in the log, in mtcfs status and to the job while it waits.
type WaitDescriber interface {
	// WaitingFor describes what inc's pending call waits for ("" when it cannot say), and
	// whether that is other nodes of the job (rather than, say, rank 0 reading the backups).
	WaitingFor(inc Incarnation) (what string, nodes bool)
}

// SyncWaitDescriber is implemented by a Coordinator that can tell what a step's sync waits
// for: the ranks that have not reported the step yet, as far as this node can tell ("": it
// cannot say). A sync stuck on a lost rank said only "waiting for every node's report"
// (black-box h58).
type SyncWaitDescriber interface {
	SyncWaitingFor(inc Incarnation, step int64) string
}

// JobChecker is implemented by a Coordinator that can tell, from how the agent was started,
// that it cannot serve a job of some shape: a static --peers map that lacks one of the job's
// ranks. The handshake refuses such a job in replicator.failed instead of waiting for a rank
// it has no way to reach.
type JobChecker interface {
	CheckJob(cfg *Config) error
}

// RestoreFailureReporter is implemented by a Coordinator that can tell the other nodes of the job
// that this node's restore failed: their Restored calls then fail with the reason (a
// coordinator of an earlier version cannot; they wait until their jobs give up).
type RestoreFailureReporter interface {
	RestoreFailed(ctx context.Context, inc Incarnation, reason string) error
}

// restoreFailedTimeout bounds the call that tells the other nodes a restore failed: as long as
// their jobs wait for their restore (Orbax, NeMo: 300 s), since the call is retried until rank 0
// answers. It was 10 s: a rank 0 frozen longer (SIGSTOP, a stalled VM) was never told, and its
// job waited out its 300 s although the others had failed (a black-box run).
const restoreFailedTimeout = 5 * time.Minute

// waitNotices says when a restore that waits for the other nodes tells of it: in the log after
// logAfter and every logEvery after that, and once in replicator.errors after lineAfter. The job
// (Orbax, NeMo) gives up on its restore after 300 s; a node whose agent is not running, or runs
// with another job-name or backup location, would otherwise leave it waiting in silence.
type waitNotices struct {
	logAfter, logEvery, lineAfter atomic.Int64 // time.Duration
}

func newWaitNotices() *waitNotices {
	w := &waitNotices{}
	w.logAfter.Store(int64(10 * time.Second))
	w.logEvery.Store(int64(30 * time.Second))
	w.lineAfter.Store(int64(60 * time.Second))
	return w
}

// What the job is told after lineAfter, beside what the coordinator says it waits for.
const (
	negotiationHint = "every node's agent must be running, with the same job-name, backup location and peer secret (rank 0's log names calls it refused), and the job's process on every node must have written its replicator.yaml (a rank whose process did not start is not reported); the restore goes on once they report"
	barrierHint     = "they are still bringing their data in (mtcfs status on those nodes shows the progress), or their restore failed (replicator.failed there); the markers appear once every node has its data"
)

// waitNoticed runs call, a coordinator call that returns once every node got as far (what names
// it), and tells of the wait while it lasts, with hint for the job. mtcfs status shows the wait
// from its first second; it is cleared when call returns.
func (r *restorer) waitNoticed(inc *incarnation, what, hint string, call func() error) error {
	done := make(chan struct{})
	ended := make(chan struct{})
	go func() { // ends with call
		defer close(ended)
		r.noticeWait(inc, what, hint, done)
	}()
	err := call()
	close(done)
	<-ended
	inc.setWaiting("")
	return err
}

// notices calls tell at each tick until done is closed, with the time since it began, whether a
// log line is due (after logAfter, then every logEvery) and whether the job's line is due (once,
// after lineAfter, while inc is the current incarnation).
func (r *restorer) notices(inc *incarnation, done <-chan struct{}, tell func(took time.Duration, logDue, lineDue bool)) {
	start := time.Now()
	logAt := time.Duration(r.waits.logAfter.Load())
	lineAt := time.Duration(r.waits.lineAfter.Load())
	tick := time.NewTicker(min(time.Second, logAt, lineAt))
	defer tick.Stop()
	lineWritten := false
	for {
		select {
		case <-done:
			return
		case <-tick.C:
		}
		took := time.Since(start)
		logDue := took >= logAt
		if logDue {
			logAt += time.Duration(r.waits.logEvery.Load())
		}
		lineDue := !lineWritten && took >= lineAt && r.incs.isCurrent(inc)
		lineWritten = lineWritten || lineDue
		tell(took, logDue, lineDue)
	}
}

func (r *restorer) noticeWait(inc *incarnation, what, hint string, done <-chan struct{}) {
	describer, _ := r.coord.(WaitDescriber)
	r.notices(inc, done, func(took time.Duration, logDue, lineDue bool) {
		waited := took.Round(time.Second)
		detail, nodes := "", false
		if describer != nil {
			detail, nodes = describer.WaitingFor(inc.Incarnation)
		}
		nodes = nodes && inc.Config.Nodes > 1
		if detail == "" {
			detail = "no answer from the coordinator (rank 0) yet"
		}
		inc.setWaiting(fmt.Sprintf("%s in %s: %s", waited, what, detail))
		if logDue {
			msg := what + " takes long"
			if nodes {
				msg = what + " waits for the other nodes"
			}
			r.log.Warn(msg, "waiting_for", detail, "waited", waited.String(), "nodes", inc.Config.Nodes)
		}
		if lineDue {
			line := fmt.Sprintf("%s has waited %s: %s", what, waited, detail)
			if nodes {
				line = fmt.Sprintf("%s has waited %s for the other nodes of the job (%d nodes): %s; %s",
					what, waited, inc.Config.Nodes, detail, hint)
			}
			r.lines.errLine(inc.Config, line)
		}
	})
}

// transferHint is what the job is told of a restore transfer still running after lineAfter.
const transferHint = "the job's wait for its markers (Orbax and NeMo: 300 s) may run out first; mtcfs status shows the progress"

// noticeTransfer tells of a restore transfer (p: from a peer or a backup) while it lasts, until
// done is closed: in the log after logAfter and every logEvery after that, with bytes, rate and
// what is left, and once in replicator.errors after lineAfter, so that a job whose wait for its
// markers runs out on a slow link is not left without a word (SPEC §5: progress in mtcfs status
// and the logs). Before, a 357 s download said nothing between its start and its end.
func (r *restorer) noticeTransfer(inc *incarnation, p *Progress, done <-chan struct{}) {
	r.notices(inc, done, func(took time.Duration, logDue, lineDue bool) {
		if !logDue && !lineDue {
			return
		}
		detail := transferDetail(p.Done(), atomic.LoadInt64(&p.Total), took)
		if stalled := Stalled(p.LastMoved(), time.Now()); stalled != "" {
			detail += "; " + stalled
		}
		if logDue {
			r.log.Warn("restore transfer takes long", "step", p.Step, "source", p.Source, "progress", detail)
		}
		if lineDue && inc.transferTold.CompareAndSwap(false, true) {
			r.lines.errLine(inc.Config, fmt.Sprintf("restoring step %d from %s: %s; %s", p.Step, p.Source, detail, transferHint))
		}
	})
}

// transferDetail says how far a transfer of total bytes got after took: moved, the rate, and
// what is left once at least 1% moved. Progress counts whole chunks (4 MiB), so a transfer on a
// slow link has moved little for long, and the estimate then read "about 4027h left" (a
// black-box run) for a transfer of 82 s.
func transferDetail(moved, total int64, took time.Duration) string {
	rate := float64(moved) / took.Seconds()
	of := " of " + FormatSize(total)
	if total <= 0 { // the size is known once the step's files are listed ("0B of 0B")
		of = " so far"
	}
	detail := fmt.Sprintf("%s%s after %s (%s/s)", FormatSize(moved), of, took.Round(time.Second), FormatSize(int64(rate)))
	if rate > 0 && total > moved && moved*100 >= total {
		detail += fmt.Sprintf(", about %s left", (time.Duration(float64(total-moved)/rate) * time.Second).Round(time.Second))
	}
	return detail
}

// noticedTransfer runs transfer, telling of it while it lasts (noticeTransfer).
func (r *restorer) noticedTransfer(inc *incarnation, p *Progress, transfer func() error) error {
	done, ended := make(chan struct{}), make(chan struct{})
	go func() { // ends with transfer
		defer close(ended)
		r.noticeTransfer(inc, p, done)
	}()
	err := transfer()
	close(done)
	<-ended
	return err
}
