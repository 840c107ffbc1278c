package gcsbackend

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math/rand/v2"
	"mime"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"cloud.google.com/go/storage"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sync/semaphore"
	"google.golang.org/api/option"

	"github.com/mtcfs/mtcfs/layout"
)

const testBucket = "mtcfs-test"

// fakeGCS is an in-memory GCS (gcsFake) reached over loopback HTTP
// through faults, which can break chosen requests.
type fakeGCS struct {
	srv       *gcsFake
	url       string
	faults    *faultInjector
	client    *storage.Client
	transport *http.Transport
}

// newFakeGCS starts a fake GCS with one empty bucket, testBucket. Server,
// proxy and client are closed when t ends.
func newFakeGCS(t *testing.T) *fakeGCS {
	t.Helper()
	srv := newGCSFake(testBucket)
	faults := &faultInjector{next: srv}
	ts := httptest.NewServer(faults)
	t.Cleanup(ts.Close)
	transport := &http.Transport{MaxIdleConnsPerHost: 64}
	t.Cleanup(transport.CloseIdleConnections)
	client, err := storage.NewClient(context.Background(),
		option.WithEndpoint(ts.URL+"/storage/v1/"),
		option.WithHTTPClient(&http.Client{Transport: transport}),
		storage.WithJSONReads())
	require.NoError(t, err)
	t.Cleanup(func() { client.Close() })
	return &fakeGCS{srv: srv, url: ts.URL, faults: faults, client: client, transport: transport}
}

// testGCSOptions keep tests fast: small parts, short stalls and backoffs,
// and a short per-name write interval.
func testGCSOptions() GCSOptions {
	return GCSOptions{
		StallTimeout:      10 * time.Second, // the stall tests set their own
		MaxAttempts:       6,
		RetryFor:          -1, // MaxAttempts alone; TestGCSFaultOutageLongerThanTheAttempts sets it
		BackoffInitial:    5 * time.Millisecond,
		BackoffMax:        40 * time.Millisecond,
		PartSize:          1 << 20,
		NameWriteInterval: 10 * time.Millisecond,
	}
}

func (f *fakeGCS) store(t *testing.T, prefix string, opts GCSOptions) *gcsStore {
	t.Helper()
	s, err := NewGCS(f.client, testBucket, prefix, opts)
	require.NoError(t, err)
	return s.(*gcsStore)
}

func newTestFakeGCS(t *testing.T) ObjectStore {
	return newFakeGCS(t).store(t, "backups/test", testGCSOptions())
}

// faultInjector passes requests to next, except those a rule claims.
type faultInjector struct {
	next  http.Handler
	mu    sync.Mutex
	rules []*faultRule // GUARDED_BY(mu)
}

// faultRule breaks the next `times` requests that match.
type faultRule struct {
	match func(r *http.Request) bool
	times int // GUARDED_BY(faultInjector.mu)
	hits  int // GUARDED_BY(faultInjector.mu)
	do    func(w http.ResponseWriter, r *http.Request, next http.Handler)
}

func (f *faultInjector) add(times int, match func(*http.Request) bool, do func(http.ResponseWriter, *http.Request, http.Handler)) *faultRule {
	f.mu.Lock()
	defer f.mu.Unlock()
	r := &faultRule{match: match, times: times, do: do}
	f.rules = append(f.rules, r)
	return r
}

// clear removes every rule.
func (f *faultInjector) clear() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.rules = nil
}

// hits is how many requests the rule has broken.
func (f *faultInjector) hits(r *faultRule) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return r.hits
}

func (f *faultInjector) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	var rule *faultRule
	for _, x := range f.rules {
		if x.hits < x.times && x.match(r) {
			x.hits++
			rule = x
			break
		}
	}
	f.mu.Unlock()
	if rule == nil {
		f.next.ServeHTTP(w, r)
		return
	}
	rule.do(w, r, f.next)
}

func anyRequest(*http.Request) bool { return true }

func isUpload(r *http.Request) bool { return strings.HasPrefix(r.URL.Path, "/upload/") }

func isMediaRead(r *http.Request) bool {
	return r.Method == http.MethodGet && r.URL.Query().Get("alt") == "media"
}

func isCompose(r *http.Request) bool { return strings.HasSuffix(r.URL.Path, "/compose") }

// uploadOf matches uploads of objects whose name contains s.
func uploadOf(s string) func(*http.Request) bool {
	return func(r *http.Request) bool { return isUpload(r) && strings.Contains(r.URL.Query().Get("name"), s) }
}

// respond answers with a JSON API error, as GCS does.
func respond(code int) func(http.ResponseWriter, *http.Request, http.Handler) {
	return func(w http.ResponseWriter, r *http.Request, _ http.Handler) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		fmt.Fprintf(w, `{"error":{"code":%d,"message":"injected %d"}}`, code, code)
	}
}

// stall holds the request for d (or until the client gives up), then
// serves it.
func stall(d time.Duration) func(http.ResponseWriter, *http.Request, http.Handler) {
	return func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		// The server notices a client hanging up only once the body is read.
		body, _ := io.ReadAll(r.Body)
		r.Body = io.NopCloser(bytes.NewReader(body))
		select {
		case <-time.After(d):
			next.ServeHTTP(w, r)
		case <-r.Context().Done():
		}
	}
}

// serveThen serves the request, discards the answer and replies code
// instead: the write happened, its acknowledgement was lost.
func serveThen(code int) func(http.ResponseWriter, *http.Request, http.Handler) {
	return func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		next.ServeHTTP(httptest.NewRecorder(), r)
		respond(code)(w, r, nil)
	}
}

// corruptRequest flips one byte of the uploaded bytes: the last one before
// the closing delimiter of a multipart upload (its metadata part stays
// intact), else the middle one of the request body.
func corruptRequest(w http.ResponseWriter, r *http.Request, next http.Handler) {
	body, _ := io.ReadAll(r.Body)
	i := len(body) / 2
	if _, params, err := mime.ParseMediaType(r.Header.Get("Content-Type")); err == nil && params["boundary"] != "" {
		i = bytes.LastIndex(body, []byte("\r\n--"+params["boundary"]+"--")) - 1
	}
	if i >= 0 && i < len(body) {
		body[i] ^= 0x5a
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.ContentLength = int64(len(body))
	next.ServeHTTP(w, r)
}

// corruptResponse flips one byte in the middle of the response body.
func corruptResponse(w http.ResponseWriter, r *http.Request, next http.Handler) {
	rec := httptest.NewRecorder()
	next.ServeHTTP(rec, r)
	body := rec.Body.Bytes()
	if len(body) > 0 {
		body[len(body)/2] ^= 0x5a
	}
	for k, v := range rec.Header() {
		w.Header()[k] = v
	}
	w.WriteHeader(rec.Code)
	w.Write(body)
}

// TestVerifyReadsAgainBytesDamagedOnTheWay: a deep verify whose read of an object comes back
// damaged once (a fault on the way, not in the store) reads it again and finds the backup
// complete; it called the intact backup DAMAGED (a black-box run with a proxy flipping bits). A
// read damaged differently each time is an error of the verify (verify again later), not damage.
func TestVerifyReadsAgainBytesDamagedOnTheWay(t *testing.T) {
	f := newFakeGCS(t)
	s := f.store(t, "backups/test", testGCSOptions())
	b := &Backups{Store: s, Parallelism: 3}
	const backup = "2025-06-30_14-30"
	uploadStep(t, b, backup, 100, 2, 1)
	dataRead := func(r *http.Request) bool { return isMediaRead(r) && strings.Contains(r.URL.Path, ".data/") }
	once := f.faults.add(1, dataRead, corruptResponse)
	rep := verify(t, b, backup, VerifyOptions{Deep: true})
	assertAllHit(t, f, once)
	require.False(t, rep.Damaged(), "%+v", rep)
	for _, st := range rep.Steps {
		assert.True(t, st.Complete, "step %d: %q", st.Step, st.Problems)
	}

	f.faults.clear()
	n := 0
	f.faults.add(1<<30, dataRead, func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		rec := httptest.NewRecorder()
		next.ServeHTTP(rec, r)
		body := rec.Body.Bytes()
		f.faults.mu.Lock()
		n++
		if len(body) > 0 {
			body[n%len(body)] ^= 0x5a // another byte each time
		}
		f.faults.mu.Unlock()
		for k, v := range rec.Header() {
			w.Header()[k] = v
		}
		w.WriteHeader(rec.Code)
		w.Write(body)
	})
	_, err := b.Verify(context.Background(), testJob, backup, VerifyOptions{Deep: true})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "differ from one read to the next")
}

// randomBytes returns n pseudo-random bytes (seeded: reproducible).
func randomBytes(n int, seed uint64) []byte {
	b := make([]byte, n)
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	for i := 0; i+8 <= n; i += 8 {
		v := r.Uint64()
		for j := range 8 {
			b[i+j] = byte(v >> (8 * j))
		}
	}
	return b
}

func TestCRC32CCombine(t *testing.T) {
	data := randomBytes(1<<20+13, 1)
	for _, split := range []int{0, 1, 7, 4096, 1 << 19, len(data) - 1, len(data)} {
		a, b := data[:split], data[split:]
		got := crc32cCombine(crcOf(a), crcOf(b), int64(len(b)))
		assert.Equal(t, crcOf(data), got, "combine at %d of %d", split, len(data))
	}
	// Many parts, folded in order, as the ranged transfers do.
	var parts []part
	for off := 0; off < len(data); off += 100_000 {
		p := data[off:min(off+100_000, len(data))]
		parts = append(parts, part{size: int64(len(p)), crc: crc32.Checksum(p, crcTable)})
	}
	assert.Equal(t, crcOf(data), combineParts(parts))
}

func TestGCSOptionDefaults(t *testing.T) {
	o := GCSOptions{}.withDefaults()
	assert.Equal(t, time.Second, o.NameWriteInterval, "GCS allows one write per second per object name")
	assert.Equal(t, int64(DefaultGCSPartSize), o.PartSize)
	assert.Equal(t, 2*o.PartSize, o.ParallelThreshold)
	assert.Positive(t, o.StallTimeout)
	assert.Positive(t, o.MaxAttempts)
}

func TestGCSStoreNamesAndPrefix(t *testing.T) {
	ctx := context.Background()
	f := newFakeGCS(t)
	s := f.store(t, "a/b", testGCSOptions())
	assert.Equal(t, "gs://mtcfs-test/a/b", s.String())
	put(t, s, "job/x", "x")
	// The object is "<prefix>/<name>" in the bucket.
	obj, ok := f.srv.object(testBucket, "a/b/job/x")
	require.True(t, ok, "the prefix is prepended to object names")
	assert.Equal(t, "x", string(obj))

	// A store on the bucket root sees it under the full name.
	root := f.store(t, "", testGCSOptions())
	assert.Equal(t, "gs://mtcfs-test", root.String())
	assert.Equal(t, []string{"a/b/job/x"}, listAll(t, root))
	_, prefixes, err := root.List(ctx, "", "/")
	require.NoError(t, err)
	assert.Equal(t, []string{"a/"}, prefixes)

	_, err = s.Stat(ctx, "job/absent")
	var nf *NotFoundError
	require.True(t, errors.As(err, &nf), "want *NotFoundError, got %v", err)
	assert.Contains(t, nf.Err.Error(), "gs://mtcfs-test/a/b/job/absent", "the error names bucket and object")

	_, err = NewGCS(f.client, "No_Such Bucket", "", GCSOptions{})
	assert.ErrorContains(t, err, "bucket name")
}

func TestGCSMissingBucket(t *testing.T) {
	f := newFakeGCS(t)
	s, err := NewGCS(f.client, "no-such-bucket", "p", testGCSOptions())
	require.NoError(t, err)
	err = PutBytes(context.Background(), s, "x", []byte("x"), true)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "no-such-bucket", "the error names the bucket")
}

// TestGCSListHidesTemporaryObjects: parts of an upload in progress (or left
// by a crash) are not objects.
func TestGCSListHidesTemporaryObjects(t *testing.T) {
	f := newFakeGCS(t)
	s := f.store(t, "p", testGCSOptions())
	put(t, s, "d/real", "r")
	f.srv.put(testBucket, "p/"+tempPrefix+"abc/00000", []byte("part"))
	f.srv.put(testBucket, "p/d/"+tempPrefix+"x", []byte("part"))
	assert.Equal(t, []string{"d/real"}, listAll(t, s))
	objs, prefixes, err := s.List(context.Background(), "", "/")
	require.NoError(t, err)
	assert.Empty(t, objs)
	assert.Equal(t, []string{"d/"}, prefixes)
}

// TestGCSNameWriteInterval: a second write to one name waits out the
// interval (GCS: one write per second per name), counted from the end of
// the previous write: each upload here takes 100 ms at the server, so an
// interval counted from the previous write's start would leave the server
// only 200 ms between the end of one and the arrival of the next. Two writes
// started at once are spaced the same way.
func TestGCSNameWriteInterval(t *testing.T) {
	f := newFakeGCS(t)
	opts := testGCSOptions()
	opts.NameWriteInterval = 300 * time.Millisecond
	s := f.store(t, "", opts)
	var mu sync.Mutex
	var arrivals, ends []time.Time
	var took atomic.Int64 // how long an upload takes at the server
	took.Store(int64(100 * time.Millisecond))
	f.faults.add(1000, uploadOf("same"), func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		mu.Lock()
		arrivals = append(arrivals, time.Now())
		mu.Unlock()
		time.Sleep(time.Duration(took.Load()))
		next.ServeHTTP(w, r)
		mu.Lock()
		ends = append(ends, time.Now())
		mu.Unlock()
	})
	for i := range 3 {
		put(t, s, "same", fmt.Sprint("version ", i))
	}
	put(t, s, "other", "not limited by same")
	// Two writes at once, each longer than the interval: the second waits for the first to
	// end, then for the interval (it would otherwise start while the first still runs).
	took.Store(int64(opts.NameWriteInterval + 100*time.Millisecond))
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i := range 2 {
		wg.Go(func() { errs[i] = PutBytes(t.Context(), s, "same", []byte(fmt.Sprint("at once ", i)), false) })
	}
	wg.Wait()
	require.NoError(t, errors.Join(errs...))
	mu.Lock()
	defer mu.Unlock()
	// The second of the two may upload twice: it read the object's generation before the
	// first replaced it, and its conditional write then retries against the new one.
	require.GreaterOrEqual(t, len(arrivals), 5)
	for i := 1; i < len(arrivals); i++ {
		assert.GreaterOrEqual(t, arrivals[i].Sub(ends[i-1]), opts.NameWriteInterval,
			"write %d to the same name came too soon after the previous one ended", i)
	}
	assert.Contains(t, readRange(t, s, "same", 0, -1), "at once ")
}

// bigTree writes a checkpoint tree with two large files (which go through
// composite upload and ranged download with small parts) and returns it.
func bigTree(t *testing.T, root string, bigSize, oddSize int) map[string]string {
	t.Helper()
	tree := slotTree(7, Slot{0, 0})
	tree["state/big.bin"] = string(randomBytes(bigSize, 42))
	tree["state/odd.bin"] = string(randomBytes(oddSize, 43)) // not a multiple of the part size
	writeTree(t, root, tree)
	return tree
}

// roundTrip uploads a tree as step 7 of slot n0-w0, checks that Verify
// (shallow and deep) calls it complete, downloads it and compares.
func roundTrip(t *testing.T, b *Backups, tree map[string]string, src string) {
	t.Helper()
	ctx := context.Background()
	const backup = "2026-01-02_03-04"
	h := fakeHash(true, "big "+t.Name())
	var calls []int64
	var mu sync.Mutex
	// The owners and modes the agent keeps beside the data go with it, and come back beside it.
	attrs := layout.NewAttrsBuilder(layout.Attr{Mode: 0o700, UID: 1000, GID: 1000}, true).Attrs()
	require.NoError(t, layout.WriteAttrs(src, attrs))
	err := b.Upload(ctx, UploadRequest{Job: testJob, Backup: backup, Step: 7, Slot: Slot{0, 0}, Hash: h, Source: src,
		Progress: func(done, total int64) { mu.Lock(); calls = append(calls, done); mu.Unlock() }})
	require.NoError(t, err)
	assertProgress(t, calls, treeBytes(tree), tree)
	// A retry (or another node with the same data) writes the attrs again: not create-if-absent.
	require.NoError(t, b.Upload(ctx, UploadRequest{Job: testJob, Backup: backup, Step: 7, Slot: Slot{0, 0}, Hash: h, Source: src}))
	for _, deep := range []bool{false, true} {
		rep := verify(t, b, backup, VerifyOptions{Nodes: 1, Workers: 1, Deep: deep})
		require.Len(t, rep.Steps, 1)
		assert.True(t, rep.Steps[0].Complete, "deep=%v: %v", deep, rep.Steps[0].Problems)
	}
	dest := filepath.Join(t.TempDir(), "restored")
	calls = nil
	require.NoError(t, b.Download(ctx, DownloadRequest{Job: testJob, Backup: backup, Hash: h, Dest: dest,
		Progress: func(done, total int64) { mu.Lock(); calls = append(calls, done); mu.Unlock() }}))
	assertProgress(t, calls, treeBytes(tree), tree)
	assert.NoFileExists(t, layout.AttrsFile(dest), "not asked for")
	kept := filepath.Join(t.TempDir(), "kept")
	require.NoError(t, b.Download(ctx, DownloadRequest{Job: testJob, Backup: backup, Hash: h, Dest: kept, Attrs: true}))
	gotAttrs, err := layout.ReadAttrs(kept)
	require.NoError(t, err)
	assert.Equal(t, attrs, gotAttrs)
	got := readTree(t, dest)
	require.Equal(t, len(tree), len(got))
	for k, v := range tree {
		assert.True(t, got[k] == v, "restored %s differs", k) // not Equal: 40 MiB diffs
	}
}

func treeBytes(tree map[string]string) int64 {
	var n int64
	for _, v := range tree {
		n += int64(len(v))
	}
	return n
}

// TestGCSBackupRoundTrip: Upload → Verify → Download of a multi-file tree
// with a 40 MiB file on the emulator, and no temporary object left behind.
func TestGCSBackupRoundTrip(t *testing.T) {
	f := newFakeGCS(t)
	s := f.store(t, "bk", testGCSOptions())
	b := &Backups{Store: s, Parallelism: 4}
	src := t.TempDir()
	tree := bigTree(t, src, 40<<20, 3<<20+5)
	composes := f.faults.add(1<<30, isCompose, func(w http.ResponseWriter, r *http.Request, next http.Handler) { next.ServeHTTP(w, r) })
	ranged := f.faults.add(1<<30, func(r *http.Request) bool { return isMediaRead(r) && r.Header.Get("Range") != "" },
		func(w http.ResponseWriter, r *http.Request, next http.Handler) { next.ServeHTTP(w, r) })
	roundTrip(t, b, tree, src)
	// 40 parts of 1 MiB: two levels of compose, and one for odd.bin.
	assert.Equal(t, 2+1+1, f.faults.hits(composes), "composite uploads: want 2 intermediate + 1 final compose for big.bin, 1 for odd.bin")
	assert.GreaterOrEqual(t, f.faults.hits(ranged), 40+4, "big files must be read in ranges")
	assertNoTemporaryObjects(t, f)
}

func assertNoTemporaryObjects(t *testing.T, f *fakeGCS) {
	t.Helper()
	for _, name := range f.srv.names(testBucket) {
		assert.NotContains(t, name, tempPrefix, "temporary object left behind")
	}
}

// TestGCSCompositeUploadCannotReplace: a composite upload onto an existing
// name with other content fails with *PreconditionError and leaves it.
func TestGCSCompositeUploadCannotReplace(t *testing.T) {
	ctx := context.Background()
	f := newFakeGCS(t)
	s := f.store(t, "", testGCSOptions())
	data := randomBytes(3<<20, 5)
	file := filepath.Join(t.TempDir(), "f")
	require.NoError(t, os.WriteFile(file, data, 0o600))
	fh, err := os.Open(file)
	require.NoError(t, err)
	defer fh.Close()
	tr := FileTransfer{Name: "obj", File: fh, Size: int64(len(data)), Requests: semaphore.NewWeighted(3)}
	crc, err := s.PutFile(ctx, tr)
	require.NoError(t, err)
	assert.Equal(t, crcOf(data), crc)
	_, err = s.PutFile(ctx, tr)
	require.NoError(t, err, "the same bytes again are a successful retry")

	put(t, s, "other", "x")
	other := tr
	other.Name = "other"
	uploads := f.faults.add(1<<30, isUpload, func(w http.ResponseWriter, r *http.Request, next http.Handler) { next.ServeHTTP(w, r) })
	_, err = s.PutFile(ctx, other)
	var pe *PreconditionError
	assert.True(t, errors.As(err, &pe), "want *PreconditionError, got %v", err)
	assert.Zero(t, f.faults.hits(uploads), "the store looks before it uploads any part (GCS would refuse the compose too)")
	assert.Equal(t, "x", readRange(t, s, "other", 0, -1))
	assertNoTemporaryObjects(t, f)
}

func skipWithoutRealGCS(t *testing.T) {
	if os.Getenv("MTCFS_TEST_GCS_BUCKET") == "" {
		t.Skip("MTCFS_TEST_GCS_BUCKET is not set: set it to bucket[/prefix] (Application Default Credentials, roles/storage.objectUser) to run the conformance suite against real GCS")
	}
}

// newTestRealGCS returns a store on a fresh prefix of the real bucket named by
// MTCFS_TEST_GCS_BUCKET (bucket or bucket/prefix; Application Default
// Credentials), emptied when t ends. Without the variable the test is skipped.
func newTestRealGCS(t *testing.T) ObjectStore {
	t.Helper()
	skipWithoutRealGCS(t)
	loc := os.Getenv("MTCFS_TEST_GCS_BUCKET")
	bucket, base, _ := strings.Cut(loc, "/")
	client, err := storage.NewClient(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { client.Close() })
	var rnd [6]byte
	for i := range rnd {
		rnd[i] = byte(rand.Uint32())
	}
	prefix := strings.Trim(base+"/mtcfs-test-"+fmt.Sprintf("%x", rnd), "/")
	opts := GCSOptions{PartSize: 1 << 20}
	s, err := NewGCS(client, bucket, prefix, opts)
	require.NoError(t, err)
	t.Cleanup(func() {
		root, err := NewGCS(client, bucket, prefix, GCSOptions{})
		if err != nil {
			return
		}
		c := root.(*gcsStore)
		ctx := context.Background()
		it := client.Bucket(bucket).Objects(ctx, &storage.Query{Prefix: prefix + "/"})
		for {
			o, err := it.Next()
			if err != nil {
				return
			}
			c.deleteKey(ctx, o.Name, o.Name, 0)
		}
	})
	return s
}

// TestBackupsOnGCSFake runs the Backups tests that do not reach
// into file:// internals against the emulator.
func TestBackupsOnGCSFake(t *testing.T) {
	for _, tc := range []struct {
		name string
		test func(*testing.T)
	}{
		{"UploadVerifyComplete", TestUploadVerifyComplete},
		{"ManifestIsDeterministic", TestManifestIsDeterministic},
		{"MissingDataMakesBackupIncomplete", TestMissingDataMakesBackupIncomplete},
		{"MissingMetaMakesBackupIncomplete", TestMissingMetaMakesBackupIncomplete},
		{"MissingHighestRank", TestMissingHighestRank},
		{"HighestCompleteStepWithinBackup", TestHighestCompleteStepWithinBackup},
		{"DownloadRoundTrip", TestDownloadRoundTrip},
		{"UploadWritesMetaLast", TestUploadWritesMetaLast},
		{"FailedUploadLeavesNoMeta", TestFailedUploadLeavesNoMeta},
		{"UploadDataParallelMetaOnly", TestUploadDataParallelMetaOnly},
		{"ConcurrentUploadsOfIdenticalData", TestConcurrentUploadsOfIdenticalData},
		{"UploadRejectsBadRequests", TestUploadRejectsBadRequests},
		{"NamesAndListOrder", TestNamesAndListOrder},
		{"RestoreVersion", TestRestoreVersion},
	} {
		runOnStore(t, tc.name, newTestFakeGCS, tc.test)
	}
}

// TestOpenGSWithEmulatorEnv: Open("gs://…") creates the shared client on
// first use, honouring STORAGE_EMULATOR_HOST (and reading through the JSON
// API, which the emulator needs).
func TestOpenGSWithEmulatorEnv(t *testing.T) {
	srv := newGCSFake("env-bucket")
	ts := httptest.NewServer(srv)
	t.Cleanup(ts.Close)
	t.Setenv("STORAGE_EMULATOR_HOST", strings.TrimPrefix(ts.URL, "http://"))
	resetShared := func() {
		sharedClient.mu.Lock()
		defer sharedClient.mu.Unlock()
		if sharedClient.c != nil {
			sharedClient.c.Close()
			sharedClient.c = nil
		}
	}
	resetShared()
	t.Cleanup(resetShared)

	s, err := Open("gs://env-bucket/some/prefix")
	require.NoError(t, err)
	put(t, s, "a/b", "through the environment")
	assert.Equal(t, "through the environment", readRange(t, s, "a/b", 0, -1))
	assert.Equal(t, "ough", readRange(t, s, "a/b", 3, 4))
	obj, ok := srv.object("env-bucket", "some/prefix/a/b")
	require.True(t, ok)
	assert.Equal(t, "through the environment", string(obj))
}

// TestGCSNoGoroutineLeak: transfers that succeed, fail on the source, stall
// and are abandoned, or read partly and close leave no goroutine behind once
// the idle connections are closed.
func TestGCSNoGoroutineLeak(t *testing.T) {
	ctx := context.Background()
	f := newFakeGCS(t)
	s := f.store(t, "", testGCSOptions())
	opts := testGCSOptions()
	opts.StallTimeout = 200 * time.Millisecond
	opts.MaxAttempts = 2
	impatient := f.store(t, "", opts)
	put(t, s, "warm", "up") // the client's own long-lived goroutines start here
	settle := func() int {
		f.transport.CloseIdleConnections()
		time.Sleep(50 * time.Millisecond)
		return runtime.NumGoroutine()
	}
	before := settle()

	b := &Backups{Store: s, Parallelism: 3}
	src := t.TempDir()
	tree := bigTree(t, src, 3<<20, 1<<20+1)
	roundTrip(t, b, tree, src)
	boom := errors.New("source failed")
	require.ErrorIs(t, s.Put(ctx, PutRequest{Name: "x", Body: io.MultiReader(strings.NewReader("abc"), &failingReader{boom}), Size: 10}), boom)
	f.faults.add(1<<30, isMediaRead, stall(time.Minute))
	_, err := impatient.Open(ctx, "warm", 0, -1)
	require.Error(t, err, "a read that never answers fails")
	f.faults.clear()
	r, err := s.Open(ctx, "warm", 0, -1)
	require.NoError(t, err)
	var one [1]byte
	_, err = r.Read(one[:])
	require.NoError(t, err)
	require.NoError(t, r.Close())

	deadline := time.Now().Add(5 * time.Second)
	after := settle()
	for after > before && time.Now().Before(deadline) {
		after = settle()
	}
	if after > before {
		buf := make([]byte, 1<<20)
		t.Fatalf("%d goroutines before, %d after:\n%s", before, after, buf[:runtime.Stack(buf, true)])
	}
}

// countingSeeker counts the bytes read through it.
type countingSeeker struct {
	*bytes.Reader
	n int64
}

func (c *countingSeeker) Read(p []byte) (int, error) {
	n, err := c.Reader.Read(p)
	c.n += int64(n)
	return n, err
}

// TestGCSPutWithCRCReadsOnce: a seekable body whose CRC32C the caller gives
// is not read beforehand; its size and CRC32C are still checked before
// anything is published.
func TestGCSPutWithCRCReadsOnce(t *testing.T) {
	ctx := context.Background()
	s := newFakeGCS(t).store(t, "", testGCSOptions())
	data := randomBytes(100<<10, 11)
	crc := crcOf(data)
	body := &countingSeeker{Reader: bytes.NewReader(data)}
	require.NoError(t, s.Put(ctx, PutRequest{Name: "a", Body: body, Size: int64(len(data)), CRC32C: &crc}))
	assert.Equal(t, int64(len(data)), body.n, "one pass over the body")
	assert.Equal(t, string(data), readRange(t, s, "a", 0, -1))

	for _, tc := range []struct {
		name string
		size int64
	}{{"short", int64(len(data)) + 1}, {"long", int64(len(data)) - 1}} {
		err := s.Put(ctx, PutRequest{Name: "b", Body: bytes.NewReader(data), Size: tc.size, CRC32C: &crc, IfAbsent: true})
		assert.Error(t, err, tc.name)
		_, err = s.Stat(ctx, "b")
		assert.True(t, IsNotFound(err), "%s: nothing may be visible, got %v", tc.name, err)
	}
	wrong := crc ^ 1
	err := s.Put(ctx, PutRequest{Name: "b", Body: bytes.NewReader(data), Size: int64(len(data)), CRC32C: &wrong})
	var ce *ChecksumError
	assert.True(t, errors.As(err, &ce), "want *ChecksumError, got %v", err)
	_, err = s.Stat(ctx, "b")
	assert.True(t, IsNotFound(err), "nothing may be visible after a CRC mismatch, got %v", err)
}

// TestGCSPutFile: PutFile takes the file's CRC32C itself (a large file's
// from its parts, combined), returns it, and refuses a file whose size is
// not the one scanned.
func TestGCSPutFile(t *testing.T) {
	ctx := context.Background()
	f := newFakeGCS(t)
	s := f.store(t, "", testGCSOptions()) // parts of 1 MiB from 2 MiB on
	for _, size := range []int{0, 5000, 2 << 20, 3<<20 + 7} {
		t.Run(fmt.Sprint(size), func(t *testing.T) {
			data := randomBytes(size, uint64(size))
			file := filepath.Join(t.TempDir(), "f")
			require.NoError(t, os.WriteFile(file, data, 0o600))
			fh, err := os.Open(file)
			require.NoError(t, err)
			defer fh.Close()
			name := fmt.Sprintf("obj-%d", size)
			tr := FileTransfer{Name: name, File: fh, Size: int64(size), Requests: semaphore.NewWeighted(3)}
			crc, err := s.PutFile(ctx, tr)
			require.NoError(t, err)
			assert.Equal(t, crcOf(data), crc)
			o, err := s.Stat(ctx, name)
			require.NoError(t, err)
			assert.Equal(t, crcOf(data), o.CRC32C)
			assert.Equal(t, int64(size), o.Size)

			for _, tc := range []struct {
				name string
				size int64
			}{{"shrank", int64(size) + 1}, {"grew", int64(size) - 1}} {
				if tc.size < 0 {
					continue
				}
				tr := tr
				tr.Name, tr.Size = name+"-"+tc.name, tc.size
				_, err := s.PutFile(ctx, tr)
				require.Error(t, err, tc.name)
				assert.Contains(t, err.Error(), "changed size", tc.name)
				_, err = s.Stat(ctx, tr.Name)
				assert.True(t, IsNotFound(err), "%s: nothing may be visible, got %v", tc.name, err)
			}
			assertNoTemporaryObjects(t, f)
		})
	}
}

// TestVerifyReportsBitRotTheStoreCatches: data objects whose bytes changed under the CRC32C
// the store keeps (bit rot) make the client's read fail at the object's end. Deep verify
// reports each as damage and goes on; it stopped at the first with "error" (found by a
// black-box run). A plain read of such an object is a *ChecksumError.
func TestVerifyReportsBitRotTheStoreCatches(t *testing.T) {
	f := newFakeGCS(t)
	s := f.store(t, "backups/test", testGCSOptions())
	b := &Backups{Store: s, Parallelism: 3}
	const backup = "2025-06-30_14-30"
	uploadStep(t, b, backup, 100, 2, 1)
	var rotted []string
	f.srv.mu.Lock()
	for name, o := range f.srv.buckets[testBucket] {
		if strings.Contains(name, ".data/") && len(o.data) > 0 && len(rotted) < 2 {
			o.data[len(o.data)/2] ^= 0x10 // its crc stays
			rotted = append(rotted, strings.TrimPrefix(name, "backups/test/"))
		}
	}
	f.srv.mu.Unlock()
	require.Len(t, rotted, 2)

	r, err := s.Open(context.Background(), rotted[0], 0, -1)
	require.NoError(t, err)
	_, err = io.ReadAll(r)
	r.Close()
	var ce *ChecksumError
	require.ErrorAs(t, err, &ce)

	rep := verify(t, b, backup, VerifyOptions{Deep: true})
	require.True(t, rep.Damaged(), "%+v", rep)
	problems := ""
	for _, st := range rep.Steps {
		problems += strings.Join(st.Problems, "\n")
	}
	assert.Equal(t, 2, strings.Count(problems, "its bytes no longer match the crc32c the store keeps"), "each rotted object is named:\n%s", problems)
}
