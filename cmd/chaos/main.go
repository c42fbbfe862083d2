// Command chaos is the chaos campaign's replica: a ledger worker that does units of work,
// each of which must happen exactly once, under `fenceproxy lock`.
//
//	fenceproxy lock --resource billing ... -- chaos worker
//
// The campaign itself (servers, proxies, faults, history, checker) is the Go test
// TestCampaign in internal/chaos, which builds this program; `make chaos` runs a long one.
//
// The worker, like the demo's billing program, trusts its lock: it reads the next pending
// unit without FOR UPDATE and the ledger has no unique constraint, so a leader that wakes
// after another took over does a unit twice unless fencing refuses it. One transaction per
// unit:
//
//	BEGIN
//	SELECT id FROM units WHERE NOT done ORDER BY id LIMIT 1
//	INSERT INTO ledger (unit_id, token, attempt, replica) ...
//	(sleep CHAOS_TX_DELAY: the window in which a freeze lands mid-transaction)
//	UPDATE units SET done = true WHERE id = ...
//	COMMIT
//
// Every attempt that inserted a ledger row ends with one JSON line in CHAOS_OUTCOMES
// (history.Outcome: acknowledged, error with its SQLSTATE, or unknown when the COMMIT's
// answer was lost). A connection refused with a SQLSTATE is recorded with the unit "".
//
// It polls for new units when none is pending. SIGTERM (what `fenceproxy lock` sends when
// leadership is lost) finishes the transaction in hand, then exits 0: the graceful shutdown
// by which a deposed leader still commits. A fencing error (class ZF) exits 3; other
// errors reconnect (the URL may name both proxies: the next one is tried).
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/history"
)

const exitFenced = 3

func main() {
	if len(os.Args) != 2 || os.Args[1] != "worker" {
		fmt.Fprintln(os.Stderr, "usage: chaos worker (environment: DATABASE_URL, FENCE_TOKEN, CHAOS_REPLICA, CHAOS_OUTCOMES, CHAOS_TX_DELAY)")
		os.Exit(2)
	}
	w, err := newWorker()
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos worker:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	code := w.run(ctx)
	stop()
	os.Exit(code)
}

type worker struct {
	url      string
	replica  string
	token    int64
	txDelay  time.Duration
	outcomes *os.File
	seq      int
}

func newWorker() (*worker, error) {
	w := &worker{url: os.Getenv("DATABASE_URL"), replica: os.Getenv("CHAOS_REPLICA"), txDelay: 50 * time.Millisecond}
	if w.url == "" {
		return nil, errors.New("DATABASE_URL is empty")
	}
	w.token, _ = strconv.ParseInt(os.Getenv("FENCE_TOKEN"), 10, 64)
	if d := os.Getenv("CHAOS_TX_DELAY"); d != "" {
		var err error
		if w.txDelay, err = time.ParseDuration(d); err != nil {
			return nil, fmt.Errorf("CHAOS_TX_DELAY: %w", err)
		}
	}
	f, err := os.OpenFile(os.Getenv("CHAOS_OUTCOMES"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return nil, fmt.Errorf("CHAOS_OUTCOMES: %w", err)
	}
	w.outcomes = f
	return w, nil
}

// record appends one outcome line: one write call per line, so that lines of a killed
// process are whole or absent.
func (w *worker) record(o history.Outcome) {
	o.At = time.Now().UTC()
	b, _ := json.Marshal(o)
	_, _ = w.outcomes.Write(append(b, '\n'))
}

func (w *worker) run(ctx context.Context) int {
	// Database work is not cancelled by SIGTERM: the transaction in hand is finished. The
	// clock runs on while the process is frozen, so the bound is long: a short one would
	// expire during a freeze and hide the late commit the campaign looks for.
	db := context.WithoutCancel(ctx)
	for ctx.Err() == nil {
		cfg, err := pgx.ParseConfig(w.url)
		if err != nil {
			fmt.Fprintln(os.Stderr, "chaos worker:", err)
			return 2
		}
		// The campaign finds this process's backend by it (to freeze it mid-transaction).
		cfg.RuntimeParams["application_name"] = fmt.Sprintf("chaos-worker-%d", os.Getpid())
		cctx, cancel := context.WithTimeout(db, 20*time.Second)
		conn, err := pgx.ConnectConfig(cctx, cfg)
		cancel()
		if err != nil {
			if code := sqlstate(err); code != "" {
				w.record(history.Outcome{Token: w.token, Result: history.Failed, SQLState: code})
				if strings.HasPrefix(code, "ZF") {
					return exitFenced
				}
			}
			pause(ctx, 100*time.Millisecond)
			continue
		}
		code := w.loop(ctx, db, conn)
		closeCtx, cancel := context.WithTimeout(db, 2*time.Second)
		_ = conn.Close(closeCtx)
		cancel()
		if code >= 0 {
			return code
		}
		pause(ctx, 50*time.Millisecond)
	}
	return 0
}

// loop works on conn until it fails (-1: reconnect) or the worker must exit (its status).
func (w *worker) loop(ctx, db context.Context, conn *pgx.Conn) int {
	for {
		if ctx.Err() != nil {
			return 0
		}
		tctx, cancel := context.WithTimeout(db, 2*time.Minute)
		did, err := w.unit(tctx, conn)
		cancel()
		if err != nil {
			if strings.HasPrefix(sqlstate(err), "ZF") {
				return exitFenced
			}
			fmt.Fprintln(os.Stderr, "chaos worker:", err)
			return -1
		}
		if !did {
			pause(ctx, 50*time.Millisecond)
		}
	}
}

// unit does the first pending unit in one transaction; did is false when none is pending.
func (w *worker) unit(ctx context.Context, conn *pgx.Conn) (did bool, err error) {
	tx, err := conn.Begin(ctx)
	if err != nil {
		return false, err
	}
	var id int64
	err = tx.QueryRow(ctx, `SELECT id FROM units WHERE NOT done ORDER BY id LIMIT 1`).Scan(&id)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, tx.Rollback(ctx)
	}
	if err != nil {
		_ = tx.Rollback(ctx)
		return false, err
	}
	w.seq++
	o := history.Outcome{
		Attempt: fmt.Sprintf("%s-%d-%d", w.replica, os.Getpid(), w.seq),
		Unit:    strconv.FormatInt(id, 10),
		Token:   w.token,
	}
	fail := func(err error) (bool, error) {
		_ = tx.Rollback(ctx)
		o.Result, o.SQLState = history.Failed, sqlstate(err)
		w.record(o)
		return true, err
	}
	if _, err := tx.Exec(ctx, `INSERT INTO ledger (unit_id, token, attempt, replica) VALUES ($1, NULLIF($2, 0), $3, $4)`,
		id, w.token, o.Attempt, w.replica); err != nil {
		return fail(err)
	}
	time.Sleep(w.txDelay) // not interruptible: a freeze here is what the campaign wants
	if _, err := tx.Exec(ctx, `UPDATE units SET done = true WHERE id = $1`, id); err != nil {
		return fail(err)
	}
	err = tx.Commit(ctx)
	var pgErr *pgconn.PgError
	switch {
	case err == nil:
		o.Result = history.Acked
	case errors.As(err, &pgErr):
		o.Result, o.SQLState = history.Failed, pgErr.Code
	default:
		o.Result = history.Unknown // the COMMIT may or may not have committed
	}
	w.record(o)
	return true, err
}

func sqlstate(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

func pause(ctx context.Context, d time.Duration) {
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}
