package tiers

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// smapsArea is one mapping of /proc/self/smaps.
type smapsArea struct {
	start, end    uintptr
	huge          bool  // VmFlags hg: madvise(MADV_HUGEPAGE)
	anonHugePages int64 // bytes of it in transparent huge pages
}

func readSmaps(t *testing.T) []smapsArea {
	t.Helper()
	f, err := os.Open("/proc/self/smaps")
	if err != nil {
		t.Skipf("no /proc/self/smaps: %v", err)
	}
	defer f.Close()
	var areas []smapsArea
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		fields := strings.Fields(line)
		switch {
		case len(fields) > 0 && strings.Count(fields[0], "-") == 1 && !strings.HasSuffix(fields[0], ":"):
			lo, hi, _ := strings.Cut(fields[0], "-")
			s, err1 := strconv.ParseUint(lo, 16, 64)
			e, err2 := strconv.ParseUint(hi, 16, 64)
			if err1 != nil || err2 != nil {
				continue
			}
			areas = append(areas, smapsArea{start: uintptr(s), end: uintptr(e)})
		case len(areas) > 0 && fields[0] == "AnonHugePages:" && len(fields) >= 2:
			kb, _ := strconv.ParseInt(fields[1], 10, 64)
			areas[len(areas)-1].anonHugePages = kb << 10
		case len(areas) > 0 && fields[0] == "VmFlags:":
			for _, fl := range fields[1:] {
				if fl == "hg" {
					areas[len(areas)-1].huge = true
				}
			}
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return areas
}

func areaOf(areas []smapsArea, p uintptr) (smapsArea, bool) {
	for _, a := range areas {
		if a.start <= p && p < a.end {
			return a, true
		}
	}
	return smapsArea{}, false
}

// The heap range HugePageHeap marks is what the Go runtime hands out next: a large allocation
// made after it lies in a mapping marked for huge pages, and, where the system gives them on
// request, is backed by them once touched.
func TestHugePageHeap(t *testing.T) {
	huge := hugePageSize()
	if huge == 0 {
		t.Skip("the kernel has no transparent huge pages")
	}
	if os.Getenv("MTCFS_HUGEHEAP_FRESH") != "1" {
		// The check runs in a process of its own. Here, earlier tests have touched heap pages
		// that the runtime has not returned to the kernel yet; marked afterwards, they stay in
		// 4 KiB pages (madvise does not convert what is mapped already): the mapping held no huge
		// page in one of five clean-clone runs of make test on 2026-12-05. The agent
		// marks its heap at start, before anything large is allocated, as a fresh process does.
		// Up to three fresh processes: even with the control mapping given huge pages just
		// before, the heap's touched mapping got none in two clean-clone CI runs of 2026-12-06/07
		// (the kernel's choice at that instant); the marking itself is checked every time, and a
		// heap that never gets huge pages fails all three.
		var out []byte
		var err error
		for try := 1; try <= 3; try++ {
			out, err = runTestInChild("TestHugePageHeap", "MTCFS_HUGEHEAP_FRESH=1", "-test.count=1", "-test.v")
			if err == nil && strings.Contains(string(out), "--- PASS: TestHugePageHeap") {
				return
			}
			if !strings.Contains(string(out), "holds no huge page") {
				break // another failure: not the kernel's choice
			}
			t.Logf("try %d: the heap's mapping got no huge page; trying in another fresh process", try)
		}
		t.Fatalf("TestHugePageHeap in a fresh process failed (%v):\n%.4000s", err, out)
	}
	const size = 32 << 20
	n, err := HugePageHeap(size)
	if err != nil {
		t.Fatal(err)
	}
	if n < size-2*huge || n > size || n%huge != 0 {
		t.Fatalf("HugePageHeap(%d) marked %d bytes, want whole huge pages of %d, at least %d", size, n, huge, size-2*huge)
	}
	// Whether a marked page gets a huge page at its first touch is the kernel's choice: with
	// memory too fragmented it gives 4 KiB pages (the project's CI once, on 2026-12-06). A
	// mapping of this process's own, marked and touched now, tells whether it gives any. It is
	// made before the heap's touch: a huge-page fault that fails wakes the kernel's compaction,
	// which could give the control what the heap did not get (a review).
	control := controlHugePage(t, huge)
	// The runtime hands out the lowest free pages that fit: free space left below the block by
	// earlier tests of this process may take the first allocations. Production marks before
	// anything large is allocated; here allocations are made (and kept) until one reaches the
	// marked range, which must happen before they have used up the block.
	var kept [][]byte
	var hit []byte
	var area smapsArea
	for tries := 0; hit == nil && tries < int(size>>23)+16; tries++ {
		obj := make([]byte, 8<<20)
		for i := 0; i < len(obj); i += 4096 {
			obj[i] = 1
		}
		kept = append(kept, obj)
		p := uintptr(unsafe.Pointer(unsafe.SliceData(obj))) + uintptr(len(obj)) - 1
		if a, ok := areaOf(readSmaps(t), p); ok && a.huge {
			hit, area = obj, a
		}
	}
	if hit == nil {
		t.Fatalf("%d allocations of 8 MiB after HugePageHeap, none in a mapping marked for huge pages", len(kept))
	}
	if mode := TransparentHugePages(); (mode == "madvise" || mode == "always") && area.anonHugePages == 0 {
		if control == 0 {
			t.Logf("THP mode %s: the kernel gave no huge page to a fresh marked mapping either (memory fragmented?): the backing is not checked, the marking is", mode)
		} else {
			t.Errorf("THP mode %s: the touched allocation's mapping %#x-%#x holds no huge page, where a fresh marked mapping got %d bytes of them just before", mode, area.start, area.end, control)
		}
	}
	runtime.KeepAlive(kept)
	if got, _ := HugePageHeap(huge); got != 0 {
		t.Errorf("HugePageHeap of one huge page marked %d bytes, want 0 (below two there may be no whole one)", got)
	}
}

// controlHugePage maps two huge pages' worth outside the Go heap, marks it with MADV_HUGEPAGE,
// touches it and returns the bytes of it the kernel backs with huge pages.
func controlHugePage(t *testing.T, huge int64) int64 {
	t.Helper()
	m, err := unix.Mmap(-1, 0, int(3*huge), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	base := uintptr(unsafe.Pointer(unsafe.SliceData(m)))
	off := int((uintptr(huge) - base%uintptr(huge)) % uintptr(huge))
	region := m[off : off+int(2*huge)]
	if err := unix.Madvise(region, unix.MADV_HUGEPAGE); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < len(region); i += 4096 {
		region[i] = 1
	}
	a, ok := areaOf(readSmaps(t), base+uintptr(off))
	if !ok {
		t.Fatalf("the control mapping at %#x is not in /proc/self/smaps", base+uintptr(off))
	}
	return a.anonHugePages
}

// Under an address-space limit (ulimit -v; strict overcommit behaves alike) a size the process
// cannot map is refused with an error: the Go runtime would end the process on the allocation.
// The limit is set in a child process, this test run again.
func TestHugePageHeapUnderAnAddressLimit(t *testing.T) {
	if os.Getenv("MTCFS_HUGEHEAP_CHILD") == "1" {
		st, err := os.ReadFile("/proc/self/status")
		if err != nil {
			fmt.Println("CHILD", err)
			os.Exit(0)
		}
		var vmKB int64
		for _, l := range strings.Split(string(st), "\n") {
			if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmSize:" {
				vmKB, _ = strconv.ParseInt(f[1], 10, 64)
			}
		}
		lim := uint64(vmKB<<10 + 256<<20)
		if err := unix.Setrlimit(unix.RLIMIT_AS, &unix.Rlimit{Cur: lim, Max: lim}); err != nil {
			fmt.Println("CHILD setrlimit", err)
			os.Exit(0)
		}
		n, err := HugePageHeap(4 << 30)
		fmt.Printf("CHILD n=%d err=%v\n", n, err)
		os.Exit(0)
	}
	if hugePageSize() == 0 {
		t.Skip("the kernel has no transparent huge pages")
	}
	out, err := runTestInChild("TestHugePageHeapUnderAnAddressLimit", "MTCFS_HUGEHEAP_CHILD=1")
	if err != nil {
		t.Fatalf("HugePageHeap(4GiB) under an address-space limit ended the process (%v):\n%.2000s", err, out)
	}
	if !strings.Contains(string(out), "CHILD n=0 err=map ") {
		t.Fatalf("HugePageHeap(4GiB) under an address-space limit: want n=0 and a mapping error, got:\n%.2000s", out)
	}
}

// runTestInChild runs test alone in a new process of this test binary, with env (NAME=value)
// added, and returns its combined output.
func runTestInChild(test, env string, args ...string) ([]byte, error) {
	cmd := exec.Command(os.Args[0], append([]string{"-test.run=^" + test + "$"}, args...)...)
	cmd.Env = append(os.Environ(), env)
	return cmd.CombinedOutput()
}
