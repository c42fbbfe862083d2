package main

import (
	"context"
	"time"

	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/lease"
)

// LockCmd runs a command as the leader of a resource: `consul lock` with fencing. See
// lease.RunLocked for what happens when the lock is lost or the command exits.
type LockCmd struct {
	Resource string `help:"Fenced resource to lead (as configured in the proxy), e.g. billing." required:"" env:"FENCEPROXY_RESOURCE"`
	Key      string `help:"Consul lock key; default locks/<resource>." env:"FENCEPROXY_KEY"`

	ConsulAddr   string `help:"Consul HTTP address (host:port or URL); default CONSUL_HTTP_ADDR, else 127.0.0.1:8500." name:"consul-addr" env:"FENCEPROXY_CONSUL_ADDR"`
	ConsulToken  string `help:"Consul ACL token (needs session write and key write on the lock key); default CONSUL_HTTP_TOKEN." name:"consul-token" env:"FENCEPROXY_CONSUL_TOKEN"`
	ConsulCAFile string `help:"CA file to verify Consul's TLS certificate (implies https)." name:"consul-ca-file" type:"path" env:"FENCEPROXY_CONSUL_CA_FILE"`
	ConsulScheme string `help:"http or https; default from --consul-addr." name:"consul-scheme" enum:",http,https" default:"" env:"FENCEPROXY_CONSUL_SCHEME"`

	DatabaseURL string `help:"Base postgres:// URL (pointing at the proxy) that the command gets as DATABASE_URL, with the fence parameters added to its options (default: $DATABASE_URL). Empty: no DATABASE_URL, only FENCE_RESOURCE, FENCE_TOKEN, FENCE_SESSION, FENCE_KEY." name:"database-url" env:"FENCEPROXY_DATABASE_URL,DATABASE_URL"`

	TTL       time.Duration `help:"Consul session TTL (10s to 24h). Consul invalidates a silent holder after TTL to 2xTTL." name:"ttl" default:"10s" env:"FENCEPROXY_TTL"`
	LockDelay time.Duration `help:"Consul lock-delay after the holder's session is invalidated. 0 is safe with fencing: a stale leader's writes are refused by the database." name:"lock-delay" default:"0s" env:"FENCEPROXY_LOCK_DELAY"`
	Grace     time.Duration `help:"After losing the lock: time between SIGTERM and SIGKILL to the command's process group." default:"10s" env:"FENCEPROXY_GRACE"`
	OnLost    string        `help:"After losing the lock and stopping the command: retry (campaign again) or exit." name:"on-lost" enum:"retry,exit" default:"retry" env:"FENCEPROXY_ON_LOST"`

	Command []string `arg:"" passthrough:"" help:"Command to run, and its arguments (after --)."`
}

// Run campaigns and supervises the command until it exits; it returns the command's exit
// status as an error with an ExitCode method when it is not 0.
func (c *LockCmd) Run(ctx context.Context, log *zap.Logger) error {
	command := c.Command
	if len(command) > 0 && command[0] == "--" {
		// kong's passthrough keeps the separator.
		command = command[1:]
	}
	client, err := lease.NewClient(lease.ConsulConfig{
		Addr: c.ConsulAddr, Token: c.ConsulToken, CAFile: c.ConsulCAFile, Scheme: c.ConsulScheme,
	})
	if err != nil {
		return err
	}
	return lease.RunLocked(ctx, lease.RunConfig{
		Client:      client,
		Resource:    c.Resource,
		Key:         c.Key,
		Command:     command,
		DatabaseURL: c.DatabaseURL,
		TTL:         c.TTL,
		LockDelay:   c.LockDelay,
		Grace:       c.Grace,
		OnLost:      c.OnLost,
		Logger:      log,
	})
}
