package gcsbackend

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"hash/crc32"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
)

// gcsFake is an in-memory Google Cloud Storage that speaks the part of the JSON API the Go
// client uses for what gcsStore does: single-request (multipart) and resumable uploads,
// metadata and media reads (ranges, pinned generations), listings with prefix, delimiter and
// pages, deletes and composes. Like GCS it enforces generation preconditions
// (ifGenerationMatch, 0: must not exist) on every write and delete and checks a CRC32C the
// client sends with an upload or compose before the object appears, answering 400 on a
// mismatch; it never publishes part of an upload. It is the server behind the store tests, with
// faultInjector in front of it.
type gcsFake struct {
	mu      sync.Mutex
	buckets map[string]map[string]*fakeObject // GUARDED_BY(mu): bucket → name → object
	gen     int64                             // GUARDED_BY(mu): the last generation handed out
	uploads map[string]*fakeUpload            // GUARDED_BY(mu): resumable sessions by id
}

type fakeObject struct {
	name, contentType string
	data              []byte
	crc               uint32
	gen               int64
	updated           time.Time
}

// fakeUpload is a resumable upload session: what the initial request asked for, and the bytes
// received so far.
type fakeUpload struct {
	bucket string
	meta   objectMeta
	conds  url.Values
	data   []byte
}

// objectMeta is the part of the JSON object resource a client sends.
type objectMeta struct {
	Name        string `json:"name"`
	ContentType string `json:"contentType"`
	CRC32C      string `json:"crc32c"`
}

func newGCSFake(buckets ...string) *gcsFake {
	g := &gcsFake{buckets: map[string]map[string]*fakeObject{}, uploads: map[string]*fakeUpload{}}
	for _, b := range buckets {
		g.buckets[b] = map[string]*fakeObject{}
	}
	return g
}

// put stores an object as if uploaded (for tests that plant objects).
func (g *gcsFake) put(bucket, name string, data []byte) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.storeLocked(bucket, name, "", data)
}

// object returns an object's content.
func (g *gcsFake) object(bucket, name string) ([]byte, bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	o, ok := g.buckets[bucket][name]
	if !ok {
		return nil, false
	}
	return o.data, true
}

// names lists a bucket's object names, sorted.
func (g *gcsFake) names(bucket string) []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	var out []string
	for n := range g.buckets[bucket] {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

func (g *gcsFake) storeLocked(bucket, name, contentType string, data []byte) *fakeObject {
	g.gen++
	o := &fakeObject{name: name, contentType: contentType, data: data, crc: crc32.Checksum(data, crcTable), gen: g.gen, updated: time.Now()}
	g.buckets[bucket][name] = o
	return o
}

// apiError answers as GCS does: a JSON error document.
func apiError(w http.ResponseWriter, code int, format string, args ...any) {
	w.Header().Set("Content-Type", "application/json; charset=UTF-8")
	w.WriteHeader(code)
	msg, _ := json.Marshal(fmt.Sprintf(format, args...))
	fmt.Fprintf(w, `{"error":{"code":%d,"message":%s,"errors":[{"message":%s}]}}`, code, msg, msg)
}

func encodeCRC(c uint32) string {
	var b [4]byte
	binary.BigEndian.PutUint32(b[:], c)
	return base64.StdEncoding.EncodeToString(b[:])
}

func (g *gcsFake) resource(bucket string, o *fakeObject) map[string]any {
	return map[string]any{
		"kind": "storage#object", "id": fmt.Sprintf("%s/%s/%d", bucket, o.name, o.gen),
		"name": o.name, "bucket": bucket, "generation": strconv.FormatInt(o.gen, 10), "metageneration": "1",
		"contentType": o.contentType, "size": strconv.Itoa(len(o.data)), "crc32c": encodeCRC(o.crc),
		"timeCreated": o.updated.UTC().Format(time.RFC3339Nano), "updated": o.updated.UTC().Format(time.RFC3339Nano),
	}
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json; charset=UTF-8")
	json.NewEncoder(w).Encode(v)
}

// checkGeneration applies an ifGenerationMatch condition to the object o (nil: absent) and
// answers 412 when it fails.
func checkGeneration(w http.ResponseWriter, q url.Values, o *fakeObject) bool {
	v := q.Get("ifGenerationMatch")
	if v == "" {
		return true
	}
	want, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		apiError(w, http.StatusBadRequest, "invalid ifGenerationMatch %q", v)
		return false
	}
	if (want == 0 && o != nil) || (want != 0 && (o == nil || o.gen != want)) {
		apiError(w, http.StatusPreconditionFailed, "At least one of the pre-conditions you specified did not hold.")
		return false
	}
	return true
}

func (g *gcsFake) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	path := r.URL.EscapedPath()
	upload := strings.HasPrefix(path, "/upload/storage/v1/b/")
	rest, ok := strings.CutPrefix(path, "/storage/v1/b/")
	if upload {
		rest = strings.TrimPrefix(path, "/upload/storage/v1/b/")
	} else if !ok {
		apiError(w, http.StatusNotFound, "no such endpoint %s", path)
		return
	}
	segs := strings.Split(rest, "/")
	bucket, err := url.PathUnescape(segs[0])
	if err != nil || len(segs) < 2 || segs[1] != "o" {
		apiError(w, http.StatusNotFound, "no such endpoint %s", path)
		return
	}
	var name string
	if len(segs) > 2 {
		if name, err = url.PathUnescape(segs[2]); err != nil {
			apiError(w, http.StatusBadRequest, "bad object name %q", segs[2])
			return
		}
	}
	g.mu.Lock()
	_, exists := g.buckets[bucket]
	g.mu.Unlock()
	if !exists {
		io.Copy(io.Discard, r.Body)
		apiError(w, http.StatusNotFound, "The specified bucket does not exist.")
		return
	}
	q := r.URL.Query()
	switch {
	case upload && r.Method == http.MethodPost && q.Get("upload_id") != "":
		g.resumeUpload(w, r, q.Get("upload_id"))
	case upload && r.Method == http.MethodPost && q.Get("uploadType") == "multipart":
		g.multipartUpload(w, r, bucket)
	case upload && r.Method == http.MethodPost && q.Get("uploadType") == "resumable":
		g.startUpload(w, r, bucket)
	case !upload && len(segs) == 2 && r.Method == http.MethodGet:
		g.list(w, q, bucket)
	case !upload && len(segs) == 3 && r.Method == http.MethodGet:
		g.get(w, r, bucket, name)
	case !upload && len(segs) == 3 && r.Method == http.MethodDelete:
		g.delete(w, q, bucket, name)
	case !upload && len(segs) == 4 && segs[3] == "compose" && r.Method == http.MethodPost:
		g.compose(w, r, bucket, name)
	default:
		apiError(w, http.StatusNotImplemented, "%s %s is not implemented by the fake", r.Method, path)
	}
}

// finish publishes an upload's bytes after checking its CRC32C and preconditions.
func (g *gcsFake) finish(w http.ResponseWriter, bucket string, meta objectMeta, conds url.Values, data []byte) {
	if meta.CRC32C != "" {
		if got := encodeCRC(crc32.Checksum(data, crcTable)); got != meta.CRC32C {
			apiError(w, http.StatusBadRequest, "Provided CRC32C %q doesn't match calculated CRC32C %q.", meta.CRC32C, got)
			return
		}
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if !checkGeneration(w, conds, g.buckets[bucket][meta.Name]) {
		return
	}
	writeJSON(w, g.resource(bucket, g.storeLocked(bucket, meta.Name, meta.ContentType, data)))
}

func (g *gcsFake) multipartUpload(w http.ResponseWriter, r *http.Request, bucket string) {
	_, params, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil {
		apiError(w, http.StatusBadRequest, "content type: %v", err)
		return
	}
	mr := multipart.NewReader(r.Body, params["boundary"])
	var meta objectMeta
	var data []byte
	for i := 0; ; i++ {
		p, err := mr.NextPart()
		if err == io.EOF {
			break
		}
		if err == nil {
			var b []byte
			if b, err = io.ReadAll(p); err == nil && i == 0 {
				err = json.Unmarshal(b, &meta)
			}
			data = b
		}
		if err != nil { // a body cut short publishes nothing
			apiError(w, http.StatusBadRequest, "upload body: %v", err)
			return
		}
	}
	if q := r.URL.Query().Get("name"); q != "" && meta.Name != "" && q != meta.Name {
		apiError(w, http.StatusBadRequest, "object name %q in the metadata differs from name=%q", meta.Name, q)
		return
	} else if meta.Name == "" {
		meta.Name = q
	}
	g.finish(w, bucket, meta, r.URL.Query(), data)
}

func (g *gcsFake) startUpload(w http.ResponseWriter, r *http.Request, bucket string) {
	var meta objectMeta
	if err := json.NewDecoder(r.Body).Decode(&meta); err != nil {
		apiError(w, http.StatusBadRequest, "upload metadata: %v", err)
		return
	}
	if meta.Name == "" {
		meta.Name = r.URL.Query().Get("name")
	}
	g.mu.Lock()
	g.gen++
	id := strconv.FormatInt(g.gen, 10)
	g.uploads[id] = &fakeUpload{bucket: bucket, meta: meta, conds: r.URL.Query()}
	g.mu.Unlock()
	loc := url.URL{Scheme: "http", Host: r.Host, Path: r.URL.Path, RawQuery: "uploadType=resumable&upload_id=" + id}
	w.Header().Set("Location", loc.String())
	w.WriteHeader(http.StatusOK)
}

// resumeUpload takes one chunk of a resumable upload ("bytes a-b/*", "bytes a-b/total" or
// "bytes */total" for the last).
func (g *gcsFake) resumeUpload(w http.ResponseWriter, r *http.Request, id string) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		apiError(w, http.StatusBadRequest, "chunk: %v", err)
		return
	}
	g.mu.Lock()
	u := g.uploads[id]
	g.mu.Unlock()
	if u == nil {
		apiError(w, http.StatusNotFound, "no upload session %s", id)
		return
	}
	span, total, ok := strings.Cut(strings.TrimPrefix(r.Header.Get("Content-Range"), "bytes "), "/")
	if !ok {
		apiError(w, http.StatusBadRequest, "bad Content-Range %q", r.Header.Get("Content-Range"))
		return
	}
	if span != "*" {
		first, _, _ := strings.Cut(span, "-")
		off, err := strconv.Atoi(first)
		if err != nil || off > len(u.data) {
			apiError(w, http.StatusBadRequest, "bad Content-Range %q for %d bytes received", r.Header.Get("Content-Range"), len(u.data))
			return
		}
		u.data = append(u.data[:off], body...) // a resent chunk replaces what it covers
	}
	if total == "*" {
		w.Header().Set("X-Http-Status-Code-Override", "308")
		w.Header().Set("Range", fmt.Sprintf("bytes=0-%d", len(u.data)-1))
		w.WriteHeader(http.StatusOK)
		return
	}
	if n, err := strconv.Atoi(total); err != nil || n != len(u.data) {
		apiError(w, http.StatusBadRequest, "upload of %s bytes ended after %d", total, len(u.data))
		return
	}
	g.mu.Lock()
	delete(g.uploads, id)
	g.mu.Unlock()
	g.finish(w, u.bucket, u.meta, u.conds, u.data)
}

func (g *gcsFake) lookup(bucket, name string, q url.Values) *fakeObject {
	g.mu.Lock()
	defer g.mu.Unlock()
	o := g.buckets[bucket][name]
	if o != nil && q.Get("generation") != "" && q.Get("generation") != strconv.FormatInt(o.gen, 10) {
		return nil // an older generation: gone (no versioning)
	}
	return o
}

func (g *gcsFake) get(w http.ResponseWriter, r *http.Request, bucket, name string) {
	q := r.URL.Query()
	o := g.lookup(bucket, name, q)
	if o == nil {
		apiError(w, http.StatusNotFound, "No such object: %s/%s", bucket, name)
		return
	}
	if !checkGeneration(w, q, o) {
		return
	}
	if q.Get("alt") != "media" {
		writeJSON(w, g.resource(bucket, o))
		return
	}
	h := w.Header()
	h.Set("Content-Type", o.contentType)
	h.Set("X-Goog-Generation", strconv.FormatInt(o.gen, 10))
	h.Set("X-Goog-Metageneration", "1")
	h.Set("X-Goog-Hash", "crc32c="+encodeCRC(o.crc))
	h.Set("Last-Modified", o.updated.UTC().Format(http.TimeFormat))
	size := int64(len(o.data))
	rng := r.Header.Get("Range")
	if rng == "" {
		h.Set("Content-Length", strconv.FormatInt(size, 10))
		w.WriteHeader(http.StatusOK)
		w.Write(o.data)
		return
	}
	first, last, err := parseRange(rng, size)
	if err != nil {
		apiError(w, http.StatusRequestedRangeNotSatisfiable, "The requested range cannot be satisfied (%s of %d bytes).", rng, size)
		return
	}
	h.Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", first, last, size))
	h.Set("Content-Length", strconv.FormatInt(last-first+1, 10))
	w.WriteHeader(http.StatusPartialContent)
	w.Write(o.data[first : last+1])
}

// parseRange reads "bytes=a-b", "bytes=a-" or "bytes=-n" against an object of size bytes.
func parseRange(h string, size int64) (first, last int64, err error) {
	spec, ok := strings.CutPrefix(h, "bytes=")
	a, b, ok2 := strings.Cut(spec, "-")
	if !ok || !ok2 {
		return 0, 0, fmt.Errorf("bad range %q", h)
	}
	if a == "" {
		n, err := strconv.ParseInt(b, 10, 64)
		if err != nil || n <= 0 || size == 0 {
			return 0, 0, fmt.Errorf("bad range %q", h)
		}
		return max(0, size-n), size - 1, nil
	}
	if first, err = strconv.ParseInt(a, 10, 64); err != nil || first >= size {
		return 0, 0, fmt.Errorf("range %q beyond %d bytes", h, size)
	}
	last = size - 1
	if b != "" {
		if last, err = strconv.ParseInt(b, 10, 64); err != nil || last < first {
			return 0, 0, fmt.Errorf("bad range %q", h)
		}
		last = min(last, size-1)
	}
	return first, last, nil
}

func (g *gcsFake) delete(w http.ResponseWriter, q url.Values, bucket, name string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	o := g.buckets[bucket][name]
	if o == nil {
		apiError(w, http.StatusNotFound, "No such object: %s/%s", bucket, name)
		return
	}
	if !checkGeneration(w, q, o) {
		return
	}
	delete(g.buckets[bucket], name)
	w.WriteHeader(http.StatusNoContent)
}

// listPage is how many items one listing answer holds at most (GCS: 1000), small enough that
// the tests' listings take several pages.
const listPage = 50

func (g *gcsFake) list(w http.ResponseWriter, q url.Values, bucket string) {
	prefix, delim, token := q.Get("prefix"), q.Get("delimiter"), q.Get("pageToken")
	g.mu.Lock()
	var names []string
	for n := range g.buckets[bucket] {
		if strings.HasPrefix(n, prefix) {
			names = append(names, n)
		}
	}
	sort.Strings(names)
	// Items and prefixes in name order, a prefix standing where its first object would.
	type entry struct {
		o      *fakeObject
		prefix string
	}
	var entries []entry
	for _, n := range names {
		if delim != "" {
			if i := strings.Index(n[len(prefix):], delim); i >= 0 {
				p := n[:len(prefix)+i+len(delim)]
				if len(entries) == 0 || entries[len(entries)-1].prefix != p {
					entries = append(entries, entry{prefix: p})
				}
				continue
			}
		}
		entries = append(entries, entry{o: g.buckets[bucket][n]})
	}
	g.mu.Unlock()
	start := 0
	if token != "" {
		start, _ = strconv.Atoi(token)
	}
	end := min(start+listPage, len(entries))
	items, prefixes := []any{}, []string{}
	for _, e := range entries[min(start, len(entries)):end] {
		if e.o != nil {
			items = append(items, g.resource(bucket, e.o))
		} else {
			prefixes = append(prefixes, e.prefix)
		}
	}
	resp := map[string]any{"kind": "storage#objects", "items": items, "prefixes": prefixes}
	if end < len(entries) {
		resp["nextPageToken"] = strconv.Itoa(end)
	}
	writeJSON(w, resp)
}

func (g *gcsFake) compose(w http.ResponseWriter, r *http.Request, bucket, name string) {
	var req struct {
		SourceObjects []struct {
			Name string `json:"name"`
		} `json:"sourceObjects"`
		Destination objectMeta `json:"destination"`
	}
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
		apiError(w, http.StatusBadRequest, "compose request: %v", err)
		return
	}
	if n := len(req.SourceObjects); n == 0 || n > maxComposeSources {
		apiError(w, http.StatusBadRequest, "compose takes 1 to %d sources, got %d", maxComposeSources, n)
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	var data bytes.Buffer
	for _, src := range req.SourceObjects {
		o := g.buckets[bucket][src.Name]
		if o == nil {
			apiError(w, http.StatusNotFound, "Object %s (generation: 0) not found.", src.Name)
			return
		}
		data.Write(o.data)
	}
	if req.Destination.CRC32C != "" {
		if got := encodeCRC(crc32.Checksum(data.Bytes(), crcTable)); got != req.Destination.CRC32C {
			apiError(w, http.StatusBadRequest, "Provided CRC32C %q doesn't match calculated CRC32C %q.", req.Destination.CRC32C, got)
			return
		}
	}
	if !checkGeneration(w, r.URL.Query(), g.buckets[bucket][name]) {
		return
	}
	writeJSON(w, g.resource(bucket, g.storeLocked(bucket, name, req.Destination.ContentType, data.Bytes())))
}
