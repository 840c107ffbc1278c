// Package manifest reads the Kubernetes manifests of deploy/kubernetes as the API server would —
// every document strictly into the API's Go types, so that an unknown or misspelled field
// (also one in the wrong case) is an error — builds the pods their controllers would create,
// resolves a container's environment and command line as the kubelet does, and checks the
// manifests against what the agent needs (policy.go).
//
// JobSet's Go module is not available, so a JobSet is decoded into a small struct of the fields
// these manifests use, whose Job templates are batch/v1 types; the same holds for the monitoring
// resources (PodMonitoring, ServiceMonitor). A field these structs do not know is an error: add
// it to the struct when a manifest starts to use it.
package manifest

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	sigsjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"
)

// Doc is one decoded document of a manifest file.
type Doc struct {
	File  string // base name of the file
	Index int    // position in the file, from 0
	Kind  string
	Obj   metav1.Object // *appsv1.DaemonSet, *batchv1.Job, *JobSet, *corev1.ConfigMap, ...
}

func (d Doc) String() string {
	return fmt.Sprintf("%s (document %d, %s %s)", d.File, d.Index+1, d.Kind, d.Obj.GetName())
}

// Namespace is the document's namespace, "default" when it names none.
func (d Doc) Namespace() string {
	if ns := d.Obj.GetNamespace(); ns != "" {
		return ns
	}
	return "default"
}

// JobSet is jobset.x-k8s.io/v1alpha2 JobSet, reduced to the fields the manifests use.
type JobSet struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              JobSetSpec `json:"spec"`
}

type JobSetSpec struct {
	ReplicatedJobs []ReplicatedJob `json:"replicatedJobs"`
	Network        *struct {
		EnableDNSHostnames       *bool  `json:"enableDNSHostnames,omitempty"`
		Subdomain                string `json:"subdomain,omitempty"`
		PublishNotReadyAddresses *bool  `json:"publishNotReadyAddresses,omitempty"`
	} `json:"network,omitempty"`
	FailurePolicy *struct {
		MaxRestarts int32 `json:"maxRestarts"`
	} `json:"failurePolicy,omitempty"`
	Suspend *bool `json:"suspend,omitempty"`
}

type ReplicatedJob struct {
	Name     string                  `json:"name"`
	Replicas int32                   `json:"replicas,omitempty"`
	Template batchv1.JobTemplateSpec `json:"template"`
}

// PodMonitoring is monitoring.googleapis.com/v1 PodMonitoring (GKE managed Prometheus).
type PodMonitoring struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		Selector  metav1.LabelSelector `json:"selector"`
		Endpoints []ScrapeEndpoint     `json:"endpoints"`
	} `json:"spec"`
}

// ScrapeEndpoint is an endpoint of a PodMonitoring (port by name or number).
type ScrapeEndpoint struct {
	Port     intstr.IntOrString `json:"port"`
	Path     string             `json:"path,omitempty"`
	Interval string             `json:"interval,omitempty"`
	Timeout  string             `json:"timeout,omitempty"`
	Scheme   string             `json:"scheme,omitempty"`
}

// ServiceMonitor is monitoring.coreos.com/v1 ServiceMonitor (prometheus-operator).
type ServiceMonitor struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		Selector          metav1.LabelSelector `json:"selector"`
		NamespaceSelector *struct {
			Any        bool     `json:"any,omitempty"`
			MatchNames []string `json:"matchNames,omitempty"`
		} `json:"namespaceSelector,omitempty"`
		Endpoints []struct {
			Port          string `json:"port,omitempty"`
			Path          string `json:"path,omitempty"`
			Interval      string `json:"interval,omitempty"`
			ScrapeTimeout string `json:"scrapeTimeout,omitempty"`
			Scheme        string `json:"scheme,omitempty"`
		} `json:"endpoints"`
	} `json:"spec"`
}

// kinds maps apiVersion/kind to the type a document decodes into. Any other kind is an error.
var kinds = map[string]func() metav1.Object{
	"v1/Namespace":                    func() metav1.Object { return &corev1.Namespace{} },
	"v1/ServiceAccount":               func() metav1.Object { return &corev1.ServiceAccount{} },
	"v1/ConfigMap":                    func() metav1.Object { return &corev1.ConfigMap{} },
	"v1/ResourceQuota":                func() metav1.Object { return &corev1.ResourceQuota{} },
	"v1/Service":                      func() metav1.Object { return &corev1.Service{} },
	"v1/Pod":                          func() metav1.Object { return &corev1.Pod{} },
	"apps/v1/DaemonSet":               func() metav1.Object { return &appsv1.DaemonSet{} },
	"batch/v1/Job":                    func() metav1.Object { return &batchv1.Job{} },
	"jobset.x-k8s.io/v1alpha2/JobSet": func() metav1.Object { return &JobSet{} },
	"monitoring.googleapis.com/v1/PodMonitoring": func() metav1.Object { return &PodMonitoring{} },
	"monitoring.coreos.com/v1/ServiceMonitor":    func() metav1.Object { return &ServiceMonitor{} },
}

var docSeparator = regexp.MustCompile(`(?m)^---[ \t]*$`)

// Load decodes every document of a manifest file named name.
func Load(name string, data []byte) ([]Doc, error) {
	var docs []Doc
	for i, part := range docSeparator.Split(string(data), -1) {
		j, err := yaml.YAMLToJSONStrict([]byte(part)) // duplicate keys are errors
		if err != nil {
			return nil, fmt.Errorf("%s (document %d): %w", name, i+1, err)
		}
		if string(j) == "null" {
			continue // only comments
		}
		var tm metav1.TypeMeta
		if err := json.Unmarshal(j, &tm); err != nil {
			return nil, fmt.Errorf("%s (document %d): %w", name, i+1, err)
		}
		mk, ok := kinds[tm.APIVersion+"/"+tm.Kind]
		if !ok {
			return nil, fmt.Errorf("%s (document %d): kind %q of apiVersion %q is not one this check knows", name, i+1, tm.Kind, tm.APIVersion)
		}
		obj := mk()
		// Case-sensitive, unknown and duplicate fields are errors, as in the API server's
		// strict field validation.
		strict, err := sigsjson.UnmarshalStrict(j, obj)
		if err == nil && len(strict) > 0 {
			err = errors.Join(strict...)
		}
		if err != nil {
			return nil, fmt.Errorf("%s (document %d, %s): %w", name, i+1, tm.Kind, err)
		}
		if obj.GetName() == "" {
			return nil, fmt.Errorf("%s (document %d, %s): metadata.name is missing", name, i+1, tm.Kind)
		}
		docs = append(docs, Doc{File: name, Index: len(docs), Kind: tm.Kind, Obj: obj})
	}
	return docs, nil
}

// LoadDir decodes every *.yaml file of dir, in name order.
func LoadDir(dir string) ([]Doc, error) {
	files, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	if err != nil {
		return nil, err
	}
	if len(files) == 0 {
		return nil, fmt.Errorf("no *.yaml in %s", dir)
	}
	var all []Doc
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			return nil, err
		}
		docs, err := Load(filepath.Base(f), data)
		if err != nil {
			return nil, err
		}
		all = append(all, docs...)
	}
	return all, nil
}

// PodTemplate is a pod spec inside a document: what its controller makes pods from.
type PodTemplate struct {
	Doc       Doc
	Where     string // path of the template in the document, for messages
	Namespace string
	Template  *corev1.PodTemplateSpec
	// Indexed: an Indexed Job's template (its pods get a completion index).
	Indexed bool
	// JobSet and ReplicatedJob name the JobSet the template belongs to, if any.
	JobSet, ReplicatedJob string
	// Job is the spec of the Job whose template it is (also a JobSet's), nil for other kinds.
	Job *batchv1.JobSpec
}

func (p PodTemplate) String() string { return p.Doc.String() + " " + p.Where }

// PodTemplates lists the pod templates of docs.
func PodTemplates(docs []Doc) []PodTemplate {
	var out []PodTemplate
	for _, d := range docs {
		ns := d.Namespace()
		switch o := d.Obj.(type) {
		case *appsv1.DaemonSet:
			out = append(out, PodTemplate{Doc: d, Where: "spec.template", Namespace: ns, Template: &o.Spec.Template})
		case *batchv1.Job:
			out = append(out, PodTemplate{Doc: d, Where: "spec.template", Namespace: ns, Template: &o.Spec.Template, Indexed: isIndexed(o.Spec), Job: &o.Spec})
		case *JobSet:
			for i := range o.Spec.ReplicatedJobs {
				rj := &o.Spec.ReplicatedJobs[i]
				out = append(out, PodTemplate{Doc: d, Where: fmt.Sprintf("spec.replicatedJobs[%d].template.spec.template", i), Namespace: ns,
					Template: &rj.Template.Spec.Template, Indexed: isIndexed(rj.Template.Spec), JobSet: o.Name, ReplicatedJob: rj.Name, Job: &rj.Template.Spec})
			}
		case *corev1.Pod:
			out = append(out, PodTemplate{Doc: d, Where: "spec", Namespace: ns, Template: &corev1.PodTemplateSpec{ObjectMeta: o.ObjectMeta, Spec: o.Spec}})
		}
	}
	return out
}

func isIndexed(s batchv1.JobSpec) bool {
	return s.CompletionMode != nil && *s.CompletionMode == batchv1.IndexedCompletion
}

// Node is what a pod learns from the node it runs on and the cluster around it.
type Node struct {
	Name   string
	HostIP string
	PodIP  string // the pod's IP (the host's with hostNetwork)
	// ConfigMaps by "namespace/name", as configMapKeyRef and envFrom read them.
	ConfigMaps map[string]map[string]string
}

// ConfigMaps collects the ConfigMaps of docs for Node.ConfigMaps.
func ConfigMaps(docs []Doc) map[string]map[string]string {
	out := map[string]map[string]string{}
	for _, d := range docs {
		if cm, ok := d.Obj.(*corev1.ConfigMap); ok {
			out[d.Namespace()+"/"+cm.Name] = cm.Data
		}
	}
	return out
}

// Instantiate makes the pod a controller would create from the template, with the given
// completion index (Indexed Jobs) and job index (JobSets): the Job controller's annotation
// and JOB_COMPLETION_INDEX variable, JobSet's annotations, and the node's addresses.
func (p PodTemplate) Instantiate(name string, jobIndex, completionIndex int, node Node) *corev1.Pod {
	pod := &corev1.Pod{ObjectMeta: *p.Template.ObjectMeta.DeepCopy(), Spec: *p.Template.Spec.DeepCopy()}
	pod.Name, pod.Namespace, pod.UID = name, p.Namespace, types.UID("uid-"+name)
	pod.Spec.NodeName = node.Name
	pod.Status.HostIP, pod.Status.PodIP = node.HostIP, node.PodIP
	if pod.Spec.HostNetwork {
		pod.Status.PodIP = node.HostIP
	}
	if pod.Annotations == nil {
		pod.Annotations = map[string]string{}
	}
	if pod.Labels == nil {
		pod.Labels = map[string]string{}
	}
	if p.JobSet != "" {
		for k, v := range map[string]string{
			"jobset.sigs.k8s.io/jobset-name":        p.JobSet,
			"jobset.sigs.k8s.io/replicatedjob-name": p.ReplicatedJob,
			"jobset.sigs.k8s.io/job-index":          fmt.Sprint(jobIndex),
		} {
			pod.Annotations[k], pod.Labels[k] = v, v
		}
	}
	if p.Indexed {
		const key = "batch.kubernetes.io/job-completion-index"
		pod.Annotations[key], pod.Labels[key] = fmt.Sprint(completionIndex), fmt.Sprint(completionIndex)
		idx := corev1.EnvVar{Name: "JOB_COMPLETION_INDEX", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.annotations['" + key + "']"}}}
		for _, cs := range [][]corev1.Container{pod.Spec.InitContainers, pod.Spec.Containers} {
			for i := range cs {
				cs[i].Env = append([]corev1.EnvVar{idx}, cs[i].Env...)
			}
		}
	}
	return pod
}

// Env returns the container's environment as the kubelet builds it (envFrom, then env, each
// value expanded against the variables before it), as an ordered list of NAME=VALUE.
func Env(pod *corev1.Pod, c *corev1.Container, node Node) ([]string, error) {
	var names []string
	vals := map[string]string{}
	set := func(k, v string) {
		if _, ok := vals[k]; !ok {
			names = append(names, k)
		}
		vals[k] = v
	}
	for _, ef := range c.EnvFrom {
		if ef.ConfigMapRef == nil {
			return nil, fmt.Errorf("container %s: only envFrom.configMapRef is supported here", c.Name)
		}
		data, ok := node.ConfigMaps[pod.Namespace+"/"+ef.ConfigMapRef.Name]
		if !ok {
			return nil, fmt.Errorf("container %s: envFrom names ConfigMap %s/%s, which no manifest defines", c.Name, pod.Namespace, ef.ConfigMapRef.Name)
		}
		for k, v := range data {
			set(ef.Prefix+k, v)
		}
	}
	for _, e := range c.Env {
		if e.ValueFrom == nil {
			set(e.Name, Expand(e.Value, vals))
			continue
		}
		v, err := envSource(pod, e, node)
		if err != nil {
			return nil, fmt.Errorf("container %s: env %s: %w", c.Name, e.Name, err)
		}
		set(e.Name, v)
	}
	out := make([]string, len(names))
	for i, k := range names {
		out[i] = k + "=" + vals[k]
	}
	return out, nil
}

var fieldKey = regexp.MustCompile(`^metadata\.(labels|annotations)\['([^']+)'\]$`)

func envSource(pod *corev1.Pod, e corev1.EnvVar, node Node) (string, error) {
	src := e.ValueFrom
	switch {
	case src.FieldRef != nil:
		switch f := src.FieldRef.FieldPath; f {
		case "metadata.name":
			return pod.Name, nil
		case "metadata.namespace":
			return pod.Namespace, nil
		case "metadata.uid":
			return string(pod.UID), nil
		case "spec.nodeName":
			return pod.Spec.NodeName, nil
		case "spec.serviceAccountName":
			return pod.Spec.ServiceAccountName, nil
		case "status.podIP":
			return pod.Status.PodIP, nil
		case "status.hostIP":
			return pod.Status.HostIP, nil
		default:
			m := fieldKey.FindStringSubmatch(f)
			if m == nil {
				return "", fmt.Errorf("fieldRef %q is not supported here", f)
			}
			if m[1] == "labels" {
				return pod.Labels[m[2]], nil
			}
			return pod.Annotations[m[2]], nil
		}
	case src.ConfigMapKeyRef != nil:
		ref := src.ConfigMapKeyRef
		data, ok := node.ConfigMaps[pod.Namespace+"/"+ref.Name]
		if !ok {
			return "", fmt.Errorf("configMapKeyRef names ConfigMap %s/%s, which no manifest defines", pod.Namespace, ref.Name)
		}
		v, ok := data[ref.Key]
		if !ok {
			return "", fmt.Errorf("ConfigMap %s/%s has no key %q", pod.Namespace, ref.Name, ref.Key)
		}
		return v, nil
	}
	return "", errors.New("only fieldRef and configMapKeyRef are supported here")
}

// Expand replaces $(VAR) with the variable's value as the kubelet does in env values, command
// and args: $$ is a literal $, and a reference to an undefined variable stays as written.
func Expand(s string, vars map[string]string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] != '$' || i+1 == len(s) {
			b.WriteByte(s[i])
			continue
		}
		switch s[i+1] {
		case '$':
			b.WriteByte('$')
			i++
		case '(':
			end := strings.IndexByte(s[i+2:], ')')
			if end < 0 {
				b.WriteString(s[i:])
				return b.String()
			}
			name := s[i+2 : i+2+end]
			if v, ok := vars[name]; ok {
				b.WriteString(v)
			} else {
				b.WriteString(s[i : i+3+end])
			}
			i += 2 + end
		default:
			b.WriteByte('$')
		}
	}
	return b.String()
}

// EnvMap turns Env's list into a map.
func EnvMap(env []string) map[string]string {
	m := map[string]string{}
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		m[k] = v
	}
	return m
}

// CommandLine is the container's command and args with variables expanded, as the kubelet
// hands them to the runtime. An empty command means the image's entrypoint: an error here,
// since the checks need the program to be named.
func CommandLine(c *corev1.Container, env []string) ([]string, error) {
	if len(c.Command) == 0 {
		return nil, fmt.Errorf("container %s: no command (the image's entrypoint would run): name the program", c.Name)
	}
	vars := EnvMap(env)
	var argv []string
	for _, a := range append(append([]string(nil), c.Command...), c.Args...) {
		argv = append(argv, Expand(a, vars))
	}
	return argv, nil
}

// AllContainers lists the pod's init containers, then its containers.
func AllContainers(spec *corev1.PodSpec) []*corev1.Container {
	var out []*corev1.Container
	for i := range spec.InitContainers {
		out = append(out, &spec.InitContainers[i])
	}
	for i := range spec.Containers {
		out = append(out, &spec.Containers[i])
	}
	return out
}

// IsAgent reports whether the container runs mtcfs.
func IsAgent(c *corev1.Container) bool {
	return len(c.Command) > 0 && filepath.Base(c.Command[0]) == "mtcfs"
}

// IsSidecar reports whether c is a native sidecar: an init container that restarts always.
func IsSidecar(spec *corev1.PodSpec, c *corev1.Container) bool {
	for i := range spec.InitContainers {
		if &spec.InitContainers[i] == c {
			return c.RestartPolicy != nil && *c.RestartPolicy == corev1.ContainerRestartPolicyAlways
		}
	}
	return false
}
