package podtest

// A node and its kubelet, emulated with namespaces. The node is a mount namespace whose
// node/ directory holds the node's filesystem (hostPath and emptyDir volumes) as a shared mount,
// and a network namespace where the node's address is nodeIP. A container is a process in a
// mount namespace of its own, chrooted into a root laid out like its image, with the pod's
// volumes bound at their mountPaths as the container runtime binds them:
//
//   - Bidirectional: the volume is bound from the node's shared mount, in the namespace of a
//     container whose root propagation is shared (as CRI runtimes do for such containers): the
//     bind joins the node's peer group, so mounts made below it reach the node and every
//     container that receives from it;
//   - HostToContainer: the container's namespace is a slave of the node's and so is the bind:
//     it receives the node's mounts, new ones too, and sends none;
//   - None: the bind is private: a copy of what was mounted when the container started.
//
// The mtcfs image's root is laid out from deploy/Containerfile.prebuilt with the context that
// make image uses (stage-image.sh); other images (busybox, the trainer's) get the host's
// userland, read-only. All containers share the node's network namespace (as with
// hostNetwork), so pod IPs are nodeIP; the kubelet's probes are sent there. Nothing is mounted
// in the test's own namespace: when the node's processes end, its mounts go with them.

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"

	"github.com/mtcfs/mtcfs/deploy/agent"
	"github.com/mtcfs/mtcfs/deploy/manifest"
)

const (
	nodeIP     = "10.88.0.1"
	mtcfsImage = "mtcfs:dev" // the image name the manifests use for the agent
)

// image is the agent image's root as make image builds it, staged once per test binary.
var image struct {
	once    sync.Once
	context string
	spec    *agent.Image
	err     error
}

func stageImage() (string, *agent.Image, error) {
	image.once.Do(func() {
		image.context, image.err = os.MkdirTemp("", "mtcfs-podtest-image-")
		if image.err != nil {
			return
		}
		if image.err = agent.Stage(image.context); image.err != nil {
			return
		}
		root, err := agent.RepoRoot()
		if err != nil {
			image.err = err
			return
		}
		f, err := os.Open(filepath.Join(root, "deploy", "Containerfile.prebuilt"))
		if err != nil {
			image.err = err
			return
		}
		defer f.Close()
		image.spec, image.err = agent.ParseContainerfile(f)
	})
	return image.context, image.spec, image.err
}

// tools are the host programs the emulation uses, by absolute path (a container's PATH is the
// image's).
var tools = map[string]string{}

func needTools(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: mount namespaces, FUSE and tmpfs mounts")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skip("needs /dev/fuse")
	}
	for _, name := range []string{"unshare", "nsenter", "mount", "mkdir", "touch", "chroot", "ip", "sh", "wget"} {
		p, err := exec.LookPath(name)
		if err != nil {
			t.Fatalf("the pod test needs %s (util-linux, coreutils, iproute2, wget): %v", name, err)
		}
		tools[name] = p
	}
}

// node is an emulated node with its kubelet.
type node struct {
	t       *testing.T
	dir     string // the test's directory
	root    string // dir/node: the node's filesystem
	holder  *exec.Cmd
	kubelet manifest.Node
	mu      sync.Mutex
	procs   []*proc
	seq     int
}

func newNode(t *testing.T, docs []manifest.Doc) *node {
	t.Helper()
	needTools(t)
	if _, _, err := stageImage(); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	n := &node{t: t, dir: dir, root: filepath.Join(dir, "node")}
	n.kubelet = manifest.Node{Name: "node-0", HostIP: nodeIP, PodIP: nodeIP, ConfigMaps: manifest.ConfigMaps(docs)}
	for _, d := range []string{n.root, filepath.Join(dir, "rootfs")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	script := fmt.Sprintf(`set -e
%[1]s --bind %[2]s %[2]s
%[1]s --make-rshared %[2]s
%[3]s link set lo up
%[3]s addr add %[4]s/32 dev lo
echo ready
exec sleep 1000000`, tools["mount"], shq(n.root), tools["ip"], nodeIP)
	n.holder = exec.Command(tools["unshare"], "--mount", "--net", "--propagation", "private", "--", tools["sh"], "-c", script)
	n.holder.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	var stderr bytes.Buffer
	n.holder.Stderr = &stderr
	out, err := n.holder.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := n.holder.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.destroy)
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || line != "ready\n" {
		t.Fatalf("the node's namespaces: %q %v: %s", line, err, stderr.String())
	}
	return n
}

// destroy kills every process of the node; its namespaces, and every mount in them, go with
// the last. Then it checks that nothing of the node is mounted in the test's namespace.
func (n *node) destroy() {
	n.mu.Lock()
	procs := n.procs
	n.mu.Unlock()
	for _, p := range procs {
		p.kill()
	}
	n.holder.Process.Kill()
	n.holder.Wait()
	data, _ := os.ReadFile("/proc/self/mountinfo")
	for _, l := range strings.Split(string(data), "\n") {
		if f := strings.Fields(l); len(f) > 4 && strings.HasPrefix(f[4], n.dir) {
			n.t.Errorf("the test's namespace has a mount of the emulated node: %s", l)
		}
	}
}

// nsPath is a namespace file of the node's holder process.
func (n *node) nsPath(kind string) string {
	return fmt.Sprintf("/proc/%d/ns/%s", n.holder.Process.Pid, kind)
}

// proc is a container's process.
type proc struct {
	name   string
	cmd    *exec.Cmd
	mu     sync.Mutex
	out    bytes.Buffer // stdout and stderr, except a trainer's stdout
	done   chan struct{}
	err    error // after done
	stdin  io.WriteCloser
	stdout *bufio.Reader
}

func (p *proc) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.out.Write(b)
}

func (p *proc) log() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.out.String()
}

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

func (p *proc) wait(timeout time.Duration) error {
	select {
	case <-p.done:
		return p.err
	case <-time.After(timeout):
		return fmt.Errorf("%s still runs after %v", p.name, timeout)
	}
}

func (p *proc) kill() {
	if !p.exited() {
		p.cmd.Process.Kill()
		<-p.done
	}
}

// pod is a pod on the node: its spec as the controller made it and its volumes' directories.
type pod struct {
	n    *node
	pod  *corev1.Pod
	dir  string // the pod's directory on the node (emptyDir volumes)
	vols map[string]string
}

// addPod admits a pod: its emptyDir volumes are made, its hostPath volumes checked or created
// as their type says.
func (n *node) addPod(p *corev1.Pod) (*pod, error) {
	pd := &pod{n: n, pod: p, dir: filepath.Join(n.root, "var/lib/kubelet/pods", string(p.UID)), vols: map[string]string{}}
	for _, v := range p.Spec.Volumes {
		switch {
		case v.EmptyDir != nil:
			d := filepath.Join(pd.dir, "volumes/kubernetes.io~empty-dir", v.Name)
			if err := os.MkdirAll(d, 0o777); err != nil {
				return nil, err
			}
			pd.vols[v.Name] = d
		case v.HostPath != nil:
			typ := corev1.HostPathUnset
			if v.HostPath.Type != nil {
				typ = *v.HostPath.Type
			}
			switch typ {
			case corev1.HostPathCharDev, corev1.HostPathBlockDev, corev1.HostPathSocket:
				pd.vols[v.Name] = v.HostPath.Path // the node's devices are the host's
				continue
			}
			d := filepath.Join(n.root, v.HostPath.Path)
			switch typ {
			case corev1.HostPathDirectoryOrCreate:
				if err := os.MkdirAll(d, 0o755); err != nil {
					return nil, err
				}
			case corev1.HostPathDirectory:
				if fi, err := os.Stat(d); err != nil || !fi.IsDir() {
					return nil, fmt.Errorf("pod %s: hostPath type check failed: %s is not a directory", p.Name, v.HostPath.Path)
				}
			}
			pd.vols[v.Name] = d
		default:
			return nil, fmt.Errorf("pod %s: volume %s: only emptyDir and hostPath are emulated", p.Name, v.Name)
		}
	}
	return pd, nil
}

func (pd *pod) container(name string) *corev1.Container {
	for _, c := range manifest.AllContainers(&pd.pod.Spec) {
		if c.Name == name {
			return c
		}
	}
	pd.n.t.Fatalf("pod %s has no container %s", pd.pod.Name, name)
	return nil
}

// env is the container's environment as the kubelet builds it.
func (pd *pod) env(c *corev1.Container) []string {
	env, err := manifest.Env(pd.pod, c, pd.n.kubelet)
	if err != nil {
		pd.n.t.Fatal(err)
	}
	return env
}

// start starts container c of the pod. argv is its command line, nil for the manifest's own
// (expanded as the kubelet does); a trainer passes its stand-in. stdio makes stdin and stdout
// pipes (the trainer's command channel).
func (pd *pod) start(c *corev1.Container, argv []string, extraEnv []string, stdio bool) *proc {
	n := pd.n
	t := n.t
	t.Helper()
	env := pd.env(c)
	if argv == nil {
		var err error
		if argv, err = manifest.CommandLine(c, env); err != nil {
			t.Fatal(err)
		}
	}
	n.mu.Lock()
	n.seq++
	name := fmt.Sprintf("%s/%s#%d", pd.pod.Name, c.Name, n.seq)
	rootfs := filepath.Join(n.dir, "rootfs", fmt.Sprintf("%s-%s-%d", pd.pod.Name, c.Name, n.seq))
	n.mu.Unlock()

	var imageEnv []string
	var sh []string // the runtime's setup, run in the container's namespace before the chroot
	run := func(args ...string) {
		q := make([]string, len(args))
		for i, a := range args {
			q[i] = shq(a)
		}
		sh = append(sh, strings.Join(q, " "))
	}
	mkdirs := func(dirs ...string) {
		for _, d := range dirs {
			if err := os.MkdirAll(filepath.Join(rootfs, d), 0o755); err != nil {
				t.Fatal(err)
			}
		}
	}
	mkdirs("proc", "dev", "sys")
	run(tools["mount"], "--bind", rootfs, rootfs)
	run(tools["mount"], "--make-private", rootfs)
	if c.Image == mtcfsImage {
		ctx, img, _ := stageImage()
		if err := img.Lay(ctx, rootfs); err != nil {
			t.Fatal(err)
		}
		imageEnv = img.Env
	} else {
		// Another image (busybox, the trainer's): the host's userland, read-only.
		imageEnv = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
		mkdirs("tmp")
		for _, d := range []string{"usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32"} {
			fi, err := os.Lstat("/" + d)
			switch {
			case err != nil:
			case fi.Mode()&os.ModeSymlink != 0:
				target, _ := os.Readlink("/" + d)
				if err := os.Symlink(target, filepath.Join(rootfs, d)); err != nil {
					t.Fatal(err)
				}
			case fi.IsDir():
				mkdirs(d)
				run(tools["mount"], "--rbind", "/"+d, filepath.Join(rootfs, d))
				run(tools["mount"], "--make-rslave", filepath.Join(rootfs, d))
				run(tools["mount"], "-o", "remount,bind,ro", filepath.Join(rootfs, d))
			}
		}
		if err := os.Chmod(filepath.Join(rootfs, "tmp"), 0o1777); err != nil {
			t.Fatal(err)
		}
	}
	imageEnv = append(imageEnv, "HOME=/root")
	if strings.HasPrefix(argv[0], "/") && filepath.Dir(argv[0]) != "/" && c.Image != mtcfsImage {
		// The trainer's stand-in is this test binary: bind its directory.
		mkdirs(filepath.Dir(argv[0]))
		run(tools["mount"], "--bind", filepath.Dir(argv[0]), filepath.Join(rootfs, filepath.Dir(argv[0])))
	}
	// What every runtime provides: /proc, a small /dev, /dev/shm, /sys.
	run(tools["mount"], "-t", "proc", "proc", filepath.Join(rootfs, "proc"))
	run(tools["mount"], "-t", "tmpfs", "-o", "mode=755", "dev", filepath.Join(rootfs, "dev"))
	for _, d := range []string{"null", "zero", "full", "random", "urandom"} {
		run(tools["touch"], filepath.Join(rootfs, "dev", d))
		run(tools["mount"], "--bind", "/dev/"+d, filepath.Join(rootfs, "dev", d))
	}
	run(tools["mkdir"], filepath.Join(rootfs, "dev/shm"))
	run(tools["mount"], "-t", "tmpfs", "-o", "mode=1777", "shm", filepath.Join(rootfs, "dev/shm"))
	run(tools["mount"], "--rbind", "/sys", filepath.Join(rootfs, "sys"))
	run(tools["mount"], "--make-rslave", filepath.Join(rootfs, "sys"))

	// The pod's volumes, in mountPath order (a volume inside another comes after it).
	mounts := append([]corev1.VolumeMount(nil), c.VolumeMounts...)
	sort.Slice(mounts, func(i, j int) bool { return mounts[i].MountPath < mounts[j].MountPath })
	privileged := c.SecurityContext != nil && c.SecurityContext.Privileged != nil && *c.SecurityContext.Privileged
	bidi := false
	for _, m := range mounts {
		src, ok := pd.vols[m.Name]
		if !ok {
			t.Fatalf("%s: volumeMount %s names no volume", name, m.Name)
		}
		dst := filepath.Join(rootfs, m.MountPath)
		if fi, err := os.Stat(src); err == nil && !fi.IsDir() {
			run(tools["mkdir"], "-p", filepath.Dir(dst))
			run(tools["touch"], dst)
		} else {
			run(tools["mkdir"], "-p", dst)
		}
		run(tools["mount"], "--rbind", src, dst)
		switch prop := manifestProp(m); prop {
		case corev1.MountPropagationBidirectional:
			if !privileged {
				t.Fatalf("%s: Bidirectional needs a privileged container", name)
			}
			bidi = true
			run(tools["mount"], "--make-rshared", dst)
		case corev1.MountPropagationHostToContainer:
			run(tools["mount"], "--make-rslave", dst)
		default:
			run(tools["mount"], "--make-rprivate", dst)
		}
	}
	if c.SecurityContext != nil && c.SecurityContext.ReadOnlyRootFilesystem != nil && *c.SecurityContext.ReadOnlyRootFilesystem {
		run(tools["mount"], "-o", "remount,bind,ro", rootfs)
	}
	q := make([]string, len(argv))
	for i, a := range argv {
		q[i] = shq(a)
	}
	sh = append(sh, "exec "+shq(tools["chroot"])+" "+shq(rootfs)+" "+strings.Join(q, " "))

	// A container with a Bidirectional volume gets a shared root propagation, the others a
	// slave one (what CRI runtimes do).
	propagation := "slave"
	if bidi {
		propagation = "unchanged"
	}
	cmd := exec.Command(tools["nsenter"], "--mount="+n.nsPath("mnt"), "--net="+n.nsPath("net"), "--",
		tools["unshare"], "--mount", "--propagation", propagation, "--",
		tools["sh"], "-c", "set -e\n"+strings.Join(sh, "\n"))
	cmd.Env = append(append(imageEnv, env...), extraEnv...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	p := &proc{name: name, cmd: cmd, done: make(chan struct{})}
	cmd.Stderr = p
	if stdio {
		in, err := cmd.StdinPipe()
		if err != nil {
			t.Fatal(err)
		}
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		p.stdin, p.stdout = in, bufio.NewReader(out)
	} else {
		cmd.Stdout = p
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.err = cmd.Wait(); close(p.done) }()
	n.mu.Lock()
	n.procs = append(n.procs, p)
	n.mu.Unlock()
	return p
}

func manifestProp(m corev1.VolumeMount) corev1.MountPropagationMode {
	if m.MountPropagation == nil {
		return corev1.MountPropagationNone
	}
	return *m.MountPropagation
}

// runInit runs an init container to completion, as the kubelet does before the next.
func (pd *pod) runInit(name string, timeout time.Duration) error {
	p := pd.start(pd.container(name), nil, nil, false)
	if err := p.wait(timeout); err != nil {
		return fmt.Errorf("init container %s: %v\n%s", name, err, p.log())
	}
	return nil
}

// probe sends the kubelet's HTTP probe once: success is a status in 200–399.
func (pd *pod) probe(c *corev1.Container, pr *corev1.Probe) error {
	port := pr.HTTPGet.Port.IntValue()
	if pr.HTTPGet.Port.StrVal != "" {
		for _, cp := range c.Ports {
			if cp.Name == pr.HTTPGet.Port.StrVal {
				port = int(cp.ContainerPort)
			}
		}
	}
	timeout := time.Duration(max(pr.TimeoutSeconds, 1)) * time.Second
	code, _, err := pd.n.get(fmt.Sprintf("http://%s%s", net.JoinHostPort(pd.pod.Status.PodIP, fmt.Sprint(port)), pr.HTTPGet.Path), timeout)
	if err != nil {
		return err
	}
	if code < 200 || code >= 400 {
		return fmt.Errorf("HTTP %d", code)
	}
	return nil
}

// waitStarted runs the container's startup probe (or readiness probe) with its period and
// failure threshold, as the kubelet does before it counts the container started.
func (pd *pod) waitStarted(c *corev1.Container, p *proc) error {
	pr := c.StartupProbe
	if pr == nil {
		pr = c.ReadinessProbe
	}
	period, threshold := 10*time.Second, int32(3) // the API's defaults
	if pr.PeriodSeconds > 0 {
		period = time.Duration(pr.PeriodSeconds) * time.Second
	}
	if pr.FailureThreshold > 0 {
		threshold = pr.FailureThreshold
	}
	var err error
	for i := int32(0); i < threshold; i++ {
		if p.exited() {
			return fmt.Errorf("%s exited before its probe succeeded: %v\n%s", p.name, p.err, p.log())
		}
		if err = pd.probe(c, pr); err == nil {
			return nil
		}
		time.Sleep(period)
	}
	return fmt.Errorf("%s: probe %s failed %d times: %v\n%s", p.name, pr.HTTPGet.Path, threshold, err, p.log())
}

// get sends an HTTP GET from inside the node's network namespace.
func (n *node) get(url string, timeout time.Duration) (int, []byte, error) {
	client := &http.Client{Timeout: timeout, Transport: &http.Transport{DialContext: n.dial, DisableKeepAlives: true}}
	resp, err := client.Get(url)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return resp.StatusCode, body, err
}

// dial opens a connection in the node's network namespace: the socket is made by a thread that
// entered the namespace, which then returns to the test's.
func (n *node) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	type result struct {
		c   net.Conn
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		self, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			runtime.UnlockOSThread()
			ch <- result{nil, err}
			return
		}
		defer self.Close()
		target, err := os.Open(n.nsPath("net"))
		if err != nil {
			runtime.UnlockOSThread()
			ch <- result{nil, err}
			return
		}
		defer target.Close()
		if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			ch <- result{nil, err}
			return
		}
		var d net.Dialer
		c, err := d.DialContext(ctx, network, addr)
		if unix.Setns(int(self.Fd()), unix.CLONE_NEWNET) == nil {
			runtime.UnlockOSThread()
		} // else the thread stays locked and ends with this goroutine
		ch <- result{c, err}
	}()
	r := <-ch
	return r.c, r.err
}

// shq quotes s for sh.
func shq(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
