package proxy_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// The review of the event loop (finding 2): when the shutdown grace ran out, a client whose
// statement was running was told 57P01 "terminating connection", and its INSERT committed
// 6 s later (closing the server connection does not stop a running statement); a client
// that retries on 57P01 writes twice. Now the statement is cancelled, and the client gets
// the cancel's answer before the end, or is told that its outcome is unknown (08007).
func TestShutdownCancelsTheStatementInFlight(t *testing.T) {
	pg, admin := fencedDB(t)
	for _, relay := range []string{"loop", "goroutines"} {
		t.Run(relay, func(t *testing.T) {
			p := fencedProxy(t, pg, func(c *proxy.Config) {
				c.Unfenced, c.Relay, c.ShutdownGrace = proxy.UnfencedAllow, relay, 300*time.Millisecond
			})
			tag := "shutdown " + relay
			r := dialRaw(t, proxyAddr(p))
			r.startup(wire.ProtocolVersion30, "user", "app", "database", "postgres", "fence.resource", "billing", "fence.token", "1")
			r.send(&pgproto3.Query{String: fmt.Sprintf("INSERT INTO items (tag) SELECT '%s' FROM pg_sleep(5)", tag)})
			time.Sleep(300 * time.Millisecond) // running
			stopped := make(chan struct{})
			go func() { p.Stop(t); close(stopped) }()
			defer func() { <-stopped }()
			got, err := receiveAll(r)
			if !isClosed(err) {
				t.Fatalf("after the error: %v, want the connection closed", err)
			}
			// The cancel's own answer, then the end of an idle session; or, when the
			// answer does not come in time, the unknown outcome.
			cancelled := "error " + wire.CodeQueryCanceled + ", ready, error " + wire.CodeAdminShutdown
			if g := strings.Join(got, ", "); g != cancelled && g != "error "+wire.CodeResolutionUnknown {
				t.Fatalf("got %q, want %s or %s", got, cancelled, wire.CodeResolutionUnknown)
			}
			eventually(t, 15*time.Second, "the statement ends after the proxy's end", func() error {
				if n := count(t, admin, `SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'INSERT INTO items%'`); n > 0 {
					return fmt.Errorf("%d still running", n)
				}
				return nil
			})
			if n := count(t, admin, `SELECT count(*) FROM items WHERE tag = $1`, tag); n != 0 {
				t.Fatalf("the cancelled INSERT committed %d rows", n)
			}
		})
	}
}
