package main

// Ownership and non-root use (SPEC §10): a job running as another uid writes into a mount a root
// agent serves, and an ordinary user mounts for development through fusermount3.

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// asUser runs a shell script in dir as uid:gid (no supplementary groups) and returns its output.
func asUser(t *testing.T, uid, gid int, dir, script string) (string, error) {
	t.Helper()
	cmd := exec.Command("setpriv", fmt.Sprintf("--reuid=%d", uid), fmt.Sprintf("--regid=%d", gid), "--clear-groups", "sh", "-ec", script)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// orbaxSaveScript is the file-system side of an Orbax job's start-up and one save of step 1, in
// shell, so that it can run as another user.
const orbaxSaveScript = `
printf 'job-name: uidjob\nframework: orbax\nnode-rank: 0\nnodes: 1\npeer-ranks: []\nbackup-interval-minutes: 60' > replicator.yaml.tmp
mv replicator.yaml.tmp replicator.yaml
i=0; while [ -e replicator.yaml ]; do i=$((i+1)); [ $i -lt 500 ] || { echo "yaml not consumed"; exit 1; }; sleep 0.02; done
i=0; while [ ! -e uidjob-s0-n0-w0.restore ]; do i=$((i+1)); [ $i -lt 500 ] || { echo "no marker"; exit 1; }; sleep 0.02; done
rm -f uidjob-s0-n0-w0.restore replicator.errors
mkdir -p 1.orbax-checkpoint-tmp/state
echo '{"step": 1}' > 1.orbax-checkpoint-tmp/_CHECKPOINT_METADATA
head -c 65536 /dev/zero | tr '\0' 'w' > 1.orbax-checkpoint-tmp/state/array
mv 1.orbax-checkpoint-tmp 1
i=0; while [ ! -e uidjob-s1-n0-w0.meta ]; do i=$((i+1)); [ $i -lt 500 ] || { echo "not sealed"; exit 1; }; sleep 0.02; done
echo saved
`

// TestStickyMountRootJobOwnsItsMarkers: in a sticky mount root (--mode 1777, root's), only an
// entry's owner may rename or remove it; the restore markers, reports and prerestore the agent
// makes for a job running as uid 1000 are that job's, so that it removes and renames them as
// Orbax does. They were root's, and every restore failed with EPERM (black-box h57, with
// Orbax and NeMo clients).
func TestStickyMountRootJobOwnsItsMarkers(t *testing.T) {
	needRoot(t)
	n := newRepNode(t)
	tmp := filepath.Clean(os.TempDir())
	for p := filepath.Dir(n.dir); p != tmp; p = filepath.Dir(p) {
		require.True(t, strings.HasPrefix(p, tmp+"/"), "%s is not below TMPDIR %s", p, tmp)
		require.NoError(t, os.Chmod(p, 0o755))
	}
	a := n.start(t, "--uid", "0", "--gid", "0", "--mode", "1777")
	out, err := asUser(t, 1000, 1000, n.dir, orbaxSaveScript) // removes its fresh-start marker
	require.NoError(t, err, "the job as uid 1000: %s\n%s", out, a.log())
	require.Contains(t, out, "saved")
	out, err = asUser(t, 1000, 1000, n.dir, `
printf 'job-name: uidjob\nframework: orbax\nnode-rank: 0\nnodes: 1\npeer-ranks: []\nbackup-interval-minutes: 60' > replicator.yaml
i=0; while [ ! -e uidjob-s1-n0-w0.restore ]; do i=$((i+1)); [ $i -lt 500 ] || { echo "no marker"; exit 1; }; sleep 0.02; done
stat -c '%n %u:%g' uidjob-s1-n0-w0.restore replicator.prerestore
mv uidjob-s1-n0-w0.restore 1
rm replicator.prerestore
cat 1/_CHECKPOINT_METADATA`)
	require.NoError(t, err, "%s\n%s", out, a.log())
	assert.Contains(t, out, "uidjob-s1-n0-w0.restore 1000:1000\nreplicator.prerestore 1000:1000\n")
	assert.Contains(t, out, `{"step": 1}`)

	// The agent is killed and restarted under the running job: its notice in replicator.failed
	// is the job's too, before any new handshake (it was root's, and the job's unlink failed
	// with EPERM at every check: black-box h60).
	killAgent(t, a)
	a = n.start(t, "--uid", "0", "--gid", "0", "--mode", "1777")
	out, err = asUser(t, 1000, 1000, n.dir, `
i=0; while [ ! -e replicator.failed ]; do i=$((i+1)); [ $i -lt 500 ] || { echo "no notice"; exit 1; }; sleep 0.02; done
stat -c '%n %u:%g' replicator.failed
rm replicator.failed && echo removed`)
	require.NoError(t, err, "%s\n%s", out, a.log())
	assert.Contains(t, out, "replicator.failed 1000:1000\nremoved")
}

// TestJobRunningAsAnotherUser: a root agent serving a directory that belongs to uid 1000 gives
// the mount root to uid 1000, whose job saves through the replicator protocol and restores; with
// --uid naming someone else, the same job is refused (EACCES), as on that directory.
func TestJobRunningAsAnotherUser(t *testing.T) {
	needRoot(t)
	if _, err := exec.LookPath("setpriv"); err != nil {
		t.Fatalf("setpriv (util-linux) is needed: %v", err)
	}
	n := newRepNode(t)
	// t.TempDir makes the directories below TMPDIR 0700. Stopping at a TMPDIR written otherwise
	// (a trailing slash, a double one) never happened: the loop went on to chmod /tmp and / (a
	// review).
	tmp := filepath.Clean(os.TempDir())
	for p := filepath.Dir(n.dir); p != tmp; p = filepath.Dir(p) {
		require.True(t, strings.HasPrefix(p, tmp+"/"), "%s is not below TMPDIR %s", p, tmp)
		require.NoError(t, os.Chmod(p, 0o755))
	}
	require.NoError(t, os.Chown(n.dir, 1000, 1000))
	a := n.start(t)
	var st syscall.Stat_t
	require.NoError(t, syscall.Stat(n.dir, &st))
	require.Equal(t, uint32(1000), st.Uid, "the root belongs to the mount point's owner")
	require.Equal(t, uint32(0o755), st.Mode&0o7777)

	out, err := asUser(t, 1000, 1000, n.dir, "umask 077\n"+orbaxSaveScript) // a private checkpoint
	require.NoError(t, err, "the job as uid 1000: %s\n%s", out, a.log())
	require.Contains(t, out, "saved")
	// The job's user asks the root agent how its checkpoints stand. Before, mtcfs status
	// looked in that user's agent registry only and said no agent was running.
	bin := filepath.Join(filepath.Dir(n.dir), "mtcfs-for-uid-1000")
	data, err := os.ReadFile(binPath)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(bin, data, 0o755))
	out, err = asUser(t, 1000, 1000, n.dir, bin+" status "+n.dir)
	require.NoError(t, err, "mtcfs status as the job's user: %s", out)
	assert.Contains(t, out, "job        uidjob (orbax)")
	assert.Contains(t, out, "latest committed 1")
	// The job restarts: the restore marker and the sealed data are readable by it.
	out, err = asUser(t, 1000, 1000, n.dir, `
printf 'job-name: uidjob\nframework: orbax\nnode-rank: 0\nnodes: 1\npeer-ranks: []\nbackup-interval-minutes: 60' > replicator.yaml
i=0; while [ ! -e uidjob-s1-n0-w0.restore ]; do i=$((i+1)); [ $i -lt 500 ] || { echo "no marker"; exit 1; }; sleep 0.02; done
mv uidjob-s1-n0-w0.restore 1
cat 1/_CHECKPOINT_METADATA
wc -c < 1/state/array`)
	require.NoError(t, err, "%s\n%s", out, a.log())
	assert.Contains(t, out, `{"step": 1}`)
	assert.Contains(t, out, "65536")

	// The agent restarts (an upgrade, node maintenance) and the job with it: the step comes
	// back from the spool as the job saved it, uid 1000's, 0700 and 0600. Before, it came back
	// as root's, 0755 and 0644: readable by every local user.
	stopAgent(t, a)
	a = n.start(t)
	restart := func(uid int) string {
		t.Helper()
		out, err := asUser(t, uid, uid, n.dir, `
rm -f 1
printf 'job-name: uidjob\nframework: orbax\nnode-rank: 0\nnodes: 1\npeer-ranks: []\nbackup-interval-minutes: 60' > replicator.yaml
i=0; while [ ! -e uidjob-s1-n0-w0.restore ]; do i=$((i+1)); [ $i -lt 500 ] || { echo "no marker"; exit 1; }; sleep 0.02; done
mv uidjob-s1-n0-w0.restore 1
cat 1/_CHECKPOINT_METADATA
stat -c '%n %u:%g %a' 1/ 1/state 1/state/array 1/_CHECKPOINT_METADATA`)
		require.NoError(t, err, "%s\n%s", out, a.log())
		return out
	}
	out = restart(1000)
	assert.Contains(t, out, `{"step": 1}`)
	assert.Contains(t, out, "1/ 1000:1000 700\n1/state 1000:1000 700\n1/state/array 1000:1000 600\n1/_CHECKPOINT_METADATA 1000:1000 600")
	// The job restarts as another user (its image changed, and the directory with it): the step
	// is given to that user, modes and groups kept, so that it can read it. Kept as uid 1000's
	// 0600, it could not.
	stopAgent(t, a)
	a = n.start(t, "--uid", "1001", "--gid", "1001")
	out = restart(1001)
	assert.Contains(t, out, `{"step": 1}`)
	assert.Contains(t, out, "1/ 1001:1000 700\n1/state 1001:1000 700\n1/state/array 1001:1000 600\n1/_CHECKPOINT_METADATA 1001:1000 600")
	assert.Contains(t, a.log(), "restored data given to the job's user")

	// The job, now uid 1002, restarts before its agent: it writes its yaml into the bare
	// directory, which the agent takes in when it mounts. That yaml is the job's too: the step
	// is given to uid 1002 (the agent had taken it in as root's, and gave nothing).
	stopAgent(t, a)
	require.NoError(t, os.Chown(n.dir, 1002, 1002))
	out, err = asUser(t, 1002, 1002, n.dir, `printf 'job-name: uidjob\nframework: orbax\nnode-rank: 0\nnodes: 1\npeer-ranks: []\nbackup-interval-minutes: 60' > replicator.yaml`)
	require.NoError(t, err, out)
	a = n.start(t)
	out, err = asUser(t, 1002, 1002, n.dir, `
i=0; while [ ! -e uidjob-s1-n0-w0.restore ]; do i=$((i+1)); [ $i -lt 500 ] || { echo "no marker"; exit 1; }; sleep 0.02; done
cat uidjob-s1-n0-w0.restore/_CHECKPOINT_METADATA
stat -c '%n %u:%g %a' uidjob-s1-n0-w0.restore/state/array`)
	require.NoError(t, err, "%s\n%s", out, a.log())
	assert.Contains(t, out, `{"step": 1}`)
	assert.Contains(t, out, "uidjob-s1-n0-w0.restore/state/array 1002:1000 600", "given to the job's user, its group kept")
	stopAgent(t, a)

	// Another user who may write the mount root (uid 2000's, mode 0777) writes the job's
	// yaml: the step is not given to it, since it does not own the root (black-box h57: it
	// read uid 1002's private files so), and it is told why.
	a = n.start(t, "--uid", "2000", "--gid", "2000", "--mode", "0777")
	out, err = asUser(t, 1003, 1003, n.dir, `
printf 'job-name: uidjob\nframework: orbax\nnode-rank: 0\nnodes: 1\npeer-ranks: []\nbackup-interval-minutes: 60' > replicator.yaml
i=0; while [ ! -e uidjob-s1-n0-w0.restore ]; do i=$((i+1)); [ $i -lt 500 ] || { echo "no marker"; exit 1; }; sleep 0.02; done
stat -L -c '%n %u:%g %a' uidjob-s1-n0-w0.restore
cat uidjob-s1-n0-w0.restore/state/array > /dev/null 2>&1 && echo READ || echo DENIED
cat replicator.errors`)
	require.NoError(t, err, "%s\n%s", out, a.log())
	assert.Contains(t, out, "uidjob-s1-n0-w0.restore 1000:1000 700", "as saved, by uid 1000")
	assert.Contains(t, out, "DENIED")
	assert.Contains(t, out, "the job's user, uid 1003 (the owner of its replicator.yaml), does not own the mount root")
	assert.NotContains(t, a.log(), "restored data given to the job's user")
	stopAgent(t, a)
	n.dropSpool(t)

	// --uid names another owner: uid 1000 may not create anything at the top.
	a = n.start(t, "--uid", "2000", "--mode", "0755")
	out, err = asUser(t, 1000, 1000, n.dir, "echo x > file")
	require.Error(t, err, "uid 1000 wrote into a root owned by uid 2000: %s", out)
	assert.Contains(t, out, "Permission denied")
	require.NoError(t, syscall.Stat(n.dir, &st))
	require.Equal(t, uint32(2000), st.Uid)
	stopAgent(t, a)
}

// TestNonRootDevelopment: an ordinary user mounts with `mtcfs mount DIR` through fusermount3: the
// root is theirs, the default spool is per user, `mtcfs status` finds the agent, SIGTERM
// unmounts; with /dev/fuse closed to them the error says so and how to fix it.
func TestNonRootDevelopment(t *testing.T) {
	needRoot(t) // to hand /dev/fuse to the user for the test and take it back
	if _, err := exec.LookPath("fusermount3"); err != nil {
		t.Fatalf("fusermount3 is needed (apt-get install fuse3): %v", err)
	}
	const uid, gid = 65534, 65534
	base := t.TempDir()
	for _, p := range []string{filepath.Dir(base), base} { // t.TempDir makes both 0700
		require.NoError(t, os.Chmod(p, 0o755))
	}
	bin := filepath.Join(base, "mtcfs")
	data, err := os.ReadFile(binPath)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(bin, data, 0o755))
	home := filepath.Join(base, "home")
	dir := filepath.Join(home, "ckpt")
	require.NoError(t, os.MkdirAll(dir, 0o755))
	for _, p := range []string{home, dir} {
		require.NoError(t, os.Chown(p, uid, gid))
	}
	t.Cleanup(func() {
		exec.Command("fusermount3", "-u", "-z", dir).Run()
		os.RemoveAll(fmt.Sprintf("/dev/shm/mtcfs-%d", uid))
		os.RemoveAll(fmt.Sprintf("/tmp/mtcfs-%d", uid))
	})
	env := []string{"HOME=" + home, "PATH=/usr/bin:/bin:/usr/sbin:/sbin"}
	run := func(args ...string) *exec.Cmd {
		cmd := exec.Command(bin, args...)
		cmd.Env = env
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: gid}}
		return cmd
	}

	fi, err := os.Stat("/dev/fuse")
	require.NoError(t, err)
	oldMode := fi.Mode().Perm()
	t.Cleanup(func() { os.Chmod("/dev/fuse", oldMode) })

	// /dev/fuse closed to the user: a clear message.
	require.NoError(t, os.Chmod("/dev/fuse", 0o600))
	out, err := run("mount", dir, "--memory", "64MiB").CombinedOutput()
	require.Error(t, err)
	assert.Contains(t, string(out), "cannot open /dev/fuse (mode 0600): your user may not use FUSE here")

	// /dev/fuse open to everyone, as on most distributions.
	require.NoError(t, os.Chmod("/dev/fuse", 0o666))
	cmd := run("mount", dir, "--memory", "64MiB")
	serving := make(chan string, 1)
	mounted := make(chan string, 1)
	var logMu sync.Mutex
	var logLines strings.Builder
	log := func() string {
		logMu.Lock()
		defer logMu.Unlock()
		return logLines.String()
	}
	done, err := startLogged(cmd, func(line string) {
		logMu.Lock()
		logLines.WriteString(line + "\n")
		logMu.Unlock()
		if strings.Contains(line, "msg=mounted") {
			select {
			case mounted <- line:
			default:
			}
		}
		if strings.Contains(line, servingLine) {
			select {
			case serving <- line:
			default:
			}
		}
	})
	require.NoError(t, err)
	t.Cleanup(func() { cmd.Process.Kill() })
	select {
	case <-serving:
	case err := <-done:
		t.Fatalf("the agent exited: %v\n%s", err, log())
	case <-time.After(20 * time.Second):
		t.Fatalf("the agent did not serve within 20s\n%s", log())
	}
	require.True(t, isMounted(dir))
	// The fusermount3 path finds the mount's /dev/fuse descriptor too: a seal's rename of a
	// step only expires the kernel's entry (FUSE_EXPIRE_ONLY, Linux 6.2+).
	var uts unix.Utsname
	require.NoError(t, unix.Uname(&uts))
	var major, minor int
	fmt.Sscanf(unix.ByteSliceToString(uts.Release[:]), "%d.%d", &major, &minor)
	select {
	case line := <-mounted:
		assert.Contains(t, line, fmt.Sprintf("expire_only=%v", major > 6 || major == 6 && minor >= 2), "kernel %d.%d", major, minor)
		// A user's agent has its notification helper too (fs/notifier.go): it clones the
		// mount's /dev/fuse descriptor, which needs no privilege.
		assert.Contains(t, line, "notification_helper=true")
	default:
		t.Error("no \"mounted\" line before \"serving\"")
	}
	// A user's FUSE mount is the user's alone (no allow_other): even root may not look in.
	out2, err := asUser(t, uid, gid, home, "stat -c 'owner %u' ckpt && cd ckpt && mkdir -p a/b && echo hello > a/b/f && cat a/b/f")
	require.NoError(t, err, out2)
	assert.Contains(t, out2, fmt.Sprintf("owner %d", uid), "the root is the user's")
	assert.Contains(t, out2, "hello")
	spools, _ := filepath.Glob(fmt.Sprintf("/dev/shm/mtcfs-%d/*", uid))
	assert.NotEmpty(t, spools, "the default spool is per user, under /dev/shm/mtcfs-%d", uid)
	statusOut, err := run("status", dir).CombinedOutput()
	require.NoError(t, err, "mtcfs status DIR as the user: %s", statusOut)
	assert.Contains(t, string(statusOut), "mount "+dir)
	// Without DIR it lists every agent of the machine; other agents running beside the test (in
	// other network namespaces, say) may not answer and make it exit 1, but the user's is listed.
	statusOut, _ = run("status").CombinedOutput()
	assert.Contains(t, string(statusOut), "mount "+dir, "mtcfs status as the user")

	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	select {
	case err := <-done:
		require.NoError(t, err, log())
	case <-time.After(30 * time.Second):
		t.Fatalf("the agent did not stop\n%s", log())
	}
	assert.False(t, isMounted(dir), "unmounted through fusermount3")

	// The user's agent is killed: its mount stays, dead. Root may not look into it (no
	// allow_other: the kernel answers root's statfs itself), so root's agent cannot tell it
	// dead; it names whose mount it is and how to detach it (it said "already a live FUSE
	// mount (another mtcfs agent?)": black-box h57).
	cmd = run("mount", dir, "--memory", "64MiB")
	serving = make(chan string, 1)
	done, err = startLogged(cmd, func(line string) {
		if strings.Contains(line, servingLine) {
			select {
			case serving <- line:
			default:
			}
		}
	})
	require.NoError(t, err)
	select {
	case <-serving:
	case err := <-done:
		t.Fatalf("the agent exited: %v", err)
	case <-time.After(20 * time.Second):
		t.Fatal("the agent did not serve within 20s")
	}
	require.NoError(t, cmd.Process.Kill())
	<-done
	require.True(t, isMounted(dir), "a killed agent's mount stays")
	out3, code := runBounded(t, 30*time.Second, "mount", dir, "--memory", "64MiB", "--spool", filepath.Join(base, "root-spool"))
	assert.Equal(t, 1, code, out3)
	assert.Contains(t, out3, fmt.Sprintf("is a FUSE mount of uid %d, which this user may not look into", uid))
	assert.Contains(t, out3, "umount -l "+dir)
}
