// Package podtest runs the agent's pods from deploy/kubernetes for real on an emulated node
// (kubelet_test.go): the exact command lines of the manifests, in mount namespaces that
// propagate mounts as the manifests' mountPropagation says, with a scripted Orbax trainer
// (internal/jobsim) in the trainer's container. It shows that the trainer sees the agent's mount
// only once /readyz answered, and that after kill -9 of the agent the restarted agent's mount
// reaches the running trainer and the job restores from RAM; and that it does not when a
// manifest's propagation is wrong.
package podtest

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mtcfs/mtcfs/deploy/manifest"
)

func TestMain(m *testing.M) {
	if os.Getenv(trainerRoleEnv) == "trainer" {
		os.Exit(trainerMain())
	}
	code := m.Run()
	if image.context != "" {
		os.RemoveAll(image.context)
	}
	os.Exit(code)
}

const job = "podtest"

// readDocs reads the manifests as the emulated kubelet gets them — strictly decoded, so a
// misspelled field stops the pod test too — with each edit (file: old → new) applied first.
func readDocs(edits ...edit) ([]manifest.Doc, error) {
	files, err := filepath.Glob("../kubernetes/*.yaml")
	if err != nil || len(files) == 0 {
		return nil, fmt.Errorf("no manifests in ../kubernetes: %v", err)
	}
	var docs []manifest.Doc
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			return nil, err
		}
		s := string(data)
		for _, e := range edits {
			if e.file == filepath.Base(f) {
				if !strings.Contains(s, e.old) {
					return nil, fmt.Errorf("%s no longer contains %q", e.file, e.old)
				}
				s = strings.Replace(s, e.old, e.new, 1)
			}
		}
		d, err := manifest.Load(filepath.Base(f), []byte(s))
		if err != nil {
			return nil, err
		}
		docs = append(docs, d...)
	}
	return docs, nil
}

func loadDocs(t *testing.T, edits ...edit) []manifest.Doc {
	t.Helper()
	docs, err := readDocs(edits...)
	if err != nil {
		t.Fatal(err)
	}
	return docs
}

// TestMisspelledManifestStopsThePodTest: the pods are made from strictly decoded manifests.
func TestMisspelledManifestStopsThePodTest(t *testing.T) {
	_, err := readDocs(edit{"node-agent.yaml", "  mountPropagation: Bidirectional", "  mountPropogation: Bidirectional"})
	if err == nil || !strings.Contains(err.Error(), `unknown field "spec.template.spec.containers[0].volumeMounts[0].mountPropogation"`) {
		t.Fatalf("want the misspelled field refused, got %v", err)
	}
}

type edit struct{ file, old, new string }

func template(t *testing.T, docs []manifest.Doc, kind, name string) manifest.PodTemplate {
	t.Helper()
	for _, tpl := range manifest.PodTemplates(docs) {
		if tpl.Doc.Kind == kind && tpl.Doc.Obj.GetName() == name {
			return tpl
		}
	}
	t.Fatalf("no %s %s in the manifests", kind, name)
	return manifest.PodTemplate{}
}

// startTrainer starts the pod's trainer container with the test binary in place of its
// training command.
func startTrainer(t *testing.T, pd *pod) trainer {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	return trainer{pd.start(pd.container("trainer"), []string{self}, []string{trainerRoleEnv + "=trainer"}, true)}
}

// status is what the tests read of the agent's /status.
type status struct {
	Job      string `json:"job"`
	Restored int64  `json:"restored_step"`
}

func (n *node) status(port int) (status, error) {
	var st status
	code, body, err := n.get(fmt.Sprintf("http://%s:%d/status", nodeIP, port), 5*time.Second)
	if err == nil && code != 200 {
		err = fmt.Errorf("HTTP %d", code)
	}
	if err == nil {
		err = json.Unmarshal(body, &st)
	}
	return st, err
}

var backupName = regexp.MustCompile(`^\d{4}-\d\d-\d\d_\d\d-\d\d$`)

// dropBackups removes the job's backups from root (the node's view of the backup location),
// while no agent runs: a restore afterwards can only come from RAM (one node, no peers).
func dropBackups(root string) error {
	ents, _ := os.ReadDir(filepath.Join(root, job))
	for _, e := range ents {
		if backupName.MatchString(e.Name()) {
			if err := os.RemoveAll(filepath.Join(root, job, e.Name())); err != nil {
				return err
			}
		}
	}
	return nil
}

// nodeAgentScenario runs node-agent.yaml's DaemonSet pod and trainer-on-node-agent.yaml's Job
// pod on one node: the trainer pod first (its wait holds it), then the agent; the trainer
// saves; the agent is killed with SIGKILL and restarted as the kubelet restarts a container;
// the same trainer container sees the new mount and the restarted job restores from RAM.
func nodeAgentScenario(t *testing.T, docs []manifest.Doc) error {
	n := newNode(t, docs)
	// The backup location is a directory of the node (no credentials for gs:// here).
	n.kubelet.ConfigMaps["mtcfs-system/mtcfs-node"]["backup"] = "file:///var/lib/mtcfs/podtest-backups"
	backups := filepath.Join(n.root, "var/lib/mtcfs/podtest-backups")

	trainerPod, err := n.addPod(template(t, docs, "Job", "train").Instantiate("train-0", 0, 0, n.kubelet))
	if err != nil {
		return err
	}
	wait := trainerPod.start(trainerPod.container("wait-for-mtcfs"), nil, nil, false)
	time.Sleep(2 * time.Second)
	if wait.exited() {
		return fmt.Errorf("the trainer's wait for the agent ended before any agent ran (%v):\n%s", wait.err, wait.log())
	}

	agentPod, err := n.addPod(template(t, docs, "DaemonSet", "mtcfs-node").Instantiate("mtcfs-node-0", 0, 0, n.kubelet))
	if err != nil {
		return err
	}
	if err := agentPod.runInit("mount-point", 30*time.Second); err != nil {
		return err
	}
	c := agentPod.container("mtcfs")
	agent := agentPod.start(c, nil, nil, false)
	if err := agentPod.waitStarted(c, agent); err != nil {
		return err
	}
	if err := wait.wait(30 * time.Second); err != nil {
		return fmt.Errorf("the trainer's wait did not end once the agent was ready: %v\n%s", err, wait.log())
	}
	tr := startTrainer(t, trainerPod)
	if got, err := tr.call("mount", 10*time.Second); err != nil || got != "live" {
		return fmt.Errorf("when the trainer starts (after /readyz), CHECKPOINT_DIR in its container is %q, want the agent's live mount (%v)\nagent:\n%s", got, err, agent.log())
	}
	if got, err := tr.call("start "+job, 90*time.Second); err != nil || got != "0 false" {
		return fmt.Errorf("fresh start: %q, want nothing restored (%v)\nagent:\n%s", got, err, agent.log())
	}
	for _, step := range []string{"10", "20"} {
		if _, err := tr.call("save "+step, 90*time.Second); err != nil {
			return fmt.Errorf("%v\nagent:\n%s", err, agent.log())
		}
	}

	// kill -9: the mount stays behind, dead, in the node's and the trainer's namespaces.
	agent.cmd.Process.Signal(syscall.SIGKILL)
	agent.wait(10 * time.Second)
	if got, err := tr.waitMount("stale", 5*time.Second); err != nil || got != "stale" {
		return fmt.Errorf("after kill -9 of the agent the trainer sees %q, want its dead mount (%v)", got, err)
	}
	if err := dropBackups(backups); err != nil {
		return err
	}
	agent = agentPod.start(c, nil, nil, false) // the kubelet restarts the container
	if err := agentPod.waitStarted(c, agent); err != nil {
		return err
	}
	if got, err := tr.waitMount("live", 10*time.Second); err != nil || got != "live" {
		return fmt.Errorf("after the agent's restart the running trainer sees %q at CHECKPOINT_DIR, want the new mount (%v)\nagent:\n%s", got, err, agent.log())
	}
	if got, err := tr.call("start "+job, 90*time.Second); err != nil || got != "20 true" {
		return fmt.Errorf("the restarted job restored %q, want step 20 (%v)\nagent:\n%s", got, err, agent.log())
	}
	if _, err := tr.call("verify 20", 90*time.Second); err != nil {
		return err
	}
	if st, err := n.status(9400); err != nil || st.Job != job || st.Restored != 20 {
		return fmt.Errorf("the restarted agent's /status: %+v, %v; want job %s restored at step 20", st, err, job)
	}
	// What podmonitoring.yaml scrapes: /metrics on the port it names, of the agent's pod.
	for _, d := range docs {
		pm, ok := d.Obj.(*manifest.PodMonitoring)
		if !ok || d.Namespace() != agentPod.pod.Namespace {
			continue
		}
		for _, ep := range pm.Spec.Endpoints {
			port := ep.Port.IntValue()
			for _, cp := range c.Ports {
				if cp.Name == ep.Port.StrVal {
					port = int(cp.ContainerPort)
				}
			}
			code, body, err := n.get(fmt.Sprintf("http://%s:%d%s", agentPod.pod.Status.PodIP, port, ep.Path), 5*time.Second)
			if err != nil || code != 200 || !strings.Contains(string(body), "\nmtcfs_ram_budget_bytes ") {
				return fmt.Errorf("%s scrapes %s on port %d: HTTP %d, %v, no mtcfs_ram_budget_bytes in:\n%.500s", d, ep.Path, port, code, err, body)
			}
		}
	}
	tr.call("quit", 5*time.Second)
	return nil
}

func TestNodeAgentPod(t *testing.T) {
	if err := nodeAgentScenario(t, loadDocs(t)); err != nil {
		t.Fatal(err)
	}
}

// TestNodeAgentPodWrongPropagationFails runs the scenario with manifests whose propagation is
// wrong in one place each: every one breaks it, where it should.
func TestNodeAgentPodWrongPropagationFails(t *testing.T) {
	const agentMount = "mountPath: /var/lib/mtcfs\n              mountPropagation: Bidirectional"
	const spool = "mountPath: /dev/shm/mtcfs\n              mountPropagation: Bidirectional"
	for _, tc := range []struct {
		name string
		edit edit
		want string
	}{
		{"agent's mount stays in its container", edit{"node-agent.yaml", agentMount, strings.Replace(agentMount, "Bidirectional", "HostToContainer", 1)},
			`CHECKPOINT_DIR in its container is "none"`},
		{"trainer receives no new mounts", edit{"trainer-on-node-agent.yaml", "  mountPropagation: HostToContainer", "  mountPropagation: None"},
			`after the agent's restart the running trainer sees "stale"`},
		{"spool dies with the agent's container", edit{"node-agent.yaml", spool, strings.Replace(spool, "Bidirectional", "None", 1)},
			`the restarted job restored "0 false", want step 20`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := nodeAgentScenario(t, loadDocs(t, tc.edit))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("want the scenario to fail with %q, got: %v", tc.want, err)
			}
		})
	}
}

// TestSidecarPod runs sidecar-job.yaml's pod: the trainer starts once the sidecar's
// startupProbe passed and sees the mount; after kill -9 the kubelet restarts the sidecar and
// the running trainer restores from RAM; the pod ends (the sidecar drains and exits on
// SIGTERM), and the Job's next pod on the node restores from RAM through the hostPath spool.
func TestSidecarPod(t *testing.T) {
	docs := loadDocs(t)
	n := newNode(t, docs)
	tpl := template(t, docs, "Job", "train-with-mtcfs")
	// The backup location is a directory of the pod (no credentials for gs:// here).
	for i := range tpl.Template.Spec.InitContainers {
		for j, e := range tpl.Template.Spec.InitContainers[i].Env {
			if e.Name == "MTCFS_BACKUP" {
				tpl.Template.Spec.InitContainers[i].Env[j].Value = "file:///mtcfs/podtest-backups"
			}
		}
	}
	runPod := func(name string) (*pod, *proc, trainer) {
		t.Helper()
		pd, err := n.addPod(tpl.Instantiate(name, 0, 0, n.kubelet))
		if err != nil {
			t.Fatal(err)
		}
		if err := pd.runInit("mount-point", 30*time.Second); err != nil {
			t.Fatal(err)
		}
		c := pd.container("mtcfs")
		sidecar := pd.start(c, nil, nil, false)
		if err := pd.waitStarted(c, sidecar); err != nil {
			t.Fatal(err)
		}
		tr := startTrainer(t, pd) // only now: the startupProbe passed
		if got, err := tr.call("mount", 10*time.Second); err != nil || got != "live" {
			t.Fatalf("when the trainer starts, CHECKPOINT_DIR is %q, want the sidecar's live mount (%v)\n%s", got, err, sidecar.log())
		}
		return pd, sidecar, tr
	}
	call := func(tr trainer, sidecar *proc, cmd, want string) {
		t.Helper()
		got, err := tr.call(cmd, 90*time.Second)
		if err != nil || (want != "" && got != want) {
			t.Fatalf("%s: %q, want %q (%v)\nsidecar:\n%s", cmd, got, want, err, sidecar.log())
		}
	}

	pd, sidecar, tr := runPod("train-with-mtcfs-a")
	call(tr, sidecar, "start "+job, "0 false")
	call(tr, sidecar, "save 10", "")

	sidecar.cmd.Process.Signal(syscall.SIGKILL)
	sidecar.wait(10 * time.Second)
	if got, err := tr.waitMount("stale", 5*time.Second); err != nil || got != "stale" {
		t.Fatalf("after kill -9 of the sidecar the trainer sees %q, want its dead mount (%v)", got, err)
	}
	backups := filepath.Join(pd.vols["mtcfs"], "podtest-backups")
	if err := dropBackups(backups); err != nil {
		t.Fatal(err)
	}
	c := pd.container("mtcfs")
	sidecar = pd.start(c, nil, nil, false) // restartPolicy: Always
	if err := pd.waitStarted(c, sidecar); err != nil {
		t.Fatal(err)
	}
	if got, err := tr.waitMount("live", 10*time.Second); err != nil || got != "live" {
		t.Fatalf("after the sidecar's restart the trainer sees %q, want the new mount (%v)\n%s", got, err, sidecar.log())
	}
	call(tr, sidecar, "start "+job, "10 true")
	call(tr, sidecar, "verify 10", "")

	// The pod ends: the trainer first, then the sidecar gets SIGTERM and must be done within
	// the grace period.
	tr.call("quit", 5*time.Second)
	tr.p.wait(10 * time.Second)
	sidecar.cmd.Process.Signal(syscall.SIGTERM)
	// (The next pod gets a new emptyDir: no backup reaches it.)
	grace := time.Duration(*pd.pod.Spec.TerminationGracePeriodSeconds) * time.Second
	if err := sidecar.wait(grace); err != nil {
		t.Fatalf("the sidecar did not stop cleanly on SIGTERM within %v: %v\n%s", grace, err, sidecar.log())
	}

	// The Job's next pod on this node: a new emptyDir, the same hostPath spool.
	_, sidecar, tr = runPod("train-with-mtcfs-b")
	call(tr, sidecar, "start "+job, "10 true")
	call(tr, sidecar, "verify 10", "")
	tr.call("quit", 5*time.Second)
}
