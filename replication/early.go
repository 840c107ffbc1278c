package replication

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/mtcfs/mtcfs/replication/peerpb"
	"github.com/mtcfs/mtcfs/tiers"
)

// Early files: a file the job closed inside a step directory before the step committed is pushed
// at once, as single-file data with PushHeader.early_group set to the step directory's top-level
// name. The receiver verifies it like any transfer but publishes nothing: it keeps the file
// aside (earlyDir) under (job, sender rank, group). When the step commits, the sender pushes the
// sealed tree with consumes_group = the group and presumed = the files the receiver already
// acknowledged; the receiver hard-links those into the transfer instead of receiving them, so
// the bytes on the wire after the commit are only what was not pushed early. The transfer is
// verified as a whole as before (the linked files' digests are known: they were verified when
// they arrived and nothing writes them since).
//
// An early group goes away when a push consuming it is accepted, when the sender drops it (its
// step was abandoned), when a call from another incarnation of the same sender rank arrives (the
// job restarted), after earlyIdle without activity, and when the receiver closes. Its bytes stay
// charged to ReceiverConfig.Reserve while it is held; the files a consuming push took over stay
// charged, now to the accepted data.

// earlyDirName is the directory in ReceiverConfig.Dir holding early files.
const earlyDirName = "early"

// earlyIdle drops an early group nothing touched for this long.
const earlyIdle = 10 * time.Minute

// maxGroupLen bounds an early group name (a top-level name in the sender's namespace).
const maxGroupLen = 255

type earlyKey struct {
	job   string
	rank  int
	group string
}

type earlyGroup struct {
	incarnation string
	files       map[tiers.FileDigest]earlyFile
	bytes       int64
	touched     time.Time
}

type earlyFile struct {
	path string
	size int64
}

func checkGroup(g string) error {
	if g == "" || len(g) > maxGroupLen || strings.ContainsAny(g, "/\x00") || g == "." || g == ".." {
		return errInvalid("early group %q: want one path element of at most %d bytes", g, maxGroupLen)
	}
	return nil
}

// noteIncarnation drops the early groups of from's rank that an earlier incarnation pushed.
func (r *Receiver) noteIncarnation(from Identity) {
	r.mu.Lock()
	var drop []*earlyGroup
	for k, g := range r.early {
		if k.job == from.Job && k.rank == from.Rank && g.incarnation != from.Incarnation {
			drop = append(drop, g)
			delete(r.early, k)
		}
	}
	r.mu.Unlock()
	r.freeEarly(drop, "the sender's job restarted")
}

// expireEarly drops groups idle for earlyIdle. It runs on every early push.
func (r *Receiver) expireEarly(now time.Time) {
	r.mu.Lock()
	var drop []*earlyGroup
	for k, g := range r.early {
		if now.Sub(g.touched) > earlyIdle {
			drop = append(drop, g)
			delete(r.early, k)
		}
	}
	r.mu.Unlock()
	r.freeEarly(drop, "idle")
}

// freeEarly removes dropped groups' files and refunds their bytes.
func (r *Receiver) freeEarly(groups []*earlyGroup, why string) {
	for _, g := range groups {
		for _, f := range g.files {
			os.Remove(f.path)
		}
		if r.cfg.Reserve != nil {
			r.cfg.Reserve(-g.bytes)
		}
		r.log.Debug("early files dropped", "files", len(g.files), "bytes", g.bytes, "why", why)
	}
}

// keepEarly takes a verified early transfer: its file moves to earlyDir under its group.
func (r *Receiver) keepEarly(t *transfer, group string) error {
	f := t.m.pb.Files[0]
	d := tiers.FileDigest(f.Blake3)
	dst := filepath.Join(r.cfg.Dir, earlyDirName, t.id)
	if err := os.Rename(t.sink.root, dst); err != nil {
		return err
	}
	k := earlyKey{t.from.Job, t.from.Rank, group}
	r.mu.Lock()
	g := r.early[k]
	if g == nil {
		g = &earlyGroup{incarnation: t.from.Incarnation, files: map[tiers.FileDigest]earlyFile{}}
		r.early[k] = g
	}
	g.touched = time.Now()
	_, dup := g.files[d]
	if !dup {
		g.files[d] = earlyFile{path: dst, size: f.Size}
		g.bytes += f.Size
	}
	r.mu.Unlock()
	if dup { // the same content pushed twice (a file rewritten identically): keep one
		os.Remove(dst)
		if r.cfg.Reserve != nil {
			r.cfg.Reserve(-f.Size)
		}
	}
	return nil
}

// adoptEarly links the presumed files of a new transfer from its group into the sink. It
// returns the bytes the transfer does not need to reserve, or NOT_FOUND when a file is missing.
func (r *Receiver) adoptEarly(from Identity, h *peerpb.PushHeader, m *manifest, s *sink) error {
	k := earlyKey{from.Job, from.Rank, h.ConsumesGroup}
	r.mu.Lock()
	g := r.early[k]
	paths := make([]string, len(h.Presumed))
	var missing string
	for j, i := range h.Presumed {
		f := m.pb.Files[i]
		var ef earlyFile
		ok := false
		if g != nil && g.incarnation == from.Incarnation {
			ef, ok = g.files[tiers.FileDigest(f.Blake3)]
		}
		if !ok || ef.size != f.Size {
			missing = f.Path
			break
		}
		paths[j] = ef.path
	}
	if g != nil {
		g.touched = time.Now()
	}
	r.mu.Unlock()
	if missing != "" {
		return errNotFound("%s: %q was not pushed early in group %q (or was dropped)", m.pb.DataName, missing, h.ConsumesGroup)
	}
	for j, i := range h.Presumed {
		if err := s.adopt(int(i), paths[j], tiers.FileDigest(m.pb.Files[i].Blake3)); err != nil {
			if errors.Is(err, os.ErrNotExist) { // dropped meanwhile
				return errNotFound("%s: early file %q was dropped", m.pb.DataName, m.pb.Files[i].Path)
			}
			return fmt.Errorf("%s: link early file %q: %w", m.pb.DataName, m.pb.Files[i].Path, err)
		}
	}
	return nil
}

// consumeEarly releases the group an accepted transfer consumed. The files it linked stay
// charged (the accepted data owns them now); the others are refunded.
func (r *Receiver) consumeEarly(t *transfer, group string) {
	k := earlyKey{t.from.Job, t.from.Rank, group}
	r.mu.Lock()
	g := r.early[k]
	if g == nil || g.incarnation != t.from.Incarnation {
		r.mu.Unlock()
		return
	}
	delete(r.early, k)
	r.mu.Unlock()
	var kept int64
	for _, i := range t.presumed {
		d := tiers.FileDigest(t.m.pb.Files[i].Blake3)
		if f, ok := g.files[d]; ok {
			kept += f.size
			os.Remove(f.path)  // the accepted data holds its own link
			delete(g.files, d) // not refunded
		}
	}
	g.bytes -= kept
	r.freeEarly([]*earlyGroup{g}, "consumed")
}

// Drop discards one of the caller's early groups.
func (r *Receiver) Drop(ctx context.Context, req *peerpb.DropRequest) (*peerpb.DropReply, error) {
	from, err := r.authenticate(ctx)
	if err != nil {
		return nil, err
	}
	if err := checkGroup(req.Group); err != nil {
		return nil, err
	}
	k := earlyKey{from.Job, from.Rank, req.Group}
	r.mu.Lock()
	g := r.early[k]
	delete(r.early, k)
	r.mu.Unlock()
	if g != nil {
		r.freeEarly([]*earlyGroup{g}, "dropped by the sender")
		r.log.Info("early files dropped", "job", from.Job, "rank", from.Rank, "group", req.Group, "files", len(g.files), "bytes", g.bytes)
	}
	return &peerpb.DropReply{}, nil
}
