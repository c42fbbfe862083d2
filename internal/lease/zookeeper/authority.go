package zookeeper

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/go-zookeeper/zk"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/lease"
)

const (
	// readTimeout bounds each read of a lock folder: a ZooKeeper that does not answer
	// within it is unreachable, and sessions are refused (ZF007) rather than kept waiting.
	readTimeout = 5 * time.Second
	// sessionTimeout is the Authority's own client session's; it holds no ephemeral node.
	sessionTimeout = 10 * time.Second
	// reconnectAfter failed reads in a row, the Authority opens a new client session: a
	// server restored to an older state refuses a client that has seen later zxids, for
	// good.
	reconnectAfter = 3
)

// AuthorityConfig configures NewAuthority.
type AuthorityConfig struct {
	// Servers are the ensemble's client addresses, host:port (--zk-servers).
	Servers []string
	// Resources are NAME or NAME=PATH, PATH the lock folder (default /locks/NAME) of
	// `fenceproxy lock --store zookeeper` or any client of the lock recipe (--zk-resource).
	Resources []string
	// Logger (nil: no logs).
	Logger *zap.Logger
}

// Authority answers for ZooKeeper locks (lease.Authority): a resource's holder owns the
// lowest lock node of its folder; the token is that node's czxid and the holder's session
// its ephemeralOwner. It reads after a sync, and tells a folder whose last child change
// (pzxid) is older than one read before (a restore from an old snapshot, a wiped data
// folder) as a regression.
type Authority struct {
	servers []string
	dirs    map[string]string // resource -> lock folder
	log     *zap.Logger

	mu      sync.Mutex
	conn    *zk.Conn
	failed  int              // reads failed in a row
	highest map[string]int64 // resource -> the highest pzxid of its folder read
}

// NewAuthority returns the Authority of cfg's resources (nil, nil when there are none).
func NewAuthority(cfg AuthorityConfig) (*Authority, error) {
	if len(cfg.Resources) == 0 {
		return nil, nil
	}
	if len(cfg.Servers) == 0 {
		return nil, errors.New("zk-resource needs zk-servers")
	}
	a := &Authority{servers: cfg.Servers, dirs: map[string]string{}, log: cfg.Logger, highest: map[string]int64{}}
	if a.log == nil {
		a.log = zap.NewNop()
	}
	for _, spec := range cfg.Resources {
		name, dir, _ := strings.Cut(spec, "=")
		dir = LockDir(dir, name)
		if !strings.HasPrefix(dir, "/") {
			return nil, fmt.Errorf("zk-resource %q: want NAME or NAME=PATH with an absolute lock folder (that of fenceproxy lock --store zookeeper, e.g. billing=/locks/billing)", spec)
		}
		a.dirs[name] = dir
	}
	var err error
	if a.conn, err = a.connect(); err != nil {
		return nil, err
	}
	return a, nil
}

func (a *Authority) connect() (*zk.Conn, error) {
	return Connect(a.servers, sessionTimeout, a.log, nil)
}

// Store is lease.StoreZooKeeper.
func (a *Authority) Store() string { return lease.StoreZooKeeper }

// Resources are the resources of the lock folders.
func (a *Authority) Resources() []string {
	return slices.Sorted(maps.Keys(a.dirs))
}

// Describe names resource's lock folder.
func (a *Authority) Describe(resource string) string {
	return fmt.Sprintf("ZooKeeper lock folder %q", a.dirs[resource])
}

// client returns the current client session.
func (a *Authority) client() *zk.Conn {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.conn
}

// readFailed counts a failed read, and replaces the client session after reconnectAfter in
// a row.
func (a *Authority) readFailed(conn *zk.Conn) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if conn != a.conn {
		return // replaced already
	}
	if a.failed++; a.failed < reconnectAfter {
		return
	}
	fresh, err := a.connect()
	if err != nil {
		a.log.Warn("new ZooKeeper client", zap.String("store", lease.StoreZooKeeper), zap.Error(err))
		return
	}
	a.log.Info("ZooKeeper unreadable; new client session", zap.String("store", lease.StoreZooKeeper), zap.Int("failed_reads", a.failed))
	a.conn.Close()
	a.conn, a.failed = fresh, 0
}

// Read reads resource's lock folder after a sync: the owner of its lowest lock node (Token
// 0: nobody holds the lock).
func (a *Authority) Read(ctx context.Context, resource string) (lease.Reading, error) {
	r, _, err := a.read(ctx, resource, false)
	return r, err
}

// read is Read and, with watch, a channel that fires when the folder's children change
// (or, while the folder is missing, when it is created).
func (a *Authority) read(ctx context.Context, res string, watch bool) (lease.Reading, <-chan zk.Event, error) {
	dir := a.dirs[res]
	conn := a.client()
	rctx, cancel := context.WithTimeout(ctx, readTimeout)
	defer cancel()
	// Written by the call; read only when it returned (not after a timeout).
	var r lease.Reading
	var wch <-chan zk.Event
	err := Call(rctx, func() error {
		if _, err := conn.Sync(dir); err != nil && !errors.Is(err, zk.ErrNoNode) {
			return fmt.Errorf("sync %s: %w", dir, err)
		}
		for range 3 { // the lowest node may go between the listing and its read
			var children []string
			var st *zk.Stat
			var err error
			if watch {
				children, st, wch, err = conn.ChildrenW(dir)
			} else {
				children, st, err = conn.Children(dir)
			}
			if errors.Is(err, zk.ErrNoNode) { // no folder: nobody ever took the lock
				r = lease.Reading{}
				if !watch {
					return nil
				}
				var exists bool
				if exists, _, wch, err = conn.ExistsW(dir); err == nil && exists {
					continue // created in between
				}
				return err
			}
			if err != nil {
				return fmt.Errorf("list %s: %w", dir, err)
			}
			r = lease.Reading{Regression: a.checkPzxid(res, st.Pzxid)}
			locks := LockOrder(children)
			if len(locks) == 0 {
				return nil
			}
			ok, hst, err := conn.Exists(dir + "/" + locks[0])
			if err != nil {
				return fmt.Errorf("read %s/%s: %w", dir, locks[0], err)
			}
			if ok {
				id := fmt.Sprintf("%x", hst.EphemeralOwner)
				r.Holder = lease.Holder{Token: hst.Czxid, Session: id, Name: "zookeeper session " + id}
				return nil
			}
		}
		return fmt.Errorf("the lowest node of %s keeps changing", dir)
	})
	if err != nil {
		a.readFailed(conn)
		return lease.Reading{}, nil, err
	}
	a.mu.Lock()
	if a.conn == conn {
		a.failed = 0
	}
	a.mu.Unlock()
	return r, wch, nil
}

// checkPzxid says why res's folder's pzxid went back ("": it did not).
func (a *Authority) checkPzxid(res string, pzxid int64) string {
	a.mu.Lock()
	defer a.mu.Unlock()
	if pzxid < a.highest[res] {
		return fmt.Sprintf("the last change to the lock folder %s went from zxid %d to %d (a restore from an old snapshot, or a wiped data folder?)",
			a.dirs[res], a.highest[res], pzxid)
	}
	a.highest[res] = pzxid
	return ""
}

// Follow reads resource's lock folder, and again after every change of its children.
func (a *Authority) Follow(ctx context.Context, resource string, changed func(lease.Reading, error)) {
	for ctx.Err() == nil {
		r, wch, err := a.read(ctx, resource, true)
		changed(r, err)
		if err != nil {
			lease.Sleep(ctx, time.Second)
			continue
		}
		select {
		case <-ctx.Done():
		case <-wch: // a change, or the watch ended (connection lost): read again
		}
	}
}

// Words word ZooKeeper's refusals.
func (a *Authority) Words(resource string) lease.Words {
	return lease.Words{
		Service: "ZooKeeper",
		NoHolder: fmt.Sprintf("the ZooKeeper lock folder %s of resource %q has no lock node (token %%d); the holder's session expired or it released the lock",
			a.dirs[resource], resource),
		NoHolderHint: "Take the lock again and use the new lock node's czxid.",
		Current:      "the czxid %d of ZooKeeper's current lock node",
		CurrentHint:  "Use the czxid of the lock node this process holds the lock with (its Stat after creating it).",
		HolderKind:   "ZooKeeper session",
		Regressed:    "ZooKeeper's zxids went backwards",
		RegressionHint: "Tokens (czxids) from this ZooKeeper are no longer above those the database admitted: reset the resource's fence (`fenceproxy fence reset --resource " +
			resource + " --token <the new holder's czxid> --database <the protected database's URL>`) once the old holders are stopped, then restart the proxies (docs/zookeeper.md: What a restore does).",
	}
}

// Close closes the client session.
func (a *Authority) Close() error {
	a.client().Close()
	return nil
}
