package tiers_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/mtcfs/mtcfs/gcsbackend"
	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/tiers"
)

// testStore is the backup tier the agent uses, the real gcsbackend store over a local directory
// (file://), with what the tests need around it: every Upload recorded and its Source checked
// against the hash it claims, a hook before each Upload, and counts of downloads and of
// restore.version deletions. It keeps no layout of its own.
type testStore struct {
	tiers.BackupStore // gcsbackend.TierStore over objects
	objects           gcsbackend.ObjectStore
	root              string // the file:// directory

	mu         sync.Mutex
	uploads    []tiers.Upload // GUARDED_BY(mu); every Upload call, in order
	uploadErrs []string       // GUARDED_BY(mu); problems seen with the uploaded Source
	downloads  int            // GUARDED_BY(mu)
	clears     int            // GUARDED_BY(mu)
	// beforeUpload, when set, runs at the start of Upload (without mu); an error fails it.
	beforeUpload func(context.Context, tiers.Upload) error // GUARDED_BY(mu)
	// afterDownload, when set, runs after the nth Download succeeded, on what it wrote.
	afterDownload func(n int, dest string) // GUARDED_BY(mu)
}

var _ tiers.BackupStore = (*testStore)(nil)

func newTestStore(t *testing.T) *testStore {
	t.Helper()
	root := t.TempDir()
	objects, err := gcsbackend.Open("file://" + root)
	if err != nil {
		t.Fatal(err)
	}
	return &testStore{BackupStore: gcsbackend.TierStore(&gcsbackend.Backups{Store: objects}), objects: objects, root: root}
}

func (s *testStore) Upload(ctx context.Context, req tiers.Upload) error {
	s.mu.Lock()
	s.uploads = append(s.uploads, req)
	before := s.beforeUpload
	s.mu.Unlock()
	// What the replicator hands over must be the sealed data the .meta names (no Source: the
	// .meta names data already in the backup).
	h, dir, ok := layout.ParseDataName(req.Hash + ".data")
	if !ok {
		s.uploadErr("upload of step %d: bad hash %q", req.Step, req.Hash)
	} else if req.Source == "" {
	} else if err := layout.VerifyData(ctx, req.Source, h, dir); err != nil {
		s.uploadErr("upload of step %d: source %s: %v", req.Step, req.Source, err)
	}
	if before != nil {
		if err := before(ctx, req); err != nil {
			return err
		}
	}
	return s.BackupStore.Upload(ctx, req)
}

func (s *testStore) Download(ctx context.Context, job, backup, hash, dest string, progress func(done, total int64)) error {
	s.mu.Lock()
	s.downloads++
	n, after := s.downloads, s.afterDownload
	s.mu.Unlock()
	err := s.BackupStore.Download(ctx, job, backup, hash, dest, progress)
	if err == nil && after != nil {
		after(n, dest)
	}
	return err
}

func (s *testStore) ClearRestoreVersion(ctx context.Context, job string) error {
	s.mu.Lock()
	s.clears++
	s.mu.Unlock()
	return s.BackupStore.ClearRestoreVersion(ctx, job)
}

// setPin writes content as job's restore.version, verbatim (as `echo NAME | gcloud storage cp`
// would, or with stray whitespace).
func (s *testStore) setPin(t *testing.T, job, content string) {
	t.Helper()
	if err := gcsbackend.PutBytes(t.Context(), s.objects, job+"/restore.version", []byte(content), false); err != nil {
		t.Fatal(err)
	}
}

func (s *testStore) setBeforeUpload(f func(context.Context, tiers.Upload) error) {
	s.mu.Lock()
	s.beforeUpload = f
	s.mu.Unlock()
}

func (s *testStore) uploadErr(format string, args ...any) {
	s.mu.Lock()
	s.uploadErrs = append(s.uploadErrs, fmt.Sprintf(format, args...))
	s.mu.Unlock()
}

// counts returns how many uploads, downloads and restore.version deletions happened.
func (s *testStore) counts() (uploads, downloads, clears int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.uploads), s.downloads, s.clears
}

func (s *testStore) uploadLog() ([]tiers.Upload, []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.uploads), slices.Clone(s.uploadErrs)
}

// objectsOf lists the objects of one backup, names relative to it.
func (s *testStore) objectsOf(t *testing.T, job, backup string) []gcsbackend.ObjectAttrs {
	t.Helper()
	dir := job + "/" + backup + "/"
	objs, _, err := s.objects.List(t.Context(), dir, "")
	if err != nil {
		t.Fatal(err)
	}
	for i := range objs {
		objs[i].Name = strings.TrimPrefix(objs[i].Name, dir)
	}
	return objs
}

// deleteObject removes what a backup holds under name: "<hash>.data" (its files and manifest)
// or a .meta, making the backup incomplete.
func (s *testStore) deleteObject(t *testing.T, job, backup, name string) {
	t.Helper()
	n := 0
	for _, o := range s.objectsOf(t, job, backup) {
		if o.Name == name || strings.HasPrefix(o.Name, name+".") || strings.HasPrefix(o.Name, name+"/") {
			if err := s.objects.Delete(t.Context(), job+"/"+backup+"/"+o.Name); err != nil {
				t.Fatal(err)
			}
			n++
		}
	}
	if n == 0 {
		t.Fatalf("deleteObject: backup %s/%s holds no %s", job, backup, name)
	}
}

// addBackup uploads a backup step through the real store: for each slot a placeholder tree
// under its hash (the store does not hash what it uploads), then its .meta.
func (s *testStore) addBackup(t *testing.T, job, backup string, step int64, data map[tiers.Slot]string) {
	t.Helper()
	s.addShapedBackup(t, job, backup, step, tiers.Shape{}, data)
}

// addShapedBackup is addBackup by a job of shape, which the backup records as the agent's
// uploads do (the zero Shape: none recorded, as in a backup the reference system took).
func (s *testStore) addShapedBackup(t *testing.T, job, backup string, step int64, shape tiers.Shape, data map[tiers.Slot]string) {
	t.Helper()
	for slot, hash := range data {
		src := filepath.Join(t.TempDir(), "data")
		if err := os.MkdirAll(src, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(src, "placeholder"), []byte(hash), 0o644); err != nil {
			t.Fatal(err)
		}
		err := s.BackupStore.Upload(t.Context(), tiers.Upload{Job: job, Backup: backup, Step: step, Slot: slot, Shape: shape, Hash: hash, Source: src})
		if err != nil {
			t.Fatal(err)
		}
	}
}

// putLegacyShape records the shape of a backup as mtcfs did before it recorded data-parallelism.
func (s *testStore) putLegacyShape(t *testing.T, job, backup string, nodes, workers int) {
	t.Helper()
	record := fmt.Sprintf(`{"format":"mtcfs-backup-v1","nodes":%d,"workers":%d}`, nodes, workers)
	if err := gcsbackend.PutBytes(t.Context(), s.objects, job+"/"+backup+"/mtcfs-backup.json", []byte(record), false); err != nil {
		t.Fatal(err)
	}
}

// checkDataBeforeMeta checks that each slot's .meta in the backup was written after everything
// else it holds (data first, .meta last: a partial backup never looks complete).
func (s *testStore) checkDataBeforeMeta(t *testing.T, job, backup string) {
	t.Helper()
	objs := s.objectsOf(t, job, backup)
	var metas, data []gcsbackend.ObjectAttrs
	for _, o := range objs {
		if strings.HasSuffix(o.Name, ".meta") {
			metas = append(metas, o)
		} else {
			data = append(data, o)
		}
	}
	if len(metas) == 0 || len(data) == 0 {
		t.Errorf("backup %s holds %d .meta and %d other objects, want both", backup, len(metas), len(data))
	}
	for _, m := range metas {
		for _, d := range data {
			if d.Updated.After(m.Updated) {
				t.Errorf("backup %s: %s was written at %v, after %s at %v", backup, d.Name, d.Updated, m.Name, m.Updated)
			}
		}
	}
}
