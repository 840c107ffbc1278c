package tiers

import (
	"bytes"
	"encoding/json"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/mtcfs/mtcfs/internal/fusectl"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestSpoolsKeepFindFree: a spool on a plain directory (no tmpfs, no root needed) through its
// life: in use while open (free refuses), kept on release while it holds a checkpoint and its
// mount directory exists, described by Find, orphaned once the mount directory is gone, freed.
func TestSpoolsKeepFindFree(t *testing.T) {
	base := t.TempDir()
	mnt, dir := filepath.Join(base, "mnt"), filepath.Join(base, "spool")
	require.NoError(t, os.Mkdir(mnt, 0o755))
	var spools Spools // no running agents known: the lock tells what is in use
	var log bytes.Buffer
	logger := slog.New(slog.NewTextHandler(&log, nil))

	s, err := OpenSpool(SpoolConfig{Dir: dir, Budget: MinBudget, MountPath: mnt})
	require.NoError(t, err)
	found, err := spools.Find(dir, nil)
	require.NoError(t, err)
	require.Len(t, found, 1)
	assert.True(t, found[0].InUse, "an open spool is locked: in use")
	err = FreeSpool(found[0])
	require.ErrorContains(t, err, "is in use by")
	assert.ErrorContains(t, err, "stop that agent first")
	assert.DirExists(t, dir)

	require.NoError(t, os.MkdirAll(filepath.Join(dir, "meta"), 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "meta", "llama-s10-n0-w0.meta"), []byte("abc"), 0o600))
	// Every job's restore plan records its shape: a plain spool (an agent without root) holds
	// that file beside the owner record, and was then refused by FreeSpool as not a spool.
	require.NoError(t, s.SetShape(Shape{Nodes: 1, Workers: 1}))
	s.Release(logger)
	// A plain directory outside the default root: no discovery finds it once its agent is gone,
	// so the line names it, not the mount path (with which `spool free` found nothing).
	assert.Contains(t, log.String(), "free it with: mtcfs spool free "+dir+"\"", "a spool holding a checkpoint is kept")
	assert.DirExists(t, dir)

	found, err = spools.Find(dir, nil)
	require.NoError(t, err)
	require.Len(t, found, 1)
	info := found[0]
	assert.Equal(t, dir, info.Dir)
	assert.Equal(t, mnt, info.MountPath)
	assert.Equal(t, "llama", info.Job, "a spool without a recorded job: the .meta names tell")
	assert.Equal(t, []int64{10}, info.Steps)
	assert.Equal(t, []string{"llama-s10-n0-w0.meta"}, info.Metas)
	assert.False(t, info.InUse)
	assert.Equal(t, MountExists, info.MountState)
	assert.False(t, info.Orphaned())
	assert.Greater(t, info.Bytes, int64(3), "the .meta and the owner record")
	assert.Equal(t, "mount "+mnt+", job llama, 1 checkpoint(s), "+FormatSize(info.Bytes), info.Describe())
	_, err = spools.Find(mnt, nil)
	assert.ErrorContains(t, err, "no mtcfs spool found for "+mnt, "the mount path finds only spools recording it, or its default spool")
	found, err = spools.Find(mnt, []SpoolInfo{info})
	require.NoError(t, err)
	assert.Equal(t, []SpoolInfo{info}, found, "a listed spool recording the mount path")

	// A running agent registered with the spool makes it in use, whatever its lock says.
	// Dirs: ReapOrphaned looks at this test's spool only; on the whole machine it would free
	// other tests' orphaned spools (and a developer's).
	busy := Spools{Users: func() ([]SpoolUser, error) { return []SpoolUser{{PID: 4242, SpoolDir: dir}}, nil },
		Dirs: func() []string { return []string{dir} }}
	found, err = busy.Find(dir, nil)
	require.NoError(t, err)
	assert.True(t, found[0].InUse)
	assert.Equal(t, 4242, found[0].AgentPID)
	// Its mount directory gone, the spool is orphaned, but still in use: never reaped.
	require.NoError(t, os.Remove(mnt))
	found, err = busy.Find(dir, nil)
	require.NoError(t, err)
	assert.True(t, found[0].Orphaned() && found[0].InUse)
	busy.ReapOrphaned("", logger)
	assert.DirExists(t, dir, "a spool in use is never reaped")

	found, err = spools.Find(dir, nil)
	require.NoError(t, err)
	assert.Equal(t, MountGone, found[0].MountState)
	assert.True(t, found[0].Orphaned())
	require.NoError(t, FreeSpool(found[0]))
	assert.NoDirExists(t, dir)
}

// spoolWithStep opens a spool for a mount directory of its own, holding one step of job
// llama, as a running agent has it.
func spoolWithStep(t *testing.T) (s *Spool, mnt, dir string) {
	t.Helper()
	base := t.TempDir()
	mnt, dir = filepath.Join(base, "mnt"), filepath.Join(base, "spool")
	require.NoError(t, os.Mkdir(mnt, 0o755))
	s, err := OpenSpool(SpoolConfig{Dir: dir, Budget: MinBudget, MountPath: mnt})
	require.NoError(t, err)
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "meta"), 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "meta", "llama-s10-n0-w0.meta"), []byte("abc"), 0o600))
	return s, mnt, dir
}

// A spool whose mount directory is gone is freed on release even though it holds a checkpoint:
// no agent would ever adopt it.
func TestSpoolReleaseFreesOrphan(t *testing.T) {
	s, mnt, dir := spoolWithStep(t)
	require.NoError(t, os.Remove(mnt))
	var log bytes.Buffer
	s.Release(slog.New(slog.NewTextHandler(&log, nil)))
	assert.Contains(t, log.String(), "its mount directory is gone, so no agent would adopt them")
	assert.NoDirExists(t, dir)
}

// Only what looks exactly like a spool is ever removed.
func TestLooksLikeSpool(t *testing.T) {
	base := t.TempDir()
	mk := func(name string, files ...string) string {
		d := filepath.Join(base, name)
		require.NoError(t, os.Mkdir(d, 0o755))
		for _, f := range files {
			p := filepath.Join(d, f)
			if f[len(f)-1] == '/' {
				require.NoError(t, os.MkdirAll(p, 0o755))
			} else {
				require.NoError(t, os.WriteFile(p, []byte(`{"mount_path":"/elsewhere"}`), 0o644))
			}
		}
		return d
	}
	assert.True(t, looksLikeSpool(mk("spool", "files/", "meta/", "sealed/", OwnerFile)))
	assert.True(t, looksLikeSpool(mk("old", "files/")), "a spool made before owner records")
	assert.False(t, looksLikeSpool(mk("empty")), "no files/")
	assert.False(t, looksLikeSpool(mk("home", "files/", "notes.txt")), "a regular file besides the owner record")
	assert.True(t, looksLikeSpool(mk("planned", "files/", OwnerFile, ShapeFile, HeadroomFile)), "the shape record of a job's restore plan, the agent's headroom")
	assert.False(t, looksLikeSpool(mk("plainfiles", "files")), "files must be a directory")
	assert.False(t, looksLikeSpool(mk("plainmeta", "files/", "meta")), "so must meta")
	assert.False(t, looksLikeSpool(filepath.Join(base, "missing")))
	self := mk("self", "files/")
	require.NoError(t, os.WriteFile(filepath.Join(self, OwnerFile), []byte(`{"mount_path":"`+self+`"}`), 0o644))
	assert.False(t, looksLikeSpool(self), "an owner record naming the directory itself as its mount")
}

func TestSpoolHelpers(t *testing.T) {
	base := t.TempDir()
	file := filepath.Join(base, "f")
	require.NoError(t, os.WriteFile(file, nil, 0o644))
	for p, want := range map[string]string{
		base:                            MountExists,
		file:                            MountNotDir,
		filepath.Join(base, "missing"):  MountGone,
		filepath.Join(file, "under"):    MountGone, // ENOTDIR
		filepath.Join(base, "a", "b/c"): MountGone,
	} {
		assert.Equal(t, want, mountPathState(p, readMounts()), "%s", p)
	}
	for in, want := range map[string]string{
		`/mnt/a\040b`:     "/mnt/a b",
		`/plain`:          "/plain",
		`/tab\011x\134y`:  "/tab\tx\\y",
		`/not\9escape\04`: `/not\9escape\04`,
	} {
		assert.Equal(t, want, fusectl.UnescapePath(in), "%s", in)
	}
	assert.Equal(t, "/ckpt/run-1", shellQuote("/ckpt/run-1"))
	assert.Equal(t, `'/ckpt/it'\''s here'`, shellQuote("/ckpt/it's here"))
	assert.Equal(t, "''", shellQuote(""))

	// Hard-linked files count once.
	require.NoError(t, os.WriteFile(filepath.Join(base, "data"), make([]byte, 1000), 0o644))
	require.NoError(t, os.Link(filepath.Join(base, "data"), filepath.Join(base, "link")))
	assert.Equal(t, int64(1000), distinctFileBytes(base))
}

// TestExitingStatus: a zombie, a dead process, or one with SIGKILL pending (for the process or
// its main thread) is exiting; a stopped or running one with other signals pending is not.
func TestExitingStatus(t *testing.T) {
	status := func(state, sigPnd, shdPnd string) string {
		return "Name:\tmtcfs\nState:\t" + state + "\nTgid:\t42\nSigPnd:\t" + sigPnd + "\nShdPnd:\t" + shdPnd + "\nSigBlk:\t0000000000000000\n"
	}
	for _, c := range []struct {
		state, sigPnd, shdPnd string
		want                  bool
	}{
		{"S (sleeping)", "0000000000000000", "0000000000000000", false},
		{"T (stopped)", "0000000000000000", "0000000000040000", false}, // SIGCONT pending
		{"Z (zombie)", "0000000000000000", "0000000000000000", true},
		{"X (dead)", "0000000000000000", "0000000000000000", true},
		{"D (disk sleep)", "0000000000000000", "0000000000000100", true}, // SIGKILL, whole process
		{"S (sleeping)", "0000000000000100", "0000000000000000", true},   // SIGKILL, main thread
		{"S (sleeping)", "0000000000000080", "0000000000000200", false},  // SIGSEGV, SIGUSR1
	} {
		assert.Equal(t, c.want, exitingStatus(status(c.state, c.sigPnd, c.shdPnd)), "%+v", c)
	}
}

// An orphaned kept spool used moments ago is kept at an agent's start, and reaped by that
// agent once it is due, not at some later start: its RAM is not held meanwhile.
func TestOrphanReapedOnceDue(t *testing.T) {
	s, mnt, dir := spoolWithStep(t)
	var log bytes.Buffer
	logger := slog.New(slog.NewTextHandler(&log, nil))
	s.Release(logger)
	require.DirExists(t, dir, "a spool holding a checkpoint is kept")
	require.NoError(t, os.Remove(mnt))

	// Last used a moment less than the grace ago.
	used := time.Now().Add(-ReapGrace + 2*time.Second)
	p := filepath.Join(dir, OwnerFile)
	data, err := os.ReadFile(p)
	require.NoError(t, err)
	var rec map[string]any
	require.NoError(t, json.Unmarshal(data, &rec))
	rec["last_used"] = used.UTC().Format(time.RFC3339Nano)
	data, err = json.Marshal(rec)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(p, data, 0o600))
	for _, d := range []string{dir, filepath.Join(dir, "files"), filepath.Join(dir, "meta")} {
		if _, err := os.Stat(d); err == nil {
			require.NoError(t, os.Chtimes(d, used, used))
		}
	}

	h := Spools{Dirs: func() []string { return []string{dir} }}
	again := h.ReapOrphaned("", logger)
	require.DirExists(t, dir, "an orphan used less than the grace ago is kept")
	require.Greater(t, again, time.Duration(0))
	require.LessOrEqual(t, again, 4*time.Second)
	h.ReapOrphanedLater(t.Context(), "", again, logger)
	assert.NoDirExists(t, dir, "the orphan is reaped once due\n%s", log.String())
}

// TestOrphanedOrOf: the spools of a mount directory are listed with the orphaned ones, but the
// asking agent's own spool is not inspected (without a tmpfs that walks all its files, at every
// restore: a review); Orphaned lists only those whose mount directory is gone.
func TestOrphanedOrOf(t *testing.T) {
	s1, mnt, dir1 := spoolWithStep(t)
	require.NoError(t, s1.Detach())
	dir2 := filepath.Join(t.TempDir(), "spool")
	s2, err := OpenSpool(SpoolConfig{Dir: dir2, Budget: MinBudget, MountPath: mnt})
	require.NoError(t, err)
	t.Cleanup(func() { s2.Detach() })
	spools := Spools{Users: func() ([]SpoolUser, error) { return nil, nil }, Dirs: func() []string { return []string{dir1, dir2} }}
	dirs := func(found []SpoolInfo, err error) []string {
		require.NoError(t, err)
		var out []string
		for _, s := range found {
			out = append(out, s.Dir)
		}
		return out
	}
	assert.Equal(t, []string{dir1}, dirs(spools.OrphanedOrOf(ResolveMountPath(mnt), dir2)), "the other spool of the mount, not the agent's own")
	assert.Empty(t, dirs(spools.Orphaned()), "the mount directory exists")
	require.NoError(t, os.Remove(mnt))
	assert.ElementsMatch(t, []string{dir1, dir2}, dirs(spools.Orphaned()), "the mount directory is gone")
}

// TestKeptSpoolListsStepsCommittedNotSealed: steps the job committed while the agent stopped are
// recorded, not sealed (the next agent seals them); the spool's listing names them too. It named
// the sealed steps only: a stop under a job saving on listed 5 where 6 to 14 were kept, and
// `spool free` said 5 alone was lost (found by a black-box run).
func TestKeptSpoolListsStepsCommittedNotSealed(t *testing.T) {
	s, _, dir := spoolWithStep(t)
	rec := filepath.Join(dir, commitsDir, "r1")
	require.NoError(t, os.MkdirAll(rec, 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(rec, commitRecordName), []byte(`{"job":"llama","incarnation":"i","rank":0,"worker":0,"step":12,"name":"12"}`), 0o600))
	s.Release(slog.New(slog.NewTextHandler(io.Discard, nil)))
	var spools Spools
	found, err := spools.Find(dir, nil)
	require.NoError(t, err)
	require.Len(t, found, 1)
	assert.Equal(t, []int64{10, 12}, found[0].Steps)
	assert.Equal(t, "llama", found[0].Job)
	require.NoError(t, FreeSpool(found[0]))
}
