package fs

import (
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestConcurrentRequestsWhileOneHandlerBlocks: go-fuse as patched in third_party/go-fuse keeps one
// reader of /dev/fuse while requests are answered quickly, and starts a spare reader only when
// a request is still being handled after a short delay. A handler that blocks must therefore
// not stop the mount: creates, stats and reads from other callers are still answered, and the
// blocked request completes once its handler goes on. Without the spare reader the second
// request waits forever behind the first.
func TestConcurrentRequestsWhileOneHandlerBlocks(t *testing.T) {
	for _, mode := range []PassthroughMode{PassthroughOff, PassthroughAuto} {
		t.Run(string(mode), func(t *testing.T) {
			dir, _, _, _ := mountWithEvents(t, mode)
			p := func(n string) string { return filepath.Join(dir, n) }
			require.NoError(t, os.WriteFile(p("held"), []byte("held"), 0o644))
			require.NoError(t, os.WriteFile(p("other"), []byte("other"), 0o644))

			// Twice: a second blocked handler after the first, once spare readers have been
			// started and have ended (each reader re-arms one timer of its own).
			for round := 1; round <= 2; round++ {
				entered, release := make(chan struct{}), make(chan struct{})
				var once sync.Once
				hook := func(f *fileNode) {
					if f.Path(nil) != "held" {
						return
					}
					once.Do(func() {
						close(entered)
						<-release
					})
				}
				frozenChecked.Store(&hook)
				var releaseOnce sync.Once
				unblock := func() { releaseOnce.Do(func() { close(release) }) }
				t.Cleanup(func() {
					unblock()
					frozenChecked.Store(nil)
				})

				truncated := make(chan error, 1)
				go func() { truncated <- os.Truncate(p("held"), int64(round)) }()
				select {
				case <-entered:
				case <-time.After(10 * time.Second):
					t.Fatal("the truncate never reached its handler")
				}

				// The truncate's handler now waits; every request below needs another reader.
				served := make(chan error, 1)
				go func() {
					for i := range 20 {
						name := p(fmt.Sprintf("new-%d-%d", round, i))
						if err := os.WriteFile(name, []byte("x"), 0o644); err != nil {
							served <- err
							return
						}
						if _, err := os.Stat(name); err != nil {
							served <- err
							return
						}
					}
					got, err := os.ReadFile(p("other"))
					if err == nil && string(got) != "other" {
						err = os.ErrInvalid
					}
					served <- err
				}()
				select {
				case err := <-served:
					require.NoError(t, err)
				case <-time.After(10 * time.Second):
					unblock() // let the mount go on so that the test can unmount
					t.Fatal("requests from other callers were not answered while one handler was blocked")
				}
				select {
				case err := <-truncated:
					t.Fatalf("the blocked truncate returned before its handler went on: %v", err)
				default:
				}

				unblock()
				select {
				case err := <-truncated:
					require.NoError(t, err)
				case <-time.After(10 * time.Second):
					t.Fatal("the truncate did not complete after its handler went on")
				}
				st, err := os.Stat(p("held"))
				require.NoError(t, err)
				require.EqualValues(t, round, st.Size())
			}
		})
	}
}
