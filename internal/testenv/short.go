package testenv

import "testing"

// NeedServers skips the calling test under `go test -short`, the fast tier: that tier
// runs what needs no server (decoders, fuzz corpora, the protocol state, configuration)
// in seconds, and every test that starts a server or a proxy in front of one through
// these helpers, or builds and runs a program that starts its own (internal/demo), runs
// in the full suite only.
func NeedServers(tb testing.TB) {
	tb.Helper()
	if testing.Short() {
		tb.Skip("testenv: starts a server; skipped in the fast tier (go test -short)")
	}
}
