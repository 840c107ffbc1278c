package replication

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

const peerJob = "job-a"

var peerSecret = []byte("the job's shared secret")

// peerChunk is the smallest chunk a sender uses, so that small trees still span many chunks.
const peerChunk = minChunkSize

// accepted is one call of Accept.
type accepted struct {
	job      string
	rank     int
	dataName string
}

// testPeer is a Receiver served over loopback TCP. Accept moves data into sealed.
type testPeer struct {
	recv     *Receiver
	addr     string
	incoming string // ReceiverConfig.Dir
	sealed   string
	srv      *grpc.Server

	mu       sync.Mutex
	accepted []accepted // GUARDED_BY(mu)
}

func startPeer(t *testing.T, configure func(*ReceiverConfig)) *testPeer {
	t.Helper()
	root := t.TempDir()
	p := &testPeer{incoming: filepath.Join(root, "incoming"), sealed: filepath.Join(root, "sealed")}
	require.NoError(t, os.Mkdir(p.sealed, 0o755))
	cfg := ReceiverConfig{
		Dir:         p.incoming,
		Secrets:     StaticSecret(peerJob, peerSecret),
		MaxIncoming: 1 << 30,
		IdleTimeout: 2 * time.Second,
		Logger:      slog.New(slog.NewTextHandler(io.Discard, nil)),
		Accept: func(_ context.Context, job string, rank int, dataName, path string) error {
			p.mu.Lock()
			p.accepted = append(p.accepted, accepted{job, rank, dataName})
			p.mu.Unlock()
			return os.Rename(path, filepath.Join(p.sealed, dataName))
		},
		Lookup: func(_ context.Context, job, dataName string) (string, error) {
			path := filepath.Join(p.sealed, dataName)
			_, err := os.Stat(path)
			return path, err
		},
	}
	if testing.Verbose() {
		cfg.Logger = slog.Default()
	}
	if configure != nil {
		configure(&cfg)
	}
	r, err := NewReceiver(cfg)
	require.NoError(t, err)
	p.recv = r
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p.addr = ln.Addr().String()
	p.srv = grpc.NewServer(ServerOptions()...)
	r.Register(p.srv)
	go p.srv.Serve(ln)
	t.Cleanup(func() {
		p.srv.Stop()
		r.Close()
	})
	return p
}

func (p *testPeer) acceptedCalls() []accepted {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]accepted(nil), p.accepted...)
}

// requireNoIncoming stops the server, which waits for every call to return, and then waits
// until the receiver's incoming directory is empty: a failed transfer is removed at once, one
// that no call will end (streams that never arrived) after the idle timeout. The Receiver is
// not closed: that would remove everything.
func (p *testPeer) requireNoIncoming(t *testing.T) {
	t.Helper()
	p.srv.Stop()
	p.waitNoIncoming(t)
}

// waitNoIncoming waits until the incoming directory is empty and no transfer is in progress.
func (p *testPeer) waitNoIncoming(t *testing.T) {
	t.Helper()
	require.Eventually(t, func() bool {
		p.recv.mu.Lock()
		n := len(p.recv.transfers)
		p.recv.mu.Unlock()
		if n > 0 {
			return false
		}
		// Only the (empty) directory of early files may remain.
		des, err := os.ReadDir(p.incoming)
		if err != nil || len(des) != 1 || des[0].Name() != earlyDirName {
			return false
		}
		early, err := os.ReadDir(filepath.Join(p.incoming, earlyDirName))
		return err == nil && len(early) == 0
	}, 5*time.Second, 10*time.Millisecond, "transfer directories or early files left in %s", p.incoming)
}

func dial(t *testing.T, addr string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, append(DialOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	return conn
}

func testSender(streams int) *Sender {
	return &Sender{Instance: "instance-1", Secrets: StaticSecret(peerJob, peerSecret), ChunkSize: peerChunk, Streams: streams,
		StallTimeout: 5 * time.Second}
}

func pushReq(name, src string) PushRequest {
	return PushRequest{Job: peerJob, Incarnation: "inc-1", Rank: 1, DataName: name, Source: src}
}

// makeTree writes a checkpoint-like tree under a new directory and returns its path and data
// name: nested directories, an empty directory, a symlink, an empty file, a file spanning
// several chunks whose size is no multiple of the chunk, and small files. big sets the size of
// the large file.
func makeTree(t *testing.T, rnd *rand.Rand, big int) (string, string) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "tree")
	files := map[string]int{
		"_CHECKPOINT_METADATA":                     200 + rnd.IntN(100),
		"state/array_0/0.0":                        big,
		"state/array_1/0.0":                        peerChunk + 1,
		"state/array_1/.zarray":                    rnd.IntN(300),
		"process_metadata/process_0.json":          rnd.IntN(2000),
		"empty-file":                               0,
		"deep/a/b/c/d/leaf":                        peerChunk,
		fmt.Sprintf("state/f%03d", rnd.IntN(1000)): 1 + rnd.IntN(5000),
	}
	for name, size := range files {
		p := filepath.Join(dir, filepath.FromSlash(name))
		require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
		data := make([]byte, size)
		for i := range data {
			data[i] = byte(rnd.Uint32())
		}
		require.NoError(t, os.WriteFile(p, data, 0o644))
	}
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "empty-dir", "nested-empty"), 0o755))
	require.NoError(t, os.Symlink("state/array_0/0.0", filepath.Join(dir, "latest")))
	require.NoError(t, os.Symlink("../array_1", filepath.Join(dir, "state/array_0/sibling")))
	hash, isDir, err := layout.HashData(context.Background(), dir)
	require.NoError(t, err)
	return dir, layout.DataName(hash, isDir)
}

// requireHashesTo checks that the data at p hashes to its name.
func requireHashesTo(t *testing.T, p, dataName string) {
	t.Helper()
	hash, isDir, err := layout.HashData(context.Background(), p)
	require.NoError(t, err)
	require.Equal(t, dataName, layout.DataName(hash, isDir), "%s does not hash to its name", p)
}
