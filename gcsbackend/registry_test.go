package gcsbackend

import (
	"bytes"
	"context"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func testRegistration(rank int, incarnation, instance string) Registration {
	return Registration{
		Job: testJob, Incarnation: incarnation, InstanceID: instance, Rank: rank,
		Addr:    "10.0.0.1:4242",
		Updated: time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC),
	}
}

func TestRegistryRegisterAndLookup(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := newTestStore(t)

	regs, err := Lookup(ctx, s, testJob)
	require.NoError(t, err)
	assert.Empty(t, regs, "a job nobody registered")

	want := map[int]Registration{}
	for rank := range 3 {
		reg := testRegistration(rank, "inc-1", "agent-"+string(rune('a'+rank)))
		require.NoError(t, Register(ctx, s, reg))
		want[rank] = reg
	}
	// Files that are not registrations are skipped, not fatal.
	put(t, s, testJob+"/agents/07.json", `{"job":"llama-7b","rank":7}`) // not the canonical name
	put(t, s, testJob+"/agents/5.json", "not json")
	put(t, s, testJob+"/agents/6.json", `{"job":"llama-7b","rank":5,"incarnation":"i","instance":"x","addr":"h:1"}`) // wrong rank
	put(t, s, testJob+"/agents/README", "hello")
	put(t, s, "other-job/agents/0.json", `{}`)

	regs, err = Lookup(ctx, s, testJob)
	require.NoError(t, err)
	assert.Equal(t, want, regs)
}

func TestRegistrationFromOlderIncarnationIsSuperseded(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := newTestStore(t)
	stale := testRegistration(1, "inc-1", "killed-agent")
	require.NoError(t, Register(ctx, s, stale))

	fresh := testRegistration(1, "inc-2", "new-agent")
	fresh.Addr, fresh.Updated = "10.0.0.9:5555", stale.Updated.Add(time.Minute)
	require.NoError(t, Register(ctx, s, fresh))
	regs, err := Lookup(ctx, s, testJob)
	require.NoError(t, err)
	assert.Equal(t, map[int]Registration{1: fresh}, regs, "the newest registration of a rank replaces the older")

	// The old agent, shutting down late, must not remove its successor's registration.
	require.NoError(t, Unregister(ctx, s, stale))
	regs, err = Lookup(ctx, s, testJob)
	require.NoError(t, err)
	assert.Equal(t, map[int]Registration{1: fresh}, regs, "unregistering a superseded agent leaves the new one")

	require.NoError(t, Unregister(ctx, s, fresh))
	regs, err = Lookup(ctx, s, testJob)
	require.NoError(t, err)
	assert.Empty(t, regs)
	require.NoError(t, Unregister(ctx, s, fresh), "unregistering twice is harmless")
}

func TestRegistrationValidation(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := newTestStore(t)
	tests := []struct {
		name   string
		change func(*Registration)
		want   string
	}{
		{"job with a slash", func(r *Registration) { r.Job = "a/b" }, "want a single path segment"},
		{"negative rank", func(r *Registration) { r.Rank = -1 }, "rank -1"},
		{"no incarnation", func(r *Registration) { r.Incarnation = "" }, "incarnation and instance id are required"},
		{"no instance", func(r *Registration) { r.InstanceID = "" }, "incarnation and instance id are required"},
		{"no address", func(r *Registration) { r.Addr = "" }, "address is required"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reg := testRegistration(0, "inc", "agent")
			tt.change(&reg)
			assert.ErrorContains(t, Register(ctx, s, reg), tt.want)
		})
	}
	_, err := Lookup(ctx, s, "../x")
	assert.Error(t, err)

	// A zero Updated is stamped with the current time.
	reg := testRegistration(2, "inc", "agent")
	reg.Updated = time.Time{}
	before := time.Now().Add(-time.Second)
	require.NoError(t, Register(ctx, s, reg))
	regs, err := Lookup(ctx, s, testJob)
	require.NoError(t, err)
	assert.True(t, regs[2].Updated.After(before), "Updated %v is the registration time", regs[2].Updated)
}

func TestSecretEnsureConcurrent(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	// Agents on different machines: each has its own store on the shared location.
	const agents = 8
	secrets := make([][]byte, agents)
	errs := make([]error, agents)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range agents {
		s, err := Open(fileURL(dir))
		require.NoError(t, err)
		wg.Go(func() {
			<-start
			secrets[i], errs[i] = EnsureSecret(context.Background(), s, testJob)
		})
	}
	close(start)
	wg.Wait()
	for i := range agents {
		require.NoError(t, errs[i], "agent %d", i)
		assert.Len(t, secrets[i], SecretSize, "agent %d", i)
		assert.Equal(t, secrets[0], secrets[i], "agent %d got the winner's secret", i)
	}

	s, err := Open(fileURL(dir))
	require.NoError(t, err)
	again, err := EnsureSecret(t.Context(), s, testJob)
	require.NoError(t, err)
	assert.Equal(t, secrets[0], again, "an existing secret is kept")
	other, err := EnsureSecret(t.Context(), s, "other-job")
	require.NoError(t, err)
	assert.NotEqual(t, secrets[0], other, "each job has its own secret")

	fi, err := os.Stat(filepath.Join(dir, testJob, "secret"))
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o600), fi.Mode().Perm(), "the secret is private to the user")
}

func TestSecretTooShortIsRefused(t *testing.T) {
	t.Parallel()
	s := newTestStore(t)
	put(t, s, testJob+"/secret", "short")
	_, err := EnsureSecret(t.Context(), s, testJob)
	assert.ErrorContains(t, err, "has 5 bytes, want at least 16")
}

// lateWinner is a store in which another agent creates the secret between this agent's read
// (which finds nothing) and its create-if-absent write.
type lateWinner struct {
	ObjectStore
	winner []byte
	once   sync.Once
}

func (s *lateWinner) Open(ctx context.Context, name string, off, length int64) (io.ReadCloser, error) {
	var first bool
	s.once.Do(func() { first = true })
	if first {
		if err := PutBytes(ctx, s.ObjectStore, name, s.winner, true); err != nil {
			return nil, err
		}
		return nil, &NotFoundError{Name: name, Err: fs.ErrNotExist}
	}
	return s.ObjectStore.Open(ctx, name, off, length)
}

func TestSecretLostRaceReturnsWinners(t *testing.T) {
	t.Parallel()
	winner := bytes.Repeat([]byte{0xab}, SecretSize)
	s := &lateWinner{ObjectStore: newTestStore(t), winner: winner}
	got, err := EnsureSecret(t.Context(), s, testJob)
	require.NoError(t, err)
	assert.Equal(t, winner, got, "the agent that lost the create-if-absent race uses the winner's secret")
}
