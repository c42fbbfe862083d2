package proxy_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
)

// TestChecksPerUnit counts the checks the proxy injects for extended-protocol
// units: one per commit, none for a Sync whose implicit transaction holds no
// statement (after a COMMIT, which had its own check, or a ROLLBACK). The
// stale-token side of the same shapes is in TestStaleWritesNeverCommit
// ("extended write after COMMIT in one unit").
func TestChecksPerUnit(t *testing.T) {
	pg, admin := fencedDB(t)
	p := fencedProxy(t, pg)
	ctx := ctxT(t)
	conn := connect(t, p.FenceURL("app", "postgres", "billing", 1)).PgConn()
	ins := "INSERT INTO items(tag) VALUES ('per-unit')"
	one := func(sql string) func(*pgconn.Pipeline) {
		return func(pl *pgconn.Pipeline) { pl.SendQueryParams(sql, nil, nil, nil, nil) }
	}
	sync := func(pl *pgconn.Pipeline) { pl.SendPipelineSync() }
	cases := []struct {
		name  string
		send  []func(*pgconn.Pipeline)
		check float64
	}{
		{"autocommit write", []func(*pgconn.Pipeline){one(ins), sync}, 1},
		{"BEGIN, write, COMMIT: a Sync each", []func(*pgconn.Pipeline){one("BEGIN"), sync, one(ins), sync, one("COMMIT"), sync}, 1},
		{"BEGIN, write, COMMIT: one Sync", []func(*pgconn.Pipeline){one("BEGIN"), one(ins), one("COMMIT"), sync}, 1},
		{"block, then a write in the same unit", []func(*pgconn.Pipeline){one("BEGIN"), one(ins), one("COMMIT"), one(ins), sync}, 2},
		{"write taken into a block", []func(*pgconn.Pipeline){one(ins), one("BEGIN"), one(ins), one("COMMIT"), sync}, 1},
		{"ROLLBACK", []func(*pgconn.Pipeline){one("BEGIN"), one(ins), one("ROLLBACK"), sync}, 0},
		{"write after ROLLBACK", []func(*pgconn.Pipeline){one("BEGIN"), one("ROLLBACK"), one(ins), sync}, 1},
	}
	for _, tc := range cases {
		before := counterValue(t, p.Metrics.Checks)
		runPipeline(ctx, t, conn, tc.send)
		if got := counterValue(t, p.Metrics.Checks) - before; got != tc.check {
			t.Errorf("%s: %v checks, want %v", tc.name, got, tc.check)
		}
		if st := conn.TxStatus(); st != 'I' {
			t.Fatalf("%s: session left in state %q", tc.name, st)
		}
	}
	if n := count(t, admin, "SELECT count(*) FROM items WHERE tag = 'per-unit'"); n != 8 {
		t.Errorf("%d rows written, want 8", n)
	}
}

// runPipeline sends the messages and reads every result, failing the test on
// any error.
func runPipeline(ctx context.Context, t *testing.T, conn *pgconn.PgConn, send []func(*pgconn.Pipeline)) {
	t.Helper()
	pl := conn.StartPipeline(ctx)
	for _, s := range send {
		s(pl)
	}
	if err := pipelineResults(pl); err != nil {
		t.Fatal(err)
	}
}

// TestDebugParseUnfenced: with --debug-parse-unfenced an unfenced session's
// simple Queries are parsed and relayed unchanged: no check is injected, and
// text the parser refuses still reaches the server, which answers it.
func TestDebugParseUnfenced(t *testing.T) {
	pg, admin := fencedDB(t)
	p := fencedProxy(t, pg, func(c *proxy.Config) { c.Unfenced, c.DebugParseUnfenced = "allow", true })
	ctx := ctxT(t)
	conn := connect(t, p.URL("app", "postgres"))
	for _, q := range []string{"SELECT 1; SELECT 2", "BEGIN", "INSERT INTO items(tag) VALUES ('parse-only')", "COMMIT"} {
		if err := simple(ctx, conn, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	var pgErr *pgconn.PgError
	if err := simple(ctx, conn, "SELEC 1"); !errors.As(err, &pgErr) || pgErr.Code != "42601" {
		t.Fatalf("syntax error: got %v, want the server's 42601", err)
	}
	if n := counterValue(t, p.Metrics.Checks); n != 0 {
		t.Errorf("%v checks injected, want 0", n)
	}
	if n := count(t, admin, "SELECT count(*) FROM items WHERE tag = 'parse-only'"); n != 1 {
		t.Errorf("%d rows, want 1", n)
	}
}

// TestPipelinedSimpleCommits: transactions sent as simple Queries without
// waiting for each answer, so that the proxy does not know the state exactly
// when a COMMIT arrives (its check then closes the portal first). With the
// current token both commit; with a stale one the COMMITs fail with ZF001
// from the check in the database, the session ends idle, and nothing of
// either transaction is left.
func TestPipelinedSimpleCommits(t *testing.T) {
	pg, admin := fencedDB(t)
	p := fencedProxy(t, pg)
	r := dialRaw(t, proxyAddr(p))
	if out := r.startup(pgproto3.ProtocolVersionNumber, "user", "app", "database", "postgres",
		"fence.resource", "other", "fence.token", "5"); !strings.HasPrefix(out[len(out)-1], "ReadyForQuery") {
		t.Fatalf("startup: %q", out)
	}
	txs := func(tag string) []pgproto3.FrontendMessage {
		var msgs []pgproto3.FrontendMessage
		for range 2 {
			msgs = append(msgs, &pgproto3.Query{String: "BEGIN"},
				&pgproto3.Query{String: "INSERT INTO items(tag) VALUES ('" + tag + "')"},
				&pgproto3.Query{String: "COMMIT"})
		}
		return msgs
	}
	r.send(txs("pipelined")...)
	out, err := r.readUntil(6, "")
	if err != nil {
		t.Fatal(err)
	}
	if joined := strings.Join(out, "\n"); strings.Contains(joined, "ErrorResponse") || !strings.HasSuffix(joined, `"TxStatus":"I"}`) {
		t.Fatalf("current token:\n%s", joined)
	}
	if n := count(t, admin, "SELECT count(*) FROM items WHERE tag = 'pipelined'"); n != 2 {
		t.Fatalf("%d rows committed, want 2", n)
	}
	// The new token comes through another proxy instance, which this one
	// does not hear of: only the check in the database stops the writes.
	q := fencedProxy(t, pg)
	connect(t, q.FenceURL("app", "postgres", "other", 6))
	r.send(txs("pipelined-stale")...)
	out, err = r.readUntil(6, "")
	if err != nil {
		t.Fatal(err)
	}
	joined := strings.Join(out, "\n")
	if !strings.Contains(joined, `"Code":"ZF001"`) || !strings.HasSuffix(joined, `"TxStatus":"I"}`) {
		t.Fatalf("stale token:\n%s", joined)
	}
	if n := count(t, admin, "SELECT count(*) FROM items WHERE tag = 'pipelined-stale'"); n != 0 {
		t.Fatalf("%d rows of the stale token committed", n)
	}
}

// counterValue reads a Prometheus counter.
func counterValue(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}
