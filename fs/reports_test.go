package fs

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mtcfs/mtcfs/layout"
	"github.com/mtcfs/mtcfs/tiers"
)

// unreadRecorder is a recorder that writes back the lines handed to Unread, before the file's
// current lines, as the agent does (tiers' jobLines.giveBack).
type unreadRecorder struct {
	*recorder
	given chan []string
}

func (r *unreadRecorder) Unread(name string, lines []string) {
	r.mu.Lock()
	ns := r.ns
	r.mu.Unlock()
	old, _ := ns.ReadFile(name, 1<<20)
	if err := ns.WriteFile(name, append([]byte(strings.Join(lines, "")), old...)); err != nil {
		panic(err)
	}
	r.given <- lines
}

// TestReportLinesAddedBetweenTheJobsReadAndItsUnlink: the job reads replicator.errors and
// unlinks it; a line the agent added in between was unlinked unread, and the job never told (a
// clean-clone CI run: a refused replica's line came 16 ms after the restore's). The lines it did
// not read come back in the file; what it read, or removed without reading any version, does not.
func TestReportLinesAddedBetweenTheJobsReadAndItsUnlink(t *testing.T) {
	for _, mode := range modes {
		t.Run(string(mode), func(t *testing.T) {
			var u *unreadRecorder
			dir, srv, _, _ := mountWithEventsWrapped(t, mode, 64<<20, func(rec *recorder) tiers.Events {
				u = &unreadRecorder{recorder: rec, given: make(chan []string, 10)}
				return u
			})
			ns := srv.Namespace()
			for _, name := range []string{layout.ReplicatorErrorsName, layout.ReplicatorFailedName} {
				p := filepath.Join(dir, name)
				expectNone := func(what string) {
					t.Helper()
					select {
					case l := <-u.given:
						t.Fatalf("%s: lines given back: %q", what, l)
					case <-time.After(300 * time.Millisecond):
					}
				}
				readAndUnlink := func() string {
					t.Helper()
					b, err := os.ReadFile(p)
					require.NoError(t, err)
					require.NoError(t, os.Remove(p))
					return string(b)
				}

				// Added between the read and the unlink: given back, alone.
				require.NoError(t, ns.WriteFile(name, []byte("one\n")))
				b, err := os.ReadFile(p)
				require.NoError(t, err)
				require.Equal(t, "one\n", string(b))
				require.NoError(t, ns.WriteFile(name, []byte("one\ntwo\n"))) // the agent's append
				require.NoError(t, os.Remove(p))
				select {
				case l := <-u.given:
					require.Equal(t, []string{"two\n"}, l)
				case <-time.After(5 * time.Second):
					t.Fatal("the unread line was not given back")
				}
				require.Equal(t, "two\n", readAndUnlink(), "the file holds the unread line again")
				expectNone("a version read whole")

				// Two appends in between, the second before a line the agent withdrew.
				require.NoError(t, ns.WriteFile(name, []byte("a\nb\n")))
				require.Equal(t, "a\nb\n", string(must(os.ReadFile(p))))
				require.NoError(t, ns.WriteFile(name, []byte("a\nb\nc\n")))
				require.NoError(t, ns.WriteFile(name, []byte("b\nc\nd\n"))) // a withdrawn, d added
				require.NoError(t, os.Remove(p))
				select {
				case l := <-u.given:
					require.Equal(t, []string{"c\n", "d\n"}, l)
				case <-time.After(5 * time.Second):
					t.Fatal("the unread lines were not given back")
				}
				require.Equal(t, "c\nd\n", readAndUnlink())

				// A version the job never read, with none read before it: removed for good.
				require.NoError(t, ns.WriteFile(name, []byte("x\n")))
				require.NoError(t, os.Remove(p))
				expectNone("a file removed unread")
				_, err = os.Stat(p)
				require.ErrorIs(t, err, os.ErrNotExist)
			}
		})
	}
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// TestReportRewrittenOnlyIfStillTheVersionRead: the agent reads replicator.errors to add a line,
// the job reads it and unlinks it, then the agent writes what it read plus its line: the job read
// the first lines twice (a black-box run: 10 to 90 lines twice in tight read loops). The write
// now fails with ErrReportChanged, and the agent's next try writes its line alone.
func TestReportRewrittenOnlyIfStillTheVersionRead(t *testing.T) {
	for _, mode := range modes {
		t.Run(string(mode), func(t *testing.T) {
			dir, srv, _, _ := mountWithEvents(t, mode)
			ns := srv.ns
			name := layout.ReplicatorErrorsName
			p := filepath.Join(dir, name)
			_, v0, err := ns.ReadReport(name, 1<<20)
			require.ErrorIs(t, err, os.ErrNotExist)
			require.Zero(t, v0)
			require.NoError(t, ns.ReplaceReport(name, []byte("a\n"), v0))
			old, v1, err := ns.ReadReport(name, 1<<20)
			require.NoError(t, err)
			require.NotZero(t, v1)
			require.ErrorIs(t, ns.ReplaceReport(name, []byte("x\n"), v0), tiers.ErrReportChanged, "a file is there now")

			b, err := os.ReadFile(p) // the job reads and unlinks, between the agent's read and write
			require.NoError(t, err)
			require.Equal(t, "a\n", string(b))
			require.NoError(t, os.Remove(p))
			require.ErrorIs(t, ns.ReplaceReport(name, append(old, "b\n"...), v1), tiers.ErrReportChanged)
			_, v, err := ns.ReadReport(name, 1<<20)
			require.ErrorIs(t, err, os.ErrNotExist)
			require.NoError(t, ns.ReplaceReport(name, []byte("b\n"), v))
			b, err = os.ReadFile(p)
			require.NoError(t, err)
			require.Equal(t, "b\n", string(b), "the line alone, not the one read before")

			_, v2, err := ns.ReadReport(name, 1<<20)
			require.NoError(t, err)
			require.NoError(t, ns.RemoveReport(name, v2))
			require.NoFileExists(t, p)
			require.NoError(t, ns.RemoveReport(name, 0), "nothing there: nothing to do")
		})
	}
}

// TestReportVersionOpenedAfterTwoReplacements: the job's lookup took version 1, the agent wrote
// versions 2 and 3, then the job opened and read version 1 and unlinked the name (version 3):
// the lines of 2 and 3 come back. Cut after one version, the chain lost them (a review).
func TestReportVersionOpenedAfterTwoReplacements(t *testing.T) {
	v1 := newReportState([]byte("a\n"), nil)
	v2 := newReportState([]byte("a\nb\n"), v1)
	v3 := newReportState([]byte("a\nb\nc\n"), v2)
	v1.opened.Store(true)
	require.Equal(t, []string{"b\n", "c\n"}, v3.unread([]byte("a\nb\nc\n")))

	// Past reportChain versions, the chain ends in what was read by then.
	cur := v3
	content := "a\nb\nc\n"
	for i := range 2 * reportChain {
		content += fmt.Sprintf("l%d\n", i)
		cur = newReportState([]byte(content), cur)
	}
	got := cur.unread([]byte(content))
	require.Len(t, got, 2+2*reportChain, "all but the line read: %q", got)
	require.Equal(t, "b\n", got[0])
	cur.opened.Store(true)
	require.Empty(t, cur.unread([]byte(content)), "the job opened the version it unlinked")
}
