package main

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mtcfs/mtcfs/internal/jobsim"
)

// compressedStep is an Orbax step whose arrays are the weights and Adam moments of a real
// training run (planecodec/testdata), in bf16 and fp32, plus its metadata.
func compressedStep(t *testing.T) map[string][]byte {
	t.Helper()
	read := func(name string, times int) []byte {
		b, err := os.ReadFile(filepath.Join("..", "..", "planecodec", "testdata", name))
		require.NoError(t, err)
		return bytes.Repeat(b, times)
	}
	return map[string][]byte{
		"_CHECKPOINT_METADATA":                 []byte(`{"item_handlers": {"state": "PyTreeCheckpointHandler"}}`),
		"state/_METADATA":                      []byte(`{"tree_metadata": {}}`),
		"state/d/weights_bf16":                 read("weights_bf16.bin", 8),
		"state/d/adam_m_bf16":                  read("adam_m_bf16.bin", 2),
		"state/d/adam_v_bf16":                  read("adam_v_bf16.bin", 2),
		"state/d/weights_fp32":                 read("weights_fp32.bin", 1),
		"state/ocdbt.process_0/manifest.ocdbt": []byte("ocdbt"),
	}
}

// saveRawStep commits step as Orbax does (a temporary directory renamed to the step number),
// with the given files.
func saveRawStep(t *testing.T, dir string, step int64, files map[string][]byte) {
	t.Helper()
	tmp := filepath.Join(dir, fmt.Sprintf("%d.orbax-checkpoint-tmp-1234", step))
	for rel, content := range files {
		p := filepath.Join(tmp, filepath.FromSlash(rel))
		require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
		require.NoError(t, os.WriteFile(p, content, 0o644))
	}
	require.NoError(t, os.Rename(tmp, filepath.Join(dir, fmt.Sprint(step))))
}

func requireFiles(t *testing.T, want map[string][]byte, root string) {
	t.Helper()
	for rel, content := range want {
		got, err := os.ReadFile(filepath.Join(root, filepath.FromSlash(rel)))
		require.NoError(t, err)
		require.True(t, bytes.Equal(content, got), "%s differs below %s (%d bytes, want %d)", rel, root, len(got), len(content))
	}
}

// TestCompressedBackupEndToEnd: an agent with --backup-compress auto backs up a step of bf16 and
// fp32 tensors compressed (a v3 manifest, smaller objects); mtcfs backups verify checks it,
// mtcfs backups export gives the plain files back, and after the node loses its RAM the step
// restores from the compressed backup byte for byte.
func TestCompressedBackupEndToEnd(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	n := newRepNode(t)
	n.args = []string{"--backup-compress", "auto"}
	const job = "cjob"
	a := n.start(t)

	o := orbaxClient(t, n.dir, job, fastBackupMinutes)
	_, found, err := o.Start(ctx)
	require.NoError(t, err)
	require.False(t, found)
	files := compressedStep(t)
	saveRawStep(t, n.dir, 10, files)
	name := waitCompleteBackup(t, n, job, 10)

	// The backup holds the arrays compressed.
	bdir := filepath.Join(n.backupRoot, job, name)
	manifests, err := filepath.Glob(filepath.Join(bdir, "D*.data.manifest"))
	require.NoError(t, err)
	require.Len(t, manifests, 1, "in %s", bdir)
	m, err := os.ReadFile(manifests[0])
	require.NoError(t, err)
	assert.Contains(t, string(m), `"format":"mtcfs-manifest-v3"`)
	assert.Contains(t, string(m), `"codec":"planecodec"`)
	data := strings.TrimSuffix(manifests[0], ".manifest")
	fi, err := os.Stat(filepath.Join(data, "state", "d", "weights_bf16"))
	require.NoError(t, err)
	assert.Less(t, float64(fi.Size()), 0.75*float64(len(files["state/d/weights_bf16"])), "stored size of the bf16 weights")

	out, code := runMtcfs(t, "backups", "verify", "--backup", n.backupURL(), "--job", job)
	require.Equal(t, 0, code, "backups verify: %s", out)
	assert.NotContains(t, out, "INCOMPLETE")

	// export: the plain reference layout.
	exp := filepath.Join(t.TempDir(), "export")
	out, code = runMtcfs(t, "backups", "export", name, exp, "--backup", n.backupURL(), "--job", job)
	require.Equal(t, 0, code, "backups export: %s", out)
	hash := strings.TrimSuffix(filepath.Base(data), ".data")
	meta, err := os.ReadFile(filepath.Join(exp, job+"-s10-n0-w0.meta"))
	require.NoError(t, err)
	assert.Equal(t, hash, string(meta))
	requireFiles(t, files, filepath.Join(exp, hash+".data"))
	out, code = runMtcfs(t, "backups", "export", name, exp, "--backup", n.backupURL(), "--job", job)
	assert.NotEqual(t, 0, code)
	assert.Contains(t, out, "not empty")
	out, code = runMtcfs(t, "backups", "export", "2020-01-01_00-00", filepath.Join(t.TempDir(), "x"), "--backup", n.backupURL(), "--job", job)
	assert.NotEqual(t, 0, code)
	assert.Contains(t, out, "has no backup 2020-01-01_00-00")

	// The node loses its RAM; the step comes back from the compressed backup.
	killAgent(t, a)
	forceUnmount(n.dir)
	n.dropSpool(t)
	b := n.start(t)
	o = orbaxClient(t, n.dir, job, fastBackupMinutes)
	step, found, err := o.Start(ctx)
	require.NoError(t, err)
	require.True(t, found, "nothing restored\n%s", b.log())
	require.EqualValues(t, 10, step)
	pre, err := os.ReadFile(filepath.Join(n.dir, "replicator.prerestore"))
	require.NoError(t, err)
	assert.Contains(t, string(pre), "restore-backup: "+name)
	requireFiles(t, files, filepath.Join(n.dir, "10"))
}

// TestPeerCompressEndToEnd: two agents with --peer-compress on replicate a step of bf16 and fp32
// tensors compressed (the metrics show chunks compressed and fewer bytes on the wire than read),
// and after rank 1's machine is replaced the step comes back from its peer byte for byte. A
// second pair with the default (auto) sends chunks compressed only once auto turned it on.
func TestPeerCompressEndToEnd(t *testing.T) {
	needRoot(t)
	ctx := repCtx(t)
	for _, mode := range []string{"on", "auto"} {
		t.Run(mode, func(t *testing.T) {
			c := newClusterWith(t, 2, func(int) []string { return []string{"--peer-compress", mode} })
			files := compressedStep(t)
			clients := make([]*jobsim.Orbax, 2)
			c.all(t, func(r int) error {
				clients[r] = c.client(t, r)
				clients[r].PeerRanks = []int{1 - r}
				_, _, err := clients[r].Start(ctx)
				return err
			})
			for r := range 2 {
				saveRawStep(t, c.nodes[r].dir, 10, files)
			}
			addr0 := agentHTTPAddr(t, c.agents[0])
			var fams map[string]*dto.MetricFamily
			repWait(t, 30*time.Second, "step 10 replicated on rank 0", func() bool {
				fams = scrape(t, addr0)
				return value(t, fams, "mtcfs_latest_step", map[string]string{"state": "replicated"}) == 10
			})
			sent := value(t, fams, "mtcfs_peer_sent_bytes_total", nil)
			wire := value(t, fams, "mtcfs_peer_wire_bytes_total", nil)
			compressed := value(t, fams, "mtcfs_peer_chunks_compressed_total", nil)
			require.Positive(t, sent, "rank 0 pushed nothing")
			if mode == "auto" {
				// Whether auto compresses depends on what it measured: loopback is usually faster
				// than the codec, but not on a loaded machine under -race (a CI run measured ~100
				// MB/s and turned it on). The decision logic is TestCompressAuto's; here, chunks
				// go compressed only after auto turned compression on for the peer, and bytes on
				// the wire differ from bytes read only for them.
				changes := value(t, fams, "mtcfs_peer_link_compress_changes_total", nil)
				t.Logf("auto: %v chunks compressed, decision changed %v times, link %.0f MB/s", compressed, changes,
					value(t, fams, "mtcfs_peer_link_rate_bytes", nil)/1e6)
				if compressed == 0 {
					assert.Equal(t, sent, wire)
				} else {
					assert.Positive(t, changes, "chunks went compressed but auto never turned compression on")
					assert.LessOrEqual(t, wire, sent)
				}
				return
			}
			assert.Equal(t, 1.0, value(t, fams, "mtcfs_peer_link_compressing", nil), "--peer-compress on, yet the link is not reported compressing")
			assert.Positive(t, compressed, "no chunk was compressed")
			assert.Less(t, wire, 0.85*sent, "bytes on the wire (%v) against bytes read (%v)", wire, sent)

			// Rank 1's machine is replaced: its step comes back from rank 0, decompressed.
			killAgent(t, c.agents[1])
			forceUnmount(c.nodes[1].dir)
			c.nodes[1].dropSpool(t)
			c.agents[1] = c.nodes[1].start(t)
			c.all(t, func(r int) error {
				o := c.client(t, r)
				o.PeerRanks = []int{1 - r}
				step, found, err := o.Start(ctx)
				if err == nil && (!found || step != 10) {
					return fmt.Errorf("restored step %d (found %v), want 10", step, found)
				}
				return err
			})
			requireFiles(t, files, filepath.Join(c.nodes[1].dir, "10"))
			require.Contains(t, c.agents[1].log(), "restored from a peer")
		})
	}
}
