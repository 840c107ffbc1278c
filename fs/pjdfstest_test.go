package fs

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The classic pjdfstest suite (github.com/pjd/pjdfstest, BSD licence) is a third-party tool kept
// outside the project, pinned at commit 85a8aea: ../shared/tools/ seen from the project root, or
// wherever MTCFS_PJDFSTEST_TARBALL points. The tarball is checked against its hash.
const (
	pjdTarballName   = "pjdfstest-85a8aea.tar.gz"
	pjdTarballSHA256 = "f5716c54c4d1c9b14c7b9911586319d13f17a3471075ed40fb2565b422789de7"
	// pjdAssertions is how many assertions the pinned suite makes on Linux (all of them pass on
	// tmpfs). Fewer means some did not run, which must not pass unnoticed.
	pjdAssertions = 8798
	// pjdJobs runs that many test files at once: the suite mostly sleeps (ctime checks wait a
	// second), so 4 jobs finish in about half the time of 1 even on 2 cores.
	pjdJobs = 4
)

// pjdTodoFailures are the assertions the pinned suite itself marks "TODO" on Linux and that
// fail on tmpfs too (not ok # TODO): Linux keeps the set-group-ID bit of a directory on chown,
// updates ctime on chown(-1, -1), and unlink(2) of a directory fails with EISDIR, not EPERM.
// They must fail the same way here: any other failed assertion fails the test.
var pjdTodoFailures = map[string][]int{
	"chown/00.t": {650, 654, 665, 666, 671, 672, 686, 690, 1054, 1058, 1064, 1069, 1073, 1079,
		1084, 1088, 1094, 1099, 1103, 1109, 1114, 1118, 1124, 1129, 1133, 1139, 1144},
	"unlink/08.t": {2},
}

// TestPjdfstest builds the pinned pjdfstest suite and runs it with prove inside a real mount, on
// both data paths: every assertion must pass, as on tmpfs, except the ones the suite itself
// expects to fail on Linux (pjdTodoFailures). On failure it prints the verbose output of every
// test file with a failed assertion. Both data paths matter: they share the namespace code, but
// reads, writes, truncation and attribute caching differ.
//
// Run time: the suite forks several processes per assertion, so it follows the machine's
// fork+exec cost: on one 2-core VM 2.5 min for both data paths at once under -race, on another
// (fork+exec of /bin/true 4.5 ms) 12.5 min beside a crashbench run. make test runs it on its
// own, without -race (PJD_TIMEOUT).
//
// It needs root (the suite changes owners, creates device nodes and acts as other users) and,
// to build the suite, autoconf, automake, gcc, make, perl (prove) and openssl (its name
// generator); their absence is a failure, not a skip: CI installs them (.ci/run).
func TestPjdfstest(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("pjdfstest needs root: it changes owners, creates device nodes and runs as other users")
	}
	tarball := pjdTarball(t)
	var missing []string
	for _, tool := range []string{"autoreconf", "aclocal", "automake", "gcc", "make", "perl", "prove", "openssl"} {
		if _, err := exec.LookPath(tool); err != nil {
			missing = append(missing, tool)
		}
	}
	if len(missing) > 0 {
		t.Fatalf("building and running pjdfstest needs %s; install them with: apt-get install -y autoconf automake gcc libc6-dev make perl openssl",
			strings.Join(missing, ", "))
	}
	start := time.Now()
	src := t.TempDir()
	pjdBuild(t, tarball, src)
	t.Logf("pjdfstest built in %v", time.Since(start).Round(time.Second))

	for _, mode := range modes {
		t.Run(string(mode), func(t *testing.T) {
			t.Parallel() // the suite mostly sleeps: both data paths at once take little longer than one
			dir, _ := testMount(t, mode, 1<<30)
			start := time.Now()
			out, runErr := pjdProve(filepath.Join(src, "tests"), dir)
			elapsed := time.Since(start).Round(time.Second)
			res := parsePjdProve(out, filepath.Join(src, "tests")+"/")
			t.Logf("pjdfstest on %s: %d assertions, %d failed, %d expected TODO failures, prove -j%d took %v",
				mode, res.assertions, len(res.failed), res.todo, pjdJobs, elapsed)
			if len(res.problems) > 0 || runErr != nil || !res.pass {
				for _, f := range res.failedFiles() {
					t.Logf("verbose output of %s:\n%s", f, res.sections[f])
				}
				t.Logf("prove summary:\n%s", res.summary)
				t.Fatalf("pjdfstest failed (prove: %v, result PASS: %v):\n%s", runErr, res.pass, strings.Join(res.problems, "\n"))
			}
		})
	}
}

// pjdTarball finds the pinned tarball and checks its hash.
func pjdTarball(t *testing.T) string {
	t.Helper()
	p := os.Getenv("MTCFS_PJDFSTEST_TARBALL")
	if p == "" {
		root, err := filepath.Abs("..") // the test runs in fs/; the project root is its parent
		if err != nil {
			t.Fatal(err)
		}
		p = filepath.Join(filepath.Dir(root), "shared", "tools", pjdTarballName)
	}
	f, err := os.Open(p)
	if err != nil {
		t.Fatalf("pjdfstest tarball: %v (it is kept outside the project, in ../shared/tools/ seen from the project root; or set MTCFS_PJDFSTEST_TARBALL)", err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	if sum := hex.EncodeToString(h.Sum(nil)); sum != pjdTarballSHA256 {
		t.Fatalf("%s has sha256 %s, want %s (the pinned commit 85a8aea)", p, sum, pjdTarballSHA256)
	}
	return p
}

// pjdBuild unpacks the tarball into src and builds the pjdfstest program there.
func pjdBuild(t *testing.T, tarball, src string) {
	t.Helper()
	for _, args := range [][]string{
		{"tar", "-xzf", tarball, "-C", src},
		{"autoreconf", "-ifs"},
		{"./configure"},
		{"make", "pjdfstest"},
	} {
		cmd := exec.Command(args[0], args[1:]...)
		cmd.Dir = src
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("building pjdfstest: %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}

// pjdProve runs the whole suite in dir and returns prove's verbose output.
func pjdProve(tests, dir string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "prove", "-r", "-v", "-j", strconv.Itoa(pjdJobs), tests)
	cmd.Dir = dir
	cmd.WaitDelay = 10 * time.Second
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.Bytes(), err
}

type pjdResult struct {
	assertions int
	todo       int                    // expected TODO failures seen
	failed     []string               // "file #n: line" of every unexpected failure
	sections   map[string]string      // file -> its verbose output
	badFiles   map[string]struct{}    // files with a failed assertion or a broken plan
	todos      map[string]map[int]int // file -> TODO failures seen
	problems   []string
	pass       bool // prove said "Result: PASS"
	summary    string
}

func (r *pjdResult) failedFiles() []string {
	var out []string
	for f := range r.badFiles {
		out = append(out, f)
	}
	sort.Strings(out)
	return out
}

var (
	pjdHeader = regexp.MustCompile(`^(\S+\.t) \.+ ?`)
	pjdTAP    = regexp.MustCompile(`^(not )?ok (\d+)(.*)$`)
	pjdPlan   = regexp.MustCompile(`^1\.\.(\d+)$`)
)

// parsePjdProve reads prove -v output: for each test file a header line ("path ..... "), its TAP
// lines (prove prints each file's lines together, also with -j; checked by their numbering),
// then the summary. prefix is cut from the file names.
func parsePjdProve(out []byte, prefix string) *pjdResult {
	r := &pjdResult{sections: map[string]string{}, badFiles: map[string]struct{}{}, todos: map[string]map[int]int{}}
	var cur string
	var sec strings.Builder
	next, plan := 1, -1
	flush := func() {
		if cur == "" {
			return
		}
		r.sections[cur] = sec.String()
		if plan >= 0 && next-1 != plan {
			r.problems = append(r.problems, fmt.Sprintf("%s: planned %d assertions, ran %d", cur, plan, next-1))
			r.badFiles[cur] = struct{}{}
		}
		cur = ""
		sec.Reset()
	}
	var summary strings.Builder
	inSummary := false
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "Test Summary Report") || strings.HasPrefix(line, "All tests successful") {
			flush()
			inSummary = true
		}
		if inSummary {
			summary.WriteString(line + "\n")
			if strings.HasPrefix(line, "Result: ") {
				r.pass = strings.TrimSpace(strings.TrimPrefix(line, "Result: ")) == "PASS"
			}
			continue
		}
		if m := pjdHeader.FindStringSubmatch(line); m != nil && strings.HasPrefix(m[1], prefix) {
			flush()
			cur = strings.TrimPrefix(m[1], prefix)
			next, plan = 1, -1
			sec.WriteString(line + "\n")
			continue
		}
		sec.WriteString(line + "\n")
		if m := pjdPlan.FindStringSubmatch(line); m != nil && cur != "" {
			plan, _ = strconv.Atoi(m[1])
			continue
		}
		m := pjdTAP.FindStringSubmatch(line)
		if m == nil || cur == "" {
			continue
		}
		n, _ := strconv.Atoi(m[2])
		if n != next {
			r.problems = append(r.problems, fmt.Sprintf("%s: assertion %d follows %d: cannot attribute prove's output", cur, n, next-1))
			r.badFiles[cur] = struct{}{}
		}
		next = n + 1
		r.assertions++
		if m[1] == "" {
			continue
		}
		if strings.Contains(m[3], "# TODO") && pjdTodoExpected(cur, n) {
			if r.todos[cur] == nil {
				r.todos[cur] = map[int]int{}
			}
			r.todos[cur][n]++
			r.todo++
			continue
		}
		r.failed = append(r.failed, fmt.Sprintf("%s #%d: %s", cur, n, line))
		r.badFiles[cur] = struct{}{}
	}
	flush()
	r.summary = summary.String()
	r.problems = append(r.problems, r.failed...)
	if r.assertions != pjdAssertions {
		r.problems = append(r.problems, fmt.Sprintf("%d assertions ran, the suite has %d", r.assertions, pjdAssertions))
	}
	for f, nums := range pjdTodoFailures {
		for _, n := range nums {
			if r.todos[f][n] != 1 {
				// An expected failure that passed means the behaviour differs from tmpfs's.
				r.problems = append(r.problems, fmt.Sprintf("%s #%d: expected to fail as on tmpfs (TODO on Linux), seen %d times", f, n, r.todos[f][n]))
				r.badFiles[f] = struct{}{}
			}
		}
	}
	return r
}

func pjdTodoExpected(file string, n int) bool {
	for _, m := range pjdTodoFailures[file] {
		if m == n {
			return true
		}
	}
	return false
}

// TestParsePjdProve checks that the reading of prove's output catches what must fail the suite:
// a failed assertion, a TODO failure that is not one tmpfs has, a plan not carried out,
// interleaved output, a missing expected failure and a count short of the suite's.
func TestParsePjdProve(t *testing.T) {
	const p = "/x/tests/"
	good := func() string {
		var b strings.Builder
		b.WriteString(p + "chown/00.t .... \n1..1144\n")
		for n := 1; n <= 1144; n++ {
			if pjdTodoExpected("chown/00.t", n) {
				fmt.Fprintf(&b, "not ok %d # TODO as on Linux\n", n)
			} else {
				fmt.Fprintf(&b, "ok %d\n", n)
			}
		}
		b.WriteString("ok\n" + p + "unlink/08.t .. \n1..2\nok 1\nnot ok 2 # TODO EPERM\nok\n")
		rest := pjdAssertions - 1146
		fmt.Fprintf(&b, "%sother/00.t ... \n1..%d\n", p, rest)
		for n := 1; n <= rest; n++ {
			fmt.Fprintf(&b, "ok %d\n", n)
		}
		b.WriteString("ok\nAll tests successful.\nFiles=3, Tests=8798\nResult: PASS\n")
		return b.String()
	}()
	r := parsePjdProve([]byte(good), p)
	if len(r.problems) != 0 || !r.pass || r.assertions != pjdAssertions || r.todo != 28 {
		t.Fatalf("clean run: problems %v, pass %v, %d assertions, %d todo", r.problems, r.pass, r.assertions, r.todo)
	}
	for name, bad := range map[string]string{
		"failed assertion":  strings.Replace(good, "\nok 7\n", "\nnot ok 7 - tried 'x', expected 0, got EPERM\n", 1),
		"unknown TODO":      strings.Replace(good, "\nok 7\n", "\nnot ok 7 # TODO something else\n", 1),
		"expected TODO ok":  strings.Replace(good, "not ok 2 # TODO EPERM", "ok 2 # TODO EPERM", 1),
		"plan not reached":  strings.Replace(good, "1..2\n", "1..3\n", 1),
		"interleaved":       strings.Replace(good, "\nok 7\nok 8\n", "\nok 8\nok 7\n", 1),
		"assertion missing": strings.Replace(good, "\nok 1\nnot ok 2", "\nnot ok 2", 1),
	} {
		if r := parsePjdProve([]byte(bad), p); len(r.problems) == 0 {
			t.Errorf("%s: not caught", name)
		}
	}
	if r := parsePjdProve([]byte(strings.Replace(good, "Result: PASS", "Result: FAIL", 1)), p); r.pass {
		t.Error("Result: FAIL read as PASS")
	}
}
