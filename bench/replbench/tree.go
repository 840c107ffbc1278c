package main

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"time"

	"golang.org/x/sync/errgroup"
	"golang.org/x/sys/unix"
)

// ioBufSize is the buffer of every read and write replbench does itself.
const ioBufSize = 1 << 20

// tree is the checkpoint replbench saves: files × fileSize bytes of random data in state/,
// the layout of an Orbax item. Its source copy lives in a plain tmpfs directory (/dev/shm), which
// is also the baseline for reading and the source of cp -r.
type tree struct {
	root     string   // <shm>/…/tree
	files    []string // paths relative to root, "state/shard_00", …
	fileSize int64
}

func (t *tree) total() int64 { return int64(len(t.files)) * t.fileSize }

// newTree writes the source tree under dir with pseudo-random bytes (incompressible, distinct
// per file), one goroutine per CPU.
func newTree(dir string, files int, fileSize int64) (*tree, error) {
	t := &tree{root: filepath.Join(dir, "tree"), fileSize: fileSize}
	if err := os.MkdirAll(filepath.Join(t.root, "state"), 0o755); err != nil {
		return nil, err
	}
	for i := range files {
		t.files = append(t.files, fmt.Sprintf("state/shard_%02d", i))
	}
	var g errgroup.Group
	g.SetLimit(max(2, runtime.NumCPU()))
	for i, rel := range t.files {
		g.Go(func() error { return writeRandomFile(filepath.Join(t.root, rel), fileSize, uint64(i)) })
	}
	if err := g.Wait(); err != nil {
		return nil, err
	}
	return t, nil
}

func writeRandomFile(p string, size int64, seed uint64) error {
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return err
	}
	var key [32]byte
	binary.LittleEndian.PutUint64(key[:], seed+0x5eed)
	binary.LittleEndian.PutUint64(key[8:], uint64(time.Now().UnixNano()))
	rng := rand.NewChaCha8(key)
	buf := make([]byte, ioBufSize)
	for done := int64(0); done < size; {
		n := min(int64(len(buf)), size-done)
		rng.Read(buf[:n])
		if _, err := f.Write(buf[:n]); err != nil {
			f.Close()
			return err
		}
		done += n
	}
	return f.Close()
}

// stamp overwrites the first bytes of every source file with a tag of this repetition, so
// that each saved step has new content (sealing a tree whose hash exists already is reported
// as "training is not making progress") while everything else stays the same.
func (t *tree) stamp(tag string) error {
	hdr := fmt.Appendf(nil, "replbench %-40s", tag)
	for _, rel := range t.files {
		f, err := os.OpenFile(filepath.Join(t.root, rel), os.O_WRONLY, 0)
		if err != nil {
			return err
		}
		_, err = f.WriteAt(hdr, 0)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// saveStep writes the tree into <mount>/<step>.orbax-checkpoint-tmp as Orbax would (mkdir, then
// each file created O_EXCL, written with 1 MiB writes, fsynced and closed), and leaves the
// commit (the rename) to the caller.
func (t *tree) saveStep(mount string, step int64) (string, error) {
	tmp := filepath.Join(mount, fmt.Sprintf("%d.orbax-checkpoint-tmp", step))
	if err := os.Mkdir(tmp, 0o755); err != nil {
		return "", err
	}
	if err := os.Mkdir(filepath.Join(tmp, "state"), 0o755); err != nil {
		return "", err
	}
	buf := make([]byte, ioBufSize)
	for _, rel := range t.files {
		if err := copyFile(filepath.Join(t.root, rel), filepath.Join(tmp, rel), buf); err != nil {
			return "", err
		}
	}
	return tmp, nil
}

func copyFile(src, dst string, buf []byte) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return err
	}
	// Plain read/write: io.CopyBuffer would pick copy_file_range or splice.
	for {
		n, rerr := in.Read(buf)
		if n > 0 {
			if _, err := out.Write(buf[:n]); err != nil {
				out.Close()
				return err
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			out.Close()
			return rerr
		}
	}
	if err := out.Sync(); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// readOnce reads every file of the source tree to EOF with 1 MiB reads, one after the other,
// and returns how long that took (open to close) and the bytes read.
func (t *tree) readOnce(buf []byte) (time.Duration, int64, error) {
	var total int64
	start := time.Now()
	for _, rel := range t.files {
		fd, err := unix.Open(filepath.Join(t.root, rel), unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return 0, 0, err
		}
		for {
			n, err := unix.Read(fd, buf)
			if err == unix.EINTR {
				continue
			}
			if err != nil {
				unix.Close(fd)
				return 0, 0, err
			}
			if n == 0 {
				break
			}
			total += int64(n)
		}
		unix.Close(fd)
	}
	return time.Since(start), total, nil
}

// cpTree times "cp -r <tree> dst", and with syncFiles also "sync" of every file and directory
// it created (coreutils sync with arguments fsyncs each one), the durability the backup store
// gives each object.
func (t *tree) cpTree(ctx context.Context, dst string, syncFiles bool) (wall, cpu time.Duration, err error) {
	args := []string{dst, filepath.Join(dst, "state")}
	for _, rel := range t.files {
		args = append(args, filepath.Join(dst, rel))
	}
	start := time.Now()
	cp := exec.CommandContext(ctx, "cp", "-r", t.root, dst)
	if out, err := cp.CombinedOutput(); err != nil {
		return 0, 0, fmt.Errorf("cp -r %s %s: %v: %s", t.root, dst, err, out)
	}
	cpu = cp.ProcessState.UserTime() + cp.ProcessState.SystemTime()
	if syncFiles {
		s := exec.CommandContext(ctx, "sync", args...)
		if out, err := s.CombinedOutput(); err != nil {
			return 0, 0, fmt.Errorf("sync: %v: %s", err, out)
		}
		cpu += s.ProcessState.UserTime() + s.ProcessState.SystemTime()
	}
	return time.Since(start), cpu, nil
}
