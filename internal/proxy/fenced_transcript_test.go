package proxy_test

import (
	"regexp"
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestFencedTranscripts runs the wire transcripts through a fenced session:
// apart from what fencing refuses by design, a fenced session must be
// indistinguishable from the server too, while the proxy injects and
// swallows its checks around every commit.
func TestFencedTranscripts(t *testing.T) {
	t.Parallel()
	pg := testenv.StartPostgres(t)
	if _, err := fence.Migrate(ctxT(t), pg.AdminURL()); err != nil {
		t.Fatal(err)
	}
	p := testenv.StartProxy(t, pg, proxy.Config{Resources: []string{"raw"}})
	// Fencing refuses a fast-path call outside a block (ZF008).
	differ := map[string]bool{"function call": true}
	run := func(t *testing.T, addr string, fenced bool, steps []rawStep) []string {
		r := dialRaw(t, addr)
		params := []string{"user", testenv.AdminUser, "database", "postgres"}
		if fenced {
			params = append(params, "fence.resource", "raw", "fence.token", "1")
		}
		out := r.startup(3<<16, params...)
		for i, s := range steps {
			r.send(s.msgs...)
			got, err := r.readUntil(s.rfq, s.stop)
			out = append(out, got...)
			if s.eof {
				out = append(out, "EOF")
				continue
			}
			if err != nil {
				t.Fatalf("step %d: %v\n%s", i, err, strings.Join(out, "\n"))
			}
		}
		return out
	}
	for _, tt := range transcripts {
		if differ[tt.name] {
			continue
		}
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			direct := run(t, pgAddr(pg), false, tt.steps)
			fenced := run(t, proxyAddr(p), true, tt.steps)
			// Where an error is raised differs by design in one place: a
			// SAVEPOINT outside a block shares an implicit block with the
			// check, so PostgreSQL reports it from another routine.
			direct, fenced = withoutSource(direct), withoutSource(fenced)
			if strings.Join(direct, "\n") != strings.Join(fenced, "\n") {
				t.Fatalf("fenced transcript differs\n%s", diffLines(direct, fenced))
			}
		})
	}
}

var sourceFields = regexp.MustCompile(`"(File|Line|Routine)":("[^"]*"|[0-9]+),?`)

// withoutSource drops the server's source location from error transcripts.
func withoutSource(lines []string) []string {
	out := make([]string, len(lines))
	for i, l := range lines {
		out[i] = sourceFields.ReplaceAllString(l, "")
	}
	return out
}
