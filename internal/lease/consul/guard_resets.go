package consul

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/fence"
)

// followResets LISTENs on the control database for fence.reset's notifications ("<resource>
// <token> reset") and starts the Consul history of a reset resource afresh (Watcher.Reset), so
// that `fenceproxy fence reset` ends a regression in the running proxies too, not only in
// those started afterwards. It runs until ctx ends, reconnecting with backoff.
//
// A notification is not proof of a reset: any client may NOTIFY on the channel. It is acted on
// only when fence.history, which nothing but the fence functions write (H2 in migration 6),
// records a reset of that resource to that token that this listener has not acted on yet
// (resetRecorded); a forged one changes nothing and is logged.
//
// Only a notification does it. A proxy that was disconnected from the control database when
// the reset committed keeps failing closed until it is restarted: inferring a reset from a
// missing database record instead could forget a regression this proxy saw and has not
// recorded yet (recording is asynchronous).
func (g *Guard) followResets(ctx context.Context, url string) {
	backoff := 100 * time.Millisecond
	for {
		err := g.listenResets(ctx, url)
		if ctx.Err() != nil {
			return
		}
		g.log.Warn("listener for fence resets disconnected; reconnecting (a reset committed meanwhile needs a restart of this proxy)",
			zap.Error(err), zap.Duration("backoff", backoff))
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(backoff*2, 5*time.Second)
	}
}

func (g *Guard) listenResets(ctx context.Context, url string) error {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return err
	}
	cfg.RuntimeParams["application_name"] = GuardApplicationName
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "LISTEN "+fence.Channel); err != nil {
		return err
	}
	// The resets recorded before the LISTEN are not this listener's to act on: a notification
	// names a reset recorded after this point.
	var seen int64
	if err := conn.QueryRow(ctx, "SELECT coalesce(max(id), 0) FROM fence.history WHERE reset").Scan(&seen); err != nil {
		return fmt.Errorf("fence.history (this fenceproxy needs fence schema version %d: run fenceproxy migrate): %w", fence.SchemaVersion, err)
	}
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		res, tok, reset, err := fence.ParsePayload(n.Payload)
		key, ours := g.keys[res]
		if err != nil || !reset || !ours {
			continue
		}
		id, err := resetRecorded(ctx, conn, res, tok, seen)
		if err != nil {
			return err
		}
		if id == 0 {
			g.log.Warn("ignoring a reset notification that fence.history does not record: not sent by fence.reset (any client may NOTIFY), or its history row could not be written",
				zap.String("resource", res), zap.Int64("token", tok), zap.Uint32("sender_pid", n.PID))
			continue
		}
		seen = max(seen, id)
		if err := g.watcher.Reset(key); err != nil {
			g.log.Error("fence reset seen, but Consul's state is unknown: this proxy keeps failing closed until restarted",
				zap.String("resource", res), zap.Error(err))
			continue
		}
		g.log.Warn("fence reset by an operator: Consul history of the resource starts afresh",
			zap.String("resource", res), zap.Int64("token", tok))
	}
}

// resetRecorded returns the id of the first reset of res to tok that fence.history records
// after id after (0: none, the notification was not fence.reset's).
func resetRecorded(ctx context.Context, conn *pgx.Conn, res string, tok, after int64) (int64, error) {
	var id int64
	err := conn.QueryRow(ctx, "SELECT coalesce(min(id), 0) FROM fence.history WHERE reset AND resource = $1 AND token = $2 AND id > $3",
		res, tok, after).Scan(&id)
	return id, err
}
