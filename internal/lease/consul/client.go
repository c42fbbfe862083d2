package consul

import (
	"fmt"
	"strings"

	"github.com/hashicorp/consul/api"
)

// Config says how to reach Consul's HTTP API. Empty fields fall back to Consul's own
// environment variables (CONSUL_HTTP_ADDR, CONSUL_HTTP_TOKEN, CONSUL_CACERT,
// CONSUL_CLIENT_CERT, CONSUL_CLIENT_KEY, ...), then to 127.0.0.1:8500 over HTTP.
type Config struct {
	// Addr is host:port, or a URL with its scheme: http://host:port, https://host:port,
	// unix:///path.
	Addr string
	// Scheme is "http" or "https"; empty: from Addr's scheme, else https when CAFile is
	// set, else Consul's environment, else http.
	Scheme string
	// Token is the ACL token. It needs key read on watched keys and, to campaign, key
	// write on the lock key and session write.
	Token string
	// CAFile verifies Consul's TLS certificate (https). CertFile and KeyFile are the
	// client certificate, when Consul asks for one.
	CAFile, CertFile, KeyFile string
}

// NewClient returns a Consul API client for c.
func NewClient(c Config) (*api.Client, error) {
	cfg := api.DefaultConfig()
	if c.Addr != "" {
		cfg.Address = c.Addr
	}
	if c.Token != "" {
		cfg.Token = c.Token
	}
	if c.CAFile != "" {
		cfg.TLSConfig.CAFile = c.CAFile
		if !strings.Contains(cfg.Address, "://") {
			// A CA file only makes sense over TLS; without a scheme the API would use http.
			cfg.Scheme = "https"
		}
	}
	if c.CertFile != "" {
		cfg.TLSConfig.CertFile = c.CertFile
	}
	if c.KeyFile != "" {
		cfg.TLSConfig.KeyFile = c.KeyFile
	}
	switch c.Scheme {
	case "":
	case "http", "https":
		cfg.Scheme = c.Scheme
	default:
		return nil, fmt.Errorf("lease: consul scheme %q: want http or https", c.Scheme)
	}
	client, err := api.NewClient(cfg)
	if err != nil {
		return nil, fmt.Errorf("lease: consul client for %s: %w", cfg.Address, err)
	}
	return client, nil
}
