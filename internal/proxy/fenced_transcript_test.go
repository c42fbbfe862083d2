package proxy_test

import (
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestFencedTranscripts runs the wire transcripts through a fenced session:
// after its startup (the bind happens before the client sees ReadyForQuery)
// a fenced session is a plain relay, so its transcript, startup included,
// must be identical to a direct session's, message by message.
func TestFencedTranscripts(t *testing.T) {
	t.Parallel()
	pg := testenv.StartPostgres(t)
	testenv.Migrate(t, pg.AdminURL())
	p := testenv.StartProxy(t, pg, proxy.Config{Resources: []string{"raw"}})
	params := []string{"user", testenv.AdminUser, "database", "postgres"}
	fenced := append(params[:len(params):len(params)], "fence.resource", "raw", "fence.token", "1")
	for _, tt := range transcripts {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			direct := runTranscript(t, pgAddr(pg), params, tt.steps)
			sameTranscript(t, direct, runTranscript(t, proxyAddr(p), fenced, tt.steps))
		})
	}
}
