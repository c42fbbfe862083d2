package main

// Tests of what deploy/ ships: the Kubernetes manifests, the systemd unit. (The example
// configuration file is TestExampleConfig's.)
//
// Why k8s.io/api and sigs.k8s.io/yaml: the manifests are checked against the API types
// that the API server itself decodes them into, so a misspelt or misplaced field (a probe
// under the pod instead of the container) fails here rather than at kubectl apply, with no
// cluster needed. sigs.k8s.io/yaml is how Kubernetes reads YAML (through the types' JSON
// tags), and UnmarshalStrict refuses unknown and duplicate fields as kubectl's server-side
// validation does. Both are test-only: the fenceproxy binary does not link k8s.io/api.

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"
)

// TestKubernetesManifests decodes every document of deploy/kubernetes/*.yaml strictly into
// its API type, and checks what the deployment docs promise: each fenceproxy container
// probes /healthz and /readyz on its admin port, reads its configuration from the ConfigMap
// and its key from the Secret at the path the configuration names, and the ConfigMap's
// configuration loads as fenceproxy serve --config would load it.
func TestKubernetesManifests(t *testing.T) {
	files, err := filepath.Glob(filepath.Join("..", "..", "deploy", "kubernetes", "*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests: %v", err)
	}
	var (
		pods       = map[string]corev1.PodSpec{}
		configMaps = map[string]corev1.ConfigMap{}
		secrets    = map[string]corev1.Secret{}
		kinds      []string
	)
	for _, file := range files {
		raw, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for i, doc := range regexp.MustCompile(`(?m)^---\s*$`).Split(string(raw), -1) {
			if strings.TrimSpace(stripComments(doc)) == "" {
				continue
			}
			where := fmt.Sprintf("%s, document %d", filepath.Base(file), i+1)
			var tm metav1.TypeMeta
			if err := yaml.Unmarshal([]byte(doc), &tm); err != nil {
				t.Fatalf("%s: %v", where, err)
			}
			var obj any
			switch tm.APIVersion + " " + tm.Kind {
			case "apps/v1 Deployment":
				obj = &appsv1.Deployment{}
			case "v1 Service":
				obj = &corev1.Service{}
			case "v1 ConfigMap":
				obj = &corev1.ConfigMap{}
			case "v1 Secret":
				obj = &corev1.Secret{}
			case "policy/v1 PodDisruptionBudget":
				obj = &policyv1.PodDisruptionBudget{}
			default:
				t.Fatalf("%s: %s %s: add its type to this test", where, tm.APIVersion, tm.Kind)
			}
			if err := yaml.UnmarshalStrict([]byte(doc), obj); err != nil {
				t.Fatalf("%s (%s): %v", where, tm.Kind, err)
			}
			kinds = append(kinds, tm.Kind)
			switch o := obj.(type) {
			case *appsv1.Deployment:
				if !labelsMatch(o.Spec.Selector.MatchLabels, o.Spec.Template.Labels) {
					t.Errorf("%s: the selector %v does not select the pod labels %v", where, o.Spec.Selector.MatchLabels, o.Spec.Template.Labels)
				}
				pods[where+" "+o.Name] = o.Spec.Template.Spec
			case *corev1.ConfigMap:
				configMaps[o.Name] = *o
			case *corev1.Secret:
				secrets[o.Name] = *o
			}
		}
	}
	for _, want := range []string{"Deployment", "Service", "ConfigMap", "Secret"} {
		if !slices.Contains(kinds, want) {
			t.Errorf("no %s among the manifests", want)
		}
	}

	var proxies int
	for where, pod := range pods {
		for _, c := range append(slices.Clone(pod.InitContainers), pod.Containers...) {
			if !slices.Contains(c.Args, "serve") || len(c.Args) == 0 || c.Args[0] != "fenceproxy" {
				continue
			}
			proxies++
			where := where + " container " + c.Name
			checkProbe(t, where, "liveness", c.LivenessProbe, "/healthz")
			checkProbe(t, where, "readiness", c.ReadinessProbe, "/readyz")
			cfgPath := c.Args[slices.Index(c.Args, "--config")+1]
			cfg := mountedFile(t, where, pod, c, cfgPath, configMaps, secrets)
			dir := t.TempDir()
			file := filepath.Join(dir, filepath.Base(cfgPath))
			if err := os.WriteFile(file, cfg, 0o600); err != nil {
				t.Fatal(err)
			}
			loaded := parseServe(t, file)
			if loaded.Serve.KeyFile == "" {
				t.Errorf("%s: the configuration names no key-file", where)
				continue
			}
			mountedFile(t, where, pod, c, loaded.Serve.KeyFile, configMaps, secrets)
			if port := strings.TrimPrefix(loaded.Serve.MetricsListen, "0.0.0.0:"); port == loaded.Serve.MetricsListen ||
				!slices.ContainsFunc(c.Ports, func(p corev1.ContainerPort) bool { return p.Name == "admin" && fmt.Sprint(p.ContainerPort) == port }) {
				t.Errorf("%s: admin-listen %q is not the admin port on every address (probes reach the pod's address)", where, loaded.Serve.MetricsListen)
			}
		}
	}
	if proxies < 2 {
		t.Errorf("%d fenceproxy containers, want one in the Service's Deployment and one sidecar", proxies)
	}
}

func labelsMatch(selector, labels map[string]string) bool {
	for k, v := range selector {
		if labels[k] != v {
			return false
		}
	}
	return len(selector) > 0
}

func checkProbe(t *testing.T, where, kind string, p *corev1.Probe, path string) {
	t.Helper()
	if p == nil || p.HTTPGet == nil || p.HTTPGet.Path != path || p.HTTPGet.Port.String() != "admin" {
		t.Errorf("%s: the %s probe is %+v, want GET %s on the admin port", where, kind, p, path)
	}
}

// mountedFile returns the content a container sees at path, from the ConfigMap or Secret
// volume mounted there.
func mountedFile(t *testing.T, where string, pod corev1.PodSpec, c corev1.Container, path string,
	configMaps map[string]corev1.ConfigMap, secrets map[string]corev1.Secret) []byte {
	t.Helper()
	for _, m := range c.VolumeMounts {
		var key string
		switch {
		case m.SubPath != "" && m.MountPath == path:
			key = m.SubPath
		case m.SubPath == "" && filepath.Dir(path) == m.MountPath:
			key = filepath.Base(path)
		default:
			continue
		}
		i := slices.IndexFunc(pod.Volumes, func(v corev1.Volume) bool { return v.Name == m.Name })
		if i < 0 {
			t.Fatalf("%s: volume %s is not in the pod", where, m.Name)
		}
		v := pod.Volumes[i]
		switch {
		case v.ConfigMap != nil:
			if s, ok := configMaps[v.ConfigMap.Name].Data[key]; ok {
				return []byte(s)
			}
		case v.Secret != nil:
			s := secrets[v.Secret.SecretName]
			if b, ok := s.Data[key]; ok {
				return b
			}
			if b, ok := s.StringData[key]; ok {
				return []byte(b)
			}
		}
		t.Fatalf("%s: %s is mounted from volume %s, which has no %s", where, path, m.Name, key)
	}
	t.Fatalf("%s: nothing is mounted at %s", where, path)
	return nil
}

func stripComments(doc string) string {
	var b strings.Builder
	for _, line := range strings.Split(doc, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(line), "#") {
			b.WriteString(line + "\n")
		}
	}
	return b.String()
}

// TestSystemdUnit runs systemd-analyze verify on deploy/systemd/fenceproxy.service where the
// command exists. verify also checks that ExecStart's program is there, so the copy it checks
// runs this test binary instead of /usr/local/bin/fenceproxy: nothing else is changed.
func TestSystemdUnit(t *testing.T) {
	unit, err := os.ReadFile(filepath.Join("..", "..", "deploy", "systemd", "fenceproxy.service"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(unit, []byte("ExecStart=/usr/local/bin/fenceproxy serve --config /etc/fenceproxy/fenceproxy.yaml")) {
		t.Fatal("the unit's ExecStart is not fenceproxy serve --config /etc/fenceproxy/fenceproxy.yaml")
	}
	analyze, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Skip("systemd-analyze is not installed here: the unit was not verified (Debian's systemd package has it)")
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(t.TempDir(), "fenceproxy.service")
	if err := os.WriteFile(file, bytes.ReplaceAll(unit, []byte("/usr/local/bin/fenceproxy"), []byte(self)), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(analyze, "verify", file).CombinedOutput()
	if err != nil || len(bytes.TrimSpace(out)) > 0 {
		t.Errorf("systemd-analyze verify: %v\n%s", err, out)
	}
}
