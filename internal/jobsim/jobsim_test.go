package jobsim

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// testFileSize spans two write/read chunks and ends unaligned.
const testFileSize = ioChunk + 4099

func testOrbax(t *testing.T, dir string) *Orbax {
	return &Orbax{
		Dir: dir, Job: "llama", Rank: 0, Nodes: 1,
		BackupIntervalMinutes: 0.05,
		Poll:                  5 * time.Millisecond, Timeout: 5 * time.Second,
		Content: Content{Files: 2, FileSize: testFileSize},
		Logf:    t.Logf,
	}
}

func testNeMo(t *testing.T, dir string) *NeMo {
	return &NeMo{
		Dir: dir, Job: "gpt", Rank: 0, Nodes: 1,
		Poll: 5 * time.Millisecond, Timeout: 5 * time.Second,
		Content: Content{Files: 2, FileSize: testFileSize},
		Logf:    t.Logf,
	}
}

func waitSealed(t *testing.T, a *fakeAgent, step int64) {
	t.Helper()
	require.Eventually(t, func() bool { return a.isSealed(step) }, 5*time.Second, 2*time.Millisecond,
		"fake agent never sealed step %d", step)
}

// savedAndRestarted runs a fresh Orbax job that saves steps 0, 10 and 20, then a restarted one
// that restores step 20.
func savedAndRestarted(t *testing.T, dir string, a *fakeAgent) *Orbax {
	t.Helper()
	ctx := context.Background()
	o := testOrbax(t, dir)
	step, found, err := o.Start(ctx)
	require.NoError(t, err)
	require.False(t, found, "fresh start restored step %d", step)
	for _, s := range []int64{0, 10, 20} {
		require.NoError(t, o.Save(ctx, s))
	}
	waitSealed(t, a, 20)

	o = testOrbax(t, dir)
	step, found, err = o.Start(ctx)
	require.NoError(t, err)
	require.True(t, found, "restart restored nothing")
	require.EqualValues(t, 20, step)
	return o
}

func TestOrbaxFreshStartSaveRestartRestore(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	const errLine = "2026-01-01T00:00:00Z job=llama node=0/1 ERR unknown key \"x\""
	a := startFakeAgent(t, dir, func(a *fakeAgent) { a.errorsLine = errLine })

	o := savedAndRestarted(t, dir, a)
	assert.Equal(t, []string{errLine}, o.Errors(), "replicator.errors lines")
	assert.NoFileExists(t, filepath.Join(dir, errorsName), "client must unlink replicator.errors")

	fi, err := os.Lstat(filepath.Join(dir, "20"))
	require.NoError(t, err)
	assert.Equal(t, os.ModeSymlink, fi.Mode().Type(), "the marker symlink itself must become 20")
	require.NoError(t, o.VerifyRestored(ctx, 20))

	yamls := a.consumedYAMLs()
	require.Len(t, yamls, 2)
	assert.Equal(t, "job-name: llama\nframework: orbax\nnode-rank: 0\nnodes: 1\npeer-ranks: []\nbackup-interval-minutes: 0.05", yamls[1])

	// The restored job saves on, and the next restart restores the newer step.
	require.NoError(t, o.Save(ctx, 30))
	waitSealed(t, a, 30)
	o = testOrbax(t, dir)
	step, found, err := o.Start(ctx)
	require.NoError(t, err)
	require.True(t, found)
	require.EqualValues(t, 30, step)
	require.NoError(t, o.VerifyRestored(ctx, 30))
}

func TestOrbaxVerifyRestoredNamesCorruptByte(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	a := startFakeAgent(t, dir, nil)
	o := savedAndRestarted(t, dir, a)

	tree := o.Tree(20)
	victim := tree[len(tree)-2] // the last data file (the item's commit_success.txt is last)
	require.Equal(t, testFileSize, int(victim.Size))
	const off = ioChunk + 7
	p := filepath.Join(dir, "20", filepath.FromSlash(victim.Path))
	f, err := os.OpenFile(p, os.O_RDWR, 0)
	require.NoError(t, err)
	b := make([]byte, 1)
	_, err = f.ReadAt(b, off)
	require.NoError(t, err)
	b[0] ^= 0x40
	_, err = f.WriteAt(b, off)
	require.NoError(t, err)
	require.NoError(t, f.Close())

	err = o.VerifyRestored(ctx, 20)
	var mm *MismatchError
	require.ErrorAs(t, err, &mm)
	assert.Equal(t, "20/"+victim.Path, mm.File)
	assert.EqualValues(t, off, mm.Offset)
	assert.Equal(t, mm.Want^0x40, mm.Got)
	assert.Equal(t, "sequential read", mm.Read)
	assert.Contains(t, err.Error(), victim.Path)
	assert.Contains(t, err.Error(), "offset 1048583")
}

func TestOrbaxVerifyRestoredNamesMissingFile(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	a := startFakeAgent(t, dir, nil)
	o := savedAndRestarted(t, dir, a)
	require.NoError(t, os.Remove(filepath.Join(dir, "20", "state", "manifest.ocdbt")))
	err := o.VerifyRestored(ctx, 20)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "missing state/manifest.ocdbt")
}

func TestOrbaxStartRejectsBadMarkerName(t *testing.T) {
	dir := t.TempDir()
	startFakeAgent(t, dir, func(a *fakeAgent) { a.markerName = "llama-step20.restore" })
	_, _, err := testOrbax(t, dir).Start(context.Background())
	require.Error(t, err)
	assert.Contains(t, err.Error(), `unexpected restore artifact name "llama-step20.restore"`)
}

func TestOrbaxStartFailsOnReplicatorFailed(t *testing.T) {
	dir := t.TempDir()
	const line = "2026-01-01T00:00:00Z job=llama node=0/1 FATAL nodes: must be at least 1, got 0"
	startFakeAgent(t, dir, func(a *fakeAgent) { a.failedLine = line })
	_, _, err := testOrbax(t, dir).Start(context.Background())
	var fatal *FatalError
	require.ErrorAs(t, err, &fatal)
	assert.Equal(t, []string{line}, fatal.Lines)
	assert.Contains(t, err.Error(), line)
	assert.NoFileExists(t, filepath.Join(dir, failedName), "client must unlink replicator.failed")
}

func TestOrbaxStartWaitsAreBounded(t *testing.T) {
	cases := []struct {
		name    string
		prepare func(dir string) // the directory as the missing agent left it
		jaxInit bool
		cancel  bool
		wantIs  error
		wantMsg string
	}{
		{name: "yaml never consumed", prepare: func(dir string) {
			os.WriteFile(filepath.Join(dir, yamlName), []byte("job-name: old"), 0o644)
		}, wantIs: ErrTimeout, wantMsg: "replicator.yaml to disappear"},
		{name: "no jax init info", jaxInit: true, wantIs: ErrTimeout, wantMsg: jaxInitName},
		{name: "context cancelled", prepare: func(dir string) {
			os.WriteFile(filepath.Join(dir, yamlName), []byte("job-name: old"), 0o644)
		}, cancel: true, wantIs: context.Canceled, wantMsg: "replicator.yaml"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			if tc.prepare != nil {
				tc.prepare(dir)
			}
			o := testOrbax(t, dir)
			o.Timeout, o.WaitJaxInitInfo = 30*time.Millisecond, tc.jaxInit
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if tc.cancel {
				o.Timeout = time.Minute
				time.AfterFunc(20*time.Millisecond, cancel)
			}
			start := time.Now()
			_, _, err := o.Start(ctx)
			require.ErrorIs(t, err, tc.wantIs)
			assert.Contains(t, err.Error(), tc.wantMsg)
			assert.Less(t, time.Since(start), 5*time.Second)
		})
	}
}

func TestOrbaxStartReadsJaxInitInfo(t *testing.T) {
	dir := t.TempDir()
	a := startFakeAgent(t, dir, nil)
	require.NoError(t, os.WriteFile(filepath.Join(dir, jaxInitName), []byte("3\n10.0.0.1:8476\n"), 0o644))
	o := testOrbax(t, dir)
	o.Nodes, o.WaitJaxInitInfo = 4, true
	_, found, err := o.Start(context.Background())
	require.NoError(t, err)
	assert.False(t, found)
	assert.Equal(t, 3, o.Rank)
	assert.Equal(t, "10.0.0.1:8476", o.Coordinator)
	assert.Contains(t, a.consumedYAMLs()[0], "\nnode-rank: 3\n")
}

func TestOrbaxYAML(t *testing.T) {
	cases := []struct {
		name string
		o    Orbax
		want string
	}{
		{"single slice defaults", Orbax{Job: "j", Rank: 0, Nodes: 1},
			"job-name: j\nframework: orbax\nnode-rank: 0\nnodes: 1\npeer-ranks: []\nbackup-interval-minutes: 30"},
		{"peers, data parallelism, fractional minutes, extra keys",
			Orbax{Job: "j", Rank: 1, Nodes: 32, PeerRanks: []int{17, 9}, DataParallelism: 2, BackupIntervalMinutes: 1.0 / 60, ExtraYAML: []string{"workers-per-node: 1 "}},
			"job-name: j\nframework: orbax\nassume-data-parallelism: 2\nnode-rank: 1\nnodes: 32\npeer-ranks: [17, 9]\nbackup-interval-minutes: 0.016666666666666666\nworkers-per-node: 1"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) { assert.Equal(t, tc.want, tc.o.YAML()) })
	}
}

func TestOrbaxSaveLayoutAndColumnMateRestore(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	// A leftover of an interrupted save of the same step is removed first.
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "5"+orbaxTmpSuffix, "state"), 0o755))
	writer := &Orbax{Dir: dir, Job: "j", Rank: 2, Nodes: 4, DataParallelism: 2, Content: Content{Files: 2, FileSize: 1000}}
	require.NoError(t, writer.Save(ctx, 5))
	assert.NoDirExists(t, filepath.Join(dir, "5"+orbaxTmpSuffix))
	got, err := listTree(filepath.Join(dir, "5"))
	require.NoError(t, err)
	var want []string
	for _, f := range writer.Tree(5) {
		want = append(want, f.Path)
		assert.EqualValues(t, f.Size, got[f.Path], f.Path)
	}
	assert.Len(t, got, len(want))
	assert.Contains(t, want, "state/ocdbt.process_2/manifest.ocdbt")
	meta, err := os.ReadFile(filepath.Join(dir, "5", checkpointMetadataName))
	require.NoError(t, err)
	assert.NotContains(t, string(meta), "null", "the final metadata carries the commit time")

	for _, tc := range []struct {
		rank, dp int
		ok       bool
	}{
		{rank: 2, ok: true},
		{rank: 0, dp: 2, ok: true}, // column-mate: 0 ≡ 2 mod 4/2
		{rank: 1, dp: 2, ok: false},
		{rank: 0, dp: 0, ok: false},
	} {
		reader := &Orbax{Dir: dir, Job: "j", Rank: tc.rank, Nodes: 4, DataParallelism: tc.dp, Content: writer.Content}
		err := reader.VerifyRestored(ctx, 5)
		if tc.ok {
			assert.NoError(t, err, "rank %d dp %d", tc.rank, tc.dp)
		} else {
			assert.ErrorContains(t, err, "holds the data of rank 2", "rank %d dp %d", tc.rank, tc.dp)
		}
	}
	assert.ErrorContains(t, writer.VerifyRestored(ctx, 6), "step 6 is not among the step directories [5]")
}

func TestNeMoSaveRestartRestore(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	a := startFakeAgent(t, dir, nil)
	n := testNeMo(t, dir)
	require.NoError(t, n.Handshake(ctx))
	step, found, err := n.Restore(ctx)
	require.NoError(t, err)
	require.False(t, found, "fresh start restored step %d", step)
	assert.FileExists(t, filepath.Join(dir, "gpt-s0-n0-w0.restore"), "NeMo leaves the s0 marker")

	for _, gs := range []int64{5, 11} {
		require.NoError(t, n.Save(ctx, gs))
		assert.NoFileExists(t, filepath.Join(dir, "step="+itoa(gs)+"-unfinished"))
	}
	waitSealed(t, a, 10) // global step 11 commits step 10

	n = testNeMo(t, dir)
	require.NoError(t, n.Handshake(ctx))
	step, found, err = n.Restore(ctx)
	require.NoError(t, err)
	require.True(t, found)
	require.EqualValues(t, 10, step)
	require.NoError(t, n.VerifyRestored(ctx, 10))

	yamls := a.consumedYAMLs()
	require.Len(t, yamls, 2)
	assert.Equal(t, "job-name: gpt\nframework: pytorch.distributed\nnode-rank: 0\nnodes: 1\npeers-per-node: 1\nbackup-interval-minutes: 30\n", yamls[1])
}

func TestNeMoRestoreRequiresPrerestore(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	startFakeAgent(t, dir, func(a *fakeAgent) { a.noPrerestore = true })
	n := testNeMo(t, dir)
	require.NoError(t, n.Handshake(ctx))
	// The short timeout is for the prerestore only: the fake agent takes the yaml in first.
	require.Eventually(t, func() bool {
		_, err := os.Stat(filepath.Join(dir, yamlName))
		return errors.Is(err, fs.ErrNotExist)
	}, 10*time.Second, 5*time.Millisecond, "the fake agent consumes the yaml")
	n.Timeout = 100 * time.Millisecond
	_, _, err := n.Restore(ctx)
	require.ErrorIs(t, err, ErrTimeout)
	assert.Contains(t, err.Error(), "waiting for replicator.prerestore")
}

func TestNeMoYAMLQuotesAndFractions(t *testing.T) {
	n := &NeMo{Job: "123", Rank: 2, Nodes: 4, PeersPerNode: 2, BackupIntervalMinutes: 0.5}
	assert.Equal(t, "job-name: \"123\"\nframework: pytorch.distributed\nnode-rank: 2\nnodes: 4\npeers-per-node: 2\nbackup-interval-minutes: 0.5\n", n.YAML())
}

func TestContentIsRandomAccess(t *testing.T) {
	f := generatedFile("j", 1, 7, "state/x", 10_000)
	full := make([]byte, f.Size)
	f.fill(full, 0)
	for _, r := range [][2]int{{0, 1}, {1, 7}, {7, 9}, {8, 8}, {13, 4000}, {9990, 10}} {
		p := make([]byte, r[1])
		f.fill(p, int64(r[0]))
		assert.Equal(t, full[r[0]:r[0]+r[1]], p, "range %v", r)
	}
	other := make([]byte, f.Size)
	generatedFile("j", 2, 7, "state/x", 10_000).fill(other, 0)
	assert.NotEqual(t, full, other, "another rank must get other bytes")
	assert.False(t, strings.Contains(string(full), strings.Repeat("\x00", 16)), "bytes look random")
}

func TestErrorsWithoutDir(t *testing.T) {
	_, _, err := (&Orbax{}).Start(context.Background())
	assert.ErrorContains(t, err, "Dir is empty")
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }
