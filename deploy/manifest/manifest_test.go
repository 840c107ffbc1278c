package manifest_test

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mtcfs/mtcfs/deploy/agent"
	"github.com/mtcfs/mtcfs/deploy/manifest"
)

const manifests = "../kubernetes"

// theAgent is the agent binary as make image stages it, with its mount flag set.
var theAgent struct {
	bin   string
	flags agent.Flags
}

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	dir, err := os.MkdirTemp("", "mtcfs-deploy-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	if err := agent.Stage(dir); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	theAgent.bin = filepath.Join(dir, "mtcfs")
	if theAgent.flags, err = agent.MountFlags(theAgent.bin); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return m.Run()
}

type agentFlags struct{}

func (agentFlags) Split(args []string) ([]string, map[string]string, error) {
	return theAgent.flags.Split(args)
}
func (agentFlags) Check(argv []string) error { return agent.Check(theAgent.bin, theAgent.flags, argv) }

// check loads every manifest of dir and checks them together.
func check(dir string) []error {
	docs, err := manifest.LoadDir(dir)
	if err != nil {
		return []error{err}
	}
	return manifest.Check(docs, agentFlags{})
}

// TestManifests: every manifest decodes strictly and passes the checks; the checks saw the
// three agents (node agent, sidecar Job, JobSet), their trainers and both monitors.
func TestManifests(t *testing.T) {
	for _, err := range check(manifests) {
		t.Error(err)
	}
	docs, err := manifest.LoadDir(manifests)
	if err != nil {
		t.Fatal(err)
	}
	kinds := map[string]int{}
	for _, d := range docs {
		kinds[d.Kind]++
	}
	agents, trainers := 0, 0
	for _, tpl := range manifest.PodTemplates(docs) {
		for _, c := range manifest.AllContainers(&tpl.Template.Spec) {
			if manifest.IsAgent(c) {
				agents++
			}
			for _, e := range c.Env {
				if e.Name == "CHECKPOINT_DIR" {
					trainers++
				}
			}
		}
	}
	if agents != 3 || trainers != 3 || kinds["DaemonSet"] != 1 || kinds["JobSet"] != 1 || kinds["Job"] != 2 ||
		kinds["PodMonitoring"] != 2 || kinds["ServiceMonitor"] != 1 {
		t.Errorf("the checks saw %d agents, %d trainers and documents %v; want 3 agents, 3 trainers, a DaemonSet, a JobSet, 2 Jobs, 2 PodMonitorings, a ServiceMonitor", agents, trainers, kinds)
	}
}

// TestBrokenManifestsFail feeds copies of the manifests with one mistake each: every one is
// caught, with a message naming it.
func TestBrokenManifestsFail(t *testing.T) {
	const sidecarSpool = "            - name: spool\n              mountPath: /dev/shm/mtcfs\n              mountPropagation: Bidirectional"
	const startup = "          startupProbe:\n            httpGet:\n              path: /readyz\n              port: 9400\n            periodSeconds: 1"
	cases := []struct {
		name, file, old, new, want string
	}{
		{"misspelled field", "node-agent.yaml", "mountPropagation: Bidirectional", "mountPropogation: Bidirectional", `unknown field "spec.template.spec.containers[0].volumeMounts[0].mountPropogation"`},
		{"field in the wrong case", "trainer-on-node-agent.yaml", "  mountPropagation: HostToContainer", "  mountpropagation: HostToContainer", `unknown field "spec.template.spec.containers[0].volumeMounts[0].mountpropagation"`},
		{"misspelled JobSet field", "jobset.yaml", "replicatedJobs:", "replicatedJob:", `unknown field "spec.replicatedJob"`},
		{"misspelled field in a JobSet's Job", "jobset.yaml", "completionMode: Indexed", "completionMod: Indexed", `unknown field "spec.replicatedJobs[0].template.spec.completionMod"`},
		{"misspelled field in a monitor", "podmonitoring.yaml", "    - port: http", "    - prot: http", `unknown field "spec.endpoints[0].prot"`},
		{"unknown kind", "servicemonitor.yaml", "kind: ServiceMonitor", "kind: ServiceMonitors", `kind "ServiceMonitors"`},
		{"agent's mount not propagated", "node-agent.yaml", "mountPath: /var/lib/mtcfs\n              mountPropagation: Bidirectional", "mountPath: /var/lib/mtcfs\n              mountPropagation: HostToContainer",
			"mount directory /var/lib/mtcfs/ckpt is on volume mounts with mountPropagation HostToContainer"},
		{"trainer does not receive mounts", "trainer-on-node-agent.yaml", "  mountPropagation: HostToContainer", "  mountPropagation: None", "has mountPropagation None: a trainer needs HostToContainer"},
		{"spool dies with the container", "sidecar-job.yaml", sidecarSpool, strings.Replace(sidecarSpool, "Bidirectional", "None", 1), "--spool /dev/shm/mtcfs/ckpt is on volume spool with mountPropagation None"},
		{"spool on an emptyDir", "sidecar-job.yaml", "        - name: spool\n          hostPath:\n            path: /dev/shm/mtcfs-pods\n            type: DirectoryOrCreate", "        - name: spool\n          emptyDir: {}", "which is not a hostPath"},
		{"Bidirectional without privilege", "sidecar-job.yaml", "privileged: true", "privileged: false", "mountPropagation Bidirectional needs privileged: true"},
		{"privilege without Bidirectional", "trainer-on-node-agent.yaml", "      containers:\n        - name: trainer\n", "      containers:\n        - name: trainer\n          securityContext:\n            privileged: true\n", "privileged without a Bidirectional volume"},
		{"liveness on a path the agent does not serve", "node-agent.yaml", "path: /livez", "path: /healthz", `path "/healthz": want /livez`},
		{"liveness on readiness", "jobset.yaml", "path: /livez", "path: /readyz", `path "/readyz": want /livez`},
		{"probe on another port", "node-agent.yaml", "              path: /readyz\n              port: 9400", "              path: /readyz\n              port: 9401", "port 9401 is not the agent's --http port 9400"},
		{"probe that stats the mount", "sidecar-job.yaml", startup, "          startupProbe:\n            exec:\n              command: [stat, /mtcfs/ckpt]\n            periodSeconds: 1", "not an httpGet probe"},
		{"sidecar without startupProbe", "sidecar-job.yaml", startup + "\n            failureThreshold: 300\n", "", "a sidecar agent needs a startupProbe"},
		{"impatient liveness", "node-agent.yaml", "failureThreshold: 6", "failureThreshold: 1", "livenessProbe restarts the agent after 20s"},
		{"probes cannot reach --http", "sidecar-job.yaml", "$(POD_IP):9400", "127.0.0.1:9400", `--http "127.0.0.1:9400" listens where the kubelet's probes`},
		{"flag the agent does not have", "node-agent.yaml", "- --drain-timeout", "- --drain-timout", `"--drain-timout" is not a flag of mtcfs mount`},
		{"value the agent refuses", "jobset.yaml", "- 60s", `- "60"`, `invalid value "60" for flag -drain-timeout`},
		{"address the agent refuses", "sidecar-job.yaml", "- $(POD_IP):7070", "- $(POD_IP)", `--advertise "10.8.0.5": want HOST:PORT`},
		{"rank without coordinator", "jobset.yaml", "                    - --jax-coordinator\n                    - $(JOBSET_NAME)-workers-0-0.$(JOBSET_NAME):8476\n", "", "--rank and --jax-coordinator go together"},
		{"undefined variable", "node-agent.yaml", "$(POD_IP):9400", "$(POD_ADDR):9400", `"$(POD_ADDR):9400" refers to a variable`},
		{"missing ConfigMap key", "node-agent.yaml", "  memory: 16GiB", "  mem: 16GiB", `ConfigMap mtcfs-system/mtcfs-node has no key "memory"`},
		{"mount on the volume's root", "sidecar-job.yaml", "            - mount\n            - /mtcfs/ckpt", "            - mount\n            - /mtcfs", "mount directory /mtcfs is the root of volume mtcfs"},
		{"trainer does not wait for /readyz", "trainer-on-node-agent.yaml", "9400/readyz", "9400/livez", "nothing holds the trainer back until the node agent answers /readyz"},
		{"trainer looks elsewhere", "trainer-on-node-agent.yaml", "value: /mtcfs/ckpt", "value: /mtcfs/checkpoints", "no agent mounts CHECKPOINT_DIR /mtcfs/checkpoints"},
		{"replacement pod overlaps the old one", "trainer-on-node-agent.yaml", "  podReplacementPolicy: Failed", "  podReplacementPolicy: TerminatingOrFailed", "the Job's podReplacementPolicy is not Failed"},
		{"two pods on one node agent", "trainer-on-node-agent.yaml", "operator: Exists", "operator: DoesNotExist", "nothing keeps a second pod using the node agent"},
		{"one pod per node in its namespace only", "trainer-on-node-agent.yaml", "              namespaceSelector: {}\n", "", "nothing keeps a second pod using the node agent"},
		{"agents rolled under running jobs", "node-agent.yaml", "type: OnDelete", "type: RollingUpdate", `updateStrategy "RollingUpdate" restarts agents under running jobs`},
		{"grace shorter than the drain", "node-agent.yaml", "terminationGracePeriodSeconds: 120", "terminationGracePeriodSeconds: 60", "terminationGracePeriodSeconds 1m0s is not above --drain-timeout 1m0s"},
		{"monitor scrapes another path", "podmonitoring.yaml", "path: /metrics", "path: /metric", `path "/metric": the agent serves /metrics`},
		{"monitor scrapes another port", "podmonitoring.yaml", "    - port: http", "    - port: peer", "port peer is not the --http port"},
		{"monitor selects nothing", "servicemonitor.yaml", "    - port: http\n      path: /metrics", "    - port: web\n      path: /metrics", "(port web) reaches no agent"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			files, _ := filepath.Glob(filepath.Join(manifests, "*.yaml"))
			for _, f := range files {
				data, err := os.ReadFile(f)
				if err != nil {
					t.Fatal(err)
				}
				if filepath.Base(f) == tc.file {
					i := strings.Index(string(data), tc.old)
					if i < 0 {
						t.Fatalf("%s no longer contains %q: update the case", tc.file, tc.old)
					}
					if line := string(data[strings.LastIndexByte(string(data[:i]), '\n')+1:]); strings.HasPrefix(strings.TrimSpace(line), "#") {
						t.Fatalf("%q is first found in a comment of %s: make it match the YAML", tc.old, tc.file)
					}
					data = []byte(strings.Replace(string(data), tc.old, tc.new, 1))
				}
				if err := os.WriteFile(filepath.Join(dir, filepath.Base(f)), data, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			errs := check(dir)
			if len(errs) == 0 {
				t.Fatalf("the broken copy passed; want an error containing %q", tc.want)
			}
			if all := errors.Join(errs...).Error(); !strings.Contains(all, tc.want) {
				t.Fatalf("want an error containing %q, got:\n%s", tc.want, all)
			}
		})
	}
}
