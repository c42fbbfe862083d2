package proxy

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// The upstream: one or several hosts in libpq's multi-host syntax, and libpq's
// target_session_attrs (any, read-write, read-only, primary, standby, prefer-standby).
//
// libpq and pgx connect to a host, authenticate, check the session (libpq 14+ reads the
// in_hot_standby and default_transaction_read_only that the server reports at startup, no
// round trip; pgx and older servers run SHOW transaction_read_only or pg_is_in_recovery()) and
// go on to the next host when it does not fit: they have the password. The proxy relays the
// client's authentication and cannot replay it on another host, so it chooses the host before
// it connects, from what it knows of each host's role (hostRoles): what the monitor reads on
// the control database's role (monitorHosts), what each session's startup reported
// (in_hot_standby, free), and which dials failed. It then checks the session's own report
// before the bind (checkRole): a fenced session goes to a primary only, whatever the
// attribute, and the bind itself (BEGIN READ WRITE) fails on a standby anyway.

// Target session attributes (libpq 14).
const (
	attrsAny           = "any"
	attrsReadWrite     = "read-write"
	attrsReadOnly      = "read-only"
	attrsPrimary       = "primary"
	attrsStandby       = "standby"
	attrsPreferStandby = "prefer-standby"
)

// upstreamHost is one host of --upstream.
type upstreamHost struct {
	network string // tcp or unix
	host    string // a name or an address, as configured (resolved at each dial); unix: the socket folder
	port    string
	tls     *tls.Config // nil: plain
}

// String is host:port, or the socket's path.
func (h upstreamHost) String() string {
	if h.network == "unix" {
		return h.socket()
	}
	return net.JoinHostPort(h.host, h.port)
}

func (h upstreamHost) socket() string { return fmt.Sprintf("%s/.s.PGSQL.%s", h.host, h.port) }

// upstreamSet is the parsed --upstream.
type upstreamSet struct {
	hosts []upstreamHost
	attrs string // target_session_attrs
}

// parseUpstream reads --upstream: a postgres:// URL (postgres://h1:5432,h2:5433/?target_session_attrs=read-write,
// or postgres:///?host=/socket/dir&port=5432) or libpq's keyword/value form (host=h1,h2
// port=5432,5433 target_session_attrs=read-write).
func parseUpstream(raw, sslmode, rootCert string) (upstreamSet, error) {
	var set upstreamSet
	if raw == "" {
		return set, errors.New("upstream is required (postgres://HOST:PORT)")
	}
	var params map[string]string
	var err error
	switch {
	case strings.HasPrefix(raw, "postgres://") || strings.HasPrefix(raw, "postgresql://"):
		params, err = upstreamURL(raw)
	case strings.Contains(raw, "="):
		params, err = upstreamKeywords(raw)
	default:
		// A bare HOST:PORT is no URL: url.Parse's own words ("first path segment in URL
		// cannot contain colon") do not say what to write.
		example := "postgres://HOST:PORT"
		if h, p, err := net.SplitHostPort(raw); err == nil {
			example = "postgres://" + net.JoinHostPort(h, p)
		}
		return set, fmt.Errorf("upstream %q is not a postgres:// URL: write %s (or postgres:///?host=/socket/dir&port=5432 for a Unix socket, or host=h1,h2 port=5432 in libpq's keyword form)", raw, example)
	}
	if err != nil {
		return set, fmt.Errorf("upstream %q: %w", raw, err)
	}
	hosts := splitList(params["host"])
	ports := splitList(params["port"])
	if len(hosts) == 0 {
		hosts = []string{""}
	}
	switch {
	case len(ports) == 0:
		ports = []string{""}
	case len(ports) != 1 && len(ports) != len(hosts):
		return set, fmt.Errorf("upstream %q: %d ports for %d hosts: give one port for every host, or one for all", raw, len(ports), len(hosts))
	}
	if m := params["sslmode"]; m != "" && sslmode == "" {
		sslmode = m
	}
	set.attrs = params["target_session_attrs"]
	switch set.attrs {
	case "":
		set.attrs = attrsAny
	case attrsAny, attrsReadWrite, attrsReadOnly, attrsPrimary, attrsStandby, attrsPreferStandby:
	default:
		return set, fmt.Errorf("upstream %q: target_session_attrs %q: use any, read-write, read-only, primary, standby or prefer-standby", raw, set.attrs)
	}
	var roots *x509.CertPool
	if sslmode == "verify-full" && rootCert != "" {
		pem, err := os.ReadFile(rootCert)
		if err != nil {
			return set, fmt.Errorf("upstream CA: %w", err)
		}
		roots = x509.NewCertPool()
		if !roots.AppendCertsFromPEM(pem) {
			return set, fmt.Errorf("upstream CA %s: no certificate found", rootCert)
		}
	}
	for i, host := range hosts {
		port := ports[0]
		if len(ports) > 1 {
			port = ports[i]
		}
		if port == "" {
			port = "5432"
		}
		if _, err := strconv.ParseUint(port, 10, 16); err != nil {
			return set, fmt.Errorf("upstream %q: bad port %q", raw, port)
		}
		h := upstreamHost{network: "tcp", host: host, port: port}
		if strings.HasPrefix(host, "/") {
			h.network = "unix"
			if sslmode != "" && sslmode != "disable" {
				return set, errors.New("upstream: TLS over a Unix socket is not supported; use sslmode=disable")
			}
			set.hosts = append(set.hosts, h)
			continue
		}
		if h.host == "" {
			h.host = "127.0.0.1"
		}
		if strings.ContainsAny(h.host, " /?#@") {
			return set, fmt.Errorf("upstream %q: bad host %q", raw, h.host)
		}
		switch sslmode {
		case "", "disable":
		case "require":
			h.tls = &tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS12} //nolint:gosec // sslmode=require means encryption without verification, as in libpq
		case "verify-full":
			h.tls = &tls.Config{ServerName: h.host, MinVersion: tls.VersionTLS12, RootCAs: roots}
		default:
			return set, fmt.Errorf("upstream sslmode %q: use disable, require or verify-full", sslmode)
		}
		set.hosts = append(set.hosts, h)
	}
	return set, nil
}

func splitList(s string) []string {
	if s == "" {
		return nil
	}
	return strings.Split(s, ",")
}

// upstreamKeys are the keywords --upstream takes; user and database come from each client.
var upstreamKeys = map[string]bool{"host": true, "port": true, "sslmode": true, "target_session_attrs": true}

func checkUpstreamKey(k string) error {
	switch {
	case upstreamKeys[k]:
		return nil
	case k == "user" || k == "dbname" || k == "password" || k == "passfile":
		return errors.New("user and database come from each client; give only host and port")
	default:
		return fmt.Errorf("%q is not a setting fenceproxy uses (host, port, sslmode, target_session_attrs)", k)
	}
}

// upstreamURL reads a postgres:// URL whose authority may list several hosts (which
// url.Parse refuses: "invalid port").
func upstreamURL(raw string) (map[string]string, error) {
	rest := raw[strings.Index(raw, "://")+3:]
	authority, tail := rest, ""
	if i := strings.IndexAny(rest, "/?"); i >= 0 {
		authority, tail = rest[:i], rest[i:]
	}
	path, query, _ := strings.Cut(tail, "?")
	if strings.Contains(authority, "@") || (path != "" && path != "/") {
		return nil, errors.New("user and database come from each client; give only host and port")
	}
	params := map[string]string{}
	var hosts, ports []string
	if authority != "" {
		for _, hp := range strings.Split(authority, ",") {
			host, port := hp, ""
			if strings.HasPrefix(hp, "[") { // [v6]:port
				end := strings.Index(hp, "]")
				if end < 0 {
					return nil, fmt.Errorf("bad host %q", hp)
				}
				host, port = hp[1:end], strings.TrimPrefix(hp[end+1:], ":")
			} else if h, p, ok := strings.Cut(hp, ":"); ok {
				host, port = h, p
			}
			h, err := url.PathUnescape(host)
			if err != nil {
				return nil, fmt.Errorf("bad host %q: %w", host, err)
			}
			hosts, ports = append(hosts, h), append(ports, port)
		}
		params["host"] = strings.Join(hosts, ",")
		if strings.Join(ports, "") != "" {
			params["port"] = strings.Join(ports, ",")
		}
	}
	q, err := url.ParseQuery(query)
	if err != nil {
		return nil, fmt.Errorf("bad query: %w", err)
	}
	for k, v := range q {
		if err := checkUpstreamKey(k); err != nil {
			return nil, err
		}
		params[k] = v[len(v)-1] // the query wins over the authority, as in libpq
	}
	return params, nil
}

// upstreamKeywords reads libpq's keyword/value form: key=value pairs separated by spaces,
// a value in single quotes where it has spaces, \' and \\ escaped.
func upstreamKeywords(raw string) (map[string]string, error) {
	params := map[string]string{}
	s := strings.TrimSpace(raw)
	for s != "" {
		eq := strings.IndexByte(s, '=')
		if eq < 0 {
			return nil, fmt.Errorf("%q has no value (keyword=value)", s)
		}
		key := strings.TrimSpace(s[:eq])
		s = strings.TrimLeft(s[eq+1:], " \t")
		var val strings.Builder
		if strings.HasPrefix(s, "'") {
			i, closed := 1, false
			for ; i < len(s); i++ {
				c := s[i]
				if c == '\\' && i+1 < len(s) {
					i++
					val.WriteByte(s[i])
					continue
				}
				if c == '\'' {
					closed = true
					break
				}
				val.WriteByte(c)
			}
			if !closed {
				return nil, fmt.Errorf("unterminated quoted value of %s", key)
			}
			s = s[i+1:]
		} else {
			end := strings.IndexAny(s, " \t")
			if end < 0 {
				end = len(s)
			}
			val.WriteString(s[:end])
			s = s[end:]
		}
		s = strings.TrimLeft(s, " \t")
		if key == "" || strings.ContainsAny(key, " \t") {
			return nil, fmt.Errorf("bad keyword %q", key)
		}
		if err := checkUpstreamKey(key); err != nil {
			return nil, err
		}
		params[key] = val.String()
	}
	return params, nil
}

// Host roles as the proxy last learned them.
const (
	roleUnknown int32 = iota
	rolePrimary
	roleStandby
	roleDown
)

func roleName(r int32) string {
	switch r {
	case rolePrimary:
		return "primary"
	case roleStandby:
		return "standby"
	case roleDown:
		return "unreachable"
	}
	return "not checked yet"
}

// hostRole is what the proxy knows of one host.
type hostRole struct {
	role atomic.Int32
	// timeline is a primary's, from its last reading (0: not a primary, or not read).
	timeline atomic.Int64
	// system is the cluster's system identifier ("": not read, or the role may not).
	system atomic.Pointer[string]
	// why is the last failure, for messages (a string: no error value kept).
	why atomic.Pointer[string]
}

func (r *hostRole) set(role int32, why string) {
	r.role.Store(role)
	if why == "" {
		r.why.Store(nil)
	} else {
		r.why.Store(&why)
	}
}

// wantOf is the role a session asks for: a fenced session the primary, whatever the
// attribute; an unfenced one, the attribute.
func (s *Server) wantOf(fenced bool) string {
	if fenced {
		return attrsPrimary
	}
	return s.cfg.upstream.attrs
}

// hostOrder is the order in which a session wanting want tries the hosts: those known to
// fit first, then those not known, then those known not to fit, and unreachable ones last
// (each may have changed since: the session's own startup is what counts). Within a rank,
// the configured order, as libpq.
func (s *Server) hostOrder(want string) []int {
	fit := func(role int32) int { // 0: fits, 1: may fit, 2: does not
		switch want {
		case attrsPrimary, attrsReadWrite:
			if role == rolePrimary {
				return 0
			}
			return 2
		case attrsStandby:
			if role == roleStandby {
				return 0
			}
			return 2
		case attrsReadOnly, attrsPreferStandby:
			// A primary is read-only when its default says so, which only the session's
			// startup tells; prefer-standby takes a primary when no standby answers.
			if role == roleStandby {
				return 0
			}
			return 1
		}
		return 0
	}
	var ranks [4][]int
	newest := s.roles[max(s.primaryHost(), 0)].timeline.Load()
	for i := range s.cfg.upstream.hosts {
		rank := 1
		switch role := s.roles[i].role.Load(); role {
		case roleDown:
			rank = 3
		case roleUnknown:
			if want == attrsAny {
				rank = 0 // any: the configured order
			}
		default:
			rank = fit(role)
			if role == rolePrimary && rank == 0 && s.roles[i].timeline.Load() < newest {
				// A primary of an older timeline than another's: the old primary of a
				// failover, frozen or thawed, whose overdue reading has not failed yet (a
				// review's session waited 15 s there for the login timeout).
				rank = 2
			}
		}
		ranks[rank] = append(ranks[rank], i)
	}
	var out []int
	for _, r := range ranks {
		out = append(out, r...)
	}
	return out
}

// primaryHost is the host the monitor last read as the primary of the newest timeline (-1:
// none known).
func (s *Server) primaryHost() int {
	best := -1
	for i := range s.roles {
		if s.roles[i].role.Load() == rolePrimary && (best < 0 || s.roles[i].timeline.Load() > s.roles[best].timeline.Load()) {
			best = i
		}
	}
	return best
}

// primaryMark is the primary the monitor last read: its host and timeline.
type primaryMark struct {
	host     int
	timeline int64
}

// primaryMoved tells whoever waits on movedCh that the primary may have moved.
func (s *Server) primaryMoved() {
	s.movedMu.Lock()
	defer s.movedMu.Unlock()
	close(s.movedCh)
	s.movedCh = make(chan struct{})
}

// moved returns a channel closed at the next primaryMoved.
func (s *Server) moved() <-chan struct{} {
	s.movedMu.Lock()
	defer s.movedMu.Unlock()
	return s.movedCh
}

// aimAtPrimary puts the host the monitor knows as the primary first in cfg, a control
// connection's settings (the hosts of the control URL follow): a multi-host URL with
// target_session_attrs=read-write tries its hosts in order, and one that is frozen (a paused
// VM, the old primary of a failover) accepts the TCP connection and never answers, so every
// control connection, and with it every fenced start, waited for it (a review's lockout).
func (s *Server) aimAtPrimary(cfg *pgconn.Config) {
	if cfg.ConnectTimeout <= 0 {
		cfg.ConnectTimeout = s.cfg.ConnectTimeout
	}
	p := s.primaryHost()
	if p < 0 || s.controlBase == nil || len(s.cfg.upstream.hosts) < 2 {
		return // one host: nothing to choose (and its address may differ from the control URL's)
	}
	h := hostConfig(s.controlBase, s.cfg.upstream.hosts[p], s)
	rest := append([]*pgconn.FallbackConfig{{Host: cfg.Host, Port: cfg.Port, TLSConfig: cfg.TLSConfig}}, cfg.Fallbacks...)
	cfg.Host, cfg.Port, cfg.TLSConfig = h.Host, h.Port, h.TLSConfig
	cfg.Fallbacks = append(h.Fallbacks, rest...)
	cfg.LookupFunc = s.lookupHost
}

// lookupHost resolves a host name for one dial: at every session start, never cached.
func (s *Server) lookupHost(ctx context.Context, host string) ([]string, error) {
	if ip := net.ParseIP(host); ip != nil {
		return []string{host}, nil
	}
	if s.resolve != nil {
		return s.resolve(ctx, host)
	}
	return net.DefaultResolver.LookupHost(ctx, host)
}

// dialHost connects to one host (each of its addresses in turn) and negotiates TLS.
func (s *Server) dialHost(ctx context.Context, h upstreamHost) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.ConnectTimeout)
	defer cancel()
	var d net.Dialer
	var conn net.Conn
	if h.network == "unix" {
		c, err := d.DialContext(ctx, "unix", h.socket())
		if err != nil {
			return nil, err
		}
		return c, nil
	}
	addrs, err := s.lookupHost(ctx, h.host)
	if err != nil {
		return nil, err
	}
	var errs []error
	for _, a := range addrs {
		c, err := d.DialContext(ctx, "tcp", net.JoinHostPort(a, h.port))
		if err == nil {
			conn = c
			break
		}
		errs = append(errs, err)
	}
	if conn == nil {
		return nil, errors.Join(errs...)
	}
	if tc, ok := conn.(*net.TCPConn); ok {
		tc.SetNoDelay(true)   //nolint:errcheck // best effort
		tc.SetKeepAlive(true) //nolint:errcheck
	}
	if h.tls == nil {
		return conn, nil
	}
	return upstreamTLS(ctx, conn, h.tls)
}

// dialUpstream connects a session that wants want to the first host, in hostOrder, that
// accepts the connection; it returns the host's index. A host that does not accept is
// marked unreachable until news says otherwise.
func (s *Server) dialUpstream(ctx context.Context, want string) (net.Conn, int, error) {
	if s.firstRound != nil {
		// Just started: the monitor's first reading of the hosts' roles, briefly.
		t := time.NewTimer(min(s.cfg.ConnectTimeout, time.Second))
		select {
		case <-s.firstRound:
		case <-t.C:
		case <-ctx.Done():
		}
		t.Stop()
	}
	var errs []string
	for _, i := range s.hostOrder(want) {
		h := s.cfg.upstream.hosts[i]
		conn, err := s.dialHost(ctx, h)
		if err == nil {
			if s.roles[i].role.Load() == roleDown {
				s.roles[i].set(roleUnknown, "") // back: its startup will say what it is
			}
			return conn, i, nil
		}
		if ctx.Err() == nil { // not the session's own timeout
			s.roles[i].set(roleDown, err.Error())
		}
		if len(s.cfg.upstream.hosts) == 1 {
			return nil, i, err
		}
		errs = append(errs, fmt.Sprintf("%s: %v", h, err))
		if ctx.Err() != nil {
			break
		}
	}
	return nil, -1, errors.New(strings.Join(errs, "; "))
}

// hostOf is the host a session with this BackendKeyData is on (-1: none known).
func (s *Server) hostOf(pid uint32, key []byte) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	for sess := range s.sessions {
		if sess.pid == pid && string(sess.key) == string(key) {
			return sess.host
		}
	}
	return -1
}

// parameterStatus reads a ParameterStatus body: name and value (copies).
func parameterStatus(body []byte) (name, value string, ok bool) {
	n, rest, ok := strings.Cut(string(body), "\x00")
	if !ok {
		return "", "", false
	}
	v, _, ok := strings.Cut(rest, "\x00")
	return n, v, ok
}

// noteParameter keeps what the server's startup reports of its role (PostgreSQL 14+).
func (sess *session) noteParameter(body []byte) {
	switch name, value, _ := parameterStatus(body); name {
	case "in_hot_standby":
		sess.hotStandby = value
	case "default_transaction_read_only":
		sess.readOnlyDefault = value
	}
}

// checkRole judges, before the bind and before the client's ReadyForQuery, whether the
// host the session reached fits it: a fenced session needs a primary (in_hot_standby off),
// an unfenced one target_session_attrs. It also tells hostRoles what the server reported.
// A server that reports no in_hot_standby (before 14) is judged by what the monitor knows,
// and a fenced session's bind (BEGIN READ WRITE) refuses a standby anyway.
func (sess *session) checkRole() error {
	s := sess.srv
	if sess.host < 0 {
		return nil
	}
	role := s.roles[sess.host].role.Load()
	switch sess.hotStandby {
	case "on":
		role = roleStandby
		s.roles[sess.host].set(roleStandby, "")
	case "off":
		role = rolePrimary
		s.roles[sess.host].set(rolePrimary, "")
	}
	want := s.wantOf(sess.mode == modeFenced)
	// default_transaction_read_only counts for read-write and read-only as in libpq, unless
	// the proxy set it itself (--unfenced=readonly).
	readOnly := sess.readOnlyDefault == "on" && !(sess.mode == modeUnfenced && s.conf().unfenced == UnfencedReadOnly)
	fits := true
	switch want {
	case attrsPrimary:
		fits = role != roleStandby
	case attrsStandby:
		fits = role != rolePrimary
	case attrsReadWrite:
		fits = role != roleStandby && !readOnly
	case attrsReadOnly:
		fits = role != rolePrimary || readOnly
	}
	if fits {
		return nil
	}
	host := s.cfg.upstream.hosts[sess.host]
	is := roleName(role)
	if readOnly && role == rolePrimary {
		is = "a primary whose default_transaction_read_only is on"
	}
	if sess.mode == modeFenced {
		f := fatalf(wire.CodeCannotConnectNow, "fenceproxy: the server at %s is a %s: a fenced session needs the writable primary", host, is)
		f.resp.Hint = "The standby refuses writes (and the fencing token's bind). Retry: fenceproxy sends new sessions to the host it now knows as primary (--upstream lists the hosts; docs/failover.md)."
		return f
	}
	f := fatalf(wire.CodeCannotConnectNow, "fenceproxy: the server at %s is a %s, which does not fit target_session_attrs=%s of --upstream", host, is, want)
	f.resp.Hint = "Retry: fenceproxy sends new sessions to the hosts it now knows to fit first."
	return f
}

// monitorHosts reads each host's role (pg_is_in_recovery()) on the control database's role
// every --upstream-check-interval until ctx ends: a connection per host, kept open. A host
// that was primary and now reports recovery (a demoted primary back as a standby) has its
// sessions ended, named; a host that becomes primary ends the fenced sessions on every other.
func (s *Server) monitorHosts(ctx context.Context) {
	var first sync.WaitGroup
	firstDone := func() { s.firstRoundOnce.Do(func() { close(s.firstRound) }) }
	base, err := pgconn.ParseConfig(s.cfg.ControlDatabase)
	if err != nil {
		firstDone()
		s.log.Error("cannot read the upstream hosts' roles: the control database's URL", zap.Error(err))
		return
	}
	var wg sync.WaitGroup
	for i, h := range s.cfg.upstream.hosts {
		wg.Add(1)
		first.Add(1)
		go func() {
			defer wg.Done()
			s.monitorHost(ctx, hostConfig(base, h, s), i, first.Done)
		}()
	}
	go func() { first.Wait(); firstDone() }()
	wg.Wait()
}

// hostConfig is the control database's connection settings, aimed at h.
func hostConfig(base *pgconn.Config, h upstreamHost, s *Server) *pgconn.Config {
	cfg := base.Copy()
	port, _ := strconv.ParseUint(h.port, 10, 16)
	// The TLS variants libpq's sslmode gives the control URL's first host (prefer: TLS,
	// then plain), for h.
	variants := []*tls.Config{base.TLSConfig}
	for _, fb := range base.Fallbacks {
		if fb.Host == base.Host && fb.Port == base.Port {
			variants = append(variants, fb.TLSConfig)
		}
	}
	for i, v := range variants {
		if v != nil && h.network == "tcp" {
			v = v.Clone()
			v.ServerName = h.host
		}
		if h.network == "unix" {
			v = nil
		}
		variants[i] = v
	}
	cfg.Host, cfg.Port, cfg.TLSConfig, cfg.Fallbacks = h.host, uint16(port), variants[0], nil
	for _, v := range variants[1:] {
		cfg.Fallbacks = append(cfg.Fallbacks, &pgconn.FallbackConfig{Host: h.host, Port: uint16(port), TLSConfig: v})
	}
	cfg.LookupFunc = s.lookupHost
	cfg.ConnectTimeout = s.cfg.ConnectTimeout
	cfg.ValidateConnect = nil
	cfg.RuntimeParams = maps.Clone(cfg.RuntimeParams)
	cfg.RuntimeParams["application_name"] = "fenceproxy upstream check"
	return cfg
}

// monitorHost reads host i's role until ctx ends; read runs once, after the first reading.
func (s *Server) monitorHost(ctx context.Context, cfg *pgconn.Config, i int, read func()) {
	var once sync.Once
	defer once.Do(read)
	h := s.cfg.upstream.hosts[i]
	var conn *pgconn.PgConn
	defer func() {
		if conn != nil {
			conn.Close(context.Background()) //nolint:errcheck
		}
	}()
	tick := time.NewTicker(s.cfg.UpstreamCheckInterval)
	defer tick.Stop()
	for {
		role, timeline, system, why := s.checkHost(ctx, cfg, &conn)
		if ctx.Err() != nil {
			return
		}
		prev := s.roles[i].role.Load()
		if role == rolePrimary || role == roleStandby {
			s.roles[i].timeline.Store(timeline)
			s.roles[i].system.Store(&system)
		}
		s.roles[i].set(role, why)
		if p := s.primaryHost(); p >= 0 {
			// Another primary than the one the control connections were made to (another
			// host, or a newer timeline): not the first reading, which names the one they
			// reached, nor the same primary read again after a failed reading (a listener
			// made to reconnect for nothing lost notifications under load).
			now := primaryMark{host: p, timeline: s.roles[p].timeline.Load()}
			if last := s.lastPrimary.Swap(&now); last != nil && (last.host != now.host || now.timeline > last.timeline) {
				s.primaryMoved()
			}
		}
		s.monitored.Store(true)
		once.Do(read)
		if prev != role {
			s.log.Info("upstream host role", zap.String("host", h.String()), zap.String("role", roleName(role)),
				zap.String("was", roleName(prev)), zap.String("why", why))
			if prev == rolePrimary && role == roleStandby {
				s.endSessionsOn(i, wire.CodeAdminShutdown, false, func(host string) string {
					return "terminating connection because the server at " + host + " is a standby now (pg_is_in_recovery())"
				})
			}
			if role == rolePrimary {
				// Another host that was primary may be frozen (a stopped VM) or cut off, not
				// down: its fenced sessions could commit there when it wakes, after the new
				// primary admitted a higher token. They end now; a host still primary too
				// (a split brain) loses its fenced sessions as well.
				for j := range s.cfg.upstream.hosts {
					if j != i {
						s.endSessionsOn(j, wire.CodeConnectionFailure, true, func(host string) string {
							return "fenceproxy: the server at " + host + " went away as the primary: " + h.String() + " is the primary now (a failover)"
						})
					}
				}
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// checkHost reads one host's role on *conn, connecting first when it is nil (and closing
// it on an error).
func (s *Server) checkHost(ctx context.Context, cfg *pgconn.Config, conn **pgconn.PgConn) (role int32, timeline int64, system, why string) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.ConnectTimeout)
	defer cancel()
	if *conn == nil {
		c, err := pgconn.ConnectConfig(ctx, cfg)
		var pe *pgconn.PgError
		if errors.As(err, &pe) && !strings.HasPrefix(pe.Code, "57P") {
			// The server answers but refuses the role (pg_hba.conf, a password): reachable,
			// its role unknown; its sessions' startups say it.
			return roleUnknown, 0, "", err.Error()
		}
		if err != nil {
			return roleDown, 0, "", err.Error()
		}
		*conn = c
	}
	res, err := (*conn).Exec(ctx, hostRoleQuery).ReadAll()
	if err == nil && (len(res) != 1 || len(res[0].Rows) != 1 || len(res[0].Rows[0]) != 3) {
		err = errors.New("pg_is_in_recovery() gave no row")
	}
	if err != nil {
		(*conn).Close(context.Background()) //nolint:errcheck
		*conn = nil
		return roleDown, 0, "", err.Error()
	}
	row := res[0].Rows[0]
	if string(row[0]) == "t" {
		return roleStandby, 0, string(row[2]), ""
	}
	timeline, _ = strconv.ParseInt(string(row[1]), 10, 64)
	return rolePrimary, timeline, string(row[2]), ""
}

// hostRoleQuery reads whether a host is in recovery, when it is not the timeline it writes
// on (of its current WAL file, as fence.lease_acquire reads it, L11), and its cluster's
// system identifier when the role may read it (pg_monitor; NULL otherwise).
const hostRoleQuery = `SELECT pg_is_in_recovery(), CASE WHEN pg_is_in_recovery() THEN 0
    ELSE ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint END,
    CASE WHEN has_function_privilege('pg_control_system()', 'EXECUTE')
    THEN (SELECT system_identifier::text FROM pg_control_system()) END`

// controlMismatch says why the control database is not the upstream's ("": it is, or not
// known): its cluster's system identifier (the listener's reading) is not that of the
// primary the monitor reads. Raises, the listener and the standby wait would read another
// server than the sessions write to (a review's control database on another cluster: the
// wait read that cluster's standbys, and a stale write committed after a failover).
func (s *Server) controlMismatch() string {
	ctrl := s.controlSystem.Load()
	p := s.primaryHost()
	if ctrl == nil || *ctrl == "" || p < 0 {
		return ""
	}
	up := s.roles[p].system.Load()
	if up == nil || *up == "" || *up == *ctrl {
		return ""
	}
	return fmt.Sprintf("the control database (--control-database) is another cluster (system identifier %s) than the --upstream primary %s (system identifier %s): point --control-database at the upstream's hosts",
		*ctrl, s.cfg.upstream.hosts[p], *up)
}

// endSessionsOn ends the sessions on host i (only the fenced ones: fenced) with code and the
// message made for the host, saying why (the host is no primary now).
func (s *Server) endSessionsOn(i int, code string, fenced bool, message func(host string) string) {
	h := s.cfg.upstream.hosts[i]
	s.mu.Lock()
	var on []*session
	for sess := range s.sessions {
		if sess.host == i && (!fenced || sess.mode == modeFenced) {
			on = append(on, sess)
		}
	}
	s.mu.Unlock()
	for _, sess := range on {
		sess.end(&pgproto3.ErrorResponse{Severity: wire.SeverityFatal, Code: code,
			Message: message(h.String()),
			Hint:    "fenceproxy: the server went away as a primary (a failover); this was not a raise. Reconnect: new sessions go to the writable primary."})
	}
}

// upstreamNotReady says why no session that needs want could start now ("": one could): no
// writable primary among the hosts (for fenced sessions), or none reachable. With the
// monitor, from its last reading; without it, by dialing the hosts and what their last
// sessions reported.
func (s *Server) upstreamNotReady(ctx context.Context, want string) string {
	if s.firstRound != nil {
		select {
		case <-s.firstRound:
		default:
			return "the upstream hosts' roles are not read yet"
		}
	}
	var seen []string
	reachable := false
	for _, i := range s.hostOrder(want) {
		h, r := s.cfg.upstream.hosts[i], &s.roles[i]
		role := r.role.Load()
		if !s.monitored.Load() {
			c, err := s.dialHost(ctx, h)
			if err != nil {
				seen = append(seen, fmt.Sprintf("%s: %v", h, err))
				if len(s.cfg.upstream.hosts) == 1 {
					seen[0] = err.Error()
				}
				continue
			}
			c.Close()
			reachable = true
			if role == roleDown {
				role = roleUnknown
			}
		}
		reachable = reachable || role != roleDown
		// A host whose role is not known (the monitor's role may not log in there) counts:
		// its sessions' startups judge it.
		fits := role != roleDown
		switch want {
		case attrsPrimary, attrsReadWrite:
			fits = fits && role != roleStandby
		case attrsStandby:
			fits = fits && role != rolePrimary
		}
		if fits {
			return ""
		}
		what := roleName(role)
		if w := r.why.Load(); w != nil && role == roleDown {
			what += ": " + *w
		}
		seen = append(seen, fmt.Sprintf("%s %s", h, what))
	}
	if !reachable {
		return "upstream unreachable: " + strings.Join(seen, "; ")
	}
	if want == attrsPrimary || want == attrsReadWrite {
		return "no writable primary reachable among the upstream hosts (" + strings.Join(seen, "; ") + ")"
	}
	return fmt.Sprintf("no upstream host fits target_session_attrs=%s (%s)", want, strings.Join(seen, "; "))
}
