package fs

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mtcfs/mtcfs/tiers"
	"golang.org/x/sys/unix"
)

// TestENOSPC fills the spool past --memory: the write that does not fit fails with ENOSPC, the
// files written before stay intact, statfs reports the budget, and deleting a file gives the
// space back. It runs on both data paths and on both kinds of budget enforcement.
func TestENOSPC(t *testing.T) {
	const budget = 32 << 20
	cases := []struct {
		name       string
		mode       PassthroughMode
		mountTmpfs bool
	}{
		{"passthrough-tmpfs", PassthroughOn, true},
		{"fallback-tmpfs", PassthroughOff, true},
		{"fallback-accounted", PassthroughOff, false}, // what an unprivileged agent gets
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var dir string
			if tc.mountTmpfs {
				dir, _ = testMount(t, tc.mode, budget)
			} else {
				dir, _ = testMountSpool(t, tc.mode, tiers.SpoolConfig{Budget: budget})
			}
			var st syscall.Statfs_t
			require.NoError(t, syscall.Statfs(dir, &st))
			require.InDelta(t, budget, int64(st.Blocks)*st.Bsize, budget/50, "statfs size should be the budget")

			chunk := bytes.Repeat([]byte{0xAB}, 1<<20)
			var kept []string
			var sawENOSPC bool
			for i := 0; i < 64 && !sawENOSPC; i++ {
				p := filepath.Join(dir, "f", string(rune('a'+i/26))+string(rune('a'+i%26)))
				require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
				f, err := os.Create(p)
				require.NoError(t, err)
				for j := 0; j < 4; j++ {
					if _, err := f.Write(chunk); err != nil {
						require.True(t, errors.Is(err, syscall.ENOSPC), "want ENOSPC, got %v", err)
						sawENOSPC = true
						break
					}
				}
				f.Close()
				if !sawENOSPC {
					kept = append(kept, p)
				}
			}
			require.True(t, sawENOSPC, "writing 64 MiB into a %d MiB budget never failed", budget>>20)
			require.NotEmpty(t, kept)

			require.NoError(t, syscall.Statfs(dir, &st))
			require.Less(t, int64(st.Bavail)*st.Bsize, int64(2<<20), "statfs should show the spool nearly full")

			for _, p := range kept {
				got, err := os.ReadFile(p)
				require.NoError(t, err)
				require.Equal(t, 4<<20, len(got), "%s lost bytes after ENOSPC", p)
				require.True(t, bytes.Equal(got[:1<<20], chunk) && bytes.Equal(got[3<<20:], chunk), "%s corrupted", p)
			}

			// Space comes back when files go away.
			for _, p := range kept[:2] {
				require.NoError(t, os.Remove(p))
			}
			require.NoError(t, os.WriteFile(filepath.Join(dir, "after"), bytes.Repeat(chunk, 4), 0o644))
		})
	}
}

// TestENOSPCSpaceReturnsAtOnce replays a job that hits ENOSPC, deletes its partial file and
// writes again at once (SPEC §10: after the job deletes files, their bytes are available to its
// next write). close(2) does not wait for the FUSE release after which the agent frees the
// spool file, so without space.go this races and fails a fair share of the loops; each order of
// close and unlink, and each kind of next write, is run many times on every data path and kind
// of budget. MTCFS_ENOSPC_LOOPS overrides the number of loops.
func TestENOSPCSpaceReturnsAtOnce(t *testing.T) {
	const budget = 16 << 20
	loops := 50
	if testing.Short() {
		loops = 20
	}
	if s := os.Getenv("MTCFS_ENOSPC_LOOPS"); s != "" {
		n, err := strconv.Atoi(s)
		require.NoError(t, err)
		loops = n
	}
	cases := []struct {
		name       string
		mode       PassthroughMode
		mountTmpfs bool
	}{
		{"passthrough-tmpfs", PassthroughOn, true},
		{"fallback-tmpfs", PassthroughOff, true},
		{"fallback-accounted", PassthroughOff, false},
	}
	// Orders of the job's steps after the failed write: close and unlink the partial file in
	// either order (or replace it by renaming an empty file over it), then write to a new file
	// or through a descriptor opened before.
	orders := []struct {
		name         string
		unlinkFirst  bool
		renameOver   bool
		writeOldFd   bool
		notWithPthru bool // not guaranteed with passthrough: see space.go
	}{
		{"close-unlink-create", false, false, false, false},
		{"close-unlink-oldfd", false, false, true, false},
		{"close-renameover-oldfd", false, true, true, false},
		{"unlink-close-create", true, false, false, false},
		{"unlink-close-oldfd", true, false, true, true},
	}
	for _, tc := range cases {
		for _, order := range orders {
			if order.notWithPthru && tc.mode == PassthroughOn {
				continue
			}
			t.Run(tc.name+"/"+order.name, func(t *testing.T) {
				var dir string
				if tc.mountTmpfs {
					dir, _ = testMount(t, tc.mode, budget)
				} else {
					dir, _ = testMountSpool(t, tc.mode, tiers.SpoolConfig{Budget: budget})
				}
				// Ballast takes all but 2 MiB, so that each loop has little to fill.
				chunk := bytes.Repeat([]byte{0xCD}, 1<<20)
				require.NoError(t, os.WriteFile(filepath.Join(dir, "ballast"), bytes.Repeat(chunk, budget>>20-2), 0o644))
				small := bytes.Repeat([]byte{0x11}, 64<<10)
				big, next := filepath.Join(dir, "partial"), filepath.Join(dir, "next")
				var failed []string
				nfailed := 0
				for i := 0; i < loops; i++ {
					old, err := os.Create(next)
					require.NoError(t, err)
					f, err := os.Create(big)
					require.NoError(t, err)
					werr := writeUntilFull(f, chunk)
					require.ErrorIs(t, werr, syscall.ENOSPC, "loop %d: filling the spool", i)
					switch {
					case order.unlinkFirst:
						require.NoError(t, os.Remove(big))
						require.NoError(t, f.Close())
					case order.renameOver:
						require.NoError(t, f.Close())
						require.NoError(t, os.WriteFile(big+".new", nil, 0o644))
						require.NoError(t, os.Rename(big+".new", big))
					default:
						require.NoError(t, f.Close())
						require.NoError(t, os.Remove(big))
					}
					if order.writeOldFd {
						_, err = old.Write(small)
						old.Close()
					} else {
						old.Close()
						err = os.WriteFile(next, small, 0o644)
					}
					if err != nil {
						nfailed++
						if len(failed) < 3 {
							failed = append(failed, fmt.Sprintf("loop %d: %v", i, err))
						}
					}
					require.NoError(t, os.Remove(next))
					if order.renameOver {
						require.NoError(t, os.Remove(big))
					}
				}
				require.Zero(t, nfailed, "%d of %d writes right after deleting the partial file failed: %v", nfailed, loops, failed)
			})
		}
	}
}

// TestENOSPCWriteWaitsForADelayedRelease: the job deletes its partial file, closes it, and
// writes through a descriptor opened before; go-fuse has read the RELEASE of the close but a
// loaded machine has not run it yet (the hook delays it). The write that failed with ENOSPC
// waits for it and is retried, rather than failing after the short grace given to a file found
// really open (1 of 50 such writes failed in a clean-clone CI run).
func TestENOSPCWriteWaitsForADelayedRelease(t *testing.T) {
	const budget = 16 << 20
	for _, tc := range []struct {
		name       string
		mountTmpfs bool
	}{{"fallback-tmpfs", true}, {"fallback-accounted", false}} {
		t.Run(tc.name, func(t *testing.T) {
			dir, _ := testMountSpool(t, PassthroughOff, tiers.SpoolConfig{Budget: budget, MountTmpfs: tc.mountTmpfs})
			chunk := bytes.Repeat([]byte{0xCD}, 1<<20)
			require.NoError(t, os.WriteFile(filepath.Join(dir, "ballast"), bytes.Repeat(chunk, budget>>20-2), 0o644))
			delay := func() { time.Sleep(3 * releaseGraceOpen) }
			releaseHook.Store(&delay)
			t.Cleanup(func() { releaseHook.Store(nil) })
			big, next := filepath.Join(dir, "partial"), filepath.Join(dir, "next")
			for i := range 5 {
				old, err := os.Create(next)
				require.NoError(t, err)
				t.Cleanup(func() { old.Close() }) // before the unmount, which an open file would hold up
				f, err := os.Create(big)
				require.NoError(t, err)
				t.Cleanup(func() { f.Close() })
				werr := writeUntilFull(f, chunk)
				require.ErrorIs(t, werr, syscall.ENOSPC, "loop %d: filling the spool", i)
				require.NoError(t, os.Remove(big))
				require.NoError(t, f.Close())
				_, err = old.Write(bytes.Repeat([]byte{0x11}, 64<<10))
				require.NoError(t, err, "loop %d: the write right after deleting and closing the partial file", i)
				require.NoError(t, old.Close())
				require.NoError(t, os.Remove(next))
			}
			// A file the job really holds open: its first failed write waits the long grace,
			// the next ones only the short one (a review: each waited 250 ms).
			releaseHook.Store(nil)
			held, err := os.Create(big)
			require.NoError(t, err)
			t.Cleanup(func() { held.Close() })
			werr := writeUntilFull(held, chunk)
			require.ErrorIs(t, werr, syscall.ENOSPC)
			require.NoError(t, os.Remove(big)) // doomed, and found really open by the unlink's wait
			other, err := os.Create(next)
			require.NoError(t, err)
			t.Cleanup(func() { other.Close() })
			var took []time.Duration
			for range 4 {
				start := time.Now()
				_, err := other.Write(bytes.Repeat(chunk, 2))
				took = append(took, time.Since(start))
				require.ErrorIs(t, err, syscall.ENOSPC, "the held file keeps its bytes")
			}
			assert.GreaterOrEqual(t, took[0], releaseGraceFailed, "the first failed write waits for a release: %v", took)
			// Three more at releaseGraceFailed each would take 750 ms: a bound with room for a
			// loaded machine's scheduling.
			assert.Less(t, took[1]+took[2]+took[3], 2*releaseGraceFailed, "later failed writes do not wait as long: %v", took)
			require.NoError(t, held.Close())
		})
	}
}

// writeUntilFull writes chunk to f up to 4 times, until a write fails, and returns its error
// (ENOSPC once the 2 MiB left by the tests' ballast is used).
func writeUntilFull(f *os.File, chunk []byte) error {
	for range 4 {
		if _, err := f.Write(chunk); err != nil {
			return err
		}
	}
	return nil
}

// TestAgentWritesPastAnAccountedBudget: with an agent-accounted budget (an unprivileged agent)
// the job's writes fail with ENOSPC once the budget is used, but the agent's own files (a line
// in replicator.failed, a .meta, jax-init-info.txt) are still written, as the tmpfs headroom
// lets them be as root. Before, a kept spool that held more than the budget (hard links counted
// once per name) failed the agent's start: "spool memory budget exhausted" (found by a
// black-box run).
func TestAgentWritesPastAnAccountedBudget(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mount tests need root")
	}
	const budget = 16 << 20
	base := t.TempDir()
	dir := filepath.Join(base, "mnt")
	require.NoError(t, os.Mkdir(dir, 0o755))
	spool, err := tiers.OpenSpool(tiers.SpoolConfig{Dir: filepath.Join(base, "spool"), Budget: budget})
	require.NoError(t, err)
	require.False(t, spool.KernelEnforced())
	srv, err := Mount(dir, Options{Spool: spool, Passthrough: PassthroughOff, InProcess: true})
	if err != nil {
		spool.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		assert.NoError(t, srv.Unmount())
		spool.Close()
	})
	err = os.WriteFile(filepath.Join(dir, "ballast"), make([]byte, budget+1), 0o644)
	require.ErrorIs(t, err, syscall.ENOSPC, "the job's write past the budget")
	line := []byte("2030-01-01T00:00:00Z job=j node=0/1 FATAL …\n")
	require.NoError(t, srv.Namespace().WriteFile("replicator.failed", line), "the agent's own file, with the budget used")
	got, err := os.ReadFile(filepath.Join(dir, "replicator.failed"))
	require.NoError(t, err)
	assert.Equal(t, line, got)
	err = os.WriteFile(filepath.Join(dir, "more"), []byte("x"), 0o644)
	assert.ErrorIs(t, err, syscall.ENOSPC, "the job's writes still fail")
}

// TestControlFilesPastAFullBudget: with the budget used up (a save cut short by ENOSPC, or a
// kept spool that holds more than the budget of an agent without root), the job can still
// write its replicator.yaml: its restart, which restores from RAM and removes the leftovers,
// would otherwise fail on it (found by a black-box run, without root). A control file is at
// most tiers.MaxConfigSize; other files still fail.
func TestControlFilesPastAFullBudget(t *testing.T) {
	const budget = 16 << 20
	for _, tmpfs := range []bool{true, false} {
		t.Run(fmt.Sprintf("tmpfs=%v", tmpfs), func(t *testing.T) {
			dir, _ := testMountSpool(t, PassthroughOff, tiers.SpoolConfig{Budget: budget, MountTmpfs: tmpfs})
			err := os.WriteFile(filepath.Join(dir, "ballast"), make([]byte, budget+(2<<20)), 0o644)
			require.ErrorIs(t, err, syscall.ENOSPC)
			yaml := []byte("job-name: j\nframework: orbax\nnode-rank: 0\nnodes: 1\npeer-ranks: []\nbackup-interval-minutes: 30")
			require.NoError(t, os.WriteFile(filepath.Join(dir, "replicator.yaml.tmp"), yaml, 0o644), "the job's yaml, with the budget used up")
			require.NoError(t, os.Rename(filepath.Join(dir, "replicator.yaml.tmp"), filepath.Join(dir, "replicator.yaml")))
			require.NoError(t, os.WriteFile(filepath.Join(dir, "replicator.yaml"), yaml, 0o644), "written directly (NeMo)")
			// Another file still fails (on a tmpfs, past what is left of the 64 KiB of headroom
			// the yaml freed).
			err = os.WriteFile(filepath.Join(dir, "other"), make([]byte, tiers.HeadroomChunk+1), 0o644)
			assert.ErrorIs(t, err, syscall.ENOSPC, "another file still fails")
			// A control file cannot take another name (a job renaming or linking its yaml away
			// again and again would overdraw the budget): EXDEV, so mv copies, and the copy is
			// charged like any file.
			yamlPath := filepath.Join(dir, "replicator.yaml")
			assert.ErrorIs(t, os.Rename(yamlPath, filepath.Join(dir, "renamed")), syscall.EXDEV)
			assert.ErrorIs(t, os.Link(yamlPath, filepath.Join(dir, "linked")), syscall.EXDEV)
			require.NoError(t, os.Mkdir(filepath.Join(dir, "sub"), 0o755))
			assert.ErrorIs(t, os.Rename(yamlPath, filepath.Join(dir, "sub", "replicator.yaml")), syscall.EXDEV)
			require.NoError(t, os.Rename(yamlPath, filepath.Join(dir, "replicator.yaml.tmp")), "between control names")
			// Written before it is a control file, the job's writes are charged as ever.
			plain := filepath.Join(dir, "plain")
			err = os.WriteFile(plain, make([]byte, tiers.HeadroomChunk+1), 0o644)
			assert.ErrorIs(t, err, syscall.ENOSPC)
			require.NoError(t, os.Rename(filepath.Join(dir, "replicator.yaml.tmp"), filepath.Join(dir, "replicator.yaml")))
			require.NoError(t, os.Remove(filepath.Join(dir, "replicator.yaml")))
		})
	}
}

// TestENOSPCSpaceReturnsWhileTheAgentReadsTheFile: the agent hashes (and pushes early) every
// file the job closes, reading its spool file on a descriptor of its own. A job that filled its
// budget, closed and deleted the file and wrote again at once got ENOSPC while that read still
// held the bytes on tmpfs (a black-box run: 12 to 17 of 18 such writes failed). A hold
// (HoldSpoolFile) is cancelled when the file loses its last name, and the requests that need the
// space wait until the holder has closed its descriptor; a hold of a file that keeps a name, or
// ended before the delete, costs nothing.
func TestENOSPCSpaceReturnsWhileTheAgentReadsTheFile(t *testing.T) {
	const budget = 16 << 20
	for _, mode := range modes {
		t.Run(string(mode), func(t *testing.T) {
			dir, srv, _, _ := mountWithEventsBudget(t, mode, budget)
			ns := srv.Namespace()
			chunk := bytes.Repeat([]byte{0xCD}, 1<<20)
			require.NoError(t, os.WriteFile(filepath.Join(dir, "ballast"), bytes.Repeat(chunk, budget>>20-4), 0o644))
			require.NoError(t, os.Mkdir(filepath.Join(dir, "5.orbax-checkpoint-tmp"), 0o755))
			name := "5.orbax-checkpoint-tmp/big"
			big := filepath.Join(dir, name)
			for i := range 3 {
				require.NoError(t, os.WriteFile(big, bytes.Repeat(chunk, 3), 0o644), "loop %d", i)
				p, held, end, err := ns.HoldSpoolFile(context.Background(), name)
				require.NoError(t, err)
				fd, err := unix.Open(p, unix.O_RDONLY|unix.O_CLOEXEC, 0)
				require.NoError(t, err)
				// The agent's read, which notices the cancellation after a while (a chunk being
				// hashed on a loaded machine).
				done := make(chan struct{})
				go func() {
					defer close(done)
					<-held.Done()
					time.Sleep(100 * time.Millisecond)
					unix.Close(fd)
					end()
				}()
				t.Cleanup(func() { <-done })
				require.NoError(t, os.Remove(big))
				require.Error(t, held.Err(), "loop %d: the delete cancels the agent's read", i)
				err = os.WriteFile(filepath.Join(dir, "next"), bytes.Repeat(chunk, 4), 0o644)
				require.NoError(t, err, "loop %d: a write right after the delete needs the deleted file's bytes", i)
				<-done
				end() // a second end does nothing
				require.NoError(t, os.Remove(filepath.Join(dir, "next")))
			}
			// A hold of a file that keeps its name is not cancelled, and ends without a trace.
			require.NoError(t, os.WriteFile(big, []byte("kept"), 0o644))
			_, held, end, err := ns.HoldSpoolFile(context.Background(), name)
			require.NoError(t, err)
			require.NoError(t, os.Rename(big, big+".renamed"))
			require.NoError(t, held.Err(), "a rename keeps the file")
			end()
			_, _, _, err = ns.HoldSpoolFile(context.Background(), name)
			require.ErrorIs(t, err, os.ErrNotExist)
		})
	}
}
