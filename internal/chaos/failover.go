package chaos

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// failover kills the primary, promotes the standby and makes it the campaign's primary,
// with its history read on (decode.go says how): the links to the standby are held from
// before the kill until the new primary's decoding slot exists, so that every client
// commit there is decoded; the old primary is started again where only the campaign
// reaches it (its links lead to a closed port from the kill on), its slot is drained up to
// its last commit, and it is stopped for good. A new standby is made from the new primary
// (a base backup; the old primary's folder is not reused), and the links that led to the
// old primary lead to it.
func (e *env) failover() {
	tb := e.tb
	began := time.Now()
	old, sb := e.pg, e.sb
	for _, h := range e.sbHops {
		h.Stall(24 * time.Hour) // until the slot exists; Heal ends it
	}
	e.pgDown = true
	old.Kill(tb)
	closed := fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(tb))
	for _, h := range e.pgHops {
		h.Retarget(closed)
		h.Cut()
	}
	sb.Promote(tb)
	var switchLSN uint64
	if err := tryConn(sb.URLWithPassword(testenv.AdminUser, testenv.AdminPassword, database), func(ctx context.Context, c *pgx.Conn) error {
		if err := createSlot(ctx, c); err != nil {
			return err
		}
		var err error
		switchLSN, err = switchPoint(ctx, c)
		return err
	}); err != nil {
		tb.Fatalf("chaos: failover: the promoted standby %s: %v", sb.Name, err)
	}

	old.Start(tb)
	if err := tryConn(old.URLWithPassword(testenv.AdminUser, testenv.AdminPassword, database), func(ctx context.Context, c *pgx.Conn) error {
		// Nothing waits for the standby it had (StandbySync).
		if _, err := c.Exec(ctx, "ALTER SYSTEM RESET synchronous_standby_names"); err != nil {
			return err
		}
		if _, err := c.Exec(ctx, "SELECT pg_reload_conf()"); err != nil {
			return err
		}
		return e.dec.drain(ctx, c, switchLSN)
	}); err != nil {
		tb.Fatalf("chaos: failover: drain the old primary's decoding slot: %v", err)
	}
	old.Stop(tb)

	e.setPrimary(sb.Postgres)
	e.pgDown = false
	e.pgHops, e.sbHops = e.sbHops, e.pgHops
	e.newStandby()
	addr := fmt.Sprintf("%s:%d", e.sb.Host, e.sb.Port)
	for i := range proxies {
		e.sbHops[i].Retarget(addr)
		e.sbHops[i].Heal()
		e.pgHops[i].Heal()
	}
	e.res.Faults[Failover]++
	e.res.FailoverPauses = append(e.res.FailoverPauses, time.Since(began))
	e.logf("chaos: failover to %s (switch point %X/%X) in %v; new standby %s", sb.Name, switchLSN>>32, uint32(switchLSN),
		time.Since(began).Round(time.Millisecond), e.sb.Name)
}

// switchPoint reads the promoted server's newest timeline history file: its last line is
// the parent timeline and the WAL position where the new one branched off (the end of the
// last record the standby replayed).
func switchPoint(ctx context.Context, c *pgx.Conn) (uint64, error) {
	var text string
	err := c.QueryRow(ctx, `SELECT pg_read_file('pg_wal/' || name) FROM pg_ls_waldir()
		WHERE name LIKE '%.history' ORDER BY name DESC LIMIT 1`).Scan(&text)
	if err != nil {
		return 0, fmt.Errorf("timeline history file: %w", err)
	}
	lines := strings.Split(strings.TrimSpace(text), "\n")
	fields := strings.Fields(lines[len(lines)-1])
	if len(fields) < 2 {
		return 0, fmt.Errorf("timeline history file: %q", text)
	}
	return pgLSN(fields[1])
}

// storedToken is fence.tokens' token of the resource on the primary (0: none, or unread).
func (e *env) storedToken() int64 {
	var t int64
	_ = e.tryAdmin(func(ctx context.Context, c *pgx.Conn) error {
		return c.QueryRow(ctx, `SELECT coalesce((SELECT token FROM fence.tokens WHERE resource = $1), 0)`, resource).Scan(&t)
	})
	return t
}

// awaitRaise waits up to within for a stored token above the leader's at the round's start,
// then up to 5 x TTL more for three ledger rows under it (the new leader's first writes,
// which the cut replication does not carry either: acknowledged, all but the last few).
func (e *env) awaitRaise(within time.Duration) {
	deadline := time.Now().Add(within)
	t := e.storedToken()
	for ; t <= e.token0 && time.Now().Before(deadline); t = e.storedToken() {
		e.supervise()
		time.Sleep(50 * time.Millisecond)
	}
	var rows int
	for deadline = time.Now().Add(5 * e.cfg.TTL); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		e.supervise()
		_ = e.tryAdmin(func(ctx context.Context, c *pgx.Conn) error {
			return c.QueryRow(ctx, `SELECT count(*) FROM ledger WHERE token > $1`, e.token0).Scan(&rows)
		})
		if rows >= 3 {
			break
		}
	}
	e.logf("chaos: failover after a raise: token %d at the round's start, %d stored now, %d ledger rows under a higher one", e.token0, t, rows)
}
