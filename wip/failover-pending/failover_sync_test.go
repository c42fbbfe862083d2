package proxy_test

import (
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
)

// TestFailoverSyncStandbyRoleSyncCommitOff (issue 21, setup 3): with a synchronous standby
// (synchronous_standby_names) and ALTER ROLE app SET synchronous_commit = off, a raise must
// still wait for the standby: with replication cut, the session whose bind raises does not
// start, and after the failover the stale leader's token is refused or its raise is there.
// Depends on synchronous_commit = on inside every raise (the schema change of another branch).
func TestFailoverSyncStandbyRoleSyncCommitOff(t *testing.T) {
	pg, sb := replicatedDB(t) // testenv: synchronous_commit off by default; on for the raise only
	makeSynchronous(t, pg, "s1")
	pg.Exec(t, "ALTER ROLE app SET synchronous_commit = off")
	px := fencedProxy(t, pg, func(c *proxy.Config) { c.LoginTimeout = 2 * time.Second })

	connect(t, px.FenceURL("app", "postgres", "billing", 33)).Close(ctxT(t))
	sb.WaitFlushed(t, pg.CurrentLSN(t), 30*time.Second)
	sb.CutReplication()
	err := connectErr(px.FenceURL("app", "postgres", "billing", 34))
	if err == nil {
		pg.Kill(t)
		sb.Promote(t)
		t.Fatalf("the session raising to 34 started with its synchronous standby cut off; after the failover the stored token is %d", storedToken(t, sb.Postgres))
	}
	pg.Kill(t)
	sb.Promote(t)
	if got := storedToken(t, sb.Postgres); got != 33 {
		t.Fatalf("stored token %d after the failover, want 33", got)
	}
}
