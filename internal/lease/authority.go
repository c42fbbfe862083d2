package lease

import "context"

// Authority is a lock service as the proxy asks it about the resources it validates: who
// holds each resource's lock now and with which token (Read), and every change (Follow).
// Each store's package implements it next to its campaign; the proxy's admission (admit,
// record, judge, raise, fail closed) is written once over it and imports no client.
type Authority interface {
	// Store is the service's name (StoreEtcd, StoreZooKeeper).
	Store() string
	// Resources are the resources the service validates.
	Resources() []string
	// Describe names what resource's tokens are validated against, for hints ("etcd
	// election prefix \"locks/billing/\"").
	Describe(resource string) string
	// Read reads resource's lock so that the answer reflects every write acknowledged
	// before the call (a linearizable read, a read after a sync).
	Read(ctx context.Context, resource string) (Reading, error)
	// Follow reads resource's lock, calls changed with the answer (or the read's error),
	// and does it again after every change, until ctx ends. It returns when ctx ends.
	Follow(ctx context.Context, resource string, changed func(Reading, error))
	// Words word the refusals of resource's tokens.
	Words(resource string) Words
	// Close ends the service's client.
	Close() error
}

// Holder is a lock's holder as its service shows it.
type Holder struct {
	// Token is the holder's fencing token; 0 when nobody holds the lock.
	Token int64
	// Session is the holder's ID as a session names it in fence.session (hex: etcd's
	// session lease, ZooKeeper's session).
	Session string
	// Name is the holder as the database records it ("etcd lease 1a2b", "zookeeper session
	// 1a2b"); migration 9's holder_words reads the service from its first word.
	Name string
}

// Reading is one read of a resource's lock.
type Reading struct {
	Holder
	// Regression says why the service's numbers went back since an earlier read of this
	// Authority (a restore from an old snapshot, a wiped data folder); "" when they did not.
	Regression string
}

// Words word the refusals of a service's tokens.
type Words struct {
	// Service is the service's name in messages ("etcd", "ZooKeeper").
	Service string
	// NoHolder says why the lock is not held (ZF006's message after its prefix), a format
	// with one %d: the session's token.
	NoHolder     string
	NoHolderHint string
	// Current is the holder's token, a format with one %d (ZF002's message).
	Current string
	// CurrentHint says what the holder's token is (ZF002's hint).
	CurrentHint string
	// HolderKind is what a holder's Session is, in messages ("etcd lease").
	HolderKind string
	// Regressed is what a regression is called in its message ("etcd's revisions went
	// backwards").
	Regressed string
	// RegressionHint is the hint of a regression: what the operator does.
	RegressionHint string
}
