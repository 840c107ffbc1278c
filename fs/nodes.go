package fs

import (
	"context"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/tiers"
)

// mtfs is what all nodes of one mount share.
type mtfs struct {
	spool       *tiers.Spool
	passthrough atomic.Bool  // use FUSE passthrough for regular files; set after the mount is live
	events      tiers.Events // nil: nobody listens
	nextIno     atomic.Uint64
	parked      sync.Map // request cancel channel -> event to emit when the request succeeded
	log         *slog.Logger
	xattrs      bool // extended attributes served (Options.Xattrs): Seal counts the entries having some
	// agentOwner is the owner (uid<<32 | gid) of the files and symlinks the agent makes at the
	// top (markers, reports, .meta): the job's user (namespace.OwnAgentFiles), root until a job
	// that runs as another user wrote its replicator.yaml. In a sticky mount root (--mode 1777)
	// only an entry's owner may rename or remove it: the job's rename of its restore marker
	// failed with EPERM when the marker was root's (black-box h57: every restore failed).
	agentOwner atomic.Uint64
	// controlMu orders writable opens of control files (shared) with the handshake's
	// version-checked removal of replicator.yaml (RemoveControl, exclusive).
	controlMu sync.RWMutex
	// sealedTop holds the top-level names of committed checkpoints (the trees Seal and Import
	// made) and of the .meta files the agent writes: the job can neither remove, rename nor
	// replace them.
	sealedTop sync.Map // name -> struct{}

	// mountDir is the mount's path; freedData the data names the agent removed from the top
	// lately, and when (mappedFreed).
	mountDir  string
	freedMu   sync.Mutex
	freedData map[string]time.Time // GUARDED_BY(freedMu)

	// Files whose last name is gone while handles remain, and the RELEASE requests running;
	// see space.go.
	relMu     sync.Mutex
	doomed    map[*fileNode]doomState // GUARDED_BY(relMu)
	ndoomed   atomic.Int32            // len(doomed), read without relMu
	nheld     atomic.Int32            // files whose bytes wait for the kernel's FORGET (fileNode.kernelHeld)
	heldBytes atomic.Int64            // their blocks (fileNode.heldBytes)
	waits     atomic.Int64            // waits for doomed files that found some (space.go; for tests)
	relCh     chan struct{}           // closed when a doomed file was freed; GUARDED_BY(relMu)
	releasing atomic.Int32            // RELEASE requests running, and cancelled holds not ended yet
	freedGen  atomic.Uint64           // counts doomed files freed
	// parkedRelease maps a RELEASE's cancel channel to a func to run once it is done.
	parkedRelease sync.Map
	// notifier sends the namespace's invalidations of top-level names and the write-back of
	// mapped pages (nil: go-fuse's calls do); set once the mount is live.
	notifier atomic.Pointer[kernelNotifier]
	// writersMu guards writing: the files with handles that may write (fileNode.writers > 0),
	// whose pages a job may have dirtied through a shared mapping (see writeBackUnder).
	writersMu sync.Mutex
	writing   map[*fileNode]struct{} // GUARDED_BY(writersMu)
	// lossy holds the files some of whose mapped pages the agent could not store when the
	// kernel wrote them back, with the errno (see writeBackUnder). GUARDED_BY(writersMu)
	lossy map[*fileNode]syscall.Errno
	// pageWrites holds the cancel channels of the WRITE requests running that write back pages
	// of the kernel's page cache (eventFS.Write).
	pageWrites sync.Map
	// fdsReported is when reportOutOfFDs last logged (UnixNano; 0: never).
	fdsReported atomic.Int64
	// reportMu orders the agent's versioned rewrites of report files with the job's unlinks of
	// them (reports.go); held for tree changes only, never across a kernel notification.
	reportMu      sync.Mutex
	nextReportVer atomic.Uint64
}

// lookupHook, when set (tests only), runs at the start of every LOOKUP the mount serves, with
// the name looked up: a test stalls one to hold the directory's lock in the kernel.
var lookupHook atomic.Pointer[func(name string)]

// writeHook, when set (tests only), runs in every WRITE the fallback data path serves, after its
// checks and before it stores the bytes, with the file's path: a test stalls one to hold a
// write-back in the kernel, or a write that a commit's copy must wait for.
var writeHook atomic.Pointer[func(path string)]

// releaseHook, when set (tests only), runs before a RELEASE request is counted as running: a
// test delays it as the scheduler of a loaded machine delays a request go-fuse has read.
var releaseHook atomic.Pointer[func()]

func (m *mtfs) isSealedTop(name string) bool {
	_, ok := m.sealedTop.Load(name)
	return ok
}

func (m *mtfs) newIno() uint64 { return m.nextIno.Add(1) }

// meta holds what every node type keeps in memory: ownership, permission bits, times (files
// take size and data times from their spool file instead) and extended attributes.
type meta struct {
	mu    sync.Mutex
	mode  uint32 // permission bits only; GUARDED_BY(mu)
	uid   uint32 // GUARDED_BY(mu)
	gid   uint32 // GUARDED_BY(mu)
	atime time.Time
	mtime time.Time
	ctime time.Time
	xattr map[string][]byte // GUARDED_BY(mu)
	// frozen marks a node of a committed checkpoint (see Namespace.Seal): its bytes, attributes
	// and (for a directory) entries are immutable to the job; only the agent changes them.
	frozen atomic.Bool
}

// nameMax is NAME_MAX, the longest name statfs reports and the kernel lets through to us only
// up to 1024 bytes (FUSE_NAME_MAX): longer names must fail here, before anything is created.
const nameMax = 255

// checkName refuses names longer than nameMax.
func checkName(name string) syscall.Errno {
	if len(name) > nameMax {
		return syscall.ENAMETOOLONG
	}
	return 0
}

func (m *meta) isFrozen() bool { return m.frozen.Load() }

// attr returns the owner and permission bits, as a checkpoint's layout.Attrs record them.
func (m *meta) attr() layout.Attr {
	m.mu.Lock()
	defer m.mu.Unlock()
	return layout.Attr{Mode: m.mode, UID: m.uid, GID: m.gid}
}

// setUID gives the node the owner uid (see Namespace.Reown), and reports whether it changed.
func (m *meta) setUID(uid uint32) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	was := m.uid
	m.uid = uid
	return was != uid
}

// setAttr gives a node being imported the owner and permission bits its checkpoint was saved
// with (a symlink keeps its mode: 0777).
func (m *meta) setAttr(a layout.Attr, symlink bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.uid, m.gid = a.UID, a.GID
	if !symlink {
		m.mode = a.Mode & 0o7777
	}
}

// init sets up a new node's meta: owned by the caller, all times now.
func (m *meta) init(ctx context.Context, mode uint32) {
	now := time.Now()
	m.mode, m.atime, m.mtime, m.ctime = mode&07777, now, now, now
	if c, ok := fuse.FromContext(ctx); ok {
		m.uid, m.gid = c.Uid, c.Gid
	}
}

// fill copies ownership, mode and times into out. Caller holds mu.
func (m *meta) fill(out *fuse.Attr) {
	out.Mode = m.mode
	out.Uid, out.Gid = m.uid, m.gid
	out.SetTimes(&m.atime, &m.mtime, &m.ctime)
}

// setattr applies mode, owner and times from in. Caller holds mu.
func (m *meta) setattr(in *fuse.SetAttrIn) {
	now := time.Now()
	if mode, ok := in.GetMode(); ok {
		m.mode = mode & 07777
	}
	if uid, ok := in.GetUID(); ok {
		m.uid = uid
	}
	if gid, ok := in.GetGID(); ok {
		m.gid = gid
	}
	if t, ok := in.GetATime(); ok {
		m.atime = t
	}
	if t, ok := in.GetMTime(); ok {
		m.mtime = t
	}
	m.ctime = now
}

func (m *meta) touch(mtime bool) {
	m.mu.Lock()
	now := time.Now()
	if mtime {
		m.mtime = now
	}
	m.ctime = now
	m.mu.Unlock()
}

// maxXattrValue bounds one extended attribute, as Linux does.
const maxXattrValue = 64 << 10

func (m *meta) Getxattr(ctx context.Context, attr string, dest []byte) (uint32, syscall.Errno) {
	m.mu.Lock()
	defer m.mu.Unlock()
	v, ok := m.xattr[attr]
	if !ok {
		return 0, gofs.ENOATTR
	}
	if len(dest) < len(v) {
		return uint32(len(v)), syscall.ERANGE
	}
	return uint32(copy(dest, v)), 0
}

func (m *meta) Setxattr(ctx context.Context, attr string, data []byte, flags uint32) syscall.Errno {
	if m.isFrozen() {
		return syscall.EROFS
	}
	if strings.HasPrefix(attr, "system.posix_acl_") {
		// The kernel enforces POSIX ACLs only for a FUSE server that asks it to (FUSE_POSIX_ACL),
		// and mtcfs does not: stored, an ACL denying a user was shown by getfacl and ignored
		// (black-box h57). Refused as by a file system without ACLs (setfacl says so).
		return syscall.EOPNOTSUPP
	}
	if len(data) > maxXattrValue {
		return syscall.E2BIG
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	_, exists := m.xattr[attr]
	if flags&unix.XATTR_CREATE != 0 && exists {
		return syscall.EEXIST
	}
	if flags&unix.XATTR_REPLACE != 0 && !exists {
		return gofs.ENOATTR
	}
	if m.xattr == nil {
		m.xattr = map[string][]byte{}
	}
	m.xattr[attr] = append([]byte(nil), data...)
	m.ctime = time.Now()
	return 0
}

// hasXattrs reports whether the node has extended attributes (checkpoints do not keep them).
func (m *meta) hasXattrs() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.xattr) > 0
}

func (m *meta) Removexattr(ctx context.Context, attr string) syscall.Errno {
	if m.isFrozen() {
		return syscall.EROFS
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.xattr[attr]; !ok {
		return gofs.ENOATTR
	}
	delete(m.xattr, attr)
	m.ctime = time.Now()
	return 0
}

func (m *meta) Listxattr(ctx context.Context, dest []byte) (uint32, syscall.Errno) {
	m.mu.Lock()
	defer m.mu.Unlock()
	names := make([]string, 0, len(m.xattr))
	for k := range m.xattr {
		names = append(names, k)
	}
	sort.Strings(names)
	var buf []byte
	for _, k := range names {
		buf = append(append(buf, k...), 0)
	}
	if len(dest) < len(buf) {
		return uint32(len(buf)), syscall.ERANGE
	}
	return uint32(copy(dest, buf)), 0
}

// ---------------------------------------------------------------------------------------------
// Directories

type dirNode struct {
	gofs.Inode
	meta
	fs      *mtfs
	removed bool // GUARDED_BY(mu)
	// subdirs counts child directories, for nlink: the kernel asks for the attributes of a
	// directory before every lookup in it (permission check), so Getattr must not walk it.
	subdirs atomic.Int64
}

var (
	_ = (gofs.NodeLookuper)((*dirNode)(nil))
	_ = (gofs.NodeGetattrer)((*dirNode)(nil))
	_ = (gofs.NodeSetattrer)((*dirNode)(nil))
	_ = (gofs.NodeCreater)((*dirNode)(nil))
	_ = (gofs.NodeMkdirer)((*dirNode)(nil))
	_ = (gofs.NodeMknoder)((*dirNode)(nil))
	_ = (gofs.NodeSymlinker)((*dirNode)(nil))
	_ = (gofs.NodeLinker)((*dirNode)(nil))
	_ = (gofs.NodeUnlinker)((*dirNode)(nil))
	_ = (gofs.NodeRmdirer)((*dirNode)(nil))
	_ = (gofs.NodeRenamer)((*dirNode)(nil))
	_ = (gofs.NodeStatfser)((*dirNode)(nil))
	_ = (gofs.NodeGetxattrer)((*dirNode)(nil))
	_ = (gofs.NodeSetxattrer)((*dirNode)(nil))
	_ = (gofs.NodeRemovexattrer)((*dirNode)(nil))
	_ = (gofs.NodeListxattrer)((*dirNode)(nil))
	_ = (gofs.NodeFsyncer)((*dirNode)(nil))
)

// Fsync of a directory has nothing to write: the namespace lives in memory.
func (d *dirNode) Fsync(ctx context.Context, f gofs.FileHandle, flags uint32) syscall.Errno { return 0 }

// inherit applies a set-group-ID parent's group (and, to directories, the bit) to a new node.
func (d *dirNode) inherit(m *meta, dir bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.mode&syscall.S_ISGID == 0 {
		return
	}
	m.gid = d.gid
	if dir {
		m.mode |= syscall.S_ISGID
	}
}

func (d *dirNode) Getattr(ctx context.Context, fh gofs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	subdirs := d.subdirs.Load()
	d.mu.Lock()
	d.fill(&out.Attr)
	removed := d.removed
	d.mu.Unlock()
	out.Nlink = uint32(2 + subdirs)
	if removed {
		out.Nlink = 0
	}
	out.Size = 4096
	out.Blocks = 8
	out.Blksize = 4096
	return 0
}

// Lookup finds a child; it is where names longer than NAME_MAX are refused, as tmpfs does.
func (d *dirNode) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	if errno := checkName(name); errno != 0 {
		return nil, errno
	}
	if h := lookupHook.Load(); h != nil {
		(*h)(name)
	}
	ch := d.GetChild(name)
	if ch == nil {
		return nil, syscall.ENOENT
	}
	if h := lookedUpHook.Load(); h != nil {
		(*h)(name)
	}
	return ch, d.fillEntry(ctx, ch, out)
}

// lookedUpHook, when set (tests only), runs in every LOOKUP that found its name, after it took
// the node: a test replaces the name meanwhile.
var lookedUpHook atomic.Pointer[func(name string)]

// checkNew vets a name the job is about to create in d.
func (d *dirNode) checkNew(name string) syscall.Errno {
	if errno := checkName(name); errno != 0 {
		return errno
	}
	if d.isFrozen() {
		return syscall.EROFS
	}
	if d.GetChild(name) != nil {
		return syscall.EEXIST
	}
	return 0
}

// checkRemove vets removing (or replacing, or renaming away) the entry name of d: nothing inside
// a committed checkpoint, nor a committed checkpoint at the top, may go.
func (d *dirNode) checkRemove(name string) syscall.Errno {
	if d.isFrozen() || (d.IsRoot() && d.fs.isSealedTop(name)) {
		return syscall.EROFS
	}
	return 0
}

func (d *dirNode) Setattr(ctx context.Context, fh gofs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	if _, ok := in.GetSize(); ok {
		return syscall.EISDIR
	}
	if d.isFrozen() {
		return syscall.EROFS
	}
	d.mu.Lock()
	d.setattr(in)
	d.mu.Unlock()
	return d.Getattr(ctx, fh, out)
}

func (d *dirNode) Statfs(ctx context.Context, out *fuse.StatfsOut) syscall.Errno {
	d.fs.awaitForgets() // space.go: df right after rm shows the room, as on tmpfs
	total, used := d.fs.spool.Usage()
	const bsize = 4096
	out.Bsize = bsize
	out.Frsize = bsize
	out.Blocks = uint64(total) / bsize
	free := uint64(0)
	if used < total {
		free = uint64(total-used) / bsize
	}
	out.Bfree, out.Bavail = free, free
	out.Files = 1 << 30
	out.Ffree = out.Files - d.fs.nextIno.Load()
	out.NameLen = 255
	return 0
}

func (d *dirNode) newDir(ctx context.Context, mode uint32) *gofs.Inode {
	nd := &dirNode{fs: d.fs}
	nd.init(ctx, mode)
	d.inherit(&nd.meta, true)
	return d.NewPersistentInode(ctx, nd, gofs.StableAttr{Mode: syscall.S_IFDIR, Ino: d.fs.newIno()})
}

func (d *dirNode) Mkdir(ctx context.Context, name string, mode uint32, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	if errno := d.checkNew(name); errno != 0 {
		return nil, errno
	}
	ch := d.newDir(ctx, mode)
	d.subdirs.Add(1)
	d.touch(true)
	d.created(ctx, name, layout.EntryDir)
	return ch, d.fillEntry(ctx, ch, out)
}

// created tells the listener about a name the job made whole at the top (mkdir, symlink, mknod,
// link): it may be a control file of the wrong type, or a pytorch .save linked into place. The
// event is parked until go-fuse has added the new entry to the root (eventFS), so that a
// listener removing it at once finds it there.
func (d *dirNode) created(ctx context.Context, name string, typ layout.EntryType) {
	if d.IsRoot() && d.fs.events != nil {
		d.fs.park(ctx, func() { d.fs.events.Created(name, typ) })
	}
}

// fillEntry fills out.Attr from the new child.
func (d *dirNode) fillEntry(ctx context.Context, ch *gofs.Inode, out *fuse.EntryOut) syscall.Errno {
	var a fuse.AttrOut
	if errno := ch.Operations().(gofs.NodeGetattrer).Getattr(ctx, nil, &a); errno != 0 {
		return errno
	}
	out.Attr = a.Attr
	return 0
}

func (d *dirNode) Create(ctx context.Context, name string, flags uint32, mode uint32, out *fuse.EntryOut) (*gofs.Inode, gofs.FileHandle, uint32, syscall.Errno) {
	if errno := d.checkNew(name); errno != 0 {
		return nil, nil, 0, errno
	}
	d.fs.awaitReleases(nil) // space.go
	fn, fd, err := d.newFile(ctx, name, mode)
	if err != nil {
		return nil, nil, 0, d.fs.toErrno("create", err)
	}
	ch := d.NewPersistentInode(ctx, fn, gofs.StableAttr{Mode: syscall.S_IFREG, Ino: d.fs.newIno()})
	fn.mu.Lock()
	fh, fflags, errno := fn.openFd(ctx, fd, flags, closeCommitName(d.IsRoot(), name))
	fn.mu.Unlock()
	if errno != 0 {
		fn.dropLink()
		return nil, nil, 0, errno
	}
	d.touch(true)
	// The new handle's descriptor gives the attributes without walking the spool path.
	var a fuse.AttrOut
	if errno := fn.Getattr(ctx, fh, &a); errno != 0 {
		return nil, nil, 0, errno
	}
	out.Attr = a.Attr
	return ch, fh, fflags, 0
}

// Mknod creates regular files (what mknod(2) with S_IFREG and some copy tools do), FIFOs,
// sockets (bind(2) of a unix socket) and device nodes, as tmpfs does. The kernel checks
// CAP_MKNOD for devices; an agent that could not create one in its spool (not root) refuses
// them, so that a checkpoint never holds an entry it cannot seal.
func (d *dirNode) Mknod(ctx context.Context, name string, mode uint32, dev uint32, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	if errno := d.checkNew(name); errno != 0 {
		return nil, errno
	}
	typ := mode & syscall.S_IFMT
	switch typ {
	case 0, syscall.S_IFREG:
	case syscall.S_IFIFO, syscall.S_IFSOCK:
		return d.newSpecial(ctx, name, mode, 0, out)
	case syscall.S_IFCHR, syscall.S_IFBLK:
		if !canMknodDevices() {
			return nil, syscall.EPERM
		}
		return d.newSpecial(ctx, name, mode, dev, out)
	default:
		return nil, syscall.EINVAL
	}
	fn, fd, err := d.newFile(ctx, name, mode)
	if err != nil {
		return nil, d.fs.toErrno("mknod", err)
	}
	unix.Close(fd)
	ch := d.NewPersistentInode(ctx, fn, gofs.StableAttr{Mode: syscall.S_IFREG, Ino: d.fs.newIno()})
	d.touch(true)
	return ch, d.fillEntry(ctx, ch, out)
}

func (d *dirNode) Symlink(ctx context.Context, target, name string, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	if errno := d.checkNew(name); errno != 0 {
		return nil, errno
	}
	l := newSymlink(ctx, target)
	d.inherit(&l.meta, false)
	ch := d.NewPersistentInode(ctx, l, gofs.StableAttr{Mode: syscall.S_IFLNK, Ino: d.fs.newIno()})
	d.touch(true)
	d.created(ctx, name, layout.EntrySymlink)
	return ch, d.fillEntry(ctx, ch, out)
}

// Link gives target another name in d. Linking a file of a committed checkpoint elsewhere is
// allowed (a job may reuse unchanged shards); the file stays immutable under every name.
func (d *dirNode) Link(ctx context.Context, target gofs.InodeEmbedder, name string, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	if errno := d.checkNew(name); errno != 0 {
		return nil, errno
	}
	switch n := target.(type) {
	case *symlinkNode:
		n.addLink()
	case *specialNode:
		n.addLink()
	case *fileNode:
		if n.isControl() {
			return nil, syscall.EXDEV // see movesControlFile
		}
		// A link may commit the file (a pytorch .save): what the job wrote through a mapping
		// goes to the agent first, as at a rename (writeback.go; a link commit missed it, found
		// by a black-box run).
		if errno := d.fs.writeBackUnder(&n.Inode); errno != 0 {
			return nil, errno
		}
		if errno := n.addLink(); errno != 0 {
			return nil, errno
		}
	default:
		return nil, syscall.EPERM
	}
	d.touch(true)
	in := target.EmbeddedInode()
	d.created(ctx, name, entryType(in))
	return in, d.fillEntry(ctx, in, out)
}

func (d *dirNode) Unlink(ctx context.Context, name string) syscall.Errno {
	ch := d.GetChild(name)
	if ch == nil {
		return syscall.ENOENT
	}
	if ch.IsDir() {
		return syscall.EISDIR
	}
	if errno := d.checkRemove(name); errno != 0 {
		return errno
	}
	var unread []string
	if fn, ok := ch.Operations().(*fileNode); ok && fn.report != nil && d.IsRoot() {
		unread = fn.unreadReport()
	}
	// The name goes here, not in go-fuse after the handler (gofs.Options.TreeKeptByFS), and
	// only if it still holds ch: the agent may have replaced it meanwhile (a line appended to
	// replicator.errors), and the job's unlink then removes what is there now.
	report := d.IsRoot() && isReportName(name)
	if report {
		d.fs.reportMu.Lock()
	}
	removed := d.RmChildIf(name, ch)
	if report {
		d.fs.reportMu.Unlock()
	}
	if !removed {
		return d.Unlink(ctx, name)
	}
	doomed, forget := droppedByJob(ch)
	if forget {
		ch.ForgetPersistent() // its bytes go when the kernel forgets it (fileNode.kernelHeld)
	}
	d.touch(true)
	if doomed != nil {
		d.fs.awaitReleases(doomed) // space.go
	}
	d.giveBackUnread(name, unread)
	return 0
}

func (d *dirNode) Rmdir(ctx context.Context, name string) syscall.Errno {
	ch := d.GetChild(name)
	if ch == nil {
		return syscall.ENOENT
	}
	if !ch.IsDir() {
		return syscall.ENOTDIR
	}
	if errno := d.checkRemove(name); errno != 0 {
		return errno
	}
	if len(ch.Children()) > 0 {
		return syscall.ENOTEMPTY
	}
	d.subdirs.Add(-1)
	dropped(ch)
	d.touch(true)
	return 0
}

func (d *dirNode) Rename(ctx context.Context, name string, newParent gofs.InodeEmbedder, newName string, flags uint32) syscall.Errno {
	np, ok := newParent.(*dirNode)
	if !ok {
		return syscall.ENOTDIR
	}
	if errno := checkName(newName); errno != 0 {
		return errno
	}
	src, dst, errno := d.checkRename(name, np, newName, flags)
	if errno != 0 || src == dst {
		return errno
	}
	if movesControlFile(src, np, newName) || (flags&unix.RENAME_EXCHANGE != 0 && movesControlFile(dst, d, name)) {
		return syscall.EXDEV
	}
	if errno := d.checkRemove(name); errno != 0 {
		return errno
	}
	if dst != nil || np.isFrozen() {
		if errno := np.checkRemove(newName); errno != 0 {
			return errno
		}
	}
	if errno := d.fs.writeBackUnder(src); errno != 0 {
		return errno
	}
	if flags&unix.RENAME_EXCHANGE != 0 {
		if errno := d.fs.writeBackUnder(dst); errno != 0 { // it is swapped in: it may commit too
			return errno
		}
	}
	if np.IsRoot() && commitName(src, newName) { // a rename that commits a step
		if errno := d.fs.roomForCopies(src); errno != 0 {
			return errno
		}
		if d.fs.spool.ReadOnly() {
			// The commit is recorded in the spool before the rename returns (SPEC §10): with
			// the spool read-only it could not be, and a kill of the agent before the spool
			// was writable again lost a step whose rename had returned (black-box h60: 4 of 4).
			// The job's save fails instead, as a write would.
			return syscall.EROFS
		}
	}
	doomed, forget := d.applyRename(ctx, name, np, newName, src, dst, flags, true)
	if forget {
		// go-fuse takes dst out of the tree after we return; let go first, it is the same:
		// the node is forgotten once the kernel and the tree both let it go.
		dst.ForgetPersistent()
	}
	if doomed != nil {
		d.fs.awaitReleases(doomed) // space.go
	}
	return 0
}

// commitName reports whether in, given the top-level name, may commit a step: a directory named
// as a step, or a .save (the framework decides later; this errs on committing).
func commitName(in *gofs.Inode, name string) bool {
	if in.IsDir() {
		_, ok := layout.ParseStepDir(name)
		return ok
	}
	return tiers.CommitsOnClose(name)
}

// movesControlFile reports whether in is a control file (replicator.yaml or .tmp at the top)
// that would get a name that is not one: np/newName. A control file is written even past the
// budget (fileNode.charge) so that a job that filled it can restart; moved or linked to another
// name, its bytes would stay past the budget, and a job renaming replicator.yaml.tmp away again
// and again overdrew the budget at will (found by a black-box run). Such a rename or link fails
// with EXDEV: mv copies instead, and the copy is charged like any file.
func movesControlFile(in *gofs.Inode, np *dirNode, newName string) bool {
	f, ok := in.Operations().(*fileNode)
	return ok && f.isControl() && !(np.IsRoot() && tiers.WriteLimit(newName) > 0)
}

// checkRename makes the checks rename(2) makes on tmpfs and returns the source and the entry the
// rename replaces or exchanges with (nil: none). src == dst means there is nothing to do.
func (d *dirNode) checkRename(name string, np *dirNode, newName string, flags uint32) (src, dst *gofs.Inode, errno syscall.Errno) {
	src = d.GetChild(name)
	if src == nil {
		return nil, nil, syscall.ENOENT
	}
	dst = np.GetChild(newName)
	switch {
	case flags&^(unix.RENAME_NOREPLACE|unix.RENAME_EXCHANGE) != 0:
		return nil, nil, syscall.EINVAL
	case flags&unix.RENAME_EXCHANGE != 0:
		if dst == nil {
			return nil, nil, syscall.ENOENT
		}
	case dst == src:
		return src, dst, 0 // rename onto a hard link of itself: nothing happens
	case dst != nil && flags&unix.RENAME_NOREPLACE != 0:
		return nil, nil, syscall.EEXIST
	case dst != nil && src.IsDir() && !dst.IsDir():
		return nil, nil, syscall.ENOTDIR
	case dst != nil && !src.IsDir() && dst.IsDir():
		return nil, nil, syscall.EISDIR
	case dst != nil && dst.IsDir() && len(dst.Children()) > 0:
		return nil, nil, syscall.ENOTEMPTY
	}
	return src, dst, 0
}

// applyRename does the bookkeeping of a checked rename; go-fuse moves the entries after a
// successful Rename returns (or the agent does, see namespace.Rename). event reports it to the
// listener once it is done: the job's rename (and only it) sets event. It returns the replaced
// file if that was its last name while it still has handles (see space.go), and, for the job's
// rename, whether the caller must let dst go (droppedByJob).
func (d *dirNode) applyRename(ctx context.Context, name string, np *dirNode, newName string, src, dst *gofs.Inode, flags uint32, event bool) (doomed *fileNode, forget bool) {
	if dst != nil && flags&unix.RENAME_EXCHANGE == 0 {
		if event {
			doomed, forget = droppedByJob(dst) // go-fuse replaces the entry after we return
		} else {
			doomed = dropped(dst)
		}
	}
	d.countRename(np, src, dst, flags&unix.RENAME_EXCHANGE != 0)
	if event && d.fs.events != nil {
		oldPath, newPath, typ := joinPath(d.Path(nil), name), joinPath(np.Path(nil), newName), entryType(src)
		d.fs.park(ctx, func() { d.fs.events.Renamed(oldPath, newPath, typ) })
	}
	d.touch(true)
	if np != d {
		np.touch(true)
	}
	if m, ok := src.Operations().(interface{ touch(bool) }); ok {
		m.touch(false)
	}
	return doomed, forget
}

// countRename keeps the subdirectory counts of both parents right across a rename.
func (d *dirNode) countRename(np *dirNode, src, dst *gofs.Inode, exchange bool) {
	move := func(in *gofs.Inode, from, to *dirNode) {
		if in != nil && in.IsDir() && from != to {
			from.subdirs.Add(-1)
			to.subdirs.Add(1)
		}
	}
	if exchange {
		move(src, d, np)
		move(dst, np, d)
		return
	}
	move(src, d, np)
	if dst != nil && dst.IsDir() {
		np.subdirs.Add(-1) // replaced
	}
}

func joinPath(dir, name string) string {
	if dir == "" {
		return name
	}
	return dir + "/" + name
}

// newFile makes a file node for a new name in d; control files at the top get a size limit.
func (d *dirNode) newFile(ctx context.Context, name string, mode uint32) (*fileNode, int, error) {
	fn, fd, err := d.fs.newFile(ctx, mode)
	if err == nil {
		d.inherit(&fn.meta, false)
	}
	if err == nil && d.IsRoot() {
		fn.limit = tiers.WriteLimit(name)
		fn.changedControl() // made: a yaml created empty and closed is the job's news too
	}
	return fn, fd, err
}

// dropped tells a node that one of its names is going away. It returns the file if that was
// its last name while it still has handles (see space.go), nil otherwise.
func dropped(ch *gofs.Inode) (doomed *fileNode) {
	doomed, _ = droppedBy(ch, false)
	return doomed
}

// droppedByJob is dropped for a name the job removed (unlink, rename over it): when that was a
// file's last name, forget says the caller must call ch.ForgetPersistent once the name is out of
// the tree (fileNode.dropLinkBy).
func droppedByJob(ch *gofs.Inode) (doomed *fileNode, forget bool) { return droppedBy(ch, true) }

func droppedBy(ch *gofs.Inode, byJob bool) (doomed *fileNode, forget bool) {
	switch n := ch.Operations().(type) {
	case *fileNode:
		var d bool
		if d, forget = n.dropLinkBy(byJob); d {
			doomed = n
		}
	case *dirNode:
		n.mu.Lock()
		n.removed = true
		n.mu.Unlock()
	case *symlinkNode:
		n.dropLink()
	case *specialNode:
		n.dropLink()
	}
	return doomed, forget
}

// ---------------------------------------------------------------------------------------------
// Symlinks

type symlinkNode struct {
	gofs.Inode
	meta
	links
	target string
}

var (
	_ = (gofs.NodeReadlinker)((*symlinkNode)(nil))
	_ = (gofs.NodeGetattrer)((*symlinkNode)(nil))
	_ = (gofs.NodeSetattrer)((*symlinkNode)(nil))
)

// agentOwned gives m, an entry the agent makes, the owner of the agent's entries (agentOwner).
func (fs *mtfs) agentOwned(m *meta) {
	o := fs.agentOwner.Load()
	m.uid, m.gid = uint32(o>>32), uint32(o)
}

func newSymlink(ctx context.Context, target string) *symlinkNode {
	l := &symlinkNode{target: target}
	l.nlink.Store(1)
	l.init(ctx, 0o777)
	return l
}

func (l *symlinkNode) Readlink(ctx context.Context) ([]byte, syscall.Errno) {
	return []byte(l.target), 0
}

func (l *symlinkNode) Getattr(ctx context.Context, fh gofs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	l.mu.Lock()
	l.fill(&out.Attr)
	l.mu.Unlock()
	out.Nlink = l.count()
	out.Size = uint64(len(l.target))
	out.Blksize = 4096
	return 0
}

func (l *symlinkNode) Setattr(ctx context.Context, fh gofs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	if l.isFrozen() {
		return syscall.EROFS
	}
	l.mu.Lock()
	mode := l.mode
	l.setattr(in)
	l.mode = mode // a symlink's permission bits are always 0777
	l.mu.Unlock()
	return l.Getattr(ctx, fh, out)
}
