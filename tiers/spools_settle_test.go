package tiers

import (
	"fmt"
	"os/exec"
	"testing"
	"time"
)

// Settle waits while the spool is held by an agent that is exiting (a kill -9 a moment ago: its
// lock goes with its last file descriptor), and not while a live agent holds it. Before, `mtcfs
// spool free` right after a kill -9 refused, naming the dying agent as running (found by a
// black-box run).
func TestSettleWaitsForAnExitingAgent(t *testing.T) {
	dir := t.TempDir()
	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	hold := func(d time.Duration) *exec.Cmd {
		t.Helper()
		c := exec.Command("flock", "--nonblock", dir, "sleep", fmt.Sprintf("%g", d.Seconds()))
		if err := c.Start(); err != nil {
			t.Skip("flock(1):", err)
		}
		t.Cleanup(func() { c.Process.Kill(); c.Wait() })
		for deadline := time.Now().Add(5 * time.Second); ; {
			f, err := LockSpool(dir)
			if err != nil {
				return c
			}
			f.Close()
			if time.Now().After(deadline) {
				t.Fatal("flock(1) did not take the spool's lock")
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	h := Spools{Dirs: func() []string { return nil }}

	// The recorded agent is gone; the lock is released 300 ms later.
	holder := hold(300 * time.Millisecond)
	s := h.Settle(SpoolInfo{Dir: dir, InUse: true, AgentPID: dead.Process.Pid}, 10*time.Second)
	if s.InUse {
		t.Fatalf("still in use after the exiting agent let go: %+v", s)
	}
	holder.Wait()

	// A live agent (this process stands for it) holding the spool: no wait.
	hold(time.Minute)
	start := time.Now()
	s = h.Settle(SpoolInfo{Dir: dir, InUse: true, AgentPID: 1}, 10*time.Second)
	if !s.InUse || time.Since(start) > 5*time.Second {
		t.Fatalf("a spool a live agent holds: %+v after %v", s, time.Since(start))
	}
}
