package proxy_test

import (
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"
)

// TestErrorQuerySyncTransparent: Execute (error), Query, Sync. The relay is plain: the
// session sees what a direct one sees, and its backend ends in the same state.
func TestErrorQuerySyncTransparent(t *testing.T) {
	t.Parallel()
	e := startStaleEnv(t, []string{"desync"})
	ctx := ctxEnv(t)
	// rfq: the server discards every message but Sync after an
	// extended-protocol error, Queries too: one ReadyForQuery for the Sync
	// (and one for a Query before the error).
	seqs := []struct {
		name string
		msgs []pgproto3.FrontendMessage
		rfq  int
	}{
		{"Execute error, Query, Sync", frontendMsgs(parseBindExecute("", "", "SELECT 1/0"), queryMsg("SELECT 1"), &pgproto3.Sync{}), 1},
		{"BEGIN, Execute error, Query COMMIT, Sync", frontendMsgs(queryMsg("BEGIN"), parseBindExecute("", "", "SELECT 1/0"), queryMsg("COMMIT"), &pgproto3.Sync{}), 2},
		{"Execute write, Execute error, Query, Sync", frontendMsgs(parseBindExecute("", "", "INSERT INTO public.v2_rows (resource, token, tag) VALUES ('desync', 0, 'x')"),
			parseBindExecute("", "", "SELECT 1/0"), queryMsg("SELECT 1"), &pgproto3.Sync{}), 1},
		{"Execute error, Query, Query, Sync", frontendMsgs(parseBindExecute("", "", "SELECT 1/0"), queryMsg("BEGIN"), queryMsg("SELECT 2"), &pgproto3.Sync{}), 1},
	}
	for _, seq := range seqs {
		t.Run(seq.name, func(t *testing.T) {
			type out struct {
				lines []string
				state string
			}
			run := func(addr string, params map[string]string) out {
				s, err := dialSession(addr, params)
				if err != nil {
					t.Fatal(err)
				}
				defer s.Close()
				if err := s.send(seq.msgs...); err != nil {
					t.Fatal(err)
				}
				// Then nothing more may come. The backend reports its state
				// before it sends ReadyForQuery.
				var o out
				first, err := s.untilRFQ(seq.rfq, "", 20*time.Second)
				if err != nil {
					t.Fatalf("%v; transcript:%s", err, s.transcript())
				}
				for _, m := range first {
					o.lines = append(o.lines, m.Text)
				}
				for {
					m, ok, err := s.next(200 * time.Millisecond)
					if err != nil || !ok {
						break
					}
					o.lines = append(o.lines, m.Text)
				}
				if err := e.admin.QueryRow(ctx, `SELECT state FROM pg_stat_activity WHERE pid = $1`, int32(s.PID)).Scan(&o.state); err != nil {
					t.Fatal(err)
				}
				lines, err := sessionTranscript(s, nil, "v2-desync-end", 20*time.Second)
				if err != nil {
					t.Fatal(err)
				}
				o.lines = append(o.lines, lines...)
				return o
			}
			d := run(addrOf(e.pg.Host, e.pg.Port), fenceParams("postgres", "", 0))
			p := run(addrOf(e.a.Host, e.a.Port), fenceParams("postgres", "desync", 1))
			if strings.Join(d.lines, "\n") != strings.Join(p.lines, "\n") {
				t.Fatalf("the proxy's session differs from a direct one:\n%s", diffLines(d.lines, p.lines))
			}
			if d.state != p.state {
				t.Fatalf("backend state afterwards: direct %q, proxy %q", d.state, p.state)
			}
			t.Logf("%d messages alike; backend state afterwards %q", len(d.lines), d.state)
		})
	}
}
