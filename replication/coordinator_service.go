package replication

// The network transport of the job coordinator (coordinator.go): CoordinatorService serves the
// rank-0 agent's Job as the Coordinator gRPC service (proto in peerpb/coordinator.proto), and
// RemoteCoordinator is the tiers.Coordinator of every other rank, calling it.
//
// Every request carries the caller's job shape (the replicator.yaml fields every agent must
// agree on), incarnation id and rank; the call's credentials (Authenticate) must name the same
// job, incarnation and rank. The service only joins callers to an incarnation the rank-0 agent
// started: a Negotiate before rank 0's own is UNAVAILABLE (the client retries), one whose shape
// differs from the current incarnation's is FAILED_PRECONDITION, so that a misconfigured agent
// cannot replace the job's incarnation with one of its own.
//
// All three calls are safe to repeat (see JobCoordinator), so RemoteCoordinator retries a call
// that failed with UNAVAILABLE — rank 0 not up yet, restarting, or unreachable — with backoff
// until its context ends, asking its address function again before each retry. A Negotiate
// refused for its shape is retried for a grace (ShapeGrace): a job restarted with another shape
// reaches rank 0's agent last as often as not.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/mtcfs/mtcfs/replication/peerpb"
	"github.com/mtcfs/mtcfs/tiers"
)

// ErrJobShape is returned for a call whose job shape (job name, nodes, workers per node,
// data parallelism, backup interval, framework) differs from the job's current incarnation.
var ErrJobShape = tiers.ErrJobShape

// errNotStarted is the UNAVAILABLE answer to a Negotiate that arrives before rank 0 started an
// incarnation.
var errNotStarted = errors.New("the coordinator has not started an incarnation yet")

// --- server ----------------------------------------------------------------------------------

// CoordinatorServiceConfig configures a CoordinatorService.
type CoordinatorServiceConfig struct {
	// Job is the rank-0 agent's job, which its own agent calls through LocalClient. Required.
	Job *Job
	// Secrets gives the shared secret of each job this agent serves (see Authenticate). Required.
	Secrets SecretFunc
	// Instance is this agent's instance id: calls meant for another instance (see WithTarget)
	// are refused with UNAVAILABLE, so a caller that used a stale registration looks again
	// instead of coordinating with the wrong agent. Empty accepts every call.
	Instance string
	// Logger receives refused calls. Default slog.Default().
	Logger *slog.Logger
	// Now is the clock for authentication (not the coordinator's clock); default time.Now.
	Now func() time.Time
}

// CoordinatorService serves the Coordinator gRPC service on top of one Job. Register it on a
// gRPC server built with ServerOptions (it can share the server of the Peer service).
type CoordinatorService struct {
	peerpb.UnimplementedCoordinatorServer
	cfg CoordinatorServiceConfig
	log *slog.Logger
}

// NewCoordinatorService returns the service of cfg.Job.
func NewCoordinatorService(cfg CoordinatorServiceConfig) (*CoordinatorService, error) {
	switch {
	case cfg.Job == nil:
		return nil, errors.New("coordinator service: Job is required")
	case cfg.Secrets == nil:
		return nil, errors.New("coordinator service: Secrets is required")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &CoordinatorService{cfg: cfg, log: cfg.Logger}, nil
}

// Register adds the coordinator service to s.
func (s *CoordinatorService) Register(r grpc.ServiceRegistrar) {
	peerpb.RegisterCoordinatorServer(r, s)
}

func (s *CoordinatorService) Negotiate(ctx context.Context, req *peerpb.NegotiateRequest) (*peerpb.NegotiateReply, error) {
	c, inc, err := s.admit(ctx, req.GetCaller(), true)
	if err != nil {
		return nil, err
	}
	plan, err := c.Negotiate(ctx, inc.Config.NodeRank, inventoryFromPB(inc.Config.NodeRank, req.GetInventory()))
	if err != nil {
		return nil, coordinatorStatus(err)
	}
	return &peerpb.NegotiateReply{Plan: planToPB(plan)}, nil
}

func (s *CoordinatorService) Restored(ctx context.Context, req *peerpb.RestoredRequest) (*peerpb.RestoredReply, error) {
	c, inc, err := s.admit(ctx, req.GetCaller(), false)
	if err != nil {
		return nil, err
	}
	// The caller learns that this coordinator holds its call (RestoredGiveUp counts from
	// the last one that did).
	grpc.SendHeader(ctx, metadata.Pairs(restoredHeldHeader, "1"))
	if err := c.Restored(ctx, inc.Config.NodeRank); err != nil {
		return nil, coordinatorStatus(err)
	}
	return &peerpb.RestoredReply{}, nil
}

func (s *CoordinatorService) RestoreFailed(ctx context.Context, req *peerpb.RestoreFailedRequest) (*peerpb.RestoreFailedReply, error) {
	c, inc, err := s.admit(ctx, req.GetCaller(), false)
	if err != nil {
		return nil, err
	}
	if err := c.RestoreFailed(inc.Config.NodeRank, req.GetReason()); err != nil {
		return nil, coordinatorStatus(err)
	}
	return &peerpb.RestoreFailedReply{}, nil
}

func (s *CoordinatorService) Sync(ctx context.Context, req *peerpb.SyncRequest) (*peerpb.SyncReply, error) {
	c, inc, err := s.admit(ctx, req.GetCaller(), false)
	if err != nil {
		return nil, err
	}
	if req.GetStep() < 0 {
		return nil, errInvalid("sync of step %d: steps are ≥ 0", req.GetStep())
	}
	dec, err := c.Sync(ctx, inc.Config.NodeRank, tiers.SyncReport{Step: req.GetStep(), Replicated: req.GetReplicated(), Data: req.GetData()})
	if err != nil {
		return nil, coordinatorStatus(err)
	}
	return &peerpb.SyncReply{Replicated: dec.Replicated}, nil
}

func (s *CoordinatorService) Backups(ctx context.Context, req *peerpb.BackupsRequest) (*peerpb.BackupsReply, error) {
	c, inc, err := s.admit(ctx, req.GetCaller(), false)
	if err != nil {
		return nil, err
	}
	order, err := c.Backups(ctx, inc.Config.NodeRank, tiers.BackupReport{Done: req.GetDone(), Failed: req.GetFailed(), Err: req.GetError(), Hashes: req.GetHashes()})
	if err != nil {
		return nil, coordinatorStatus(err)
	}
	return &peerpb.BackupsReply{Backup: order.Backup, Step: order.Step, Data: order.Data}, nil
}

// admit authenticates a call, checks that its request speaks for the authenticated agent and
// has the shape of the job's current incarnation, and returns the coordinator to call. Refusals
// are logged with the peer's address.
func (s *CoordinatorService) admit(ctx context.Context, caller *peerpb.Caller, negotiate bool) (*JobCoordinator, tiers.Incarnation, error) {
	from, err := Authenticate(ctx, s.cfg.Secrets, s.cfg.Now())
	var (
		c   *JobCoordinator
		inc tiers.Incarnation
	)
	if err == nil {
		err = checkTarget(ctx, s.cfg.Instance)
	}
	if err == nil {
		c, inc, err = s.coordinator(from, caller, negotiate)
	}
	if errors.Is(err, ErrJobShape) {
		s.cfg.Job.refused(from.Rank, err.Error(), s.cfg.Now())
	}
	if err != nil && !errors.Is(err, errNotStarted) && !errors.Is(err, errNotRankZero) {
		method, _ := grpc.Method(ctx)
		s.log.Warn("coordinator call refused", "peer", peerAddr(ctx), "method", method, "job", from.Job, "rank", from.Rank,
			"incarnation", from.Incarnation, "err", err)
	}
	return c, inc, err
}

func (s *CoordinatorService) coordinator(from Identity, caller *peerpb.Caller, negotiate bool) (*JobCoordinator, tiers.Incarnation, error) {
	if caller == nil || caller.GetShape() == nil {
		return nil, tiers.Incarnation{}, errInvalid("request without caller or job shape")
	}
	cfg := configFromPB(caller.GetShape(), int(caller.GetRank()))
	if cfg.JobName != from.Job || caller.GetIncarnation() != from.Incarnation || cfg.NodeRank != from.Rank {
		return nil, tiers.Incarnation{}, errPermission("request for job %q, incarnation %s, rank %d made with the credentials of job %q, incarnation %s, rank %d",
			cfg.JobName, caller.GetIncarnation(), cfg.NodeRank, from.Job, from.Incarnation, from.Rank)
	}
	cur := s.cfg.Job.currentConfig()
	switch {
	case s.cfg.Job.isResigned():
		return nil, tiers.Incarnation{}, notRankZero("rank %d", cfg.NodeRank)
	case cur == nil && negotiate:
		return nil, tiers.Incarnation{}, withCode(codes.Unavailable, "negotiation of rank %d: %w", cfg.NodeRank, errNotStarted)
	case cur == nil:
		return nil, tiers.Incarnation{}, errPrecondition("incarnation %s of rank %d: %w (no incarnation started)", from.Incarnation, from.Rank, ErrOtherIncarnation)
	case !sameShape(cur, cfg):
		return nil, tiers.Incarnation{}, &codedError{code: codes.FailedPrecondition,
			err: fmt.Errorf("rank %d: %w: the caller has %s, the incarnation %s", cfg.NodeRank, ErrJobShape, describeShape(cfg), describeShape(cur))}
	case cfg.NodeRank < 0 || cfg.NodeRank >= cfg.Nodes:
		return nil, tiers.Incarnation{}, errInvalid("rank %d is not in the job's %d nodes", cfg.NodeRank, cfg.Nodes)
	}
	// Not atomic with the check above: if the rank-0 agent starts an incarnation of another
	// shape in between, this Negotiate starts one of the old shape again (and the rank-0
	// agent's gets ErrClosed). Closing that needs the check inside Job.Coordinator's lock.
	inc := tiers.Incarnation{ID: from.Incarnation, Config: cfg, Superseded: caller.GetSuperseded()}
	if n := len(inc.Superseded); n > tiers.MaxSuperseded {
		// The newest (last) are kept: an agent of a later version sending more is still served
		// (a review: it was refused, and could never negotiate with this one).
		inc.Superseded = inc.Superseded[n-tiers.MaxSuperseded:]
	}
	c, err := s.cfg.Job.RemoteCoordinator(cfg.NodeRank, inc, negotiate)
	if err != nil {
		return nil, inc, coordinatorStatus(err)
	}
	return c, inc, nil
}

// currentConfig is the config of the job's current incarnation, nil before the first one.
func (j *Job) currentConfig() *tiers.Config {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.cur == nil {
		return nil
	}
	return j.cur.cfg
}

// sameShape reports whether two configs agree on every job-wide field a request carries: the
// layout sameJob compares, and the backup interval and framework, which must not differ between
// the agents of one job either.
func sameShape(a, b *tiers.Config) bool {
	return sameJob(a, b) && a.BackupIntervalMinutes == b.BackupIntervalMinutes &&
		a.BackupIntervalSteps == b.BackupIntervalSteps && a.Framework == b.Framework
}

func describeShape(c *tiers.Config) string {
	return fmt.Sprintf("job %q, nodes %d, workers-per-node %d, assume-data-parallelism %d, backup interval %gmin/%d steps, framework %q",
		c.JobName, c.Nodes, c.WorkersPerNode, c.AssumeDataParallelism, c.BackupIntervalMinutes, c.BackupIntervalSteps, c.Framework)
}

// coordinatorStatus gives an error of the coordinator the status code it travels as. Errors
// that already carry one keep it.
func coordinatorStatus(err error) error {
	if _, ok := status.FromError(err); ok {
		return err
	}
	var code codes.Code
	switch {
	case errors.Is(err, context.Canceled):
		code = codes.Canceled
	case errors.Is(err, context.DeadlineExceeded):
		code = codes.DeadlineExceeded
	case errors.Is(err, ErrOtherIncarnation), errors.Is(err, ErrJobShape):
		code = codes.FailedPrecondition
	case errors.Is(err, ErrClosed), errors.Is(err, ErrSyncTimeout), errors.Is(err, ErrStepSkipped), errors.Is(err, ErrRestoreFailed):
		code = codes.Aborted
	default:
		// Bad reports (a rank out of range, an inventory of another rank, a step < 0) are
		// caught before; what is left is the plan's failure, e.g. the backup store's.
		code = codes.Internal
	}
	return &codedError{code: code, err: err}
}

// remoteSentinels are the coordinator errors a RemoteCoordinator's errors match with errors.Is
// when the server's message says so.
var remoteSentinels = []error{ErrClosed, ErrSyncTimeout, ErrStepSkipped, ErrOtherIncarnation, ErrJobShape, ErrRestoreFailed}

// remoteError is an error status from the coordinator service. It keeps the status (status.Code
// works on it) and unwraps to the coordinator's sentinel error named in its message, if any, or
// to the context error its code stands for.
type remoteError struct {
	st       *status.Status
	sentinel error
}

func newRemoteError(err error) error {
	st := status.Convert(err)
	e := &remoteError{st: st}
	switch st.Code() {
	case codes.DeadlineExceeded:
		// The server may see the call's deadline pass (and end it) before the caller's
		// context does.
		e.sentinel = context.DeadlineExceeded
		return e
	case codes.Canceled:
		e.sentinel = context.Canceled
		return e
	}
	for _, s := range remoteSentinels {
		if strings.Contains(st.Message(), s.Error()) {
			e.sentinel = s
			break
		}
	}
	return e
}

func (e *remoteError) Error() string              { return e.st.Code().String() + ": " + e.st.Message() }
func (e *remoteError) Unwrap() error              { return e.sentinel }
func (e *remoteError) GRPCStatus() *status.Status { return e.st }

// --- client ----------------------------------------------------------------------------------

// Backoff of RemoteCoordinator retries, when not configured.
const (
	DefaultRetryMin = 100 * time.Millisecond
	DefaultRetryMax = 5 * time.Second
	// DefaultShapeGrace is how long a Negotiate refused for its job shape is retried: most of
	// the job client's 300 s wait for its restore, so that a misconfigured rank still fails
	// within it, with the reason.
	DefaultShapeGrace = 4 * time.Minute
	// DefaultRestoredGiveUp is how long a Restored call retries a coordinator it cannot reach:
	// rank 0 planned the restore, and without it the restore cannot finish. Every rank waited
	// until its job gave up (330 s) when rank 0's agent died mid-restore (a black-box run).
	DefaultRestoredGiveUp = 90 * time.Second
)

// RemoteCoordinatorConfig configures a RemoteCoordinator.
type RemoteCoordinatorConfig struct {
	// Addr returns the address of the rank-0 agent's coordinator service (host:port). It is
	// asked before the first call and again before each retry, so discovery can move it; an
	// error is retried like an unreachable server. Required.
	Addr func(ctx context.Context) (string, error)
	// Target, when set, is used instead of Addr and also returns the instance id of the agent
	// behind the address (from its registration); calls then carry it (WithTarget), and an
	// agent that is not that instance refuses them, which makes the next attempt look again.
	Target func(ctx context.Context) (addr, instance string, err error)
	// Secret is the job's shared secret. Required.
	Secret []byte
	// Secrets, when set, gives the secret each call uses instead (Secret while it has none): an
	// agent that adopts the job's secret anew (jobSecrets.check) calls with it from then on.
	Secrets SecretFunc
	// Instance is random per agent process (Identity.Instance). Required.
	Instance string
	// DialOptions replace the default DialOptions() with plain-text transport credentials.
	DialOptions []grpc.DialOption
	// RetryMin and RetryMax bound the backoff between retries; defaults DefaultRetryMin and
	// DefaultRetryMax.
	RetryMin, RetryMax time.Duration
	// ShapeGrace is how long a Negotiate refused because its job shape differs from the
	// coordinator's incarnation (ErrJobShape) is retried: a job restarted with another shape
	// (nodes, workers, backup interval, ...) reaches the agents in no set order, and rank 0's
	// may not have read its new replicator.yaml yet. Past it the refusal stands: an agent of
	// another shape than rank 0's is misconfigured. Default DefaultShapeGrace; negative: none.
	ShapeGrace time.Duration
	// RestoredGiveUp is how long a Restored call is retried while no attempt reaches a
	// coordinator that holds it (one held, then cut, starts the count again). Default
	// DefaultRestoredGiveUp; negative: until the call's context ends.
	RestoredGiveUp time.Duration
	// Logger receives one line per retried failure after the first. Default slog.Default().
	Logger *slog.Logger
}

// RemoteCoordinator is the tiers.Coordinator of an agent of rank > 0: every call goes to the
// coordinator service of the rank-0 agent. Calls that fail with UNAVAILABLE are retried until
// their context ends, a Negotiate refused for its job shape for ShapeGrace; other errors are
// returned at once, with the gRPC status (status.Code) and
// matching the coordinator's errors (ErrClosed, ErrOtherIncarnation, ErrSyncTimeout,
// ErrStepSkipped, ErrJobShape) with errors.Is.
type RemoteCoordinator struct {
	cfg RemoteCoordinatorConfig
	log *slog.Logger

	mu     sync.Mutex
	addr   string           // GUARDED_BY(mu); the address conn dials
	target string           // GUARDED_BY(mu); the instance id behind addr ("" if unknown)
	conn   *grpc.ClientConn // GUARDED_BY(mu); nil before the first call and after Close
	closed bool             // GUARDED_BY(mu)
	// failing is the latest failure of a Negotiate or Restored call being retried (nil: none
	// is); the Backups and Sync calls running beside them do not count.
	failing error // GUARDED_BY(mu)
}

var _ tiers.WaitDescriber = (*RemoteCoordinator)(nil)

// WaitingFor says what a pending call waits for, as far as this rank can tell: rank 0 when it
// answers (it holds the call until every node got as far), or why it cannot be reached.
func (r *RemoteCoordinator) WaitingFor(inc tiers.Incarnation) (string, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.failing != nil && strings.Contains(r.failing.Error(), staleRegistration) {
		// The address registered for rank 0 is served by another agent instance: rank 0's
		// agent restarted, and registers again only when rank 0's job writes its yaml. The
		// job-wide hint ("the restore goes on once they report") read as if waiting could end
		// it (a black-box run).
		return fmt.Sprintf("the coordinator (rank 0): the agent registered for it is gone (its address answers as another agent instance: rank 0's agent restarted), and rank 0 registers again when its job restarts; restart the job if rank 0's job did not (%v)", r.failing), true
	}
	if r.failing != nil {
		return fmt.Sprintf("the coordinator (rank 0) has not answered yet: %v", r.failing), true
	}
	return "the coordinator (rank 0), which answers once every node got as far (mtcfs status on rank 0 names the ranks missing)", true
}

// SyncWaitingFor says what a pending sync waits for, as far as this rank can tell.
func (r *RemoteCoordinator) SyncWaitingFor(inc tiers.Incarnation, step int64) string {
	what, _ := r.WaitingFor(inc)
	return what
}

var _ tiers.SyncWaitDescriber = (*RemoteCoordinator)(nil)

// setFailing records the failure of a call being retried (nil: it got through).
func (r *RemoteCoordinator) setFailing(err error) {
	r.mu.Lock()
	r.failing = err
	r.mu.Unlock()
}

var _ tiers.Coordinator = (*RemoteCoordinator)(nil)

// NewRemoteCoordinator returns a client of the coordinator service. It dials nothing until the
// first call. Close it when done.
func NewRemoteCoordinator(cfg RemoteCoordinatorConfig) (*RemoteCoordinator, error) {
	switch {
	case cfg.Addr == nil && cfg.Target == nil:
		return nil, errors.New("remote coordinator: Addr or Target is required")
	case len(cfg.Secret) == 0:
		return nil, errors.New("remote coordinator: Secret is required")
	case cfg.Instance == "" || len(cfg.Instance) > maxIdentityField:
		return nil, fmt.Errorf("remote coordinator: Instance must be 1 to %d bytes", maxIdentityField)
	}
	if cfg.DialOptions == nil {
		cfg.DialOptions = append(DialOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	}
	if cfg.RetryMin <= 0 {
		cfg.RetryMin = DefaultRetryMin
	}
	if cfg.RetryMax < cfg.RetryMin {
		cfg.RetryMax = max(DefaultRetryMax, cfg.RetryMin)
	}
	if cfg.ShapeGrace == 0 {
		cfg.ShapeGrace = DefaultShapeGrace
	}
	if cfg.RestoredGiveUp == 0 {
		cfg.RestoredGiveUp = DefaultRestoredGiveUp
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &RemoteCoordinator{cfg: cfg, log: cfg.Logger}, nil
}

// Close closes the connection; calls made afterwards fail.
func (r *RemoteCoordinator) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.closed = true
	if r.conn == nil {
		return nil
	}
	err := r.conn.Close()
	r.conn, r.addr = nil, ""
	return err
}

func (r *RemoteCoordinator) Negotiate(ctx context.Context, inc tiers.Incarnation, inv tiers.Inventory) (tiers.RestorePlan, error) {
	caller, err := callerToPB(inc)
	if err != nil {
		return tiers.RestorePlan{}, err
	}
	if inv.Rank != inc.Config.NodeRank {
		return tiers.RestorePlan{}, fmt.Errorf("inventory of rank %d reported for rank %d", inv.Rank, inc.Config.NodeRank)
	}
	req := &peerpb.NegotiateRequest{Caller: caller, Inventory: inventoryToPB(inv)}
	var reply *peerpb.NegotiateReply
	err = r.call(ctx, inc, "Negotiate", func(ctx context.Context, c peerpb.CoordinatorClient, opt grpc.CallOption) (err error) {
		reply, err = c.Negotiate(ctx, req, opt)
		return err
	}, nil)
	if err != nil {
		return tiers.RestorePlan{}, err
	}
	return planFromPB(reply.GetPlan()), nil
}

func (r *RemoteCoordinator) Restored(ctx context.Context, inc tiers.Incarnation) error {
	caller, err := callerToPB(inc)
	if err != nil {
		return err
	}
	req := &peerpb.RestoredRequest{Caller: caller}
	held := false // the latest attempt reached a coordinator that held it (restoredHeldHeader)
	return r.call(ctx, inc, "Restored", func(ctx context.Context, c peerpb.CoordinatorClient, opt grpc.CallOption) error {
		var hdr metadata.MD
		_, err := c.Restored(ctx, req, opt, grpc.Header(&hdr))
		held = len(hdr.Get(restoredHeldHeader)) > 0
		return err
	}, func() bool {
		h := held
		held = false
		return h
	})
}

// restoredHeldHeader is the header a coordinator sends as it takes a Restored call to hold.
const restoredHeldHeader = "mtcfs-restored-held"

// RestoreFailed tells rank 0 that this node's restore failed. A coordinator of an earlier
// version answers Unimplemented: the other nodes then wait until their jobs give up.
func (r *RemoteCoordinator) RestoreFailed(ctx context.Context, inc tiers.Incarnation, reason string) error {
	caller, err := callerToPB(inc)
	if err != nil {
		return err
	}
	req := &peerpb.RestoreFailedRequest{Caller: caller, Reason: reason}
	err = r.call(ctx, inc, "RestoreFailed", func(ctx context.Context, c peerpb.CoordinatorClient, opt grpc.CallOption) error {
		_, err := c.RestoreFailed(ctx, req, opt)
		return err
	}, nil)
	if status.Code(err) == codes.Unimplemented {
		return fmt.Errorf("rank 0's agent is of an earlier version: %w (%v)", errors.ErrUnsupported, err)
	}
	return err
}

func (r *RemoteCoordinator) Sync(ctx context.Context, inc tiers.Incarnation, rep tiers.SyncReport) (tiers.SyncDecision, error) {
	caller, err := callerToPB(inc)
	if err != nil {
		return tiers.SyncDecision{}, err
	}
	req := &peerpb.SyncRequest{Caller: caller, Step: rep.Step, Replicated: rep.Replicated, Data: rep.Data}
	var reply *peerpb.SyncReply
	err = r.call(ctx, inc, "Sync", func(ctx context.Context, c peerpb.CoordinatorClient, opt grpc.CallOption) (err error) {
		reply, err = c.Sync(ctx, req, opt)
		return err
	}, nil)
	if err != nil {
		return tiers.SyncDecision{}, err
	}
	return tiers.SyncDecision{Replicated: reply.GetReplicated()}, nil
}

// Backups waits for a backup order as JobCoordinator.Backups does; when ctx ends first, it
// returns the zero order and no error.
func (r *RemoteCoordinator) Backups(ctx context.Context, inc tiers.Incarnation, rep tiers.BackupReport) (tiers.BackupOrder, error) {
	caller, err := callerToPB(inc)
	if err != nil {
		return tiers.BackupOrder{}, err
	}
	req := &peerpb.BackupsRequest{Caller: caller, Done: rep.Done, Failed: rep.Failed, Error: validText(rep.Err), Hashes: rep.Hashes}
	var reply *peerpb.BackupsReply
	err = r.call(ctx, inc, "Backups", func(ctx context.Context, c peerpb.CoordinatorClient, opt grpc.CallOption) (err error) {
		reply, err = c.Backups(ctx, req, opt)
		return err
	}, nil)
	if err != nil {
		// The long poll ended without an order at the caller's deadline. The server ends the
		// call at its copy of that deadline, which can pass a moment before ctx's does: the
		// error then says DeadlineExceeded while ctx.Err() is still nil (agents logged it as a
		// failed call and backed off, up to 30 s).
		if ctx.Err() != nil || errors.Is(err, context.DeadlineExceeded) {
			return tiers.BackupOrder{}, nil
		}
		if status.Code(err) == codes.Unimplemented {
			// An agent from before backup orders (a black-box run mixed versions: this
			// node's part of every backup was missing, and the job was told nothing).
			return tiers.BackupOrder{}, fmt.Errorf("rank 0's agent is of an earlier version: %w (%v)", errors.ErrUnsupported, err)
		}
		return tiers.BackupOrder{}, err
	}
	return tiers.BackupOrder{Backup: reply.GetBackup(), Step: reply.GetStep(), Data: reply.GetData()}, nil
}

// call makes one RPC, authenticated as inc's agent, retrying while it fails with UNAVAILABLE
// (or the address cannot be had) and ctx allows; a Negotiate refused for its job shape is
// retried for ShapeGrace.
// reached, when not nil, reports (once) whether the latest attempt reached a coordinator that
// held the call: Restored gives up RestoredGiveUp after the last that did.
func (r *RemoteCoordinator) call(ctx context.Context, inc tiers.Incarnation, method string,
	rpc func(context.Context, peerpb.CoordinatorClient, grpc.CallOption) error, reached func() bool) error {
	secret := r.cfg.Secret
	if r.cfg.Secrets != nil {
		if s, ok := r.cfg.Secrets(inc.Config.JobName); ok {
			secret = s
		}
	}
	creds := grpc.PerRPCCredentials(Credentials(Identity{
		Job: inc.Config.JobName, Incarnation: inc.ID, Rank: inc.Config.NodeRank, Instance: r.cfg.Instance,
	}, secret))
	wait := r.cfg.RetryMin
	refresh := false
	var last error // the latest retried failure
	// WaitingFor describes the calls that wait for the other nodes.
	waits := method == "Negotiate" || method == "Restored"
	// A Negotiate refused for its job shape waits for rank 0 to take that shape until then (set
	// at the first such refusal: time spent unable to reach rank 0 does not count).
	var shapeUntil time.Time
	var unreached time.Time // Restored: since when no attempt reached a coordinator that held it
	giveUp := func(err error, attempts int) error {
		if last == nil {
			return err
		}
		return fmt.Errorf("%w (gave up after %d attempts: %w)", last, attempts, ctx.Err())
	}
	for attempt := 1; ; attempt++ {
		addr, conn, err := r.connect(ctx, refresh)
		switch {
		case errors.Is(err, errRemoteClosed):
			return fmt.Errorf("coordinator %s: %w", method, err)
		case err != nil && ctx.Err() != nil:
			return giveUp(fmt.Errorf("coordinator %s: %w (%w)", method, ctx.Err(), err), attempt)
		case err == nil:
			r.mu.Lock()
			target := r.target
			r.mu.Unlock()
			if waits {
				r.setFailing(nil) // reached; rpc may wait for the other nodes
			}
			err = rpc(WithTarget(ctx, target), peerpb.NewCoordinatorClient(conn), creds)
			if err == nil {
				return nil
			}
			if ctx.Err() != nil {
				// The failure is the context's end, whatever the status says.
				return giveUp(fmt.Errorf("coordinator %s at %s: %w", method, addr, ctx.Err()), attempt)
			}
			err = fmt.Errorf("coordinator %s at %s: %w", method, addr, newRemoteError(err))
			// A Negotiate whose coordinator ended under it (this agent's former rank 0 became
			// another rank, or stopped) negotiates again with rank 0 as it is found now.
			closedWait := method == "Negotiate" && errors.Is(err, ErrClosed)
			shapeWait := method == "Negotiate" && errors.Is(err, ErrJobShape)
			if shapeWait && shapeUntil.IsZero() {
				shapeUntil = time.Now().Add(r.cfg.ShapeGrace)
			}
			shapeWait = shapeWait && time.Now().Before(shapeUntil)
			if !retryable(err) && !shapeWait && !closedWait {
				return err
			}
		}
		last = err
		if waits {
			r.setFailing(err)
		}
		if method == "Restored" && r.cfg.RestoredGiveUp > 0 {
			if unreached.IsZero() || (reached != nil && reached()) {
				unreached = time.Now() // the first failure, or a call held until it was cut
			}
			if waited := time.Since(unreached); waited > r.cfg.RestoredGiveUp {
				return fmt.Errorf("%w; rank 0's coordinator, which planned this restore, was not reached for %v: the restore cannot finish without it (its agent stopped, or the link to it is down): restart the job", err, waited.Round(time.Second))
			}
		}
		switch {
		case isTLSRefusal(err):
			// Retrying may help (a peer restarting with new certificates), but the operator must
			// see why: it is usually a certificate from the wrong CA.
			r.log.Warn("coordinator call refused by TLS, retrying", "method", method, "attempt", attempt, "retry_in", wait.String(), "err", err)
		case attempt > 1:
			r.log.Info("coordinator call failed, retrying", "method", method, "attempt", attempt, "retry_in", wait.String(), "err", err)
		}
		// Jitter in [wait/2, wait]: ranks that lost rank 0 together do not retry together.
		t := time.NewTimer(wait/2 + rand.N(wait/2+1))
		select {
		case <-ctx.Done():
			t.Stop()
			return giveUp(err, attempt)
		case <-t.C:
		}
		wait = min(2*wait, r.cfg.RetryMax)
		refresh = true
	}
}

var errRemoteClosed = errors.New("remote coordinator closed")

// retryable reports whether a failed call may be repeated: the server could not be reached or
// went away (UNAVAILABLE), or the call's connection was closed under it because the address
// changed (CANCELED while the caller's context is alive; the caller checks that).
func retryable(err error) bool {
	switch status.Code(err) {
	case codes.Unavailable, codes.Canceled:
		return true
	}
	return false
}

// connect returns the connection to the coordinator, asking Addr first when there is none yet or
// refresh is set; a changed address replaces the connection.
func (r *RemoteCoordinator) connect(ctx context.Context, refresh bool) (string, *grpc.ClientConn, error) {
	r.mu.Lock()
	addr, conn, closed := r.addr, r.conn, r.closed
	r.mu.Unlock()
	if closed {
		return "", nil, errRemoteClosed
	}
	if conn != nil && !refresh {
		return addr, conn, nil
	}
	var next, instance string
	var err error
	if r.cfg.Target != nil {
		next, instance, err = r.cfg.Target(ctx)
	} else {
		next, err = r.cfg.Addr(ctx)
	}
	if err != nil {
		return "", nil, fmt.Errorf("address of the coordinator: %w", err)
	}
	if next == "" {
		return "", nil, errors.New("address of the coordinator: none published")
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return "", nil, errRemoteClosed
	}
	r.target = instance
	if r.conn != nil && r.addr == next {
		return r.addr, r.conn, nil
	}
	c, err := grpc.NewClient(next, r.cfg.DialOptions...)
	if err != nil {
		return "", nil, fmt.Errorf("coordinator at %s: %w", next, err)
	}
	if r.conn != nil {
		// Calls still running on the old connection fail with CANCELED and retry on the new
		// address (see retryable).
		r.conn.Close()
	}
	r.addr, r.conn = next, c
	return next, c, nil
}

// --- conversions between the tiers types and their messages ----------------------------------

func callerToPB(inc tiers.Incarnation) (*peerpb.Caller, error) {
	c := inc.Config
	if c == nil {
		return nil, fmt.Errorf("incarnation %s has no config", inc.ID)
	}
	return &peerpb.Caller{
		Shape: &peerpb.JobShape{
			Job:                   c.JobName,
			Nodes:                 int32(c.Nodes),
			WorkersPerNode:        int32(c.WorkersPerNode),
			AssumeDataParallelism: int32(c.AssumeDataParallelism),
			BackupIntervalMinutes: c.BackupIntervalMinutes,
			BackupIntervalSteps:   int32(c.BackupIntervalSteps),
			Framework:             c.Framework,
		},
		Incarnation: inc.ID,
		Rank:        int32(c.NodeRank),
		Superseded:  inc.Superseded,
	}, nil
}

// configFromPB is the config a request describes: its job-wide fields and the caller's rank.
func configFromPB(s *peerpb.JobShape, rank int) *tiers.Config {
	return &tiers.Config{
		JobName:               s.GetJob(),
		Framework:             s.GetFramework(),
		NodeRank:              rank,
		Nodes:                 int(s.GetNodes()),
		BackupIntervalMinutes: s.GetBackupIntervalMinutes(),
		BackupIntervalSteps:   int(s.GetBackupIntervalSteps()),
		AssumeDataParallelism: int(s.GetAssumeDataParallelism()),
		WorkersPerNode:        int(s.GetWorkersPerNode()),
	}
}

func inventoryToPB(inv tiers.Inventory) *peerpb.Inventory {
	m := &peerpb.Inventory{Metas: inv.Metas, Data: inv.Data, Generation: inv.Timeline.Generation, Restores: inv.Timeline.Restores,
		GenerationFloor: inv.Timeline.Floor}
	if s := inv.Shape; s.Nodes > 0 {
		m.SavedShape = &peerpb.SavedShape{Nodes: int32(s.Nodes), WorkersPerNode: int32(s.Workers), DataParallelism: int32(s.DataParallelism)}
	}
	return m
}

// inventoryFromPB is rank's inventory; the maps and slices are the message's own. A saved
// shape that no job can have is unknown.
func inventoryFromPB(rank int, m *peerpb.Inventory) tiers.Inventory {
	inv := tiers.Inventory{Rank: rank, Metas: m.GetMetas(), Data: m.GetData()}
	if inv.Metas == nil {
		inv.Metas = map[string]string{}
	}
	if g := m.GetGeneration(); g > 0 {
		inv.Timeline = tiers.Timeline{Generation: g, Restores: m.GetRestores()}
	}
	inv.Timeline.Floor = max(m.GetGenerationFloor(), 0)
	if s := m.GetSavedShape(); s.GetNodes() > 0 && s.GetWorkersPerNode() > 0 && s.GetDataParallelism() >= 0 {
		inv.Shape = tiers.Shape{Nodes: int(s.GetNodes()), Workers: int(s.GetWorkersPerNode()), DataParallelism: int(s.GetDataParallelism())}
	}
	return inv
}

// validText makes free text (an error naming a path, which need not be UTF-8) fit in a protobuf
// string, which refuses invalid UTF-8: the message failed to marshal, and was sent again and
// again.
func validText(s string) string { return strings.ToValidUTF8(s, "\uFFFD") }

func planToPB(p tiers.RestorePlan) *peerpb.RestorePlan {
	m := &peerpb.RestorePlan{Step: p.Step, Found: p.Found, Backup: p.Backup, Pinned: p.Pinned, Generation: p.Generation, BackedUpIn: p.BackedUpIn,
		LastBackup: p.LastBackup, LastBackupStep: p.LastBackupStep}
	for rank, b := range p.StaleAbove {
		if m.StaleAbove == nil {
			m.StaleAbove = map[int32]int64{}
		}
		m.StaleAbove[int32(rank)] = b
	}
	for _, e := range p.Errors {
		m.Errors = append(m.Errors, validText(e))
	}
	for slot, hash := range p.Data {
		m.Data = append(m.Data, &peerpb.SlotData{Rank: int32(slot.Rank), Worker: int32(slot.Worker), Hash: hash})
	}
	if len(p.Holders) > 0 {
		m.Holders = make(map[string]*peerpb.Ranks, len(p.Holders))
		for hash, ranks := range p.Holders {
			rs := make([]int32, len(ranks))
			for i, r := range ranks {
				rs[i] = int32(r)
			}
			m.Holders[hash] = &peerpb.Ranks{Ranks: rs}
		}
	}
	return m
}

// planFromPB always returns non-nil Data and Holders, as PlanForRank does.
func planFromPB(m *peerpb.RestorePlan) tiers.RestorePlan {
	p := tiers.RestorePlan{
		Step: m.GetStep(), Found: m.GetFound(), Backup: m.GetBackup(), Errors: m.GetErrors(), Pinned: m.GetPinned(), Generation: m.GetGeneration(),
		BackedUpIn: m.GetBackedUpIn(), LastBackup: m.GetLastBackup(), LastBackupStep: m.GetLastBackupStep(),
		Data:    make(map[tiers.Slot]string, len(m.GetData())),
		Holders: make(map[string][]int, len(m.GetHolders())),
	}
	for _, d := range m.GetData() {
		p.Data[tiers.Slot{Rank: int(d.GetRank()), Worker: int(d.GetWorker())}] = d.GetHash()
	}
	for rank, b := range m.GetStaleAbove() {
		if p.StaleAbove == nil {
			p.StaleAbove = map[int]int64{}
		}
		p.StaleAbove[int(rank)] = b
	}
	for hash, rs := range m.GetHolders() {
		ranks := make([]int, len(rs.GetRanks()))
		for i, r := range rs.GetRanks() {
			ranks[i] = int(r)
		}
		p.Holders[hash] = ranks
	}
	return p
}

// isTLSRefusal reports whether err looks like a failed TLS handshake (a certificate the other
// side does not trust, or TLS on one side only).
func isTLSRefusal(err error) bool {
	msg := err.Error()
	return strings.Contains(msg, "tls:") || strings.Contains(msg, "x509:") || strings.Contains(msg, "certificate")
}
