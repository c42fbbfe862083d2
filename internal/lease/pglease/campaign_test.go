package pglease_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fenceproxy/fenceproxy/internal/lease"
	"github.com/fenceproxy/fenceproxy/internal/lease/leasetest"
	"github.com/fenceproxy/fenceproxy/internal/lease/pglease"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// leaseDB is a test cluster with the fence schema (version 5) in database postgres.

// TestMain doubles as the holder process of the freeze tests (leasetest.StartHolder).
func TestMain(m *testing.M) {
	leasetest.Main(m, map[string]func() int{
		"LEASE_TEST_PG_HOLDER": runPGHolder,
	})
}

// leaseRow is resource's row of fence.leases.
type leaseRow struct {
	holder     *string
	generation int64
	live       bool // held and not expired by the database's clock
	expiresAt  *time.Time
}

func readLease(t *testing.T, conn *pgx.Conn, resource string) leaseRow {
	t.Helper()
	var r leaseRow
	err := conn.QueryRow(context.Background(),
		"SELECT holder, generation, coalesce(expires_at > clock_timestamp(), false), expires_at FROM fence.leases WHERE resource = $1",
		resource).Scan(&r.holder, &r.generation, &r.live, &r.expiresAt)
	if err != nil {
		t.Fatalf("read lease %s: %v", resource, err)
	}
	return r
}

func storedToken(t *testing.T, conn *pgx.Conn, resource string) int64 {
	t.Helper()
	var tok int64
	if err := conn.QueryRow(context.Background(), "SELECT token FROM fence.tokens WHERE resource = $1", resource).Scan(&tok); err != nil {
		t.Fatalf("stored token of %s: %v", resource, err)
	}
	return tok
}

func TestPostgresLease(t *testing.T) {
	t.Parallel()
	_, url := leasetest.LeaseDB(t)
	conn := testenv.Connect(t, url)
	var connMu sync.Mutex // one pgx.Conn, parallel subtests
	row := func(t *testing.T, resource string) leaseRow {
		connMu.Lock()
		defer connMu.Unlock()
		return readLease(t, conn, resource)
	}
	stored := func(t *testing.T, resource string) int64 {
		connMu.Lock()
		defer connMu.Unlock()
		return storedToken(t, conn, resource)
	}
	store := func(holder string, ttl time.Duration) *pglease.Store {
		return &pglease.Store{URL: url, TTL: ttl, Holder: holder}
	}

	t.Run("acquire, renew past the TTL, release", func(t *testing.T) {
		t.Parallel()
		s := store("a", time.Second)
		l := leasetest.Campaign(t, s, "renew")
		if l.Token() != 1 || l.Store() != lease.StorePostgres || l.Key() != "fence.leases/renew" || l.Holder() != "a" {
			t.Fatalf("lease: token %d store %q key %q holder %q; want 1, postgres, fence.leases/renew, a",
				l.Token(), l.Store(), l.Key(), l.Holder())
		}
		if got := stored(t, "renew"); got != 1 {
			t.Errorf("stored token %d after the acquisition, want 1 (admitted with it)", got)
		}
		// Three TTLs: only renewals keep it.
		select {
		case <-l.Done():
			t.Fatalf("lease lost while renewed: %v", l.Err())
		case <-time.After(3 * time.Second):
		}
		if r := row(t, "renew"); !r.live || r.holder == nil || *r.holder != "a" || r.generation != 1 {
			t.Fatalf("lease row after 3 TTLs: %+v, want held by a, generation 1, unexpired", r)
		}
		if err := l.Release(context.Background()); err != nil {
			t.Fatalf("Release: %v", err)
		}
		if !errors.Is(l.Err(), lease.ErrReleased) {
			t.Errorf("Err after Release = %v, want ErrReleased", l.Err())
		}
		leasetest.WaitClosed(t, "Done after Release", l.Done(), time.Second)
		if r := row(t, "renew"); r.live || r.holder != nil || r.generation != 1 {
			t.Errorf("lease row after release: %+v, want free with generation 1", r)
		}
	})

	t.Run("each takeover increments the generation once", func(t *testing.T) {
		t.Parallel()
		a, b := store("a", 5*time.Second), store("b", 5*time.Second)
		var tokens []int64
		for _, s := range []*pglease.Store{a, b, a, a, b} {
			l := leasetest.Campaign(t, s, "takeover")
			tokens = append(tokens, l.Token())
			if got := stored(t, "takeover"); got != l.Token() {
				t.Errorf("stored token %d, want the new generation %d", got, l.Token())
			}
			if err := l.Release(context.Background()); err != nil {
				t.Fatal(err)
			}
		}
		if want := []int64{1, 2, 3, 4, 5}; !slices.Equal(tokens, want) {
			t.Errorf("generations %v, want %v", tokens, want)
		}
	})

	t.Run("expiry by the database's clock", func(t *testing.T) {
		t.Parallel()
		// A holder that never renews: a plain acquisition with a 1 s TTL.
		var expires time.Time
		connMu.Lock()
		err := conn.QueryRow(context.Background(),
			"SELECT expires_at FROM fence.lease_acquire('expiry', 'silent', '1 second')").Scan(&expires)
		connMu.Unlock()
		if err != nil {
			t.Fatal(err)
		}
		started := time.Now()
		l := leasetest.Campaign(t, store("b", 2*time.Second), "expiry")
		t.Logf("contender acquired %v after the silent holder's 1 s lease started", time.Since(started).Round(time.Millisecond))
		if l.Token() != 2 {
			t.Errorf("contender's generation %d, want 2", l.Token())
		}
		var acquiredAt time.Time
		connMu.Lock()
		err = conn.QueryRow(context.Background(), "SELECT acquired_at FROM fence.leases WHERE resource = 'expiry'").Scan(&acquiredAt)
		connMu.Unlock()
		if err != nil {
			t.Fatal(err)
		}
		if acquiredAt.Before(expires) {
			t.Errorf("taken over at %v, before the lease's expiry %v by the database's clock", acquiredAt, expires)
		}
		var renewed bool
		connMu.Lock()
		err = conn.QueryRow(context.Background(), "SELECT fence.lease_renew('expiry', 'silent', 1, '1 second')").Scan(&renewed)
		connMu.Unlock()
		if err != nil || renewed {
			t.Errorf("the expired holder's renewal: %v, %v; want refused", renewed, err)
		}
	})

	t.Run("a refused renewal ends the lease", func(t *testing.T) {
		t.Parallel()
		l := leasetest.Campaign(t, store("a", 3*time.Second), "refused")
		// Another process takes over (a holder name is no secret: see migration 5).
		connMu.Lock()
		_, err := conn.Exec(context.Background(), "SELECT fence.lease_release('refused', 'a', 1)")
		if err == nil {
			_, err = conn.Exec(context.Background(), "SELECT * FROM fence.lease_acquire('refused', 'b', '10 seconds')")
		}
		connMu.Unlock()
		if err != nil {
			t.Fatal(err)
		}
		leasetest.WaitClosed(t, "Done after a takeover", l.Done(), 2*time.Second) // the next renewal is due within TTL/3
		if err := l.Err(); !errors.Is(err, lease.ErrLockLost) || !strings.Contains(err.Error(), "taken over by b with generation 2") {
			t.Errorf("Err = %v, want ErrLockLost saying who took over", err)
		}
	})

	t.Run("contenders: one holder at a time, one generation each", func(t *testing.T) {
		t.Parallel()
		const n = 6
		var holding, maxHolding atomic.Int32
		tokens := make([]int64, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer cancel()
				l, err := store("c"+strconv.Itoa(i), 5*time.Second).Campaign(ctx, "contended")
				if err != nil {
					t.Errorf("contender %d: %v", i, err)
					return
				}
				h := holding.Add(1)
				for {
					m := maxHolding.Load()
					if h <= m || maxHolding.CompareAndSwap(m, h) {
						break
					}
				}
				tokens[i] = l.Token()
				time.Sleep(50 * time.Millisecond)
				holding.Add(-1)
				if err := l.Release(context.Background()); err != nil {
					t.Errorf("contender %d: release: %v", i, err)
				}
			})
		}
		wg.Wait()
		if m := maxHolding.Load(); m != 1 {
			t.Errorf("%d contenders held the lease at once", m)
		}
		slices.Sort(tokens)
		if want := []int64{1, 2, 3, 4, 5, 6}; !slices.Equal(tokens, want) {
			t.Errorf("generations %v, want %v: one each", tokens, want)
		}
	})

	t.Run("arguments that retrying cannot fix are returned", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithTimeout(context.Background(), leasetest.WaitTimeout)
		defer cancel()
		if _, err := store("a", time.Second).Campaign(ctx, "Bad"); !errors.Is(err, lease.ErrRefused) || !strings.Contains(err.Error(), "ZF004") {
			t.Errorf("Campaign of a malformed resource: %v, want ErrRefused with ZF004", err)
		}
		if _, err := store("a", 500*time.Millisecond).Campaign(ctx, "short"); !errors.Is(err, lease.ErrRefused) {
			t.Errorf("Campaign with a TTL below 1 s: %v, want ErrRefused", err)
		}
		// (L9) A resource whose stored token is the largest bigint has no higher generation:
		// a review's client stored it, and the store retried a bare "bigint out of range".
		connMu.Lock()
		_, err := conn.Exec(ctx, "SELECT fence.reset('maxed', 9223372036854775807)")
		connMu.Unlock()
		if err != nil {
			t.Fatal(err)
		}
		// ... and with the database's HINT, what to do (a newcomer had to read it in psql).
		if _, err := store("b", time.Second).Campaign(ctx, "maxed"); !errors.Is(err, lease.ErrRefused) || !strings.Contains(err.Error(), "no higher generation") ||
			!strings.Contains(err.Error(), "fenceproxy fence reset --force") {
			t.Errorf("Campaign at the largest token: %v, want ErrRefused saying no higher generation exists, and the hint", err)
		}
	})

	t.Run("a URL through fenceproxy is refused at once", func(t *testing.T) {
		t.Parallel()
		// The lease is what gives a token, so a session through the proxy has none to
		// show (ZF003): a review saw the store retry that forever.
		pg, _ := leasetest.LeaseDB(t)
		px := testenv.StartProxy(t, pg, proxy.Config{Resources: []string{"billing"}})
		ctx, cancel := context.WithTimeout(context.Background(), leasetest.WaitTimeout)
		defer cancel()
		s := &pglease.Store{URL: px.URL("postgres", "postgres"), TTL: time.Second, Holder: "a"}
		if _, err := s.Campaign(ctx, "billing"); !errors.Is(err, lease.ErrRefused) || !strings.Contains(err.Error(), "directly") {
			t.Errorf("Campaign through the proxy: %v, want ErrRefused saying to reach PostgreSQL directly", err)
		}
	})
}

// TestPostgresLeaseRace calls fence.lease_acquire from several connections at the same
// instant on a free lease, round after round: exactly one wins each round, and the
// generations of the winners are 1, 2, 3...
func TestPostgresLeaseRace(t *testing.T) {
	t.Parallel()
	_, url := leasetest.LeaseDB(t)
	const contenders, rounds = 8, 25
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = contenders
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	for round := 1; round <= rounds; round++ {
		var wg sync.WaitGroup
		start := make(chan struct{})
		type answer struct {
			acquired   bool
			generation int64
			err        error
		}
		answers := make([]answer, contenders)
		for i := range contenders {
			wg.Go(func() {
				<-start
				a := &answers[i]
				a.err = pool.QueryRow(context.Background(), "SELECT acquired, generation FROM fence.lease_acquire('race', $1, '10 seconds')",
					fmt.Sprintf("h%d", i)).Scan(&a.acquired, &a.generation)
			})
		}
		close(start)
		wg.Wait()
		winner := -1
		for i, a := range answers {
			if a.err != nil {
				t.Fatalf("round %d, contender %d: %v", round, i, a.err)
			}
			if a.acquired {
				if winner >= 0 {
					t.Fatalf("round %d: contenders %d and %d both acquired (generations %d, %d)",
						round, winner, i, answers[winner].generation, a.generation)
				}
				winner = i
			}
		}
		if winner < 0 {
			t.Fatalf("round %d: nobody acquired a free lease", round)
		}
		if g := answers[winner].generation; g != int64(round) {
			t.Fatalf("round %d: the winner got generation %d, want %d", round, g, round)
		}
		if _, err := pool.Exec(context.Background(), "SELECT fence.lease_release('race', $1, $2)",
			fmt.Sprintf("h%d", winner), answers[winner].generation); err != nil {
			t.Fatal(err)
		}
	}
}

// TestPostgresLeaseDatabaseDown: a holder that cannot reach the database counts its lease
// lost one TTL after its last successful renewal, without the database's word; once the
// database is back, Release frees the row.
func TestPostgresLeaseDatabaseDown(t *testing.T) {
	t.Parallel()
	pg, url := leasetest.LeaseDB(t)
	l := leasetest.Campaign(t, &pglease.Store{URL: url, TTL: 2 * time.Second, Holder: "a"}, "down")
	pg.Stop(t)
	stopped := time.Now()
	leasetest.WaitClosed(t, "Done with the database down", l.Done(), 4*time.Second)
	t.Logf("lease lost %v after the database stopped (TTL 2s)", time.Since(stopped).Round(time.Millisecond))
	if time.Since(stopped) > 2*time.Second+500*time.Millisecond {
		t.Errorf("lost after %v: more than the TTL after the last renewal", time.Since(stopped))
	}
	if err := l.Err(); !errors.Is(err, lease.ErrLockLost) || !strings.Contains(err.Error(), "not renewed within its TTL") {
		t.Errorf("Err = %v, want ErrLockLost: not renewed within its TTL", err)
	}
	// Once the database is back, Release frees the row the holder lost track of.
	pg.Start(t)
	if err := l.Release(context.Background()); err != nil {
		t.Fatalf("Release: %v", err)
	}
	if r := readLease(t, testenv.Connect(t, url), "down"); r.holder != nil {
		t.Errorf("lease row after Release: held by %q, want free", *r.holder)
	}
	if !errors.Is(l.Err(), lease.ErrLockLost) {
		t.Errorf("Err after Release = %v, want still ErrLockLost", l.Err())
	}
}

// runPGHolder is the frozen holder of TestPostgresLeaseFrozenHolder, in a process of its
// own: it wins the lease of $LEASE_TEST_RESOURCE with a 2 s TTL, prints "token N", opens a
// transaction through the proxy with its token and inserts a row, prints "ready", and
// commits when it reads a line on stdin, printing "commit ok" or "commit SQLSTATE". It
// prints "lost ERROR" when the lease is lost.
func runPGHolder() int {
	ctx := context.Background()
	resource := os.Getenv("LEASE_TEST_RESOURCE")
	s := &pglease.Store{URL: os.Getenv("LEASE_TEST_PG"), TTL: 2 * time.Second, Holder: "frozen"}
	l, err := s.Campaign(ctx, resource)
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	fmt.Println("token", l.Token())
	go func() {
		<-l.Done()
		fmt.Println("lost", l.Err())
	}()
	url, err := lease.FencedURL(os.Getenv("LEASE_TEST_PROXY"), resource, l.Token(), "")
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	tx, err := conn.Begin(ctx)
	if err == nil {
		_, err = tx.Exec(ctx, "INSERT INTO writes (token) VALUES ($1)", l.Token())
	}
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	fmt.Println("ready")
	bufio.NewScanner(os.Stdin).Scan()
	if err := tx.Commit(ctx); err != nil {
		var pe *pgconn.PgError
		if errors.As(err, &pe) {
			fmt.Println("commit", pe.Code, pe.Message)
		} else {
			fmt.Println("commit error", err)
		}
		return 0
	}
	fmt.Println("commit ok")
	return 0
}

// TestPostgresLeaseFrozenHolder freezes a holder (a process of its own, SIGSTOP) in the
// middle of a transaction through the proxy: its lease expires by the database's clock,
// another process takes over with the next generation, and when the old holder thaws it
// learns that its lease is lost and its commit is refused with ZF001.
func TestPostgresLeaseFrozenHolder(t *testing.T) {
	t.Parallel()
	pg, url := leasetest.LeaseDB(t)
	pg.Exec(t, "CREATE TABLE writes (token bigint NOT NULL)")
	const resource = "frozen"
	px := testenv.StartProxy(t, pg, proxy.Config{Resources: []string{resource}, ControlDatabase: url})
	conn := testenv.Connect(t, url)

	holder, stdin, next := leasetest.StartHolder(t, "LEASE_TEST_PG_HOLDER=1", "LEASE_TEST_PG="+url,
		"LEASE_TEST_PROXY="+px.URL(testenv.AdminUser, "postgres"), "LEASE_TEST_RESOURCE="+resource)
	token, err := strconv.ParseInt(strings.TrimPrefix(next("token "), "token "), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	next("ready")

	if err := holder.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	frozen := time.Now()
	contender := leasetest.Campaign(t, &pglease.Store{URL: url, TTL: 2 * time.Second, Holder: "contender"}, resource)
	t.Logf("holder frozen -> new holder after %v (TTL 2s)", time.Since(frozen).Round(time.Millisecond))
	if contender.Token() != token+1 {
		t.Errorf("generations %d then %d, want consecutive", token, contender.Token())
	}
	if got := storedToken(t, conn, resource); got != contender.Token() {
		t.Errorf("stored token %d, want the new generation %d", got, contender.Token())
	}
	// The new holder writes through the proxy.
	nc := testenv.Connect(t, px.FenceURL(testenv.AdminUser, "postgres", resource, contender.Token()))
	if _, err := nc.Exec(context.Background(), "INSERT INTO writes (token) VALUES ($1)", contender.Token()); err != nil {
		t.Fatalf("new holder's write: %v", err)
	}

	thawed := time.Now()
	if err := holder.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	line := next("lost ")
	t.Logf("thawed holder learned %v later: %s", time.Since(thawed).Round(time.Millisecond), line)
	if _, err := fmt.Fprintln(stdin, "commit"); err != nil {
		t.Fatal(err)
	}
	if line := next("commit "); !strings.HasPrefix(line, "commit ZF001 ") {
		t.Errorf("old holder's commit: %q, want ZF001", line)
	}
	var old, current int
	if err := conn.QueryRow(context.Background(), "SELECT count(*) FILTER (WHERE token = $1), count(*) FILTER (WHERE token = $2) FROM writes",
		token, contender.Token()).Scan(&old, &current); err != nil {
		t.Fatal(err)
	}
	if old != 0 || current != 1 {
		t.Errorf("rows: %d of the old holder (want 0), %d of the new one (want 1)", old, current)
	}
}
