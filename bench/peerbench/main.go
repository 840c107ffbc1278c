// Command peerbench measures the peer data path — replication.Sender pushing a checkpoint tree
// to a replication.Receiver over gRPC on loopback, every chunk CRC-checked and the whole tree
// BLAKE3-verified before it is accepted — against a plain Go TCP sender and receiver copying the
// same bytes with no checks, in one run.
//
// Run it in bench/ (a module of its own; no root needed):
//
//	go run ./peerbench -out RESULTS.md
//
// It takes about two minutes on 2 CPUs and needs about 3 GiB of free space in -shm. Without -out
// it only prints.
//
// The tree is -files × -file-mib of random bytes (default 16 × 64 MiB = 1 GiB) in a directory
// under -shm (tmpfs). Sender and receiver run in this process, connected over 127.0.0.1, and
// write into the same tmpfs. Each variant is timed from the start of the transfer until the
// receiver holds the whole tree:
//
//   - plain TCP: one connection; per file a small header, then the bytes with io.Copy (which
//     uses sendfile on the sender and splice on the receiver: the fastest plain Go copy). Also
//     with four connections, the files spread over them.
//   - minimal pipeline: the same TCP sender; the receiver reads 4 MiB chunks, computes each
//     chunk's CRC32C and the file's BLAKE3 (checked against the source's), and writes with
//     pwrite: the least any verified copy does. The report compares the default push's CPU per
//     GiB with this one's (issue 12: at most 1.25×).
//   - gRPC push: Sender.Push until it returns, i.e. the receiver verified every chunk's CRC-32C,
//     hashed every file (as its chunks arrived), checked the digests and the tree hash and moved the tree out of its
//     incoming directory (Accept is a rename). The sender's file digests come from a
//     layout.DigestCache filled beforehand, as in the agent, where files are hashed when the job
//     closes them; one variant leaves the cache out, so the push hashes the files first.
//
// Every round runs all variants, the first one rotating from round to round so that drift hits
// them alike; the figures are medians over -reps rounds after -warmup unrecorded ones. Goodput
// is tree bytes ÷ time, in GB/s (10^9 bytes). CPU is the CPU time of this process (sender and
// receiver together) per transfer.
package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"hash/crc32"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"lukechampine.com/blake3"

	"github.com/mtcfs/mtcfs/bench/internal/benchkit"
	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/replication"
)

const prog = "peerbench"

type config struct {
	out      string
	shm      string
	reps     int
	warmup   int
	files    int
	fileSize int64
	sweep    bool
	only     string // run only variants whose key contains this
	profile  string // CPU profile of the measured rounds
}

func main() {
	var cfg config
	var fileMiB int
	flag.StringVar(&cfg.out, "out", "", "Markdown file whose peerbench section receives the results, e.g. RESULTS.md (default: print only)")
	flag.StringVar(&cfg.shm, "shm", "/dev/shm", "tmpfs directory for the source tree and the received copies")
	flag.IntVar(&cfg.reps, "reps", 5, "measured rounds (at least 5)")
	flag.IntVar(&cfg.warmup, "warmup", 1, "unrecorded rounds before the measured ones")
	flag.IntVar(&cfg.files, "files", 16, "files in the tree")
	flag.IntVar(&fileMiB, "file-mib", 64, "size of each file in MiB")
	flag.BoolVar(&cfg.sweep, "sweep", true, "also sweep chunk size (1, 4, 16 MiB) and streams (1, 2, 4, 8)")
	flag.StringVar(&cfg.only, "only", "", "run only the variants whose key contains this string (keys are printed per round)")
	flag.StringVar(&cfg.profile, "cpuprofile", "", "write a CPU profile of the measured rounds to this file")
	flag.Parse()
	cfg.fileSize = int64(fileMiB) << 20
	var invalid error
	if cfg.reps < 5 || cfg.files < 1 || fileMiB < 1 {
		invalid = errors.New("want -reps ≥ 5, -files ≥ 1, -file-mib ≥ 1")
	}
	benchkit.Main(prog, invalid, func(ctx context.Context) error { return run(ctx, cfg) })
}

// sample is one timed transfer.
type sample struct {
	seconds, cpu float64
}

// variant is one way of moving the tree.
type variant struct {
	key      string
	transfer string // "plain TCP" or "gRPC push"
	chunk    int    // gRPC chunk size, 0 for TCP
	streams  int    // gRPC streams or TCP connections
	cached   bool   // sender digests from the cache
	checked  bool   // the minimal pipeline's receiver (CRC32C and BLAKE3 on arrival, pwrite), over TCP or gRPC
	run      func(ctx context.Context) error
}

func run(ctx context.Context, cfg config) error {
	work, err := os.MkdirTemp(cfg.shm, "peerbench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	env := benchkit.DescribeEnvironment(prog, os.Args[0])
	fmt.Fprintf(os.Stderr, "peerbench: writing %d × %s in %s\n", cfg.files, benchkit.FormatBytes(cfg.fileSize), work)
	src := filepath.Join(work, "src")
	treeBytes, err := writeTree(src, cfg.files, cfg.fileSize)
	if err != nil {
		return err
	}
	var digests layout.DigestCache
	hash, _, err := layout.HashDataCached(ctx, src, &digests)
	if err != nil {
		return err
	}
	name := layout.DataName(hash, true)

	b, err := startBench(work, name, src, &digests)
	if err != nil {
		return err
	}
	defer b.close()

	variants := []variant{
		{key: "tcp1", transfer: "plain TCP", streams: 1, run: func(ctx context.Context) error { return b.plainTCP(ctx, 1, false) }},
		{key: "tcp4", transfer: "plain TCP", streams: 4, run: func(ctx context.Context) error { return b.plainTCP(ctx, 4, false) }},
		{key: "min1", transfer: minimalLabel, streams: 1, checked: true, run: func(ctx context.Context) error { return b.plainTCP(ctx, 1, true) }},
		{key: "min4", transfer: minimalLabel, streams: 4, checked: true, run: func(ctx context.Context) error { return b.plainTCP(ctx, 4, true) }},
		{key: "gmin1", transfer: grpcMinimalLabel, chunk: replication.DefaultChunkSize, streams: 1, checked: true, run: b.grpcMinimal},
	}
	grpcVariant := func(chunk, streams int, cached bool) variant {
		key := fmt.Sprintf("grpc-c%d-s%d-cached=%v", chunk, streams, cached)
		return variant{key: key, transfer: "gRPC push", chunk: chunk, streams: streams, cached: cached,
			run: func(ctx context.Context) error { return b.push(ctx, chunk, streams, cached) }}
	}
	def := grpcVariant(replication.DefaultChunkSize, replication.DefaultStreams, true)
	variants = append(variants, def, grpcVariant(replication.DefaultChunkSize, replication.DefaultStreams, false))
	if cfg.sweep {
		for _, chunk := range []int{1 << 20, 16 << 20} {
			variants = append(variants, grpcVariant(chunk, replication.DefaultStreams, true))
		}
		for _, streams := range []int{1, 2, 8} {
			if streams != replication.DefaultStreams {
				variants = append(variants, grpcVariant(replication.DefaultChunkSize, streams, true))
			}
		}
	}

	variants = slices.DeleteFunc(variants, func(v variant) bool { return !strings.Contains(v.key, cfg.only) })
	if cfg.profile != "" {
		f, err := os.Create(cfg.profile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	cpu := benchkit.StartCPUAccount()
	samples := map[string][]sample{}
	for round := range cfg.warmup + cfg.reps {
		for i := range variants {
			v := variants[(i+round)%len(variants)]
			s, err := timed(ctx, v.run)
			if err != nil {
				return fmt.Errorf("%s: %w", v.key, err)
			}
			if err := b.clean(); err != nil {
				return err
			}
			if round >= cfg.warmup {
				samples[v.key] = append(samples[v.key], s)
			}
			fmt.Fprintf(os.Stderr, "round %d %-36s %6.2f GB/s  cpu %.2fs\n", round, v.key, float64(treeBytes)/s.seconds/1e9, s.cpu)
		}
	}
	env.CPU = cpu.OthersSummary(benchkit.CPUWording{Span: "the measurements", Us: "peerbench"})
	return resultsSection.Publish(cfg.out, renderSection(cfg, env, treeBytes, variants, samples, def.key))
}

// timed runs fn and measures its wall time and this process's CPU time.
func timed(ctx context.Context, fn func(context.Context) error) (sample, error) {
	cpu0 := processCPU()
	start := time.Now()
	err := fn(ctx)
	return sample{seconds: time.Since(start).Seconds(), cpu: (processCPU() - cpu0).Seconds()}, err
}

func processCPU() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// writeTree writes files × size random bytes as dir/shard_NN and returns the total.
func writeTree(dir string, files int, size int64) (int64, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return 0, err
	}
	rnd := rand.NewChaCha8([32]byte{1})
	buf := make([]byte, 4<<20)
	for i := range files {
		f, err := os.Create(filepath.Join(dir, fmt.Sprintf("shard_%02d", i)))
		if err != nil {
			return 0, err
		}
		for left := size; left > 0; {
			b := buf[:min(int64(len(buf)), left)]
			rnd.Read(b)
			if _, err := f.Write(b); err != nil {
				f.Close()
				return 0, err
			}
			left -= int64(len(b))
		}
		if err := f.Close(); err != nil {
			return 0, err
		}
	}
	return int64(files) * size, nil
}

// bench holds both transfer paths' endpoints.
type bench struct {
	work, src, name string
	digests         *layout.DigestCache
	received        string // where both receivers put the tree

	recv *replication.Receiver
	srv  *grpc.Server
	conn *grpc.ClientConn

	grpcMin *grpcMin // the gRPC minimal pipeline (grpcmin.go)

	tcp      net.Listener
	tcpWG    sync.WaitGroup
	tcpFiles []tcpFile
	sums     map[string][]byte // BLAKE3 of each source file, for the minimal pipeline
}

type tcpFile struct {
	name string
	size int64
}

func startBench(work, name, src string, digests *layout.DigestCache) (*bench, error) {
	b := &bench{work: work, src: src, name: name, digests: digests, received: filepath.Join(work, "received")}
	secret := []byte("peerbench")
	recv, err := replication.NewReceiver(replication.ReceiverConfig{
		Dir:         filepath.Join(work, "incoming"),
		Secrets:     replication.StaticSecret(prog, secret),
		MaxIncoming: 1 << 40,
		Logger:      slog.New(slog.DiscardHandler),
		Accept: func(_ context.Context, _ string, _ int, _, path string) error {
			return os.Rename(path, b.received)
		},
	})
	if err != nil {
		return nil, err
	}
	b.recv = recv
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	b.srv = grpc.NewServer(replication.ServerOptions()...)
	recv.Register(b.srv)
	go b.srv.Serve(ln)
	b.conn, err = grpc.NewClient(ln.Addr().String(), append(replication.DialOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		return nil, err
	}
	if b.tcp, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
		return nil, err
	}
	des, err := os.ReadDir(src)
	if err != nil {
		return nil, err
	}
	for _, de := range des {
		info, err := de.Info()
		if err != nil {
			return nil, err
		}
		b.tcpFiles = append(b.tcpFiles, tcpFile{de.Name(), info.Size()})
	}
	if b.sums, err = fileSums(src, b.tcpFiles); err != nil {
		return nil, err
	}
	if b.grpcMin, err = startGRPCMin(b); err != nil {
		return nil, err
	}
	return b, nil
}

func (b *bench) close() {
	if b.grpcMin != nil {
		b.grpcMin.close()
	}
	b.conn.Close()
	b.srv.Stop()
	b.recv.Close()
	b.tcp.Close()
}

// clean removes the received tree (untimed, between transfers).
func (b *bench) clean() error { return os.RemoveAll(b.received) }

func (b *bench) push(ctx context.Context, chunk, streams int, cached bool) error {
	s := &replication.Sender{Instance: "peerbench", Secrets: replication.StaticSecret(prog, []byte("peerbench")),
		ChunkSize: chunk, Streams: streams}
	if cached {
		s.Digests = b.digests
	}
	return s.Push(ctx, b.conn, replication.PushRequest{Job: prog, Incarnation: "1", Rank: 0, DataName: b.name, Source: b.src})
}

// minimalLabel names the minimal pipeline (issue 12): what any verified peer copy must do at
// least, with nothing of mtcfs's — sendfile on the sender; on the receiver CRC32C of every 4 MiB
// chunk, BLAKE3 of every file checked against the sender's, and pwrite into tmpfs.
const minimalLabel = "minimal pipeline: TCP, CRC32C + BLAKE3 on arrival, pwrite"

// plainTCP copies the tree over conns connections, file i on connection i mod conns: per file
// a header (name length, name, size) and the bytes. It returns when the receiver closed every
// file. checked: the receiver runs the minimal pipeline instead of splicing.
func (b *bench) plainTCP(ctx context.Context, conns int, checked bool) error {
	if err := os.Mkdir(b.received, 0o755); err != nil {
		return err
	}
	errs := make(chan error, 2*conns)
	var wg sync.WaitGroup
	for range conns {
		wg.Go(func() {
			if checked {
				errs <- b.tcpReceiveChecked()
			} else {
				errs <- b.tcpReceive()
			}
		})
	}
	for c := range conns {
		wg.Go(func() { errs <- b.tcpSend(ctx, c, conns) })
	}
	wg.Wait()
	close(errs)
	var all []error
	for err := range errs {
		all = append(all, err)
	}
	return errors.Join(all...)
}

func (b *bench) tcpSend(ctx context.Context, c, conns int) error {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", b.tcp.Addr().String())
	if err != nil {
		return err
	}
	defer conn.Close()
	for i := c; i < len(b.tcpFiles); i += conns {
		f := b.tcpFiles[i]
		hdr := binary.BigEndian.AppendUint16(nil, uint16(len(f.name)))
		hdr = append(hdr, f.name...)
		hdr = binary.BigEndian.AppendUint64(hdr, uint64(f.size))
		if _, err := conn.Write(hdr); err != nil {
			return err
		}
		in, err := os.Open(filepath.Join(b.src, f.name))
		if err != nil {
			return err
		}
		_, err = io.Copy(conn, in) // sendfile
		in.Close()
		if err != nil {
			return err
		}
	}
	return conn.(*net.TCPConn).CloseWrite()
}

func (b *bench) tcpReceive() error {
	conn, err := b.tcp.Accept()
	if err != nil {
		return err
	}
	defer conn.Close()
	for {
		var n [2]byte
		if _, err := io.ReadFull(conn, n[:]); err == io.EOF {
			return nil
		} else if err != nil {
			return err
		}
		hdr := make([]byte, int(binary.BigEndian.Uint16(n[:]))+8)
		if _, err := io.ReadFull(conn, hdr); err != nil {
			return err
		}
		name, size := string(hdr[:len(hdr)-8]), int64(binary.BigEndian.Uint64(hdr[len(hdr)-8:]))
		out, err := os.Create(filepath.Join(b.received, filepath.Base(name)))
		if err != nil {
			return err
		}
		_, err = io.CopyN(out, conn, size) // splice
		if cerr := out.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
	}
}

// tcpReceiveChecked is tcpReceive as the minimal pipeline: each file's bytes are read in 4 MiB
// chunks, each chunk's CRC32C computed (as a receiver checks a chunk's), the file's BLAKE3
// computed over the chunks and compared with the source's, and the chunks written with pwrite.
func (b *bench) tcpReceiveChecked() error {
	conn, err := b.tcp.Accept()
	if err != nil {
		return err
	}
	defer conn.Close()
	buf := make([]byte, 4<<20)
	var crcs uint32 // what a receiver checks against the sender's; here, computed only
	for {
		var n [2]byte
		if _, err := io.ReadFull(conn, n[:]); err == io.EOF {
			break
		} else if err != nil {
			return err
		}
		hdr := make([]byte, int(binary.BigEndian.Uint16(n[:]))+8)
		if _, err := io.ReadFull(conn, hdr); err != nil {
			return err
		}
		name, size := filepath.Base(string(hdr[:len(hdr)-8])), int64(binary.BigEndian.Uint64(hdr[len(hdr)-8:]))
		out, err := os.Create(filepath.Join(b.received, name))
		if err != nil {
			return err
		}
		h := blake3.New(32, nil)
		for off := int64(0); off < size && err == nil; {
			chunk := buf[:min(int64(len(buf)), size-off)]
			if _, err = io.ReadFull(conn, chunk); err != nil {
				break
			}
			crcs ^= crc32.Checksum(chunk, castagnoli)
			h.Write(chunk)
			if _, err = out.WriteAt(chunk, off); err != nil {
				break
			}
			off += int64(len(chunk))
		}
		if cerr := out.Close(); err == nil {
			err = cerr
		}
		if err == nil {
			err = b.checkSum(name, h.Sum(nil))
		}
		if err != nil {
			return err
		}
	}
	return nil
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// checkSum compares a received file's BLAKE3 with the source's, as both minimal pipelines'
// receivers do once the file is complete.
func (b *bench) checkSum(name string, sum []byte) error {
	if !bytes.Equal(sum, b.sums[name]) {
		return fmt.Errorf("%s: BLAKE3 differs from the source's", name)
	}
	return nil
}

// fileSums returns the BLAKE3 of every file of dir (untimed, before the rounds): the digests the
// minimal pipeline's receiver checks against, as a sender would announce them.
func fileSums(dir string, files []tcpFile) (map[string][]byte, error) {
	sums := map[string][]byte{}
	for _, f := range files {
		in, err := os.Open(filepath.Join(dir, f.name))
		if err != nil {
			return nil, err
		}
		h := blake3.New(32, nil)
		_, err = io.Copy(h, in)
		in.Close()
		if err != nil {
			return nil, err
		}
		sums[f.name] = h.Sum(nil)
	}
	return sums, nil
}
