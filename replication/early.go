package replication

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/replication/peerpb"
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
// step was abandoned), when a push from another incarnation of the same sender rank arrives (the
// job restarted), after earlyIdle without activity (checked every earlyIdle/4), and when the
// receiver closes. Its bytes stay charged to ReceiverConfig.Reserve while it is held; the files a
// consuming push takes move to that push's charge (adoptEarly), refunded when the push fails or
// is accepted (the accepted data is accounted for by whoever Accept handed it to).

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
	files       map[layout.FileDigest]earlyFile
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

// rankKey names one sender: a rank of a job.
type rankKey struct {
	job  string
	rank int
}

// noteIncarnation drops the early groups of from's rank that another incarnation pushed, when a
// push shows that rank's incarnation changed (the job restarted; the old incarnation's pushes
// were cancelled with it, Drop too). Only pushes and drops count: a late Abandon, sent on a
// context that outlives its incarnation, must not drop the new one's groups.
func (r *Receiver) noteIncarnation(from Identity) {
	key := rankKey{from.Job, from.Rank}
	r.mu.Lock()
	if r.lastInc[key] == from.Incarnation {
		r.mu.Unlock()
		return
	}
	r.lastInc[key] = from.Incarnation
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

// expireEarly drops groups idle for earlyIdle and runs again in earlyIdle/4, until Close.
func (r *Receiver) expireEarly() {
	now := time.Now()
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return
	}
	var drop []*earlyGroup
	for k, g := range r.early {
		if now.Sub(g.touched) > earlyIdle {
			drop = append(drop, g)
			delete(r.early, k)
		}
	}
	r.expiry.Reset(earlyIdle / 4)
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
	d := layout.FileDigest(f.Blake3)
	dst := filepath.Join(r.cfg.Dir, earlyDirName, t.id)
	if err := os.Rename(t.sink.root, dst); err != nil {
		return err
	}
	k := earlyKey{t.from.Job, t.from.Rank, group}
	r.mu.Lock()
	g := r.early[k]
	var stale *earlyGroup
	if g != nil && g.incarnation != t.from.Incarnation {
		stale, g = g, nil
	}
	if g == nil {
		g = &earlyGroup{incarnation: t.from.Incarnation, files: map[layout.FileDigest]earlyFile{}}
		r.early[k] = g
	}
	g.touched = time.Now()
	_, dup := g.files[d]
	if !dup {
		g.files[d] = earlyFile{path: dst, size: f.Size}
		g.bytes += f.Size
	}
	r.mu.Unlock()
	if stale != nil {
		r.freeEarly([]*earlyGroup{stale}, "replaced by another incarnation's")
	}
	if dup { // the same content pushed twice (a file rewritten identically): keep one
		os.Remove(dst)
		if r.cfg.Reserve != nil {
			r.cfg.Reserve(-f.Size)
		}
	}
	return nil
}

// adoptEarly links the presumed files of a new transfer t from its group into the sink, or
// returns NOT_FOUND when one is missing. The files it takes leave the group, and their bytes
// move from the group's charge to t's (t.reserved, t.early): one owner each, so whatever
// happens next — the group dropped, t discarded or accepted — every byte is refunded or kept
// exactly once.
func (r *Receiver) adoptEarly(t *transfer, h *peerpb.PushHeader, s *sink) error {
	m := t.m
	k := earlyKey{t.from.Job, t.from.Rank, h.ConsumesGroup}
	r.mu.Lock()
	g := r.early[k]
	if g == nil || g.incarnation != t.from.Incarnation {
		g = nil
	}
	for _, i := range h.Presumed {
		f := m.pb.Files[i]
		var ef earlyFile
		ok := false
		if g != nil {
			ef, ok = g.files[layout.FileDigest(f.Blake3)]
		}
		if !ok || ef.size != f.Size {
			r.mu.Unlock()
			return errNotFound("%s: %q was not pushed early in group %q (or was dropped)", m.pb.DataName, f.Path, h.ConsumesGroup)
		}
	}
	paths := make([]string, len(h.Presumed))
	taken := map[layout.FileDigest]string{} // files with the same content share one early file
	for j, i := range h.Presumed {
		d := layout.FileDigest(m.pb.Files[i].Blake3)
		if p, ok := taken[d]; ok {
			paths[j] = p
			continue
		}
		ef := g.files[d]
		delete(g.files, d)
		g.bytes -= ef.size
		t.reserved += ef.size
		r.inFlight += ef.size
		t.early = append(t.early, ef.path)
		taken[d], paths[j] = ef.path, ef.path
	}
	g.touched = time.Now()
	r.mu.Unlock()
	for j, i := range h.Presumed {
		if err := s.adopt(int(i), paths[j], layout.FileDigest(m.pb.Files[i].Blake3)); err != nil {
			return fmt.Errorf("%s: link early file %q: %w", m.pb.DataName, m.pb.Files[i].Path, err)
		}
	}
	return nil
}

// consumeEarly releases what is left of the group an accepted transfer consumed (files it did
// not use: rewritten before the commit), refunding their bytes.
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
	r.noteIncarnation(from)
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
