package testenv

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/faulthop"
)

// Standby is a streaming standby of a Postgres that StartPostgres (or LaunchPostgres)
// started: its data folder is a base backup of the primary (pg_basebackup -R), it streams
// the primary's WAL through Relay, a faulthop the test can cut, and it can be promoted.
// It is a Postgres itself: Exec, URL, Kill, Start... work on it as on the primary.
type Standby struct {
	*Postgres
	// Name is the standby's application_name, as the primary's pg_stat_replication and
	// synchronous_standby_names know it, and the name of its physical replication slot on
	// the primary.
	Name string
	// Primary is the cluster it was made from.
	Primary *Postgres
	// Relay carries the standby's replication connection to the primary.
	Relay *faulthop.Hop
}

type standbySource struct {
	primary *Postgres
	name    string
	relay   *faulthop.Hop
}

// StartStandby makes a streaming standby of primary named name (its application_name and
// replication slot), starts it and waits until it accepts (read-only) connections.
// opts add settings as for StartPostgres (WithConf); the auth method is the primary's (the
// base backup copies pg_hba.conf). The primary must be running. tb.Cleanup stops the
// standby, closes the relay and removes the folder.
//
// The standby's synchronous_standby_names is emptied: a standby promoted with the setting
// its base backup copied from the primary would wait for standbys it does not have at every
// commit (an operator clears it; Patroni does).
//
// To make the standby synchronous, start the primary WithConf("synchronous_standby_names",
// name) and WithConf("synchronous_commit", "on") (testenv's default is off).
func StartStandby(tb testing.TB, primary *Postgres, name string, opts ...PGOption) *Standby {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	s, err := LaunchStandby(ctx, primary, name, opts...)
	if err != nil {
		tb.Fatalf("testenv: %v", err)
	}
	tb.Cleanup(func() {
		err := s.Shutdown()
		if tb.Failed() {
			tb.Logf("testenv: standby %s log tail (%s):\n%s", s.Name, s.LogFile, s.logTail(0))
		}
		if err := errors.Join(err, s.Close()); err != nil {
			tb.Errorf("testenv: %v", err)
		}
	})
	tb.Logf("testenv: standby %s of %s:%d on %s:%d, replication through %s, folder %s",
		name, primary.Host, primary.Port, s.Host, s.Port, s.Relay.Addr, s.base)
	return s
}

// LaunchStandby is StartStandby for programs that are not tests; the caller must Close it.
func LaunchStandby(ctx context.Context, primary *Postgres, name string, opts ...PGOption) (*Standby, error) {
	if !validStandbyName(name) {
		return nil, fmt.Errorf("standby name %q: use lower-case letters, digits and _ (it names a replication slot)", name)
	}
	relay, err := faulthop.Start("", fmt.Sprintf("%s:%d", primary.Host, primary.Port))
	if err != nil {
		return nil, fmt.Errorf("standby %s: replication relay: %w", name, err)
	}
	src := &standbySource{primary: primary, name: name, relay: relay}
	p, err := LaunchPostgres(ctx, append(opts, func(o *pgOptions) { o.standbyOf = src })...)
	if err != nil {
		closeRelay(relay)
		return nil, fmt.Errorf("standby %s: %w", name, err)
	}
	return &Standby{Postgres: p, Name: name, Primary: primary, Relay: relay}, nil
}

func validStandbyName(name string) bool {
	if name == "" || len(name) > 63 {
		return false
	}
	for _, c := range name {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_') {
			return false
		}
	}
	return true
}

func closeRelay(h *faulthop.Hop) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_ = h.Close(ctx)
}

// Close stops the standby, removes its folder and closes its relay (its replication slot
// stays on the primary, which the primary's own Close removes with everything else).
func (s *Standby) Close() error {
	err := s.Postgres.Close()
	closeRelay(s.Relay)
	return err
}

// prepareStandby fills p.DataDir with a base backup of src.primary taken through the relay,
// with standby.signal, a primary_conninfo through the relay, and a replication slot.
func (p *Postgres) prepareStandby(src *standbySource) error {
	conninfo := fmt.Sprintf("host=127.0.0.1 port=%d user=%s password=%s application_name=%s",
		src.relay.Port(), AdminUser, AdminPassword, src.name)
	bb := p.command(p.Bin("pg_basebackup"), "-D", p.DataDir, "-d", conninfo, "-R", "-X", "stream",
		"-C", "-S", src.name, "-c", "fast", "--no-sync")
	if out, err := bb.CombinedOutput(); err != nil {
		return fmt.Errorf("pg_basebackup: %w\n%s", err, out)
	}
	// postgresql.auto.conf is read last: pg_basebackup -R wrote its primary_conninfo there.
	// Say it again, whole, as the last line (the slot: -R names it in primary_slot_name).
	auto := filepath.Join(p.DataDir, "postgresql.auto.conf")
	f, err := os.OpenFile(auto, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(f, "\n# testenv standby\nprimary_conninfo = %s\nprimary_slot_name = %s\n", quoteLiteral(conninfo), quoteLiteral(src.name))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	// postgresql.conf is the primary's copy: the socket folder must be this cluster's.
	conf := [][2]string{
		{"unix_socket_directories", p.SocketDir},
		{"synchronous_standby_names", ""},
		{"hot_standby", "on"},
		{"wal_receiver_status_interval", "1s"},
		{"wal_retrieve_retry_interval", "200ms"}, // reconnect soon after HealReplication
	}
	return p.appendConf(append(conf, p.opts.conf...))
}

// Promote makes the standby a primary (`pg_ctl promote`) and waits until it accepts writes.
func (s *Standby) Promote(tb testing.TB) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	if err := s.PromoteContext(ctx); err != nil {
		tb.Fatalf("testenv: %v", err)
	}
}

// PromoteContext is Promote returning an error.
func (s *Standby) PromoteContext(ctx context.Context) error {
	cmd := s.command(s.Bin("pg_ctl"), "promote", "-D", s.DataDir, "-w", "-t", strconv.Itoa(int(startTimeout/time.Second)))
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("promote standby %s: %w\n%s\nserver log:\n%s", s.Name, err, out, s.LogTail())
	}
	for {
		var recovering bool
		err := s.queryRow(ctx, "SELECT pg_is_in_recovery()", nil, &recovering)
		if err == nil && !recovering {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("standby %s still in recovery after pg_ctl promote: %v", s.Name, errOr(err, "pg_is_in_recovery() is true"))
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func errOr(err error, otherwise string) string {
	if err != nil {
		return err.Error()
	}
	return otherwise
}

// CutReplication cuts the standby's replication connection and holds every new one (the
// standby keeps serving reads, and streams nothing) until HealReplication.
func (s *Standby) CutReplication() {
	s.Relay.Stall(24 * time.Hour)
	s.Relay.Cut()
}

// HealReplication lets replication through again (the standby reconnects within a second:
// WaitFlushed the primary's CurrentLSN to know when it has caught up).
func (s *Standby) HealReplication() { s.Relay.Heal() }

// CurrentLSN is the primary's WAL insert position (pg_current_wal_insert_lsn()), as text.
func (p *Postgres) CurrentLSN(tb testing.TB) string {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), execTimeout)
	defer cancel()
	var lsn string
	if err := p.queryRow(ctx, "SELECT pg_current_wal_insert_lsn()::text", nil, &lsn); err != nil {
		tb.Fatalf("testenv: %v", err)
	}
	return lsn
}

// WaitFlushed waits (at most timeout) until the primary's pg_stat_replication says the
// standby has flushed WAL up to lsn.
func (s *Standby) WaitFlushed(tb testing.TB, lsn string, timeout time.Duration) {
	tb.Helper()
	q := "SELECT coalesce(bool_or(flush_lsn >= $2::pg_lsn), false) FROM pg_stat_replication WHERE application_name = $1"
	if err := waitTrue(s.Primary, q, []any{s.Name, lsn}, timeout); err != nil {
		tb.Fatalf("testenv: standby %s has not flushed %s within %v: %v", s.Name, lsn, timeout, err)
	}
}

// WaitReplayed waits (at most timeout) until the standby has replayed WAL up to lsn.
func (s *Standby) WaitReplayed(tb testing.TB, lsn string, timeout time.Duration) {
	tb.Helper()
	q := "SELECT coalesce(pg_last_wal_replay_lsn() >= $1::pg_lsn, false)"
	if err := waitTrue(s.Postgres, q, []any{lsn}, timeout); err != nil {
		tb.Fatalf("testenv: standby %s has not replayed %s within %v: %v", s.Name, lsn, timeout, err)
	}
}

// waitTrue polls a one-boolean query on p until it is true.
func waitTrue(p *Postgres, q string, args []any, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var lastErr error
	for {
		var ok bool
		lastErr = p.queryRow(ctx, q, args, &ok)
		if lastErr == nil && ok {
			return nil
		}
		select {
		case <-ctx.Done():
			if lastErr == nil {
				lastErr = errors.New("not yet")
			}
			return lastErr
		case <-time.After(5 * time.Millisecond):
		}
	}
}

func (p *Postgres) queryRow(ctx context.Context, q string, args []any, dest ...any) error {
	conn, err := pgx.Connect(ctx, p.AdminURL())
	if err != nil {
		return fmt.Errorf("connect as %s: %w", AdminUser, err)
	}
	defer conn.Close(context.Background())
	return conn.QueryRow(ctx, q, args...).Scan(dest...)
}
