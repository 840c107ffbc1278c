package gcsbackend

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"cloud.google.com/go/storage"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/api/option"
)

const leftoverBackup = "2026-01-02_03-04"

// later is a clock LeftoverAge past now: every temporary is old by then.
func later() time.Time { return time.Now().Add(2 * DefaultLeftoverAge) }

// deadPid returns the pid of a process that has exited.
func deadPid(t *testing.T) int {
	t.Helper()
	cmd := exec.Command("true")
	require.NoError(t, cmd.Run())
	return cmd.Process.Pid
}

func TestTempNameRecordsWriter(t *testing.T) {
	w := self()
	require.NotEmpty(t, w.host, "this test needs /proc")
	got, ok := parseTempName(newTempName())
	require.True(t, ok)
	assert.Equal(t, w, got)
	assert.True(t, got.alive(), "this process is alive")
	assert.False(t, writer{host: w.host, pid: w.pid, start: w.start + 1}.alive(), "same pid, other start time: a reused pid")
	assert.False(t, writer{host: w.host, pid: deadPid(t), start: w.start}.alive())
	for _, bad := range []string{tempPrefix + "0011223344556677", tempPrefix + "x-1-2-ab", tempPrefix + w.host + "-0-1-ab",
		tempPrefix + w.host + "-01-1-ab", tempPrefix + w.host + "-1-1-", "other"} {
		_, ok := parseTempName(bad)
		assert.False(t, ok, bad)
	}
}

// plantTemp writes a temporary file into a file:// store as a writer
// would have left it.
func plantTemp(t *testing.T, s *localDir, dir, seg string) string {
	t.Helper()
	p := filepath.Join(s.root, filepath.FromSlash(dir), seg)
	require.NoError(t, os.MkdirAll(filepath.Dir(p), dirPerm))
	require.NoError(t, os.WriteFile(p, []byte("partial"), filePerm))
	return p
}

func exists(p string) bool {
	_, err := os.Lstat(p)
	return err == nil
}

// TestCleanLeftoversLocalRules: which temporaries of a file:// store are
// removed, by writer and by age.
func TestCleanLeftoversLocalRules(t *testing.T) {
	ctx := context.Background()
	s := newTestLocalDir(t).(*localDir)
	b := &Backups{Store: s}
	w := self()
	dir := backupDir(testJob, leftoverBackup)
	put(t, s, dir+"keep-me", "an object")

	dead := plantTemp(t, s, dir+"D00/state/", fmt.Sprintf("%s%s-%d-%d-00ff", tempPrefix, w.host, deadPid(t), w.start))
	reused := plantTemp(t, s, dir, fmt.Sprintf("%s%s-%d-%d-00fe", tempPrefix, w.host, w.pid, w.start+1))
	live := plantTemp(t, s, dir, fmt.Sprintf("%s%s-%d-%d-00fd", tempPrefix, w.host, w.pid, w.start))
	foreign := plantTemp(t, s, dir, fmt.Sprintf("%s%s-%d-%d-00fc", tempPrefix, "0123456789abcdef", w.pid, w.start))
	legacy := plantTemp(t, s, testJob+"/agents/", tempPrefix+"0011223344556677")
	otherJob := plantTemp(t, s, "other-job/"+leftoverBackup+"/", fmt.Sprintf("%s%s-%d-%d-00fb", tempPrefix, w.host, deadPid(t), w.start))
	userDir := filepath.Join(s.root, testJob, leftoverBackup, tempPrefix+"not-ours")
	require.NoError(t, os.MkdirAll(userDir, dirPerm))
	require.NoError(t, os.WriteFile(filepath.Join(userDir, "f"), nil, filePerm))

	// Now: only writers known to be gone.
	n, err := b.CleanLeftovers(ctx, testJob)
	require.NoError(t, err)
	assert.Equal(t, 2, n)
	assert.False(t, exists(dead), "a temporary of a dead local writer goes at once")
	assert.False(t, exists(filepath.Dir(dead)), "and the directories it leaves empty")
	assert.False(t, exists(reused), "a reused pid is not the writer")
	for _, p := range []string{live, foreign, legacy, otherJob, userDir} {
		assert.True(t, exists(p), "%s must stay", p)
	}

	// An hour later: also those whose writer cannot be checked; never a
	// live local writer's, another job's, or a directory that is not ours.
	b.now = later
	n, err = b.CleanLeftovers(ctx, testJob)
	require.NoError(t, err)
	assert.Equal(t, 2, n)
	assert.False(t, exists(foreign))
	assert.False(t, exists(legacy))
	for _, p := range []string{live, otherJob, userDir} {
		assert.True(t, exists(p), "%s must stay", p)
	}
	assert.Equal(t, []string{dir + "keep-me"}, listAll(t, s))

	_, err = b.CleanLeftovers(ctx, "../x")
	assert.ErrorContains(t, err, "job name")
}

// blockingBody yields some bytes, says so, then blocks until released.
type blockingBody struct {
	first   []byte
	started chan struct{}
	release chan struct{}
	rest    io.Reader
	once    sync.Once
}

func (r *blockingBody) Read(p []byte) (int, error) {
	if len(r.first) > 0 {
		n := copy(p, r.first)
		r.first = r.first[n:]
		return n, nil
	}
	r.once.Do(func() { close(r.started) })
	<-r.release
	return r.rest.Read(p)
}

// TestCleanLeftoversSparesLiveLocalPut: a Put in progress in this process
// keeps its temporary file whatever its age, and completes.
func TestCleanLeftoversSparesLiveLocalPut(t *testing.T) {
	ctx := context.Background()
	s := newTestLocalDir(t).(*localDir)
	b := &Backups{Store: s, LeftoverAge: time.Nanosecond, now: later}
	name := backupDir(testJob, leftoverBackup) + "obj"
	body := &blockingBody{first: []byte("first half "), started: make(chan struct{}), release: make(chan struct{}), rest: strings.NewReader("second half")}
	done := make(chan error, 1)
	go func() {
		done <- s.Put(ctx, PutRequest{Name: name, Body: body, Size: int64(len("first half second half")), IfAbsent: true})
	}()
	<-body.started
	temps, err := s.temporaries(ctx, testJob+"/")
	require.NoError(t, err)
	require.Len(t, temps, 1, "the Put's temporary file")

	n, err := b.CleanLeftovers(ctx, testJob)
	require.NoError(t, err)
	assert.Zero(t, n)
	assert.True(t, exists(temps[0].keys[0]))
	close(body.release)
	require.NoError(t, <-done)
	assert.Equal(t, "first half second half", readRange(t, s, name, 0, -1))
}

// TestLeftoverWriterProcess is not a test: it is the writer process that
// TestCleanLeftoversAcrossProcesses starts and kills.
func TestLeftoverWriterProcess(t *testing.T) {
	mode := os.Getenv("MTCFS_TEST_LEFTOVER_WRITER")
	if mode == "" {
		t.Skip("helper process")
	}
	ctx := context.Background()
	kind, loc, _ := strings.Cut(mode, ":")
	switch kind {
	case "file":
		s, err := newLocalDir(loc)
		require.NoError(t, err)
		pr, pw := io.Pipe()
		go func() {
			pw.Write([]byte("some bytes"))
			fmt.Println("ready")
			select {} // the rest never comes
		}()
		s.Put(ctx, PutRequest{Name: backupDir(testJob, leftoverBackup) + "obj", Body: pr, Size: 1 << 20})
	case "gcs":
		client, err := storage.NewClient(ctx, option.WithEndpoint(loc+"/storage/v1/"),
			option.WithHTTPClient(&http.Client{}), storage.WithJSONReads())
		require.NoError(t, err)
		s, err := NewGCS(client, testBucket, "backups/test", testGCSOptions())
		require.NoError(t, err)
		// The parent's directory: this process dies by SIGKILL, so its own t.TempDir would stay.
		src := os.Getenv("MTCFS_TEST_LEFTOVER_SRC")
		require.NotEmpty(t, src)
		require.NoError(t, os.WriteFile(filepath.Join(src, "big"), randomBytes(3<<20, 9), 0o600))
		fmt.Println("ready")
		b := &Backups{Store: s, Parallelism: 1}
		b.Upload(ctx, UploadRequest{Job: testJob, Backup: leftoverBackup, Hash: fakeHash(true, "x"), Source: src})
	}
	select {}
}

// startWriter starts a writer process and waits until it says it is ready.
func startWriter(t *testing.T, mode string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestLeftoverWriterProcess$")
	cmd.Env = append(os.Environ(), "MTCFS_TEST_LEFTOVER_WRITER="+mode, "MTCFS_TEST_LEFTOVER_SRC="+t.TempDir())
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, "ready\n", line)
	return cmd
}

func kill9(t *testing.T, cmd *exec.Cmd) {
	t.Helper()
	require.NoError(t, cmd.Process.Kill()) // SIGKILL
	_ = cmd.Wait()
}

// TestCleanLeftoversAcrossProcesses: a backup in progress in another
// process keeps its temporaries, however old; once that process is killed
// with SIGKILL, the next CleanLeftovers removes them at once — on file://
// (a temporary file) and on GCS (the parts of a composite upload).
func TestCleanLeftoversAcrossProcesses(t *testing.T) {
	ctx := context.Background()
	t.Run("file", func(t *testing.T) {
		s := newTestLocalDir(t).(*localDir)
		cmd := startWriter(t, "file:"+s.root)
		b := &Backups{Store: s, now: later}
		temps, err := s.temporaries(ctx, testJob+"/")
		require.NoError(t, err)
		require.Len(t, temps, 1)
		w, ok := parseTempName(temps[0].seg)
		require.True(t, ok)
		assert.Equal(t, cmd.Process.Pid, w.pid)

		n, err := b.CleanLeftovers(ctx, testJob)
		require.NoError(t, err)
		assert.Zero(t, n, "the writer is alive")
		assert.True(t, exists(temps[0].keys[0]))

		kill9(t, cmd)
		b.now = nil // no waiting for an age: the writer is known to be gone
		n, err = b.CleanLeftovers(ctx, testJob)
		require.NoError(t, err)
		assert.Equal(t, 1, n)
		assert.False(t, exists(temps[0].keys[0]))
		assert.False(t, exists(filepath.Join(s.root, testJob)), "nothing is left, not even directories")
	})
	t.Run("gcs", func(t *testing.T) {
		f := newFakeGCS(t)
		s := f.store(t, "backups/test", testGCSOptions())
		blocked := make(chan struct{})
		var once sync.Once
		f.faults.add(1, anyPart(1), func(w http.ResponseWriter, r *http.Request, next http.Handler) {
			io.Copy(io.Discard, r.Body)
			once.Do(func() { close(blocked) })
			<-r.Context().Done() // until the writer is gone
		})
		cmd := startWriter(t, "gcs:"+f.url)
		select {
		case <-blocked:
		case <-time.After(time.Minute):
			t.Fatal("the writer never uploaded its second part")
		}
		b := &Backups{Store: s, now: later}
		n, err := b.CleanLeftovers(ctx, testJob)
		require.NoError(t, err)
		assert.Zero(t, n, "the writer is alive")
		assert.Equal(t, 1, countTemporaryObjects(t, f), "its first part")

		kill9(t, cmd)
		b.now = nil
		n, err = b.CleanLeftovers(ctx, testJob)
		require.NoError(t, err)
		assert.Equal(t, 1, n)
		assertNoTemporaryObjects(t, f)
	})
}

// anyPart matches the upload of the i-th part (0-based) of a composite upload.
func anyPart(i int) func(*http.Request) bool {
	suffix := fmt.Sprintf("/%05d", i)
	return func(r *http.Request) bool {
		name := r.URL.Query().Get("name")
		return isUpload(r) && strings.Contains(name, tempPrefix) && strings.HasSuffix(name, suffix)
	}
}

func countTemporaryObjects(t *testing.T, f *fakeGCS) int {
	t.Helper()
	n := 0
	for _, name := range f.srv.names(testBucket) {
		if strings.Contains(name, tempPrefix) {
			n++
		}
	}
	return n
}

// TestCleanLeftoversGCS: composite-upload parts in progress in this process
// are spared and the upload completes; areas of gone or unknown writers are
// removed by the rules; objects are never touched.
func TestCleanLeftoversGCS(t *testing.T) {
	ctx := context.Background()
	f := newFakeGCS(t)
	s := f.store(t, "backups/test", testGCSOptions())
	b := &Backups{Store: s, Parallelism: 1, LeftoverAge: time.Nanosecond, now: later}
	w := self()
	part := func(key string) {
		f.srv.put(testBucket, key, []byte("part"))
	}
	jobArea := "backups/test/" + testJob + "/"
	part(jobArea + fmt.Sprintf("%s%s-%d-%d-01/00000", tempPrefix, w.host, deadPid(t), w.start))
	part(jobArea + fmt.Sprintf("%s%s-%d-%d-01/00001", tempPrefix, w.host, deadPid(t), w.start))
	part(jobArea + tempPrefix + "fedcba9876543210fedcba98/00000")         // other host: by age
	part("backups/test/" + tempPrefix + "00112233445566778899aabb/00000") // an earlier version's, at the root
	part("backups/test/other-job/" + fmt.Sprintf("%s%s-%d-%d-02/00000", tempPrefix, w.host, deadPid(t), w.start))

	// A composite upload of this process, held after its first part.
	src := t.TempDir()
	tree := map[string]string{"big": string(randomBytes(3<<20, 4))}
	writeTree(t, src, tree)
	blocked, release := make(chan struct{}), make(chan struct{})
	f.faults.add(1, anyPart(1), func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		close(blocked)
		<-release
		next.ServeHTTP(w, r)
	})
	h := fakeHash(true, "live")
	done := make(chan error, 1)
	go func() {
		done <- b.Upload(ctx, UploadRequest{Job: testJob, Backup: leftoverBackup, Hash: h, Source: src})
	}()
	<-blocked
	n, err := b.CleanLeftovers(ctx, testJob)
	require.NoError(t, err)
	assert.Equal(t, 4, n, "the dead writer's two parts, the other host's and the root one")
	assert.Equal(t, 2, countTemporaryObjects(t, f), "the live upload's first part and the other job's")
	close(release)
	require.NoError(t, <-done)
	rep := verify(t, b, leftoverBackup, VerifyOptions{Nodes: 1, Workers: 1, Deep: true})
	assert.True(t, rep.Steps[0].Complete, rep.Steps[0].Problems)
	assert.Equal(t, 1, countTemporaryObjects(t, f), "the upload removed its own parts")

	// Fresh temporaries of writers that cannot be checked stay.
	b.now, b.LeftoverAge = nil, 0
	part(jobArea + tempPrefix + "fedcba9876543210fedcba99/00000")
	n, err = b.CleanLeftovers(ctx, testJob)
	require.NoError(t, err)
	assert.Zero(t, n)
}

// TestLeftoversDoNotChangeVerdicts: temporary files or objects a crash left
// inside or beside a backup change nothing that Names, List or Verify say.
func TestLeftoversDoNotChangeVerdicts(t *testing.T) {
	runOnStores(t, func(t *testing.T, gcs bool, plant func(name string)) {
		ctx := context.Background()
		b := newTestBackups(t)
		uploadStep(t, b, leftoverBackup, 3, 2, 1)
		uploadStep(t, b, "2026-01-02_03-05", 3, 2, 1, Slot{1, 0}) // incomplete
		before, err := b.List(ctx, testJob)
		require.NoError(t, err)
		h := hashOf(t, b, leftoverBackup, 3, Slot{0, 0})
		dir := backupDir(testJob, leftoverBackup)
		w := self()
		seg := fmt.Sprintf("%s%s-%d-%d-0a", tempPrefix, w.host, w.pid, w.start)
		plant(dir + seg)                                                                             // beside the .meta files
		plant(dir + h + ".data/state/" + seg)                                                        // inside a data tree
		plant(dir + "D" + strings.Repeat("0", 64) + ".data/" + seg)                                  // data nothing names
		plant(backupDir(testJob, "2026-01-02_03-05") + seg + "/" + metaName(testJob, 3, Slot{1, 0})) // the missing .meta, not yet published
		plant(testJob + "/" + seg + "/00000")                                                        // a part area
		after, err := b.List(ctx, testJob)
		require.NoError(t, err)
		assert.Equal(t, before, after)
		names, err := b.Names(ctx, testJob)
		require.NoError(t, err)
		assert.Equal(t, []string{"2026-01-02_03-05", leftoverBackup}, names)

		// A backup cut short before its first object: file:// does not list
		// it; GCS lists the prefix (our writers never leave temporaries
		// there), and Verify reports it as not found, which List skips.
		plant(backupDir(testJob, "2026-01-02_03-06") + seg)
		after, err = b.List(ctx, testJob)
		require.NoError(t, err)
		assert.Equal(t, before, after)
		_, err = b.Verify(ctx, testJob, "2026-01-02_03-06", VerifyOptions{})
		assert.True(t, IsNotFound(err), "%v", err)
		if !gcs {
			plant(backupDir(testJob, "2026-01-02_03-07") + seg + "/00000") // a directory named as a temporary
			names, err = b.Names(ctx, testJob)
			require.NoError(t, err)
			assert.Equal(t, []string{"2026-01-02_03-05", leftoverBackup}, names)
		}
	})
}

// runOnStores runs test on file:// and on the GCS emulator, with a function
// that plants a temporary file or object under a store name.
func runOnStores(t *testing.T, test func(t *testing.T, gcs bool, plant func(name string))) {
	t.Run("file", func(t *testing.T) {
		s := newTestLocalDir(t).(*localDir)
		testStores.Store(t, func(*testing.T) ObjectStore { return s })
		defer testStores.Delete(t)
		test(t, false, func(name string) {
			p := filepath.Join(s.root, filepath.FromSlash(name))
			require.NoError(t, os.MkdirAll(filepath.Dir(p), dirPerm))
			require.NoError(t, os.WriteFile(p, []byte("llama"), filePerm))
		})
	})
	t.Run("gcs", func(t *testing.T) {
		f := newFakeGCS(t)
		s := f.store(t, "backups/test", testGCSOptions())
		testStores.Store(t, func(*testing.T) ObjectStore { return s })
		defer testStores.Delete(t)
		test(t, true, func(name string) {
			f.srv.put(testBucket, s.key(name), []byte("llama"))
		})
	})
}
