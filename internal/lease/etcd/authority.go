package etcd

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/lease"
)

// readTimeout bounds each read of an election: an etcd that does not answer within it is
// unreachable, and sessions are refused (ZF007) rather than kept waiting.
const readTimeout = 5 * time.Second

// AuthorityConfig configures NewAuthority.
type AuthorityConfig struct {
	// Endpoints are etcd's client URLs (--etcd-endpoints).
	Endpoints []string
	// Resources are NAME=PREFIX, the election prefix of `fenceproxy lock --store etcd`
	// (--etcd-resource).
	Resources []string
	// Logger (nil: no logs).
	Logger *zap.Logger
}

// Authority answers for etcd elections (lease.Authority): a resource's holder is the
// election's leader, the oldest key under its prefix; the token is that key's
// CreateRevision and the holder's session its lease. It reads linearizably, and tells a
// store revision lower than one read before (a snapshot restore) as a regression.
type Authority struct {
	client   *clientv3.Client
	prefixes map[string]string // resource -> election prefix, with its trailing "/"
	log      *zap.Logger

	mu      sync.Mutex
	highest int64 // the highest store revision read
}

// NewAuthority returns the Authority of cfg's resources (nil, nil when there are none).
func NewAuthority(cfg AuthorityConfig) (*Authority, error) {
	if len(cfg.Resources) == 0 {
		return nil, nil
	}
	if len(cfg.Endpoints) == 0 {
		return nil, fmt.Errorf("etcd-resource needs etcd-endpoints")
	}
	a := &Authority{prefixes: map[string]string{}, log: cfg.Logger}
	if a.log == nil {
		a.log = zap.NewNop()
	}
	for _, spec := range cfg.Resources {
		name, prefix, ok := strings.Cut(spec, "=")
		if !ok || prefix == "" {
			return nil, fmt.Errorf("etcd-resource %q: want NAME=PREFIX (the election prefix of fenceproxy lock --store etcd, e.g. billing=locks/billing)", spec)
		}
		a.prefixes[name] = strings.TrimSuffix(prefix, "/") + "/"
	}
	var err error
	a.client, err = NewClient(Config{Endpoints: cfg.Endpoints, Logger: a.log.Named("etcd-client").WithOptions(zap.IncreaseLevel(zap.WarnLevel))})
	if err != nil {
		return nil, err
	}
	return a, nil
}

// Store is lease.StoreEtcd.
func (a *Authority) Store() string { return lease.StoreEtcd }

// Resources are the resources of the elections.
func (a *Authority) Resources() []string {
	return slices.Sorted(maps.Keys(a.prefixes))
}

// Describe names resource's election prefix.
func (a *Authority) Describe(resource string) string {
	return fmt.Sprintf("etcd election prefix %q", a.prefixes[resource])
}

// Read reads resource's election linearizably: its leader (Token 0: none).
func (a *Authority) Read(ctx context.Context, resource string) (lease.Reading, error) {
	r, _, err := a.read(ctx, resource)
	return r, err
}

// read is Read, with the store revision of the read.
func (a *Authority) read(ctx context.Context, res string) (lease.Reading, int64, error) {
	rctx, cancel := context.WithTimeout(ctx, readTimeout)
	defer cancel()
	resp, err := a.client.Get(rctx, a.prefixes[res], clientv3.WithFirstCreate()...)
	if err != nil {
		return lease.Reading{}, 0, err
	}
	var r lease.Reading
	store := resp.Header.Revision
	a.mu.Lock()
	if store < a.highest {
		r.Regression = fmt.Sprintf("etcd's store revision went from %d to %d (a snapshot restore?)", a.highest, store)
	} else {
		a.highest = store
	}
	a.mu.Unlock()
	if len(resp.Kvs) > 0 {
		id := fmt.Sprintf("%x", resp.Kvs[0].Lease)
		r.Holder = lease.Holder{Token: resp.Kvs[0].CreateRevision, Session: id, Name: "etcd lease " + id}
	}
	return r, store, nil
}

// Follow reads resource's election, and again after every change under its prefix.
func (a *Authority) Follow(ctx context.Context, resource string, changed func(lease.Reading, error)) {
	for ctx.Err() == nil {
		r, store, err := a.read(ctx, resource)
		changed(r, err)
		if err != nil {
			lease.Sleep(ctx, time.Second)
			continue
		}
		wctx, wcancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		wch := a.client.Watch(wctx, a.prefixes[resource], clientv3.WithPrefix(), clientv3.WithRev(store+1))
		select {
		case <-ctx.Done():
		case <-wch: // any change, or the watch ended: read again
		}
		wcancel()
	}
}

// Words word etcd's refusals.
func (a *Authority) Words(resource string) lease.Words {
	return lease.Words{
		Service:      "etcd",
		NoHolder:     fmt.Sprintf("the etcd election %s of resource %q has no leader (token %%d); the session expired or resigned, or the election is held under another prefix", a.prefixes[resource], resource),
		NoHolderHint: fmt.Sprintf("Campaign again on the prefix this proxy validates (fenceproxy lock --store etcd --prefix %s) and use the new leader key's CreateRevision.", strings.TrimSuffix(a.prefixes[resource], "/")),
		Current:      "the CreateRevision %d of etcd's current leader key",
		CurrentHint:  "Use the leader key's CreateRevision (concurrency.Election.Rev()) that this process won the election with.",
		HolderKind:   "etcd lease",
		Regressed:    "etcd's revisions went backwards",
		RegressionHint: "Restore etcd with etcdutl snapshot restore --bump-revision, or reset the resource's fence (`fenceproxy fence reset --resource " +
			resource + " --token <the new leader's revision> --database <the protected database's URL>`), then restart the proxies (docs/etcd.md: What a restore does).",
	}
}

// Close closes the client.
func (a *Authority) Close() error { return a.client.Close() }
