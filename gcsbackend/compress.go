package gcsbackend

import (
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"log/slog"
	"os"
	"runtime"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/googleapis/gax-go/v2"
	"golang.org/x/sync/semaphore"

	"github.com/mtcfs/mtcfs/planecodec"
)

// Compression says how Upload stores data objects (SPEC §6: opt-in).
type Compression string

const (
	// CompressOff stores every file's bytes as they are: the backup is
	// byte-identical to the reference layout, readable by any tool. The zero
	// value means the same.
	CompressOff Compression = "off"
	// CompressAuto stores a file as a sequence of planecodec chunks when that
	// saves at least 1/64 of it, and as it is otherwise (random or already
	// compressed data, small files). The manifest records each object's codec.
	CompressAuto Compression = "auto"
)

// ParseCompression reads a --backup-compress value.
func ParseCompression(s string) (Compression, error) {
	switch Compression(s) {
	case CompressOff, CompressAuto:
		return Compression(s), nil
	case "":
		return CompressOff, nil
	}
	return "", fmt.Errorf("compression %q: want auto or off", s)
}

const (
	// codecPlanes is the manifest's name of planecodec chunk sequences.
	codecPlanes = "planecodec"
	// DefaultChunkLen is the file bytes per compressed chunk: the 4 MiB the
	// store already moves at a time (onceChunkSize, replication's default
	// chunk), so that compressing or decompressing holds two such buffers per
	// request in flight.
	DefaultChunkLen = 4 << 20
	// Chunk lengths a manifest may name: the decoder allocates up to the
	// chunk length a (possibly hostile) manifest declares.
	minChunkLen = 64 << 10
	maxChunkLen = 16 << 20
	// chunksPerRead is the chunks one ranged read of a compressed object
	// covers (32 MiB of file bytes, like the GCS store's DefaultGCSPartSize
	// for plain files): a larger file is read as several ranges in parallel,
	// a smaller one in one request.
	chunksPerRead = 8
)

var planecodecHeaderLen = int64(planecodec.MaxEncodedLen(0))

func (b *Backups) compress() bool { return b.Compress == CompressAuto }

func (b *Backups) chunkLen() int64 {
	if b.chunkLenForTest > 0 {
		return b.chunkLenForTest
	}
	return DefaultChunkLen
}

// bufPool pools byte buffers of chunks, grown to what each use needs.
type bufPool struct{ p sync.Pool }

func (bp *bufPool) get(n int) *[]byte {
	b, _ := bp.p.Get().(*[]byte)
	if b == nil {
		b = new([]byte)
	}
	if cap(*b) < n {
		*b = make([]byte, n)
	}
	*b = (*b)[:n]
	return b
}

func (bp *bufPool) put(b *[]byte) { bp.p.Put(b) }

// codec bounds the files planned (encoded a first time) and the chunks
// decoded at once by one Upload, Download or Verify to the number of CPUs:
// the work is CPU-bound, and so the memory of the chunks in flight is bounded
// too (a file chunk and a stored chunk each). The chunks a plan keeps for the
// upload (so that it does not encode them again) are bounded by keep. Encoding
// again as the store reads is bounded by the store's requests in flight, one
// chunk each, plus the chunks an upload keeps in its cache.
type codec struct {
	chunkLen int64 // file bytes per chunk, when encoding
	slots    *semaphore.Weighted
	keep     *semaphore.Weighted // stored chunks plans may keep at once; nil: none
	plain    bufPool             // file bytes of a chunk
	stored   bufPool             // a stored chunk
	enc      sync.Pool           // *planecodec.Encoder
	dec      sync.Pool           // *planecodec.Decoder
	encodes  atomic.Int64        // chunks encoded, for tests
}

// newCodec returns a codec of chunkLen-byte chunks whose plans keep at most
// keepChunks encoded chunks at once for their uploads (0 for readers).
func newCodec(chunkLen int64, keepChunks int) *codec {
	c := &codec{chunkLen: chunkLen, slots: semaphore.NewWeighted(int64(runtime.GOMAXPROCS(0)))}
	if keepChunks > 0 {
		c.keep = semaphore.NewWeighted(int64(keepChunks))
	}
	c.enc.New = func() any { return new(planecodec.Encoder) }
	c.dec.New = func() any { return planecodec.NewDecoder(maxChunkLen) }
	return c
}

// encodeChunk reads the file bytes [off, off+n) of r and encodes them into
// *dst (a buffer of c.stored). It returns the stored chunk and the CRC32C of
// the file bytes.
func (c *codec) encodeChunk(r io.ReaderAt, off, n int64, dst *[]byte) ([]byte, uint32, error) {
	pp := c.plain.get(int(n))
	defer c.plain.put(pp)
	plain := *pp
	if m, err := r.ReadAt(plain, off); int64(m) != n {
		if err == nil || err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return nil, 0, fmt.Errorf("read [%d, +%d): %w", off, n, err)
	}
	c.encodes.Add(1)
	e := c.enc.Get().(*planecodec.Encoder)
	defer c.enc.Put(e)
	if cap(*dst) < planecodec.MaxEncodedLen(int(n)) {
		*dst = make([]byte, 0, planecodec.MaxEncodedLen(int(n)))
	}
	chunk, err := e.Encode((*dst)[:0], plain)
	return chunk, crc32.Checksum(plain, crcTable), err
}

// encodedPlan is what compressing a file gives, found by encoding it once
// and keeping the chunks' lengths and CRC32Cs, and as many of the encoded
// chunks as the codec's keep budget allows: the upload sends those as they
// are instead of encoding them again.
type encodedPlan struct {
	size      int64     // file bytes
	chunkLen  int64     // file bytes per chunk
	offs      []int64   // stored offset of chunk i; offs[len] = stored size
	crcs      []uint32  // CRC32C of stored chunk i
	storedCRC uint32    // of the whole object
	fileCRC   uint32    // of the file's bytes
	kept      []*[]byte // stored chunk i if kept (a buffer of codec.stored), else nil
}

// release gives the kept chunks back to c; the plan no longer has any.
func (p *encodedPlan) release(c *codec) {
	for i, b := range p.kept {
		if b != nil {
			c.stored.put(b)
			c.keep.Release(1)
			p.kept[i] = nil
		}
	}
}

func (p *encodedPlan) stored() int64 { return p.offs[len(p.offs)-1] }

// pays reports whether storing the file compressed saves at least 1/64 of
// it, planecodec's own threshold for a chunk. Below that the object stays
// plain, readable by every tool.
func (p *encodedPlan) pays() bool { return p.stored() <= p.size-p.size/64-1 }

// chunks returns the stored length of every chunk, as the manifest lists them.
func (p *encodedPlan) chunks() []int64 {
	out := make([]int64, len(p.offs)-1)
	for i := range out {
		out[i] = p.offs[i+1] - p.offs[i]
	}
	return out
}

// planFile encodes the size bytes of r chunk by chunk and returns the plan of
// its compressed object, keeping the encoded chunks the codec's keep budget
// has room for (the caller releases them). It holds a codec slot for the
// whole file, so that files are planned a few at a time and the first start
// uploading while others are still being planned.
func (c *codec) planFile(ctx context.Context, r io.ReaderAt, size int64) (_ *encodedPlan, err error) {
	if err := c.slots.Acquire(ctx, 1); err != nil {
		return nil, err
	}
	defer c.slots.Release(1)
	cl := c.chunkLen
	n := (size + cl - 1) / cl
	p := &encodedPlan{size: size, chunkLen: cl, offs: make([]int64, 1, n+1), crcs: make([]uint32, 0, n), kept: make([]*[]byte, n)}
	defer func() {
		if err != nil {
			p.release(c)
		}
	}()
	// The upload sends kept chunks as this pass read them: a file written meanwhile must not
	// go out torn (the file's own CRC32C in the manifest would match the torn bytes).
	before, statErr := fileVersion(r)
	defer func() {
		if err == nil && statErr == nil {
			if after, e := fileVersion(r); e != nil || after != before {
				err = fmt.Errorf("the file changed while it was encoded (%v, then %v)", before, after)
			}
		}
	}()
	dp := c.stored.get(0)
	defer func() { c.stored.put(dp) }()
	for i, off := 0, int64(0); off < size; i, off = i+1, off+cl {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		chunk, plainCRC, err := c.encodeChunk(r, off, min(cl, size-off), dp)
		if err != nil {
			return nil, err
		}
		crc := crc32.Checksum(chunk, crcTable)
		p.crcs = append(p.crcs, crc)
		p.offs = append(p.offs, p.offs[len(p.offs)-1]+int64(len(chunk)))
		p.storedCRC = crc32cCombine(p.storedCRC, crc, int64(len(chunk)))
		p.fileCRC = crc32cCombine(p.fileCRC, plainCRC, min(cl, size-off))
		if c.keep != nil && c.keep.TryAcquire(1) {
			*dp = chunk
			p.kept[i] = dp
			dp = c.stored.get(0)
		}
	}
	return p, nil
}

// version is what changes when a file is written: its size, modification and change times.
type version struct {
	size         int64
	mtime, ctime int64 // ns
}

func (v version) String() string {
	return fmt.Sprintf("%d bytes, modified %s", v.size, time.Unix(0, v.mtime).UTC().Format(time.RFC3339Nano))
}

// fileVersion returns r's version if r is a file that can tell it (an *os.File).
func fileVersion(r io.ReaderAt) (version, error) {
	f, ok := r.(interface{ Stat() (os.FileInfo, error) })
	if !ok {
		return version{}, errors.ErrUnsupported
	}
	fi, err := f.Stat()
	if err != nil {
		return version{}, err
	}
	v := version{size: fi.Size(), mtime: fi.ModTime().UnixNano()}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		v.ctime = st.Ctim.Nano()
	}
	return v, nil
}

// encodedFile is the compressed object of a local file as a LocalFile that
// ObjectStore.PutFile reads: the chunks its plan kept as they are, the others
// encoded again as they are read, so that the object is never held whole.
// Chunks encoded again are kept in cache, so that the small sequential reads
// of one request encode each chunk once.
type encodedFile struct {
	src   LocalFile
	plan  *encodedPlan
	codec *codec
	cache *chunkCache
}

var _ LocalFile = (*encodedFile)(nil)

func (v *encodedFile) Name() string { return v.src.Name() + " (compressed)" }

func (v *encodedFile) WriteAt([]byte, int64) (int, error) {
	return 0, errors.New("a compressed view is read-only")
}

// ReadAt reads the object's bytes at off.
func (v *encodedFile) ReadAt(p []byte, off int64) (int, error) {
	stored := v.plan.stored()
	n := 0
	for n < len(p) {
		pos := off + int64(n)
		if pos >= stored {
			return n, io.EOF
		}
		i := sort.Search(len(v.plan.offs)-1, func(k int) bool { return v.plan.offs[k+1] > pos }) // chunk holding pos
		m, err := v.copyChunk(i, p[n:], pos-v.plan.offs[i])
		if err != nil {
			return n, err
		}
		n += m
	}
	return n, nil
}

// copyChunk copies stored chunk i from its byte at into p.
func (v *encodedFile) copyChunk(i int, p []byte, at int64) (int, error) {
	if kept := v.plan.kept[i]; kept != nil {
		return copy(p, (*kept)[at:]), nil
	}
	if n, ok := v.cache.copy(v, i, p, at); ok {
		return n, nil
	}
	dp := v.codec.stored.get(0)
	off := int64(i) * v.plan.chunkLen
	// No codec slot: the store's requests in flight bound these encodes.
	chunk, _, err := v.codec.encodeChunk(v.src, off, min(v.plan.chunkLen, v.plan.size-off), dp)
	if err == nil && int64(len(chunk)) != v.plan.offs[i+1]-v.plan.offs[i] {
		err = fmt.Errorf("chunk %d encodes to %d bytes, %d before: the file changed during the upload", i, len(chunk), v.plan.offs[i+1]-v.plan.offs[i])
	}
	if err != nil {
		v.codec.stored.put(dp)
		return 0, fmt.Errorf("%s: %w", v.Name(), err)
	}
	*dp = chunk
	return v.cache.add(v, i, dp, p, at), nil
}

// rangeCRC returns the CRC32C of the object's bytes [off, off+size) from the
// chunks' CRC32Cs, encoding only the chunks the range cuts (the GCS store
// asks for its parts' CRC32Cs before sending them).
func (v *encodedFile) rangeCRC(ctx context.Context, off, size int64) (uint32, error) {
	if off < 0 || size < 0 || off+size > v.plan.stored() {
		return 0, fmt.Errorf("%s: range [%d, +%d) beyond its %d bytes", v.Name(), off, size, v.plan.stored())
	}
	var crc uint32
	end := off + size
	buf := make([]byte, 0, copyBufSize)
	for pos := off; pos < end; {
		if err := ctx.Err(); err != nil {
			return 0, err
		}
		i := sort.Search(len(v.plan.offs)-1, func(k int) bool { return v.plan.offs[k+1] > pos })
		cs, ce := v.plan.offs[i], v.plan.offs[i+1]
		if pos == cs && ce <= end {
			crc = crc32cCombine(crc, v.plan.crcs[i], ce-cs)
			pos = ce
			continue
		}
		n := min(end, ce) - pos
		for n > 0 {
			b := buf[:min(n, int64(cap(buf)))]
			m, err := v.ReadAt(b, pos)
			if m != len(b) {
				if err == nil || err == io.EOF {
					err = io.ErrUnexpectedEOF
				}
				return 0, err
			}
			crc = crc32.Update(crc, crcTable, b)
			pos += int64(m)
			n -= int64(m)
		}
	}
	return crc, nil
}

// chunkCache keeps the last few encoded chunks of one Upload, for all its
// files: as many as requests may read at once, plus some slack. Copies happen
// under the lock, so an evicted buffer can go back to the pool at once.
type chunkCache struct {
	mu      sync.Mutex
	max     int
	bufs    *bufPool
	entries []cacheEntry // GUARDED_BY(mu), oldest first
}

type cacheEntry struct {
	file *encodedFile
	i    int
	data *[]byte
}

func newChunkCache(max int, bufs *bufPool) *chunkCache {
	return &chunkCache{max: max, bufs: bufs}
}

// copy copies chunk i of f from at into p if the cache holds it.
func (c *chunkCache) copy(f *encodedFile, i int, p []byte, at int64) (int, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for k := len(c.entries) - 1; k >= 0; k-- {
		if e := c.entries[k]; e.file == f && e.i == i {
			return copy(p, (*e.data)[at:]), true
		}
	}
	return 0, false
}

// add caches chunk i of f (data, a buffer of c.bufs) and copies from
// at into p.
func (c *chunkCache) add(f *encodedFile, i int, data *[]byte, p []byte, at int64) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := copy(p, (*data)[at:])
	if len(c.entries) >= c.max {
		c.bufs.put(c.entries[0].data)
		c.entries = append(c.entries[:0], c.entries[1:]...)
	}
	c.entries = append(c.entries, cacheEntry{file: f, i: i, data: data})
	return n
}

// drop releases every buffer the cache holds.
func (c *chunkCache) drop() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, e := range c.entries {
		c.bufs.put(e.data)
	}
	c.entries = nil
}

// scaledProgress turns the stored bytes of one compressed object moved into
// file bytes, so that an upload or download reports file bytes whatever the
// codec: done reaches the file's size exactly when the object is complete.
type scaledProgress struct {
	mu           sync.Mutex
	stored, size int64
	moved, shown int64 // GUARDED_BY(mu)
	report       func(int)
}

func newScaledProgress(stored, size int64, report func(int)) func(int) {
	if report == nil {
		return nil
	}
	s := &scaledProgress{stored: stored, size: size, report: report}
	return s.add
}

func (s *scaledProgress) add(n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.moved += int64(n)
	want := s.size
	if s.moved < s.stored {
		want = int64(float64(s.moved) / float64(s.stored) * float64(s.size))
	}
	if want > s.shown {
		s.report(int(want - s.shown))
		s.shown = want
	}
}

// readCompressed reads the compressed object name described by mf, in ranges
// of whole chunks read in parallel (each request holding one unit of
// requests), checks every chunk against the manifest and its own CRC32C,
// decodes it and hands the file bytes to out with their offset (out may be
// nil). It returns the CRC32C of all the file bytes, which the caller checks.
func (b *Backups) readCompressed(ctx context.Context, c *codec, name string, mf manifestFile, requests *semaphore.Weighted, out func(p []byte, off int64) error) (uint32, error) {
	// No Stat first (a round trip per file): every chunk is checked, and an
	// object cut short ends a range early.
	n := len(mf.Chunks)
	per := chunksPerRead
	type rng struct {
		first, last int    // chunks
		off, size   int64  // stored bytes
		crc         uint32 // of the file bytes
	}
	var ranges []rng
	var off int64
	for first := 0; first < n; first += per {
		r := rng{first: first, last: min(first+per, n), off: off}
		for _, c := range mf.Chunks[r.first:r.last] {
			r.size += c
		}
		off += r.size
		ranges = append(ranges, r)
	}
	t := FileTransfer{Requests: requests}.withRequests()
	err := t.eachRequest(ctx, len(ranges), func(ctx context.Context, k int) error {
		r := &ranges[k]
		// Chunks [r.first, i) are read; off is chunk i's stored offset. A chunk damaged on the
		// way is read again from there (see chunkDamage).
		i, off := r.first, r.off
		var last *chunkDamage
		pause := transitPause
		read := 0 // of the chunk last damaged: each chunk gets transitReads (a review: a range's
		// chunks damaged now and then shared them)
		for {
			err := b.readChunks(ctx, c, name, mf, &i, &off, r.off+r.size, r.last, &r.crc, out)
			var dmg *chunkDamage
			if !errors.As(err, &dmg) {
				return err
			}
			if last == nil || dmg.chunk != last.chunk {
				read, pause = 0, transitPause
			}
			read++
			switch {
			case last != nil && last.same(dmg) && b.damagedOnTheWay(ctx, name, mf):
				return fmt.Errorf("read %s: chunk %d arrived damaged alike on two reads, but the store keeps the object with the crc32c the manifest recorded and a whole read does not match it: damaged on the way (a proxy, the network), not in the store; try again later: %v", name, dmg.chunk, dmg.err)
			case last != nil && last.same(dmg):
				// Read alike twice: damaged in the store (or cut short there).
				return err
			case read == transitReads:
				return fmt.Errorf("read %s: %d reads delivered damaged bytes, each differently: damaged on the way (the network, a proxy), not in the store; try again later: %v", name, read, dmg.err)
			}
			slog.Warn("backup location: a compressed chunk arrived damaged; reading again", "object", name, "chunk", dmg.chunk, "read", read, "of", transitReads, "err", dmg.err)
			last = dmg
			if err := gax.Sleep(ctx, pause); err != nil {
				return err
			}
			pause *= 2
		}
	})
	if err != nil {
		return 0, err
	}
	var crc uint32
	for i, r := range ranges {
		crc = crc32cCombine(crc, r.crc, min(mf.Size, int64(ranges[i].last)*mf.ChunkLen)-int64(r.first)*mf.ChunkLen)
	}
	return crc, nil
}

// readChunks reads the chunks *i up to last of a compressed object, the first at stored offset
// *off, in one request ending at end, and hands them on as readChunk does; *i and *off advance
// past each chunk read, and *crc takes its file bytes in. A chunk that arrives damaged (it does
// not decode, or the object ends inside it) ends the request with a *chunkDamage.
//
// The store's CRC32C covers the whole object and these are ranges: a chunk damaged on the way
// (a proxy, the network) is told from one damaged in the store by reading it again, which the
// caller does — the first reads alike, the second not. Failed at once, a download damaged on
// the way failed twice and the restore marked intact backup data damaged for good, as it did
// for uncompressed objects before GetFile read them again (a black-box run).
func (b *Backups) readChunks(ctx context.Context, c *codec, name string, mf manifestFile, i *int, off *int64, end int64, last int, crc *uint32, out func(p []byte, off int64) error) error {
	body, err := b.Store.Open(ctx, name, *off, end-*off)
	if err != nil {
		return err
	}
	defer body.Close()
	for ; *i < last; *i++ {
		plain, err := b.readChunk(ctx, c, body, mf, *i, out)
		if err != nil {
			if d := (*chunkDamage)(nil); errors.As(err, &d) {
				d.chunk = *i
				return fmt.Errorf("%s: chunk %d: %w", name, *i, d)
			}
			return fmt.Errorf("%s: chunk %d: %w", name, *i, err)
		}
		*crc = crc32cCombine(*crc, plain, mf.chunkSize(*i))
		*off += mf.Chunks[*i]
	}
	return nil
}

// damagedOnTheWay tells, for a chunk of name that arrived damaged alike on two reads, whether
// the damage was on the way: the store checks its objects at rest (GCS: the CRC32C it keeps),
// keeps name with the size and CRC32C the manifest recorded, and a whole read of it does not
// match that CRC32C. Damaged alike on every read (a faulty proxy or NIC) and taken for damage
// in the store, an intact backup was recorded damaged for good (black-box h55). A whole read
// that matches means the stored bytes are those the manifest recorded, and the chunk among them
// was stored damaged. A file:// store's CRC32C is a cache of its own that bit rot does not
// change: not asked.
func (b *Backups) damagedOnTheWay(ctx context.Context, name string, mf manifestFile) bool {
	if c, ok := b.Store.(interface{ checksAtRest() bool }); !ok || !c.checksAtRest() || mf.StoredCRC32C == 0 {
		return false
	}
	a, err := b.Store.Stat(ctx, name)
	if err != nil || a.Size != mf.StoredSize || a.CRC32C != uint32(mf.StoredCRC32C) {
		return false
	}
	r, err := b.Store.Open(ctx, name, 0, -1)
	if err != nil {
		return false
	}
	defer r.Close()
	n, crc, err := copyCRC(ctx, io.Discard, r)
	if ce := (*ChecksumError)(nil); errors.As(err, &ce) {
		return true // the store's own check of the whole read failed
	}
	return err == nil && (n != mf.StoredSize || crc != uint32(mf.StoredCRC32C))
}

// chunkDamage is a compressed chunk that arrived damaged: what was read of it (n bytes of
// CRC32C crc), and why it is refused (err, wrapping planecodec.ErrCorrupt or an EOF).
type chunkDamage struct {
	chunk int
	n     int
	crc   uint32
	err   error
}

func (d *chunkDamage) Error() string { return d.err.Error() }
func (d *chunkDamage) Unwrap() error { return d.err }

// same reports whether two reads of a chunk delivered the same damaged bytes.
func (d *chunkDamage) same(o *chunkDamage) bool {
	return d.chunk == o.chunk && d.n == o.n && d.crc == o.crc
}

// readChunk reads chunk i of a compressed object from body, decodes it,
// hands it to out and returns the CRC32C of its file bytes. Bytes that
// arrive damaged give a *chunkDamage.
func (b *Backups) readChunk(ctx context.Context, c *codec, body io.Reader, mf manifestFile, i int, out func(p []byte, off int64) error) (uint32, error) {
	sp := c.stored.get(int(mf.Chunks[i]))
	defer c.stored.put(sp)
	stored := *sp
	if n, err := io.ReadFull(body, stored); err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return 0, &chunkDamage{n: n, crc: crc32.Checksum(stored[:n], crcTable), err: err}
		}
		return 0, err
	}
	damaged := func(err error) error {
		return &chunkDamage{n: len(stored), crc: crc32.Checksum(stored, crcTable), err: err}
	}
	if err := c.slots.Acquire(ctx, 1); err != nil {
		return 0, err
	}
	defer c.slots.Release(1)
	h, err := planecodec.ParseHeader(stored)
	if err != nil {
		return 0, damaged(err)
	}
	if int64(h.Len) != mf.chunkSize(i) {
		return 0, damaged(fmt.Errorf("%w: holds %d bytes, manifest says %d", planecodec.ErrCorrupt, h.Len, mf.chunkSize(i)))
	}
	pp := c.plain.get(int(mf.chunkSize(i)))
	defer c.plain.put(pp)
	d := c.dec.Get().(*planecodec.Decoder)
	defer c.dec.Put(d)
	plain, err := d.Decode((*pp)[:0], stored)
	if err != nil {
		return 0, damaged(err)
	}
	if out != nil {
		if err := out(plain, int64(i)*mf.ChunkLen); err != nil {
			return 0, err
		}
	}
	return crc32.Checksum(plain, crcTable), nil
}
