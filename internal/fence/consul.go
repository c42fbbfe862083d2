package fence

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
)

// ConsulRecord is what the database keeps of a Consul-validated resource (fence.consul_tokens,
// migration 7): the highest token admitted on Consul's word, the Consul session that held the
// lock with it, and the regression that fails the resource closed ("" when none).
type ConsulRecord struct {
	Token      int64
	Holder     string
	Regression string
}

// Admits reports whether the record lets token be admitted for holder: no regression, and
// the record is this very token and holder (fence.consul_admit records a higher token).
func (r ConsulRecord) Admits(token int64, holder string) bool {
	return r.Regression == "" && r.Token == token && r.Holder == holder
}

// ConsulAdmit records through conn (the proxy's control connection) that Consul showed token
// as the current token of resource's lock, held by session holder, and returns the record
// afterwards (fence.consul_admit: C1-C3 in docs/proof.md).
func (k Key) ConsulAdmit(ctx context.Context, conn *pgx.Conn, resource string, token int64, holder string) (ConsulRecord, error) {
	var r ConsulRecord
	var regression *string
	err := k.inTx(ctx, conn, "consul", resource, token, func(tx pgx.Tx, c Call) error {
		return tx.QueryRow(ctx, "SELECT recorded, recorded_holder, regression FROM fence.consul_admit($1, $2, $3, $4)",
			c.Resource, c.Token, holder, c.Proof).Scan(&r.Token, &r.Holder, &regression)
	})
	if regression != nil {
		r.Regression = *regression
	}
	return r, err
}

// ConsulRegress records through conn that resource's Consul token went backwards (token: the
// highest token known, for the proof), and returns the regression recorded: the first one,
// which stays until fence.reset (fence.consul_regress).
func (k Key) ConsulRegress(ctx context.Context, conn *pgx.Conn, resource string, token int64, reason string) (string, error) {
	var recorded string
	err := k.inTx(ctx, conn, "consul", resource, token, func(tx pgx.Tx, c Call) error {
		return tx.QueryRow(ctx, "SELECT fence.consul_regress($1, $2, $3, $4)", c.Resource, c.Token, reason, c.Proof).Scan(&recorded)
	})
	return recorded, err
}

// ConsulBindQuery is the bind of a session whose token Consul just showed as current, held by
// a session: fence.consul_admit records (token, holder) in the session's own database, with
// the proof of kind "consul", and fence.bind runs only when the record admits them (C5 in
// docs/proof.md: one token, one holder, and a second holder deposes the first). Its row:
// recorded token, recorded holder, regression (NULL: none) and the stored token after the
// bind (NULL: not bound, the record did not admit the token).
const ConsulBindQuery = `SELECT a.recorded, a.recorded_holder, a.regression,
	CASE WHEN a.regression IS NULL AND a.recorded = $2 AND a.recorded_holder = $4 THEN fence.bind($1, $2, $3) END
	FROM fence.consul_admit($1, $2, $4, $5) AS a`

// ConsulBindCall returns ConsulBindQuery's parameters for the session's backend (process ID
// pid, in database): the bind's call, then holder and the proof of the admission.
func (k Key) ConsulBindCall(database, resource string, token int64, holder string, pid uint32) ([][]byte, error) {
	bind, err := k.BindCall(database, resource, token, pid)
	if err != nil {
		return nil, err
	}
	if holder == "" {
		return nil, Malformed("a Consul-validated bind needs the lock's holder session")
	}
	return append(bind.Args(), []byte(holder), []byte(k.Proof("consul", database, resource, token, pid))), nil
}

// ErrMoved is the cause of MovedFrom's refusal: the session reports it, not the stale
// token this proxy's memory would name (a higher token of the other service's sequence).
var ErrMoved = errors.New("the resource was led through another lock service")

// recordedStore names the lock service of a holder fence.consul_tokens records: "etcd lease
// ID", "zookeeper session ID", or a bare Consul session ID (fence.holder_words, W1).
func recordedStore(holder string) string {
	switch {
	case strings.HasPrefix(holder, "etcd lease "):
		return "etcd"
	case strings.HasPrefix(holder, "zookeeper session "):
		return "ZooKeeper"
	}
	return "Consul"
}

// MovedFrom refuses token of store when the database admitted a higher token r of another
// lock service's holder: the resource was led through that service, and store's numbers are
// not its sequence, so nothing went backwards. Refused (ZF007) without failing the resource
// closed for good, so that the reset that moves it admits the new holder at once (a
// newcomer's move from etcd to Consul read as a "LockIndex regression ... a snapshot restore",
// and one to etcd stayed closed after the reset until the proxy restarted).
func (rec ConsulRecord) MovedFrom(res string, token int64, store string) *Error {
	was := recordedStore(rec.Holder)
	if rec.Holder == "" || was == store {
		return nil
	}
	fe := Unavailable(res, fmt.Sprintf("token %d of %s is below token %d, which was admitted through %s (holder %q): the resource was led through %s, and this proxy validates it with %s",
		token, store, rec.Token, was, rec.Holder, was, store))
	fe.Err = ErrMoved
	fe.Hint = fmt.Sprintf("One resource has one lock service. To move it to %s, stop the holders of its %s lock, then run fenceproxy fence reset --resource %s --token %d --database URL (%s's current token); or give the %s lock another resource name.",
		store, was, res, token, store, store)
	return fe
}
