package fence

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"
)

// Channel is the notification channel fence.raise and fence.reset notify,
// with the payload "<resource> <token>".
const Channel = "fence_raise"

// ParsePayload decodes a notification payload: "<resource> <token>" from
// fence.raise, "<resource> <token> reset" from fence.reset.
func ParsePayload(p string) (resource string, token int64, reset bool, err error) {
	f := strings.Fields(p)
	if len(f) < 2 || len(f) > 3 || !ValidResource(f[0]) || (len(f) == 3 && f[2] != "reset") {
		return "", 0, false, fmt.Errorf("fence: bad notification payload %q", p)
	}
	t, err := strconv.ParseInt(f[1], 10, 64)
	if err != nil {
		return "", 0, false, fmt.Errorf("fence: bad notification payload %q: %w", p, err)
	}
	return f[0], t, len(f) == 3, nil
}

// Listen keeps a connection to the database at url, LISTENs on Channel and
// feeds every raise into reg (the token stored in fence.tokens, which a
// notification only points at), until ctx is done. After every (re)connection
// it reads fence.tokens whole, so raises notified while it was disconnected
// are not missed. ready, if not nil, is called after each successful sync.
func Listen(ctx context.Context, url string, reg *Registry, log *zap.Logger, ready func()) error {
	return Follow(ctx, url, reg, log, func(synced bool) {
		if synced && ready != nil {
			ready()
		}
	})
}

// Follow is Listen that also says when the listener loses its connection: synced(true) after
// each sync, synced(false) at each loss (a proxy is not ready while it may miss raises).
func Follow(ctx context.Context, url string, reg *Registry, log *zap.Logger, synced func(bool)) error {
	return FollowUpstream(ctx, url, reg, log, Hooks{Synced: synced})
}

// Hooks are what FollowUpstream tells its caller.
type Hooks struct {
	// Synced(true) after each sync, Synced(false) at each loss.
	Synced func(bool)
	// Changed is called when a (re)connection finds another server than the last one: kind
	// "server" (another system identifier) or "timeline" (the same cluster on a new timeline:
	// a promoted standby), once the registry holds the new server's tokens. Nil: not told.
	Changed func(kind string)
	// Switching is called as soon as a (re)connection finds another server than the last
	// one, before the registry forgets the lost timeline's tokens. Nil: not told.
	Switching func()
	// Prepare adjusts the connection's settings before each (re)connection (the proxy aims
	// it at the primary its monitor knows). Nil: the URL's settings.
	Prepare func(*pgx.ConnConfig)
	// Identity is told the server's identity at each (re)connection that could read it.
	// Nil: not told.
	Identity func(Upstream)
	// Moved returns a channel closed when the primary may have moved: the connection is
	// dropped and made again (a listener left on a frozen old primary hears no raise and
	// never notices the failover). Nil: never.
	Moved func() <-chan struct{}
}

// Upstream is the identity of the server a connection reached: its cluster's system
// identifier and its current timeline (of its current WAL file).
type Upstream struct {
	SystemID string
	Timeline int64
}

// identityQuery reads Upstream, and whether the server is in recovery (a standby, whose
// timeline is not read).
const identityQuery = `SELECT (SELECT system_identifier::text FROM pg_control_system()), pg_is_in_recovery(),
    CASE WHEN pg_is_in_recovery() THEN 0 ELSE ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint END`

// errMoved ends a listener's connection when the primary may have moved (Hooks.Moved).
var errMoved = errors.New("the primary may have moved: connecting again")

// errStandby is a control connection that reached a standby: raises are made on the primary.
var errStandby = errors.New("the control database's server is a standby (in recovery): raises are made on the primary; use target_session_attrs=read-write and list every host (postgres://h1:p1,h2:p2/db)")

// FollowUpstream is Follow that also watches the server's identity: at each (re)connection it
// reads the system identifier and timeline, refuses a standby (not synced: the proxy is not
// ready), and when they changed since the last connection (a failover) it drops what the
// registry remembered of this database (Registry.Rebase with the tokens stored now), logs it
// and calls h.Changed.
func FollowUpstream(ctx context.Context, url string, reg *Registry, log *zap.Logger, h Hooks) error {
	synced := h.Synced
	if synced == nil {
		synced = func(bool) {}
	}
	backoff := 100 * time.Millisecond
	var last *Upstream
	// changedKind is a change seen before the sync; h.Changed hears of it once the registry
	// is rebased, so that whoever counts the change sees the new timeline's tokens.
	changedKind := ""
	afterSync := func() {
		if changedKind != "" && h.Changed != nil {
			h.Changed(changedKind)
		}
		changedKind = ""
		synced(true)
	}
	for {
		err := listenOnce(ctx, url, h, reg, afterSync, func(now Upstream, database string) bool {
			changed := last != nil && *last != now
			kind := "timeline"
			if last != nil && last.SystemID != now.SystemID {
				kind = "server"
			}
			if changed {
				log.Warn("the upstream server changed (a failover): forgetting the tokens of the lost timeline and reading the stored ones",
					zap.String("kind", kind), zap.String("database", database),
					zap.String("system_identifier", now.SystemID), zap.Int64("timeline", now.Timeline),
					zap.String("was_system_identifier", last.SystemID), zap.Int64("was_timeline", last.Timeline))
				changedKind = kind
				if h.Switching != nil {
					h.Switching()
				}
			}
			last = &now
			if h.Identity != nil {
				h.Identity(now)
			}
			return changed
		}, func(err error) {
			log.Warn("cannot read the upstream server's identity, so a failover to a standby goes unnoticed until the proxy restarts: grant pg_monitor (pg_control_system, pg_walfile_name) to the control database's role", zap.Error(err))
		})
		synced(false)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if errors.Is(err, errMoved) {
			log.Info("fence listener: the primary may have moved; connecting again")
			backoff = 0
		} else {
			log.Warn("fence listener disconnected; reconnecting", zap.Error(err), zap.Duration("backoff", backoff))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(backoff):
		}
		backoff = min(max(backoff*2, 100*time.Millisecond), 5*time.Second)
	}
}

// listenOnce connects, LISTENs and syncs reg with fence.tokens. identity, when not nil, is
// told the server's identity before the sync and says whether it changed (then the sync
// rebases the registry instead of raising it).
func listenOnce(ctx context.Context, url string, h Hooks, reg *Registry, ready func(), identity func(Upstream, string) bool, identityErr func(error)) (err error) {
	if h.Moved != nil {
		moved := h.Moved()
		mctx, cancel := context.WithCancelCause(ctx)
		defer cancel(nil)
		defer func() {
			if errors.Is(context.Cause(mctx), errMoved) {
				err = errMoved
			}
		}()
		ctx = mctx
		go func() {
			select {
			case <-moved:
				cancel(errMoved)
			case <-mctx.Done():
			}
		}()
	}
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return err
	}
	if h.Prepare != nil {
		h.Prepare(cfg)
	}
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	database := DatabaseName(conn.Config())
	rebase := false
	if identity != nil {
		var recovering bool
		if err := conn.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&recovering); err != nil {
			return err
		}
		if recovering {
			return errStandby
		}
		var up Upstream
		if err := conn.QueryRow(ctx, identityQuery).Scan(&up.SystemID, &recovering, &up.Timeline); err != nil {
			if ctx.Err() != nil {
				return err // cut (a stop, or the primary moved): no privilege is missing
			}
			// Without it a failover is noticed only by its effects: say what to grant.
			identityErr(err)
		} else {
			rebase = identity(up, database)
		}
	}
	if _, err := conn.Exec(ctx, "LISTEN "+Channel); err != nil {
		return err
	}
	rows, err := conn.Query(ctx, "SELECT resource, token FROM fence.tokens")
	if err != nil {
		return fmt.Errorf("read fence.tokens: %w", err)
	}
	stored := map[string]int64{}
	for rows.Next() {
		var res string
		var tok int64
		if err := rows.Scan(&res, &tok); err != nil {
			return err
		}
		stored[res] = tok
	}
	if err := rows.Err(); err != nil {
		return err
	}
	if rebase {
		reg.Rebase(database, stored)
	} else {
		for res, tok := range stored {
			reg.Observe(database, res, tok)
		}
	}
	if ready != nil {
		ready()
	}
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		res, _, reset, err := ParsePayload(n.Payload)
		if err != nil {
			continue
		}
		// Any session may NOTIFY on the channel: the payload only says which
		// resource to look at, the stored token is what counts. (Believing a
		// forged "billing 999999" would end every session of the resource
		// and refuse its leader.)
		var tok int64
		err = conn.QueryRow(ctx, "SELECT token FROM fence.tokens WHERE resource = $1", res).Scan(&tok)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
		case err != nil:
			return fmt.Errorf("read fence.tokens: %w", err)
		case reset:
			reg.Reset(database, res, tok)
		default:
			reg.Observe(database, res, tok)
		}
	}
}
