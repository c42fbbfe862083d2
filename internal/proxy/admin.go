package proxy

import (
	"context"
	_ "embed" // the status page
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/standby"
)

// Status is what /status says of the proxy.
type Status struct {
	Ready    bool     `json:"ready"`
	NotReady []string `json:"not_ready,omitempty"` // why not
	Sessions int      `json:"sessions"`            // client sessions open
	// Paused: new sessions wait (PAUSE on the admin console without a resource); Waiting
	// counts the sessions waiting, for this or a resource's pause.
	Paused    bool             `json:"paused,omitempty"`
	Waiting   int              `json:"waiting"`
	Resources []ResourceStatus `json:"resources"`
	Refusals  []Refusal        `json:"refusals"` // the most recent last
}

// ResourceStatus is one resource's leadership as this proxy knows it.
type ResourceStatus struct {
	Resource string `json:"resource"`
	// Store is the authority of the resource's tokens: the lock service that validates them
	// (consul, etcd, zookeeper), postgres (the PostgreSQL lease, --lease-resource), or bare.
	Store string `json:"store"`
	// Bare: no lock service issues the tokens; the database orders the tokens clients bring,
	// so any client of the proxy may raise the resource's token (and end its leader's sessions).
	Bare bool `json:"bare,omitempty"`
	// Token is the highest token known to be admitted (0: none yet); Holder its holder when
	// known (a Consul session).
	Token      int64      `json:"token,string"` // a string: JSON numbers lose precision above 2^53 in a script
	Holder     string     `json:"holder,omitempty"`
	HolderName string     `json:"holder_name,omitempty"` // the name the lock service knows Holder by (a Consul session's Name)
	AdmittedAt *time.Time `json:"admitted_at,omitempty"` // when this proxy learned of Token
	Changes    int64      `json:"changes"`
	Flapping   bool       `json:"flapping"`
	Blocked    string     `json:"blocked,omitempty"` // why every session is refused (fencing unavailable)
	// Free: nobody holds the resource's lock (no leader; sessions are refused with ZF006 until
	// one takes it). Normal between leaders: not Blocked.
	Free bool `json:"free,omitempty"`
	// Sessions counts the sessions open through this proxy, by token.
	Sessions map[string]int `json:"sessions"`
	// StaleSessionsEnded counts the sessions that ended after a higher token was admitted
	// (fenceproxy_resource_stale_sessions_ended_total); Refusals lists the latest (phase
	// "session").
	StaleSessionsEnded int64 `json:"stale_sessions_ended"`
	// Removed: the proxy no longer serves the resource (a reload removed it) and lists it
	// only while sessions of it remain open.
	Removed bool `json:"removed,omitempty"`
	// Paused: new sessions of the resource wait (PAUSE on the admin console, of the resource
	// or of the whole proxy); Waiting counts them.
	Paused  bool `json:"paused,omitempty"`
	Waiting int  `json:"waiting,omitempty"`
}

// readyTimeout bounds each readiness check.
const readyTimeout = 2 * time.Second

// NotReady returns why the proxy should get no new clients, or nothing when it is ready:
// the server is unreachable, the control database's listener is not synced (it may miss
// raises), a Consul watch is not synchronised, or fencing is unavailable for a resource.
func (s *Server) NotReady(ctx context.Context) []string {
	var why []string
	if s.draining.Load() {
		why = append(why, "shutting down")
	}
	ctx, cancel := context.WithTimeout(ctx, readyTimeout)
	defer cancel()
	want := s.cfg.upstream.attrs
	if len(s.conf().names) > 0 {
		want = attrsPrimary // fenced sessions go to the primary whatever the attribute
	}
	if w := s.upstreamNotReady(ctx, want); w != "" {
		why = append(why, w)
	}
	if s.control != nil && !s.listenSynced.Load() {
		why = append(why, "control database listener not synced")
	}
	if w := s.controlMismatch(); w != "" {
		why = append(why, w)
	}
	if s.control != nil {
		// A named standby that does not stream from this primary (down, cut off, cascading)
		// fails every fenced session's start: not ready, saying which (a review's H1).
		un, err := s.conf().standbys.Unconfirmable(ctx, s.control)
		switch {
		case errors.Is(err, standby.ErrSetup):
			why = append(why, err.Error())
		case err != nil && !s.conf().standbys.Empty() && ctx.Err() != nil:
			// The standby wait reads on this connection: every fenced start would fail.
			why = append(why, "the control database did not answer the read of the failover standbys' positions: "+err.Error())
		case len(un) > 0:
			why = append(why, "failover standbys cannot confirm a fenced session's start (each fails with ZF007): "+strings.Join(un, ", "))
		}
	}
	for _, g := range guards(s.admit) {
		for _, r := range g.Unsynced() {
			why = append(why, fmt.Sprintf("resource %s: %s lock state not synchronised", r, serviceNames[g.Store()]))
		}
	}
	for _, name := range s.conf().names {
		if fe := s.reg.Blocked(name); fe != nil && fe.Code == fence.CodeUnavailable {
			why = append(why, fe.Message)
		}
	}
	return why
}

// Status returns the proxy's status (NotReady included).
func (s *Server) Status(ctx context.Context) Status {
	st := s.status()
	st.NotReady = s.NotReady(ctx)
	st.Ready = len(st.NotReady) == 0
	return st
}

// status is Status without the readiness checks (which dial the server): what the admin
// console shows.
func (s *Server) status() Status {
	st := Status{Refusals: s.lead.recentRefusals(), Resources: []ResourceStatus{}}
	pause := s.pause.snapshot()
	st.Paused, st.Waiting = pause.all, pause.waitingTotal()
	s.mu.Lock()
	st.Sessions = len(s.sessions)
	s.mu.Unlock()
	now := time.Now()
	names := s.conf().names
	for _, l := range s.lead.leaders() {
		r := ResourceStatus{Resource: l.Resource, Store: s.storeOf(l.Resource), Token: l.Token, Holder: l.Holder, HolderName: l.HolderName, Changes: l.Changes,
			Flapping: s.lead.isFlapping(l.Resource, now), Sessions: map[string]int{}, Removed: !slices.Contains(names, l.Resource)}
		r.Bare = r.Store == AuthorityBare
		r.StaleSessionsEnded = s.lead.staleEnded(l.Resource)
		r.Paused, r.Waiting = pause.all || pause.resources[l.Resource], pause.waiting[l.Resource]
		if !l.Since.IsZero() {
			r.AdmittedAt = &l.Since
		}
		switch {
		case lockFree(l.Blocked):
			r.Free = true
		case l.Blocked != nil:
			r.Blocked = l.Blocked.Message
		}
		for tok, n := range l.Sessions {
			r.Sessions[fmt.Sprint(tok)] = n
		}
		st.Resources = append(st.Resources, r)
	}
	if st.Refusals == nil {
		st.Refusals = []Refusal{}
	}
	return st
}

// statusPage is the status page: plain HTML and a script that reads /status and /history.
//
//go:embed ui/status.html
var statusPage []byte

// AdminMux returns the admin listener's handler: /healthz (the process answers), /readyz
// (200 or 503 with the reasons), /status (JSON), /history (JSON, the control database's
// fence.history), the status page at /, and metrics on /metrics.
func (s *Server) AdminMux(metrics http.Handler) *http.ServeMux {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		w.Write(statusPage) //nolint:errcheck // the client went away
	})
	mux.HandleFunc("GET /history", func(w http.ResponseWriter, r *http.Request) {
		if s.control == nil {
			writeJSON(w, http.StatusNotFound, map[string]string{"error": "no history: the proxy has no --control-database to read fence.history from"})
			return
		}
		// Bad parameters are the client's error (400), never passed on to the database (a
		// review's resource=%00 came back as a 503 with the server's encoding error).
		limit := 100
		if v := r.URL.Query().Get("limit"); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil || n <= 0 {
				writeJSON(w, http.StatusBadRequest, map[string]string{"error": fmt.Sprintf("limit %q: want a positive integer (at most 1000 are returned)", v)})
				return
			}
			limit = n
		}
		resource := r.URL.Query().Get("resource")
		if resource != "" {
			if !fence.ValidResource(resource) {
				writeJSON(w, http.StatusBadRequest, map[string]string{"error": fmt.Sprintf("resource %q: not a resource name (a lowercase letter, then up to 62 of a-z 0-9 _ . -)", resource)})
				return
			}
		}
		ctx, cancel := context.WithTimeout(r.Context(), 5*time.Second)
		defer cancel()
		h, err := fence.ReadHistory(ctx, s.control, resource, min(limit, 1000))
		if err != nil {
			writeJSON(w, http.StatusServiceUnavailable, map[string]string{"error": err.Error()})
			return
		}
		if h == nil {
			h = []fence.HistoryEntry{}
		}
		writeJSON(w, http.StatusOK, h)
	})
	mux.Handle("GET /metrics", metrics)
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		if why := s.NotReady(r.Context()); len(why) > 0 {
			w.WriteHeader(http.StatusServiceUnavailable)
			fmt.Fprintln(w, strings.Join(why, "\n"))
			return
		}
		fmt.Fprintln(w, "ready")
	})
	mux.HandleFunc("GET /status", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, s.Status(r.Context()))
	})
	return mux
}

// AdminHosts guards an admin listener on loopback against DNS rebinding: a web page whose
// name an attacker points at 127.0.0.1 makes the browser send its own name as Host, so
// only loopback addresses, "localhost" and the names in allowed (each with any port or
// none) reach h; any other Host gets 421 Misdirected Request. /status shows Consul
// sessions, roles, addresses and pids: not for any page the operator's browser visits.
func AdminHosts(h http.Handler, allowed []string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host := r.Host
		if hh, _, err := net.SplitHostPort(host); err == nil {
			host = hh
		}
		host = strings.ToLower(strings.TrimSuffix(strings.TrimPrefix(host, "["), "]"))
		ip := net.ParseIP(host)
		if host == "localhost" || (ip != nil && ip.IsLoopback()) || slices.ContainsFunc(allowed, func(a string) bool { return strings.EqualFold(a, host) }) {
			h.ServeHTTP(w, r)
			return
		}
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.WriteHeader(http.StatusMisdirectedRequest)
		fmt.Fprintf(w, "fenceproxy admin listener: Host %q is not a loopback address or localhost (fenceproxy --admin-allowed-hosts allows a name)\n", r.Host)
	})
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.Encode(v) //nolint:errcheck // the client went away
}
