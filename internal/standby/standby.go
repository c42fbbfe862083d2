// Package standby waits until the standbys that a failover may promote have flushed a
// commit: a raise of a fencing token (or a PostgreSQL lease's new generation) counts as
// admitted only once it is on every one of them, or a failover could lose it and admit the
// stale leader again (issue 21).
//
// Which standbys count is the operator's choice (Set): standbys by application_name, as the
// primary's pg_stat_replication shows them (their flush_lsn), and physical replication slots
// (their restart_lsn, which the primary moves to the standby's reported flush position),
// named or every physical slot. A named standby that is not streaming, or a slot that has not
// reached the commit, does not confirm: the wait fails closed and names it.
package standby

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// DefaultTimeout bounds a wait when the caller gives none.
const DefaultTimeout = 5 * time.Second

// Set is the standbys whose flush a commit waits for. The zero Set waits for none.
type Set struct {
	Names    []string // application_name in pg_stat_replication
	Slots    []string // physical replication slots
	AllSlots bool     // every physical replication slot (at least one must exist)
}

// Parse reads the operator's list: NAME (a standby by application_name), slot:NAME (a
// physical replication slot) or slot:* (every physical replication slot).
func Parse(list []string) (Set, error) {
	var s Set
	seen := map[string]bool{}
	for _, raw := range list {
		item := strings.TrimSpace(raw)
		if item == "" {
			continue
		}
		if seen[item] {
			return Set{}, fmt.Errorf("failover standby %q named twice", item)
		}
		seen[item] = true
		name, isSlot := strings.CutPrefix(item, "slot:")
		switch {
		case isSlot && name == "*":
			s.AllSlots = true
		case isSlot && name != "":
			s.Slots = append(s.Slots, name)
		case isSlot:
			return Set{}, errors.New("failover standby \"slot:\" names no slot: write slot:NAME, or slot:* for every physical replication slot")
		default:
			s.Names = append(s.Names, name)
		}
	}
	return s, nil
}

// Empty reports whether the set waits for nothing.
func (s Set) Empty() bool { return len(s.Names) == 0 && len(s.Slots) == 0 && !s.AllSlots }

// String is the set as Parse reads it.
func (s Set) String() string {
	out := append([]string(nil), s.Names...)
	for _, n := range s.Slots {
		out = append(out, "slot:"+n)
	}
	if s.AllSlots {
		out = append(out, "slot:*")
	}
	return strings.Join(out, ",")
}

// Querier is a *pgx.Conn or a *pgxpool.Pool on the primary.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// CommitLSNQuery reads, on the connection that just committed, a WAL position at or after
// the end of its commit record (the insert position: also with synchronous_commit off,
// where the commit may not be written yet). The PostgreSQL lease waits for it.
const CommitLSNQuery = "SELECT pg_catalog.pg_current_wal_insert_lsn()::pg_catalog.text"

// FlushedLSNQuery reads the primary's locally flushed WAL position. A fenced session's bind
// waits for it: every raise commits with synchronous_commit at least local (fence.raise),
// so a raise the bind saw (its own, or the one that admitted its token) is flushed at or
// before it, while the bind's own record of the session, which no failover needs, may be
// written later (synchronous_commit off; waiting for it measured about 110 ms more, the WAL
// writer's delay). Schema-qualified: it runs on the client's own backend after the bind's
// transaction, under the client's search_path, where a function of the client's could
// answer instead (a review's F4).
const FlushedLSNQuery = "SELECT pg_catalog.pg_current_wal_flush_lsn()::pg_catalog.text"

// pendingQuery lists, for the set ($1 names, $2 slots, $3 every physical slot), the members
// that have not flushed $4, each described, and how many members there are; it also says
// whether the role can read pg_stat_replication's positions and whether this server is in
// recovery (a standby has no standbys to ask).
//
// A name stands for one standby: two connections streaming under it (pg_basebackup -R names
// every standby "walreceiver") fail the wait, saying so, for one streaming twin must not
// confirm for another, and a twin that is cut off disappears from pg_stat_replication (a
// review's F4, a second review's G4); a standby reconnecting before its old connection timed
// out (wal_sender_timeout) looks the same for that long. A name that is this server's own (its cluster_name, or the
// application_name its primary_conninfo gives, when the role may read it: pg_read_all_settings)
// is waited for all the same, and said to be its own: after a failover to the standby of that
// name it fails every wait until the operator takes the name out of --failover-standbys (a
// reload), for nothing tells it from another standby of the same name that is cut off (a
// symmetric primary_conninfo, Debian's cluster_name on every host: a second review's G2,
// where skipping it let a stale write commit after the failover).
const pendingQuery = `
WITH self AS (
    SELECT n FROM (
        SELECT nullif(current_setting('cluster_name'), '') AS n
        UNION ALL
        SELECT substring(c FROM 'application_name\s*=\s*''?([^'' ]+)')
        FROM (SELECT CASE WHEN pg_has_role('pg_read_all_settings', 'USAGE') THEN nullif(current_setting('primary_conninfo'), '') END AS c) pc
        WHERE c IS NOT NULL
    ) x WHERE n IS NOT NULL
), want AS (
    SELECT n AS name, 'standby' AS kind FROM unnest($1::text[]) n
    UNION SELECT n, 'slot' FROM unnest($2::text[]) n
    UNION SELECT slot_name::text, 'slot' FROM pg_replication_slots WHERE $3 AND slot_type = 'physical'
), streaming AS (
    SELECT coalesce(string_agg(DISTINCT r.application_name, ', '), 'none') AS names FROM pg_stat_replication r
), pos AS (
    SELECT w.name, w.kind,
        CASE w.kind
            WHEN 'standby' THEN CASE WHEN r.streams = 1 THEN r.flushed END
            ELSE (SELECT s.restart_lsn FROM pg_replication_slots s WHERE s.slot_name = w.name AND s.slot_type = 'physical')
        END AS flushed,
        CASE w.kind WHEN 'standby' THEN r.streams END AS streams
    FROM want w
    LEFT JOIN LATERAL (SELECT count(*) AS streams, min(r.flush_lsn) AS flushed
                       FROM pg_stat_replication r WHERE r.application_name = w.name) r ON true
)
SELECT coalesce(array_agg(p.kind || ' ' || p.name || CASE
            WHEN p.streams > 1
                THEN ' (' || p.streams || ' connections stream under this name: give each standby its own application_name, or name slots; one that is cut off could not be counted)'
            WHEN p.flushed IS NULL AND p.kind = 'standby' AND p.name IN (SELECT n FROM self)
                THEN ' (not streaming from this primary; it is also this primary''s own name: after a failover to it, take it out of --failover-standbys and reload the proxies)'
            WHEN p.flushed IS NULL AND p.kind = 'standby'
                THEN ' (not streaming from this primary: down, cut off, or cascading from another standby, which cannot be waited for; names are case-sensitive, and streaming now: ' || (SELECT names FROM streaming) || ')'
            WHEN p.flushed IS NULL THEN ' (no such physical slot, or it never streamed)'
            ELSE ' (flushed up to ' || p.flushed::text || ')' END ORDER BY p.kind, p.name)
        FILTER (WHERE p.flushed IS NULL OR p.flushed < $4::pg_lsn), '{}'),
    count(*),
    pg_has_role('pg_read_all_stats', 'USAGE'),
    pg_is_in_recovery()
FROM pos p`

// NotFlushedError is a wait that ran out: Pending names what did not confirm, or Unread says
// that no reading of the positions came back at all.
type NotFlushedError struct {
	LSN     string
	Pending []string // e.g. "standby s1 (not streaming from this primary: ...)", "slot s2 (flushed up to 0/3000060)"
	Timeout time.Duration
	// Unread: the primary never answered the wait's query (a frozen or unreachable control
	// connection), so nothing is known of the standbys (a review's message blamed them).
	Unread bool
}

func (e *NotFlushedError) Error() string {
	if e.Unread {
		return fmt.Sprintf("the control database did not answer the read of the failover standbys' flush positions (%s) within %v: nothing says they have WAL position %s, and a failover to one of them could lose the commit",
			strings.Join(e.Pending, ", "), e.Timeout, e.LSN)
	}
	return fmt.Sprintf("%s did not confirm the flush of WAL position %s within %v: a failover to it could lose the commit",
		strings.Join(e.Pending, ", "), e.LSN, e.Timeout)
}

// ErrSetup is a wait that cannot succeed whatever the standbys do (a role without
// pg_read_all_stats, no physical slot for slot:*, a server in recovery): retrying will not
// help, the operator must act.
var ErrSetup = errors.New("failover standbys")

// WaitFlushed waits until every member of s has flushed lsn, polling on q (every
// millisecond at first, then less often), at most timeout (0: DefaultTimeout) or until ctx
// ends. The empty set returns at once.
func (s Set) WaitFlushed(ctx context.Context, q Querier, lsn string, timeout time.Duration) error {
	if s.Empty() {
		return nil
	}
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	wctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	pause := 500 * time.Microsecond
	var pending []string
	for {
		now, err := s.pending(wctx, q, lsn)
		if err == nil {
			pending = now // the last reading that came back names what did not confirm
		}
		switch {
		case err != nil && wctx.Err() != nil:
			return s.timedOut(ctx, lsn, pending, timeout)
		case err != nil:
			return err
		case len(pending) == 0:
			return nil
		}
		t := time.NewTimer(pause)
		select {
		case <-wctx.Done():
			t.Stop()
			return s.timedOut(ctx, lsn, pending, timeout)
		case <-t.C:
		}
		pause = min(pause*2, 10*time.Millisecond)
	}
}

// Unconfirmable lists the members of s that could not confirm any commit now (a named
// standby that does not stream from this primary, a slot that never streamed), or returns
// an ErrSetup error: while either holds, every wait fails. /readyz says so.
func (s Set) Unconfirmable(ctx context.Context, q Querier) ([]string, error) {
	if s.Empty() {
		return nil, nil
	}
	out, err := s.pending(ctx, q, "0/0")
	if err != nil {
		return nil, err
	}
	// A slot keeps the position its standby reached, streaming or not: one that no standby
	// streams from confirms no new commit (a review's /readyz said ready with slot:s2 stopped).
	var idle []string
	slots := s.Slots
	if slots == nil {
		slots = []string{}
	}
	if err := q.QueryRow(ctx, `SELECT coalesce(array_agg('slot ' || slot_name || ' (no standby streams from it)' ORDER BY slot_name), '{}')
        FROM pg_replication_slots WHERE slot_type = 'physical' AND NOT active AND (slot_name = ANY($1) OR $2)`, slots, s.AllSlots).Scan(&idle); err != nil {
		return nil, err
	}
	return append(out, idle...), nil
}

// pending is one reading of the members of s that have not flushed lsn; an error wrapping
// ErrSetup when the wait cannot succeed whatever the standbys do.
func (s Set) pending(ctx context.Context, q Querier, lsn string) ([]string, error) {
	names, slots := s.Names, s.Slots
	if names == nil {
		names = []string{}
	}
	if slots == nil {
		slots = []string{}
	}
	var pending []string
	var members int
	var canRead, recovering bool
	err := q.QueryRow(ctx, pendingQuery, names, slots, s.AllSlots, lsn).Scan(&pending, &members, &canRead, &recovering)
	switch {
	case err != nil && ctx.Err() != nil:
		return nil, err
	case err != nil:
		return nil, fmt.Errorf("%w: read the standbys' flush positions: %w", ErrSetup, err)
	case recovering:
		return nil, fmt.Errorf("%w: the server is a standby (in recovery), not the primary whose standbys count", ErrSetup)
	case len(s.Names) > 0 && !canRead:
		return nil, fmt.Errorf("%w: this role cannot read pg_stat_replication's flush positions: GRANT pg_read_all_stats (or pg_monitor) TO it, or name slots (slot:NAME, slot:*) instead", ErrSetup)
	case members == 0 && s.AllSlots:
		return nil, fmt.Errorf("%w: slot:* counts every physical replication slot, and the server has none: create one per standby (pg_basebackup -C -S NAME, primary_slot_name) or name the standbys", ErrSetup)
	}
	return pending, nil
}

func (s Set) timedOut(ctx context.Context, lsn string, pending []string, timeout time.Duration) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if len(pending) == 0 {
		return &NotFlushedError{LSN: lsn, Pending: []string{s.String()}, Timeout: timeout, Unread: true}
	}
	return &NotFlushedError{LSN: lsn, Pending: pending, Timeout: timeout}
}
