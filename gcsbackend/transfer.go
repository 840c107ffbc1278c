package gcsbackend

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"sync"

	"golang.org/x/sync/errgroup"
	"golang.org/x/sync/semaphore"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/tiers"
)

// UploadRequest describes one slot's contribution to a backup.
type UploadRequest struct {
	Job    string
	Backup string // YYYY-MM-DD_HH-MM, see BackupName
	Step   int64
	Slot   Slot
	// Hash names the data: "D" + 64 hex for a directory, 64 hex for a file.
	Hash string
	// Source is the local directory or file holding the data. Empty means
	// upload only the .meta, naming data another slot uploaded to this
	// backup (data-parallel mode); its manifest must already be there.
	Source string
	// Progress, if set, is called with uploaded data bytes and their total,
	// first with done = 0. Calls are serialised and done never decreases.
	Progress func(done, total int64)
	// Shape, when set (Nodes and Workers > 0), is the job's: Upload records it in the backup
	// (see shapeName), so that a backup missing a whole rank's .meta is known incomplete without
	// the caller knowing the shape, and a job of another shape does not restore it.
	Shape tiers.Shape
}

// Upload adds one slot's step to a backup: every data file in parallel
// (bounded by Parallelism), then the owners and modes kept beside the source
// (layout.AttrsFile, as <hash>.data.attrs), then the data's manifest, then the
// .meta — last, so the step cannot look complete before its data is. Every
// object but the attrs is written create-if-absent with its CRC32C: a retry,
// or another node uploading identical data, succeeds; different content under
// an existing name fails with *PreconditionError. The attrs are overwritten:
// two nodes' may differ, and either is right.
//
// Every data file goes through the store's PutFile. GCS must have an
// upload's CRC32C before the first byte, so it reads each file twice,
// streaming — once for the CRC32C (a large file part by part, in parallel,
// the parts' CRC32Cs combined into the whole file's) and once to upload it,
// as parallel parts for a large file — and GCS checks the bytes it received
// against that CRC32C; a file that changes in between fails the upload.
// Downloads (GetFile) are parallel ranged reads there. file:// reads each
// file once and the manifest records the CRC32C of the bytes as they were
// streamed to the store, which computes and keeps its own.
func (b *Backups) Upload(ctx context.Context, req UploadRequest) error {
	if err := validateJob(req.Job); err != nil {
		return err
	}
	if err := validateBackupName(req.Backup); err != nil {
		return err
	}
	if err := validateHash(req.Hash); err != nil {
		return err
	}
	if req.Step < 0 || req.Slot.Rank < 0 || req.Slot.Worker < 0 {
		return fmt.Errorf("upload: negative step, rank or worker (s%d %s)", req.Step, req.Slot)
	}
	dir := backupDir(req.Job, req.Backup)
	meta := dir + metaName(req.Job, req.Step, req.Slot)
	if req.Shape.Nodes > 0 && req.Shape.Workers > 0 {
		if err := b.putShape(ctx, dir, req.Shape); err != nil {
			// The backup's first write: not the .meta's (a black-box run read it as such).
			return fmt.Errorf("upload step %d (%s) to %s: %w", req.Step, req.Slot, dir, err)
		}
	}
	if req.Source == "" {
		// The slot may be done already: in data-parallel mode, an earlier attempt uploaded this
		// node's own data where the order now names the column's. A .meta naming data whose
		// manifest is in the backup is a finished slot. Before, naming other data failed the
		// create-if-absent .meta at every retry, for ever.
		if named, err := ReadSmall(ctx, b.Store, meta, 1024); err == nil && validateHash(string(named)) == nil {
			if _, err := b.Store.Stat(ctx, dir+manifestName(string(named))); err == nil {
				return nil
			}
		} else if err != nil && !IsNotFound(err) {
			return fmt.Errorf("upload %s: %w", meta, err)
		}
		if _, err := b.Store.Stat(ctx, dir+manifestName(req.Hash)); IsNotFound(err) {
			return fmt.Errorf("upload %s: data %s: %w (%w)", meta, dataName(req.Hash), tiers.ErrDataNotInBackup, err)
		} else if err != nil {
			return fmt.Errorf("upload %s: data %s: %w", meta, dataName(req.Hash), err)
		}
	} else if err := b.uploadData(ctx, dir, req); err != nil {
		return fmt.Errorf("upload %s to %s: %w", req.Source, dir+dataName(req.Hash), err)
	}
	if err := PutBytes(ctx, b.Store, meta, []byte(req.Hash), true); err != nil {
		return fmt.Errorf("upload %s: %w", meta, err)
	}
	return nil
}

// uploadData uploads req.Source as dir/<hash>.data, then its manifest.
func (b *Backups) uploadData(ctx context.Context, dir string, req UploadRequest) error {
	src, err := openSource(req.Source, req.Hash)
	if err != nil {
		return err
	}
	defer src.close()
	m := src.m
	if m.Kind == kindDir {
		budget := b.nameBudget()
		for i := range m.Files {
			m.Files[i].Object = mappedObject(dir, req.Hash, string(m.Files[i].Path), budget)
		}
	}
	// Never write a manifest that a reader would refuse (encode then picks
	// the lowest format that holds it).
	m.Format = manifestFormatV2
	if err := m.check(req.Hash); err != nil {
		return fmt.Errorf("%s: %w", req.Source, err)
	}
	// The data's manifest is written once all its objects are: an upload of it finished (this
	// one's, cut short before its .meta, now resumed). Nothing travels again if it lists the
	// same files.
	switch have, err := b.readManifest(ctx, dir, req.Hash); {
	case err == nil && sameFiles(have, m):
		if err := b.checkObjects(ctx, dir, req.Hash, have); err != nil {
			// Lost since: the next try uploads them again, and writes the manifest again.
			if derr := b.Store.Delete(ctx, dir+manifestName(req.Hash)); derr != nil && !IsNotFound(derr) {
				return errors.Join(err, derr)
			}
			return err
		}
		if req.Progress != nil {
			req.Progress(0, 0)
		}
		return nil
	case err == nil:
		return &PreconditionError{Name: dir + manifestName(req.Hash), Err: errors.New("the data in the backup lists other files than the source")}
	case !IsNotFound(err):
		return err
	}
	prog := newProgress(m.total(), req.Progress)
	requests := semaphore.NewWeighted(int64(b.parallelism()))
	var c *codec
	var cache *chunkCache
	if b.compress() {
		c = newCodec(b.chunkLen(), keptChunks*b.parallelism())
		cache = newChunkCache(b.parallelism()+2, &c.stored)
		defer cache.drop()
	}
	err = forEach(ctx, b.parallelism(), len(m.Files), func(ctx context.Context, i int) error {
		f := &m.Files[i]
		file, err := src.open(string(f.Path))
		if err != nil {
			return err
		}
		defer file.Close()
		t := FileTransfer{Name: dir + f.object(req.Hash), File: file, Size: f.Size,
			Progress: prog.add, Requests: requests, TempDir: req.Job + "/"}
		if c != nil {
			return b.putCompressed(ctx, c, cache, f, t)
		}
		crc, err := b.Store.PutFile(ctx, t)
		f.CRC32C = crc32cHex(crc)
		return err
	})
	if err != nil {
		return err
	}
	// Kept attrs that do not parse are left out (the data restores with the defaults); a
	// failure to read them fails the upload, which is retried, rather than lose them.
	if _, enc, err := layout.ReadAttrsEncoded(req.Source); err == nil {
		if err := PutBytes(ctx, b.Store, dir+attrsName(req.Hash), enc, false); err != nil {
			return err
		}
	} else if pe := (*fs.PathError)(nil); errors.As(err, &pe) && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if err := b.checkObjects(ctx, dir, req.Hash, m); err != nil {
		return err
	}
	data, err := m.encode()
	if err != nil {
		return err
	}
	return PutBytes(ctx, b.Store, dir+manifestName(req.Hash), data, true)
}

// ErrObjectsMissing fails an upload whose data objects are not all in the store when its
// manifest would be written: the store lost some while the upload ran. The upload is tried again.
var ErrObjectsMissing = errors.New("objects of the data are missing from the backup")

// checkObjects checks, by one listing of the data's prefix, that every object m names is in
// the store with its size and CRC32C (listedProblem, as Verify does). A store that lost objects while the upload ran (an emulator
// restarted empty, or `mtcfs backups delete --force` of the backup under way) took the
// manifest and the .meta of data that was not there: the backup counted complete while it was
// damaged, and the step was never backed up again (found by a black-box run).
func (b *Backups) checkObjects(ctx context.Context, dir, hash string, m *manifest) error {
	objs, _, err := b.Store.List(ctx, dir+dataName(hash), "")
	if err != nil {
		return fmt.Errorf("list the uploaded data: %w", err)
	}
	index := make(map[string]ObjectAttrs, len(objs))
	for _, o := range objs {
		index[strings.TrimPrefix(o.Name, dir)] = o
	}
	n, first, why := 0, "", ""
	for _, f := range m.Files {
		if p := listedProblem(index, hash, f, true); p != "" {
			if n++; n == 1 {
				first, why = f.object(hash), p
			}
		}
	}
	if n > 0 {
		return fmt.Errorf("%d of %d (%s%s first): %s; the store lost them while the upload ran: %w", n, len(m.Files), dir, first, why, ErrObjectsMissing)
	}
	return nil
}

// keptChunks is how many encoded chunks per request in flight an upload's
// plans keep for the store to send as they are (64 MiB at the defaults):
// enough for the files uploading at once when they are up to two chunks long.
const keptChunks = 2

// putCompressed uploads one file with compression on: compressed when that
// pays (see encodedPlan.pays), else as it is. It encodes the file once to
// learn the object's size and CRC32C, which the store needs before the first
// byte; the store then reads the chunks that plan kept, and the others are
// encoded again as it reads them. It fills in f.
func (b *Backups) putCompressed(ctx context.Context, c *codec, cache *chunkCache, f *manifestFile, t FileTransfer) error {
	plan, err := c.planFile(ctx, t.File, t.Size)
	if err != nil {
		return fmt.Errorf("compress %s: %w", t.File.Name(), err)
	}
	defer plan.release(c)
	if !plan.pays() {
		plan.release(c)
		crc, err := b.Store.PutFile(ctx, t)
		f.CRC32C = crc32cHex(crc)
		return err
	}
	view := &encodedFile{src: t.File, plan: plan, codec: c, cache: cache}
	t.File, t.Size = view, plan.stored()
	if t.Progress != nil {
		t.Progress = newScaledProgress(plan.stored(), plan.size, t.Progress)
	}
	crc, err := b.Store.PutFile(ctx, t)
	if err != nil {
		return err
	}
	if crc != plan.storedCRC {
		return fmt.Errorf("%s: the file changed during the upload (crc32c %08x, %08x before)", view.Name(), crc, plan.storedCRC)
	}
	*f = manifestFile{Path: f.Path, Size: plan.size, CRC32C: crc32cHex(plan.fileCRC), Object: f.Object,
		Codec: codecPlanes, StoredSize: plan.stored(), StoredCRC32C: crc32cHex(plan.storedCRC), ChunkLen: plan.chunkLen, Chunks: plan.chunks()}
	return nil
}

// source is the local data of an upload, described as a manifest without
// CRCs, and how to open each of its files.
type source struct {
	m    *manifest
	dir  *layout.Dir // nil for a single file
	path string
}

func (s *source) open(rel string) (*os.File, error) {
	if s.dir == nil {
		return os.Open(s.path)
	}
	return s.dir.Open(rel, os.O_RDONLY, 0)
}

func (s *source) close() {
	if s.dir != nil {
		s.dir.Close()
	}
}

// openSource lists the local data at src (a directory for a "D" hash, else a
// regular file) the way the tree hash does (layout.Dir: paths of any length,
// no symlink followed): directories, regular files, symlinks and special
// files, sorted by path so the manifest is deterministic.
func openSource(src, hash string) (*source, error) {
	fi, err := os.Stat(src)
	if err != nil {
		return nil, err
	}
	kind := kindOf(hash)
	m := &manifest{Kind: kind, Files: []manifestFile{}}
	switch {
	case fi.IsDir() != (kind == kindDir):
		return nil, fmt.Errorf("hash %s names a %s, but %s is not one (directories take the D prefix)", hash, kind, src)
	case kind == kindFile && !fi.Mode().IsRegular():
		return nil, fmt.Errorf("%s is not a regular file", src)
	case kind == kindFile:
		m.Files = append(m.Files, manifestFile{Size: fi.Size()})
		return &source{m: m, path: src}, nil
	}
	d, err := layout.OpenDir(src)
	if err != nil {
		return nil, err
	}
	entries, err := d.List()
	if err != nil {
		d.Close()
		return nil, err
	}
	slices.SortFunc(entries, func(a, b layout.TreeEntry) int { return strings.Compare(a.Path, b.Path) })
	for _, e := range entries {
		p := text(e.Path)
		switch e.Type {
		case layout.EntryDir:
			m.Dirs = append(m.Dirs, p)
		case layout.EntryFile:
			m.Files = append(m.Files, manifestFile{Path: p, Size: e.Size})
		case layout.EntrySymlink:
			m.Symlinks = append(m.Symlinks, manifestSymlink{Path: p, Target: text(e.Target)})
		default:
			t, ok := specialName(e.Type)
			if !ok {
				d.Close()
				return nil, fmt.Errorf("%s/%s: a %v cannot be backed up", src, e.Path, e.Type)
			}
			m.Specials = append(m.Specials, manifestSpecial{Path: p, Type: t, Rdev: e.Rdev})
		}
	}
	return &source{m: m, dir: d, path: src}, nil
}

// specialName and specialType translate special entry types to manifest
// spellings and back.
func specialName(t layout.EntryType) (string, bool) {
	switch t {
	case layout.EntryFIFO:
		return specialFIFO, true
	case layout.EntrySocket:
		return specialSocket, true
	case layout.EntryCharDev:
		return specialCharDev, true
	case layout.EntryBlockDev:
		return specialBlockDev, true
	}
	return "", false
}

func specialType(name string) layout.EntryType {
	switch name {
	case specialFIFO:
		return layout.EntryFIFO
	case specialSocket:
		return layout.EntrySocket
	case specialCharDev:
		return layout.EntryCharDev
	case specialBlockDev:
		return layout.EntryBlockDev
	}
	return 0
}

// DownloadRequest describes fetching one data from a backup.
type DownloadRequest struct {
	Job, Backup, Hash string
	// Dest is the path the data gets: a directory for a "D" hash, else a
	// file. It must not exist; its parent must. The tree below it may hold
	// paths of any length.
	Dest string
	// Progress is as for UploadRequest.
	Progress func(done, total int64)
	// Attrs puts the owners and modes the backup keeps for the data beside Dest
	// (layout.AttrsFile), as the agent's spool keeps them; without it (an export) they stay
	// behind.
	Attrs bool
}

// Download fetches <hash>.data from a backup to req.Dest, in parallel, and
// checks every file's size and CRC32C against the manifest (*ChecksumError
// on mismatch). The data is assembled under a temporary name beside Dest and
// renamed into place only when all of it is verified, so Dest never holds a
// partial or corrupt tree. Files are not fsynced: Dest is the RAM tier, and
// what survives there is verified again on adoption.
func (b *Backups) Download(ctx context.Context, req DownloadRequest) error {
	if err := validateJob(req.Job); err != nil {
		return err
	}
	if err := validateBackupName(req.Backup); err != nil {
		return err
	}
	if err := validateHash(req.Hash); err != nil {
		return err
	}
	dir := backupDir(req.Job, req.Backup)
	src := dir + dataName(req.Hash)
	if err := b.download(ctx, dir, req); err != nil {
		return fmt.Errorf("download %s to %s: %w", src, req.Dest, err)
	}
	return nil
}

func (b *Backups) download(ctx context.Context, dir string, req DownloadRequest) error {
	if _, err := os.Lstat(req.Dest); err == nil {
		return fmt.Errorf("destination exists: %w", fs.ErrExist)
	} else if !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	m, err := b.readManifest(ctx, dir, req.Hash)
	if err != nil {
		return err
	}
	var attrs *layout.Attrs
	if req.Attrs {
		if attrs, err = b.readAttrs(ctx, dir, req.Hash); err != nil {
			return err
		}
	}
	// The owners and modes go beside Dest before the data: tiers moves them first too.
	place := func(tmp string) error {
		if err := layout.WriteAttrs(req.Dest, attrs); err != nil {
			return err
		}
		if err := os.Rename(tmp, req.Dest); err != nil {
			os.Remove(layout.AttrsFile(req.Dest))
			return err
		}
		return nil
	}
	prog := newProgress(m.total(), req.Progress)
	requests := semaphore.NewWeighted(int64(b.parallelism()))
	parent, pattern := filepath.Dir(req.Dest), "."+filepath.Base(req.Dest)+".tmp-*"

	if m.Kind == kindFile {
		f, err := os.CreateTemp(parent, pattern)
		if err != nil {
			return err
		}
		tmp := f.Name()
		err = b.fetch(ctx, dir, req.Hash, m.Files[0], f, prog, requests)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err == nil {
			err = place(tmp)
		}
		if err != nil {
			os.Remove(tmp)
		}
		return err
	}

	tmp, err := os.MkdirTemp(parent, pattern)
	if err != nil {
		return err
	}
	err = b.fetchTree(ctx, dir, req.Hash, m, tmp, prog, requests)
	if err == nil {
		err = place(tmp)
	}
	if err != nil {
		os.RemoveAll(tmp)
	}
	return err
}

// readAttrs reads the owners and modes kept for hash's data: nil when the backup has none, or
// what it has is too large or does not parse (the data restores with the agent's defaults
// then). A failure to read them fails the download, as a failure to read the manifest does,
// rather than restore the data without them on a passing error.
func (b *Backups) readAttrs(ctx context.Context, dir, hash string) (*layout.Attrs, error) {
	data, err := ReadSmall(ctx, b.Store, dir+attrsName(hash), layout.MaxAttrsSize)
	var nf *NotFoundError
	var tooLarge tooLargeError
	if errors.As(err, &nf) || errors.As(err, &tooLarge) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	a, err := layout.DecodeAttrs(data)
	if err != nil {
		return nil, nil
	}
	return a, nil
}

// fetchTree rebuilds a directory data below root: directories, then files
// (downloaded in parallel), then symlinks and special files. Everything is
// created through layout.Dir, so paths of any length work and no symlink the
// tree holds is ever followed.
func (b *Backups) fetchTree(ctx context.Context, dir, hash string, m *manifest, root string, prog *progress, requests *semaphore.Weighted) error {
	d, err := layout.OpenDir(root)
	if err != nil {
		return err
	}
	defer d.Close()
	for _, p := range m.Dirs {
		if err := d.MkdirAll(string(p), dirPerm); err != nil {
			return err
		}
	}
	// The manifest lists every directory, but a tree is still restorable
	// if it lists only what they hold.
	mkParent := func(p text) error {
		parent := path.Dir(string(p))
		if parent == "." {
			return nil
		}
		return d.MkdirAll(parent, dirPerm)
	}
	err = forEach(ctx, b.parallelism(), len(m.Files), func(ctx context.Context, i int) error {
		mf := m.Files[i]
		if err := mkParent(mf.Path); err != nil {
			return err
		}
		f, err := d.Open(string(mf.Path), os.O_WRONLY|os.O_CREATE|os.O_EXCL, filePerm)
		if err != nil {
			return err
		}
		err = b.fetch(ctx, dir, hash, mf, f, prog, requests)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		return err
	})
	if err != nil {
		return err
	}
	for _, l := range m.Symlinks {
		if err := mkParent(l.Path); err != nil {
			return err
		}
		if err := d.Create(layout.TreeEntry{Path: string(l.Path), Type: layout.EntrySymlink, Target: string(l.Target)}, 0); err != nil {
			return err
		}
	}
	for _, s := range m.Specials {
		if err := mkParent(s.Path); err != nil {
			return err
		}
		if err := d.Create(layout.TreeEntry{Path: string(s.Path), Type: specialType(s.Type), Rdev: s.Rdev}, filePerm); err != nil {
			return err
		}
	}
	return nil
}

// fetch copies one data object to the new, empty file f, verifying it
// against its manifest entry. requests bounds the requests in flight of one
// Download.
func (b *Backups) fetch(ctx context.Context, dir, hash string, mf manifestFile, f *os.File, prog *progress, requests *semaphore.Weighted) error {
	name := dir + mf.object(hash)
	if mf.compressed() {
		c := newCodec(mf.ChunkLen, 0)
		report := newScaledProgress(mf.Size, mf.Size, prog.add)
		crc, err := b.readCompressed(ctx, c, name, mf, requests, func(p []byte, off int64) error {
			if _, err := f.WriteAt(p, off); err != nil {
				return err
			}
			if report != nil {
				report(len(p))
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("fetch %s: %w", name, err)
		}
		if crc != uint32(mf.CRC32C) {
			return &ChecksumError{Name: name + " (decompressed)", Want: uint32(mf.CRC32C), Got: crc}
		}
		return nil
	}
	n, crc, err := b.Store.GetFile(ctx, FileTransfer{Name: name, File: f, Size: mf.Size, Progress: prog.add, Requests: requests})
	if err != nil {
		return fmt.Errorf("fetch %s: %w", name, err)
	}
	if n != mf.Size {
		return fmt.Errorf("fetch %s: got %d bytes, manifest says %d", name, n, mf.Size)
	}
	if crc != uint32(mf.CRC32C) {
		return &ChecksumError{Name: name, Want: uint32(mf.CRC32C), Got: crc}
	}
	return nil
}

// FileTransfer is one local file moving to or from an object (ObjectStore's
// PutFile and GetFile).
type FileTransfer struct {
	Name string    // object name
	File LocalFile // read with ReadAt (PutFile) or written with WriteAt (GetFile)
	// Size is the file's size (PutFile) or the size the object must have
	// (GetFile).
	Size int64
	// Progress, if set, is told the bytes moved; retried bytes are not
	// counted twice.
	Progress func(n int)
	// Requests bounds the requests in flight across all files of one Upload
	// or Download: each request holds one unit while it runs. nil: at most
	// DefaultParallelism for this file.
	Requests *semaphore.Weighted
	// TempDir is the store name prefix ("" or ending in "/") under which an
	// upload in parts keeps its temporary objects.
	TempDir string
}

// LocalFile is the local side of a FileTransfer: an *os.File, or a view of
// one (the compressed form of a file, see encodedFile).
type LocalFile interface {
	io.ReaderAt
	io.WriterAt
	Name() string
}

// withRequests returns t with Requests set.
func (t FileTransfer) withRequests() FileTransfer {
	if t.Requests == nil {
		t.Requests = semaphore.NewWeighted(DefaultParallelism)
	}
	return t
}

// request runs fn holding one unit of t.Requests (see withRequests).
func (t FileTransfer) request(ctx context.Context, fn func() error) error {
	if err := t.Requests.Acquire(ctx, 1); err != nil {
		return err
	}
	defer t.Requests.Release(1)
	return fn()
}

// eachRequest calls fn(ctx, i) for every i in [0, n), in order, each once it
// holds one unit of t.Requests (see withRequests), so that the parts of a
// file start in order and the requests of all files of one transfer stay
// within the bound. The first error cancels the ctx the other calls see,
// stops further calls, and is returned; so is the caller's cancellation.
func (t FileTransfer) eachRequest(ctx context.Context, n int, fn func(ctx context.Context, i int) error) error {
	cctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	g, gctx := errgroup.WithContext(cctx)
	for i := range n {
		if t.Requests.Acquire(gctx, 1) != nil {
			break // cancelled: Wait or ctx says why
		}
		g.Go(func() error {
			defer t.Requests.Release(1)
			err := fn(gctx, i)
			if err != nil {
				cancel(err) // before the unit is released: no later part starts
				if afterPartCancelled != nil {
					afterPartCancelled()
				}
			}
			return err
		})
	}
	if err := g.Wait(); err != nil {
		// The part that failed first cancels the others before it returns, and one of them
		// may return its "context canceled" first, which errgroup then keeps: the error that
		// says why is the cause (a loaded run: "read …: context canceled" instead of "giving up
		// after 3 attempts").
		if cause := context.Cause(cctx); cause != nil && ctx.Err() == nil {
			return cause
		}
		return err
	}
	return ctx.Err()
}

// afterPartCancelled, when set (tests), runs in eachRequest after a failed part cancelled the
// others and before it returns.
var afterPartCancelled func()

// progressOf returns t.Progress, or a function that ignores its argument.
func (t FileTransfer) progressOf() func(int) {
	if t.Progress == nil {
		return func(int) {}
	}
	return t.Progress
}

// progress totals the bytes moved by parallel transfers and reports them.
type progress struct {
	mu     sync.Mutex
	done   int64                   // GUARDED_BY(mu)
	total  int64                   // immutable
	report func(done, total int64) // called under mu, so calls are ordered
}

func newProgress(total int64, report func(done, total int64)) *progress {
	p := &progress{total: total, report: report}
	if report != nil {
		report(0, total)
	}
	return p
}

func (p *progress) add(n int) {
	if p.report == nil || n == 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.done += int64(n)
	p.report(p.done, p.total)
}

// countingReader reports the bytes read through it.
type countingReader struct {
	r      io.Reader
	report func(n int)
}

func (c *countingReader) Read(b []byte) (int, error) {
	n, err := c.r.Read(b)
	c.report(n)
	return n, err
}

// forEach calls fn(ctx, i) for every i in [0, n), at most par at a time (an
// errgroup), and waits for them. The first error cancels the ctx the other
// calls see, stops further calls, and is returned; so is the caller's
// cancellation.
func forEach(ctx context.Context, par, n int, fn func(ctx context.Context, i int) error) error {
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(max(par, 1))
	for i := 0; i < n && gctx.Err() == nil; i++ {
		g.Go(func() error { return fn(gctx, i) })
	}
	if err := g.Wait(); err != nil {
		return err
	}
	return ctx.Err()
}

// sameFiles reports whether two manifests of one hash list the same entries (kinds, paths,
// sizes, link targets): the CRC32Cs of a source are known only once it is read.
func sameFiles(a, b *manifest) bool {
	if a.Kind != b.Kind || len(a.Files) != len(b.Files) || !slices.Equal(a.Dirs, b.Dirs) ||
		!slices.Equal(a.Symlinks, b.Symlinks) || !slices.Equal(a.Specials, b.Specials) {
		return false
	}
	for i := range a.Files {
		if a.Files[i].Path != b.Files[i].Path || a.Files[i].Size != b.Files[i].Size {
			return false
		}
	}
	return true
}
