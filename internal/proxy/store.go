package proxy

import (
	"cmp"
	"context"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/lease"
)

// Guard is a lock service's guard as the proxy asks it: LockGuard (etcd, ZooKeeper) and
// internal/lease/consul's Guard, built outside the proxy (internal/proxy/guards) so that it
// imports no lock service's client. A guard validates its own resources' tokens and admits
// the others'.
type Guard interface {
	HolderAdmitter
	// Validates reports whether the guard checks resource's tokens: the guard, not the
	// registry's highest token, then decides (session.admit), so that a regression is told
	// as such (ZF007) also to a token below the highest admitted one.
	Validates(resource string) bool
	// Authority names what resource's tokens are validated against, for hints.
	Authority(resource string) string
	// Store is the lock service's name, as lease.Store* names it.
	Store() string
	// HolderOf is the holder of token for resource as the service last showed it ("" when
	// not known).
	HolderOf(resource string, token int64) string
	// HolderName is the name the service knows holder by ("" when none or not known yet).
	HolderName(holder string) string
	// Unsynced are the guard's resources whose lock state is not known now (/readyz).
	Unsynced() []string
	// Run follows the lock service until ctx ends.
	Run(ctx context.Context) error
}

// serviceNames are the lock services' names in messages.
var serviceNames = map[string]string{lease.StoreConsul: "Consul", lease.StoreEtcd: "etcd", lease.StoreZooKeeper: "ZooKeeper"}

// guards are the Guards among the server's admitters.
func guards(a Admitter) []Guard {
	as, ok := a.(Admitters)
	if !ok {
		as = Admitters{a}
	}
	var gs []Guard
	for _, x := range as {
		if g, ok := x.(Guard); ok {
			gs = append(gs, g)
		}
	}
	return gs
}

// guardOf returns the guard that validates resource among the server's admitters (nil: the
// database alone orders its tokens).
func guardOf(a Admitter, resource string) Guard {
	for _, g := range guards(a) {
		if g.Validates(resource) {
			return g
		}
	}
	return nil
}

// storeOf names the authority of resource's tokens: the lock service that validates them
// (consul, etcd, zookeeper), postgres for a --lease-resource, or AuthorityBare.
func (s *Server) storeOf(resource string) string {
	if g := guardOf(s.admit, resource); g != nil {
		return g.Store()
	}
	if a := s.conf().authority(resource); a != "" && a != lease.StoreConsul {
		return a
	}
	return AuthorityBare
}

// Admitters admits a session when each of its Admitters does (each validates its own
// resources and admits the others'), for a proxy that validates against Consul and etcd.
type Admitters []Admitter

// Admit implements Admitter.
func (as Admitters) Admit(ctx context.Context, c fence.Credentials) error {
	for _, a := range as {
		if err := a.Admit(ctx, c); err != nil {
			return err
		}
	}
	return nil
}

// AdmitHolder implements HolderAdmitter: the holder named by the Admitter that validates
// resource, if it names one.
func (as Admitters) AdmitHolder(ctx context.Context, c fence.Credentials) (string, error) {
	holder := ""
	for _, a := range as {
		if ha, ok := a.(HolderAdmitter); ok {
			h, err := ha.AdmitHolder(ctx, c)
			if err != nil {
				return "", err
			}
			holder = cmp.Or(holder, h)
		} else if err := a.Admit(ctx, c); err != nil {
			return "", err
		}
	}
	return holder, nil
}

// Judge implements HolderAdmitter: the judgement of the Admitter that validates resource.
func (as Admitters) Judge(ctx context.Context, resource string, token int64, holder string, rec fence.ConsulRecord) error {
	for _, a := range as {
		if ha, ok := a.(HolderAdmitter); ok && guardOf(a, resource) != nil {
			return ha.Judge(ctx, resource, token, holder, rec)
		}
	}
	return fence.Unavailable(resource, "no admitter validates the resource against a lock service")
}
