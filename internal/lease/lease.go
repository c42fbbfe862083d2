package lease

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"time"
)

// Store names, as logs show them (the `store` key) and FENCE_STORE tells a child.
const (
	StoreConsul   = "consul"
	StorePostgres = "postgres"
	StoreEtcd     = "etcd"
	// StoreZooKeeper is ZooKeeperStore's name.
	StoreZooKeeper = "zookeeper"
)

// Lease is a lease on one resource that a Store granted: whatever the store, the holder
// learns its fencing token, when it lost the lease, and why. RunLocked needs nothing else.
type Lease interface {
	// Store is the name of the store that granted the lease (StoreConsul, StorePostgres,
	// StoreEtcd, StoreZooKeeper).
	Store() string
	// Key is where the lease lives in its store: the Consul key, "fence.leases/<resource>",
	// etcd's leader key ("<prefix>/<lease ID>"), or ZooKeeper's lock node
	// ("<folder>/_c_<random>-lock-<sequence>").
	Key() string
	// Holder is the holder's identity in the store: the Consul session ID, the holder
	// name of the PostgreSQL lease row, etcd's session lease ID or ZooKeeper's session ID
	// (both hex).
	Holder() string
	// Token is the fencing token of this acquisition: Consul's LockIndex, the lease row's
	// generation, the CreateRevision of etcd's leader key, or the czxid of ZooKeeper's lock
	// node. It never changes while the lease is held.
	Token() int64
	// Done is closed when the lease is lost or released; Err says which.
	Done() <-chan struct{}
	// Err is nil while the lease is held; after Done it wraps ErrLockLost (with what
	// happened) or is ErrReleased.
	Err() error
	// Release gives the lease up (if it is still held) and frees what holding it took (the
	// Consul session, the database connections). Call it once the lease's holder has
	// stopped using the token, also after the lease was lost.
	Release(ctx context.Context) error
}

// Store grants leases: Campaign blocks until the caller holds the lease of resource, or
// ctx ends (ctx's error, wrapped). Errors of the store while campaigning are retried inside
// Campaign when they may pass, and returned when they will not.
type Store interface {
	Name() string
	Campaign(ctx context.Context, resource string) (Lease, error)
}

// DefaultTTL is the lease TTL of a store when none is given: Consul's minimum session TTL.
const DefaultTTL = 10 * time.Second

// DefaultHolder is a store's holder name when none is given: host:pid:random, drawn anew
// for each campaign.
func DefaultHolder() (string, error) {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "unknown-host"
	}
	var b [4]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("lease: holder name: %w", err)
	}
	return fmt.Sprintf("%s:%d:%s", host, os.Getpid(), hex.EncodeToString(b[:])), nil
}
