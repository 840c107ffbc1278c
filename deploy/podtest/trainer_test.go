package podtest

// The trainer: this test binary, run again inside the trainer's container in place of the
// manifest's training command, drives the scripted Orbax client (internal/jobsim) against
// CHECKPOINT_DIR as the container sees it. The test sends it one command a line on stdin and
// reads one reply a line on stdout.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mtcfs/mtcfs/internal/jobsim"
)

const trainerRoleEnv = "MTCFS_PODTEST_ROLE"

// trainerMain serves the commands:
//
//	mount        what is mounted at CHECKPOINT_DIR here: none, live (mtcfs answers) or stale
//	start JOB    a new incarnation of job JOB: the handshake and restore; "ok STEP FOUND"
//	save STEP    saves a step as Orbax does
//	verify STEP  reads the restored step back and compares every byte
//	quit         exits
func trainerMain() int {
	dir := os.Getenv("CHECKPOINT_DIR")
	if dir == "" {
		fmt.Println("err CHECKPOINT_DIR is not set")
		return 1
	}
	ctx := context.Background()
	var o *jobsim.Orbax
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		f := strings.Fields(in.Text())
		reply := func(err error, format string, args ...any) {
			if err != nil {
				fmt.Println("err " + strings.ReplaceAll(err.Error(), "\n", " | "))
				return
			}
			fmt.Printf("ok "+format+"\n", args...)
		}
		if len(f) == 0 {
			continue
		}
		var step int64
		if len(f) == 2 {
			step, _ = strconv.ParseInt(f[1], 10, 64)
		}
		switch f[0] {
		case "mount":
			reply(nil, "%s", mountState(dir))
		case "start":
			o = &jobsim.Orbax{Dir: dir, Job: f[1], Nodes: 1, Poll: 100 * time.Millisecond, Timeout: 60 * time.Second}
			s, found, err := o.Start(ctx)
			reply(err, "%d %v", s, found)
		case "save":
			reply(o.Save(ctx, step), "%d", step)
		case "verify":
			reply(o.VerifyRestored(ctx, step), "%d", step)
		case "quit":
			return 0
		default:
			reply(fmt.Errorf("unknown command %q", f[0]), "")
		}
	}
	return 0
}

// mountState tells what is mounted at dir without waiting on it: the mount table says whether
// an mtcfs mount is there, statfs whether its agent answers (a dead agent's mount fails at once
// with ENOTCONN).
func mountState(dir string) string {
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return "error:" + err.Error()
	}
	fstype := ""
	for _, l := range strings.Split(string(data), "\n") {
		// id parent major:minor root mountpoint options ... - fstype source superopts
		pre, post, ok := strings.Cut(l, " - ")
		f, g := strings.Fields(pre), strings.Fields(post)
		if ok && len(f) >= 5 && len(g) >= 1 && f[4] == dir {
			fstype = g[0] // the last one is on top
		}
	}
	if fstype != "fuse.mtcfs" {
		return "none"
	}
	var st unix.Statfs_t
	switch err := unix.Statfs(dir, &st); {
	case err == nil:
		return "live"
	case errors.Is(err, unix.ENOTCONN), errors.Is(err, unix.ECONNABORTED):
		return "stale"
	default:
		return "error:" + err.Error()
	}
}

// trainer is the test's side of a running trainer.
type trainer struct{ p *proc }

// call sends a command and returns the reply's text after "ok ", or an error with the reply
// and the trainer's log.
func (tr trainer) call(cmd string, timeout time.Duration) (string, error) {
	if _, err := fmt.Fprintln(tr.p.stdin, cmd); err != nil {
		return "", fmt.Errorf("trainer %s: %v\n%s", cmd, err, tr.p.log())
	}
	type line struct {
		s   string
		err error
	}
	ch := make(chan line, 1)
	go func() { s, err := tr.p.stdout.ReadString('\n'); ch <- line{s, err} }()
	select {
	case l := <-ch:
		if l.err != nil {
			return "", fmt.Errorf("trainer %s: %v\n%s", cmd, l.err, tr.p.log())
		}
		s := strings.TrimSpace(l.s)
		if rest, ok := strings.CutPrefix(s, "ok "); ok {
			return rest, nil
		}
		return "", fmt.Errorf("trainer %s: %s", cmd, s)
	case <-time.After(timeout):
		return "", fmt.Errorf("trainer %s: no reply within %v\n%s", cmd, timeout, tr.p.log())
	}
}

// waitMount polls the trainer's view of CHECKPOINT_DIR until it is want.
func (tr trainer) waitMount(want string, timeout time.Duration) (string, error) {
	deadline := time.Now().Add(timeout)
	for {
		got, err := tr.call("mount", 10*time.Second)
		if err != nil || got == want || time.Now().After(deadline) {
			return got, err
		}
		time.Sleep(100 * time.Millisecond)
	}
}
