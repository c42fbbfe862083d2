package proxy_test

import (
	"context"
	"fmt"
	"regexp"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// proofRE matches a proof: a MAC of 32 bytes in hex.
var proofRE = regexp.MustCompile(`[0-9a-fA-F]{64}`)

// TestBindAndRaiseProofsNotInPgStatActivity (F4): the role's other sessions
// read pg_stat_activity.query of its fenced sessions. The bind's proof must
// not be there, neither while the bind runs (its text is fence.BindQuery with
// parameters) nor after it (the last statement is the COMMIT); nor the proof
// of a raise on a control connection (fence.Key.Raise, fence.RaiseQuery).
func TestBindAndRaiseProofsNotInPgStatActivity(t *testing.T) {
	t.Parallel()
	pg, admin := fencedDB(t)
	p := fencedProxy(t, pg)
	ctx := ctxT(t)
	peer := connect(t, pg.URL("app", "postgres")) // the role's other session

	s5 := connect(t, p.FenceURL("app", "postgres", "billing", 5))
	var q string
	if err := peer.QueryRow(ctx, `SELECT query FROM pg_stat_activity WHERE pid = $1`, int32(s5.PgConn().PID())).Scan(&q); err != nil {
		t.Fatal(err)
	}
	if proofRE.MatchString(q) || q != "COMMIT" {
		t.Fatalf("the fenced session's last query after its bind is %q, want COMMIT and no proof", q)
	}

	// A bind in progress: it waits for the token row.
	release := lockTokenRow(t, pg.AdminURL(), "billing")
	var bindErr error
	bound := make(chan struct{})
	go func() { defer close(bound); bindErr = connectErr(p.FenceURL("app", "postgres", "billing", 6)) }()
	t.Cleanup(func() { release(); <-bound })
	_, q = waitLocked(t, peer, "app")
	if proofRE.MatchString(q) || q != fence.BindQuery {
		t.Fatalf("a bind in progress shows %q in pg_stat_activity, want %q and no proof", q, fence.BindQuery)
	}
	release()
	if <-bound; bindErr != nil {
		t.Fatalf("the bind of 6: %v", bindErr)
	}

	// A raise on a control connection, in progress.
	control := connect(t, pg.AdminURL())
	release = lockTokenRow(t, pg.AdminURL(), "billing")
	var raiseErr error
	raised := make(chan struct{})
	go func() {
		defer close(raised)
		var stored int64
		stored, raiseErr = testenv.Key.Raise(context.Background(), control, "billing", 7)
		if raiseErr == nil && stored != 7 {
			raiseErr = fmt.Errorf("stored %d after the raise, want 7", stored)
		}
	}()
	t.Cleanup(func() { release(); <-raised }) // before control closes
	_, q = waitLocked(t, admin, testenv.AdminUser)
	if proofRE.MatchString(q) || q != fence.RaiseQuery {
		t.Fatalf("a raise in progress shows %q in pg_stat_activity, want %q and no proof", q, fence.RaiseQuery)
	}
	release()
	if <-raised; raiseErr != nil {
		t.Fatalf("the raise to 7: %v", raiseErr)
	}

	// Nowhere in pg_stat_activity a literal proof.
	rows, err := admin.Query(ctx, `SELECT pid, query FROM pg_stat_activity WHERE query ~ '[0-9a-fA-F]{64}'`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var pid int32
		rows.Scan(&pid, &q) //nolint:errcheck
		t.Errorf("backend %d shows a proof: %q", pid, q)
	}
}
