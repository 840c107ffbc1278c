package main

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mtcfs/mtcfs/internal/jobsim"
)

// fakeGCSVersion is the fake-gcs-server release the end-to-end test runs; the agent's module does
// not require the emulator, and bench/go.mod pins the same version for gcsbench.
const fakeGCSVersion = "v1.56.1"

var (
	fakeGCSOnce sync.Once
	fakeGCSDir  string // holds the binary; TestMain removes it
	fakeGCSBin  string
	fakeGCSErr  error
)

// fakeGCSBinary builds the fake-gcs-server emulator (fakeGCSVersion, with the versions of its own
// go.mod: go install pkg@version) once per run.
func fakeGCSBinary(t *testing.T) string {
	t.Helper()
	fakeGCSOnce.Do(func() {
		dir, err := os.MkdirTemp("", "fake-gcs-server")
		if err != nil {
			fakeGCSErr = err
			return
		}
		fakeGCSDir = dir
		cmd := exec.Command("go", "install", "github.com/fsouza/fake-gcs-server@"+fakeGCSVersion)
		cmd.Env = append(os.Environ(), "GOBIN="+dir)
		if out, err := cmd.CombinedOutput(); err != nil {
			fakeGCSErr = fmt.Errorf("go install fake-gcs-server@%s: %v\n%s", fakeGCSVersion, err, out)
			return
		}
		fakeGCSBin = filepath.Join(dir, "fake-gcs-server")
	})
	require.NoError(t, fakeGCSErr)
	return fakeGCSBin
}

// startFakeGCS runs the emulator binary on a free loopback port with bucket created, and points
// this process and the agents it starts at it (STORAGE_EMULATOR_HOST). It is stopped when the
// test ends.
func startFakeGCS(t *testing.T, bucket string) {
	t.Helper()
	bin := fakeGCSBinary(t)
	// A loopback address no other test binds: between this probe and the emulator's listen, a
	// port of 127.0.0.1 could be taken by another test, whose server would then answer below.
	const ip = "127.0.0.77"
	ln, err := net.Listen("tcp", ip+":0")
	require.NoError(t, err)
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	cmd := exec.Command(bin, "-scheme", "http", "-host", ip, "-port", fmt.Sprint(port), "-backend", "memory", "-log-level", "warn")
	var logs bytes.Buffer
	cmd.Stdout, cmd.Stderr = &logs, &logs
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		if t.Failed() {
			t.Logf("fake-gcs-server output:\n%s", logs.String())
		}
	})
	host := fmt.Sprintf("%s:%d", ip, port)
	repWait(t, 15*time.Second, "the GCS emulator to answer", func() bool {
		resp, err := http.Get("http://" + host + "/storage/v1/b")
		if err == nil {
			resp.Body.Close()
		}
		return err == nil
	})
	resp, err := http.Post("http://"+host+"/storage/v1/b", "application/json", strings.NewReader(fmt.Sprintf(`{"name":%q}`, bucket)))
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode, "create bucket %s", bucket)
	t.Setenv("STORAGE_EMULATOR_HOST", host)
}

// TestGCSBackupEndToEnd: three agents whose only shared location is gs://bucket/prefix on the
// fake-gcs-server binary — they find each other through the registry there, back up a step,
// lose all their RAM, and restore it from GCS with verified bytes. The admin commands work on
// the gs:// location.
func TestGCSBackupEndToEnd(t *testing.T) {
	needRoot(t)
	startFakeGCS(t, "ckpt")
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	const url = "gs://ckpt/e2e"
	c := &cluster{}
	for range 3 {
		n := newRepNode(t)
		n.backup = url
		c.nodes = append(c.nodes, n)
		c.agents = append(c.agents, n.start(t))
	}
	client := func(r int) *jobsim.Orbax {
		o := orbaxClient(t, c.nodes[r].dir, "gjob", fastBackupMinutes)
		o.Rank, o.Nodes, o.PeerRanks = r, 3, []int{(r + 1) % 3}
		return o
	}
	clients := make([]*jobsim.Orbax, 3)
	c.all(t, func(r int) error {
		clients[r] = client(r)
		_, found, err := clients[r].Start(ctx)
		if err == nil && found {
			err = fmt.Errorf("a fresh job restored something")
		}
		return err
	})
	c.all(t, func(r int) error { return clients[r].Save(ctx, 0) })
	for r := range c.nodes {
		meta := filepath.Join(c.nodes[r].dir, fmt.Sprintf("gjob-s0-n%d-w0.meta", r))
		repWait(t, 15*time.Second, fmt.Sprintf("rank %d to seal step 0", r), func() bool { return pathExists(meta) })
	}
	c.all(t, func(r int) error { return clients[r].Save(ctx, 10) })
	name := waitCompleteBackup(t, c.nodes[0], "gjob", 10)

	out, code := runMtcfs(t, "backups", "verify", "--backup", url, "--job", "gjob")
	require.Equal(t, 0, code, "backups verify on gs://: %s", out)
	assert.Contains(t, out, name)
	assert.NotContains(t, out, "INCOMPLETE")
	out, code = runMtcfs(t, "restore-version", "set", name, "--backup", url, "--job", "gjob")
	require.Equal(t, 0, code, "restore-version set on gs://: %s", out)
	out, code = runMtcfs(t, "restore-version", "clear", "--backup", url, "--job", "gjob")
	require.Equal(t, 0, code, "restore-version clear on gs://: %s", out)

	// Every node loses its RAM: the agents die, their spools go.
	for r, a := range c.agents {
		killAgent(t, a)
		forceUnmount(c.nodes[r].dir)
		c.nodes[r].dropSpool(t)
	}
	for r := range c.nodes {
		c.agents[r] = c.nodes[r].start(t)
	}
	c.all(t, func(r int) error {
		o := client(r)
		step, found, err := o.Start(ctx)
		if err != nil {
			return err
		}
		if !found || step != 10 {
			return fmt.Errorf("restored step %d (found %v), want 10 from backup %s", step, found, name)
		}
		pre, err := os.ReadFile(filepath.Join(c.nodes[r].dir, "replicator.prerestore"))
		if err != nil {
			return err
		}
		if !strings.Contains(string(pre), "restore-backup: "+name) {
			return fmt.Errorf("replicator.prerestore %q does not name backup %s", pre, name)
		}
		return o.VerifyRestored(ctx, 10)
	})
}
