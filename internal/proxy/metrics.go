package proxy

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the proxy's Prometheus metrics. A nil *Metrics is valid and
// records nothing.
type Metrics struct {
	Sessions      prometheus.Gauge
	SessionsTotal *prometheus.CounterVec // by outcome: ok, refused, error
	Rejections    *prometheus.CounterVec // by sqlstate
	Checks        prometheus.Counter
	CheckFailures prometheus.Counter
	Cancels       prometheus.Counter
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
		Checks: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "fenceproxy_checks_injected_total", Help: "Commit-time checks injected."}),
		CheckFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "fenceproxy_check_failures_total", Help: "Commit-time checks that rejected a transaction."}),
		Cancels: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "fenceproxy_stale_cancels_total", Help: "In-flight queries cancelled because their session went stale."}),
	}
	if reg != nil {
		reg.MustRegister(m.Sessions, m.SessionsTotal, m.Rejections, m.Checks, m.CheckFailures, m.Cancels)
	}
	return m
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

// checks counts n injected checks.
func (m *Metrics) checks(n int) {
	if m != nil && n > 0 {
		m.Checks.Add(float64(n))
	}
}

func (m *Metrics) checkFailure() {
	if m != nil {
		m.CheckFailures.Inc()
	}
}

func (m *Metrics) cancel() {
	if m != nil {
		m.Cancels.Inc()
	}
}

func (m *Metrics) sessions(d float64) {
	if m != nil {
		m.Sessions.Add(d)
	}
}
