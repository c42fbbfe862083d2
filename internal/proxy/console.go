package proxy

import (
	"bufio"
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// The admin console: a client that names the database --admin-database (fenceproxy) talks to
// the proxy itself, as PgBouncer's console (psql -d fenceproxy -c 'SHOW FENCES'). Its users are
// --admin-users, authenticated by the server: the proxy relays their password exchange to
// --admin-auth-database and closes that connection once the server has said yes. It takes the
// simple query protocol; what it shows comes from the sources of /status and /metrics.

// maxConsoleMessage is the largest message the console reads: its commands are short.
const maxConsoleMessage = 64 << 10

// consoleAuthName is the application_name of the connection that authenticates a console user.
const consoleAuthName = "fenceproxy admin console login"

// consoleLogin authorises a console user (one of --admin-users), has the server authenticate
// it, and leaves the client at its ReadyForQuery.
func (sess *session) consoleLogin(ctx context.Context, br *bufio.Reader, st *wire.Startup) error {
	conf := sess.srv.conf()
	sess.console = true
	if !slices.Contains(conf.adminUsers, sess.user) {
		f := fatalf(wire.CodeInvalidAuthorization, "user %q may not use the fenceproxy admin console (database %q): it is not in fenceproxy --admin-users; connect as one of them, or add it to --admin-users (admin-users in the configuration file) and reload",
			sess.user, conf.adminDatabase)
		if len(conf.adminUsers) == 0 {
			f = fatalf(wire.CodeInvalidAuthorization, "the fenceproxy admin console (database %q) is closed: fenceproxy --admin-users is empty; list the users who may use it there (admin-users in the configuration file) and reload, and they log in with their PostgreSQL password",
				conf.adminDatabase)
		}
		f.resp.Hint = fmt.Sprintf("To reach a server database named %q through the proxy instead, rename the console with fenceproxy --admin-database.", conf.adminDatabase)
		return f
	}
	// A startup of our own: the client's options and replication are nothing to the console.
	auth := &wire.Startup{Kind: wire.KindStartup, Version: st.Version, Params: []wire.Param{
		{Name: "user", Value: sess.user}, {Name: "database", Value: conf.adminAuthDatabase}, {Name: "application_name", Value: consoleAuthName}}}
	if enc, ok := st.Param("client_encoding"); ok {
		auth.SetParam("client_encoding", enc)
	}
	err := sess.authenticate(ctx, br, auth)
	if sess.sw != nil {
		// The server said yes (or no): its session is not used.
		wire.WriteMessage(sess.sw, 'X', nil) //nolint:errcheck // closed next
		sess.sw.Flush()                      //nolint:errcheck
	}
	if sc := sess.serverConn(); sc != nil {
		sc.Close()
	}
	return err
}

// serveConsole answers an admin console connection's commands until it ends.
func (s *Server) serveConsole(sess *session) {
	s.mu.Lock()
	if s.draining.Load() {
		s.mu.Unlock()
		return
	}
	s.consoles[sess] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.consoles, sess)
		s.mu.Unlock()
	}()
	sess.log.Info("admin console session", zap.String("user", sess.user))
	c := &console{s: s, sess: sess}
	if err := c.serve(); err != nil {
		sess.log.Debug("admin console session ended", zap.Error(err))
	}
}

type console struct {
	s    *Server
	sess *session
	buf  []byte // the answer being built
	// skip: an extended-protocol message was refused; the rest up to Sync is discarded, as
	// PostgreSQL does after an error there.
	skip bool
}

var errConsoleProtocol = errors.New("admin console: protocol violation")

func (c *console) serve() error {
	cr, cw := c.sess.cr, c.sess.cw
	for {
		typ, n, err := cr.Next()
		if err != nil {
			return err
		}
		if n > maxConsoleMessage {
			c.fatal(wire.CodeProgramLimitExceeded, fmt.Sprintf("message of %d bytes is too large for the fenceproxy admin console (at most %d)", n, maxConsoleMessage))
			return c.flush(cw)
		}
		body, err := cr.Body()
		if err != nil {
			return err
		}
		switch typ {
		case 'Q':
			// A string of our own: body is the reader's buffer, which the next read reuses.
			query := strings.TrimRight(string(body), "\x00")
			if !c.skip {
				c.query(query)
				c.ready()
			}
		case 'X':
			return nil
		case 'S':
			c.skip = false
			c.ready()
		case 'P', 'B', 'D', 'E', 'C', 'H':
			if !c.skip {
				c.errorf(wire.CodeFeatureNotSupported, "the fenceproxy admin console takes the simple query protocol only, as PgBouncer's: use psql, or with pgx default_query_exec_mode=simple_protocol")
				c.skip = true
			}
		case 'F':
			if !c.skip {
				c.errorf(wire.CodeFeatureNotSupported, "the fenceproxy admin console has no functions to call: it answers SHOW, RELOAD, PAUSE and RESUME (SHOW HELP)")
				c.ready()
			}
		case 'd', 'c', 'f':
			// COPY data outside a COPY: ignored, as PostgreSQL does.
		default:
			c.fatal(wire.CodeProtocolViolation, fmt.Sprintf("invalid message type %q for the fenceproxy admin console", typ))
			c.flush(cw) //nolint:errcheck // closing anyway
			return errConsoleProtocol
		}
		if err := c.flush(cw); err != nil {
			return err
		}
	}
}

func (c *console) flush(w *bufio.Writer) error {
	if len(c.buf) == 0 {
		return nil
	}
	_, err := w.Write(c.buf)
	c.buf = c.buf[:0]
	if err != nil {
		return err
	}
	return w.Flush()
}

func (c *console) send(m pgproto3.BackendMessage) {
	var err error
	if c.buf, err = m.Encode(c.buf); err != nil {
		c.sess.log.Warn("admin console: encoding an answer", zap.Error(err))
	}
}

func (c *console) ready() { c.send(&pgproto3.ReadyForQuery{TxStatus: 'I'}) }

func (c *console) errorf(code, format string, args ...any) {
	c.buf = wire.AppendError(c.buf, &pgproto3.ErrorResponse{Severity: wire.SeverityError, Code: code, Message: fmt.Sprintf(format, args...)})
}

func (c *console) fatal(code, message string) {
	c.buf = wire.AppendError(c.buf, &pgproto3.ErrorResponse{Severity: wire.SeverityFatal, Code: code, Message: message})
}

// notice sends a NOTICE (successful_completion) or a WARNING (warning).
func (c *console) notice(severity, message string) {
	code := "00000"
	if severity == "WARNING" {
		code = "01000"
	}
	c.send(&pgproto3.NoticeResponse{Severity: severity, SeverityUnlocalized: severity, Code: code, Message: message})
}

// query runs the statements of a simple Query, separated by semicolons, up to the first error.
// Comments (-- to the end of the line) are dropped: pgx's Ping sends "-- ping".
func (c *console) query(query string) {
	lines := strings.Split(query, "\n")
	for i, l := range lines {
		lines[i], _, _ = strings.Cut(l, "--")
	}
	query = strings.Join(lines, "\n")
	ran := false
	for stmt := range strings.SplitSeq(query, ";") {
		words := strings.Fields(stmt)
		if len(words) == 0 {
			continue
		}
		ran = true
		if !c.command(words) {
			return
		}
	}
	if !ran {
		c.send(&pgproto3.EmptyQueryResponse{})
	}
}

// consoleCommands are the console's commands, for SHOW HELP.
var consoleCommands = [][2]string{
	{"SHOW FENCES", "each resource: the authority of its tokens, its leader's token and holder, its state, the sessions open through this proxy, whether it is paused"},
	{"SHOW BINDINGS", "the sessions open through this proxy by resource and token, and whether the token is stale"},
	{"SHOW CLIENTS", "each client session this proxy relays: address, user, database, resource and token, state, backend pid"},
	{"SHOW REFUSALS", "the last 50 sessions refused with a fencing error"},
	{"SHOW STATS", "the proxy's metrics, as /metrics of the admin listener has them"},
	{"SHOW VERSION", "this fenceproxy's version"},
	{"SHOW HELP", "this list"},
	{"RELOAD", "read the configuration again and apply what can change without a restart, as SIGHUP"},
	{"PAUSE [resource]", "new sessions (of the resource) wait before they connect to the server, each up to --login-timeout; open sessions go on"},
	{"RESUME [resource]", "end a PAUSE: the waiting sessions connect"},
}

// showLists are what SHOW takes, for its errors.
const showLists = "FENCES, BINDINGS, CLIENTS, REFUSALS, STATS, VERSION or HELP"

// command runs one statement; false when it failed (an ErrorResponse was sent).
func (c *console) command(words []string) bool {
	verb := strings.ToUpper(words[0])
	args := words[1:]
	switch verb {
	case "SHOW":
		if len(args) != 1 {
			c.errorf(wire.CodeSyntaxError, "SHOW takes one of "+showLists)
			return false
		}
		return c.show(strings.ToUpper(args[0]))
	case "RELOAD":
		if len(args) != 0 {
			c.errorf(wire.CodeSyntaxError, "RELOAD takes no argument")
			return false
		}
		return c.reload()
	case "PAUSE", "RESUME":
		if len(args) > 1 {
			c.errorf(wire.CodeSyntaxError, "%s takes at most one resource", verb)
			return false
		}
		var resource string
		if len(args) == 1 {
			resource = args[0]
		}
		return c.pause(verb == "PAUSE", resource)
	case "COPY":
		c.errorf(wire.CodeFeatureNotSupported, "COPY is not supported by the fenceproxy admin console: it answers SHOW, RELOAD, PAUSE and RESUME (SHOW HELP)")
		return false
	}
	c.errorf(wire.CodeSyntaxError, "%q is not a fenceproxy admin console command (the console is not the server: for SQL connect to another database); SHOW HELP lists the commands", strings.Join(words, " "))
	return false
}

// column is a result column: its name and type (text unless said).
type column struct {
	name string
	oid  uint32
}

const (
	oidBool        = 16
	oidInt8        = 20
	oidText        = 25
	oidFloat8      = 701
	oidTimestamptz = 1184
)

// result sends a result set: values are nil (NULL), string, int64, bool, float64 or time.Time.
func (c *console) result(tag string, cols []column, rows [][]any) {
	rd := &pgproto3.RowDescription{}
	for _, col := range cols {
		rd.Fields = append(rd.Fields, pgproto3.FieldDescription{Name: []byte(col.name), DataTypeOID: cmp.Or(col.oid, oidText), DataTypeSize: -1, TypeModifier: -1})
	}
	c.send(rd)
	for _, row := range rows {
		dr := &pgproto3.DataRow{Values: make([][]byte, len(row))}
		for i, v := range row {
			switch v := v.(type) {
			case nil:
			case string:
				dr.Values[i] = []byte(v)
			case int64:
				dr.Values[i] = strconv.AppendInt(nil, v, 10)
			case bool:
				dr.Values[i] = []byte{"ft"[b2i(v)]}
			case float64:
				// As PostgreSQL's float8: no exponent for a timestamp or a count.
				f := byte('g')
				if a := math.Abs(v); a == 0 || a >= 1e-4 && a < 1e15 {
					f = 'f'
				}
				dr.Values[i] = strconv.AppendFloat(nil, v, f, -1, 64)
			case time.Time:
				dr.Values[i] = v.UTC().AppendFormat(nil, "2006-01-02 15:04:05.999999-07")
			default:
				panic(fmt.Sprintf("admin console: a value of type %T", v))
			}
		}
		c.send(dr)
	}
	c.send(&pgproto3.CommandComplete{CommandTag: fmt.Appendf(nil, "%s %d", tag, len(rows))})
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// orNull is s, or NULL when empty.
func orNull(s string) any {
	if s == "" {
		return nil
	}
	return s
}

func (c *console) show(what string) bool {
	s := c.s
	switch what {
	case "HELP":
		rows := make([][]any, len(consoleCommands))
		for i, cmd := range consoleCommands {
			rows[i] = []any{cmd[0], cmd[1]}
		}
		c.result("SHOW", []column{{name: "command"}, {name: "description"}}, rows)
	case "VERSION":
		c.result("SHOW", []column{{name: "version"}}, [][]any{{"fenceproxy " + cmp.Or(s.version, "(unknown version)")}})
	case "FENCES":
		var rows [][]any
		for _, r := range s.status().Resources {
			var admitted any
			if r.AdmittedAt != nil {
				admitted = *r.AdmittedAt
			}
			n := 0
			for _, k := range r.Sessions {
				n += k
			}
			rows = append(rows, []any{r.Resource, r.Store, r.Token, orNull(r.Holder), orNull(r.HolderName), admitted, r.Changes, r.Flapping,
				fenceState(r), int64(n), r.Paused, int64(r.Waiting)})
		}
		c.result("SHOW", []column{{name: "resource"}, {name: "store"}, {name: "token", oid: oidInt8}, {name: "holder"}, {name: "holder_name"},
			{name: "admitted_at", oid: oidTimestamptz}, {name: "changes", oid: oidInt8}, {name: "flapping", oid: oidBool}, {name: "state"},
			{name: "sessions", oid: oidInt8}, {name: "paused", oid: oidBool}, {name: "waiting", oid: oidInt8}}, rows)
	case "BINDINGS":
		var rows [][]any
		for _, r := range s.status().Resources {
			var toks []int64
			for k := range r.Sessions {
				if t, err := strconv.ParseInt(k, 10, 64); err == nil {
					toks = append(toks, t)
				}
			}
			slices.Sort(toks)
			for _, t := range toks {
				rows = append(rows, []any{r.Resource, t, int64(r.Sessions[strconv.FormatInt(t, 10)]), t < r.Token})
			}
		}
		c.result("SHOW", []column{{name: "resource"}, {name: "token", oid: oidInt8}, {name: "sessions", oid: oidInt8}, {name: "stale", oid: oidBool}}, rows)
	case "CLIENTS":
		var rows [][]any
		for _, cl := range s.Clients() {
			var token any
			if cl.Resource != "" {
				token = cl.Token
			}
			rows = append(rows, []any{int64(cl.ID), cl.Addr, cl.User, cl.Database, orNull(cl.Resource), token, cl.TLS, cl.State, int64(cl.BackendPID), cl.Since})
		}
		c.result("SHOW", []column{{name: "id", oid: oidInt8}, {name: "addr"}, {name: "user"}, {name: "database"}, {name: "resource"}, {name: "token", oid: oidInt8},
			{name: "tls", oid: oidBool}, {name: "state"}, {name: "backend_pid", oid: oidInt8}, {name: "connected_at", oid: oidTimestamptz}}, rows)
	case "REFUSALS":
		var rows [][]any
		for _, r := range s.status().Refusals {
			var token any
			if r.Token != 0 {
				token = r.Token
			}
			rows = append(rows, []any{r.At, r.Phase, orNull(r.Resource), token, r.SQLState, r.Message})
		}
		c.result("SHOW", []column{{name: "at", oid: oidTimestamptz}, {name: "phase"}, {name: "resource"}, {name: "token", oid: oidInt8}, {name: "sqlstate"}, {name: "message"}}, rows)
	case "STATS":
		rows, err := s.stats()
		if err != nil {
			c.errorf(wire.CodeInternalError, "reading the metrics: %v", err)
			return false
		}
		c.result("SHOW", []column{{name: "metric"}, {name: "labels"}, {name: "value", oid: oidFloat8}}, rows)
	default:
		c.errorf(wire.CodeSyntaxError, "SHOW %s: not a fenceproxy admin console list; SHOW takes %s", what, showLists)
		return false
	}
	return true
}

// fenceState says in a word or a sentence what a resource's sessions get now.
func fenceState(r ResourceStatus) string {
	switch {
	case r.Removed:
		return "removed (a reload; its open sessions remain)"
	case r.Free:
		return "free (no leader: sessions are refused with ZF006)"
	case r.Blocked != "":
		return "blocked: " + r.Blocked
	case r.Token == 0:
		return "no token yet"
	}
	return "led"
}

func (c *console) reload() bool {
	s := c.s
	if s.reload == nil {
		c.errorf(wire.CodeFeatureNotSupported, "RELOAD is not available: this proxy runs inside a program that gave it no configuration to read again")
		return false
	}
	c.sess.log.Info("admin console: RELOAD", zap.String("user", c.sess.user))
	applied, skipped, err := s.reload()
	if err != nil {
		c.errorf(wire.CodeConfigFileError, "reload failed, nothing changed: %v", err)
		return false
	}
	if len(applied) == 0 {
		c.notice("NOTICE", "reloaded: nothing changed")
	}
	for _, a := range applied {
		c.notice("NOTICE", "reloaded: "+a)
	}
	for _, sk := range skipped {
		c.notice("WARNING", "not applied, restart to apply it: "+sk)
	}
	c.send(&pgproto3.CommandComplete{CommandTag: []byte("RELOAD")})
	return true
}

func (c *console) pause(on bool, resource string) bool {
	s := c.s
	verb := "RESUME"
	if on {
		verb = "PAUSE"
	}
	if resource != "" && !slices.Contains(s.conf().names, resource) {
		c.errorf(wire.CodeUndefinedObject, "%s %s: this proxy serves no resource %q (SHOW FENCES lists them)", verb, resource, resource)
		return false
	}
	c.sess.log.Info("admin console: "+verb, zap.String("user", c.sess.user), zap.String("resource", resource))
	what := "sessions"
	if resource != "" {
		what = "sessions of resource " + resource
	}
	if on {
		s.pause.set(resource)
		c.notice("NOTICE", fmt.Sprintf("paused: new %s wait before they connect to the server until RESUME, each at most --login-timeout (%s); open sessions go on", what, s.conf().loginTimeout))
	} else {
		if err := s.pause.clear(resource); err != nil {
			c.errorf(wire.CodeObjectNotInPrerequisiteState, "%v", err)
			return false
		}
		c.notice("NOTICE", "resumed: new "+what+" connect")
	}
	c.send(&pgproto3.CommandComplete{CommandTag: []byte(verb)})
	return true
}

// ClientStatus is one client session the proxy relays (SHOW CLIENTS).
type ClientStatus struct {
	ID         uint64
	Addr       string
	User       string
	Database   string
	Resource   string // "" when unfenced
	Token      int64
	TLS        bool
	State      string // idle, active, in transaction, failed transaction, stale
	BackendPID uint32
	Since      time.Time
}

// Clients returns the client sessions the proxy relays, oldest first: the sessions /status
// counts.
func (s *Server) Clients() []ClientStatus {
	s.mu.Lock()
	out := make([]ClientStatus, 0, len(s.sessions))
	for sess := range s.sessions {
		cl := ClientStatus{ID: sess.id, Addr: sess.client.RemoteAddr().String(), User: sess.user, Database: sess.database,
			TLS: sess.clientTLS, BackendPID: sess.pid, Since: sess.since}
		if sess.mode == modeFenced {
			cl.Resource, cl.Token = sess.cred.Resource, sess.cred.Token
		}
		sess.mu.Lock()
		status, outstanding := sess.status, sess.outstanding
		sess.mu.Unlock()
		switch {
		case sess.stale.Load():
			cl.State = "stale"
		case outstanding > 0:
			cl.State = "active"
		case status == 'T':
			cl.State = "in transaction"
		case status == 'E':
			cl.State = "failed transaction"
		default:
			cl.State = "idle"
		}
		out = append(out, cl)
	}
	s.mu.Unlock()
	slices.SortFunc(out, func(a, b ClientStatus) int { return cmp.Compare(a.ID, b.ID) })
	return out
}

// stats reads the metrics /metrics serves (the proxy's own, without the Go runtime's), a row
// a series: name, labels, value; a histogram as its _count and _sum.
func (s *Server) stats() ([][]any, error) {
	reg := prometheus.NewRegistry()
	cs := []prometheus.Collector{s.lead}
	if s.metrics != nil {
		cs = append(cs, s.metrics.collectors()...)
	}
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	fams, err := reg.Gather()
	if err != nil {
		return nil, err
	}
	var rows [][]any
	for _, f := range fams {
		for _, m := range f.GetMetric() {
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, l.GetName()+"="+l.GetValue())
			}
			ls := strings.Join(labels, ",")
			switch {
			case m.Counter != nil:
				rows = append(rows, []any{f.GetName(), ls, m.Counter.GetValue()})
			case m.Gauge != nil:
				rows = append(rows, []any{f.GetName(), ls, m.Gauge.GetValue()})
			case m.Histogram != nil:
				rows = append(rows, []any{f.GetName() + "_count", ls, float64(m.Histogram.GetSampleCount())},
					[]any{f.GetName() + "_sum", ls, m.Histogram.GetSampleSum()})
			case m.Untyped != nil:
				rows = append(rows, []any{f.GetName(), ls, m.Untyped.GetValue()})
			}
		}
	}
	return rows, nil
}

// pauseState is PAUSE and RESUME: whether new sessions wait, of every resource or of some,
// and how many wait.
type pauseState struct {
	mu        sync.Mutex
	all       bool
	resources map[string]bool
	waiting   map[string]int // by resource ("": unfenced sessions)
	// changed is closed (and replaced) at each RESUME and at shutdown: waiters look again.
	changed chan struct{}
}

type pauseSnapshot struct {
	all       bool
	resources map[string]bool
	waiting   map[string]int
}

func (p pauseSnapshot) waitingTotal() int {
	n := 0
	for _, k := range p.waiting {
		n += k
	}
	return n
}

func (p *pauseState) init() {
	p.resources, p.waiting, p.changed = map[string]bool{}, map[string]int{}, make(chan struct{})
}

func (p *pauseState) snapshot() pauseSnapshot {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := pauseSnapshot{all: p.all, resources: map[string]bool{}, waiting: map[string]int{}}
	for r, on := range p.resources {
		out.resources[r] = on
	}
	for r, n := range p.waiting {
		out.waiting[r] = n
	}
	return out
}

// set pauses new sessions of resource ("": every new session).
func (p *pauseState) set(resource string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if resource == "" {
		p.all = true
	} else {
		p.resources[resource] = true
	}
}

// clear resumes new sessions of resource ("": every pause).
func (p *pauseState) clear(resource string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if resource == "" {
		p.all = false
		clear(p.resources)
	} else {
		if p.all {
			return fmt.Errorf("RESUME %s: the whole proxy is paused (PAUSE without a resource); RESUME without a resource ends that pause", resource)
		}
		delete(p.resources, resource)
	}
	p.wakeLocked()
	return nil
}

// release wakes every waiter (shutdown: they are refused).
func (p *pauseState) release() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.wakeLocked()
}

func (p *pauseState) wakeLocked() {
	close(p.changed)
	p.changed = make(chan struct{})
}

// errPaused is wrapped by the refusal of a session that waited for RESUME in vain.
var errPaused = errors.New("paused")

// waitResumed makes a new session wait while the proxy, or its resource, is paused: until
// RESUME, shutdown, or the login timeout (ctx), which refuses it saying so.
func (sess *session) waitResumed(ctx context.Context) error {
	s, p := sess.srv, &sess.srv.pause
	resource := ""
	if sess.mode == modeFenced {
		resource = sess.cred.Resource
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.all && !p.resources[resource] {
		return nil
	}
	p.waiting[resource]++
	defer func() {
		if p.waiting[resource]--; p.waiting[resource] == 0 {
			delete(p.waiting, resource)
		}
	}()
	sess.log.Info("session waits: fenceproxy is paused (admin console PAUSE)")
	started := time.Now()
	for (p.all || p.resources[resource]) && !s.draining.Load() {
		ch := p.changed
		p.mu.Unlock()
		select {
		case <-ch:
			p.mu.Lock()
		case <-ctx.Done():
			p.mu.Lock()
			what := "fenceproxy is paused"
			if !p.all {
				what = fmt.Sprintf("resource %q is paused", resource)
			}
			return &fatal{err: errPaused, resp: &pgproto3.ErrorResponse{Severity: wire.SeverityFatal, Code: wire.CodeCannotConnectNow,
				Message: fmt.Sprintf("%s (PAUSE on its admin console) and was not resumed within %s (fenceproxy --login-timeout): the session did not start",
					what, time.Since(started).Round(time.Millisecond)),
				Hint: fmt.Sprintf("Retry later. An operator ends the pause with RESUME: psql -d %s -c 'RESUME' on the proxy's port.", s.conf().adminDatabase)}}
		}
	}
	return nil
}
