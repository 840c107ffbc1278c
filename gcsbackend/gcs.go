package gcsbackend

import (
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"cloud.google.com/go/storage"
	"github.com/googleapis/gax-go/v2"
	"google.golang.org/api/googleapi"
	"google.golang.org/api/iterator"
	"google.golang.org/api/option"
)

// gcsStore is the gs://bucket[/prefix] ObjectStore: object "a/b" is the GCS
// object "<prefix>/a/b" in the bucket, the same layout as file://.
//
// Every request is retried by gcsStore itself, not by the client library
// (whose retries are switched off per handle; doc.go says which fault tests
// the library's retries and timeouts fail): one loop gives every call the
// same backoff, the same stall detection (an attempt that moves no byte for
// StallTimeout is abandoned) and the same idempotency rules:
//
//   - uploads send their CRC32C before the first byte, so GCS refuses damaged
//     bytes and nothing is published; a refusal whose bytes matched the CRC
//     on our side was damaged on the way, and is retried;
//   - create-if-absent uploads carry ifGenerationMatch=0; a 412 on a retry
//     means an earlier attempt landed, which Stat confirms (same size and
//     CRC32C) or refutes (*PreconditionError);
//   - replacing uploads carry ifGenerationMatch of the generation they saw,
//     which makes a retry of our own write idempotent: a 412 whose object
//     holds our bytes is our own earlier attempt, which landed. They are
//     last-writer-wins against other writers: a 412 whose object holds other
//     bytes means someone replaced the object since we looked, and the
//     upload replaces that version in turn, so a concurrent replacing write
//     can be overwritten. Only create-if-absent uploads never overwrite;
//   - reads pin the generation they started with, so a read resumed after an
//     error never mixes two versions of an object; a reader resumed
//     MaxAttempts times in a row without a byte gives up. (The library still
//     reopens a body that breaks mid-read by itself, without limit and
//     without backoff, whatever the retry policy: only the stall watchdog
//     ends that, so each of those attempts lasts up to StallTimeout.)
//
// GCS allows about one write per second to one object name; the store delays
// a second write to a name it wrote less than NameWriteInterval ago.
//
// Large files go through PutFile and GetFile (see gcs_transfer.go): parallel
// composite uploads and parallel ranged downloads, streamed from and to the
// local file.
type gcsStore struct {
	bucket, prefix string // prefix: "" or a valid name, without a trailing "/"
	client         func(context.Context) (*storage.Client, error)
	opts           GCSOptions
	names          nameLimiter
}

var _ ObjectStore = (*gcsStore)(nil)

// GCSOptions tunes a GCS store. The zero value gives the defaults.
type GCSOptions struct {
	// StallTimeout abandons (and retries) a request that has moved no byte
	// for this long. Default 60 s.
	StallTimeout time.Duration
	// MaxAttempts bounds the attempts of one request. Default 8.
	MaxAttempts int
	// RetryFor keeps a request that fails on errors worth retrying going past MaxAttempts
	// until this long after its first attempt. Default 2 minutes; negative: none. With
	// MaxAttempts alone, the jittered backoff gave up after as little as 11 s: an outage of
	// 20 s failed a restore, which then took an older step or none (a black-box run), where
	// waiting loses minutes and a failed restore loses the training since that step.
	RetryFor time.Duration
	// BackoffInitial and BackoffMax shape the exponential backoff between
	// attempts (with jitter). Defaults 500 ms and 16 s.
	BackoffInitial, BackoffMax time.Duration
	// PartSize is the size of the parts of a composite upload and of the
	// ranges of a parallel download. Default DefaultGCSPartSize.
	PartSize int64
	// ParallelThreshold: files of at least this size are moved in parts.
	// Default 2 × PartSize.
	ParallelThreshold int64
	// NameWriteInterval is the minimum time from the end of one write to a
	// name to the start of the next.
	// Default 1 s, GCS's documented limit.
	NameWriteInterval time.Duration
}

// DefaultGCSPartSize was chosen with bench/gcsbench (bench/RESULTS.md): on
// the emulator 32 MiB gave the fastest backup of 8–64 MiB and a restore
// within noise of the fastest; it keeps a 1 GiB file within one compose (32
// sources), and a request long enough that per-request latency does not
// matter against real GCS.
const DefaultGCSPartSize = 32 << 20

func (o GCSOptions) withDefaults() GCSOptions {
	if o.StallTimeout <= 0 {
		o.StallTimeout = 60 * time.Second
	}
	if o.MaxAttempts <= 0 {
		o.MaxAttempts = 8
	}
	if o.RetryFor == 0 {
		o.RetryFor = 2 * time.Minute
	}
	if o.BackoffInitial <= 0 {
		o.BackoffInitial = 500 * time.Millisecond
	}
	if o.BackoffMax <= 0 {
		o.BackoffMax = 16 * time.Second
	}
	if o.PartSize <= 0 {
		o.PartSize = DefaultGCSPartSize
	}
	if o.ParallelThreshold <= 0 {
		o.ParallelThreshold = 2 * o.PartSize
	}
	if o.NameWriteInterval <= 0 {
		o.NameWriteInterval = time.Second
	}
	return o
}

// NewGCS returns the store for gs://bucket/prefix using client, which the
// caller owns (and closes after the store's last use). Reads against
// fake-gcs-server need a client created with storage.WithJSONReads().
func NewGCS(client *storage.Client, bucket, prefix string, opts GCSOptions) (ObjectStore, error) {
	return newGCS(func(context.Context) (*storage.Client, error) { return client, nil }, bucket, prefix, opts)
}

func newGCS(client func(context.Context) (*storage.Client, error), bucket, prefix string, opts GCSOptions) (*gcsStore, error) {
	if err := validateBucket(bucket); err != nil {
		return nil, err
	}
	prefix = strings.TrimSuffix(prefix, "/")
	if prefix != "" {
		if err := ValidateName(prefix); err != nil {
			return nil, fmt.Errorf("gs://%s/%s: prefix: %w", bucket, prefix, err)
		}
	}
	return &gcsStore{bucket: bucket, prefix: prefix, client: client, opts: opts.withDefaults()}, nil
}

// validateBucket checks the GCS bucket naming rules that a URL can break.
func validateBucket(b string) error {
	if len(b) < 3 || len(b) > 222 {
		return fmt.Errorf("bucket name %q: want 3 to 222 characters", b)
	}
	for _, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.') {
			return fmt.Errorf("bucket name %q: only lowercase letters, digits, '-', '_' and '.' are allowed", b)
		}
	}
	return nil
}

// sharedClient is the one *storage.Client of the process for stores from
// Open: created on first use (credential discovery may do network I/O, which
// Open must not), kept when that succeeds, retried when it failed.
var sharedClient struct {
	mu sync.Mutex
	c  *storage.Client // GUARDED_BY(mu)
}

func defaultClient(context.Context) (*storage.Client, error) {
	sharedClient.mu.Lock()
	defer sharedClient.mu.Unlock()
	if sharedClient.c != nil {
		return sharedClient.c, nil
	}
	var opts []option.ClientOption
	if os.Getenv("STORAGE_EMULATOR_HOST") != "" || os.Getenv("MTCFS_GCS_JSON_READS") != "" {
		// fake-gcs-server serves reads through the JSON API only.
		opts = append(opts, storage.WithJSONReads())
	}
	// Not the caller's context: the client outlives the call.
	c, err := storage.NewClient(context.Background(), opts...)
	if err != nil {
		return nil, fmt.Errorf("create the GCS client (Application Default Credentials, see README): %w", err)
	}
	sharedClient.c = c
	return c, nil
}

func (s *gcsStore) String() string {
	if s.prefix == "" {
		return "gs://" + s.bucket
	}
	return "gs://" + s.bucket + "/" + s.prefix
}

// key is the GCS object name of a store name.
func (s *gcsStore) key(name string) string {
	if s.prefix == "" {
		return name
	}
	return s.prefix + "/" + name
}

// rel is the store name of a GCS object name under the prefix.
func (s *gcsStore) rel(key string) string {
	if s.prefix == "" {
		return key
	}
	return strings.TrimPrefix(key, s.prefix+"/")
}

// url names an object in error messages, bucket included.
func (s *gcsStore) url(name string) string { return "gs://" + s.bucket + "/" + s.key(name) }

// handle returns the object handle of a GCS object name, with the library's
// own retries off: retry loops them all.
func (s *gcsStore) handle(ctx context.Context, key string) (*storage.ObjectHandle, error) {
	c, err := s.client(ctx)
	if err != nil {
		return nil, err
	}
	return c.Bucket(s.bucket).Object(key).Retryer(storage.WithPolicy(storage.RetryNever)), nil
}

// errStalled is the cause of an attempt abandoned by its watchdog.
var errStalled = errors.New("no progress")

// watchdog cancels an attempt's context when touch has not been called for
// its timeout.
type watchdog struct {
	d      time.Duration
	t      *time.Timer
	cancel context.CancelCauseFunc
}

func startWatchdog(ctx context.Context, d time.Duration) (context.Context, *watchdog) {
	ctx, cancel := context.WithCancelCause(ctx)
	w := &watchdog{d: d, cancel: cancel}
	w.t = time.AfterFunc(d, func() { cancel(fmt.Errorf("%w for %s", errStalled, d)) })
	return ctx, w
}

func (w *watchdog) touch() { w.t.Reset(w.d) }

func (w *watchdog) stop() {
	w.t.Stop()
	w.cancel(context.Canceled)
}

// attempt is one try of a request: its context, cancelled by the watchdog
// when nothing moves, and the attempt number from 0.
type attempt struct {
	ctx context.Context
	n   int
	wd  *watchdog
}

// errTransitCorruption marks an upload GCS refused for a CRC32C mismatch
// although the bytes we sent matched it: damaged on the way, worth a retry.
var errTransitCorruption = errors.New("the server received bytes that differ from those sent")

// retryable reports whether an attempt's error is worth another attempt.
func retryable(a *attempt, err error) bool {
	var perm *permanentError
	switch {
	case errors.As(err, &perm):
		return false
	case errors.Is(context.Cause(a.ctx), errStalled) || errors.Is(err, errStalled) || errors.Is(err, errTransitCorruption):
		return true
	}
	return storage.ShouldRetry(err)
}

// retry runs fn until it succeeds, fails for good, or MaxAttempts are used and RetryFor has
// passed since the first attempt. op and name only label the error.
func (s *gcsStore) retry(ctx context.Context, op, name string, fn func(a *attempt) error) error {
	var err error
	bo := s.backoff()
	start := time.Now()
	more := func(n int) bool { return n < s.opts.MaxAttempts || time.Since(start) < s.opts.RetryFor }
	for n := 0; more(n); n++ {
		if n > 0 {
			if werr := gax.Sleep(ctx, bo.Pause()); werr != nil {
				return fmt.Errorf("%s %s: %w (after %d attempts, last: %v)", op, s.url(name), werr, n, err)
			}
		}
		actx, wd := startWatchdog(ctx, s.opts.StallTimeout)
		a := &attempt{ctx: actx, n: n, wd: wd}
		err = fn(a)
		stalled := errors.Is(context.Cause(actx), errStalled)
		wd.stop()
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return fmt.Errorf("%s %s: %w", op, s.url(name), ctx.Err())
		}
		if stalled {
			err = fmt.Errorf("%w: %w", context.Cause(actx), err)
		}
		if !(stalled || retryable(a, err)) {
			return err
		}
		if more(n + 1) {
			// Said at each try: a stalled location otherwise left minutes without a word
			// (found by a black-box run with a frozen server).
			slog.Warn("backup location: a request failed; trying again", "op", op, "object", s.url(name), "attempt", n+1,
				"until", fmt.Sprintf("%d attempts and %s", s.opts.MaxAttempts, max(s.opts.RetryFor, 0)), "failing_for", time.Since(start).Round(time.Millisecond).String(), "err", err)
			continue
		}
		return fmt.Errorf("%s %s: giving up after %d attempts in %s: %w", op, s.url(name), n+1, time.Since(start).Round(time.Millisecond), err)
	}
	return fmt.Errorf("%s %s: giving up: %w", op, s.url(name), err)
}

// backoff is the pause between attempts: exponential from BackoffInitial to
// BackoffMax with full jitter, so that parallel retries spread out (the
// client library's own backoff).
func (s *gcsStore) backoff() gax.Backoff {
	return gax.Backoff{Initial: s.opts.BackoffInitial, Max: s.opts.BackoffMax, Multiplier: 2}
}

func httpCode(err error) int {
	var ge *googleapi.Error
	if errors.As(err, &ge) {
		return ge.Code
	}
	return 0
}

// mapErr turns a library error about name into the ObjectStore errors.
func (s *gcsStore) mapErr(op, name string, err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, storage.ErrBucketNotExist) || httpCode(err) == http.StatusNotFound && (op == "put" || op == "list" || op == "compose"):
		// Uploads and listings do not depend on an object: only the bucket
		// can be missing.
		return fmt.Errorf("%s %s: bucket %q does not exist or is not visible to these credentials: %w", op, s.url(name), s.bucket, err)
	case errors.Is(err, storage.ErrObjectNotExist) || httpCode(err) == http.StatusNotFound:
		return &NotFoundError{Name: name, Err: fmt.Errorf("%s: %w", s.url(name), err)}
	case httpCode(err) == http.StatusForbidden || httpCode(err) == http.StatusUnauthorized:
		return fmt.Errorf("%s %s: permission denied (the credentials need storage.objects.create/get/list/delete on bucket %s, e.g. roles/storage.objectUser): %w",
			op, s.url(name), s.bucket, err)
	}
	var nf *NotFoundError
	var ce *ChecksumError
	var pe *PreconditionError
	if errors.As(err, &nf) || errors.As(err, &ce) || errors.As(err, &pe) || strings.Contains(err.Error(), s.url(name)) {
		return err // already ours
	}
	return fmt.Errorf("%s %s: %w", op, s.url(name), err)
}

func (s *gcsStore) attrs(o *storage.ObjectAttrs) ObjectAttrs {
	return ObjectAttrs{Name: s.rel(o.Name), Size: o.Size, CRC32C: o.CRC32C, Updated: o.Updated, Generation: o.Generation}
}

// checksAtRest: GCS checks its objects' bytes against the CRC32C it keeps (storeHoldsIntact).
func (s *gcsStore) checksAtRest() bool { return true }

func (s *gcsStore) Stat(ctx context.Context, name string) (ObjectAttrs, error) {
	if err := s.validName(name); err != nil {
		return ObjectAttrs{}, err
	}
	o, err := s.statKey(ctx, name, s.key(name))
	if err != nil {
		return ObjectAttrs{}, err
	}
	return s.attrs(o), nil
}

// statKey returns the attributes of the GCS object key; name labels errors.
func (s *gcsStore) statKey(ctx context.Context, name, key string) (*storage.ObjectAttrs, error) {
	var o *storage.ObjectAttrs
	err := s.retry(ctx, "stat", name, func(a *attempt) error {
		h, err := s.handle(a.ctx, key)
		if err != nil {
			return err
		}
		o, err = h.Attrs(a.ctx)
		return err
	})
	return o, s.mapErr("stat", name, err)
}

func (s *gcsStore) List(ctx context.Context, prefix, delimiter string) ([]ObjectAttrs, []string, error) {
	if err := validatePrefix(prefix); err != nil {
		return nil, nil, err
	}
	var objects []ObjectAttrs
	var prefixes []string
	q := &storage.Query{Prefix: s.key(prefix), Delimiter: delimiter}
	if s.prefix != "" && prefix == "" {
		q.Prefix = s.prefix + "/"
	}
	if err := q.SetAttrSelection([]string{"Name", "Size", "CRC32C", "Updated", "Generation"}); err != nil {
		return nil, nil, err
	}
	err := s.retry(ctx, "list", prefix, func(a *attempt) error {
		objects, prefixes = nil, nil // a retry starts the listing over
		c, err := s.client(a.ctx)
		if err != nil {
			return err
		}
		it := c.Bucket(s.bucket).Retryer(storage.WithPolicy(storage.RetryNever)).Objects(a.ctx, q)
		for {
			o, err := it.Next()
			if err == iterator.Done {
				return nil
			}
			if err != nil {
				return err
			}
			a.wd.touch()
			if o.Prefix != "" {
				if rel := s.rel(o.Prefix); !hasTempSegment(rel) {
					prefixes = append(prefixes, rel)
				}
				continue
			}
			if rel := s.rel(o.Name); !hasTempSegment(rel) {
				objects = append(objects, s.attrs(o))
			}
		}
	})
	if err != nil {
		return nil, nil, s.mapErr("list", prefix, err)
	}
	return objects, prefixes, nil
}

// hasTempSegment reports whether a name lies in a temporary area (the parts
// of a composite upload), which listings hide.
func hasTempSegment(name string) bool {
	for seg := range strings.SplitSeq(strings.TrimSuffix(name, "/"), "/") {
		if isTempName(seg) {
			return true
		}
	}
	return false
}

func (s *gcsStore) Delete(ctx context.Context, name string) error {
	if err := s.validName(name); err != nil {
		return err
	}
	return s.deleteKey(ctx, name, s.key(name), 0)
}

// deleteKey deletes a GCS object (of generation gen, if not 0). A 404 on a
// retry means an earlier attempt whose answer was lost deleted it.
func (s *gcsStore) deleteKey(ctx context.Context, name, key string, gen int64) error {
	if !hasTempSegment(key) { // temporary names are ours alone
		done, err := s.names.wait(ctx, key, s.opts.NameWriteInterval)
		if err != nil {
			return err
		}
		defer done()
	}
	return s.deleteNow(ctx, name, key, gen)
}

// deleteNow is deleteKey without waiting for the name: for a write that
// holds it (nameLimiter.wait) and withdraws what it wrote.
func (s *gcsStore) deleteNow(ctx context.Context, name, key string, gen int64) error {
	err := s.retry(ctx, "delete", name, func(a *attempt) error {
		h, err := s.handle(a.ctx, key)
		if err != nil {
			return err
		}
		if gen != 0 {
			h = h.If(storage.Conditions{GenerationMatch: gen})
		}
		err = h.Delete(a.ctx)
		if a.n > 0 && errors.Is(err, storage.ErrObjectNotExist) {
			return nil
		}
		return err
	})
	return s.mapErr("delete", name, err)
}

// Open reads a range. The returned reader resumes after transient errors
// from where it was, on the generation it started with.
func (s *gcsStore) Open(ctx context.Context, name string, off, length int64) (io.ReadCloser, error) {
	if err := s.validName(name); err != nil {
		return nil, err
	}
	if off < 0 {
		return nil, fmt.Errorf("open %s: negative offset %d", s.url(name), off)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	// The reader outlives this call (see ObjectStore.Open): its context is
	// cut loose from ctx and cancelled by Close. Until the call returns, ctx
	// ending ends the open too (its attempts and the pauses between them).
	rctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	r := &gcsReader{s: s, ctx: rctx, cancel: cancel, name: name, off: off, remaining: length, bo: s.backoff()}
	stop := context.AfterFunc(ctx, cancel)
	err := r.open()
	ctxEnded := !stop()
	if ctxEnded && err == nil { // ctx ended as the open succeeded: the reader is cancelled
		r.closeReader()
		err = ctx.Err()
	}
	if err != nil {
		cancel()
		if cause := context.Cause(ctx); ctxEnded && cause != nil { // not a failure of its own that raced with ctx
			if cause != ctx.Err() {
				return nil, fmt.Errorf("open %s: %w (%w)", s.url(name), cause, ctx.Err())
			}
			return nil, fmt.Errorf("open %s: %w", s.url(name), cause)
		}
		return nil, err
	}
	return r, nil
}

// gcsReader reads [off, off+remaining) of one generation of an object.
type gcsReader struct {
	s         *gcsStore
	ctx       context.Context
	cancel    context.CancelFunc
	name      string
	off       int64 // next byte to read
	remaining int64 // < 0: to the end
	gen       int64 // 0 until the first open
	r         *storage.Reader
	wd        *watchdog
	rctx      context.Context // the current reader's attempt context
	// failed counts the readers in a row that failed before delivering a
	// byte; Read gives up at MaxAttempts, and backs off by bo between them.
	// open's own retries start afresh each time, so they cannot bound a
	// server that answers every request and breaks every body.
	failed int
	bo     gax.Backoff
}

// open (re)opens the object at r.off, retrying transient errors.
func (r *gcsReader) open() error {
	return r.s.retry(r.ctx, "read", r.name, func(a *attempt) error {
		h, err := r.s.handle(a.ctx, r.s.key(r.name))
		if err != nil {
			return err
		}
		if r.gen != 0 {
			h = h.Generation(r.gen)
		}
		// The attempt context dies with this function; the reader needs one
		// that lives until the next error or Close, with its own watchdog.
		rctx, wd := startWatchdog(r.ctx, r.s.opts.StallTimeout)
		sr, err := h.NewRangeReader(rctx, r.off, r.remaining)
		if err != nil {
			stalled := context.Cause(rctx)
			wd.stop()
			if httpCode(err) == http.StatusRequestedRangeNotSatisfiable {
				return r.outOfRange(a.ctx)
			}
			if errors.Is(stalled, errStalled) {
				return fmt.Errorf("%w: %w", stalled, err)
			}
			return r.s.mapErr("read", r.name, err)
		}
		if r.gen == 0 {
			r.gen = sr.Attrs.Generation
		}
		r.r, r.wd, r.rctx = sr, wd, rctx
		return nil
	})
}

// outOfRange tells an empty range at the end of the object (GCS answers 416
// for it) from an offset beyond the end.
func (r *gcsReader) outOfRange(ctx context.Context) error {
	o, err := r.s.statKey(ctx, r.name, r.s.key(r.name))
	if err != nil {
		return err
	}
	if r.off > o.Size {
		return fmt.Errorf("open %s: offset %d is beyond the object's size %d", r.s.url(r.name), r.off, o.Size)
	}
	r.remaining = 0 // at the end: nothing to read
	return nil
}

func (r *gcsReader) Read(p []byte) (int, error) {
	for {
		if r.remaining == 0 {
			return 0, io.EOF
		}
		if r.r == nil {
			if r.failed > 0 {
				// A server can accept every connection and break every body
				// before its first byte: back off, as between attempts.
				if err := gax.Sleep(r.ctx, r.bo.Pause()); err != nil {
					return 0, err
				}
			}
			if err := r.open(); err != nil {
				return 0, err
			}
			if r.r == nil {
				return 0, io.EOF
			}
		}
		n, err := r.r.Read(p)
		if n > 0 {
			r.wd.touch()
			r.failed, r.bo = 0, r.s.backoff()
			r.off += int64(n)
			if r.remaining > 0 {
				r.remaining -= int64(n)
			}
			if err == io.EOF {
				err = nil // the next call reports it
			}
			if err != nil {
				err = badCRC(r.s.url(r.name), err)
			}
			return n, err
		}
		if err == nil {
			return 0, nil // io.Reader allows it; nothing is wrong
		}
		if err == io.EOF {
			r.remaining = 0
			return 0, io.EOF
		}
		cause := context.Cause(r.rctx)
		stalled := errors.Is(cause, errStalled)
		r.closeReader()
		if r.ctx.Err() != nil {
			return 0, r.ctx.Err()
		}
		if ce := badCRC(r.s.url(r.name), err); ce != err {
			return 0, ce
		}
		if !stalled && !storage.ShouldRetry(err) {
			return 0, r.s.mapErr("read", r.name, err)
		}
		if stalled {
			err = fmt.Errorf("%w: %w", cause, err)
		}
		r.failed++
		if r.failed >= r.s.opts.MaxAttempts {
			return 0, fmt.Errorf("read %s: giving up after %d attempts that delivered no byte at offset %d: %w",
				r.s.url(r.name), r.failed, r.off, err)
		}
		// Reopen at r.off on the next loop.
	}
}

// badCRC turns the client's check of a whole object's CRC32C at its end ("storage: bad CRC on
// read: got G, want W", no error type of its own) into a *ChecksumError: the stored bytes no
// longer match the CRC32C the store keeps. backups verify stopped there with "error" instead
// of reporting the data damaged and going on (found by a black-box run).
func badCRC(name string, err error) error {
	const text = "bad CRC on read"
	if err == nil {
		return nil
	}
	msg := err.Error()
	i := strings.Index(msg, text)
	if i < 0 {
		return err
	}
	var got, want uint32
	if n, _ := fmt.Sscanf(msg[i:], text+": got %d, want %d", &got, &want); n != 2 {
		return &ChecksumError{Name: name, Detail: msg} // the client's wording changed: its words
	}
	return &ChecksumError{Name: name, Want: want, Got: got}
}

func (r *gcsReader) closeReader() {
	if r.r != nil {
		r.r.Close()
		r.wd.stop()
		r.r = nil
	}
}

// Abort ends the reader's reads and reopens, from any goroutine: a Read running returns an
// error. Close it still.
func (r *gcsReader) Abort() { r.cancel() }

func (r *gcsReader) Close() error {
	r.closeReader()
	r.cancel()
	return nil
}

func (s *gcsStore) Put(ctx context.Context, req PutRequest) error {
	if err := s.validName(req.Name); err != nil {
		return err
	}
	if req.Size < 0 {
		return fmt.Errorf("put %s: negative size %d", s.url(req.Name), req.Size)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	body, err := newReplayableBody(ctx, req)
	if err != nil {
		return fmt.Errorf("put %s: %w", s.url(req.Name), err)
	}
	return s.write(ctx, writeRequest{name: req.Name, key: s.key(req.Name), size: req.Size, crc: body.crc, crcKnown: body.crcKnown,
		body: body.open, once: body.seek == nil, ifAbsent: req.IfAbsent})
}

// replayableBody gives a Put body to each attempt. A body that can seek is
// replayed from where it started; without a CRC32C from the caller it is
// read once beforehand, to check its size and take its CRC32C. Any other
// body can only be sent once, and without a CRC32C from the caller it is
// checked only after the upload (see writeOnce).
type replayableBody struct {
	r        io.Reader
	start    int64
	seek     io.Seeker
	crc      uint32
	crcKnown bool
	used     bool
}

// newReplayableBody prepares req.Body. GCS must have the CRC32C before the
// first byte to refuse damaged data. A CRC32C from the caller needs no
// pre-read: writeOnce checks the size and CRC32C of what it streamed before
// it Closes the upload, and abandons it (publishing nothing) on a mismatch.
func newReplayableBody(ctx context.Context, req PutRequest) (*replayableBody, error) {
	b := &replayableBody{r: req.Body}
	if sk, ok := req.Body.(io.Seeker); ok {
		if pos, err := sk.Seek(0, io.SeekCurrent); err == nil {
			b.seek, b.start = sk, pos
		}
	}
	if req.CRC32C != nil {
		b.crc, b.crcKnown = *req.CRC32C, true
		return b, nil
	}
	if b.seek == nil {
		return b, nil
	}
	n, crc, err := copyCRC(ctx, io.Discard, io.LimitReader(req.Body, req.Size))
	if err != nil {
		return nil, err
	}
	if n != req.Size {
		return nil, fmt.Errorf("body ended after %d of %d bytes", n, req.Size)
	}
	var extra [1]byte
	if m, _ := io.ReadFull(req.Body, extra[:]); m > 0 {
		return nil, fmt.Errorf("body is longer than the announced %d bytes", req.Size)
	}
	b.crc, b.crcKnown = crc, true
	return b, nil
}

func (b *replayableBody) open() (io.Reader, error) {
	if b.seek != nil {
		if _, err := b.seek.Seek(b.start, io.SeekStart); err != nil {
			return nil, err
		}
	} else if b.used {
		return nil, &permanentError{errors.New("cannot retry: the body was consumed and cannot seek")}
	}
	b.used = true
	return b.r, nil
}

// writeRequest is one object upload.
type writeRequest struct {
	name, key string // store name (for errors) and GCS object name
	size      int64
	crc       uint32
	// crcKnown is false for a body that could not be checksummed before the
	// upload: crc is then unset, and the CRC32C is checked afterwards.
	crcKnown bool
	// body returns the bytes for one attempt; at least size of them.
	body func() (io.Reader, error)
	// once marks a body that cannot be replayed, nor checked before it is
	// sent: it is uploaded in resumable chunks, so that abandoning it before
	// the last one publishes nothing (memory: one chunk buffer).
	once     bool
	ifAbsent bool
	// exclusive marks a name only this upload uses (a part): no rate limit.
	exclusive bool
	// progress is told the bytes sent so far in the current attempt.
	progress func(sent int64)
}

// write uploads one object with its CRC32C and a generation precondition,
// retrying. See gcsStore for the rules.
func (s *gcsStore) write(ctx context.Context, req writeRequest) error {
	// Replacing: the generation we replace. 0 with ifAbsent: must not exist.
	var gen int64
	if !req.ifAbsent {
		o, err := s.statKey(ctx, req.name, req.key)
		switch {
		case IsNotFound(err):
		case err != nil:
			return err
		default:
			gen = o.Generation
		}
	}
	err := s.retry(ctx, "put", req.name, func(a *attempt) error {
		if !req.exclusive {
			done, err := s.names.wait(a.ctx, req.key, s.opts.NameWriteInterval)
			if err != nil {
				return err
			}
			defer done()
		}
		sent, err := s.writeOnce(a, req, gen)
		if httpCode(err) != http.StatusPreconditionFailed {
			return err
		}
		want := req.crc
		if !req.crcKnown {
			want = sent
		}
		// The name is not in the state we required: an earlier attempt of
		// ours may have landed, or someone else wrote it.
		o, serr := s.statKey(a.ctx, req.name, req.key)
		if IsNotFound(serr) {
			gen = 0 // deleted meanwhile (or a spurious 412): create it
			return errRetryNow
		}
		if serr != nil {
			return serr
		}
		if o.Size == req.size && o.CRC32C == want {
			return nil // our bytes are there
		}
		if req.ifAbsent {
			return s.conflict(req.name, o, req.size, want)
		}
		gen = o.Generation // a newer write than the one we saw: replace that
		return errRetryNow
	})
	return s.mapErr("put", req.name, err)
}

// conflict is the error of a create-if-absent write of size bytes with
// crc32c crc that found o, with other content, under the name.
func (s *gcsStore) conflict(name string, o *storage.ObjectAttrs, size int64, crc uint32) error {
	return &PreconditionError{Name: name, Err: fmt.Errorf("%s exists with different content (size %d crc32c %08x, put size %d crc32c %08x): %w",
		s.url(name), o.Size, o.CRC32C, size, crc, os.ErrExist)}
}

// errRetryNow asks retry for another attempt after a precondition changed.
var errRetryNow = &googleapi.Error{Code: http.StatusServiceUnavailable, Message: "retry with the new generation"}

// writeOnce is one upload attempt; it returns the CRC32C of the bytes it
// read from the body (all sent, when it reaches Close). Close is only reached
// with exactly req.size bytes whose CRC32C is req.crc; any other outcome
// cancels the request with at least the last byte read unsent, so that
// nothing that could still land matches the CRC32C sent up front.
func (s *gcsStore) writeOnce(a *attempt, req writeRequest, gen int64) (uint32, error) {
	body, err := req.body()
	if err != nil {
		return 0, err
	}
	h, err := s.handle(a.ctx, req.key)
	if err != nil {
		return 0, err
	}
	if gen != 0 {
		h = h.If(storage.Conditions{GenerationMatch: gen})
	} else {
		h = h.If(storage.Conditions{DoesNotExist: true})
	}
	wctx, abort := context.WithCancel(a.ctx)
	defer abort()
	w := h.NewWriter(wctx)
	w.ChunkSize = 0 // one streamed request: no buffer; retries re-read the source
	if req.once {
		w.ChunkSize = onceChunkSize
	}
	w.ContentType = "application/octet-stream"
	if req.crcKnown {
		w.CRC32C, w.SendCRC32C = req.crc, true
		w.DisableAutoChecksum = true // the CRC32C we send is checked by the server
	}

	bp := copyBufs.Get().(*[]byte)
	defer copyBufs.Put(bp)
	buf := *bp
	// The last byte received is held back (in buf[0:held]) until the body is
	// known to be complete and right: cancelling does not reliably withdraw a
	// single-request upload (on a copy error the client's multipart writer
	// still ends the body with its closing boundary), and a body that ended
	// early could otherwise be published whole, matching a CRC32C computed
	// from the same short body. Without that byte, what may land has another
	// CRC32C than the one announced, and GCS refuses it.
	var got, sent int64 // received from the body, and handed to w
	var held int
	var crc uint32
	for got < req.size {
		m, rerr := body.Read(buf[held : held+int(min(int64(len(buf)-held), req.size-got))])
		if m > 0 {
			crc = crc32.Update(crc, crcTable, buf[held:held+m])
			got += int64(m)
			a.wd.touch()
			if k := held + m - 1; k > 0 {
				if _, werr := w.Write(buf[:k]); werr != nil {
					abort()
					return crc, werr
				}
				sent += int64(k)
				buf[0] = buf[k]
				if req.progress != nil {
					req.progress(sent)
				}
			}
			held = 1
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			abort()
			return crc, &permanentError{fmt.Errorf("read the source of %s: %w", s.url(req.name), rerr)}
		}
	}
	// To give up, cancel and never Close: Close would end the request body
	// normally and could publish what was sent so far.
	fail := func(err error) (uint32, error) { abort(); return crc, &permanentError{err} }
	if got != req.size {
		return fail(fmt.Errorf("put %s: body ended after %d of %d bytes", s.url(req.name), got, req.size))
	}
	var extra [1]byte
	if m, _ := io.ReadFull(body, extra[:]); m > 0 {
		return fail(fmt.Errorf("put %s: body is longer than the announced %d bytes", s.url(req.name), req.size))
	}
	if req.crcKnown && crc != req.crc {
		abort()
		return crc, &ChecksumError{Name: req.name, Want: req.crc, Got: crc}
	}
	if held > 0 {
		if _, werr := w.Write(buf[:held]); werr != nil {
			abort()
			return crc, werr
		}
		sent += int64(held)
		a.wd.touch()
		if req.progress != nil {
			req.progress(sent)
		}
	}
	err = w.Close()
	if httpCode(err) == http.StatusBadRequest && strings.Contains(strings.ToLower(err.Error()), "crc32c") {
		return crc, fmt.Errorf("%w: %w", errTransitCorruption, err)
	}
	if err != nil {
		return crc, err
	}
	if o := w.Attrs(); o.Size != req.size || o.CRC32C != crc {
		// Only reachable when the server did not check a CRC32C before
		// publishing (none was known, or an emulator that does not check):
		// withdraw exactly what we wrote.
		s.deleteNow(context.WithoutCancel(a.ctx), req.name, req.key, o.Generation) // the write holds the name
		return crc, &permanentError{fmt.Errorf("put %s: stored %d bytes with crc32c %08x, sent %d with crc32c %08x: %w",
			s.url(req.name), o.Size, o.CRC32C, sent, crc, &ChecksumError{Name: req.name, Want: crc, Got: o.CRC32C})}
	}
	return crc, nil
}

// onceChunkSize is the chunk buffer of an upload whose body can be read only
// once (see writeRequest.once). Nothing in mtcfs sends such bodies; it is
// there for the ObjectStore contract.
const onceChunkSize = 4 << 20

// permanentError is an attempt error that retrying cannot fix (the source
// is short, long or unreadable).
type permanentError struct{ err error }

func (e *permanentError) Error() string { return e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// tempArea returns a fresh GCS name prefix for the temporary objects of one
// upload: "<prefix>/<dir>.mtcfs-tmp-<writer>-<random>/" (see leftovers.go).
// The temporary prefix can never be an object name (ValidateName) and
// listings hide it. dir is "" or a store name ending in "/".
func (s *gcsStore) tempArea(dir string) string {
	return s.key(dir + newTempName() + "/")
}

// maxName is the longest store name that fits GCS's limit on object names
// once the prefix is added (nameBudgeter).
func (s *gcsStore) maxName() int {
	if s.prefix == "" {
		return maxObjectName
	}
	return maxObjectName - len(s.prefix) - 1
}

// validName checks a store name, including its length with the prefix.
func (s *gcsStore) validName(name string) error {
	if err := ValidateName(name); err != nil {
		return err
	}
	if len(name) > s.maxName() {
		return fmt.Errorf("object name %.40q…: longer than %d bytes with the prefix of %s", name, maxObjectName, s)
	}
	return nil
}

// temporaries lists the temporary areas of composite uploads of objects
// under dir, and those that earlier versions left at the store's root
// (tempStore).
func (s *gcsStore) temporaries(ctx context.Context, dir string) ([]temporary, error) {
	if err := validatePrefix(dir); err != nil {
		return nil, err
	}
	var out []temporary
	bases := []string{s.key(dir), s.key("")}
	if bases[0] == bases[1] {
		bases = bases[:1]
	}
	for _, base := range bases {
		areas := map[string]*temporary{}
		var order []string
		err := s.retry(ctx, "list", dir+tempPrefix, func(a *attempt) error {
			areas, order = map[string]*temporary{}, nil
			c, err := s.client(a.ctx)
			if err != nil {
				return err
			}
			q := &storage.Query{Prefix: base + tempPrefix}
			if err := q.SetAttrSelection([]string{"Name", "Updated"}); err != nil {
				return err
			}
			it := c.Bucket(s.bucket).Retryer(storage.WithPolicy(storage.RetryNever)).Objects(a.ctx, q)
			for {
				o, err := it.Next()
				if err == iterator.Done {
					return nil
				}
				if err != nil {
					return err
				}
				a.wd.touch()
				seg, _, ok := strings.Cut(strings.TrimPrefix(o.Name, base), "/")
				if !ok || !isTempName(seg) {
					continue // a temporary area is a prefix
				}
				t := areas[seg]
				if t == nil {
					t = &temporary{seg: seg}
					areas[seg] = t
					order = append(order, seg)
				}
				t.keys = append(t.keys, o.Name)
				if o.Updated.After(t.newest) {
					t.newest = o.Updated
				}
			}
		})
		if err != nil {
			return nil, s.mapErr("list", dir, err)
		}
		for _, seg := range order {
			out = append(out, *areas[seg])
		}
	}
	return out, nil
}

// removeTemporary deletes the objects of one temporary area (tempStore).
// A running upload that still needed them fails its compose: nothing is
// published.
func (s *gcsStore) removeTemporary(ctx context.Context, t temporary) (int, error) {
	var n atomic.Int64
	err := forEach(ctx, 8, len(t.keys), func(ctx context.Context, i int) error {
		if !hasTempSegment(t.keys[i]) {
			return fmt.Errorf("remove gs://%s/%s: not a temporary object", s.bucket, t.keys[i])
		}
		err := s.deleteKey(ctx, s.rel(t.keys[i]), t.keys[i], 0)
		if IsNotFound(err) {
			return nil
		}
		if err == nil {
			n.Add(1)
		}
		return err
	})
	return int(n.Load()), err
}

// nameLimiter delays a write to a name written less than an interval ago
// (GCS: about one write per second per object name). The interval counts
// from the end of the previous write: a request that started on time but
// reached the server late, or took long, still leaves the server a full
// interval between the two changes. A write to a name that another write
// holds waits for that one to end, then for the interval.
type nameLimiter struct {
	mu   sync.Mutex
	last map[string]nameState // GUARDED_BY(mu)
}

// nameState is a name's last write: when it ended, and, while one runs, a
// channel closed when it ends.
type nameState struct {
	ended time.Time
	busy  chan struct{}
}

// wait returns once name may be written, with done, which the caller calls
// when the write has ended, whatever its outcome (more calls do nothing).
// Until then the caller holds the name: a write of its own to the name
// inside that time must not wait again (see deleteNow).
func (l *nameLimiter) wait(ctx context.Context, name string, interval time.Duration) (done func(), err error) {
	for {
		l.mu.Lock()
		now := time.Now()
		if l.last == nil {
			l.last = make(map[string]nameState)
		}
		if len(l.last) > 4096 { // forget names whose interval has passed
			for n, st := range l.last {
				if st.busy == nil && now.Sub(st.ended) >= interval {
					delete(l.last, n)
				}
			}
		}
		st := l.last[name]
		if busy := st.busy; busy != nil {
			l.mu.Unlock()
			select {
			case <-busy:
				continue
			case <-ctx.Done():
				return nil, ctx.Err() // as gax.Sleep below returns it
			}
		}
		next := st.ended.Add(interval)
		if !now.Before(next) {
			busy := make(chan struct{})
			l.last[name] = nameState{ended: st.ended, busy: busy}
			l.mu.Unlock()
			var once sync.Once
			return func() {
				once.Do(func() {
					l.mu.Lock()
					l.last[name] = nameState{ended: time.Now()}
					l.mu.Unlock()
					close(busy)
				})
			}, nil
		}
		l.mu.Unlock()
		if err := gax.Sleep(ctx, next.Sub(now)); err != nil {
			return nil, err
		}
	}
}
