package jobsim

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"gopkg.in/yaml.v3"
)

// fakeAgent does on one node, in one goroutine polling the directory, what SPEC §2/§3/§5 says an
// agent does, just enough to exercise the clients: it consumes replicator.yaml, cleans the
// namespace, publishes replicator.prerestore and the restore marker (a symlink to the latest
// sealed "D<hash>.data" directory, or an empty s0 file), and seals committed step directories
// by renaming them to "D<hash>.data" and writing a .meta.
type fakeAgent struct {
	dir string

	// Faults; set by the configure function before the agent starts.
	errorsLine   string // appended to replicator.errors by every handshake
	failedLine   string // a handshake only writes this to replicator.failed and deletes the yaml
	markerName   string // publish an empty marker with this name instead of the right one
	noPrerestore bool   // never write replicator.prerestore

	mu     sync.Mutex
	job    string
	rank   int
	yamls  []string         // every replicator.yaml consumed, verbatim
	sealed map[int64]string // step → data name
	err    error            // first failure of the agent itself
}

func startFakeAgent(t *testing.T, dir string, configure func(*fakeAgent)) *fakeAgent {
	t.Helper()
	a := &fakeAgent{dir: dir, rank: -1, sealed: map[int64]string{}}
	if configure != nil {
		configure(a)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(2 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			if err := a.tick(); err != nil {
				a.mu.Lock()
				if a.err == nil {
					a.err = err
				}
				a.mu.Unlock()
			}
		}
	}()
	t.Cleanup(func() {
		cancel()
		<-done
		if a.err != nil {
			t.Errorf("fake agent failed: %v", a.err)
		}
	})
	return a
}

func (a *fakeAgent) consumedYAMLs() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]string(nil), a.yamls...)
}

func (a *fakeAgent) isSealed(step int64) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	_, ok := a.sealed[step]
	return ok
}

func (a *fakeAgent) path(name string) string { return filepath.Join(a.dir, name) }

// tick seals before it handshakes: a client commits before it writes a new yaml, and a
// committed step is never dropped.
func (a *fakeAgent) tick() error {
	if err := a.seal(); err != nil {
		return err
	}
	data, err := os.ReadFile(a.path(yamlName))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var cfg map[string]any
	if yaml.Unmarshal(data, &cfg) != nil || cfg["job-name"] == nil || cfg["node-rank"] == nil || cfg["backup-interval-minutes"] == nil {
		return nil // NeMo writes in place: maybe not complete yet
	}
	return a.handshake(string(data), fmt.Sprint(cfg["job-name"]), cfg["node-rank"].(int))
}

var (
	fakeStepRE = regexp.MustCompile(`^\d+$`)
	fakeMetaRE = regexp.MustCompile(`-s(\d+)-n\d+-w\d+\.meta$`)
)

func (a *fakeAgent) seal() error {
	a.mu.Lock()
	job, rank := a.job, a.rank
	a.mu.Unlock()
	if rank < 0 {
		return nil
	}
	entries, err := os.ReadDir(a.dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if !fakeStepRE.MatchString(e.Name()) || e.Type()&fs.ModeSymlink != 0 || !e.IsDir() {
			continue // the restored step is a symlink, not a commit
		}
		step, _ := strconv.ParseInt(e.Name(), 10, 64)
		sum, err := fakeTreeHash(a.path(e.Name()))
		if err != nil {
			return err
		}
		data := "D" + sum + ".data"
		if _, err := os.Stat(a.path(data)); err == nil {
			return fmt.Errorf("step %d: tree %s already sealed", step, data)
		}
		if err := os.Rename(a.path(e.Name()), a.path(data)); err != nil {
			return err
		}
		meta := fmt.Sprintf("%s-s%d-n%d-w0.meta", job, step, rank)
		if err := os.WriteFile(a.path(meta+".tmp"), []byte(data[:len(data)-len(".data")]), 0o644); err != nil {
			return err
		}
		if err := os.Rename(a.path(meta+".tmp"), a.path(meta)); err != nil {
			return err
		}
		a.mu.Lock()
		a.sealed[step] = data
		a.mu.Unlock()
	}
	return nil
}

// fakeTreeHash hashes paths, sizes and bytes of the tree.
func fakeTreeHash(root string) (string, error) {
	h := sha256.New()
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		defer f.Close()
		fmt.Fprintf(h, "%s\x00", rel)
		_, err = io.Copy(h, f)
		fmt.Fprint(h, "\x00")
		return err
	})
	return hex.EncodeToString(h.Sum(nil)), err
}

func (a *fakeAgent) handshake(content, job string, rank int) error {
	a.mu.Lock()
	a.yamls = append(a.yamls, content)
	a.job, a.rank = job, rank
	a.mu.Unlock()
	if a.failedLine != "" {
		if err := appendLine(a.path(failedName), a.failedLine); err != nil {
			return err
		}
		return os.Remove(a.path(yamlName))
	}
	entries, err := os.ReadDir(a.dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		n := e.Name()
		if strings.HasSuffix(n, ".meta") || strings.HasSuffix(n, ".data") || n == jaxInitName || n == yamlName {
			continue
		}
		if err := os.RemoveAll(a.path(n)); err != nil {
			return err
		}
	}
	if err := os.Remove(a.path(yamlName)); err != nil {
		return err
	}
	if a.errorsLine != "" {
		if err := appendLine(a.path(errorsName), a.errorsLine); err != nil {
			return err
		}
	}

	// Negotiation of one node: the highest step whose .meta names data that exists.
	metas, err := filepath.Glob(a.path(fmt.Sprintf("%s-s*-n%d-w0.meta", job, rank)))
	if err != nil {
		return err
	}
	sort.Strings(metas)
	best, bestData := int64(0), ""
	for _, m := range metas {
		step, _ := strconv.ParseInt(fakeMetaRE.FindStringSubmatch(filepath.Base(m))[1], 10, 64)
		sum, err := os.ReadFile(m)
		if err != nil {
			return err
		}
		if _, err := os.Stat(a.path(string(sum) + ".data")); err == nil && step > best {
			best, bestData = step, string(sum)+".data"
		}
	}
	if !a.noPrerestore {
		pre := "{}\n"
		if best > 0 {
			pre = fmt.Sprintf("restore-step: %d\n", best)
		}
		if err := os.WriteFile(a.path(prerestoreName+".tmp"), []byte(pre), 0o644); err != nil {
			return err
		}
		if err := os.Rename(a.path(prerestoreName+".tmp"), a.path(prerestoreName)); err != nil {
			return err
		}
	}
	marker := fmt.Sprintf("%s-s%d-n%d-w0.restore", job, best, rank)
	switch {
	case a.markerName != "":
		return os.WriteFile(a.path(a.markerName), nil, 0o644)
	case best > 0:
		return os.Symlink(bestData, a.path(marker))
	default:
		return os.WriteFile(a.path(marker), nil, 0o644)
	}
}

func appendLine(path, line string) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	if _, err := f.WriteString(line + "\n"); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
