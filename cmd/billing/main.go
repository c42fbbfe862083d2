// Command billing is the demo's billing scheduler: an ordinary application that
// charges every pending customer once, one transaction per customer.
//
// It is deliberately naive in the way real schedulers are: it trusts that it is the
// only writer because it holds a lock (it runs under `fenceproxy lock`), so it reads
// the next pending customer without FOR UPDATE or SKIP LOCKED, and the charges table
// has no unique constraint on the customer. A leader that freezes in the middle of a
// charge and wakes up after another replica took over would charge that customer a
// second time; with DATABASE_URL pointing at fenceproxy and the fencing token in it,
// its commit is refused instead.
//
// One transaction per customer:
//
//	BEGIN
//	SELECT id, amount_cents FROM customers WHERE NOT charged ORDER BY id LIMIT 1
//	INSERT INTO charges (customer_id, amount_cents, replica, token) ...
//	(sleep --tx-delay: the window in which a freeze lands mid-transaction)
//	UPDATE customers SET charged = true WHERE id = ...
//	COMMIT
//
// It prints one line per event on stdout, logfmt (key=value, values with spaces
// quoted), for the demo's timeline:
//
//	time=2025-01-02T03:04:05.123456Z replica=billing-1 token=7 event=charged customer=3 charge=3 amount_cents=1200
//
// Events: started, charging (charge inserted, not committed), charged (committed),
// rejected (a fencing error, SQLSTATE class ZF), error (anything else), stopped
// (SIGTERM or SIGINT), finished (nothing pending).
//
// Exit status: 0 when finished or stopped by a signal, 3 when fenced off (a fencing
// rejection: this process is not the leader any more and must stop writing), 1 on
// any other error.
//
// A stop signal is handled the way most services handle it: the transaction in hand
// is finished, then the program exits without starting another. That is the usual
// graceful shutdown, and also exactly how a deposed leader ends up writing after it
// lost its lock: `fenceproxy lock` sends SIGTERM when leadership is lost, and the
// charge in progress still tries to commit.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/alecthomas/kong"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Exit statuses.
const (
	exitOK     = 0
	exitError  = 1
	exitUsage  = 2
	exitFenced = 3
)

type config struct {
	DatabaseURL string        `help:"PostgreSQL URL (through fenceproxy, with the fencing token: fenceproxy lock sets it)." env:"DATABASE_URL" required:""`
	Replica     string        `help:"Name of this replica in the events (default: the host name)." env:"BILLING_REPLICA"`
	Token       string        `help:"Fencing token, only to label events and charges (fenceproxy lock sets FENCE_TOKEN)." env:"FENCE_TOKEN"`
	TxDelay     time.Duration `help:"Pause inside each transaction, between inserting the charge and marking the customer charged." env:"BILLING_TX_DELAY" default:"300ms"`
	StepDelay   time.Duration `help:"Pause between two charges." env:"BILLING_STEP_DELAY" default:"200ms"`
	// The clock runs on while a process is frozen, so a short timeout would expire
	// during a freeze and hide the late write this demo is about.
	TxTimeout time.Duration `help:"Time allowed for connecting and for each charge's transaction; it keeps running while the process is frozen." env:"BILLING_TX_TIMEOUT" default:"5m"`
}

func main() {
	var c config
	parser, err := kong.New(&c,
		kong.Name("billing"),
		kong.Description("The fenceproxy demo's billing scheduler: charges every pending customer, one transaction each."),
		kong.UsageOnError(),
	)
	if err == nil {
		_, err = parser.Parse(os.Args[1:])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "billing:", err)
		os.Exit(exitUsage)
	}
	if c.Replica == "" {
		c.Replica, _ = os.Hostname()
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	code := run(ctx, c, &events{w: os.Stdout, replica: c.Replica, token: c.Token})
	stop()
	os.Exit(code)
}

// run charges customers until none is pending (exitOK), ctx ends (exitOK, after
// the transaction in hand), or an error.
func run(ctx context.Context, c config, ev *events) int {
	token, _ := strconv.ParseInt(c.Token, 10, 64) // labels only: 0 stored as NULL
	// Database work is not cancelled by the stop signal: the charge in hand is
	// finished first (see the package comment). TxTimeout bounds it instead.
	db := context.WithoutCancel(ctx)

	connectCtx, cancel := context.WithTimeout(db, c.TxTimeout)
	conn, err := pgx.Connect(connectCtx, c.DatabaseURL)
	cancel()
	if err != nil {
		return ev.failure(err, "connect")
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(db, 5*time.Second)
		defer cancel()
		_ = conn.Close(closeCtx)
	}()
	ev.emit("started", "pid", strconv.Itoa(os.Getpid()), "server", conn.PgConn().Conn().RemoteAddr().String())

	charged := 0
	for {
		if ctx.Err() != nil {
			ev.emit("stopped", "reason", "signal", "charged", strconv.Itoa(charged))
			return exitOK
		}
		txCtx, cancel := context.WithTimeout(db, c.TxTimeout)
		done, err := chargeNext(txCtx, conn, c, token, ev)
		cancel()
		if err != nil {
			return ev.failure(err, "charge")
		}
		if done {
			ev.emit("finished", "charged", strconv.Itoa(charged))
			return exitOK
		}
		charged++
		select {
		case <-ctx.Done():
		case <-time.After(c.StepDelay):
		}
	}
}

// chargeNext charges the first pending customer in one transaction. done reports
// that no customer was pending.
func chargeNext(ctx context.Context, conn *pgx.Conn, c config, token int64, ev *events) (done bool, err error) {
	tx, err := conn.Begin(ctx)
	if err != nil {
		return false, fmt.Errorf("begin: %w", err)
	}
	defer func() {
		if err != nil || done {
			// After a failed COMMIT the transaction is already over; Rollback then
			// does nothing. Its own error adds nothing to err.
			_ = tx.Rollback(ctx)
		}
	}()

	var customer, amount int64
	err = tx.QueryRow(ctx, `SELECT id, amount_cents FROM customers WHERE NOT charged ORDER BY id LIMIT 1`).Scan(&customer, &amount)
	if errors.Is(err, pgx.ErrNoRows) {
		return true, nil
	}
	if err != nil {
		return false, fmt.Errorf("read pending customer: %w", err)
	}
	cust := strconv.FormatInt(customer, 10)

	var charge int64
	err = tx.QueryRow(ctx,
		`INSERT INTO charges (customer_id, amount_cents, replica, token) VALUES ($1, $2, $3, NULLIF($4, 0)) RETURNING id`,
		customer, amount, c.Replica, token).Scan(&charge)
	if err != nil {
		return false, &chargeError{customer: cust, step: "insert charge", err: err}
	}
	ev.emit("charging", "customer", cust, "charge", strconv.FormatInt(charge, 10))

	// Not interruptible by the stop signal: the charge in hand is finished.
	time.Sleep(c.TxDelay)

	if _, err = tx.Exec(ctx, `UPDATE customers SET charged = true WHERE id = $1`, customer); err != nil {
		return false, &chargeError{customer: cust, step: "mark customer charged", err: err}
	}
	if err = tx.Commit(ctx); err != nil {
		return false, &chargeError{customer: cust, step: "commit", err: err}
	}
	ev.emit("charged", "customer", cust, "charge", strconv.FormatInt(charge, 10), "amount_cents", strconv.FormatInt(amount, 10))
	return false, nil
}

// chargeError names the customer and the step a charge failed at.
type chargeError struct {
	customer, step string
	err            error
}

func (e *chargeError) Error() string {
	return fmt.Sprintf("customer %s: %s: %v", e.customer, e.step, e.err)
}
func (e *chargeError) Unwrap() error { return e.err }

// events writes the event lines. Safe for concurrent use.
type events struct {
	mu      sync.Mutex
	w       io.Writer
	replica string
	token   string
}

// emit writes one line: time, replica, token, event, then kv pairs.
func (e *events) emit(event string, kv ...string) {
	var b strings.Builder
	token := e.token
	if token == "" {
		token = "none"
	}
	b.WriteString("time=" + time.Now().UTC().Format("2006-01-02T15:04:05.000000Z"))
	b.WriteString(" replica=" + value(e.replica) + " token=" + value(token) + " event=" + event)
	for i := 0; i+1 < len(kv); i += 2 {
		b.WriteString(" " + kv[i] + "=" + value(kv[i+1]))
	}
	b.WriteByte('\n')
	e.mu.Lock()
	defer e.mu.Unlock()
	_, _ = io.WriteString(e.w, b.String()) // nowhere better to report it
}

// failure reports err as a rejected (fencing, SQLSTATE class ZF) or error event
// and returns the exit status.
func (e *events) failure(err error, step string) int {
	kv := []string{"step", step}
	var ce *chargeError
	if errors.As(err, &ce) {
		kv = []string{"step", ce.step, "customer", ce.customer}
		err = ce.err
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		kv = append(kv, "sqlstate", pgErr.Code, "severity", pgErr.Severity, "message", pgErr.Message)
		if strings.HasPrefix(pgErr.Code, "ZF") {
			e.emit("rejected", kv...)
			return exitFenced
		}
	} else {
		kv = append(kv, "message", err.Error())
	}
	e.emit("error", kv...)
	return exitError
}

// value quotes v when it is empty or holds spaces, quotes, '=' or control characters.
func value(v string) string {
	if v != "" && !strings.ContainsAny(v, " \t\r\n\"=\\") && strconv.CanBackquote(v) {
		return v
	}
	return strconv.Quote(v)
}
