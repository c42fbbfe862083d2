package proxy

import (
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/fence"
)

// maxRefusals is how many recent refusals /status keeps.
const maxRefusals = 50

// Refusal is a session the proxy refused with a fencing error: at its start (Phase
// "start"), or after it (Phase "session": a stale or blocked session ended, its client told).
type Refusal struct {
	At       time.Time `json:"at"`
	Phase    string    `json:"phase"`
	Resource string    `json:"resource,omitempty"`
	Token    int64     `json:"token,omitempty,string"` // a string: JSON numbers lose precision above 2^53 in a script
	SQLState string    `json:"sqlstate"`
	Message  string    `json:"message"`
}

// The phases of a Refusal.
const (
	PhaseStart   = "start"
	PhaseSession = "session"
)

// leadership makes the registry's view of each resource's leader visible: the leader
// metrics (read from the registry at each scrape, so nothing is added to a session's
// messages), flapping (a warning when a leader changes more than flapChanges times within
// flapWindow) and the recent refusals. It sees admissions through the registry's OnChange,
// and session starts and ends through Server.handle.
type leadership struct {
	srv *Server

	mu       sync.Mutex
	recent   map[string][]time.Time // resource -> its leader changes within the flap window
	flapping map[string]bool
	refusals []Refusal // a ring of the last maxRefusals, oldest first
	refused  map[[2]string]float64
	ended    map[string]float64 // resource -> sessions ended stale

	descInfo, descHolder, descToken, descChanges, descLast, descFlap, descSessions, descBlocked, descFree, descRefused, descEnded *prometheus.Desc
}

func newLeadership(srv *Server) *leadership {
	l := &leadership{srv: srv, recent: map[string][]time.Time{}, flapping: map[string]bool{},
		refused: map[[2]string]float64{}, ended: map[string]float64{}}
	res := []string{"resource"}
	l.descInfo = prometheus.NewDesc("fenceproxy_resource_info", "1 for each resource, labelled with the authority of its tokens: the lock service that validates them (consul, etcd, zookeeper), postgres (the PostgreSQL lease) or bare (the database orders the tokens clients bring: any client may raise it).", []string{"resource", "store"}, nil)
	l.descHolder = prometheus.NewDesc("fenceproxy_leader_info", "1 for each resource whose leader's holder is known, labelled with the holder (a Consul session, an etcd lease, a ZooKeeper session) and the name its lock service knows it by (a Consul session's Name; empty when none).", []string{"resource", "holder", "holder_name"}, nil)
	l.descToken = prometheus.NewDesc("fenceproxy_leader_token", "The highest fencing token this proxy knows to be admitted for the resource (its leader's; 0: none yet).", res, nil)
	l.descChanges = prometheus.NewDesc("fenceproxy_leader_changes_total", "Moves of the resource's leader to a higher token since the proxy started.", res, nil)
	l.descLast = prometheus.NewDesc("fenceproxy_leader_last_change_timestamp_seconds", "When this proxy learned of the resource's current leader token (Unix time).", res, nil)
	l.descFlap = prometheus.NewDesc("fenceproxy_leader_flapping", "1 while the resource's leader changed more than --flap-changes times within --flap-window.", res, nil)
	l.descSessions = prometheus.NewDesc("fenceproxy_resource_sessions", "Fenced sessions open through this proxy, by resource and token.", []string{"resource", "token"}, nil)
	l.descBlocked = prometheus.NewDesc("fenceproxy_resource_blocked", "1 while every session of the resource is refused because fencing is unavailable (a token regression, or the lock's state unknown); a free lock is fenceproxy_lock_free, not this.", res, nil)
	l.descFree = prometheus.NewDesc("fenceproxy_lock_free", "1 while nobody holds the resource's lock: no leader, sessions refused with ZF006 until one takes it (normal between leaders and when nothing runs).", res, nil)
	l.descRefused = prometheus.NewDesc("fenceproxy_resource_refusals_total", "Fenced sessions refused at their start, by resource and SQLSTATE (ZF001: a stale token).", []string{"resource", "sqlstate"}, nil)
	l.descEnded = prometheus.NewDesc("fenceproxy_resource_stale_sessions_ended_total", "Fenced sessions that ended after a higher token was admitted for their resource.", res, nil)
	srv.reg.SetOnChange(l.changed)
	return l
}

// lockFree reports whether a resource's block (nil: none) is its lock being free (ZF006), the
// normal state between leaders, not a failure.
func lockFree(blocked *fence.Error) bool { return blocked != nil && blocked.Code == fence.CodeNotHeld }

// changed runs at each leader change the registry sees: of this proxy's resources only (the
// registry also learns of other proxies' resources through the control database).
func (l *leadership) changed(c fence.Change) {
	conf := l.srv.conf()
	if !slices.Contains(conf.names, c.Resource) {
		return
	}
	l.mu.Lock()
	times := append(l.recent[c.Resource], c.At)
	times = slices.DeleteFunc(times, func(t time.Time) bool { return c.At.Sub(t) > conf.flapWindow })
	l.recent[c.Resource] = times
	starts := len(times) > conf.flapChanges && !l.flapping[c.Resource]
	if starts {
		l.flapping[c.Resource] = true
	}
	l.mu.Unlock()
	l.srv.log.Info("leader changed", zap.String("resource", c.Resource), zap.Int64("from", c.From), zap.Int64("to", c.To))
	if starts {
		l.srv.log.Warn("leader flapping: a lease too short for the leader's pauses, or a starved leader",
			zap.String("resource", c.Resource), zap.Int("changes", len(times)), zap.Duration("window", conf.flapWindow), zap.Int64("token", c.To))
	}
}

// isFlapping reports whether resource's leader changed more than flapChanges times within
// the window ending now.
func (l *leadership) isFlapping(resource string, now time.Time) bool {
	conf := l.srv.conf()
	l.mu.Lock()
	defer l.mu.Unlock()
	times := slices.DeleteFunc(l.recent[resource], func(t time.Time) bool { return now.Sub(t) > conf.flapWindow })
	l.recent[resource] = times
	f := len(times) > conf.flapChanges
	l.flapping[resource] = f
	return f
}

// refusal records a session refused at its start.
func (l *leadership) refusal(r Refusal) {
	r.Phase = PhaseStart
	l.mu.Lock()
	defer l.mu.Unlock()
	l.recordLocked(r)
	// Only resources the proxy serves get a series: a client's name for an unknown resource
	// (ZF005) must not create metrics without end.
	if slices.Contains(l.srv.conf().names, r.Resource) {
		l.refused[[2]string{r.Resource, r.SQLState}]++
	}
}

func (l *leadership) recordLocked(r Refusal) {
	if len(l.refusals) == maxRefusals {
		l.refusals = slices.Delete(l.refusals, 0, 1)
	}
	l.refusals = append(l.refusals, r)
}

// endedSession records a started session that the proxy ended with a fencing error (fe): a stale
// one (ZF001), or one whose resource is blocked (ZF006, ZF007). Its count is
// endedStale's.
func (l *leadership) endedSession(resource string, token int64, fe *fence.Error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.recordLocked(Refusal{At: time.Now(), Phase: PhaseSession, Resource: resource, Token: token, SQLState: fe.Code, Message: fe.Message})
}

// endedStale records a fenced session that ended after its token went stale.
func (l *leadership) endedStale(resource string) {
	l.mu.Lock()
	l.ended[resource]++
	l.mu.Unlock()
}

// staleEnded is how many sessions of resource ended after their token went stale
// (fenceproxy_resource_stale_sessions_ended_total, /status).
func (l *leadership) staleEnded(resource string) int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return int64(l.ended[resource])
}

func (l *leadership) recentRefusals() []Refusal {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.refusals)
}

// leaders returns the leaders of the configured resources, and of a resource the proxy no
// longer serves while sessions of it remain open (a reload removed it; the database still
// fences them); not of the others the registry knows (e.g. a resource that exists only in
// the database, which fence reset notified). Holders are filled in from Consul where the
// registry has none.
func (l *leadership) leaders() []fence.Leader {
	names := l.srv.conf().names
	out := slices.DeleteFunc(l.srv.reg.Leaders(), func(x fence.Leader) bool {
		return !slices.Contains(names, x.Resource) && len(x.Sessions) == 0
	})
	for _, name := range names {
		if !slices.ContainsFunc(out, func(x fence.Leader) bool { return x.Resource == name }) {
			out = append(out, fence.Leader{Resource: name, Sessions: map[int64]int{}})
		}
	}
	slices.SortFunc(out, func(a, b fence.Leader) int {
		switch {
		case a.Resource < b.Resource:
			return -1
		case a.Resource > b.Resource:
			return 1
		}
		return 0
	})
	for i := range out {
		if g := guardOf(l.srv.admit, out[i].Resource); g != nil {
			if out[i].Holder == "" {
				out[i].Holder = g.HolderOf(out[i].Resource, out[i].Token)
			}
			out[i].HolderName = g.HolderName(out[i].Holder)
		}
	}
	return out
}

// Describe implements prometheus.Collector.
func (l *leadership) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{l.descInfo, l.descHolder, l.descToken, l.descChanges, l.descLast, l.descFlap, l.descSessions, l.descBlocked, l.descFree, l.descRefused, l.descEnded} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (l *leadership) Collect(ch chan<- prometheus.Metric) {
	now := time.Now()
	for _, ld := range l.leaders() {
		r := ld.Resource
		ch <- prometheus.MustNewConstMetric(l.descInfo, prometheus.GaugeValue, 1, r, l.srv.storeOf(r))
		if ld.Holder != "" {
			ch <- prometheus.MustNewConstMetric(l.descHolder, prometheus.GaugeValue, 1, r, ld.Holder, ld.HolderName)
		}
		ch <- prometheus.MustNewConstMetric(l.descToken, prometheus.GaugeValue, float64(ld.Token), r)
		ch <- prometheus.MustNewConstMetric(l.descChanges, prometheus.CounterValue, float64(ld.Changes), r)
		if !ld.Since.IsZero() {
			ch <- prometheus.MustNewConstMetric(l.descLast, prometheus.GaugeValue, float64(ld.Since.UnixNano())/1e9, r)
		}
		ch <- prometheus.MustNewConstMetric(l.descFlap, prometheus.GaugeValue, b2f(l.isFlapping(r, now)), r)
		ch <- prometheus.MustNewConstMetric(l.descBlocked, prometheus.GaugeValue, b2f(ld.Blocked != nil && !lockFree(ld.Blocked)), r)
		ch <- prometheus.MustNewConstMetric(l.descFree, prometheus.GaugeValue, b2f(lockFree(ld.Blocked)), r)
		for tok, n := range ld.Sessions {
			ch <- prometheus.MustNewConstMetric(l.descSessions, prometheus.GaugeValue, float64(n), r, strconv.FormatInt(tok, 10))
		}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	for k, n := range l.refused {
		ch <- prometheus.MustNewConstMetric(l.descRefused, prometheus.CounterValue, n, k[0], k[1])
	}
	for r, n := range l.ended {
		ch <- prometheus.MustNewConstMetric(l.descEnded, prometheus.CounterValue, n, r)
	}
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
