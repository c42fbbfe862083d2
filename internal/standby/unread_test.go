package standby

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// silent is a primary that never answers (a frozen control connection): each query's row
// returns the query's context error once it ends.
type silent struct{}

type silentRow struct{ ctx context.Context }

func (silent) QueryRow(ctx context.Context, _ string, _ ...any) pgx.Row { return silentRow{ctx} }

func (r silentRow) Scan(...any) error {
	<-r.ctx.Done()
	return r.ctx.Err()
}

// TestWaitUnreadSaysTheControlDatabaseDidNotAnswer: a wait whose every reading failed to come
// back blames the control database, not the standbys (a review's message said "s1,s2 did
// not confirm" and told the operator to remove them from --failover-standbys).
func TestWaitUnreadSaysTheControlDatabaseDidNotAnswer(t *testing.T) {
	set, err := Parse([]string{"s1", "s2"})
	if err != nil {
		t.Fatal(err)
	}
	err = set.WaitFlushed(context.Background(), silent{}, "0/3000000", 50*time.Millisecond)
	var nf *NotFlushedError
	if !errors.As(err, &nf) || !nf.Unread || !strings.Contains(err.Error(), "the control database did not answer") {
		t.Fatalf("WaitFlushed = %v, want an unread NotFlushedError", err)
	}
}
