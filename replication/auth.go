package replication

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"strconv"
	"time"

	"github.com/mtcfs/mtcfs/layout"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
)

// Authentication (SPEC §4: a request from outside the job is refused and logged).
//
// Every call carries, in its gRPC metadata, the caller's Identity, the time it was made, and an
// HMAC-SHA256 keyed by the job's shared secret over all of them and the full method name. The
// receiver recomputes it with its own copy of the secret and refuses the call (Unauthenticated)
// when the MAC is missing or wrong, the job is not one it serves, or the time is more than
// MaxClockSkew away from its clock. Binding the method and the time keeps a captured MAC from
// being reused for another call type or, after a few minutes, at all.
//
// What this does not do: encrypt, or protect the message bodies. Someone who can rewrite traffic
// between two agents can alter a transfer's header and chunks consistently, unless the agents
// use mutual TLS (tls.go), which the MAC then complements. The receiver's checks still guarantee
// that what it accepts hashes to the name it was sent under.

// Identity says who makes a call: one agent of one job.
type Identity struct {
	Job         string // layout.ValidateJobName holds
	Incarnation string // the job's current start (tiers.Incarnation.ID)
	Rank        int
	Instance    string // random per agent process, so a restarted agent is told apart
}

// SecretFunc returns the shared secret of a job, or false when this agent does not serve it.
type SecretFunc func(job string) ([]byte, bool)

// StaticSecret serves one job with one secret.
func StaticSecret(job string, secret []byte) SecretFunc {
	return func(j string) ([]byte, bool) { return secret, j == job }
}

// MaxClockSkew is how far a call's timestamp may be from the receiver's clock.
const MaxClockSkew = 5 * time.Minute

// The metadata keys of a call's authentication.
const (
	mdJob         = "mtcfs-job"
	mdIncarnation = "mtcfs-incarnation"
	mdRank        = "mtcfs-rank"
	mdInstance    = "mtcfs-instance"
	mdTime        = "mtcfs-time" // Unix time in nanoseconds, decimal
	mdMAC         = "mtcfs-mac"  // hex HMAC-SHA256
)

// maxIdentityField bounds the incarnation and instance strings a peer may send.
const maxIdentityField = 128

// callMAC is the HMAC of one call: every field is length-prefixed, so no two different calls
// share an input.
func callMAC(secret []byte, id Identity, unixNano int64, method string) []byte {
	h := hmac.New(sha256.New, secret)
	var n [8]byte
	for _, f := range []string{"mtcfs peer call v1", id.Job, id.Incarnation, strconv.Itoa(id.Rank), id.Instance,
		strconv.FormatInt(unixNano, 10), method} {
		binary.LittleEndian.PutUint64(n[:], uint64(len(f)))
		h.Write(n[:])
		h.Write([]byte(f))
	}
	return h.Sum(nil)
}

// callCredentials attaches an Identity and its MAC to every call it is used for.
type callCredentials struct {
	id     Identity
	secret []byte
	now    func() time.Time
}

var _ credentials.PerRPCCredentials = callCredentials{}

// Credentials returns the per-call credentials that authenticate id to peers of its job, for
// grpc.WithPerRPCCredentials or grpc.PerRPCCredentials. The Sender adds them to its calls itself.
func Credentials(id Identity, secret []byte) credentials.PerRPCCredentials {
	return callCredentials{id: id, secret: secret, now: time.Now}
}

func (c callCredentials) GetRequestMetadata(ctx context.Context, _ ...string) (map[string]string, error) {
	ri, _ := credentials.RequestInfoFromContext(ctx)
	ts := c.now().UnixNano()
	return map[string]string{
		mdJob:         c.id.Job,
		mdIncarnation: c.id.Incarnation,
		mdRank:        strconv.Itoa(c.id.Rank),
		mdInstance:    c.id.Instance,
		mdTime:        strconv.FormatInt(ts, 10),
		mdMAC:         hex.EncodeToString(callMAC(c.secret, c.id, ts, ri.Method)),
	}, nil
}

// RequireTransportSecurity is false: the MAC is what authenticates, over plain TCP too.
func (callCredentials) RequireTransportSecurity() bool { return false }

// Authenticate checks the credentials of the call whose server-side context is ctx and returns
// the caller's identity. Every refusal is Unauthenticated and says why (the secret itself never
// appears). The peer service uses it for every call; other services of the agent can too.
func Authenticate(ctx context.Context, secrets SecretFunc, now time.Time) (Identity, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	method, _ := grpc.Method(ctx)
	return authenticateMD(md, method, secrets, now)
}

// errJobNotServed is a call of a job whose secret this agent does not hold.
var errJobNotServed = errors.New("not served by this agent")

// authenticateMD is Authenticate of a call to method with the metadata md.
func authenticateMD(md metadata.MD, method string, secrets SecretFunc, now time.Time) (Identity, error) {
	get := func(k string) string {
		if v := md.Get(k); len(v) == 1 {
			return v[0]
		}
		return ""
	}
	id := Identity{Job: get(mdJob), Incarnation: get(mdIncarnation), Instance: get(mdInstance)}
	sum, err := hex.DecodeString(get(mdMAC))
	if err != nil || len(sum) != sha256.Size {
		return id, errUnauthenticated("call to %s carries no valid %s", method, mdMAC)
	}
	if err := layout.ValidateJobName(id.Job); err != nil {
		return id, errUnauthenticated("call to %s: job name %s", method, err)
	}
	rank, err := strconv.Atoi(get(mdRank))
	if err != nil || rank < 0 {
		return id, errUnauthenticated("call to %s: rank %q is not a number ≥ 0", method, get(mdRank))
	}
	id.Rank = rank
	if id.Incarnation == "" || len(id.Incarnation) > maxIdentityField || id.Instance == "" || len(id.Instance) > maxIdentityField {
		return id, errUnauthenticated("call to %s: incarnation and instance must be 1 to %d bytes", method, maxIdentityField)
	}
	ts, err := strconv.ParseInt(get(mdTime), 10, 64)
	if err != nil {
		return id, errUnauthenticated("call to %s carries no valid %s", method, mdTime)
	}
	if skew := now.Sub(time.Unix(0, ts)).Abs(); skew > MaxClockSkew {
		return id, errUnauthenticated("call to %s was made %v away from this agent's clock (at most %v allowed)", method, skew.Round(time.Second), MaxClockSkew)
	}
	secret, ok := secrets(id.Job)
	if !ok {
		return id, errUnauthenticated("job %q is %w", id.Job, errJobNotServed)
	}
	if !hmac.Equal(sum, callMAC(secret, id, ts, method)) {
		return id, errUnauthenticated("call to %s for job %q: wrong MAC (not signed with this job's secret)", method, id.Job)
	}
	return id, nil
}
