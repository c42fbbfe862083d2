package proxy

import (
	"context"
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
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "LISTEN "+fence.Channel); err != nil {
		return err
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
		if err := g.watcher.Reset(key); err != nil {
			g.log.Error("fence reset seen, but Consul's state is unknown: this proxy keeps failing closed until restarted",
				zap.String("resource", res), zap.Error(err))
			continue
		}
		g.log.Warn("fence reset by an operator: Consul history of the resource starts afresh",
			zap.String("resource", res), zap.Int64("token", tok))
	}
}
