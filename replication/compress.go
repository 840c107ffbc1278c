package replication

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sort"
	"sync"
	"time"

	"google.golang.org/grpc"

	"github.com/mtcfs/mtcfs/planecodec"
	"github.com/mtcfs/mtcfs/replication/peerpb"
)

// Compression of chunks on the peer data stream (pushes, early files, fetches): each chunk is
// sent as it is or as one planecodec chunk (Chunk.codec), chosen per chunk by the sender where
// the peer supports it; see "Compression" in the package doc.

// Compression says when a sender compresses the chunks it sends. The zero value is
// CompressAuto. It is a flag.Value: `--peer-compress auto|on|off`.
type Compression uint8

const (
	// CompressAuto compresses the chunks sent to a peer when the link to it, measured as
	// transfers go, is slower than the codec: loopback and fast links stay uncompressed.
	CompressAuto Compression = iota
	// CompressOn compresses every chunk the peer takes compressed (planecodec still stores a
	// chunk as it is where coding does not pay).
	CompressOn
	// CompressOff never compresses; the agent still takes compressed chunks from its peers.
	CompressOff
)

// ParseCompression parses "auto", "on" or "off".
func ParseCompression(s string) (Compression, error) {
	switch s {
	case "auto":
		return CompressAuto, nil
	case "on":
		return CompressOn, nil
	case "off":
		return CompressOff, nil
	}
	return CompressAuto, fmt.Errorf("peer compression %q: want auto, on or off", s)
}

func (c Compression) String() string {
	switch c {
	case CompressOn:
		return "on"
	case CompressOff:
		return "off"
	}
	return "auto"
}

// Set parses s into c (flag.Value).
func (c *Compression) Set(s string) error {
	v, err := ParseCompression(s)
	if err == nil {
		*c = v
	}
	return err
}

// codecsHeader is the response header in which a receiver announces, at the start of every
// PushFiles stream, the chunk codecs it decodes; a sender compresses only on streams where it
// arrived. An agent older than the codec sends no header before the stream ends, and so only
// ever gets chunks as they are.
const codecsHeader = "mtcfs-chunk-codecs"

// heldHeader, in the same response header, says that the receiver held the stream before it
// announced itself (ReceiverConfig.Yield): chunks sent before the announcement crossed while
// it was held, and do not measure the link.
const heldHeader = "mtcfs-held"

// codecPlanesName is the codec's name in codecsHeader.
const codecPlanesName = "planes"

const codecPlanes = uint32(peerpb.ChunkCodec_CHUNK_CODEC_PLANES)

// Decisions of CompressAuto. The link's rate L (wire bytes/s) and the data's ratio r (original
// ÷ wire bytes of the chunks sent compressed) are measured per peer; c is what one core
// compresses (codecRate). Raw transfers turn compression on when r·L < autoOnBelow·c: even with
// the bytes shrunk by r, the link stays clearly slower than one core's codec, so the codec keeps
// up and the link carries fewer bytes. Compressed transfers turn it off when the original bytes
// moved faster than autoOffAbove·c (the link is no longer the slower part), or when the sender
// waited for the network less than autoCodecBound of its time (the codec was the bottleneck).
// The gap between the two thresholds is the hysteresis.
const (
	autoOnBelow    = 0.7
	autoOffAbove   = 0.9
	autoCodecBound = 0.1
	// autoPriorRatio is the ratio assumed before anything was sent compressed to a peer: what
	// planecodec gets on a mix of bf16 and fp32 tensors (bench/RESULTS.md, codecbench).
	autoPriorRatio = 1.3
	// minLinkSample is the fewest bytes a transfer needs to count as a measurement: below, its
	// time is mostly round trips, not throughput.
	minLinkSample = 4 << 20
	// rateWeight is the weight of a new measurement in the running estimates.
	rateWeight = 0.5
)

// linkSample is what one transfer measured.
type linkSample struct {
	orig, wire int64         // chunk bytes, as read and as sent
	elapsed    time.Duration // wall time of the streams, from the first open to the last end
	// waitFrac is the share of the streams' time spent waiting for the network (in Send and
	// for the receiver's reply); -1 when unknown (a fetch).
	waitFrac float64
	// compressed is set when the chunks were sent compressed (those where coding paid).
	compressed bool
}

// linkMeter keeps the measurements and CompressAuto's decision for one peer.
type linkMeter struct {
	mu      sync.Mutex
	on      bool    // GUARDED_BY(mu)
	rate    float64 // GUARDED_BY(mu); wire bytes/s, 0 before the first measurement
	ratio   float64 // GUARDED_BY(mu); original ÷ wire bytes of compressed transfers
	samples int     // GUARDED_BY(mu)
	changes int     // GUARDED_BY(mu); times the decision flipped
	// silent is set when the peer's last push stream ended without announcing the codec (an
	// agent older than compression): compressed pushes then send at once, without waiting.
	silent bool // GUARDED_BY(mu)
}

func (m *linkMeter) setAnnounces(yes bool) {
	m.mu.Lock()
	m.silent = !yes
	m.mu.Unlock()
}

// mayAnnounce says whether a push stream should wait for the codec's announcement.
func (m *linkMeter) mayAnnounce() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return !m.silent
}

func blend(old, v float64) float64 {
	if old == 0 {
		return v
	}
	return old + rateWeight*(v-old)
}

// add takes a transfer's measurement into the estimates and revises the decision; codec is the
// codec's rate (original bytes/s on one core).
func (m *linkMeter) add(s linkSample, codec float64) {
	if s.orig < minLinkSample || s.elapsed <= 0 {
		return
	}
	secs := s.elapsed.Seconds()
	m.mu.Lock()
	defer m.mu.Unlock()
	m.samples++
	m.rate = blend(m.rate, float64(s.wire)/secs)
	was := m.on
	if s.compressed {
		m.ratio = blend(m.ratio, float64(s.orig)/float64(s.wire))
		codecBound := s.waitFrac >= 0 && s.waitFrac < autoCodecBound
		m.on = !(codecBound || float64(s.orig)/secs > autoOffAbove*codec)
	} else if m.on {
		m.on = m.expectedRatio()*m.rate <= autoOffAbove*codec
	} else {
		m.on = m.expectedRatio()*m.rate < autoOnBelow*codec
	}
	if m.on != was {
		m.changes++
	}
}

func (m *linkMeter) expectedRatio() float64 { // REQUIRES mu
	if m.ratio == 0 {
		return autoPriorRatio
	}
	return max(m.ratio, 1)
}

func (m *linkMeter) compressing() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.on
}

// PeerLink is what a Sender measured of the link to one peer.
type PeerLink struct {
	Peer string // the connection's target
	// Rate is the link's throughput in wire bytes/s, from recent transfers of at least 4 MiB.
	Rate float64
	// Ratio is original ÷ wire bytes of the transfers sent compressed (0: none yet).
	Ratio float64
	// Compressing says whether chunks to the peer go compressed: CompressAuto's current
	// decision, or the fixed mode.
	Compressing bool
	Samples     int // transfers measured
	Changes     int // times CompressAuto's decision flipped (0 in the fixed modes)
}

// PeerLinks returns the measurements of every peer this sender pushed to or fetched from,
// ordered by peer.
func (s *Sender) PeerLinks() []PeerLink {
	s.linksMu.Lock()
	defer s.linksMu.Unlock()
	out := make([]PeerLink, 0, len(s.links))
	for peer, m := range s.links {
		m.mu.Lock()
		l := PeerLink{Peer: peer, Rate: m.rate, Ratio: m.ratio, Compressing: m.on, Samples: m.samples, Changes: m.changes}
		m.mu.Unlock()
		if s.Compress != CompressAuto { // what the sender does, not what auto would have chosen
			l.Compressing, l.Changes = s.Compress == CompressOn, 0
		}
		out = append(out, l)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Peer < out[j].Peer })
	return out
}

// linkKey names the peer behind conn for the link meters.
func linkKey(conn grpc.ClientConnInterface) string {
	if t, ok := conn.(interface{ Target() string }); ok {
		return t.Target()
	}
	return fmt.Sprintf("%p", conn)
}

func (s *Sender) meter(key string) *linkMeter {
	s.linksMu.Lock()
	defer s.linksMu.Unlock()
	if s.links == nil {
		s.links = map[string]*linkMeter{}
	}
	m := s.links[key]
	if m == nil {
		m = &linkMeter{}
		s.links[key] = m
	}
	return m
}

// compressTo says whether chunks sent to the peer behind key go compressed (where it takes them).
func (s *Sender) compressTo(key string) bool {
	switch s.Compress {
	case CompressOn:
		return true
	case CompressOff:
		return false
	}
	return s.meter(key).compressing()
}

// measure records a transfer to or from the peer behind key.
func (s *Sender) measure(key string, sample linkSample) {
	s.meter(key).add(sample, s.codecRate())
}

func (s *Sender) codecRate() float64 {
	if s.CodecRate > 0 {
		return s.CodecRate
	}
	return measuredCodecRate()
}

var codecRate struct {
	once sync.Once
	rate float64
}

// measuredCodecRate is what one core of this machine compresses, in original bytes per second:
// measured once, on a MiB of bf16 values shaped like model weights, best of three.
func measuredCodecRate() float64 {
	codecRate.once.Do(func() {
		rnd := rand.New(rand.NewPCG(1, 2))
		src := make([]byte, 1<<20)
		for i := 0; i < len(src); i += 2 {
			bits := math.Float32bits(float32(rnd.NormFloat64() * 0.02))
			src[i], src[i+1] = byte(bits>>16), byte(bits>>24) // bf16: the top half, little-endian
		}
		var enc planecodec.Encoder
		dst := make([]byte, 0, planecodec.MaxEncodedLen(len(src)))
		best := time.Duration(math.MaxInt64)
		for range 3 {
			start := time.Now()
			if _, err := enc.Encode(dst[:0], src); err != nil {
				panic(err) // a MiB is always within the codec's limits
			}
			best = min(best, time.Since(start))
		}
		codecRate.rate = float64(len(src)) / max(best, time.Microsecond).Seconds()
	})
	return codecRate.rate
}

// encoders and inflaters keep codec scratch (a chunk's worth each) between streams.
var (
	encoders  = sync.Pool{New: func() any { return new(planecodec.Encoder) }}
	inflaters = sync.Pool{New: func() any { return &inflater{dec: planecodec.NewDecoder(MaxChunkSize)} }}
)

// inflater decodes the compressed chunks of one stream into buffers it reuses: at most a chunk
// as stored and a chunk decoded.
type inflater struct {
	dec   *planecodec.Decoder
	wire  []byte
	plain []byte
}

// decode returns the original bytes of c, a compressed chunk whose CRC was checked, valid until
// the next call. The header is checked before anything is decoded, against the bytes the chunk
// may cover (limit).
func (f *inflater) decode(c *inChunk, limit int64) ([]byte, error) {
	f.wire = slices.Grow(f.wire[:0], c.size)
	for _, b := range c.data {
		f.wire = append(f.wire, b.ReadOnlyData()...)
	}
	h, err := planecodec.ParseHeader(f.wire)
	if err != nil {
		return nil, err
	}
	if h.Len == 0 || int64(h.Len) > limit {
		return nil, fmt.Errorf("decodes to %d bytes, at most %d fit", h.Len, limit)
	}
	f.plain, err = f.dec.Decode(f.plain[:0], f.wire)
	return f.plain, err
}

func getInflater() *inflater  { return inflaters.Get().(*inflater) }
func putInflater(f *inflater) { inflaters.Put(f) }
