package gcsbackend

// Discovery through the backup location (SPEC §4, §7): agents of one job that share a backup
// location find each other there, and agree on the job's peer secret, with nothing else
// configured.
//
//	<job>/agents/<rank>.json   the newest registration of each rank (Registration, JSON)
//	<job>/secret               the job's shared secret, created once (create-if-absent)
//
// A registration is a hint, not a proof: a killed agent leaves its file behind, and an agent
// of an earlier incarnation may still be registered. That is why a registration carries the
// incarnation and the agent's instance id, which a connection confirms before any data moves,
// and why the newest registration of a rank simply replaces the older one.

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"
)

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

func registrationName(job string, rank int) string {
	return job + "/" + agentsDir + "/" + strconv.Itoa(rank) + ".json"
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
func Register(ctx context.Context, store ObjectStore, reg Registration) error {
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
	if err := PutBytes(ctx, store, registrationName(reg.Job, reg.Rank), data, false); err != nil {
		return fmt.Errorf("register rank %d of %s: %w", reg.Rank, reg.Job, err)
	}
	return nil
}

// Lookup returns the registrations of job's agents by rank. Objects that are not a valid
// registration of the rank their name says (stray files, or written by another tool) are
// skipped: one bad entry must not hide the others.
func Lookup(ctx context.Context, store ObjectStore, job string) (map[int]Registration, error) {
	if err := validateJob(job); err != nil {
		return nil, err
	}
	prefix := job + "/" + agentsDir + "/"
	objects, _, err := store.List(ctx, prefix, "/")
	if err != nil {
		return nil, fmt.Errorf("list agents of %s: %w", job, err)
	}
	type entry struct {
		rank int
		name string
	}
	var entries []entry
	for _, o := range objects {
		digits, ok := strings.CutSuffix(strings.TrimPrefix(o.Name, prefix), ".json")
		rank, err := strconv.Atoi(digits)
		if !ok || err != nil || rank < 0 || strconv.Itoa(rank) != digits {
			continue
		}
		entries = append(entries, entry{rank, o.Name})
	}
	regs := make(map[int]Registration, len(entries))
	var mu sync.Mutex // guards regs during the parallel reads
	err = forEach(ctx, lookupParallelism, len(entries), func(ctx context.Context, i int) error {
		e := entries[i]
		data, err := ReadSmall(ctx, store, e.name, registrationLimit)
		if IsNotFound(err) { // unregistered since listed
			return nil
		}
		if err != nil {
			return err
		}
		var reg Registration
		if json.Unmarshal(data, &reg) != nil || reg.Job != job || reg.Rank != e.rank || reg.validate() != nil {
			return nil
		}
		mu.Lock()
		regs[e.rank] = reg
		mu.Unlock()
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("look up agents of %s: %w", job, err)
	}
	return regs, nil
}

// Unregister removes reg's registration if it is still the rank's current one (same instance
// id): an agent shutting down must not remove the registration of the agent that replaced it.
// Read and delete are two calls, so a registration written in between can still be removed;
// the new agent re-registers when it notices (peers cannot reach it meanwhile). A missing
// registration is not an error.
func Unregister(ctx context.Context, store ObjectStore, reg Registration) error {
	if err := validateJob(reg.Job); err != nil {
		return err
	}
	name := registrationName(reg.Job, reg.Rank)
	data, err := ReadSmall(ctx, store, name, registrationLimit)
	if IsNotFound(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("unregister rank %d of %s: %w", reg.Rank, reg.Job, err)
	}
	var cur Registration
	if json.Unmarshal(data, &cur) == nil && cur.InstanceID != reg.InstanceID {
		return nil // superseded: not ours to remove
	}
	if err := store.Delete(ctx, name); err != nil && !IsNotFound(err) {
		return fmt.Errorf("unregister rank %d of %s: %w", reg.Rank, reg.Job, err)
	}
	return nil
}

// EnsureSecret returns job's shared peer secret, creating <job>/secret with SecretSize random
// bytes if it does not exist yet. Creation is create-if-absent, so when agents race the first
// write wins and every agent returns the winner's secret. On file:// the object is private to
// the user (mode 0600).
func EnsureSecret(ctx context.Context, store ObjectStore, job string) ([]byte, error) {
	if err := validateJob(job); err != nil {
		return nil, err
	}
	name := job + "/" + secretName
	secret, err := ReadSmall(ctx, store, name, secretLimit)
	if IsNotFound(err) {
		fresh := make([]byte, SecretSize)
		rand.Read(fresh) // never fails (crypto/rand)
		err = PutBytes(ctx, store, name, fresh, true)
		var lost *PreconditionError
		if err != nil && !errors.As(err, &lost) {
			return nil, fmt.Errorf("create the peer secret of %s: %w", job, err)
		}
		// Created, or another agent won the race: either way the stored secret is the one.
		secret, err = ReadSmall(ctx, store, name, secretLimit)
	}
	if err != nil {
		return nil, fmt.Errorf("read the peer secret of %s: %w", job, err)
	}
	if len(secret) < minSecretSize {
		return nil, fmt.Errorf("the peer secret %s in %s has %d bytes, want at least %d: delete it to have a new one created",
			name, store, len(secret), minSecretSize)
	}
	return secret, nil
}
