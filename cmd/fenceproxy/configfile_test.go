package main

import (
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// example is the example configuration file that deployments start from.
var example = filepath.Join("..", "..", "deploy", "fenceproxy.yaml")

// parseServe parses `serve --config file` as fenceproxy does (without running it).
func parseServe(t *testing.T, file string) *cli {
	t.Helper()
	var c cli
	parser, err := newParser(&c)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := parser.Parse([]string{"serve", "--config", file}); err != nil {
		t.Fatalf("fenceproxy serve --config %s: %v", file, err)
	}
	return &c
}

// TestExampleConfig loads deploy/fenceproxy.yaml, checks that it sets every setting of
// serve (so the example cannot fall behind a new flag), and that the same settings as a JSON
// file (the format of earlier versions) load to the same configuration.
func TestExampleConfig(t *testing.T) {
	c := parseServe(t, example)
	if c.Serve.Listen != "0.0.0.0:7432" || c.Serve.Upstream != "postgres://db.internal:5432" ||
		!slices.Equal(c.Serve.Resources, []string{"billing=locks/billing", "ledger", "reports"}) ||
		c.Serve.ShutdownGrace.String() != "30s" || c.Serve.MaxClients != 1000 ||
		c.Serve.MetricsListen != "127.0.0.1:9187" { // admin-listen, an alias
		t.Errorf("the example loaded as %+v", c.Serve.Config)
	}

	raw, err := os.ReadFile(example)
	if err != nil {
		t.Fatal(err)
	}
	var keys map[string]any
	if err := yaml.Unmarshal(raw, &keys); err != nil {
		t.Fatal(err)
	}
	var c0 cli
	parser, err := newParser(&c0)
	if err != nil {
		t.Fatal(err)
	}
	var missing []string
	flags := parser.Model.Node.Flags
	for _, n := range parser.Model.Node.Children {
		if n.Name == "serve" {
			flags = append(slices.Clone(flags), n.Flags...)
		}
	}
	for _, f := range flags {
		if f.Hidden || f.Name == "help" || f.Name == "config" || f.Name == "version" { // actions, not settings
			continue
		}
		if _, ok := keys[f.Name]; !ok {
			// An alias is as good as the name (admin-listen for metrics-listen).
			if !slices.ContainsFunc(f.Aliases, func(a string) bool { _, ok := keys[a]; return ok }) {
				missing = append(missing, f.Name)
			}
		}
	}
	if len(missing) > 0 {
		t.Errorf("deploy/fenceproxy.yaml does not set %s: the example sets every setting", strings.Join(missing, ", "))
	}

	asJSON, err := yaml.YAMLToJSON(raw)
	if err != nil {
		t.Fatal(err)
	}
	jsonFile := filepath.Join(t.TempDir(), "fenceproxy.json")
	if err := os.WriteFile(jsonFile, asJSON, 0o600); err != nil {
		t.Fatal(err)
	}
	j := parseServe(t, jsonFile)
	if !reflect.DeepEqual(j.Serve.Config, c.Serve.Config) || j.LogLevel != c.LogLevel || j.LogFormat != c.LogFormat {
		t.Errorf("the same settings as JSON loaded differently:\nyaml %+v\njson %+v", c.Serve.Config, j.Serve.Config)
	}
}

// TestConfigFileErrors: a YAML file is refused as a JSON one is, with the file named.
func TestConfigFileErrors(t *testing.T) {
	for _, tc := range []struct {
		name, body, want string
	}{
		{"unknown.yaml", "upstream: postgres://x:5432\nmax_client: 3\n", "unknown key(s) max-client"},
		{"list.yml", "- upstream\n", "want one YAML mapping"},
		{"bad.yaml", "upstream: [\n", "invalid YAML"},
		{"bad.json", "{\"upstream\": ", "empty or truncated"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			file := filepath.Join(t.TempDir(), tc.name)
			if err := os.WriteFile(file, []byte(tc.body), 0o600); err != nil {
				t.Fatal(err)
			}
			var c cli
			parser, err := newParser(&c)
			if err != nil {
				t.Fatal(err)
			}
			_, err = parser.Parse([]string{"serve", "--config", file})
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), tc.name) {
				t.Errorf("error %v, want one naming %s and saying %q", err, tc.name, tc.want)
			}
		})
	}
}
