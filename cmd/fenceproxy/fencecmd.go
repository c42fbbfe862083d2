package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/fence"
)

// FenceCmd groups operator tools on the stored tokens.
type FenceCmd struct {
	Show    FenceShowCmd    `cmd:"" help:"List the highest admitted token of every resource, the live sessions bound to each token, and the PostgreSQL leases."`
	Reset   FenceResetCmd   `cmd:"" help:"Set a resource's stored token, even lower (the way out after a Consul LockIndex regression)."`
	History FenceHistoryCmd `cmd:"" help:"Print the history of admitted tokens (every raise and reset), oldest first."`
}

// FenceHistoryCmd prints fence.history.
type FenceHistoryCmd struct {
	Database string `help:"Database URL (directly to PostgreSQL)." required:""`
	Resource string `help:"Only this resource."`
	Limit    int    `help:"The most recent N entries." default:"50"`
}

// Run prints the last Limit entries of the history, oldest first.
func (f *FenceHistoryCmd) Run(ctx context.Context) error {
	conn, err := pgx.Connect(ctx, f.Database)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	entries, err := fence.ReadHistory(ctx, conn, f.Resource, f.Limit)
	if err != nil {
		return err
	}
	fmt.Printf("%-30s %-24s %12s %12s  %-5s  %-24s  %s\n", "raised_at", "resource", "token", "previous", "how", "holder", "raised by")
	for _, e := range entries {
		prev, how, holder, by := "-", "raise", "-", e.Role+"@local"
		if e.Previous != nil {
			prev = fmt.Sprint(*e.Previous)
		}
		if e.Reset {
			how = "reset"
		}
		if e.Holder != "" {
			holder = e.Holder
		}
		if e.ClientAddr != "" {
			by = e.Role + "@" + e.ClientAddr
		}
		if e.ApplicationName != "" {
			by += " (" + e.ApplicationName + ")"
		}
		fmt.Printf("%-30s %-24s %12d %12s  %-5s  %-24s  %s pid %d\n", e.At.UTC().Format(time.RFC3339Nano), e.Resource, e.Token, prev, how,
			printable(holder), printable(by), e.PID)
	}
	return nil
}

// printable is s for a terminal: as it is when every character is printable, else quoted with
// Go's escapes (a holder or a role name written by someone else must not drive the operator's
// terminal: "\x1b[2J" clears it).
func printable(s string) string {
	if utf8.ValidString(s) && !strings.ContainsFunc(s, func(r rune) bool { return r == '\\' || r == '"' || !unicode.IsGraphic(r) && r != ' ' }) {
		return s
	}
	return strconv.QuoteToGraphic(s)
}

// FenceShowCmd lists fence.tokens.
type FenceShowCmd struct {
	Database string `help:"Database URL (directly to PostgreSQL)." required:""`
}

// Run prints the stored tokens.
func (f *FenceShowCmd) Run(ctx context.Context) error {
	conn, err := pgx.Connect(ctx, f.Database)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, "SELECT resource, token, updated_at FROM fence.tokens ORDER BY resource")
	if err != nil {
		return err
	}
	defer rows.Close()
	fmt.Printf("%-32s %20s  %s\n", "resource", "token", "updated_at")
	for rows.Next() {
		var r string
		var t int64
		var at any
		if err := rows.Scan(&r, &t, &at); err != nil {
			return err
		}
		fmt.Printf("%-32s %20d  %v\n", r, t, at)
	}
	if err := rows.Err(); err != nil {
		return err
	}
	rows.Close()
	// Live bound sessions per token: a raise ends those of lower tokens.
	rows, err = conn.Query(ctx, `SELECT b.resource, b.token, count(*)
		FROM fence.bindings AS b
		JOIN pg_stat_activity AS a ON a.pid = b.pid AND a.backend_start = b.backend_start
		GROUP BY 1, 2 ORDER BY 1, 2`)
	if err != nil {
		return err
	}
	defer rows.Close()
	fmt.Printf("\n%-32s %20s  %s\n", "resource", "bound token", "live sessions")
	for rows.Next() {
		var r string
		var t, n int64
		if err := rows.Scan(&r, &t, &n); err != nil {
			return err
		}
		fmt.Printf("%-32s %20d  %d\n", r, t, n)
	}
	if err := rows.Err(); err != nil {
		return err
	}
	rows.Close()
	// The PostgreSQL leases (fenceproxy lock --store postgres), by the database's clock.
	rows, err = conn.Query(ctx, `SELECT resource, generation, coalesce(holder, '-'),
		CASE WHEN holder IS NULL THEN 'free' WHEN expires_at <= clock_timestamp() THEN 'expired'
		     ELSE 'held, ' || (expires_at - clock_timestamp())::text || ' left' END
		FROM fence.leases ORDER BY resource`)
	if err != nil {
		return err
	}
	defer rows.Close()
	fmt.Printf("\n%-32s %20s  %s\n", "resource", "lease generation", "holder, state")
	for rows.Next() {
		var r, holder, state string
		var g int64
		if err := rows.Scan(&r, &g, &holder, &state); err != nil {
			return err
		}
		fmt.Printf("%-32s %20d  %s, %s\n", r, g, printable(holder), state)
	}
	return rows.Err()
}

// FenceResetCmd calls fence.reset.
type FenceResetCmd struct {
	Database string `help:"Database URL of a role allowed to execute fence.reset (directly to PostgreSQL)." required:""`
	Resource string `help:"Resource name." required:""`
	Token    int64  `help:"The token to store, 1 or more (normally the lock's current LockIndex in Consul)." required:""`
	Force    bool   `help:"Store a token below the resource's PostgreSQL lease generation (holders of the generations in between may then bind again), or below the token of live bound sessions (they go on)."`
}

// Run resets the token.
func (f *FenceResetCmd) Run(ctx context.Context, log *zap.Logger) error {
	if f.Token <= 0 {
		return fmt.Errorf("fence reset --token %d: a fencing token is a positive integer (1 or more)", f.Token)
	}
	conn, err := pgx.Connect(ctx, f.Database)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	// A resource led by the PostgreSQL lease has its sequence in the lease row: a token
	// stored below its generation would let the holders of the generations in between bind
	// again next to the current one (a review did this and both committed).
	var generation int64
	err = conn.QueryRow(ctx, "SELECT coalesce((SELECT generation FROM fence.leases WHERE resource = $1), 0)", f.Resource).Scan(&generation)
	if pe := (*pgconn.PgError)(nil); err != nil && !(errors.As(err, &pe) && pe.Code == "42P01") { // no fence.leases before schema version 5
		return fmt.Errorf("read the lease of %q: %w", f.Resource, err)
	}
	if f.Token < generation && !f.Force {
		return fmt.Errorf("fence reset --token %d: resource %q is led by the PostgreSQL lease, at generation %d; a lower token would let the holders of generations %d to %d bind again (--force to do it anyway)",
			f.Token, f.Resource, generation, f.Token, generation-1)
	}
	// Live sessions bound to a higher token go on after a lowering reset (nothing ends them),
	// next to the holders of the lower tokens it admits again: a review had both commit.
	var live, highest int64
	err = conn.QueryRow(ctx, `SELECT count(*), coalesce(max(b.token), 0) FROM fence.bindings AS b
		JOIN pg_stat_get_activity(NULL) AS a ON a.pid = b.pid AND a.backend_start = b.backend_start
		WHERE b.resource = $1 AND b.token > $2`, f.Resource, f.Token).Scan(&live, &highest)
	if err != nil {
		return fmt.Errorf("read the sessions bound to %q: %w", f.Resource, err)
	}
	if live > 0 && !f.Force {
		return fmt.Errorf("fence reset --token %d: %d live session(s) of resource %q are bound to tokens above it (up to %d) and would go on writing next to the holders of the lower tokens the reset admits again; stop their holders first (fenceproxy fence show lists them), or --force",
			f.Token, live, f.Resource, highest)
	}
	if _, err := conn.Exec(ctx, "SELECT fence.reset($1, $2)", f.Resource, f.Token); err != nil {
		return fmt.Errorf("fence.reset: %w", err)
	}
	log.Warn("fencing token reset", zap.String("resource", f.Resource), zap.Int64("token", f.Token))
	fmt.Printf("resource %q: stored token set to %d; proxies whose --control-database is this database follow it at once, except those that validate it with etcd or ZooKeeper (a regression they saw holds until they restart); restart the others (they refuse tokens below the highest they saw)\n", f.Resource, f.Token)
	return nil
}
