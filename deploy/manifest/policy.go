package manifest

import (
	"cmp"
	"fmt"
	"net"
	"path"
	"strconv"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// AgentFlags is what the policy needs of the agent: its mount flag set, to find the mount
// directory and flag values in a command line, and a dry run of a whole command line through
// the agent's own parsing and validation (package agent provides both).
type AgentFlags interface {
	Split(args []string) (pos []string, vals map[string]string, err error)
	Check(argv []string) error
}

// The agent's HTTP endpoints (cmd/mtcfs serveHTTP) and defaults the checks depend on.
const (
	livez            = "/livez"
	readyz           = "/readyz"
	metricsPath      = "/metrics"
	defaultDrain     = 30 * time.Second
	unmountBound     = 30 * time.Second // stopWait in cmd/mtcfs/signals.go
	minLivenessGrace = 60 * time.Second // a liveness probe must tolerate this much silence
)

// CheckNode is the node the pods of the checks are instantiated on.
var CheckNode = Node{Name: "node-0", HostIP: "10.0.0.2", PodIP: "10.8.0.5"}

// Agent is an mtcfs mount container of a pod as the checks instantiated it.
type Agent struct {
	Pod       *corev1.Pod
	Container *corev1.Container
	Argv      []string
	Dir       string            // the mount directory
	Flags     map[string]string // flag values by name
	DirMount  *corev1.VolumeMount
}

// Check checks docs (all manifests together) and returns every problem found.
func Check(docs []Doc, agent AgentFlags) []error {
	var errs []error
	fail := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	node := CheckNode
	node.ConfigMaps = ConfigMaps(docs)
	var agents []Agent
	type trainer struct {
		where string
		tpl   PodTemplate
		pod   *corev1.Pod
		c     *corev1.Container
		dir   string
	}
	var trainers []trainer
	for _, tpl := range PodTemplates(docs) {
		pod := tpl.Instantiate("check", 0, 0, node)
		spec := &pod.Spec
		var podAgents []Agent
		for _, c := range AllContainers(spec) {
			where := fmt.Sprintf("%s, container %s", tpl, c.Name)
			checkPrivilege(where, c, fail)
			if !IsAgent(c) {
				env, err := Env(pod, c, node)
				if err != nil {
					fail("%s: %v", where, err)
					continue
				}
				if dir := EnvMap(env)["CHECKPOINT_DIR"]; dir != "" {
					trainers = append(trainers, trainer{where, tpl, pod, c, dir})
				}
				continue
			}
			a, ok := checkAgent(where, pod, c, node, agent, fail)
			if ok {
				podAgents = append(podAgents, a)
			}
		}
		agents = append(agents, podAgents...)
		// A DaemonSet of agents updated by RollingUpdate restarts each node's agent under the
		// running job, and an agent restart ends the job's incarnation on that node (the job
		// must restart): the agents are updated when the operator deletes their pods, between
		// jobs (deploy/README.md, "Upgrading the agents").
		if ds, ok := tpl.Doc.Obj.(*appsv1.DaemonSet); ok && len(podAgents) > 0 && ds.Spec.UpdateStrategy.Type != appsv1.OnDeleteDaemonSetStrategyType {
			fail("%s: updateStrategy %q restarts agents under running jobs, each restart making the job restart: use OnDelete and update the agents between jobs",
				tpl.Doc, cmp.Or(string(ds.Spec.UpdateStrategy.Type), "RollingUpdate (the default)"))
		}
	}
	// Every trainer sees an agent's mount at CHECKPOINT_DIR: through the same volume in its
	// pod (a sidecar) or the same hostPath (the node agent), mounted HostToContainer.
	for _, tr := range trainers {
		m, rel := mountOf(&tr.c.VolumeMounts, tr.dir)
		if m == nil {
			fail("%s: CHECKPOINT_DIR %s is on no volume", tr.where, tr.dir)
			continue
		}
		if prop(m) != corev1.MountPropagationHostToContainer {
			fail("%s: volume %s (CHECKPOINT_DIR %s) has mountPropagation %s: a trainer needs HostToContainer to see the agent's mount, and a new one after the agent restarts", tr.where, m.Name, tr.dir, prop(m))
		}
		vol := volume(&tr.pod.Spec, m.Name)
		var served *Agent
		for i, a := range agents {
			avol := volume(&a.Pod.Spec, a.DirMount.Name)
			_, arel := mountOf(&a.Container.VolumeMounts, a.Dir)
			same := false
			switch {
			case a.Pod == tr.pod:
				same = avol == vol
			case vol != nil && avol != nil && vol.HostPath != nil && avol.HostPath != nil:
				same = path.Clean(vol.HostPath.Path) == path.Clean(avol.HostPath.Path)
			}
			if same && arel == rel {
				served = &agents[i]
			}
		}
		switch {
		case served == nil:
			fail("%s: no agent mounts CHECKPOINT_DIR %s (volume %s): the agent's mount directory must be the same place of the same volume or hostPath", tr.where, tr.dir, m.Name)
		case served.Pod != tr.pod && !waitsForReady(tr.pod, node, agentHTTPPort(*served)):
			// A sidecar's startupProbe holds the trainer back; with the node agent, the pod must
			// wait itself, or the job writes into the node's plain directory under the mount.
			fail("%s: nothing holds the trainer back until the node agent answers %s: add an init container that waits for http://$(HOST_IP):%d%s", tr.where, readyz, agentHTTPPort(*served), readyz)
		}
		if served != nil && served.Pod != tr.pod {
			checkOnePodPerNodeAgent(tr.where, tr.tpl, tr.pod, fail)
		}
	}
	errs = append(errs, checkMonitoring(docs, agents)...)
	return errs
}

// checkOnePodPerNodeAgent checks that a pod using the node agent is alone on its node: a node
// agent's mount serves one job at a time, and every pod using it shares its one directory. Two
// jobs' pods there each restored the other's saves as their own, and a Job's replacement pod,
// started while the old one still terminated (the default podReplacementPolicy), had the old
// pod's save on SIGTERM taken as its own (a black-box run).
func checkOnePodPerNodeAgent(where string, tpl PodTemplate, pod *corev1.Pod, fail func(string, ...any)) {
	if tpl.Job != nil && (tpl.Job.PodReplacementPolicy == nil || *tpl.Job.PodReplacementPolicy != batchv1.Failed) {
		fail("%s: the Job's podReplacementPolicy is not Failed: a replacement pod starts while the old one still terminates (and may save on SIGTERM), both in the node agent's one directory; set podReplacementPolicy: Failed", where)
	}
	var aa []corev1.PodAffinityTerm
	if a := pod.Spec.Affinity; a != nil && a.PodAntiAffinity != nil {
		aa = a.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution
	}
	for _, term := range aa {
		if term.TopologyKey != corev1.LabelHostname || term.LabelSelector == nil {
			continue
		}
		sel, err := metav1.LabelSelectorAsSelector(term.LabelSelector)
		if err != nil || !sel.Matches(labels.Set(pod.Labels)) {
			continue
		}
		// Any namespace: pods of other namespaces on the node share the hostPath too.
		if ns := term.NamespaceSelector; ns != nil && len(ns.MatchLabels) == 0 && len(ns.MatchExpressions) == 0 {
			return
		}
	}
	fail("%s: nothing keeps a second pod using the node agent (of this job or another, in any namespace) off the node: add a required podAntiAffinity term on %s whose labelSelector matches this pod's labels, with namespaceSelector: {} (a node agent's mount serves one job at a time)", where, corev1.LabelHostname)
}

// waitsForReady reports whether an init container of pod polls the agent's /readyz on port.
func waitsForReady(pod *corev1.Pod, node Node, port int) bool {
	for i := range pod.Spec.InitContainers {
		c := &pod.Spec.InitContainers[i]
		env, err := Env(pod, c, node)
		if err != nil {
			continue
		}
		argv, err := CommandLine(c, env)
		if err == nil && !IsSidecar(&pod.Spec, c) && strings.Contains(strings.Join(argv, " "), fmt.Sprintf(":%d%s", port, readyz)) {
			return true
		}
	}
	return false
}

func prop(m *corev1.VolumeMount) corev1.MountPropagationMode {
	if m.MountPropagation == nil {
		return corev1.MountPropagationNone
	}
	return *m.MountPropagation
}

// checkPrivilege: privileged exactly where Bidirectional propagation is used (the API server
// refuses Bidirectional without it; privilege without it is more than needed).
func checkPrivilege(where string, c *corev1.Container, fail func(string, ...any)) {
	bidi := false
	for i := range c.VolumeMounts {
		if prop(&c.VolumeMounts[i]) == corev1.MountPropagationBidirectional {
			bidi = true
		}
	}
	priv := c.SecurityContext != nil && c.SecurityContext.Privileged != nil && *c.SecurityContext.Privileged
	switch {
	case bidi && !priv:
		fail("%s: mountPropagation Bidirectional needs privileged: true", where)
	case priv && !bidi:
		fail("%s: privileged without a Bidirectional volume: keep privilege to the container whose mounts must propagate", where)
	}
}

// mountOf finds the volume mount holding p and p's path relative to the mount's path.
func mountOf(mounts *[]corev1.VolumeMount, p string) (*corev1.VolumeMount, string) {
	var best *corev1.VolumeMount
	for i := range *mounts {
		m := &(*mounts)[i]
		mp := path.Clean(m.MountPath)
		if (p == mp || strings.HasPrefix(p, mp+"/")) && (best == nil || len(mp) > len(path.Clean(best.MountPath))) {
			best = m
		}
	}
	if best == nil {
		return nil, ""
	}
	rel := strings.TrimPrefix(strings.TrimPrefix(path.Clean(p), path.Clean(best.MountPath)), "/")
	return best, rel
}

func volume(spec *corev1.PodSpec, name string) *corev1.Volume {
	for i := range spec.Volumes {
		if spec.Volumes[i].Name == name {
			return &spec.Volumes[i]
		}
	}
	return nil
}

func checkAgent(where string, pod *corev1.Pod, c *corev1.Container, node Node, agent AgentFlags, fail func(string, ...any)) (Agent, bool) {
	env, err := Env(pod, c, node)
	if err != nil {
		fail("%s: %v", where, err)
		return Agent{}, false
	}
	argv, err := CommandLine(c, env)
	if err != nil {
		fail("%s: %v", where, err)
		return Agent{}, false
	}
	for _, a := range argv {
		if strings.Contains(a, "$(") {
			fail("%s: %q refers to a variable the container does not define", where, a)
		}
	}
	if err := agent.Check(argv); err != nil {
		fail("%s: %v", where, err)
		return Agent{}, false
	}
	pos, vals, err := agent.Split(argv[2:])
	if err != nil || len(pos) != 1 {
		fail("%s: %q: want mtcfs mount DIR [flags] (%v)", where, argv, err)
		return Agent{}, false
	}
	a := Agent{Pod: pod, Container: c, Argv: argv, Dir: path.Clean(pos[0]), Flags: vals}
	spec := &pod.Spec
	if !IsSidecar(spec, c) && isInit(spec, c) {
		fail("%s: an agent in a plain init container blocks the pod: make it a native sidecar (restartPolicy: Always)", where)
	}

	// The mount directory: below the root of a Bidirectional volume, so that the mount reaches
	// the trainer, and a mount left by a killed agent does not keep the runtime from binding
	// the volume for the restarted one.
	m, rel := mountOf(&c.VolumeMounts, a.Dir)
	switch {
	case m == nil:
		fail("%s: mount directory %s is on no volume: the trainer cannot see the mount", where, a.Dir)
	case prop(m) != corev1.MountPropagationBidirectional:
		fail("%s: mount directory %s is on volume %s with mountPropagation %s: the mount must propagate out of the container (Bidirectional)", where, a.Dir, m.Name, prop(m))
	case rel == "":
		fail("%s: mount directory %s is the root of volume %s: mount on a directory below it (a stale mount on the root would keep the restarted agent's volume from being bound)", where, a.Dir, m.Name)
	}
	a.DirMount = m

	// The spool: on a hostPath, Bidirectional, so that its tmpfs (mounted by the agent) lives in
	// the node's namespace and outlives the container and the pod.
	if sp, ok := vals["spool"]; !ok {
		fail("%s: no --spool: the default spool is in the container's own /dev/shm and dies with it; put it on a hostPath volume", where)
	} else if sm, srel := mountOf(&c.VolumeMounts, path.Clean(sp)); sm == nil {
		fail("%s: --spool %s is on no volume: it dies with the container", where, sp)
	} else if v := volume(spec, sm.Name); v == nil || v.HostPath == nil {
		fail("%s: --spool %s is on volume %s, which is not a hostPath: RAM would not survive the pod", where, sp, sm.Name)
	} else if prop(sm) != corev1.MountPropagationBidirectional {
		fail("%s: --spool %s is on volume %s with mountPropagation %s: the spool's tmpfs would die with the container (Bidirectional keeps it on the node)", where, sp, sm.Name, prop(sm))
	} else if srel == "" {
		fail("%s: --spool %s is the root of volume %s: give it a directory below", where, sp, sm.Name)
	}

	// Probes: only on the agent's HTTP endpoints, never a command (a stat on a hung FUSE
	// mount hangs the probe).
	httpPort := checkHTTP(where, pod, c, vals["http"], fail)
	probes := []struct {
		name string
		p    *corev1.Probe
		want string
	}{{"startupProbe", c.StartupProbe, readyz}, {"readinessProbe", c.ReadinessProbe, readyz}, {"livenessProbe", c.LivenessProbe, livez}}
	for _, pr := range probes {
		if pr.p == nil {
			continue
		}
		checkProbe(where+", "+pr.name, c, pr.p, pr.want, httpPort, fail)
	}
	if c.LivenessProbe == nil {
		fail("%s: no livenessProbe on %s", where, livez)
	} else if lp := c.LivenessProbe; lp.PeriodSeconds == 0 || lp.FailureThreshold == 0 || lp.TimeoutSeconds == 0 ||
		time.Duration(lp.PeriodSeconds*lp.FailureThreshold)*time.Second < minLivenessGrace || lp.TimeoutSeconds < 2 {
		fail("%s: livenessProbe restarts the agent after %ds (period %d × failureThreshold %d, timeout %ds): set all three, for at least %v of silence and a timeout of 2s or more — a restart interrupts the job",
			where, lp.PeriodSeconds*lp.FailureThreshold, lp.PeriodSeconds, lp.FailureThreshold, lp.TimeoutSeconds, minLivenessGrace)
	}
	if c.StartupProbe == nil && c.ReadinessProbe == nil {
		fail("%s: neither startupProbe nor readinessProbe on %s", where, readyz)
	}
	if IsSidecar(spec, c) && c.StartupProbe == nil {
		fail("%s: a sidecar agent needs a startupProbe on %s: the trainer must start only once the mount exists", where, readyz)
	}

	// Termination: the drain and the unmount fit in the grace period.
	drain := defaultDrain
	if v, ok := vals["drain-timeout"]; ok {
		if drain, err = time.ParseDuration(v); err != nil {
			fail("%s: --drain-timeout %q: %v", where, v, err)
		}
	}
	grace := 30 * time.Second
	if spec.TerminationGracePeriodSeconds != nil {
		grace = time.Duration(*spec.TerminationGracePeriodSeconds) * time.Second
	}
	if grace <= drain+unmountBound {
		fail("%s: terminationGracePeriodSeconds %v is not above --drain-timeout %v plus the agent's %v bound on unmounting: SIGKILL would cut the drain short", where, grace, drain, unmountBound)
	}
	return a, true
}

func isInit(spec *corev1.PodSpec, c *corev1.Container) bool {
	for i := range spec.InitContainers {
		if &spec.InitContainers[i] == c {
			return true
		}
	}
	return false
}

// checkHTTP checks --http: a fixed port the kubelet can reach at the pod's IP. It returns the port.
func checkHTTP(where string, pod *corev1.Pod, c *corev1.Container, addr string, fail func(string, ...any)) int {
	if addr == "" {
		fail("%s: no --http: the default (127.0.0.1, a random port) is out of the kubelet's reach, so probes and metrics cannot work", where)
		return 0
	}
	host, p, err := net.SplitHostPort(addr)
	port, perr := strconv.Atoi(p)
	if err != nil || perr != nil || port <= 0 {
		fail("%s: --http %q: want HOST:PORT with a fixed port for the probes", where, addr)
		return 0
	}
	if host != "" && host != "0.0.0.0" && host != "::" && host != pod.Status.PodIP {
		fail("%s: --http %q listens where the kubelet's probes (sent to the pod IP) cannot reach it", where, addr)
	}
	return port
}

func checkProbe(where string, c *corev1.Container, p *corev1.Probe, want string, httpPort int, fail func(string, ...any)) {
	if p.HTTPGet == nil {
		fail("%s: not an httpGet probe: probe the agent on %s, never with a command (a stat on a hung FUSE mount hangs the probe)", where, want)
		return
	}
	if p.HTTPGet.Path != want {
		fail("%s: path %q: want %s (the agent serves /livez for liveness and /readyz for readiness)", where, p.HTTPGet.Path, want)
	}
	if p.HTTPGet.Host != "" {
		fail("%s: host %q: leave it empty, the kubelet probes the pod IP", where, p.HTTPGet.Host)
	}
	if port, ok := resolvePort(c, p.HTTPGet.Port); !ok || port != httpPort {
		fail("%s: port %s is not the agent's --http port %d", where, p.HTTPGet.Port.String(), httpPort)
	}
}

// resolvePort resolves a probe or Service target port against the container's ports.
func resolvePort(c *corev1.Container, p intstr.IntOrString) (int, bool) {
	if p.Type == intstr.Int {
		return p.IntValue(), true
	}
	for _, cp := range c.Ports {
		if cp.Name == p.StrVal {
			return int(cp.ContainerPort), true
		}
	}
	return 0, false
}

// agentHTTPPort is the port of a's --http flag.
func agentHTTPPort(a Agent) int {
	_, p, _ := net.SplitHostPort(a.Flags["http"])
	n, _ := strconv.Atoi(p)
	return n
}

// checkMonitoring: every PodMonitoring and ServiceMonitor selects agents and scrapes /metrics on
// their --http port.
func checkMonitoring(docs []Doc, agents []Agent) []error {
	var errs []error
	fail := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	matches := func(sel metav1.LabelSelector, l map[string]string) bool {
		s, err := metav1.LabelSelectorAsSelector(&sel)
		return err == nil && !s.Empty() && s.Matches(labels.Set(l))
	}
	// scraped reports whether port (by name or number) of agent a is its --http port.
	scraped := func(a Agent, port intstr.IntOrString) bool {
		p, ok := resolvePort(a.Container, port)
		return ok && p == agentHTTPPort(a)
	}
	for _, d := range docs {
		switch o := d.Obj.(type) {
		case *PodMonitoring:
			for i, ep := range o.Spec.Endpoints {
				if ep.Path != metricsPath {
					fail("%s: endpoints[%d].path %q: the agent serves %s", d, i, ep.Path, metricsPath)
				}
				n := 0
				for _, a := range agents {
					if a.Pod.Namespace == d.Namespace() && matches(o.Spec.Selector, a.Pod.Labels) {
						n++
						if !scraped(a, ep.Port) {
							fail("%s: endpoints[%d].port %s is not the --http port of container %s of the pods it selects", d, i, ep.Port.String(), a.Container.Name)
						}
					}
				}
				if n == 0 {
					fail("%s: its selector matches no agent pod in namespace %s", d, d.Namespace())
				}
			}
		case *ServiceMonitor:
			for i, ep := range o.Spec.Endpoints {
				if ep.Path != metricsPath {
					fail("%s: endpoints[%d].path %q: the agent serves %s", d, i, ep.Path, metricsPath)
				}
				n := 0
				for _, sd := range docs {
					svc, ok := sd.Obj.(*corev1.Service)
					if !ok || sd.Namespace() != d.Namespace() || !matches(o.Spec.Selector, svc.Labels) {
						continue
					}
					for _, sp := range svc.Spec.Ports {
						if sp.Name != ep.Port {
							continue
						}
						for _, a := range agents {
							if a.Pod.Namespace == sd.Namespace() && labels.SelectorFromSet(svc.Spec.Selector).Matches(labels.Set(a.Pod.Labels)) && len(svc.Spec.Selector) > 0 {
								n++
								target := sp.TargetPort
								if target.Type == intstr.Int && target.IntVal == 0 {
									target = intstr.FromInt32(sp.Port)
								}
								if !scraped(a, target) {
									fail("%s: endpoints[%d] port %s leads through %s to port %s, not the --http port of container %s", d, i, ep.Port, sd, target.String(), a.Container.Name)
								}
							}
						}
					}
				}
				if n == 0 {
					fail("%s: endpoints[%d] (port %s) reaches no agent through a Service it selects", d, i, ep.Port)
				}
			}
		}
	}
	return errs
}
