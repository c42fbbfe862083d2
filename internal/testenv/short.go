package testenv

import "testing"

// needServers skips the calling test under `go test -short`, the fast tier: that tier
// runs what needs no server (decoders, fuzz corpora, the protocol state, configuration)
// in seconds, and every test that starts a server, a proxy in front of one, or a
// fenceproxy binary runs in the full suite only. Every helper here that starts one calls
// it first, so a test is in the fast tier exactly when it starts nothing.
func needServers(tb testing.TB) {
	tb.Helper()
	if testing.Short() {
		tb.Skip("testenv: starts a server; skipped in the fast tier (go test -short)")
	}
}
