package gcsbackend

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"regexp"
	"sort"
	"strings"
	"sync"
	"time"

	"golang.org/x/sync/semaphore"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/planecodec"
	"github.com/mtcfs/mtcfs/tiers"
)

// Backups reads and writes the SPEC §6 backup layout (see the package
// documentation) in Store. The zero values of the options are usable;
// Backups holds no other state and is safe for concurrent use.
type Backups struct {
	Store ObjectStore
	// Parallelism bounds the concurrent object transfers or reads of one
	// call; 0 means DefaultParallelism.
	Parallelism int
	// LeftoverAge is how long CleanLeftovers waits before it removes a
	// temporary whose writer's liveness it cannot check; 0 means
	// DefaultLeftoverAge.
	LeftoverAge time.Duration
	// Compress says how Upload stores data files: CompressOff (the zero
	// value) as they are, CompressAuto compressed where that pays. Reads
	// (Download, Verify, Export) understand both whatever it says. Every agent
	// of a job should use the same setting: two nodes uploading identical
	// data with different settings conflict on its objects.
	Compress Compression

	now             func() time.Time // tests: the clock of CleanLeftovers
	chunkLenForTest int64            // tests: file bytes per compressed chunk
}

// DefaultParallelism keeps enough requests in flight to hide GCS latency
// without one node's upload flooding a small machine.
const DefaultParallelism = 8

func (b *Backups) parallelism() int {
	if b.Parallelism > 0 {
		return b.Parallelism
	}
	return DefaultParallelism
}

const (
	restoreVersionName = "restore.version"
	// metaLimit and pinLimit bound reads of objects that hold one name, so
	// that a stray large object cannot exhaust memory.
	metaLimit = 256
	pinLimit  = 4096
)

var (
	hashRE     = regexp.MustCompile(`^D?[0-9a-f]{64}$`)
	metaRestRE = regexp.MustCompile(`^s(\d+)-n(\d+)-w(\d+)\.meta$`)
)

// Slot identifies one training process: a node rank and a worker index.
type Slot struct{ Rank, Worker int }

func (s Slot) String() string { return fmt.Sprintf("n%d-w%d", s.Rank, s.Worker) }

// metaName is the .meta object name of (job, step, slot), as the reference
// system spells it.
func metaName(job string, step int64, s Slot) string {
	return fmt.Sprintf("%s-s%d-n%d-w%d.meta", job, step, s.Rank, s.Worker)
}

// parseMetaName recognises job's .meta names. Only the canonical spelling
// (no leading zeros) counts, so that one slot cannot have two names.
func parseMetaName(job, name string) (step int64, s Slot, ok bool) {
	rest, found := strings.CutPrefix(name, job+"-")
	if !found {
		return 0, Slot{}, false
	}
	m := metaRestRE.FindStringSubmatch(rest)
	if m == nil {
		return 0, Slot{}, false
	}
	if _, err := fmt.Sscan(m[1]+" "+m[2]+" "+m[3], &step, &s.Rank, &s.Worker); err != nil {
		return 0, Slot{}, false
	}
	return step, s, metaName(job, step, s) == name
}

func dataName(hash string) string     { return hash + ".data" }
func manifestName(hash string) string { return hash + ".data.manifest" }

// attrsName is the object holding the owners and modes of hash's entries as the job saved them
// (layout.Attrs' encoding), written before the manifest when the spool keeps them. It is not
// part of what makes a backup complete: a backup without it (an earlier agent's, the reference
// system's) restores with the agent's defaults. Two nodes uploading the same data may both
// write it (not create-if-absent): either one's is right.
func attrsName(hash string) string { return hash + ".data.attrs" }

// damagedName is the object a restore writes beside hash's data when the data it downloaded
// failed its check (MarkDamaged): Verify then reports the data damaged, so that the next
// restore passes over it instead of failing on it again.
func damagedName(hash string) string { return hash + ".data.damaged" }

// damagedLimit bounds what Verify reads of a damage record.
const damagedLimit = 4 << 10

// MarkDamaged records in the backup that hash's data failed its check when a restore
// downloaded it, with why (a line). Verify reports the steps naming it damaged from then on.
func (b *Backups) MarkDamaged(ctx context.Context, job, backup, hash, why string) error {
	if err := validateJob(job); err != nil {
		return err
	}
	if err := validateBackupName(backup); err != nil {
		return err
	}
	if err := validateHash(hash); err != nil {
		return err
	}
	if len(why) > damagedLimit-1 {
		why = why[:damagedLimit-1]
	}
	return PutBytes(ctx, b.Store, backupDir(job, backup)+damagedName(hash), []byte(why+"\n"), false)
}

// dataObject is the object holding path inside hash's data ("" for a
// single-file data, which is one object).
func dataObject(hash, path string) string {
	if path == "" {
		return dataName(hash)
	}
	return dataName(hash) + "/" + path
}

func validateJob(job string) error {
	if err := ValidateName(job); err != nil || strings.Contains(job, "/") {
		return fmt.Errorf("job name %q: want a single path segment (no \"/\", not \"..\")", job)
	}
	return nil
}

func validateBackupName(name string) error {
	if !layout.IsBackupName(name) {
		return fmt.Errorf("backup name %q: want YYYY-MM-DD_HH-MM (UTC), e.g. %s", name, layout.BackupName(time.Now()))
	}
	return nil
}

func validateHash(hash string) error {
	if !hashRE.MatchString(hash) {
		return fmt.Errorf("data hash %q: want 64 lowercase hex digits, prefixed with D for a directory", hash)
	}
	return nil
}

// shapeName is mtcfs's record of the job's shape in a backup, beside the reference layout:
// {"format":"mtcfs-backup-v1","nodes":N,"workers":W,"data-parallelism":D}, without D when it is 0
// (data-parallel mode off): as agents before it wrote every record, which say nothing of it.
// Every node writes the same bytes, create-if-absent. Verify uses it when
// the caller does not know the shape, instead of inferring it from the .meta names present
// (which cannot see a whole missing rank), and reports it (BackupReport.Saved), so that a job of
// another shape does not restore the backup.
const shapeName = "mtcfs-backup.json"

// dpName records data-parallelism 0 beside a shapeName record without the field (the bytes of
// agents before data-parallelism, which every node writes alike: see putShape), so that "off"
// stays told apart from "not recorded". Only agents that write it read it.
const dpName = "mtcfs-backup-dp.json"

var dpOff = []byte(`{"data-parallelism":0}`)

type backupShape struct {
	Format      string `json:"format"`
	tiers.Shape        // DataParallelism -1 once read: not recorded
}

const shapeFormat = "mtcfs-backup-v1"

func (b *Backups) putShape(ctx context.Context, dir string, s tiers.Shape) error {
	data, _ := json.Marshal(backupShape{Format: shapeFormat, Shape: s})
	if s.DataParallelism == 0 {
		// The bytes an agent before data-parallelism writes for the same shape: its
		// create-if-absent fails on any other, and it has no way round it, so every upload of
		// such a node into a backup this one recorded first failed, and the backup never
		// completed (found by a black-box run of mixed versions).
		data, _ = json.Marshal(struct {
			Format  string `json:"format"`
			Nodes   int    `json:"nodes"`
			Workers int    `json:"workers"`
		}{shapeFormat, s.Nodes, s.Workers})
		// Before the record: a reader that finds the record finds this too, or an earlier
		// agent wrote the record (which says nothing of data-parallelism).
		if err := PutBytes(ctx, b.Store, dir+dpName, dpOff, true); err != nil && !errors.As(err, new(*PreconditionError)) {
			return fmt.Errorf("record the job's shape (%s): %w", s, err)
		}
	}
	err := PutBytes(ctx, b.Store, dir+shapeName, data, true)
	var pe *PreconditionError
	if errors.As(err, &pe) {
		// Another node recorded it first, in other bytes: an agent of an earlier version writes
		// no data-parallelism (the nodes of one job are upgraded one after another). The same
		// nodes and workers, and no other data-parallelism, are the same shape.
		if old, ok := b.readShape(ctx, dir); ok && sameShape(old, s) {
			return nil
		}
	}
	if err != nil {
		return fmt.Errorf("record the job's shape (%s): %w", s, err)
	}
	return nil
}

// sameShape reports whether a shape recorded in a backup is s: the same nodes and workers, and no
// other data-parallelism (-1, from an agent of an earlier version, says none).
func sameShape(old backupShape, s tiers.Shape) bool {
	return old.Nodes == s.Nodes && old.Workers == s.Workers &&
		(old.DataParallelism == -1 || old.DataParallelism == s.DataParallelism)
}

// readShape returns the shape recorded in the backup at dir (ok false: none, or unreadable).
func (b *Backups) readShape(ctx context.Context, dir string) (backupShape, bool) {
	data, err := ReadSmall(ctx, b.Store, dir+shapeName, 4096)
	if err != nil {
		return backupShape{}, false
	}
	s := backupShape{Shape: tiers.Shape{DataParallelism: -1}} // what a record without the field keeps
	if json.Unmarshal(data, &s) != nil || s.Format != shapeFormat || s.Nodes <= 0 || s.Workers <= 0 || s.DataParallelism < -1 {
		return backupShape{}, false
	}
	if s.DataParallelism == -1 {
		if dp, err := ReadSmall(ctx, b.Store, dir+dpName, 64); err == nil && bytes.Equal(dp, dpOff) {
			s.DataParallelism = 0
		}
	}
	return s, true
}

// backupDir is the object-name prefix of one backup.
func backupDir(job, backup string) string { return job + "/" + backup + "/" }

// Names returns the names of job's backups, newest first. Other names under
// the job (restore.version, anything else) are ignored.
func (b *Backups) Names(ctx context.Context, job string) ([]string, error) {
	if err := validateJob(job); err != nil {
		return nil, err
	}
	_, prefixes, err := b.Store.List(ctx, job+"/", "/")
	if err != nil {
		return nil, fmt.Errorf("list backups of %s: %w", job, err)
	}
	var names []string
	for _, p := range prefixes {
		name := strings.TrimSuffix(strings.TrimPrefix(p, job+"/"), "/")
		if layout.IsBackupName(name) {
			names = append(names, name)
		}
	}
	sort.Sort(sort.Reverse(sort.StringSlice(names)))
	return names, nil
}

// List verifies every backup of job (cheaply: VerifyOptions{}, node and
// worker counts inferred) and returns the reports, newest first.
func (b *Backups) List(ctx context.Context, job string) ([]BackupReport, error) {
	names, err := b.Names(ctx, job)
	if err != nil {
		return nil, err
	}
	reports := make([]BackupReport, 0, len(names))
	for _, name := range names {
		r, err := b.Verify(ctx, job, name, VerifyOptions{})
		if IsNotFound(err) { // deleted since listed
			continue
		}
		if err != nil {
			return nil, err
		}
		reports = append(reports, r)
	}
	return reports, nil
}

// VerifyOptions says what Verify expects and how hard it looks.
type VerifyOptions struct {
	// Nodes and Workers are the job's node count and workers per node. A
	// backup does not record them; when zero, they are inferred from the
	// .meta names as highest rank (worker) + 1 over the whole backup, so
	// ranks 0..max must all be present. Inference cannot notice that the
	// highest ranks are missing altogether: pass the counts when known.
	Nodes, Workers int
	// Deep reads every data object and recomputes its CRC32C instead of
	// trusting the CRC32C the store reports. For GCS that is the server's
	// own checksum; for file:// it catches bit rot that left the mtime
	// alone.
	Deep bool
}

// BackupReport is the result of verifying one backup.
type BackupReport struct {
	Name string
	// Nodes and Workers are the counts the backup was checked against;
	// Inferred tells whether they came from the .meta names.
	Nodes, Workers int
	Inferred       bool
	// Saved is the shape of the job that took the backup, as recorded with it (SavedRecorded),
	// or else at least what its .meta names show: highest rank and worker + 1.
	Saved         tiers.Shape
	SavedRecorded bool
	// Steps holds every step with at least one .meta, highest first.
	Steps []StepReport
}

// StepReport says whether one step of a backup is complete, and why not.
type StepReport struct {
	Step     int64
	Complete bool
	// Data maps every slot whose .meta is present and well-formed to the
	// hash it names: what to Download to restore that slot.
	Data map[Slot]string
	// Problems lists, sorted, what keeps the step from being complete.
	Problems []string
	// Damaged tells that a slot whose upload finished (its .meta is written last) no longer
	// has intact data, or that a .meta does not name data: the backup was complete once and
	// has been damaged since (objects deleted, bit rot, a foreign write), which an
	// interrupted upload never leaves behind.
	Damaged bool
}

// HighestComplete returns the highest complete step of the backup.
func (r BackupReport) HighestComplete() (int64, bool) {
	for _, s := range r.Steps {
		if s.Complete {
			return s.Step, true
		}
	}
	return 0, false
}

// Damaged reports whether a step of the backup is damaged (StepReport.Damaged).
func (r BackupReport) Damaged() bool {
	for _, s := range r.Steps {
		if s.Damaged {
			return true
		}
	}
	return false
}

// Complete reports whether the backup holds at least one step and every step
// it holds is complete: nothing in it is a leftover of an interrupted upload.
func (r BackupReport) Complete() bool {
	for _, s := range r.Steps {
		if !s.Complete {
			return false
		}
	}
	return len(r.Steps) > 0
}

// Verify checks the completeness of one backup (SPEC §6): a step is complete
// when every slot's .meta is present and names data whose manifest is
// present and whose every file is present with the manifest's size and
// CRC32C. A backup with no objects at all is *NotFoundError.
//
// Cost: one recursive listing, one small read per .meta and per distinct
// data manifest, and with Deep a full read of every data object.
//
// A step found damaged is looked at again, with a second listing: on GCS a listing comes in
// pages, and a slot whose upload finished while the first was read can show its .meta without
// the data objects of an earlier page. Its data was all written before its .meta, so the second
// listing, begun after the first ended, holds it; a step is Damaged only if both say so. Not
// with Deep: that would read every object of a damaged backup twice. `mtcfs backups verify` run
// beside an upload to GCS may then call a step damaged that the next run finds complete. Nor
// when every damaged step is damaged whatever the listing says (a .damaged record, a .meta that
// names no data): a backup a restore marked was otherwise verified twice at every restore plan.
func (b *Backups) Verify(ctx context.Context, job, backup string, opts VerifyOptions) (BackupReport, error) {
	first, recorded, err := b.verifyOnce(ctx, job, backup, opts)
	if err != nil || !first.Damaged() || opts.Deep {
		return first, err
	}
	listed := false // a step damaged by what the listing showed
	for _, s := range first.Steps {
		listed = listed || (s.Damaged && !recorded[s.Step])
	}
	if !listed {
		return first, nil
	}
	again, _, err := b.verifyOnce(ctx, job, backup, opts)
	if err != nil {
		return BackupReport{}, err
	}
	damagedBefore := make(map[int64]bool, len(first.Steps))
	for _, s := range first.Steps {
		damagedBefore[s.Step] = s.Damaged
	}
	for i := range again.Steps {
		again.Steps[i].Damaged = again.Steps[i].Damaged && damagedBefore[again.Steps[i].Step]
	}
	return again, nil
}

// verifyOnce is Verify over one listing of the backup. recorded holds the damaged steps that a
// second listing cannot clear: a .damaged record of their data, or a .meta that names no data.
func (b *Backups) verifyOnce(ctx context.Context, job, backup string, opts VerifyOptions) (rep BackupReport, recorded map[int64]bool, err error) {
	if err := validateJob(job); err != nil {
		return BackupReport{}, nil, err
	}
	if err := validateBackupName(backup); err != nil {
		return BackupReport{}, nil, err
	}
	dir := backupDir(job, backup)
	objs, _, err := b.Store.List(ctx, dir, "")
	if err != nil {
		return BackupReport{}, nil, fmt.Errorf("verify backup %s: %w", dir, err)
	}
	if len(objs) == 0 {
		return BackupReport{}, nil, &NotFoundError{Name: dir}
	}
	index := make(map[string]ObjectAttrs, len(objs))
	metas := make(map[int64]map[Slot]bool)
	maxRank, maxWorker := -1, -1
	for _, o := range objs {
		rel := strings.TrimPrefix(o.Name, dir)
		index[rel] = o
		step, slot, ok := parseMetaName(job, rel)
		if !ok {
			continue
		}
		if metas[step] == nil {
			metas[step] = make(map[Slot]bool)
		}
		metas[step][slot] = true
		maxRank, maxWorker = max(maxRank, slot.Rank), max(maxWorker, slot.Worker)
	}

	recorded = make(map[int64]bool)
	rep = BackupReport{Name: backup, Nodes: opts.Nodes, Workers: opts.Workers,
		Saved: tiers.Shape{Nodes: maxRank + 1, Workers: maxWorker + 1}}
	if _, listed := index[shapeName]; listed {
		if s, ok := b.readShape(ctx, dir); ok {
			rep.Saved = s.Shape
			rep.SavedRecorded = true
			if rep.Nodes <= 0 {
				rep.Nodes = s.Nodes
			}
			if rep.Workers <= 0 {
				rep.Workers = s.Workers
			}
		}
	}
	if rep.Nodes <= 0 {
		rep.Nodes, rep.Inferred = maxRank+1, true
	}
	if rep.Workers <= 0 {
		rep.Workers, rep.Inferred = maxWorker+1, true
	}

	// Read the expected .meta objects that exist.
	type metaRead struct {
		step    int64
		slot    Slot
		hash    string // "" if the .meta vanished since the listing
		invalid bool   // the content is not a data hash
	}
	var reads []metaRead
	for step, slots := range metas {
		for slot := range slots {
			if slot.Rank < rep.Nodes && slot.Worker < rep.Workers {
				reads = append(reads, metaRead{step: step, slot: slot})
			}
		}
	}
	err = forEach(ctx, b.parallelism(), len(reads), func(ctx context.Context, i int) error {
		m := &reads[i]
		data, err := ReadSmall(ctx, b.Store, dir+metaName(job, m.step, m.slot), metaLimit)
		if IsNotFound(err) {
			return nil
		}
		if err != nil {
			return err
		}
		m.hash = strings.TrimSpace(string(data))
		m.invalid = validateHash(m.hash) != nil
		return nil
	})
	if err != nil {
		return BackupReport{}, nil, fmt.Errorf("verify backup %s: %w", dir, err)
	}
	named := make(map[int64]map[Slot]metaRead)
	var distinct []string
	seen := make(map[string]bool)
	for _, m := range reads {
		if named[m.step] == nil {
			named[m.step] = make(map[Slot]metaRead)
		}
		named[m.step][m.slot] = m
		if m.hash != "" && !m.invalid && !seen[m.hash] {
			seen[m.hash] = true
			distinct = append(distinct, m.hash)
		}
	}

	dataProblems, unknown, err := b.checkData(ctx, dir, distinct, index, opts.Deep)
	if err != nil {
		return BackupReport{}, nil, fmt.Errorf("verify backup %s: %w", dir, err)
	}

	for step := range metas {
		sr := StepReport{Step: step, Data: make(map[Slot]string)}
		reported := make(map[string]bool)
		for r := 0; r < rep.Nodes; r++ {
			for w := 0; w < rep.Workers; w++ {
				slot := Slot{r, w}
				m := named[step][slot]
				h := m.hash
				switch {
				case h == "":
					sr.Problems = append(sr.Problems, fmt.Sprintf("%s: .meta missing", slot))
				case m.invalid:
					sr.Problems = append(sr.Problems, fmt.Sprintf("%s: .meta content %.80q is not a data hash", slot, h))
					sr.Damaged, recorded[step] = true, true
				default:
					sr.Data[slot] = h
					sr.Damaged = sr.Damaged || (len(dataProblems[h]) > 0 && !unknown[h])
					if _, marked := index[damagedName(h)]; marked {
						recorded[step] = true
					}
					if !reported[h] {
						reported[h] = true
						for _, p := range dataProblems[h] {
							sr.Problems = append(sr.Problems, dataName(h)+": "+p)
						}
					}
				}
			}
		}
		sort.Strings(sr.Problems)
		sr.Complete = len(sr.Problems) == 0
		rep.Steps = append(rep.Steps, sr)
	}
	sort.Slice(rep.Steps, func(i, j int) bool { return rep.Steps[i].Step > rep.Steps[j].Step })
	return rep, recorded, nil
}

// verifyRereads is how many times a deep verify reads again an object whose bytes do not match.
const verifyRereads = 2

// checkData returns, per hash, what is wrong with its data in the backup at
// dir (no entry: complete), and the hashes whose manifest this version cannot
// read (a newer format: not damage). index holds the backup's objects by
// relative name.
func (b *Backups) checkData(ctx context.Context, dir string, hashes []string, index map[string]ObjectAttrs, deep bool) (map[string][]string, map[string]bool, error) {
	problems := make(map[string][]string)
	unknown := make(map[string]bool)
	var mu sync.Mutex // guards problems during the parallel phases
	note := func(hash, format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		problems[hash] = append(problems[hash], fmt.Sprintf(format, args...))
	}

	manifests := make([]*manifest, len(hashes))
	err := forEach(ctx, b.parallelism(), len(hashes), func(ctx context.Context, i int) error {
		h := hashes[i]
		if _, marked := index[damagedName(h)]; marked {
			why, err := ReadSmall(ctx, b.Store, dir+damagedName(h), damagedLimit)
			switch {
			case IsNotFound(err): // removed since the listing
			case err != nil && ctx.Err() != nil:
				return err
			case err != nil: // too large, say: still a record of damage
				note(h, "a record of damage (%s) that cannot be read: %v", damagedName(h), err)
			default:
				note(h, "a restore found it damaged: %s", strings.TrimSpace(string(why)))
			}
		}
		m, err := b.readManifest(ctx, dir, h)
		var nf *NotFoundError
		switch {
		case errors.As(err, &nf) && holdsObjects(index, h):
			// The data is there, its manifest never was: the plain reference layout, written by
			// another tool (the reference system; mtcfs backups export copied into a location).
			note(h, "manifest %s missing beside its data: a backup in the plain reference layout (written by another tool, or mtcfs backups export copied back) cannot be verified, and mtcfs restores only the backups it wrote", manifestName(h))
		case errors.As(err, &nf):
			note(h, "manifest %s missing", manifestName(h))
		case errors.As(err, new(*manifestError)):
			note(h, "%v", err)
			if errors.Is(err, errUnknownFormat) {
				mu.Lock()
				unknown[h] = true
				mu.Unlock()
			}
		case err != nil:
			return err
		default:
			manifests[i] = m
		}
		return nil
	})
	if err != nil {
		return nil, nil, err
	}

	// Presence, size and the store's CRC32C, from the listing alone.
	type check struct {
		hash   string
		object string
		name   string // for messages
		want   manifestFile
	}
	var reads []check
	for i, m := range manifests {
		if m == nil {
			continue
		}
		h := hashes[i]
		for _, f := range m.Files {
			switch problem := listedProblem(index, h, f, !deep); {
			case problem != "":
				note(h, "%s", problem)
			case deep:
				reads = append(reads, check{h, f.object(h), objectLabel(h, f), f})
			}
		}
	}
	if !deep {
		return problems, unknown, nil
	}

	requests := semaphore.NewWeighted(int64(b.parallelism()))
	var codecs sync.Map // chunk length → *codec
	err = forEach(ctx, b.parallelism(), len(reads), func(ctx context.Context, i int) error {
		c := reads[i]
		if c.want.compressed() {
			cd, _ := codecs.LoadOrStore(c.want.ChunkLen, newCodec(c.want.ChunkLen, 0))
			crc, err := b.readCompressed(ctx, cd.(*codec), dir+c.object, c.want, requests, nil)
			switch {
			case IsNotFound(err):
				note(c.hash, "%s missing", c.name)
			case errors.Is(err, planecodec.ErrCorrupt), errors.Is(err, io.ErrUnexpectedEOF):
				note(c.hash, "%s: %v", c.name, err)
			case err != nil:
				return err
			case crc != uint32(c.want.CRC32C):
				note(c.hash, "%s decompresses to bytes with crc32c %08x, manifest says %08x", c.name, crc, uint32(c.want.CRC32C))
			}
			return nil
		}
		// A read's result: its bytes match the manifest (ok), or how they do not.
		type result struct {
			ok      bool
			bad     *ChecksumError // the store's own check failed (GCS: the CRC32C it keeps)
			n       int64
			crc     uint32
			missing bool
		}
		read := func() (result, error) {
			r, err := b.Store.Open(ctx, dir+c.object, 0, -1)
			if IsNotFound(err) {
				return result{missing: true}, nil
			}
			if err != nil {
				return result{}, err
			}
			defer r.Close()
			n, crc, err := copyCRC(ctx, io.Discard, r)
			if ce := (*ChecksumError)(nil); errors.As(err, &ce) {
				return result{bad: ce}, nil
			}
			if err != nil {
				return result{}, fmt.Errorf("read %s: %w", c.name, err)
			}
			return result{ok: n == c.want.Size && crc == uint32(c.want.CRC32C), n: n, crc: crc}, nil
		}
		first, err := read()
		if err != nil || first.ok {
			return err
		}
		if first.missing {
			note(c.hash, "%s missing", c.name)
			return nil
		}
		// Read again: bytes damaged on the way (a proxy, the network) differ from one read to
		// the next, or come right; damage in the store reads the same every time. Reported as
		// damage, a fault in transit made `verify` call an intact backup DAMAGED (a black-box
		// run).
		for range verifyRereads {
			again, err := read()
			switch {
			case err != nil || again.ok:
				return err
			case again.missing || (again.bad == nil) != (first.bad == nil) || again.crc != first.crc ||
				again.bad != nil && first.bad != nil && again.bad.Got != first.bad.Got:
				return fmt.Errorf("read %s: its bytes differ from one read to the next (damaged on the way, not in the store, or changed meanwhile): verify again later", c.name)
			}
		}
		if first.bad != nil {
			note(c.hash, "%s: its bytes no longer match the crc32c the store keeps (%v)", c.name, first.bad)
			return nil
		}
		note(c.hash, "%s content (%d bytes, crc32c %08x) differs from the manifest (%d bytes, crc32c %08x)",
			c.name, first.n, first.crc, c.want.Size, uint32(c.want.CRC32C))
		return nil
	})
	return problems, unknown, err
}

// objectLabel names file f of hash's data in messages: its object, and the file's path when the
// object's name does not show it.
func objectLabel(hash string, f manifestFile) string {
	if f.Object != "" {
		return fmt.Sprintf("%s (file %.80q)", f.object(hash), f.Path)
	}
	return f.object(hash)
}

// listedProblem says what a listing of the backup (index: its objects by name relative to the
// backup) shows wrong with file f of hash's data: missing, another size, or, with crc, another
// CRC32C than the manifest's; "" when nothing.
func listedProblem(index map[string]ObjectAttrs, hash string, f manifestFile, crc bool) string {
	a, ok := index[f.object(hash)]
	switch {
	case !ok:
		return objectLabel(hash, f) + " missing"
	case a.Size != f.storedSize():
		return fmt.Sprintf("%s has %d bytes, manifest says %d", objectLabel(hash, f), a.Size, f.storedSize())
	case crc && a.CRC32C != f.storedCRC():
		return fmt.Sprintf("%s has crc32c %08x, manifest says %08x", objectLabel(hash, f), a.CRC32C, f.storedCRC())
	}
	return ""
}

// manifestError marks a manifest that exists but cannot be used: a property
// of the backup to report, not a failure to reach the store.
type manifestError struct{ err error }

func (e *manifestError) Error() string { return e.err.Error() }
func (e *manifestError) Unwrap() error { return e.err }

// readManifest reads and checks the manifest of hash in the backup at dir.
func (b *Backups) readManifest(ctx context.Context, dir, hash string) (*manifest, error) {
	// Manifests list every file: allow for a few hundred thousand entries.
	data, err := ReadSmall(ctx, b.Store, dir+manifestName(hash), 64<<20)
	if err != nil {
		return nil, err
	}
	m, err := decodeManifest(data, hash)
	if err != nil {
		return nil, &manifestError{err}
	}
	return m, nil
}

// NewestComplete chooses the backup to restore when nothing newer is
// available (SPEC §5.3): the newest backup that has a complete step for
// nodes×workers slots (0 infers, see VerifyOptions), and its highest complete
// step. A step missing any slot's .meta or data is never chosen.
func (b *Backups) NewestComplete(ctx context.Context, job string, nodes, workers int) (backup string, step int64, ok bool, err error) {
	names, err := b.Names(ctx, job)
	if err != nil {
		return "", 0, false, err
	}
	for _, name := range names {
		r, err := b.Verify(ctx, job, name, VerifyOptions{Nodes: nodes, Workers: workers})
		if IsNotFound(err) {
			continue
		}
		if err != nil {
			return "", 0, false, err
		}
		if s, ok := r.HighestComplete(); ok {
			return name, s, true, nil
		}
	}
	return "", 0, false, nil
}

// ReadRestoreVersion returns the backup name pinned in <job>/restore.version
// (SPEC §5.1), whitespace-stripped, and whether the pin exists. An existing
// pin may name nothing usable (even ""); the caller then starts from scratch.
func (b *Backups) ReadRestoreVersion(ctx context.Context, job string) (string, bool, error) {
	if err := validateJob(job); err != nil {
		return "", false, err
	}
	data, err := ReadSmall(ctx, b.Store, job+"/"+restoreVersionName, pinLimit)
	if IsNotFound(err) {
		return "", false, nil
	}
	if err != nil {
		return "", false, fmt.Errorf("read restore pin of %s: %w", job, err)
	}
	return strings.TrimSpace(string(data)), true, nil
}

// SetRestoreVersion pins job's next restore to backup. It writes what the
// documented `echo NAME | gcloud storage cp - …/restore.version` writes.
func (b *Backups) SetRestoreVersion(ctx context.Context, job, backup string) error {
	if err := validateJob(job); err != nil {
		return err
	}
	if err := validateBackupName(backup); err != nil {
		return err
	}
	if err := PutBytes(ctx, b.Store, job+"/"+restoreVersionName, []byte(backup+"\n"), false); err != nil {
		if pin, pinned, rerr := b.readBack(ctx, job); rerr == nil && pinned && pin == backup {
			slog.Warn("the backup location's answer to the restore pin was lost, but the pin is written", "job", job, "backup", backup, "err", err)
			return nil
		}
		return fmt.Errorf("set restore pin of %s: %w", job, err)
	}
	return nil
}

// readBack reads job's restore pin once more after a change whose answers were all lost: a
// write that went through, its every answer lost (the connection reset after the request),
// took effect, and `mtcfs restore-version` said it failed, exit 1 (a black-box run: an
// operator told "failed" does not clear a pin that is there). Not once ctx is done (a Ctrl-C,
// a --timeout: the command must end now).
func (b *Backups) readBack(ctx context.Context, job string) (pin string, pinned bool, err error) {
	if err := ctx.Err(); err != nil {
		return "", false, err
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	return b.ReadRestoreVersion(ctx, job)
}

// ClearRestoreVersion removes job's restore pin; no pin is not an error.
func (b *Backups) ClearRestoreVersion(ctx context.Context, job string) error {
	if err := validateJob(job); err != nil {
		return err
	}
	err := b.Store.Delete(ctx, job+"/"+restoreVersionName)
	if err != nil && !IsNotFound(err) {
		if _, pinned, rerr := b.readBack(ctx, job); rerr == nil && !pinned {
			slog.Warn("the backup location's answer to the removal of the restore pin was lost, but the pin is gone", "job", job, "err", err)
			return nil
		}
		return fmt.Errorf("clear restore pin of %s: %w", job, err)
	}
	return nil
}

// holdsObjects reports whether the listing index holds hash's data: the object <hash>.data or
// objects below <hash>.data/.
func holdsObjects(index map[string]ObjectAttrs, hash string) bool {
	if _, ok := index[dataName(hash)]; ok {
		return true
	}
	prefix := dataName(hash) + "/"
	for name := range index {
		if strings.HasPrefix(name, prefix) {
			return true
		}
	}
	return false
}
