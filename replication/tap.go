package replication

import (
	"cmp"
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/tap"
)

// admitCall is the peer server's tap (grpc.InTapHandle): it checks a call's credentials from its
// headers, before gRPC reads a byte of its message, with the secrets this agent holds already
// (the job's own, read when it joined the job; no store I/O: gRPC calls it with its connection's
// lock held). The services check them again. Checked only in the handlers, a caller without the
// secret had each message read whole first: 40 calls of 25 MB took the agent from 38 MB to
// 1.45 GB, and a call naming any job made the agent create that job's secret in the backup
// location (a black-box run). A job whose secret this agent does not hold is one it has not
// joined: the call is refused as Unavailable, which the job's own agents try again (a rank that
// reaches rank 0's agent before that agent read its replicator.yaml).
func (n *Node) admitCall(ctx context.Context, info *tap.Info) (context.Context, error) {
	id, err := authenticateMD(info.Header, info.FullMethodName, n.secrets.cached, time.Now())
	if err == nil {
		return ctx, nil
	}
	log := n.refusals
	switch {
	case errors.Is(err, errJobNotServed):
		err = withCode(codes.Unavailable, "the agent at this address has not joined job %q (it serves no start of that job yet): the call is refused before its message is read", id.Job)
		log = n.notJoined
	case n.secrets.fixed == nil && id.Job != "":
		// A wrong MAC for a job it holds a secret of: perhaps the secret in the location was
		// made anew, which the services' lookup used to find by the call (a review).
		n.secrets.recheckIfDue(id.Job)
	}
	log.note(time.Now(), "peer", peerAddr(ctx), "method", info.FullMethodName, "job", id.Job, "rank", id.Rank, "err", err)
	return ctx, err
}

// refusalBurst is how many refused calls are logged each minute, one line each; those beyond
// are counted in one line at the end of the minute. A line per refusal made 20,000 lines in
// 3.5 s of a stranger's calls (a black-box run).
const refusalBurst = 10

// refusalLog logs the calls the tap refuses, at most refusalBurst lines a minute and a count of
// the others.
type refusalLog struct {
	log   *slog.Logger
	level slog.Level
	every time.Duration // the window: a minute when 0
	total atomic.Int64  // refusals noted

	mu         sync.Mutex
	since      time.Time // GUARDED_BY(mu); start of the current minute
	logged     int       // GUARDED_BY(mu); lines logged in it
	suppressed int       // GUARDED_BY(mu); refusals not logged in it
	last       []any     // GUARDED_BY(mu); the attributes of the last one not logged
}

func (l *refusalLog) note(now time.Time, attrs ...any) {
	l.total.Add(1)
	every := cmp.Or(l.every, time.Minute)
	l.mu.Lock()
	if l.since.IsZero() || now.Sub(l.since) >= every {
		l.since, l.logged = now, 0
	}
	if l.logged < refusalBurst {
		l.logged++
		l.mu.Unlock()
		l.log.Log(context.Background(), l.level, "peer call refused", attrs...)
		return
	}
	l.suppressed++
	l.last = attrs
	first := l.suppressed == 1
	wait := l.since.Add(every).Sub(now)
	l.mu.Unlock()
	if first {
		time.AfterFunc(wait, l.flush)
	}
}

// flush logs how many refusals were not logged, if any.
func (l *refusalLog) flush() {
	l.mu.Lock()
	n, last := l.suppressed, l.last
	l.suppressed, l.last = 0, nil
	l.mu.Unlock()
	if n > 0 {
		l.log.Log(context.Background(), l.level, "more peer calls refused, not logged one by one", "count", n, "in", cmp.Or(l.every, time.Minute).String(), slog.Group("call", last...))
	}
}
