package fs

import (
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
