package proxy

import (
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/fenceproxy/fenceproxy/internal/standby"
)

// Metrics are the proxy's Prometheus metrics. A nil *Metrics is valid and
// records nothing.
type Metrics struct {
	Sessions      prometheus.Gauge
	SessionsTotal *prometheus.CounterVec // by outcome: ok, refused, error
	Rejections    *prometheus.CounterVec // by sqlstate
	// BindSeconds is the time of fenced sessions' binds (raises included:
	// a bind that raises waits for the stale backends to exit), by outcome.
	BindSeconds *prometheus.HistogramVec
	// HandBacks counts the sessions the event loop gave back to the goroutine relay, by
	// reason (loop_linux.go): end, message, full, recall.
	HandBacks *prometheus.CounterVec
	// StandbyWaitSeconds is how long fenced sessions' starts waited for the failover standbys
	// to flush their bind (--failover-standbys), by outcome: flushed, timeout, error.
	StandbyWaitSeconds *prometheus.HistogramVec
	// UpstreamChanges counts the control connection's sightings of a new server or timeline
	// behind --upstream (a failover), by kind: server, timeline.
	UpstreamChanges *prometheus.CounterVec
}

// NewMetrics creates the metrics and registers them with reg (if not nil).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		Sessions: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "fenceproxy_sessions", Help: "Client sessions currently open."}),
		SessionsTotal: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "fenceproxy_sessions_total", Help: "Client connections by outcome of their startup."}, []string{"outcome"}),
		Rejections: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "fenceproxy_rejections_total", Help: "Fencing rejections sent to clients, by SQLSTATE."}, []string{"sqlstate"}),
		BindSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "fenceproxy_bind_seconds", Help: "Time to bind a fenced session to its token at startup (a bind that raises includes ending the stale backends), by outcome: bound, refused.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14)}, []string{"outcome"}),
		HandBacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "fenceproxy_relay_handbacks_total", Help: "Sessions the event loop relayed and then gave to the goroutine relay, by reason: end (a connection ended or failed), message (one the loop leaves to it: Terminate, an error to look at, a refusal), full (a connection did not take what was read for it), recall (the proxy ended the session or shuts down)."}, []string{"reason"}),
		StandbyWaitSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "fenceproxy_standby_wait_seconds", Help: "Time fenced session starts waited for --failover-standbys to flush their bind, by outcome: flushed, timeout, error.",
			Buckets: prometheus.ExponentialBuckets(0.0002, 2, 16)}, []string{"outcome"}),
		UpstreamChanges: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "fenceproxy_upstream_changes_total", Help: "New primaries (server: another system identifier) or timelines (timeline: a promotion) seen behind --upstream by the control connection."}, []string{"kind"}),
	}
	if reg != nil {
		reg.MustRegister(m.collectors()...)
	}
	return m
}

// collectors are the metrics, for a registry: /metrics's and the admin console's SHOW STATS.
func (m *Metrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.Sessions, m.SessionsTotal, m.Rejections, m.BindSeconds, m.HandBacks, m.StandbyWaitSeconds, m.UpstreamChanges}
}

func (m *Metrics) sessionOutcome(o string) {
	if m != nil {
		m.SessionsTotal.WithLabelValues(o).Inc()
	}
}

func (m *Metrics) rejection(code string) {
	if m != nil {
		m.Rejections.WithLabelValues(code).Inc()
	}
}

func (m *Metrics) bind(outcome string, d time.Duration) {
	if m != nil {
		m.BindSeconds.WithLabelValues(outcome).Observe(d.Seconds())
	}
}

func (m *Metrics) sessions(d float64) {
	if m != nil {
		m.Sessions.Add(d)
	}
}

func (m *Metrics) handBack(reason string) {
	if m != nil {
		m.HandBacks.WithLabelValues(reason).Inc()
	}
}

func (m *Metrics) standbyWait(err error, d time.Duration) {
	if m == nil {
		return
	}
	outcome := "flushed"
	var nf *standby.NotFlushedError
	switch {
	case errors.As(err, &nf):
		outcome = "timeout"
	case err != nil:
		outcome = "error"
	}
	m.StandbyWaitSeconds.WithLabelValues(outcome).Observe(d.Seconds())
}

func (m *Metrics) upstreamChange(kind string) {
	if m != nil {
		m.UpstreamChanges.WithLabelValues(kind).Inc()
	}
}
