package proxy_test

import (
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// The transparency and failure suite: integration tests through the proxy
// against a real PostgreSQL. Each top-level test shares one cluster among
// its subtests (a cluster costs seconds of CPU, a proxy nothing); every
// subtest starts the proxies it needs.

// TestTransparency: the proxy is indistinguishable from the server, for
// pgx in both protocol modes, for the raw protocol, for libpq (psql,
// pgbench) and psycopg2, at session start and with or without TLS.
func TestTransparency(t *testing.T) {
	t.Parallel()
	s := newSuite(t)
	s.runAll(t, []suiteTest{
		{"pgx", testPgx},
		{"wire transcripts", testWireTranscripts},
		{"startup relayed", testStartupRelayed},
		{"startup garbage", testStartupGarbage},
		{"cancel request", testCancelRequestRaw},
		{"psql", testPsql},
		{"pgbench", testPgbench},
		{"psycopg2", testPsycopg2},
		{"psql with PGOPTIONS", testPsqlOptions},
		{"no client TLS", testNoClientTLS},
		{"client TLS", testClientTLS},
		{"upstream TLS refused", testUpstreamTLSRefused},
		{"unix socket upstream", testUnixSocketUpstream},
	})
}

// TestAuthAndTLS: authentication relayed unchanged, TLS to the server, and
// the login timeout, on a cluster with TLS and one role per auth method.
func TestAuthAndTLS(t *testing.T) {
	t.Parallel()
	s := newSuite(t, testenv.WithSSL())
	setupAuth(t, s)
	s.runAll(t, []suiteTest{
		{"methods", testAuthMethods},
		{"upstream TLS", testUpstreamTLS},
		{"SCRAM channel binding", testSCRAMChannelBinding},
		{"login timeout", testLoginTimeout},
	})
}

// TestFailures: what a client sees when something goes wrong, and that
// nothing is left behind.
func TestFailures(t *testing.T) {
	t.Parallel()
	s := newSuite(t)
	s.runAll(t, []suiteTest{
		{"client disconnects", testClientDisconnect},
		{"max message size", testMaxMessageSize},
		{"upstream unreachable", testUpstreamUnreachable},
		{"max clients", testMaxClients},
		{"graceful shutdown", testGracefulShutdown},
	})
}

// suite is one cluster shared by the subtests of a top-level test:
// starting a cluster costs seconds of CPU, a proxy in front of it nothing.
type suite struct {
	pg    *testenv.Postgres
	admin *pgxpool.Pool // straight to PostgreSQL, as the superuser
}

func newSuite(t *testing.T, opts ...testenv.PGOption) *suite {
	t.Helper()
	pg := testenv.StartPostgres(t, opts...)
	admin, err := pgxpool.New(ctxT(t), pg.AdminURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(admin.Close)
	return &suite{pg: pg, admin: admin}
}

// setup starts a new unfenced proxy in front of the suite's cluster (mod
// changes its config) and returns the cluster, the proxy and the admin pool.
func (s *suite) setup(t *testing.T, mod ...func(*proxy.Config)) (*testenv.Postgres, *testenv.Proxy, *pgxpool.Pool) {
	t.Helper()
	return s.pg, plainProxy(t, s.pg, mod...), s.admin
}

// suiteTest is a subtest that runs on a shared cluster.
type suiteTest struct {
	name string
	run  func(t *testing.T, s *suite)
}

// runAll runs tests in parallel on s.
func (s *suite) runAll(t *testing.T, tests []suiteTest) {
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			tt.run(t, s)
		})
	}
}
