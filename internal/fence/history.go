package fence

import (
	"context"
	"fmt"
	"net/netip"
	"time"

	"github.com/jackc/pgx/v5"
)

// HistoryEntry is one row of fence.history (migration 6): a committed raise or reset.
type HistoryEntry struct {
	ID       int64     `json:"id"`
	At       time.Time `json:"at"`
	Resource string    `json:"resource"`
	Token    int64     `json:"token,string"`              // strings: a script's numbers lose precision above 2^53
	Previous *int64    `json:"previous,omitempty,string"` // the token before (nil or 0: none)
	Holder   string    `json:"holder,omitempty"`          // a PostgreSQL lease's holder
	Reset    bool      `json:"reset"`                     // fence.reset, an operator's
	// Who raised it: the role, the client's application_name (its own word), its address
	// ("" for a Unix socket) and the backend's pid.
	Role            string `json:"role"`
	ApplicationName string `json:"application_name,omitempty"`
	ClientAddr      string `json:"client_addr,omitempty"`
	PID             int32  `json:"pid"`
}

// Querier is what ReadHistory needs of a connection or a pool.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// ReadHistory returns the last limit entries of the history (of resource, unless it is ""),
// oldest first.
func ReadHistory(ctx context.Context, q Querier, resource string, limit int) ([]HistoryEntry, error) {
	rows, err := q.Query(ctx, `SELECT * FROM (
		SELECT h.id, h.raised_at, h.resource, h.token, h.previous, coalesce(h.holder, ''), h.reset, h.role::text,
		       coalesce(h.application_name, ''), h.client_addr, h.pid
		FROM fence.history AS h
		WHERE $1 = '' OR h.resource = $1
		ORDER BY h.id DESC LIMIT $2) AS last ORDER BY id`, resource, max(limit, 0))
	if err != nil {
		return nil, fmt.Errorf("fence.history (this fenceproxy needs fence schema version %d: run fenceproxy migrate): %w", SchemaVersion, err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (HistoryEntry, error) {
		var e HistoryEntry
		var addr *netip.Prefix
		err := r.Scan(&e.ID, &e.At, &e.Resource, &e.Token, &e.Previous, &e.Holder, &e.Reset, &e.Role, &e.ApplicationName, &addr, &e.PID)
		if addr != nil {
			e.ClientAddr = addr.Addr().String()
		}
		return e, err
	})
}
