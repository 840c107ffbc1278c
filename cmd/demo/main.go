// Command demo is the scripted walk-through behind "make demo": it starts an mtcfs agent on a
// scratch directory, saves a checkpoint-shaped tree the way Orbax does (tmp dir, pwrite, fsync,
// rename to the step number), reads it back and verifies it, prints what happened and the
// throughput, and stops the agent, leaving nothing mounted.
package main

import (
	"bufio"
	"bytes"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

func main() {
	bin := flag.String("mtcfs", "bin/mtcfs", "mtcfs binary")
	shards := flag.Int("shards", 8, "state files per checkpoint")
	shardMiB := flag.Int("shard-mib", 64, "MiB per state file")
	flag.Parse()
	if err := run(*bin, *shards, *shardMiB); err != nil {
		fmt.Fprintln(os.Stderr, "demo failed:", err)
		os.Exit(1)
	}
}

func step(format string, args ...any) { fmt.Printf("==> "+format+"\n", args...) }

func run(bin string, shards, shardMiB int) error {
	base, err := os.MkdirTemp("", "mtcfs-demo")
	if err != nil {
		return err
	}
	defer os.RemoveAll(base)
	dir := filepath.Join(base, "ckpt")
	if err := os.Mkdir(dir, 0o755); err != nil {
		return err
	}

	step("starting agent: %s mount %s --memory 2GiB", bin, dir)
	agent, logs, err := startAgent(bin, dir, filepath.Join(base, "spool"))
	if err != nil {
		return err
	}
	defer func() {
		agent.Process.Signal(syscall.SIGTERM)
		agent.Wait()
	}()
	for _, l := range logs {
		fmt.Println("    agent:", l)
	}

	total := int64(shards) * int64(shardMiB) << 20
	step("saving step 100 Orbax-style: %d state files × %d MiB, pwrite + fsync, rename 100.orbax-checkpoint-tmp → 100", shards, shardMiB)
	took, err := saveStep(dir, 100, shards, shardMiB)
	if err != nil {
		return err
	}
	fmt.Printf("    wrote %d MiB in %v: %.2f GB/s\n", total>>20, took.Round(time.Millisecond), float64(total)/took.Seconds()/1e9)

	step("tree as a training job sees it:")
	filepath.Walk(filepath.Join(dir, "100"), func(p string, fi os.FileInfo, err error) error {
		if err == nil {
			rel, _ := filepath.Rel(dir, p)
			fmt.Printf("    %-40s %10d bytes\n", rel, fi.Size())
		}
		return err
	})

	step("restoring: reading every file back and comparing it with what was written")
	if took, err = verifyStep(dir, 100, shards, shardMiB); err != nil {
		return err
	}
	fmt.Printf("    verified %d MiB in %v: %.2f GB/s (includes the comparison)\n", total>>20, took.Round(time.Millisecond), float64(total)/took.Seconds()/1e9)

	out, _ := exec.Command("df", "-h", dir).Output()
	step("df -h shows the RAM budget and its use:\n%s", strings.TrimRight(string(out), "\n"))

	step("stopping agent with SIGTERM")
	agent.Process.Signal(syscall.SIGTERM)
	if err := agent.Wait(); err != nil {
		return fmt.Errorf("agent exit: %w", err)
	}
	if mounted(dir) {
		return fmt.Errorf("%s still mounted after the agent stopped", dir)
	}
	step("done: agent stopped, nothing left mounted")
	return nil
}

func startAgent(bin, dir, spool string) (*exec.Cmd, []string, error) {
	cmd := exec.Command(bin, "mount", dir, "--memory", "2GiB", "--spool", spool)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, nil, fmt.Errorf("start %s: %w (run make build first)", bin, err)
	}
	sc := bufio.NewScanner(stderr)
	var logs []string
	for sc.Scan() {
		logs = append(logs, sc.Text())
		if strings.Contains(sc.Text(), "serving") {
			go io.Copy(io.Discard, stderr)
			return cmd, logs, nil
		}
	}
	cmd.Wait()
	return nil, logs, fmt.Errorf("agent exited before serving:\n%s", strings.Join(logs, "\n"))
}

// pattern holds a few random 1 MiB blocks; file i's block k is pattern[(i*7+k)%len]. Data is
// made before the clock starts, so the figures measure the filesystem, not the generator.
var pattern = func() [][]byte {
	p := make([][]byte, 16)
	for i := range p {
		p[i] = make([]byte, 1<<20)
		r := rand.NewPCG(uint64(i), 0x9e3779b97f4a7c15)
		for j := 0; j+8 <= len(p[i]); j += 8 {
			v := r.Uint64()
			for k := 0; k < 8; k++ {
				p[i][j+k] = byte(v >> (8 * k))
			}
		}
	}
	return p
}()

func block(file, k int) []byte { return pattern[(file*7+k)%len(pattern)] }

// saveStep writes a checkpoint the way Orbax does: a tmp dir, item dirs renamed into place,
// O_EXCL creates, pwrite, fsync, and the final rename of the step directory.
func saveStep(dir string, s, shards, shardMiB int) (time.Duration, error) {
	start := time.Now()
	tmp := filepath.Join(dir, fmt.Sprintf("%d.orbax-checkpoint-tmp", s))
	state := filepath.Join(tmp, "state.orbax-checkpoint-tmp")
	if err := os.MkdirAll(state, 0o755); err != nil {
		return 0, err
	}
	meta := []byte(fmt.Sprintf(`{"step": %d, "format": "demo"}`, s))
	if err := os.WriteFile(filepath.Join(tmp, "_CHECKPOINT_METADATA"), meta, 0o644); err != nil {
		return 0, err
	}
	for i := 0; i < shards; i++ {
		f, err := os.OpenFile(filepath.Join(state, shardName(i)), os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
		if err != nil {
			return 0, err
		}
		for k := 0; k < shardMiB; k++ {
			if _, err := f.WriteAt(block(i, k), int64(k)<<20); err != nil {
				f.Close()
				return 0, err
			}
		}
		if err := f.Sync(); err != nil {
			return 0, err
		}
		if err := f.Close(); err != nil {
			return 0, err
		}
	}
	if err := os.WriteFile(filepath.Join(state, "commit_success.txt"), nil, 0o644); err != nil {
		return 0, err
	}
	if err := os.Rename(state, filepath.Join(tmp, "state")); err != nil {
		return 0, err
	}
	if err := os.Rename(tmp, filepath.Join(dir, fmt.Sprint(s))); err != nil {
		return 0, err
	}
	return time.Since(start), nil
}

func shardName(i int) string { return fmt.Sprintf("shard_%03d", i) }

// verifyStep reads every state file back and compares it with what was written.
func verifyStep(dir string, s, shards, shardMiB int) (time.Duration, error) {
	start := time.Now()
	buf := make([]byte, 1<<20)
	for i := 0; i < shards; i++ {
		f, err := os.Open(filepath.Join(dir, fmt.Sprint(s), "state", shardName(i)))
		if err != nil {
			return 0, err
		}
		for k := 0; k < shardMiB; k++ {
			if _, err := io.ReadFull(f, buf); err != nil {
				f.Close()
				return 0, fmt.Errorf("%s: %w", shardName(i), err)
			}
			if !bytes.Equal(buf, block(i, k)) {
				f.Close()
				return 0, fmt.Errorf("%s: MiB %d differs from what was written", shardName(i), k)
			}
		}
		if n, _ := f.Read(buf); n != 0 {
			f.Close()
			return 0, fmt.Errorf("%s: longer than written", shardName(i))
		}
		f.Close()
	}
	return time.Since(start), nil
}

func mounted(p string) bool {
	data, _ := os.ReadFile("/proc/self/mounts")
	return bytes.Contains(data, []byte(" "+p+" "))
}
