package proxy

import (
	"fmt"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/lease"
)

// storeGuard is an Admitter that validates some resources' tokens against a lock service.
type storeGuard interface {
	// guards reports whether the service validates resource's tokens. (Not Validates:
	// session.admit asks that of Consul resources only, whose early refusal it skips.)
	guards(resource string) bool
	// store is the lock service's name, as lease.Store* names it.
	store() string
	// holderOf is the holder of token for resource as the service last showed it ("" when
	// not known).
	holderOf(resource string, token int64) string
	// holderName is the name the service knows holder by ("" when none or not known yet).
	holderName(holder string) string
}

func (g *Guard) store() string          { return lease.StoreConsul }
func (g *EtcdGuard) store() string      { return lease.StoreEtcd }
func (g *ZooKeeperGuard) store() string { return lease.StoreZooKeeper }

func (g *ZooKeeperGuard) guards(resource string) bool { return g.Validates(resource) }

// holderOf is the ZooKeeper session that owns the lock holder's node, if its token is token.
func (g *ZooKeeperGuard) holderOf(resource string, token int64) string {
	g.mu.Lock()
	defer g.mu.Unlock()
	if l := g.leaders[resource]; l.token == token && token > 0 {
		return l.holder()
	}
	return ""
}

// holderOf is the session lease of the election's leader, if its token is token.
func (g *EtcdGuard) holderOf(resource string, token int64) string {
	g.mu.Lock()
	defer g.mu.Unlock()
	if l := g.leaders[resource]; l.rev == token && token > 0 {
		return "etcd lease " + l.holder
	}
	return ""
}

func (g *Guard) guards(resource string) bool { return g.Validates(resource) }

func (g *Guard) holderOf(resource string, token int64) string { return g.holder(resource, token) }

// etcd's leases and ZooKeeper's sessions have no name of their own.
func (g *EtcdGuard) holderName(string) string      { return "" }
func (g *ZooKeeperGuard) holderName(string) string { return "" }

func (g *EtcdGuard) guards(resource string) bool {
	_, ok := g.prefixes[resource]
	return ok
}

// guardOf returns the guard that validates resource among the server's admitters (nil: the
// database alone orders its tokens).
func guardOf(a Admitter, resource string) storeGuard {
	as, ok := a.(Admitters)
	if !ok {
		as = Admitters{a}
	}
	for _, x := range as {
		if g, ok := x.(storeGuard); ok && g.guards(resource) {
			return g
		}
	}
	return nil
}

// storeOf names the authority of resource's tokens: the lock service that validates them
// (consul, etcd, zookeeper), postgres for a --lease-resource, or AuthorityBare.
func (s *Server) storeOf(resource string) string {
	if g := guardOf(s.admit, resource); g != nil {
		return g.store()
	}
	if a := s.conf().authority(resource); a != "" && a != lease.StoreConsul {
		return a
	}
	return AuthorityBare
}

// judgeRecord is what a record rec of the database that does not admit token, which the
// store showed held by holder, means for res (the etcd and ZooKeeper guards' Judge; the
// Consul Guard's judge reasons the same way). A recorded regression, or the same token
// recorded for another holder (consul_admit turns that into one), fails the resource closed
// (fail). A higher recorded token is either a newer holder (the store's answer was behind:
// stale, ZF001) or the store's numbers went back below an admitted token (fail): current,
// a read started now, tells them apart.
func judgeRecord(res string, token int64, holder string, rec fence.ConsulRecord, store string,
	current func() (int64, error), fail func(why string) error) error {
	switch {
	case rec.Regression != "":
		return fail(rec.Regression)
	case rec.Token <= token:
		// Not an answer consul_admit gives (one number with two holders is a regression).
		return fence.Unavailable(res, fmt.Sprintf("the database recorded token %d of %s for token %d of %s", rec.Token, rec.Holder, token, holder))
	}
	cur, err := current()
	if err != nil {
		return fence.Unavailable(res, store+"'s lock state is unknown ("+err.Error()+"); no token is admitted without "+store+"'s word")
	}
	if cur >= rec.Token {
		return fence.Stale(res, token, rec.Token)
	}
	return fail(fmt.Sprintf("the database admitted token %d (%s) but %s's current holder has token %d", rec.Token, rec.Holder, store, cur))
}
