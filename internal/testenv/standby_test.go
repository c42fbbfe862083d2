package testenv

import (
	"context"
	"testing"
	"time"
)

// TestStandbyStreamsCutsAndPromotes: a row committed on the primary reaches the standby; with
// replication cut, a row acknowledged on the primary does not, and after the primary's crash
// and the standby's promotion it is gone while the first one is there, on a new timeline.
func TestStandbyStreamsCutsAndPromotes(t *testing.T) {
	primary := StartPostgres(t)
	standby := StartStandby(t, primary, "s1")
	primary.Exec(t, "CREATE TABLE t (v text)")
	primary.Exec(t, "INSERT INTO t VALUES ('kept')")
	lsn := primary.CurrentLSN(t)
	standby.WaitFlushed(t, lsn, 10*time.Second)
	standby.WaitReplayed(t, lsn, 10*time.Second)
	if got := count(t, standby.Postgres, "kept"); got != 1 {
		t.Fatalf("standby has %d rows 'kept', want 1", got)
	}
	var tl1 int64
	if err := standby.queryRow(context.Background(), "SELECT timeline_id FROM pg_control_checkpoint()", nil, &tl1); err != nil {
		t.Fatal(err)
	}

	standby.CutReplication()
	primary.Exec(t, "INSERT INTO t VALUES ('lost')")
	time.Sleep(300 * time.Millisecond)
	if got := count(t, standby.Postgres, "lost"); got != 0 {
		t.Fatalf("replication cut, yet the standby has the row")
	}

	primary.Kill(t)
	standby.Promote(t)
	standby.Exec(t, "INSERT INTO t VALUES ('after')")
	if got := count(t, standby.Postgres, "lost"); got != 0 {
		t.Fatalf("the promoted standby has the row acknowledged after the cut")
	}
	if got := count(t, standby.Postgres, "kept") + count(t, standby.Postgres, "after"); got != 2 {
		t.Fatalf("the promoted standby has %d of the rows 'kept' and 'after', want 2", got)
	}
	var tl2 int64
	standby.Exec(t, "CHECKPOINT")
	if err := standby.queryRow(context.Background(), "SELECT timeline_id FROM pg_control_checkpoint()", nil, &tl2); err != nil {
		t.Fatal(err)
	}
	if tl2 <= tl1 {
		t.Fatalf("timeline %d after promotion, %d before: want a higher one", tl2, tl1)
	}
}

// TestSynchronousStandby: with the standby named in synchronous_standby_names, a commit waits
// for it: with replication cut, it does not return.
func TestSynchronousStandby(t *testing.T) {
	primary := StartPostgres(t, WithConf("synchronous_standby_names", "s1"), WithConf("synchronous_commit", "on"))
	standby := StartStandby(t, primary, "s1")
	primary.Exec(t, "CREATE TABLE t (v text)") // returns: the standby confirmed it
	standby.CutReplication()
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	if err := primary.ExecContext(ctx, "INSERT INTO t VALUES ('waits')"); err == nil {
		t.Fatalf("a synchronous commit returned with the standby cut off")
	}
	standby.HealReplication()
	primary.Exec(t, "INSERT INTO t VALUES ('flows')")
}

func count(t *testing.T, p *Postgres, v string) int {
	t.Helper()
	var n int
	if err := p.queryRow(context.Background(), "SELECT count(*) FROM t WHERE v = $1", []any{v}, &n); err != nil {
		t.Fatal(err)
	}
	return n
}
