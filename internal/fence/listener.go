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
	backoff := 100 * time.Millisecond
	for {
		err := listenOnce(ctx, url, reg, func() { synced(true) })
		synced(false)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		log.Warn("fence listener disconnected; reconnecting", zap.Error(err), zap.Duration("backoff", backoff))
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(backoff):
		}
		backoff = min(backoff*2, 5*time.Second)
	}
}

func listenOnce(ctx context.Context, url string, reg *Registry, ready func()) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	database := DatabaseName(conn.Config())
	if _, err := conn.Exec(ctx, "LISTEN "+Channel); err != nil {
		return err
	}
	rows, err := conn.Query(ctx, "SELECT resource, token FROM fence.tokens")
	if err != nil {
		return fmt.Errorf("read fence.tokens: %w", err)
	}
	for rows.Next() {
		var res string
		var tok int64
		if err := rows.Scan(&res, &tok); err != nil {
			return err
		}
		reg.Observe(database, res, tok)
	}
	if err := rows.Err(); err != nil {
		return err
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
