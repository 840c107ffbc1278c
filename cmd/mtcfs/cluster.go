package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"

	"github.com/mtcfs/mtcfs/gcsbackend"
	"github.com/mtcfs/mtcfs/replication"
	"github.com/mtcfs/mtcfs/tiers"
)

// clusterCoordinator is the tiers.Coordinator the replicator uses. A one-node job is
// coordinated locally. In a multi-node job the rank-0 agent coordinates in process and serves
// the coordinator to the other ranks over gRPC; they find it through the agent registry in the
// backup location, so nothing but a shared --backup needs configuring (SPEC §4, §7).
//
// Not yet here (issue 4): replication of data to peers and fetching from them, so a multi-node
// job restores each node from its own RAM or from a backup.
type clusterCoordinator struct {
	local    *tiers.LocalCoordinator
	objects  gcsbackend.ObjectStore
	job      *replication.Job
	addr     string // where this agent's gRPC server listens
	instance string // random per agent process
	secrets  *secrets

	mu      sync.Mutex
	remotes map[string]*replication.RemoteCoordinator // GUARDED_BY(mu); per job
}

var _ tiers.Coordinator = (*clusterCoordinator)(nil)

func newInstanceID() string {
	var b [8]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// secrets holds the per-job shared secret: the --peer-secret-file for every job, or the one the
// first agent of the job created in the backup location.
type secrets struct {
	fixed   []byte
	objects gcsbackend.ObjectStore

	mu    sync.Mutex
	byJob map[string][]byte // GUARDED_BY(mu)
}

func newSecrets(file string, objects gcsbackend.ObjectStore) (*secrets, error) {
	s := &secrets{objects: objects, byJob: map[string][]byte{}}
	if file != "" {
		data, err := os.ReadFile(file)
		if err != nil {
			return nil, fmt.Errorf("--peer-secret-file: %w", err)
		}
		if s.fixed = []byte(strings.TrimSpace(string(data))); len(s.fixed) < 16 {
			return nil, fmt.Errorf("--peer-secret-file %s: the secret must be at least 16 bytes", file)
		}
	}
	return s, nil
}

func (s *secrets) get(ctx context.Context, job string) ([]byte, error) {
	if s.fixed != nil {
		return s.fixed, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if sec, ok := s.byJob[job]; ok {
		return sec, nil
	}
	sec, err := gcsbackend.EnsureSecret(ctx, s.objects, job)
	if err != nil {
		return nil, fmt.Errorf("per-job secret in %s: %w", s.objects, err)
	}
	s.byJob[job] = sec
	return sec, nil
}

// lookup serves the gRPC side, which asks without a context.
func (s *secrets) lookup(job string) ([]byte, bool) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	sec, err := s.get(ctx, job)
	return sec, err == nil
}

// servePeers starts the gRPC server of this agent (the coordinator service, for when it is
// rank 0 of a multi-node job) on listen and returns the coordinator the replicator uses.
func servePeers(listen string, local *tiers.LocalCoordinator, objects gcsbackend.ObjectStore, store tiers.BackupStore, secretFile string) (*clusterCoordinator, func(), error) {
	sec, err := newSecrets(secretFile, objects)
	if err != nil {
		return nil, nil, err
	}
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return nil, nil, fmt.Errorf("--listen %s: %w", listen, err)
	}
	c := &clusterCoordinator{local: local, objects: objects, addr: ln.Addr().String(), instance: newInstanceID(),
		secrets: sec, remotes: map[string]*replication.RemoteCoordinator{},
		job: replication.NewJob(replication.Options{Store: store, Log: slog.Default()})}
	svc, err := replication.NewCoordinatorService(replication.CoordinatorServiceConfig{Job: c.job, Secrets: sec.lookup})
	if err != nil {
		ln.Close()
		return nil, nil, err
	}
	srv := grpc.NewServer(replication.ServerOptions()...)
	svc.Register(srv)
	go srv.Serve(ln)
	slog.Info("peer service", "addr", c.addr)
	return c, func() {
		srv.Stop()
		c.mu.Lock()
		for _, r := range c.remotes {
			r.Close()
		}
		c.mu.Unlock()
	}, nil
}

// pick returns the coordinator for inc: local for one node, the in-process job on rank 0, the
// rank-0 agent over gRPC otherwise.
func (c *clusterCoordinator) pick(ctx context.Context, inc tiers.Incarnation) (tiers.Coordinator, error) {
	cfg := inc.Config
	if cfg.Nodes == 1 {
		return c.local, nil
	}
	if cfg.NodeRank == 0 {
		return replication.LocalClient{Job: c.job}, nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if r, ok := c.remotes[cfg.JobName]; ok {
		return r, nil
	}
	secret, err := c.secrets.get(ctx, cfg.JobName)
	if err != nil {
		return nil, err
	}
	job := cfg.JobName
	r, err := replication.NewRemoteCoordinator(replication.RemoteCoordinatorConfig{
		Secret: secret, Instance: c.instance,
		Addr: func(ctx context.Context) (string, error) {
			regs, err := gcsbackend.Lookup(ctx, c.objects, job)
			if err != nil {
				return "", err
			}
			reg, ok := regs[0]
			if !ok {
				return "", errors.New("rank 0 has not registered yet")
			}
			return reg.Addr, nil
		},
	})
	if err != nil {
		return nil, err
	}
	c.remotes[job] = r
	return r, nil
}

func (c *clusterCoordinator) Negotiate(ctx context.Context, inc tiers.Incarnation, inv tiers.Inventory) (tiers.RestorePlan, error) {
	co, err := c.pick(ctx, inc)
	if err != nil {
		return tiers.RestorePlan{}, err
	}
	if cfg := inc.Config; cfg.Nodes > 1 {
		// Every agent of the job registers where it listens, for this incarnation. A rank that
		// reaches rank 0 before rank 0 started the incarnation is told to retry.
		if _, err := c.secrets.get(ctx, cfg.JobName); err != nil {
			return tiers.RestorePlan{}, err
		}
		reg := gcsbackend.Registration{Job: cfg.JobName, Incarnation: inc.ID, InstanceID: c.instance,
			Rank: cfg.NodeRank, Addr: c.addr, Updated: time.Now()}
		if err := gcsbackend.Register(ctx, c.objects, reg); err != nil {
			return tiers.RestorePlan{}, fmt.Errorf("register in %s: %w", c.objects, err)
		}
	}
	return co.Negotiate(ctx, inc, inv)
}

func (c *clusterCoordinator) Restored(ctx context.Context, inc tiers.Incarnation) error {
	co, err := c.pick(ctx, inc)
	if err != nil {
		return err
	}
	return co.Restored(ctx, inc)
}

func (c *clusterCoordinator) Sync(ctx context.Context, inc tiers.Incarnation, rep tiers.SyncReport) (tiers.SyncDecision, error) {
	co, err := c.pick(ctx, inc)
	if err != nil {
		return tiers.SyncDecision{}, err
	}
	return co.Sync(ctx, inc, rep)
}
