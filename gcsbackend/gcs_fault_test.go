package gcsbackend

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mtcfs/mtcfs/internal/syncbuf"
)

// Fault injection: the emulator sits behind faultInjector, which breaks
// chosen requests. Every scenario must end in a correct backup and restore,
// or in a clear error with a backup that Verify does not call complete —
// never in a complete-looking backup that is wrong, or a torn restored file.

const faultBackup = "2026-01-02_03-04"

// faultSetup is an emulator, a store with fast test options (parts of
// 256 KiB), and a source tree with a 1 MiB file (4 parts) and a
// 768 KiB + 5 B one (4 parts, the last one short).
func faultSetup(t *testing.T, tune func(*GCSOptions)) (*fakeGCS, *Backups, map[string]string, string) {
	t.Helper()
	f := newFakeGCS(t)
	opts := testGCSOptions()
	opts.PartSize = 256 << 10
	if tune != nil {
		tune(&opts)
	}
	b := &Backups{Store: f.store(t, "bk", opts), Parallelism: 4}
	src := t.TempDir()
	return f, b, bigTree(t, src, 1<<20, 768<<10+5), src
}

func assertAllHit(t *testing.T, f *fakeGCS, rules ...*faultRule) {
	t.Helper()
	for i, r := range rules {
		assert.Equal(t, r.times, f.faults.hits(r), "fault rule %d must have fired every time (the scenario did not happen otherwise)", i)
	}
}

// assertNotComplete checks that a failed upload left no complete-looking
// step behind.
func assertNotComplete(t *testing.T, b *Backups) {
	t.Helper()
	rep, err := b.Verify(context.Background(), testJob, faultBackup, VerifyOptions{Nodes: 1, Workers: 1, Deep: true})
	if IsNotFound(err) {
		return
	}
	require.NoError(t, err)
	for _, s := range rep.Steps {
		assert.False(t, s.Complete, "step %d of a failed upload must not be complete", s.Step)
	}
}

func uploadFaultTree(b *Backups, src string) error {
	return b.Upload(context.Background(), UploadRequest{Job: testJob, Backup: faultBackup, Step: 7, Slot: Slot{0, 0},
		Hash: fakeHash(true, "fault"), Source: src})
}

func TestGCSFaultServerErrorBursts(t *testing.T) {
	f, b, tree, src := faultSetup(t, func(o *GCSOptions) { o.MaxAttempts = 30 })
	r503 := f.faults.add(12, anyRequest, respond(http.StatusServiceUnavailable))
	r429 := f.faults.add(8, anyRequest, respond(http.StatusTooManyRequests))
	reads := f.faults.add(4, isMediaRead, respond(http.StatusServiceUnavailable))
	roundTrip(t, b, tree, src)
	assertAllHit(t, f, r503, r429, reads)
	assertNoTemporaryObjects(t, f)
}

// TestGCSFaultLostAcknowledgement: uploads and composes that landed but whose
// answer was lost are retried; the retry's 412 is recognised as our own write.
// A spurious 412 (object absent) is retried too.
func TestGCSFaultLostAcknowledgement(t *testing.T) {
	f, b, tree, src := faultSetup(t, nil)
	lostUploads := f.faults.add(6, isUpload, serveThen(http.StatusServiceUnavailable))
	lostCompose := f.faults.add(1, isCompose, serveThen(http.StatusBadGateway))
	spurious := f.faults.add(2, uploadOf(".meta"), respond(http.StatusPreconditionFailed))
	roundTrip(t, b, tree, src)
	assertAllHit(t, f, lostUploads, lostCompose, spurious)
	assertNoTemporaryObjects(t, f)
}

// TestGCSFaultReplaceRace: a replacing Put (restore.version, registrations)
// whose object changed between its look and its write gets a 412, looks
// again and replaces the newer version; it never clobbers blindly.
func TestGCSFaultReplaceRace(t *testing.T) {
	ctx := context.Background()
	f := newFakeGCS(t)
	b := &Backups{Store: f.store(t, "", testGCSOptions())}
	require.NoError(t, b.SetRestoreVersion(ctx, testJob, "2025-01-01_00-00"))
	race := f.faults.add(1, uploadOf("restore.version"), func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		// Another writer gets in first.
		f.srv.put(testBucket, testJob+"/restore.version", []byte("2025-05-05_05-05\n"))
		next.ServeHTTP(w, r)
	})
	require.NoError(t, b.SetRestoreVersion(ctx, testJob, "2026-02-02_02-02"))
	assertAllHit(t, f, race)
	pin, ok, err := b.ReadRestoreVersion(ctx, testJob)
	require.NoError(t, err)
	assert.True(t, ok)
	assert.Equal(t, "2026-02-02_02-02", pin, "the later Put replaces the version it found")
}

// TestGCSFaultStall: requests that hang longer than the stall timeout are
// abandoned and retried — not waited out: a stalled request would be served
// after long, so the round trip must end well before that.
func TestGCSFaultStall(t *testing.T) {
	f, b, tree, src := faultSetup(t, func(o *GCSOptions) { o.StallTimeout = 500 * time.Millisecond })
	long := 10 * time.Second
	rules := []*faultRule{
		f.faults.add(2, isUpload, stall(long)),
		f.faults.add(1, isCompose, stall(long)),
		f.faults.add(2, isMediaRead, stall(long)),
		f.faults.add(1, func(r *http.Request) bool { return r.Method == http.MethodGet && !isMediaRead(r) }, stall(long)),
	}
	var logs syncbuf.Buffer
	old := slog.Default()
	slog.SetDefault(slog.New(slog.NewTextHandler(&logs, nil)))
	t.Cleanup(func() { slog.SetDefault(old) })
	start := time.Now()
	roundTrip(t, b, tree, src)
	assert.Less(t, time.Since(start), long, "stalled requests must be abandoned after StallTimeout, not waited out")
	assertAllHit(t, f, rules...)
	// Each abandoned attempt is said: a stalled location left minutes without a word.
	assert.Contains(t, logs.String(), "backup location: a request failed; trying again")
	assert.Contains(t, logs.String(), "no progress for 500ms")
}

// TestGCSFaultStallForever: a server that never answers ends in a clear error
// and an incomplete backup.
func TestGCSFaultStallForever(t *testing.T) {
	f, b, _, src := faultSetup(t, func(o *GCSOptions) {
		o.StallTimeout = 100 * time.Millisecond
		o.MaxAttempts = 2
	})
	f.faults.add(1<<30, uploadOf(tempPrefix), stall(time.Minute)) // the parts of the large files
	err := uploadFaultTree(b, src)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "no progress for 100ms", "the error says what happened")
	assert.Contains(t, err.Error(), "gs://mtcfs-test/bk/", "the error names bucket and object")
	f.faults.clear()
	assertNotComplete(t, b)
}

// TestGCSFaultCorruptUpload: bytes damaged on the way are refused by the
// server's CRC32C check and sent again.
func TestGCSFaultCorruptUpload(t *testing.T) {
	f, b, tree, src := faultSetup(t, nil)
	corrupt := f.faults.add(3, uploadOf(tempPrefix), corruptRequest) // parts of a composite upload
	small := f.faults.add(1, uploadOf("array_0"), corruptRequest)
	roundTrip(t, b, tree, src)
	assertAllHit(t, f, corrupt, small)
	assertNoTemporaryObjects(t, f)
}

// TestGCSFaultCorruptUploadPersistent: a path that damages every upload
// ends in a clear error, not in a backup.
func TestGCSFaultCorruptUploadPersistent(t *testing.T) {
	f, b, _, src := faultSetup(t, func(o *GCSOptions) { o.MaxAttempts = 3 })
	f.faults.add(1<<30, uploadOf("array_0"), corruptRequest)
	err := uploadFaultTree(b, src)
	require.Error(t, err)
	assert.Contains(t, strings.ToLower(err.Error()), "crc32c", "the error says the checksum failed")
	assert.Contains(t, err.Error(), "array_0")
	f.faults.clear()
	assertNotComplete(t, b)
	// Temporary parts may remain here: a part whose request was cancelled
	// when array_0 failed can still land after the cleanup (on GCS too).
	// Listings hide them.
	assert.NotContains(t, listAll(t, b.Store), tempPrefix)
}

// TestGCSFaultCorruptDownload: bytes damaged on the way down (their CRC32C is not the one GCS
// keeps for the object) are read again: a download damaged a few times restores correctly. One
// damaged on every read fails with an error that says so, not a *ChecksumError: the data in the
// store is intact, and must not be taken for damaged (a restore marked it damaged for good, and
// every next start restored an older step: a black-box run). Nothing is left at the destination.
func TestGCSFaultCorruptDownload(t *testing.T) {
	ctx := context.Background()
	quickReadsAgain(t)
	for _, tc := range []struct {
		name  string
		match func(*http.Request) bool
	}{
		{"ranged", func(r *http.Request) bool { return isMediaRead(r) && strings.Contains(r.URL.Path, "big.bin") }},
		{"whole", func(r *http.Request) bool { return isMediaRead(r) && strings.Contains(r.URL.Path, "array_0") }},
		// ReadSmall: the manifest (black-box h55: read once, it failed the restore plan).
		{"manifest", func(r *http.Request) bool { return isMediaRead(r) && strings.Contains(r.URL.Path, ".manifest") }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, b, tree, src := faultSetup(t, nil)
			require.NoError(t, uploadFaultTree(b, src))
			parent := t.TempDir()
			dest := filepath.Join(parent, "restored")
			req := DownloadRequest{Job: testJob, Backup: faultBackup, Hash: fakeHash(true, "fault"), Dest: dest}

			rule := f.faults.add(transitReads-1, tc.match, corruptResponse)
			require.NoError(t, b.Download(ctx, req), "damaged on the way %d times: read again", transitReads-1)
			assertAllHit(t, f, rule)
			got := readTree(t, dest)
			for k, v := range tree {
				assert.True(t, got[k] == v, "restored %s differs", k)
			}
			require.NoError(t, os.RemoveAll(dest))

			f.faults.add(1<<30, tc.match, corruptResponse)
			err := b.Download(ctx, req)
			require.Error(t, err, "a download damaged on every read must fail")
			var ce *ChecksumError
			assert.False(t, errors.As(err, &ce), "damaged on the way is not damage in the store: %v", err)
			assert.Contains(t, err.Error(), "damaged on the way")
			entries, err := os.ReadDir(parent)
			require.NoError(t, err)
			assert.Empty(t, entries, "a failed download leaves nothing behind, not even its temporary tree")
		})
	}
}

// cutBody serves the request's status and headers (Content-Length included),
// then drops the connection before the first byte of the body: a server that
// accepts every (re)connection and resets it every time.
func cutBody(w http.ResponseWriter, r *http.Request, next http.Handler) {
	rec := httptest.NewRecorder()
	next.ServeHTTP(rec, r)
	for k, v := range rec.Header() {
		w.Header()[k] = v
	}
	w.Header().Set("Content-Length", strconv.Itoa(rec.Body.Len()))
	w.WriteHeader(rec.Code)
	w.(http.Flusher).Flush()
	panic(http.ErrAbortHandler) // the server closes the connection, quietly
}

// TestGCSFaultBodyCutEveryTime: reads whose body is cut after the headers,
// on every connection, end in a clear error naming bucket and object after
// the configured attempts — never in a download that reconnects forever.
func TestGCSFaultBodyCutEveryTime(t *testing.T) {
	ctx := context.Background()
	// The client library reconnects by itself, without limit and without
	// backoff, while a body breaks before its first byte; only the stall
	// timeout ends that, so it is short here.
	opts := testGCSOptions()
	opts.PartSize = 256 << 10
	opts.StallTimeout = 250 * time.Millisecond
	opts.MaxAttempts = 3
	for _, tc := range []struct {
		name  string
		match func(*http.Request) bool
	}{
		{"manifest", func(r *http.Request) bool { return isMediaRead(r) && strings.Contains(r.URL.Path, ".manifest") }},
		{"ranged", func(r *http.Request) bool { return isMediaRead(r) && strings.Contains(r.URL.Path, "big.bin") }},
		{"whole", func(r *http.Request) bool { return isMediaRead(r) && strings.Contains(r.URL.Path, "array_0") }},
		{"every", isMediaRead},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, b, tree, src := faultSetup(t, nil)
			require.NoError(t, uploadFaultTree(b, src))
			b.Store = f.store(t, "bk", opts) // short options for the download only
			rule := f.faults.add(1<<30, tc.match, cutBody)
			parent := t.TempDir()
			dest := filepath.Join(parent, "restored")
			req := DownloadRequest{Job: testJob, Backup: faultBackup, Hash: fakeHash(true, "fault"), Dest: dest}
			start := time.Now()
			err := b.Download(ctx, req)
			require.Error(t, err, "a download whose bodies never arrive must fail")
			assert.Less(t, time.Since(start), 30*time.Second, "bounded attempts, not an endless reconnect loop")
			assert.Contains(t, err.Error(), "giving up after 3 attempts", "the error says it gave up")
			assert.Contains(t, err.Error(), "gs://mtcfs-test/bk/", "the error names bucket and object")
			assert.Positive(t, f.faults.hits(rule))
			t.Logf("%d broken responses: %v", f.faults.hits(rule), err)
			entries, err := os.ReadDir(parent)
			require.NoError(t, err)
			assert.Empty(t, entries, "a failed download leaves nothing behind")

			f.faults.clear()
			require.NoError(t, b.Download(ctx, req), "the next download is clean")
			got := readTree(t, dest)
			for k, v := range tree {
				assert.True(t, got[k] == v, "restored %s differs", k)
			}
		})
	}
}

// TestGCSFaultOpenBodyCutEveryTime: the same through Open, whose reader
// resumes after errors: it resumes a bounded number of times, backing off.
func TestGCSFaultOpenBodyCutEveryTime(t *testing.T) {
	ctx := context.Background()
	f := newFakeGCS(t)
	data := randomBytes(300<<10, 9)
	put(t, f.store(t, "p", testGCSOptions()), "obj", string(data))
	opts := testGCSOptions()
	opts.StallTimeout = 250 * time.Millisecond
	opts.MaxAttempts = 3
	s := f.store(t, "p", opts)
	for _, tc := range []struct {
		name        string
		off, length int64
	}{{"whole", 0, -1}, {"ranged", 1000, 5000}} {
		t.Run(tc.name, func(t *testing.T) {
			// The open itself succeeds; every body, the first one included, breaks.
			rule := f.faults.add(1<<30, isMediaRead, cutBody)
			defer f.faults.clear()
			r, err := s.Open(ctx, "obj", tc.off, tc.length)
			require.NoError(t, err)
			defer r.Close()
			start := time.Now()
			_, err = io.ReadAll(r)
			require.Error(t, err)
			assert.Less(t, time.Since(start), 30*time.Second, "bounded attempts, not an endless reconnect loop")
			assert.Contains(t, err.Error(), "read gs://mtcfs-test/p/obj")
			assert.Contains(t, err.Error(), "giving up after 3 attempts")
			assert.Positive(t, f.faults.hits(rule))
			t.Logf("%d broken responses: %v", f.faults.hits(rule), err)
		})
	}
}

// TestGCSFaultOpenHonoursItsContext: a server that does not answer holds Open only as long as
// its context, as ObjectStore.Open promises; the reader of an open that succeeded outlives it.
// Before, the open was cut loose from the context: a restore plan bounded to 20 s waited for a
// location that did not answer as long as the attempts took (here 3 of a minute each).
func TestGCSFaultOpenHonoursItsContext(t *testing.T) {
	f := newFakeGCS(t)
	put(t, f.store(t, "p", testGCSOptions()), "obj", "pinned")
	opts := testGCSOptions()
	opts.StallTimeout = time.Minute
	opts.MaxAttempts = 3
	s := f.store(t, "p", opts)

	rule := f.faults.add(1<<30, isMediaRead, stall(time.Hour))
	ctx, cancel := context.WithTimeoutCause(context.Background(), 100*time.Millisecond, errors.New("no answer within 100ms"))
	defer cancel()
	r, err := s.Open(ctx, "obj", 0, -1)
	require.Error(t, err)
	assert.Nil(t, r)
	assert.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Contains(t, err.Error(), "open gs://mtcfs-test/p/obj: no answer within 100ms")
	assert.Positive(t, f.faults.hits(rule))
	f.faults.clear()

	// A server that sends the headers and then stalls the body holds ReadSmall only as long as
	// its context too (the reader itself outlives the context: the read must not).
	stallBody := func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		rec := httptest.NewRecorder()
		next.ServeHTTP(rec, r)
		for k, v := range rec.Header() {
			w.Header()[k] = v
		}
		w.WriteHeader(rec.Code)
		w.Write(rec.Body.Bytes()[:1])
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	}
	rule = f.faults.add(1<<30, isMediaRead, stallBody)
	ctx, cancel = context.WithTimeoutCause(context.Background(), 100*time.Millisecond, errors.New("no answer within 100ms"))
	defer cancel()
	_, err = ReadSmall(ctx, s, "obj", 1<<10)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "read obj: no answer within 100ms")
	assert.Positive(t, f.faults.hits(rule))
	f.faults.clear()

	// Answered, the reader is not cancelled with the context it was opened under.
	ctx, cancel = context.WithCancel(context.Background())
	r, err = s.Open(ctx, "obj", 0, -1)
	require.NoError(t, err)
	cancel()
	data, err := io.ReadAll(r)
	require.NoError(t, err)
	assert.Equal(t, "pinned", string(data))
	require.NoError(t, r.Close())
}

// TestGCSFaultRestorePinAnswerLost: a restore pin written (or removed) whose every answer was
// lost (the connection reset after the request went through) took effect: SetRestoreVersion and
// ClearRestoreVersion read the pin back and succeed, where `mtcfs restore-version` said the
// change failed, exit 1, and the operator, told so, left a pin in place (a black-box run). A
// change that did not go through still fails.
func TestGCSFaultRestorePinAnswerLost(t *testing.T) {
	ctx := context.Background()
	f := newFakeGCS(t)
	b := &Backups{Store: f.store(t, "jobs", testGCSOptions())}
	const job, backup = "train", "2026-12-07_10-00"

	lost := f.faults.add(1<<30, uploadOf(restoreVersionName), serveThen(http.StatusServiceUnavailable))
	require.NoError(t, b.SetRestoreVersion(ctx, job, backup), "every answer lost, the pin written")
	assert.NotZero(t, f.faults.hits(lost))
	pin, pinned, err := b.ReadRestoreVersion(ctx, job)
	require.NoError(t, err)
	assert.True(t, pinned)
	assert.Equal(t, backup, pin)

	f.faults.clear()
	isDelete := func(r *http.Request) bool {
		return r.Method == http.MethodDelete && strings.Contains(r.URL.Path, restoreVersionName)
	}
	lost = f.faults.add(1<<30, isDelete, serveThen(http.StatusServiceUnavailable))
	require.NoError(t, b.ClearRestoreVersion(ctx, job), "every answer lost, the pin removed")
	assert.NotZero(t, f.faults.hits(lost))
	_, pinned, err = b.ReadRestoreVersion(ctx, job)
	require.NoError(t, err)
	assert.False(t, pinned)

	f.faults.clear()
	f.faults.add(1<<30, uploadOf(restoreVersionName), respond(http.StatusServiceUnavailable))
	require.Error(t, b.SetRestoreVersion(ctx, job, backup), "a write that never went through")
	_, pinned, err = b.ReadRestoreVersion(ctx, job)
	require.NoError(t, err)
	assert.False(t, pinned)
}

// TestGCSFaultOutageLongerThanTheAttempts: every read fails with 503 for longer than the
// attempts last. With the attempts alone, the download gives up (with the default backoff, an
// outage of 20 s failed a restore after 11 s in a black-box run); with RetryFor it goes on
// trying for that long, and the download completes once the location answers again.
func TestGCSFaultOutageLongerThanTheAttempts(t *testing.T) {
	ctx := context.Background()
	f, b, tree, src := faultSetup(t, nil)
	require.NoError(t, uploadFaultTree(b, src))
	for _, retryFor := range []time.Duration{-1, 3 * time.Second} {
		opts := testGCSOptions()
		opts.PartSize = 256 << 10
		opts.MaxAttempts = 2
		opts.RetryFor = retryFor
		b.Store = f.store(t, "bk", opts)
		rule := f.faults.add(1<<30, isMediaRead, respond(http.StatusServiceUnavailable))
		go func() { time.Sleep(500 * time.Millisecond); f.faults.clear() }() // the outage ends
		dest := filepath.Join(t.TempDir(), "restored")
		err := b.Download(ctx, DownloadRequest{Job: testJob, Backup: faultBackup, Hash: fakeHash(true, "fault"), Dest: dest})
		assert.Positive(t, f.faults.hits(rule))
		if retryFor < 0 {
			require.Error(t, err, "two attempts, 40 ms apart at most, end inside the outage")
			assert.Contains(t, err.Error(), "giving up after 2 attempts")
			time.Sleep(time.Second) // the outage is over
			continue
		}
		require.NoError(t, err, "tried until the outage was over")
		got := readTree(t, dest)
		for k, v := range tree {
			assert.True(t, got[k] == v, "restored %s differs", k)
		}
	}
}
