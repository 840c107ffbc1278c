package tiers

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// HugePageHeap asks the kernel to back the next size bytes the Go heap grows into with
// transparent huge pages (madvise MADV_HUGEPAGE), where the system leaves that choice to each
// program (/sys/kernel/mm/transparent_hugepage/enabled "madvise", a common default) and the Go
// runtime asks for none on its heap. A restart builds its namespace, listings and nodes for
// every adopted file in fresh memory: 23,000 faults of 4 KiB pages, some 12 µs each on a virtual
// machine, were a sixth of the CPU of adopting 100,000 files (issue 12); with 2 MiB pages they
// are some 3,000.
//
// It does so by allocating a block of size bytes (fresh pages from the system, which nothing
// touches), marking the whole huge pages inside it, and collecting the block at once: the
// runtime hands those pages out again, lowest addresses first, to what the agent allocates next,
// and the mark stays with the address range. What it costs: pages of that range are resident
// in 2 MiB units, and the kernel's khugepaged may make whole again a huge page whose 4 KiB
// pages the runtime gave back, so the agent's resident memory may exceed the runtime's own count
// by up to size. It returns the bytes marked: 0 where the kernel has no transparent huge pages
// or size is below two of them.
func HugePageHeap(size int64) (int64, error) {
	huge := hugePageSize()
	if huge <= 0 || size < 2*huge {
		return 0, nil
	}
	// The Go runtime ends the process when it cannot map what make asks for (an address-space
	// limit, strict overcommit): a mapping of the same size, made and dropped first, finds out.
	probe, err := unix.Mmap(-1, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		return 0, fmt.Errorf("map %d bytes: %w", size, err)
	}
	if err := unix.Munmap(probe); err != nil {
		return 0, fmt.Errorf("unmap: %w", err)
	}
	block := make([]byte, size)
	start := uintptr(unsafe.Pointer(unsafe.SliceData(block)))
	off := int64((huge - int64(start%uintptr(huge))) % huge) // to the first whole huge page
	n := (size - off) / huge * huge
	err = unix.Madvise(block[off:off+n], unix.MADV_HUGEPAGE)
	runtime.KeepAlive(block)
	runtime.GC() // the block's pages return to the heap now, before the agent allocates anything large
	if err != nil {
		return 0, fmt.Errorf("madvise MADV_HUGEPAGE: %w", err)
	}
	return n, nil
}

// hugePageSize is the size of the kernel's transparent huge pages, 0 where it has none.
func hugePageSize() int64 {
	b, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
	if err != nil {
		return 0
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil || n <= 0 || n&(n-1) != 0 {
		return 0
	}
	return n
}

// TransparentHugePages is the system's transparent huge page mode (always, madvise or never; ""
// where it cannot be read): with always the kernel gives huge pages unasked, with never
// HugePageHeap's request has no effect.
func TransparentHugePages() string {
	b, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/enabled")
	if err != nil {
		return ""
	}
	for _, w := range strings.Fields(string(b)) {
		if strings.HasPrefix(w, "[") && strings.HasSuffix(w, "]") {
			return strings.Trim(w, "[]")
		}
	}
	return ""
}
