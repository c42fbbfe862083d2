package proxy_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/binary"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// authRoles are the roles setupAuth creates, one per pg_hba.conf method.
var authRoles = map[string]string{
	"trust":         "alice_trust",
	"password":      "alice_password",
	"md5":           "alice_md5",
	"scram-sha-256": "alice_scram",
}

// authPassword is every auth role's password.
const authPassword = "s3cret'pw"

// setupAuth gives each method of authRoles its own role and pg_hba.conf
// line on the suite's cluster (the superuser stays trusted), and waits
// until the server has reloaded the file.
func setupAuth(t *testing.T, s *suite) {
	t.Helper()
	hba := "local all all trust\n"
	for method, role := range authRoles {
		enc := "scram-sha-256"
		if method == "md5" {
			// Under md5 the server runs the MD5 exchange only for MD5 hashes.
			enc = "md5"
		}
		s.pg.Exec(t, fmt.Sprintf("SET password_encryption = '%s'; CREATE ROLE %s LOGIN PASSWORD '%s'", enc, role, strings.ReplaceAll(authPassword, "'", "''")))
		hba += fmt.Sprintf("host all %s 127.0.0.1/32 %s\n", role, method)
	}
	hba += "host all all 127.0.0.1/32 trust\n"
	if err := os.WriteFile(filepath.Join(s.pg.DataDir, "pg_hba.conf"), []byte(hba), 0o600); err != nil {
		t.Fatal(err)
	}
	s.pg.Exec(t, "SELECT pg_reload_conf()")
	eventually(t, 10*time.Second, "pg_hba.conf reloaded", func() error {
		if err := connectErr(s.pg.URLWithPassword(authRoles["password"], "wrong", "postgres")); sqlstate(err) != "28P01" {
			return fmt.Errorf("a wrong password: %v, want 28P01", err)
		}
		return nil
	})
}

// testAuthMethods: every password method PostgreSQL offers is relayed
// unchanged, for pgx and for libpq (psql), and a wrong password is refused
// by the server with its own error.
func testAuthMethods(t *testing.T, s *suite) {
	tests := []struct {
		method string
		// first is the server's first authentication request, as pgproto3 names it.
		first string
	}{
		{"trust", "AuthenticationOk"},
		{"password", "AuthenticationCleartextPassword"},
		{"md5", "AuthenticationMD5Password"},
		{"scram-sha-256", "AuthenticationSASL"},
	}
	for _, tt := range tests {
		t.Run(tt.method, func(t *testing.T) {
			t.Parallel()
			pg, p, _ := s.setup(t)
			alice := authRoles[tt.method]

			// What the server asks first, through the proxy and directly.
			for _, addr := range []string{pgAddr(pg), proxyAddr(p)} {
				r := dialRaw(t, addr)
				r.writeRaw(startupPacket(wire.ProtocolVersion30, "user", alice, "database", "postgres"))
				m, err := r.fe.Receive()
				if err != nil {
					t.Fatal(err)
				}
				if got := reflect.TypeOf(m).Elem().Name(); got != tt.first {
					t.Fatalf("%s: first message %s, want %s", addr, got, tt.first)
				}
				if sasl, ok := m.(*pgproto3.AuthenticationSASL); ok && !reflect.DeepEqual(sasl.AuthMechanisms, []string{"SCRAM-SHA-256"}) {
					t.Fatalf("SASL mechanisms %q", sasl.AuthMechanisms)
				}
			}

			conn := connect(t, p.URLWithPassword(alice, authPassword, "postgres"))
			var user string
			if err := conn.QueryRow(ctxT(t), "SELECT current_user").Scan(&user); err != nil || user != alice {
				t.Fatalf("current_user %q %v", user, err)
			}
			err := connectErr(p.URLWithPassword(alice, "wrong", "postgres"))
			if tt.method == "trust" {
				if err != nil {
					t.Fatalf("trust: %v", err)
				}
			} else {
				wantCode(t, err, "28P01")
			}

			out, stderr, err := runPsql(t, pg, p.URL(alice, "postgres"), []string{"PGPASSWORD=" + authPassword}, "-c", "SELECT current_user")
			if err != nil || strings.TrimSpace(out) != alice {
				t.Fatalf("psql: %q %q %v", out, stderr, err)
			}
			if tt.method != "trust" {
				_, stderr, err = runPsql(t, pg, p.URL(alice, "postgres"), []string{"PGPASSWORD=wrong"}, "-c", "SELECT 1")
				if err == nil || !strings.Contains(stderr, "password authentication failed for user \""+alice+"\"") {
					t.Fatalf("psql with a wrong password: %q %v", stderr, err)
				}
			}
		})
	}
}

// testCA is a certificate authority made for one test.
type testCA struct {
	cert    *x509.Certificate
	key     *ecdsa.PrivateKey
	dir     string
	CAFile  string
	pemData []byte
}

func newCA(t *testing.T) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "fenceproxy test CA"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	ca := &testCA{cert: cert, key: key, dir: t.TempDir()}
	ca.pemData = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	ca.CAFile = filepath.Join(ca.dir, "ca.crt")
	if err := os.WriteFile(ca.CAFile, ca.pemData, 0o644); err != nil {
		t.Fatal(err)
	}
	return ca
}

// issue writes a server certificate for 127.0.0.1 and localhost and its
// key, and returns their files.
func (ca *testCA) issue(t *testing.T, name string) (certFile, keyFile string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()),
		Subject:      pkix.Name{CommonName: "localhost"},
		DNSNames:     []string{"localhost"},
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certFile = filepath.Join(ca.dir, name+".crt")
	keyFile = filepath.Join(ca.dir, name+".key")
	if err := os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
		t.Fatal(err)
	}
	return certFile, keyFile
}

// serverSSL reports whether the session's backend sees TLS.
func serverSSL(t *testing.T, conn *pgx.Conn) bool {
	t.Helper()
	var ssl bool
	if err := conn.QueryRow(ctxT(t), "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").Scan(&ssl); err != nil {
		t.Fatal(err)
	}
	return ssl
}

func clientTLS(conn *pgx.Conn) bool {
	_, ok := conn.PgConn().Conn().(*tls.Conn)
	return ok
}

// testClientTLS: a proxy with a certificate answers SSLRequest with 'S'
// and clients can verify it; the upstream leg is independent.
func testClientTLS(t *testing.T, s *suite) {
	ca := newCA(t)
	certFile, keyFile := ca.issue(t, "proxy")
	pg, p, admin := s.setup(t, func(c *proxy.Config) { c.TLSCert, c.TLSKey = certFile, keyFile })
	other := newCA(t)

	tests := []struct {
		name    string
		params  []string
		host    string
		wantTLS bool
		wantErr string
	}{
		{"require", []string{"sslmode=require"}, "", true, ""},
		{"verify-full by IP", []string{"sslmode=verify-full", "sslrootcert=" + ca.CAFile}, "", true, ""},
		{"verify-full by name", []string{"sslmode=verify-full", "sslrootcert=" + ca.CAFile}, "localhost", true, ""},
		{"verify-full with another CA", []string{"sslmode=verify-full", "sslrootcert=" + other.CAFile}, "", false, "certificate signed by unknown authority"},
		{"prefer", []string{"sslmode=prefer"}, "", true, ""},
		{"disable", []string{"sslmode=disable"}, "", false, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			url := p.URL(testenv.AdminUser, "postgres", tt.params...)
			if tt.host != "" {
				url = strings.Replace(url, "127.0.0.1", tt.host, 1)
			}
			if tt.wantErr != "" {
				err := connectErr(url)
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("want an error with %q, got %v", tt.wantErr, err)
				}
				return
			}
			conn := connect(t, url)
			if clientTLS(conn) != tt.wantTLS {
				t.Fatalf("client TLS %t, want %t", clientTLS(conn), tt.wantTLS)
			}
			if serverSSL(t, conn) {
				t.Fatal("the upstream leg uses TLS though the proxy was not asked to")
			}
			if c := count(t, conn, "SELECT length(repeat('x', 1000000))"); c != 1000000 {
				t.Fatal(c)
			}
		})
	}
	t.Run("psql verify-full", func(t *testing.T) {
		t.Parallel()
		out, stderr, err := runPsql(t, pg, p.URL(testenv.AdminUser, "postgres", "sslmode=verify-full", "sslrootcert="+ca.CAFile), nil, "-c", `\conninfo`)
		if err != nil || !strings.Contains(out, "SSL connection (protocol: TLSv1.3") {
			t.Fatalf("psql: %q %q %v", out, stderr, err)
		}
	})
	t.Run("cancel over TLS", func(t *testing.T) {
		t.Parallel()
		// pgx sends its CancelRequest over TLS when the session uses TLS.
		conn := connect(t, p.URL(testenv.AdminUser, "postgres", "sslmode=require"))
		cancelOnce(t, conn, admin)
	})
	t.Run("bytes pipelined after SSLRequest", func(t *testing.T) {
		t.Parallel()
		r := dialRaw(t, proxyAddr(p))
		r.writeRaw(append(requestPacket(wire.SSLRequestCode), startupPacket(wire.ProtocolVersion30, "user", "postgres")...))
		msgs, err := r.readAll()
		e := errorOf(msgs)
		if e == nil || e.Code != "08P01" || !isClosed(err) {
			t.Fatalf("want a 08P01 error and a closed connection, got %+v, %v", msgs, err)
		}
	})
}

// cancelOnce cancels a pg_sleep of conn with a CancelRequest sent by pgx on
// a new connection and checks the query ends with 57014.
func cancelOnce(t *testing.T, conn *pgx.Conn, admin querier) {
	t.Helper()
	errc := make(chan error, 1)
	go func() {
		_, err := conn.Exec(context.Background(), "SELECT pg_sleep(30)")
		errc <- err
	}()
	waitActive(t, admin, conn.PgConn().PID(), "pg_sleep")
	start := time.Now()
	if err := conn.PgConn().CancelRequest(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-errc:
		if sqlstate(err) != "57014" {
			t.Fatalf("want 57014, got %v", err)
		}
		t.Logf("cancelled in %v", time.Since(start))
	case <-time.After(5 * time.Second):
		t.Fatal("CancelRequest did not cancel the query within 5 s")
	}
}

// testUpstreamTLS: the proxy's own TLS to the server, in its two modes.
func testUpstreamTLS(t *testing.T, s *suite) {
	pg, admin := s.pg, s.admin
	other := newCA(t)
	hostPort := func(host string, pg *testenv.Postgres) string {
		return fmt.Sprintf("postgres://%s:%d", host, pg.Port)
	}
	tests := []struct {
		name    string
		pg      *testenv.Postgres
		cfg     proxy.Config
		wantErr string
	}{
		{"require", pg, proxy.Config{UpstreamSSLMode: "require"}, ""},
		{"verify-full by IP", pg, proxy.Config{UpstreamSSLMode: "verify-full", UpstreamSSLRootCert: pg.CAFile}, ""},
		{"verify-full by name", pg, proxy.Config{Upstream: hostPort("localhost", pg), UpstreamSSLMode: "verify-full", UpstreamSSLRootCert: pg.CAFile}, ""},
		{"sslmode in the upstream URL", pg, proxy.Config{Upstream: hostPort("localhost", pg) + "?sslmode=require"}, ""},
		{"verify-full with another CA", pg, proxy.Config{UpstreamSSLMode: "verify-full", UpstreamSSLRootCert: other.CAFile}, "certificate signed by unknown authority"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			tt.cfg.Unfenced = proxy.UnfencedAllow
			p := testenv.StartProxy(t, tt.pg, tt.cfg)
			url := p.URL(testenv.AdminUser, "postgres")
			if tt.wantErr != "" {
				wantUpstreamTLSError(t, url, tt.wantErr)
				return
			}
			conn := connect(t, url)
			if !serverSSL(t, conn) {
				t.Fatal("the backend does not see TLS")
			}
			if clientTLS(conn) {
				t.Fatal("client leg uses TLS")
			}
			// The proxy's cancel connection negotiates TLS too.
			cancelOnce(t, conn, admin)
			if c := count(t, conn, "SELECT length(repeat('x', 1000000))"); c != 1000000 {
				t.Fatal(c)
			}
		})
	}
}

func wantUpstreamTLSError(t *testing.T, url, want string) {
	t.Helper()
	start := time.Now()
	err := connectErr(url)
	wantCode(t, err, "08006")
	if !strings.Contains(err.Error(), want) {
		t.Fatalf("error %q does not say %q", err, want)
	}
	if time.Since(start) > 3*time.Second {
		t.Fatalf("refusal took %v", time.Since(start))
	}
}

// testUpstreamTLSRefused: upstream sslmode=require against a server
// without TLS fails clearly (run on a cluster without ssl).
func testUpstreamTLSRefused(t *testing.T, s *suite) {
	p := plainProxy(t, s.pg, func(c *proxy.Config) { c.UpstreamSSLMode = "require" })
	wantUpstreamTLSError(t, p.URL(testenv.AdminUser, "postgres"), "refused TLS")
}

// testSCRAMChannelBinding: SCRAM over TLS on both legs. The client binds
// its SCRAM exchange to the certificate it sees (tls-server-end-point); the
// server checks against its own. They agree only when the proxy presents
// the server's certificate, or when the client does not bind.
func testSCRAMChannelBinding(t *testing.T, s *suite) {
	pg := s.pg
	ca := newCA(t)
	ownCert, ownKey := ca.issue(t, "proxy")
	// The server's own pair (we run as root or as the cluster's owner, so
	// its key is readable).
	srvCert, srvKey := filepath.Join(pg.DataDir, "server.crt"), filepath.Join(pg.DataDir, "server.key")
	tests := []struct {
		name       string
		cert, key  string
		binding    string
		wantErr    bool
		wantBound  bool
		upstreamOn bool
	}{
		{"upstream plain, client binds if it can", ownCert, ownKey, "prefer", false, false, false},
		{"both TLS, client does not bind", ownCert, ownKey, "disable", false, false, true},
		{"both TLS, proxy has the server's certificate", srvCert, srvKey, "require", false, true, true},
		{"both TLS, proxy has its own certificate, client binds", ownCert, ownKey, "prefer", true, false, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg := proxy.Config{Unfenced: proxy.UnfencedAllow, TLSCert: tt.cert, TLSKey: tt.key}
			if tt.upstreamOn {
				cfg.UpstreamSSLMode = "require"
			}
			p := testenv.StartProxy(t, pg, cfg)
			url := p.URLWithPassword(authRoles["scram-sha-256"], authPassword, "postgres", "sslmode=require", "channel_binding="+tt.binding)
			err := connectErr(url)
			if tt.wantErr {
				if err == nil {
					t.Fatal("want an authentication error")
				}
				pe := pgErrorOf(err)
				if pe == nil || !strings.Contains(pe.Hint, "channel_binding=disable") {
					t.Fatalf("the error does not say what to do: %v", err)
				}
				t.Logf("as expected, channel binding across the proxy fails: %v", err)
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			_, stderr, err := runPsql(t, pg, url, nil, "-c", "SELECT 1")
			if err != nil {
				t.Fatalf("psql: %s %v", stderr, err)
			}
		})
	}
}

// testUnixSocketUpstream: the proxy reaches the server over its Unix socket.
func testUnixSocketUpstream(t *testing.T, s *suite) {
	pg, admin := s.pg, s.admin
	p := plainProxy(t, pg, func(c *proxy.Config) {
		c.Upstream = fmt.Sprintf("postgres:///?host=%s&port=%d", pg.SocketDir, pg.Port)
	})
	conn := connect(t, p.URL(testenv.AdminUser, "postgres"))
	var unix bool
	if err := conn.QueryRow(ctxT(t), "SELECT inet_client_addr() IS NULL").Scan(&unix); err != nil || !unix {
		t.Fatalf("the backend's client is not a Unix socket (%v)", err)
	}
	cancelOnce(t, conn, admin)
	if c := count(t, conn, "SELECT 1"); c != 1 {
		t.Fatal(c)
	}
}

// testNoClientTLS: without a certificate the proxy answers SSLRequest with
// 'N', as a server with ssl=off does.
func testNoClientTLS(t *testing.T, s *suite) {
	pg, p, _ := s.setup(t)
	conn := connect(t, p.URL(testenv.AdminUser, "postgres", "sslmode=prefer"))
	if clientTLS(conn) {
		t.Fatal("TLS without a certificate?")
	}
	for _, url := range []string{pg.URL(testenv.AdminUser, "postgres", "sslmode=require"), p.URL(testenv.AdminUser, "postgres", "sslmode=require")} {
		err := connectErr(url)
		if err == nil || !strings.Contains(err.Error(), "server refused TLS connection") {
			t.Fatalf("%s: want pgx's 'server refused TLS connection', got %v", url, err)
		}
		_, stderr, err := runPsql(t, pg, url, nil, "-c", "SELECT 1")
		if err == nil || !strings.Contains(stderr, "server does not support SSL, but SSL was required") {
			t.Fatalf("psql sslmode=require: %q %v", stderr, err)
		}
	}
	out, stderr, err := runPsql(t, pg, p.URL(testenv.AdminUser, "postgres", "sslmode=prefer", "gssencmode=prefer"), nil, "-c", "SELECT 5")
	if err != nil || strings.TrimSpace(out) != "5" {
		t.Fatalf("psql sslmode=prefer gssencmode=prefer: %q %q %v", out, stderr, err)
	}

	// The raw exchanges: 'N' to either request, then a session on the same
	// connection, as libpq does (GSSENCRequest first, then SSLRequest).
	for _, reqs := range [][]uint32{
		{wire.SSLRequestCode},
		{wire.GSSENCRequestCode},
		{wire.GSSENCRequestCode, wire.SSLRequestCode},
	} {
		r := dialRaw(t, proxyAddr(p))
		for _, code := range reqs {
			r.writeRaw(requestPacket(code))
			if b, err := r.readByte(); err != nil || b != 'N' {
				t.Fatalf("answer to request %d: %q %v", code, b, err)
			}
		}
		out := r.startup(wire.ProtocolVersion30, "user", testenv.AdminUser, "database", "postgres")
		if !strings.HasPrefix(out[len(out)-1], "ReadyForQuery") {
			t.Fatalf("after %v: %q", reqs, out)
		}
		r.send(&pgproto3.Query{String: "SELECT 1"})
		if _, err := r.readUntil(1, ""); err != nil {
			t.Fatal(err)
		}
	}
	// GSSENCRequest with bytes pipelined behind it: 'N', then the error,
	// as PostgreSQL does when it has no encryption to offer.
	r := dialRaw(t, proxyAddr(p))
	r.writeRaw(append(requestPacket(wire.GSSENCRequestCode), startupPacket(wire.ProtocolVersion30, "user", "postgres")...))
	if b, err := r.readByte(); err != nil || b != 'N' {
		t.Fatalf("answer to the GSSENCRequest: %q %v", b, err)
	}
	msgs, err := r.readAll()
	if e := errorOf(msgs); e == nil || e.Code != "08P01" || !isClosed(err) {
		t.Fatalf("want a 08P01 error and a closed connection, got %+v, %v", msgs, err)
	}
}

// TestOversizedAuthAnswerRefusedUnread (F2): before authentication the proxy
// does not buffer what a client announces. After the server's SCRAM challenge
// a client announces a 10 MB SASLInitialResponse and sends only its first
// bytes: the proxy answers FATAL 08P01 "... too large" at once (not at the
// login timeout, 30 s here, after waiting for 10 MB), and closes. A normal
// SCRAM login through the proxy still works.
func TestOversizedAuthAnswerRefusedUnread(t *testing.T) {
	t.Parallel()
	pg, _ := fencedDB(t, testenv.WithAuth("scram-sha-256"))
	p := fencedProxy(t, pg, func(c *proxy.Config) { c.LoginTimeout = 30 * time.Second })

	ok := connect(t, p.URLWithPassword("app", "app", "postgres", "fence.resource=billing", "fence.token=1"))
	if _, err := ok.Exec(ctxT(t), "SELECT 1"); err != nil {
		t.Fatalf("a session after a normal SCRAM login: %v", err)
	}

	r := dialRaw(t, proxyAddr(p))
	r.writeRaw(startupPacket(196608, "user", "app", "database", "postgres", "fence.resource", "billing", "fence.token", "1"))
	m, err := r.fe.Receive()
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := m.(*pgproto3.AuthenticationSASL); !ok {
		t.Fatalf("want AuthenticationSASL, got %s", normalize(m))
	}
	const announced = 10 << 20
	msg := []byte{'p'}
	msg = binary.BigEndian.AppendUint32(msg, announced+4)
	msg = append(msg, "SCRAM-SHA-256\x00"...)
	msg = binary.BigEndian.AppendUint32(msg, uint32(announced-4-len("SCRAM-SHA-256\x00")-4))
	msg = append(msg, "n,,n=,r="...)
	r.writeRaw(msg)
	start := time.Now()
	r.conn.SetReadDeadline(start.Add(10 * time.Second)) //nolint:errcheck
	msgs, err := r.readAll()
	e := errorOf(msgs)
	if e == nil {
		t.Fatalf("no error within %v of an announced %d-byte authentication answer (connection: %v)", time.Since(start).Round(time.Millisecond), announced, err)
	}
	if e.Code != wire.CodeProtocolViolation || e.Severity != wire.SeverityFatal || !strings.Contains(e.Message, "too large") {
		t.Fatalf("want FATAL 08P01 ... too large, got %s %s: %s", e.Severity, e.Code, e.Message)
	}
	if !isClosed(err) {
		t.Fatalf("the connection stays open after the error: %v", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("the refusal took %v", d)
	}
	t.Logf("refused after %v: %s", time.Since(start).Round(time.Millisecond), e.Message)
}

// TestStaleTokenNotDisclosedBeforeAuthentication (F10): a client that has not
// authenticated learns nothing of the admitted tokens. With a wrong password,
// or as an unknown user, and a stale token, the client gets the server's
// authentication error (28P01) and no token number; with the right password
// the same stale token is refused with ZF001.
func TestStaleTokenNotDisclosedBeforeAuthentication(t *testing.T) {
	t.Parallel()
	pg, _ := fencedDB(t, testenv.WithAuth("scram-sha-256"))
	p := fencedProxy(t, pg)
	const admitted = 734
	connect(t, p.URLWithPassword("app", "app", "postgres", "fence.resource=billing", fmt.Sprintf("fence.token=%d", admitted)))
	if h := p.Registry.Highest("postgres", "billing"); h != admitted {
		t.Fatalf("the proxy knows token %d, want %d: the test would prove nothing", h, admitted)
	}
	stale := fmt.Sprintf("fence.token=%d", admitted-1)
	for _, c := range []struct{ name, user, password string }{
		{"wrong password", "app", "wrong"},
		{"unknown user", "nobody", "app"},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := connectErr(p.URLWithPassword(c.user, c.password, "postgres", "fence.resource=billing", stale))
			pe := pgErrorOf(err)
			if pe == nil || pe.Code != "28P01" {
				t.Fatalf("want the server's 28P01, got SQLSTATE %q: %v", sqlstate(err), err)
			}
			for _, s := range []string{pe.Message, pe.Detail, pe.Hint} {
				if strings.Contains(s, fmt.Sprint(admitted)) || strings.Contains(strings.ToLower(s), "token") {
					t.Fatalf("the refusal of an unauthenticated client tells of the tokens: %+v", pe)
				}
			}
		})
	}
	err := connectErr(p.URLWithPassword("app", "app", "postgres", "fence.resource=billing", stale))
	wantStale(t, err)
	if !strings.Contains(err.Error(), fmt.Sprint(admitted)) {
		t.Fatalf("the authenticated client's refusal does not name token %d: %v", admitted, err)
	}
}
