package tiers

import (
	"bufio"
	"os"
	"strconv"
	"strings"
	"testing"
	"unsafe"
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
	const size = 32 << 20
	n, err := HugePageHeap(size)
	if err != nil {
		t.Fatal(err)
	}
	if n < size-2*huge || n > size || n%huge != 0 {
		t.Fatalf("HugePageHeap(%d) marked %d bytes, want whole huge pages of %d, at least %d", size, n, huge, size-2*huge)
	}
	obj := make([]byte, 8<<20)
	for i := 0; i < len(obj); i += 4096 {
		obj[i] = 1
	}
	// The block's first huge page boundary may be up to one huge page into it: the allocation,
	// which starts where the block started, is marked from there on.
	areas := readSmaps(t)
	base := uintptr(unsafe.Pointer(unsafe.SliceData(obj)))
	for _, off := range []uintptr{uintptr(huge), uintptr(len(obj)) / 2, uintptr(len(obj)) - 1} {
		p := base + off
		a, ok := areaOf(areas, p)
		if !ok {
			t.Fatalf("no mapping holds %#x", p)
		}
		if !a.huge {
			t.Fatalf("byte %d of an 8 MiB allocation made after HugePageHeap is at %#x, in %#x-%#x, which is not marked for huge pages", off, p, a.start, a.end)
		}
		if mode := TransparentHugePages(); (mode == "madvise" || mode == "always") && a.anonHugePages == 0 {
			t.Errorf("THP mode %s: the touched allocation's mapping %#x-%#x holds no huge page", mode, a.start, a.end)
		}
	}
	if got, _ := HugePageHeap(huge); got != 0 {
		t.Errorf("HugePageHeap of one huge page marked %d bytes, want 0 (below two there may be no whole one)", got)
	}
}
