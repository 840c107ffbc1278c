package fs

import (
	"sync/atomic"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// fuseOp numbers the FUSE operations the agent counts (mtcfs_fuse_requests_total{op}).
type fuseOp int

const (
	opLookup fuseOp = iota
	opForget
	opGetattr
	opSetattr
	opMknod
	opMkdir
	opUnlink
	opRmdir
	opRename
	opLink
	opSymlink
	opReadlink
	opAccess
	opGetxattr
	opListxattr
	opSetxattr
	opRemovexattr
	opCreate
	opTmpfile
	opOpen
	opRead
	opLseek
	opGetlk
	opSetlk
	opSetlkw
	opRelease
	opWrite
	opCopyFileRange
	opIoctl
	opFlush
	opFsync
	opFallocate
	opOpendir
	opReaddir
	opReaddirplus
	opReleasedir
	opFsyncdir
	opStatfs
	opStatx
	numFuseOps
)

// fuseOpNames are the op label values, in the kernel's words (FUSE_LOOKUP → "lookup").
var fuseOpNames = [numFuseOps]string{
	opLookup: "lookup", opForget: "forget", opGetattr: "getattr", opSetattr: "setattr",
	opMknod: "mknod", opMkdir: "mkdir", opUnlink: "unlink", opRmdir: "rmdir", opRename: "rename",
	opLink: "link", opSymlink: "symlink", opReadlink: "readlink", opAccess: "access",
	opGetxattr: "getxattr", opListxattr: "listxattr", opSetxattr: "setxattr", opRemovexattr: "removexattr",
	opCreate: "create", opTmpfile: "tmpfile", opOpen: "open", opRead: "read", opLseek: "lseek",
	opGetlk: "getlk", opSetlk: "setlk", opSetlkw: "setlkw", opRelease: "release", opWrite: "write",
	opCopyFileRange: "copy_file_range", opIoctl: "ioctl", opFlush: "flush", opFsync: "fsync",
	opFallocate: "fallocate", opOpendir: "opendir", opReaddir: "readdir", opReaddirplus: "readdirplus",
	opReleasedir: "releasedir", opFsyncdir: "fsyncdir", opStatfs: "statfs", opStatx: "statx",
}

// requestCounts counts the requests that reached the filesystem, by operation: one atomic add
// per request. Requests go-fuse answers itself (INIT, INTERRUPT, GETXATTR and friends while
// xattrs are disabled, POLL) are not counted.
type requestCounts [numFuseOps]atomic.Uint64

// snapshot returns the counts by op name; ops never seen are left out.
func (c *requestCounts) snapshot() map[string]uint64 {
	out := make(map[string]uint64, 16)
	for op := range numFuseOps {
		if n := c[op].Load(); n > 0 {
			out[fuseOpNames[op]] = n
		}
	}
	return out
}

// countingFS wraps the raw filesystem and counts every request before passing it on.
type countingFS struct {
	fuse.RawFileSystem
	n *requestCounts
}

func (c *countingFS) Lookup(cancel <-chan struct{}, h *fuse.InHeader, name string, out *fuse.EntryOut) fuse.Status {
	c.n[opLookup].Add(1)
	return c.RawFileSystem.Lookup(cancel, h, name, out)
}

func (c *countingFS) Forget(nodeid, nlookup uint64) {
	c.n[opForget].Add(1)
	c.RawFileSystem.Forget(nodeid, nlookup)
}

func (c *countingFS) GetAttr(cancel <-chan struct{}, in *fuse.GetAttrIn, out *fuse.AttrOut) fuse.Status {
	c.n[opGetattr].Add(1)
	return c.RawFileSystem.GetAttr(cancel, in, out)
}

func (c *countingFS) SetAttr(cancel <-chan struct{}, in *fuse.SetAttrIn, out *fuse.AttrOut) fuse.Status {
	c.n[opSetattr].Add(1)
	return c.RawFileSystem.SetAttr(cancel, in, out)
}

func (c *countingFS) Mknod(cancel <-chan struct{}, in *fuse.MknodIn, name string, out *fuse.EntryOut) fuse.Status {
	c.n[opMknod].Add(1)
	return c.RawFileSystem.Mknod(cancel, in, name, out)
}

func (c *countingFS) Mkdir(cancel <-chan struct{}, in *fuse.MkdirIn, name string, out *fuse.EntryOut) fuse.Status {
	c.n[opMkdir].Add(1)
	return c.RawFileSystem.Mkdir(cancel, in, name, out)
}

func (c *countingFS) Unlink(cancel <-chan struct{}, h *fuse.InHeader, name string) fuse.Status {
	c.n[opUnlink].Add(1)
	return c.RawFileSystem.Unlink(cancel, h, name)
}

func (c *countingFS) Rmdir(cancel <-chan struct{}, h *fuse.InHeader, name string) fuse.Status {
	c.n[opRmdir].Add(1)
	return c.RawFileSystem.Rmdir(cancel, h, name)
}

func (c *countingFS) Rename(cancel <-chan struct{}, in *fuse.RenameIn, oldName, newName string) fuse.Status {
	c.n[opRename].Add(1)
	return c.RawFileSystem.Rename(cancel, in, oldName, newName)
}

func (c *countingFS) Link(cancel <-chan struct{}, in *fuse.LinkIn, name string, out *fuse.EntryOut) fuse.Status {
	c.n[opLink].Add(1)
	return c.RawFileSystem.Link(cancel, in, name, out)
}

func (c *countingFS) Symlink(cancel <-chan struct{}, h *fuse.InHeader, target, name string, out *fuse.EntryOut) fuse.Status {
	c.n[opSymlink].Add(1)
	return c.RawFileSystem.Symlink(cancel, h, target, name, out)
}

func (c *countingFS) Readlink(cancel <-chan struct{}, h *fuse.InHeader) ([]byte, fuse.Status) {
	c.n[opReadlink].Add(1)
	return c.RawFileSystem.Readlink(cancel, h)
}

func (c *countingFS) Access(cancel <-chan struct{}, in *fuse.AccessIn) fuse.Status {
	c.n[opAccess].Add(1)
	return c.RawFileSystem.Access(cancel, in)
}

func (c *countingFS) GetXAttr(cancel <-chan struct{}, h *fuse.InHeader, attr string, dest []byte) (uint32, fuse.Status) {
	c.n[opGetxattr].Add(1)
	return c.RawFileSystem.GetXAttr(cancel, h, attr, dest)
}

func (c *countingFS) ListXAttr(cancel <-chan struct{}, h *fuse.InHeader, dest []byte) (uint32, fuse.Status) {
	c.n[opListxattr].Add(1)
	return c.RawFileSystem.ListXAttr(cancel, h, dest)
}

func (c *countingFS) SetXAttr(cancel <-chan struct{}, in *fuse.SetXAttrIn, attr string, data []byte) fuse.Status {
	c.n[opSetxattr].Add(1)
	return c.RawFileSystem.SetXAttr(cancel, in, attr, data)
}

func (c *countingFS) RemoveXAttr(cancel <-chan struct{}, h *fuse.InHeader, attr string) fuse.Status {
	c.n[opRemovexattr].Add(1)
	return c.RawFileSystem.RemoveXAttr(cancel, h, attr)
}

func (c *countingFS) Create(cancel <-chan struct{}, in *fuse.CreateIn, name string, out *fuse.CreateOut) fuse.Status {
	c.n[opCreate].Add(1)
	return c.RawFileSystem.Create(cancel, in, name, out)
}

func (c *countingFS) Tmpfile(cancel <-chan struct{}, in *fuse.CreateIn, out *fuse.CreateOut) fuse.Status {
	c.n[opTmpfile].Add(1)
	return c.RawFileSystem.Tmpfile(cancel, in, out)
}

func (c *countingFS) Open(cancel <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	c.n[opOpen].Add(1)
	return c.RawFileSystem.Open(cancel, in, out)
}

func (c *countingFS) Read(cancel <-chan struct{}, in *fuse.ReadIn, buf []byte) (fuse.ReadResult, fuse.Status) {
	c.n[opRead].Add(1)
	return c.RawFileSystem.Read(cancel, in, buf)
}

func (c *countingFS) Lseek(cancel <-chan struct{}, in *fuse.LseekIn, out *fuse.LseekOut) fuse.Status {
	c.n[opLseek].Add(1)
	return c.RawFileSystem.Lseek(cancel, in, out)
}

func (c *countingFS) GetLk(cancel <-chan struct{}, in *fuse.LkIn, out *fuse.LkOut) fuse.Status {
	c.n[opGetlk].Add(1)
	return c.RawFileSystem.GetLk(cancel, in, out)
}

func (c *countingFS) SetLk(cancel <-chan struct{}, in *fuse.LkIn) fuse.Status {
	c.n[opSetlk].Add(1)
	return c.RawFileSystem.SetLk(cancel, in)
}

func (c *countingFS) SetLkw(cancel <-chan struct{}, in *fuse.LkIn) fuse.Status {
	c.n[opSetlkw].Add(1)
	return c.RawFileSystem.SetLkw(cancel, in)
}

func (c *countingFS) Release(cancel <-chan struct{}, in *fuse.ReleaseIn) {
	c.n[opRelease].Add(1)
	c.RawFileSystem.Release(cancel, in)
}

func (c *countingFS) Write(cancel <-chan struct{}, in *fuse.WriteIn, data []byte) (uint32, fuse.Status) {
	c.n[opWrite].Add(1)
	return c.RawFileSystem.Write(cancel, in, data)
}

func (c *countingFS) Writev(cancel <-chan struct{}, in *fuse.WriteIn, data [][]byte) (uint32, fuse.Status) {
	c.n[opWrite].Add(1)
	return c.RawFileSystem.Writev(cancel, in, data)
}

func (c *countingFS) CopyFileRange(cancel <-chan struct{}, in *fuse.CopyFileRangeIn) (uint32, fuse.Status) {
	c.n[opCopyFileRange].Add(1)
	return c.RawFileSystem.CopyFileRange(cancel, in)
}

func (c *countingFS) Ioctl(cancel <-chan struct{}, in *fuse.IoctlIn, inbuf []byte, out *fuse.IoctlOut, outbuf []byte) fuse.Status {
	c.n[opIoctl].Add(1)
	return c.RawFileSystem.Ioctl(cancel, in, inbuf, out, outbuf)
}

func (c *countingFS) Flush(cancel <-chan struct{}, in *fuse.FlushIn) fuse.Status {
	c.n[opFlush].Add(1)
	return c.RawFileSystem.Flush(cancel, in)
}

func (c *countingFS) Fsync(cancel <-chan struct{}, in *fuse.FsyncIn) fuse.Status {
	c.n[opFsync].Add(1)
	return c.RawFileSystem.Fsync(cancel, in)
}

func (c *countingFS) Fallocate(cancel <-chan struct{}, in *fuse.FallocateIn) fuse.Status {
	c.n[opFallocate].Add(1)
	return c.RawFileSystem.Fallocate(cancel, in)
}

func (c *countingFS) OpenDir(cancel <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	c.n[opOpendir].Add(1)
	return c.RawFileSystem.OpenDir(cancel, in, out)
}

func (c *countingFS) ReadDir(cancel <-chan struct{}, in *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	c.n[opReaddir].Add(1)
	return c.RawFileSystem.ReadDir(cancel, in, out)
}

func (c *countingFS) ReadDirPlus(cancel <-chan struct{}, in *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	c.n[opReaddirplus].Add(1)
	return c.RawFileSystem.ReadDirPlus(cancel, in, out)
}

func (c *countingFS) ReleaseDir(in *fuse.ReleaseIn) {
	c.n[opReleasedir].Add(1)
	c.RawFileSystem.ReleaseDir(in)
}

func (c *countingFS) FsyncDir(cancel <-chan struct{}, in *fuse.FsyncIn) fuse.Status {
	c.n[opFsyncdir].Add(1)
	return c.RawFileSystem.FsyncDir(cancel, in)
}

func (c *countingFS) StatFs(cancel <-chan struct{}, h *fuse.InHeader, out *fuse.StatfsOut) fuse.Status {
	c.n[opStatfs].Add(1)
	return c.RawFileSystem.StatFs(cancel, h, out)
}

func (c *countingFS) Statx(cancel <-chan struct{}, in *fuse.StatxIn, out *fuse.StatxOut) fuse.Status {
	c.n[opStatx].Add(1)
	return c.RawFileSystem.Statx(cancel, in, out)
}

// quietOps are the requests that do not count as the job's use of the mount (changes): looks,
// listings and stats, which a job polling for its restore markers makes, and the kernel's
// forgets.
var quietOps = [numFuseOps]bool{
	opLookup: true, opForget: true, opGetattr: true, opReadlink: true, opAccess: true,
	opGetxattr: true, opListxattr: true, opOpendir: true, opReaddir: true, opReaddirplus: true,
	opReleasedir: true, opStatfs: true, opStatx: true,
}

// changes is how many requests that change or open something the mount has served.
func (c *requestCounts) changes() uint64 {
	var n uint64
	for op := range numFuseOps {
		if !quietOps[op] {
			n += c[op].Load()
		}
	}
	return n
}
