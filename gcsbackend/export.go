package gcsbackend

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/mtcfs/mtcfs/layout"
)

// ExportRequest describes copying one backup out of the store in the plain
// reference layout.
type ExportRequest struct {
	Job, Backup string
	// Dir receives the backup: it must be an empty directory, or not exist
	// (its parent must).
	Dir string
	// Progress, if set, is called with the file bytes written and their total
	// over the whole export, first with done = 0.
	Progress func(done, total int64)
}

// ExportReport says what Export wrote.
type ExportReport struct {
	Steps   []int64  // the complete steps exported, highest first
	Skipped []int64  // incomplete steps left out
	Data    []string // the hashes whose data was written, sorted
	Bytes   int64    // file bytes written
}

// Export writes the complete steps of a backup to req.Dir as the reference
// system lays them out — <job>-sS-nR-wW.meta holding the hash, and
// <hash>.data, the checkpoint as the job wrote it (a directory or one file)
// — with every file's plain bytes, whatever codec the backup stores it in,
// so that tools which read the reference layout (Orbax) can open it. The
// result is what <backup-root>/<job>/<backup>/ holds with compression off,
// minus mtcfs's own sidecar objects.
//
// Every file is checked against its manifest (size and CRC32C of the plain
// bytes; compressed chunks also against their own CRC32C) as it is written,
// and every data against its BLAKE3 name (layout.VerifyData) once all are
// written, before the .meta files. A step that is not complete is left out and reported;
// a backup without a complete step is an error, and so is a missing backup
// (*NotFoundError).
func (b *Backups) Export(ctx context.Context, req ExportRequest) (ExportReport, error) {
	var rep ExportReport
	if err := validateJob(req.Job); err != nil {
		return rep, err
	}
	if err := validateBackupName(req.Backup); err != nil {
		return rep, err
	}
	vr, err := b.Verify(ctx, req.Job, req.Backup, VerifyOptions{})
	if err != nil {
		return rep, err
	}
	type meta struct {
		name, hash string
	}
	var metas []meta
	seen := map[string]bool{}
	for _, s := range vr.Steps {
		if !s.Complete {
			rep.Skipped = append(rep.Skipped, s.Step)
			continue
		}
		rep.Steps = append(rep.Steps, s.Step)
		for slot, h := range s.Data {
			metas = append(metas, meta{metaName(req.Job, s.Step, slot), h})
			if !seen[h] {
				seen[h] = true
				rep.Data = append(rep.Data, h)
			}
		}
	}
	if len(rep.Steps) == 0 {
		if vr.Damaged() {
			// "no complete step" alone did not say that the backup was complete once and is
			// damaged now (a recorded damage, objects gone: black-box h55).
			var problems []string
			for _, st := range vr.Steps {
				problems = append(problems, st.Problems...)
			}
			return rep, fmt.Errorf("backup %s of job %s is DAMAGED, no step of it can be exported: %s (see mtcfs backups verify)", req.Backup, req.Job, strings.Join(problems, "; "))
		}
		return rep, fmt.Errorf("backup %s of job %s has no complete step to export (see mtcfs backups verify)", req.Backup, req.Job)
	}
	sort.Strings(rep.Data)
	sort.Slice(metas, func(i, j int) bool { return metas[i].name < metas[j].name })

	if err := prepareExportDir(req.Dir); err != nil {
		return rep, err
	}
	dir := backupDir(req.Job, req.Backup)
	totals := make([]int64, len(rep.Data))
	var total int64
	for i, h := range rep.Data {
		m, err := b.readManifest(ctx, dir, h)
		if err != nil {
			return rep, fmt.Errorf("export %s: %w", dataName(h), err)
		}
		totals[i] = m.total()
		total += totals[i]
	}
	report := func(done int64) {
		if req.Progress != nil {
			req.Progress(done, total)
		}
	}
	report(0)
	for i, h := range rep.Data {
		base := rep.Bytes
		err := b.Download(ctx, DownloadRequest{Job: req.Job, Backup: req.Backup, Hash: h, Dest: filepath.Join(req.Dir, dataName(h)),
			Progress: func(done, _ int64) { report(base + done) }})
		if err != nil {
			return rep, fmt.Errorf("export: %w", err)
		}
		rep.Bytes += totals[i]
	}
	// The manifests' CRC32Cs proved every file came out as stored; the hashes prove the trees
	// are the checkpoints the job wrote, whatever the backup's history.
	for _, h := range rep.Data {
		p := filepath.Join(req.Dir, dataName(h))
		hash, isDir, _ := layout.ParseDataName(dataName(h)) // Verify checked the names
		if err := layout.VerifyData(ctx, p, hash, isDir); err != nil {
			return rep, fmt.Errorf("export: %s: %w", p, err)
		}
	}
	// The owners and modes the backup keeps, once the hashes were read (a mode may close an
	// entry); owners only as root, who alone may give files away.
	for _, h := range rep.Data {
		attrs, err := b.readAttrs(ctx, dir, h)
		if err != nil {
			return rep, fmt.Errorf("export: owners and modes of %s: %w", dataName(h), err)
		}
		if err := layout.ApplyAttrs(filepath.Join(req.Dir, dataName(h)), attrs, os.Geteuid() == 0); err != nil {
			return rep, fmt.Errorf("export: owners and modes of %s: %w", dataName(h), err)
		}
	}
	for _, m := range metas {
		if err := os.WriteFile(filepath.Join(req.Dir, m.name), []byte(m.hash), 0o644); err != nil {
			return rep, fmt.Errorf("export: %w", err)
		}
	}
	return rep, nil
}

// prepareExportDir makes sure dir is an empty directory that can be written.
func prepareExportDir(dir string) error {
	if dir == "" {
		return errors.New("export: no destination directory")
	}
	fi, err := os.Stat(dir)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		// Its missing parents too, as mkdir -p: an export is often aimed at a fresh scratch
		// path (a black-box run: /scratch/exports/llama failed for want of /scratch/exports).
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("export: create %s: %w", dir, err)
		}
		return nil
	case err != nil:
		return fmt.Errorf("export: %w", err)
	case !fi.IsDir():
		return fmt.Errorf("export: %s is not a directory", dir)
	}
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("export: %w", err)
	}
	defer d.Close()
	if names, err := d.Readdirnames(1); len(names) > 0 {
		return fmt.Errorf("export: %s is not empty (%s, …): export into an empty or new directory", dir, names[0])
	} else if err != nil && err != io.EOF {
		return fmt.Errorf("export: %w", err)
	}
	// Fail now rather than after the first download.
	probe, err := os.CreateTemp(dir, ".mtcfs-export-probe-*")
	if err != nil {
		return fmt.Errorf("export: %s is not writable: %w", dir, err)
	}
	probe.Close()
	return os.Remove(probe.Name())
}
