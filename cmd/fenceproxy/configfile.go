package main

import (
	"bytes"
	"fmt"
	"io"
	"path/filepath"
	"strings"

	"github.com/alecthomas/kong"
	"sigs.k8s.io/yaml"
)

// configFile reads the --config file: YAML when its name ends in .yaml or .yml, JSON
// otherwise (the format of earlier versions, which keeps working). Either way the keys are
// the flag names.
//
// Why YAML and not TOML: the people who run proxies next to PostgreSQL already write YAML
// for it (Kubernetes manifests and ConfigMaps, Patroni, Prometheus, docker compose), a
// ConfigMap mounts the file as it is, and YAML takes the JSON files of earlier versions
// unchanged. Why sigs.k8s.io/yaml: it turns YAML into JSON, so that one reader
// (configJSON: flag names as keys, unknown keys refused, one object) serves both formats,
// and it is the library the Kubernetes manifests' test decodes with already. kong's own
// YAML loader (kong-yaml) has no licence file.
func configFile(r io.Reader) (kong.Resolver, error) {
	name := ""
	if f, ok := r.(interface{ Name() string }); ok {
		name = f.Name()
	}
	switch strings.ToLower(filepath.Ext(name)) {
	case ".yaml", ".yml":
	default:
		return configJSON(r)
	}
	b, err := io.ReadAll(r)
	if err != nil {
		return nil, fmt.Errorf("configuration file %s: %w", name, err)
	}
	j, err := yaml.YAMLToJSON(b)
	if err != nil {
		return nil, fmt.Errorf("configuration file %s: invalid YAML: %w", name, err)
	}
	if t := bytes.TrimSpace(j); len(t) == 0 || t[0] != '{' {
		return nil, fmt.Errorf("configuration file %s: want one YAML mapping whose keys are flag names (fenceproxy serve --help)", name)
	}
	return configJSON(namedReader{Reader: bytes.NewReader(j), name: name})
}

// namedReader keeps the file's name for configJSON's messages.
type namedReader struct {
	io.Reader
	name string
}

func (n namedReader) Name() string { return n.name }

// Resolve implements kong.Resolver: a key may also be one of the flag's aliases
// (admin-listen for metrics-listen), as on the command line; kong's JSON resolver looks up
// the flag's name only, so a file with admin-listen set nothing and said nothing.
func (k knownKeys) Resolve(ctx *kong.Context, parent *kong.Path, flag *kong.Flag) (any, error) {
	v, err := k.Resolver.Resolve(ctx, parent, flag)
	if v != nil || err != nil {
		return v, err
	}
	for _, a := range flag.Aliases {
		value := *flag.Value
		value.Name = a
		alias := *flag
		alias.Value = &value
		if v, err := k.Resolver.Resolve(ctx, parent, &alias); v != nil || err != nil {
			return v, err
		}
	}
	return nil, nil
}
