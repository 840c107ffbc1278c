package replication

import (
	"bytes"
	"context"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mtcfs/mtcfs/gcsbackend"
	"github.com/mtcfs/mtcfs/internal/syncbuf"
)

// dirObjects is a backup location on a local directory, as the agent opens a file:// --backup.
func dirObjects(t *testing.T, dir string) Objects {
	t.Helper()
	store, err := gcsbackend.Open("file://" + dir)
	require.NoError(t, err)
	return gcsbackend.SmallObjects{Store: store}
}

func testRegistration(rank int, incarnation, instance string) Registration {
	return Registration{
		Job: testJob, Incarnation: incarnation, InstanceID: instance, Rank: rank,
		Addr:    "10.0.0.1:4242",
		Updated: time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC),
	}
}

func putObject(t *testing.T, o Objects, name, content string) {
	t.Helper()
	require.NoError(t, o.Put(t.Context(), name, []byte(content)), "put %s", name)
}

func TestRegistryRegisterAndLookup(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	o := dirObjects(t, t.TempDir())
	r := Registry{Objects: o}

	regs, err := r.Lookup(ctx, testJob)
	require.NoError(t, err)
	assert.Empty(t, regs, "a job nobody registered")

	want := map[int]Registration{}
	for rank := range 3 {
		reg := testRegistration(rank, "inc-1", "agent-"+string(rune('a'+rank)))
		require.NoError(t, r.Register(ctx, reg))
		want[rank] = reg
	}
	// Files that are not registrations are skipped, not fatal.
	putObject(t, o, testJob+"/agents/07.json", fmt.Sprintf(`{"job":%q,"rank":7}`, testJob)) // not the canonical name
	putObject(t, o, testJob+"/agents/5.json", "not json")
	putObject(t, o, testJob+"/agents/6.json", fmt.Sprintf(`{"job":%q,"rank":5,"incarnation":"i","instance":"x","addr":"h:1"}`, testJob)) // wrong rank
	putObject(t, o, testJob+"/agents/README", "hello")
	putObject(t, o, "other-job/agents/0.json", `{}`)

	regs, err = r.Lookup(ctx, testJob)
	require.NoError(t, err)
	assert.Equal(t, want, regs)

	p, err := r.Find(ctx, testJob, 1)
	require.NoError(t, err)
	assert.Equal(t, Peer{Addr: want[1].Addr, Instance: want[1].InstanceID}, p, "Find gives the address and the instance to confirm")
	_, err = r.Find(ctx, testJob, 3)
	assert.ErrorContains(t, err, "rank 3 of job "+testJob+" has not registered")
}

func TestRegistrationFromOlderIncarnationIsSuperseded(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	r := Registry{Objects: dirObjects(t, t.TempDir())}
	stale := testRegistration(1, "inc-1", "killed-agent")
	require.NoError(t, r.Register(ctx, stale))

	fresh := testRegistration(1, "inc-2", "new-agent")
	fresh.Addr, fresh.Updated = "10.0.0.9:5555", stale.Updated.Add(time.Minute)
	require.NoError(t, r.Register(ctx, fresh))
	regs, err := r.Lookup(ctx, testJob)
	require.NoError(t, err)
	assert.Equal(t, map[int]Registration{1: fresh}, regs, "the newest registration of a rank replaces the older")

	// The old agent, shutting down late, must not remove its successor's registration.
	require.NoError(t, r.Unregister(ctx, stale))
	regs, err = r.Lookup(ctx, testJob)
	require.NoError(t, err)
	assert.Equal(t, map[int]Registration{1: fresh}, regs, "unregistering a superseded agent leaves the new one")

	require.NoError(t, r.Unregister(ctx, fresh))
	regs, err = r.Lookup(ctx, testJob)
	require.NoError(t, err)
	assert.Empty(t, regs)
	require.NoError(t, r.Unregister(ctx, fresh), "unregistering twice is harmless")
}

func TestRegistrationValidation(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	r := Registry{Objects: dirObjects(t, t.TempDir())}
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
			assert.ErrorContains(t, r.Register(ctx, reg), tt.want)
		})
	}
	_, err := r.Lookup(ctx, "../x")
	assert.Error(t, err)

	// A zero Updated is stamped with the current time.
	reg := testRegistration(2, "inc", "agent")
	reg.Updated = time.Time{}
	before := time.Now().Add(-time.Second)
	require.NoError(t, r.Register(ctx, reg))
	regs, err := r.Lookup(ctx, testJob)
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
		o := dirObjects(t, dir)
		wg.Go(func() {
			<-start
			secrets[i], errs[i] = EnsureSecret(context.Background(), o, testJob)
		})
	}
	close(start)
	wg.Wait()
	for i := range agents {
		require.NoError(t, errs[i], "agent %d", i)
		assert.Len(t, secrets[i], SecretSize, "agent %d", i)
		assert.Equal(t, secrets[0], secrets[i], "agent %d got the winner's secret", i)
	}

	o := dirObjects(t, dir)
	again, err := EnsureSecret(t.Context(), o, testJob)
	require.NoError(t, err)
	assert.Equal(t, secrets[0], again, "an existing secret is kept")
	other, err := EnsureSecret(t.Context(), o, "other-job")
	require.NoError(t, err)
	assert.NotEqual(t, secrets[0], other, "each job has its own secret")

	fi, err := os.Stat(filepath.Join(dir, testJob, "secret"))
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o600), fi.Mode().Perm(), "the secret is private to the user")
}

func TestSecretTooShortIsRefused(t *testing.T) {
	t.Parallel()
	o := dirObjects(t, t.TempDir())
	putObject(t, o, testJob+"/secret", "short")
	_, err := EnsureSecret(t.Context(), o, testJob)
	assert.ErrorContains(t, err, "has 5 bytes, want at least 16")
}

// lateWinner is a location in which another agent creates the secret between this agent's read
// (which finds nothing) and its create-if-absent write.
type lateWinner struct {
	Objects
	winner []byte
	once   sync.Once
}

func (o *lateWinner) Get(ctx context.Context, name string, limit int64) ([]byte, error) {
	var first bool
	o.once.Do(func() { first = true })
	if first {
		if err := o.Objects.PutIfAbsent(ctx, name, o.winner); err != nil {
			return nil, err
		}
		return nil, &fs.PathError{Op: "get", Path: name, Err: fs.ErrNotExist}
	}
	return o.Objects.Get(ctx, name, limit)
}

func TestSecretLostRaceReturnsWinners(t *testing.T) {
	t.Parallel()
	winner := bytes.Repeat([]byte{0xab}, SecretSize)
	o := &lateWinner{Objects: dirObjects(t, t.TempDir()), winner: winner}
	got, err := EnsureSecret(t.Context(), o, testJob)
	require.NoError(t, err)
	assert.Equal(t, winner, got, "the agent that lost the create-if-absent race uses the winner's secret")
}

// TestSmallObjectsErrors: gcsbackend.SmallObjects reports a missing object as fs.ErrNotExist and
// a create-if-absent over other content as fs.ErrExist, which is all the registry and
// EnsureSecret tell apart.
func TestSmallObjectsErrors(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	o := dirObjects(t, t.TempDir())
	_, err := o.Get(ctx, "a/b", 10)
	assert.ErrorIs(t, err, fs.ErrNotExist)
	assert.ErrorIs(t, o.Delete(ctx, "a/b"), fs.ErrNotExist)
	require.NoError(t, o.PutIfAbsent(ctx, "a/b", []byte("one")))
	require.NoError(t, o.PutIfAbsent(ctx, "a/b", []byte("one")), "the same content again is a retry")
	assert.ErrorIs(t, o.PutIfAbsent(ctx, "a/b", []byte("two")), fs.ErrExist)
	_, err = o.Get(ctx, "a/b", 2)
	assert.ErrorContains(t, err, "larger than 2 bytes")
	putObject(t, o, "a/c/d", "deeper")
	names, err := o.List(ctx, "a/")
	require.NoError(t, err)
	assert.Equal(t, []string{"a/b"}, names, "only the objects directly below the prefix")
}

// TestSecretGoneIsPutBackAndANewOneIsTaken: an agent checks the job's secret against the backup
// location now and then. One deleted there (by hand, or by a lifecycle rule on old objects) is
// put back, so that an agent started afterwards does not make another; one made anew meanwhile
// is taken, so that the agents come to agree. Before, each agent kept the secret it read at its
// start, and after the secret was deleted every restart of the job failed on a wrong MAC until
// every agent was restarted (a black-box run).
func TestSecretGoneIsPutBackAndANewOneIsTaken(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	o := dirObjects(t, dir)
	var logs syncbuf.Buffer
	s := &jobSecrets{objects: o, log: slog.New(slog.NewTextHandler(&logs, nil)), recheck: 0,
		byJob: map[string][]byte{}, checked: map[string]time.Time{}}
	first, err := s.get(t.Context(), testJob)
	require.NoError(t, err)

	require.NoError(t, o.Delete(t.Context(), testJob+"/secret"))
	again, err := s.get(t.Context(), testJob) // in use; the check puts it back
	require.NoError(t, err)
	require.Equal(t, first, again)
	s.checks.Wait()
	stored, err := o.Get(t.Context(), testJob+"/secret", 1<<10)
	require.NoError(t, err)
	require.Equal(t, first, stored, "the secret in use is put back")
	require.Contains(t, logs.String(), "the job's peer secret was gone from the backup location: put back")

	// Made anew by an agent started while it was gone.
	require.NoError(t, o.Delete(t.Context(), testJob+"/secret"))
	other, err := EnsureSecret(t.Context(), o, testJob)
	require.NoError(t, err)
	require.NotEqual(t, first, other)
	_, err = s.get(t.Context(), testJob)
	require.NoError(t, err)
	s.checks.Wait()
	now, err := s.get(t.Context(), testJob)
	require.NoError(t, err)
	require.Equal(t, other, now, "the secret in the location is taken")
	require.Contains(t, logs.String(), "this agent uses it from now on")
	s.checks.Wait()
}
