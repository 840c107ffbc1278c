package fs

import (
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestReplacedWhileItsLookupRuns: the agent replaces a top-level file (a .meta of a step saved
// again) while a job's lookup of that name is between taking the node and answering. go-fuse
// linked the looked-up node under the name again after the answer: the replaced file came back
// in the tree, its bytes gone (open failed with ENOENT, stat said 0 bytes), and stayed until the
// next change (a clean-clone CI run: a test waited 10 s for the .meta of a step saved again). The
// new file must be what the job reads once the lookup is answered, and what the agent reads.
func TestReplacedWhileItsLookupRuns(t *testing.T) {
	for _, mode := range modes {
		t.Run(string(mode), func(t *testing.T) { replacedWhileLookedUp(t, mode, false) })
	}
}

// TestReplacedWhileAReaddirplusLooksItUp: the same race through a listing (READDIRPLUS, which
// the kernel asks for a job's first listing of a directory: glob, os.listdir), whose entries
// go-fuse linked again just as a lookup's (a review).
func TestReplacedWhileAReaddirplusLooksItUp(t *testing.T) {
	replacedWhileLookedUp(t, PassthroughOn, true)
}

// replacedWhileLookedUp stalls a lookup of a .meta (by a read, or by a listing when listing)
// after it took the node, replaces the .meta meanwhile, and checks that the replacement stays.
func replacedWhileLookedUp(t *testing.T, mode PassthroughMode, listing bool) {
	{
		{
			dir, srv, _, _ := mountWithEvents(t, mode)
			ns := srv.Namespace()
			const name = "job-s1-n0-w0.meta"
			p := filepath.Join(dir, name)
			require.NoError(t, ns.WriteFile(name, []byte("first")))

			entered, released := make(chan struct{}), make(chan struct{})
			var enter, free sync.Once
			hook := func(n string) {
				if n == name {
					enter.Do(func() { close(entered) })
					<-released
				}
			}
			lookedUpHook.Store(&hook)
			release := func() { free.Do(func() { close(released) }) }
			t.Cleanup(func() { lookedUpHook.Store(nil); release() })

			read := make(chan string, 1)
			go func() {
				if listing {
					ents, err := os.ReadDir(dir)
					if err != nil {
						read <- err.Error()
						return
					}
					for _, e := range ents {
						if e.Name() == name {
							read <- "first" // listed; what it reads is checked below
							return
						}
					}
					read <- "not listed"
					return
				}
				b, err := os.ReadFile(p)
				if err != nil {
					read <- err.Error()
					return
				}
				read <- string(b)
			}()
			select {
			case <-entered:
			case <-time.After(5 * time.Second):
				t.Fatal("the lookup never reached the agent (no READDIRPLUS for the listing?)")
			}
			written := make(chan error, 1)
			go func() { written <- ns.WriteFile(name, []byte("second")) }() // its notification waits for the lookup
			require.Eventually(t, func() bool {
				b, _ := ns.ReadFile(name, 100)
				return string(b) == "second"
			}, 5*time.Second, time.Millisecond, "the agent's replacement")
			release()
			lookedUpHook.Store(nil)
			select {
			case r := <-read:
				require.Contains(t, []string{"first", "second"}, r, "the racing read sees one of the two")
			case <-time.After(5 * time.Second):
				t.Fatal("the job's read never returned")
			}
			require.NoError(t, <-written)

			b, err := ns.ReadFile(name, 100)
			require.NoError(t, err)
			require.Equal(t, "second", string(b), "the agent's tree holds the replacement")
			b, err = os.ReadFile(p)
			require.NoError(t, err, "the job's read after the lookup")
			require.Equal(t, "second", string(b))
		}
	}
}
