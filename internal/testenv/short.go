package testenv

import "testing"

// needServers skips the calling test under `go test -short`, the fast tier: that tier
// runs what needs no server (decoders, fuzz corpora, the protocol state, configuration)
// in seconds, and every test that starts a server or a proxy in front of one through
// these helpers runs in the full suite only. Not yet covered: tests that build and run a
// program that starts its own servers (internal/demo's TestDemo*, 181 s under -short).
func needServers(tb testing.TB) {
	tb.Helper()
	if testing.Short() {
		tb.Skip("testenv: starts a server; skipped in the fast tier (go test -short)")
	}
}
