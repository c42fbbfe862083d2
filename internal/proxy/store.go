package proxy

import (
	"errors"
	"fmt"
	"strings"

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

func (g *EtcdGuard) guards(resource string) bool { return g.Validates(resource) }

// Validates reports whether resource's tokens are etcd's (an --etcd-resource): a token
// etcd shows current is judged against the database's record (Judge), as Consul's and
// ZooKeeper's are, not refused on this proxy's memory alone.
func (g *EtcdGuard) Validates(resource string) bool {
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
	if fe := movedFrom(res, token, rec, store); fe != nil {
		return fe
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

// errMoved is the cause of movedFrom's refusal: the session reports it, not the stale
// token this proxy's memory would name (a higher token of the other service's sequence).
var errMoved = errors.New("the resource was led through another lock service")

// recordedStore names the lock service of a holder fence.consul_tokens records: "etcd lease
// ID", "zookeeper session ID", or a bare Consul session ID (fence.holder_words, W1).
func recordedStore(holder string) string {
	switch {
	case strings.HasPrefix(holder, "etcd lease "):
		return "etcd"
	case strings.HasPrefix(holder, "zookeeper session "):
		return "ZooKeeper"
	}
	return "Consul"
}

// movedFrom refuses token of store when the database admitted a higher token rec of another
// lock service's holder: the resource was led through that service, and store's numbers are
// not its sequence, so nothing went backwards. Refused (ZF007) without failing the resource
// closed for good, so that the reset that moves it admits the new holder at once (a
// newcomer's move from etcd to Consul read as a "LockIndex regression ... a snapshot restore",
// and one to etcd stayed closed after the reset until the proxy restarted).
func movedFrom(res string, token int64, rec fence.ConsulRecord, store string) *fence.Error {
	was := recordedStore(rec.Holder)
	if rec.Holder == "" || was == store {
		return nil
	}
	fe := fence.Unavailable(res, fmt.Sprintf("token %d of %s is below token %d, which was admitted through %s (holder %q): the resource was led through %s, and this proxy validates it with %s",
		token, store, rec.Token, was, rec.Holder, was, store))
	fe.Err = errMoved
	fe.Hint = fmt.Sprintf("One resource has one lock service. To move it to %s, stop the holders of its %s lock, then run fenceproxy fence reset --resource %s --token %d --database URL (%s's current token); or give the %s lock another resource name.",
		store, was, res, token, store, store)
	return fe
}
