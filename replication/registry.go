package replication

// Discovery through the backup location (SPEC §4, §7): agents of one job that share a backup
// location find each other there, and agree on the job's peer secret, with nothing else
// configured.
//
//	<job>/agents/<rank>.json   the newest registration of each rank (Registration, JSON)
//	<job>/secret               the job's shared secret, created once (create-if-absent)
//
// A registration is a hint, not a proof: a killed agent leaves its file behind, and an agent
// of an earlier incarnation may still be registered. That is why a registration carries the
// incarnation and the agent's instance id, which a connection confirms before any data moves
// (WithTarget), and why the newest registration of a rank simply replaces the older one.

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/mtcfs/mtcfs/layout"
)

// Objects is the part of the backup location the cluster uses: small objects, read and written
// whole, holding the agent registry and the job secrets. gcsbackend.SmallObjects serves it over
// any backup store (file:// or gs://).
type Objects interface {
	// Get returns the object's content, failing when it is larger than limit bytes. A missing
	// object is an error matching fs.ErrNotExist (errors.Is).
	Get(ctx context.Context, name string, limit int64) ([]byte, error)
	// Put stores data under name, replacing any object there.
	Put(ctx context.Context, name string, data []byte) error
	// PutIfAbsent stores data under name unless an object with other content is there: then it
	// fails with an error matching fs.ErrExist. The same content counts as success (a retry).
	PutIfAbsent(ctx context.Context, name string, data []byte) error
	// List returns the names of the objects directly below prefix (none below a further "/").
	List(ctx context.Context, prefix string) ([]string, error)
	// Delete removes the object; a missing one is an error matching fs.ErrNotExist.
	Delete(ctx context.Context, name string) error
	// String names the location in messages.
	String() string
}

// Registration is one agent's entry in the backup location: where rank Rank of job Job, in its
// incarnation Incarnation, accepts peer connections.
type Registration struct {
	Job         string `json:"job"`
	Incarnation string `json:"incarnation"`
	// InstanceID names one agent process; a restarted agent has a new one.
	InstanceID string    `json:"instance"`
	Rank       int       `json:"rank"`
	Addr       string    `json:"addr"` // host:port of the peer service
	Updated    time.Time `json:"updated"`
}

const (
	agentsDir  = "agents"
	secretName = "secret"
	// SecretSize is the length of a secret EnsureSecret creates.
	SecretSize = 32
	// minSecretSize rejects a secret too short to authenticate anything (a truncated or
	// hand-written file).
	minSecretSize = 16
	// registrationLimit bounds reads of registrations, secretLimit of the secret.
	registrationLimit = 4096
	secretLimit       = 4096
	// lookupParallelism overlaps registration reads: a 1024-node job has 1024 of them.
	lookupParallelism = 32
)

// Registry is the agent registry of one backup location. As a Discovery it finds an agent by its
// newest registration.
type Registry struct{ Objects Objects }

var _ Discovery = Registry{}

func (Registry) registrationName(job string, rank int) string {
	return job + "/" + agentsDir + "/" + strconv.Itoa(rank) + ".json"
}

// validateJob checks a job name used as the first segment of object names.
func validateJob(job string) error {
	if err := layout.ValidateJobName(job); err != nil {
		return fmt.Errorf("job name: %w (want a single path segment)", err)
	}
	return nil
}

func (r Registration) validate() error {
	if err := validateJob(r.Job); err != nil {
		return err
	}
	switch {
	case r.Rank < 0:
		return fmt.Errorf("rank %d: want ≥ 0", r.Rank)
	case r.Incarnation == "" || r.InstanceID == "":
		return errors.New("incarnation and instance id are required, so that peers can confirm them")
	case r.Addr == "":
		return errors.New("address is required")
	}
	return nil
}

// Register publishes reg as the rank's registration, replacing any older one (a restarted
// agent, an earlier incarnation). A zero Updated is set to the current time.
func (g Registry) Register(ctx context.Context, reg Registration) error {
	if err := reg.validate(); err != nil {
		return fmt.Errorf("register: %w", err)
	}
	if reg.Updated.IsZero() {
		reg.Updated = time.Now()
	}
	reg.Updated = reg.Updated.UTC()
	data, err := json.Marshal(reg)
	if err != nil {
		return fmt.Errorf("register rank %d of %s: %w", reg.Rank, reg.Job, err)
	}
	if err := g.Objects.Put(ctx, g.registrationName(reg.Job, reg.Rank), data); err != nil {
		return fmt.Errorf("register rank %d of %s: %w", reg.Rank, reg.Job, err)
	}
	return nil
}

// Lookup returns the registrations of job's agents by rank. Objects that are not a valid
// registration of the rank their name says (stray files, or written by another tool) are
// skipped: one bad entry must not hide the others.
func (g Registry) Lookup(ctx context.Context, job string) (map[int]Registration, error) {
	if err := validateJob(job); err != nil {
		return nil, err
	}
	prefix := job + "/" + agentsDir + "/"
	names, err := g.Objects.List(ctx, prefix)
	if err != nil {
		return nil, fmt.Errorf("list agents of %s: %w", job, err)
	}
	regs := make(map[int]Registration, len(names))
	var mu sync.Mutex // guards regs during the parallel reads
	grp, gctx := errgroup.WithContext(ctx)
	grp.SetLimit(lookupParallelism)
	for _, name := range names {
		digits, ok := strings.CutSuffix(strings.TrimPrefix(name, prefix), ".json")
		rank, err := strconv.Atoi(digits)
		if !ok || err != nil || rank < 0 || strconv.Itoa(rank) != digits {
			continue
		}
		grp.Go(func() error {
			reg, err := g.current(gctx, job, rank) // name is its registrationName
			if errors.Is(err, fs.ErrNotExist) || errors.Is(err, errNotRegistration) {
				return nil // unregistered since listed, or not a registration
			}
			if err != nil {
				return err
			}
			mu.Lock()
			regs[rank] = reg
			mu.Unlock()
			return nil
		})
	}
	if err := grp.Wait(); err != nil {
		return nil, fmt.Errorf("look up agents of %s: %w", job, err)
	}
	return regs, nil
}

// Find returns where rank's agent of job listens, from its registration.
func (g Registry) Find(ctx context.Context, job string, rank int) (Peer, error) {
	regs, err := g.Lookup(ctx, job)
	if err != nil {
		return Peer{}, err
	}
	reg, ok := regs[rank]
	if !ok {
		return Peer{}, fmt.Errorf("rank %d of job %s has not registered in %s", rank, job, g.Objects)
	}
	return Peer{Addr: reg.Addr, Instance: reg.InstanceID}, nil
}

// errNotRegistration: the object where a registration belongs is not a valid one.
var errNotRegistration = errors.New("not a valid registration")

// current reads the registration of rank of job, as Lookup validates one: an object that is
// not a valid registration of that job and rank is an error wrapping errNotRegistration.
func (g Registry) current(ctx context.Context, job string, rank int) (Registration, error) {
	var reg Registration
	data, err := g.Objects.Get(ctx, g.registrationName(job, rank), registrationLimit)
	if err != nil {
		return reg, err
	}
	if err := json.Unmarshal(data, &reg); err != nil || reg.Job != job || reg.Rank != rank || reg.validate() != nil {
		return Registration{}, fmt.Errorf("%s: %w of rank %d of %s", g.registrationName(job, rank), errNotRegistration, rank, job)
	}
	return reg, nil
}

// Unregister removes reg's registration if it is still the rank's current one (same instance
// id): an agent shutting down must not remove the registration of the agent that replaced it.
// Read and delete are two calls, so a registration written in between can still be removed;
// the new agent re-registers when it notices (peers cannot reach it meanwhile). A missing
// registration is not an error.
func (g Registry) Unregister(ctx context.Context, reg Registration) error {
	if err := validateJob(reg.Job); err != nil {
		return err
	}
	name := g.registrationName(reg.Job, reg.Rank)
	cur, err := g.current(ctx, reg.Job, reg.Rank)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return nil
	case err == nil && cur.InstanceID != reg.InstanceID:
		return nil // superseded: not ours to remove
	case err != nil && !errors.Is(err, errNotRegistration): // an invalid object goes
		return fmt.Errorf("unregister rank %d of %s: %w", reg.Rank, reg.Job, err)
	}
	if err := g.Objects.Delete(ctx, name); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("unregister rank %d of %s: %w", reg.Rank, reg.Job, err)
	}
	return nil
}

// EnsureSecret returns job's shared peer secret, creating <job>/secret with SecretSize random
// bytes if it does not exist yet. Creation is create-if-absent, so when agents race the first
// write wins and every agent returns the winner's secret. (On file:// the object is private to
// the user, mode 0600.)
func EnsureSecret(ctx context.Context, objects Objects, job string) ([]byte, error) {
	fresh := make([]byte, SecretSize)
	rand.Read(fresh) // never fails (crypto/rand)
	secret, _, err := ensureSecret(ctx, objects, job, fresh)
	return secret, err
}

// ensureSecret returns job's peer secret in the location, storing ifAbsent there first
// (create-if-absent) when there is none; created says this call stored it.
func ensureSecret(ctx context.Context, objects Objects, job string, ifAbsent []byte) (secret []byte, created bool, err error) {
	if err := validateJob(job); err != nil {
		return nil, false, err
	}
	name := job + "/" + secretName
	secret, err = objects.Get(ctx, name, secretLimit)
	if errors.Is(err, fs.ErrNotExist) {
		err = objects.PutIfAbsent(ctx, name, ifAbsent)
		if err != nil && !errors.Is(err, fs.ErrExist) {
			return nil, false, fmt.Errorf("create the peer secret of %s: %w", job, err)
		}
		created = err == nil
		// Created, or another agent won the race: either way the stored secret is the one.
		secret, err = objects.Get(ctx, name, secretLimit)
	}
	if err != nil {
		return nil, false, fmt.Errorf("read the peer secret of %s: %w", job, err)
	}
	if len(secret) < minSecretSize {
		return nil, false, fmt.Errorf("the peer secret %s in %s has %d bytes, want at least %d: stop the job's agents, delete it, and start them to have a new one created",
			name, objects, len(secret), minSecretSize)
	}
	return secret, created, nil
}
