package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/lease/consul"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/proxy/guards"
)

// ServeCmd runs the proxy. Its flags are proxy.Config's fields.
type ServeCmd struct {
	proxy.Config `embed:""`
}

// Validate refuses what proxy.Config takes as "the default" but a command line or
// configuration file can only mean as a mistake: --flap-changes 0 (its default is 3; 0 would
// call every leader change flapping). kong runs it at startup and at each reload.
func (s *ServeCmd) Validate() error {
	if s.FlapChanges < 1 {
		return fmt.Errorf("flap-changes %d: must be 1 or more", s.FlapChanges)
	}
	return nil
}

// checkConsul fails the start on a misconfigured or unreachable Consul, with the cause.
func checkConsul(ctx context.Context, guard *consul.Guard, timeout time.Duration) error {
	if timeout <= 0 {
		timeout = 15 * time.Second
	}
	cctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	return guard.Check(cctx)
}

// Run serves until SIGTERM/SIGINT, then drains sessions and exits 0. SIGHUP reloads what can
// change without a restart (Server.Reload, and the log level) from the same sources as at
// startup, and logs what it could not apply.
func (s *ServeCmd) Run(ctx context.Context, log *zap.Logger, level zap.AtomicLevel, again reloadSource) error {
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	metrics := proxy.NewMetrics(reg)
	registry := fence.NewRegistry()
	guard, err := guards.Consul(ctx, s.Config, consul.GuardOptions{Logger: log, Registry: registry, Registerer: reg})
	if err != nil {
		return err
	}
	lockGuards, err := guards.Lock(ctx, s.Config, proxy.LockGuardOptions{Logger: log, Registry: registry, Registerer: reg})
	if err != nil {
		return err
	}
	var srv *proxy.Server
	opts := proxy.Options{Logger: log, Metrics: metrics, Registry: registry, Registerer: reg, Version: buildVersion(),
		// The admin console's RELOAD: what SIGHUP does (srv is set before any session starts).
		Reload: func() ([]string, []string, error) { return reload(srv, log, level, again, "admin console RELOAD") }}
	var admitters proxy.Admitters
	if guard != nil {
		admitters = append(admitters, guard)
	}
	for _, g := range lockGuards {
		admitters = append(admitters, g)
	}
	switch len(admitters) {
	case 0:
	case 1:
		opts.Admitter = admitters[0]
	default:
		opts.Admitter = admitters
	}
	if guard != nil {
		if err := checkConsul(ctx, guard, s.ConsulStartTimeout); err != nil {
			return err
		}
	}
	srv, err = proxy.New(s.Config, opts)
	if err != nil {
		return err
	}
	// A key file that is not the one migrate stored fails the start, not every session later
	// (with --control-database; without one the first fenced session of a database says so).
	kctx, cancelKey := context.WithTimeout(ctx, 15*time.Second)
	err = srv.CheckKey(kctx)
	cancelKey()
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", srv.Addr())
	if err != nil {
		return err
	}
	log.Info("fenceproxy listening", zap.String("version", buildVersion()), zap.String("listen", ln.Addr().String()), zap.String("upstream", s.Upstream),
		zap.Strings("resources", s.Resources), zap.String("unfenced", s.Unfenced))

	bg, cancelBG := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelBG()
	if s.MetricsListen != "" {
		addr := s.MetricsListen
		if strings.HasPrefix(addr, ":") {
			addr = "127.0.0.1" + addr // a port alone: loopback, the admin endpoints are not for clients
		}
		aln, err := net.Listen("tcp", addr)
		if err != nil {
			ln.Close()
			return fmt.Errorf("admin listener: %w", err)
		}
		mux := srv.AdminMux(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		if s.DebugPprof {
			mux.HandleFunc("/debug/pprof/", pprof.Index)
			mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
			mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
			mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
		}
		var handler http.Handler = mux
		if ta, ok := aln.Addr().(*net.TCPAddr); ok && ta.IP.IsLoopback() {
			// Reached only from this machine, but also by its browsers: no DNS rebinding.
			handler = proxy.AdminHosts(mux, s.AdminAllowedHosts)
		}
		hs := &http.Server{Handler: handler, ReadHeaderTimeout: 5 * time.Second}
		log.Info("admin listening", zap.String("admin", aln.Addr().String()))
		go func() {
			if err := hs.Serve(aln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				log.Error("admin server failed", zap.Error(err))
			}
		}()
		defer hs.Close()
	}
	if s.ControlDatabase == "" && len(s.Resources) > 0 {
		log.Warn("no --control-database: a session ended by a raise made through another proxy instance sees the server's 57P01 instead of ZF001 with the admitted token")
	}
	if guard != nil {
		go guard.Run(bg) //nolint:errcheck // returns only when bg ends
	}
	for _, g := range lockGuards {
		go g.Run(bg) //nolint:errcheck // returns only when bg ends
	}
	go func() {
		for {
			select {
			case <-bg.Done():
				return
			case <-hup:
				reload(srv, log, level, again, "SIGHUP") //nolint:errcheck // logged
			}
		}
	}()
	err = srv.Serve(ctx, ln)
	log.Info("fenceproxy stopped")
	return err
}

// reload applies the configuration read again; an invalid one changes nothing. by says what
// asked (SIGHUP, the admin console's RELOAD) in the logs. It returns what it applied and what
// needs a restart.
func reload(srv *proxy.Server, log *zap.Logger, level zap.AtomicLevel, again reloadSource, by string) (applied, skipped []string, err error) {
	c, err := again()
	if err == nil {
		applied, skipped, err = srv.Reload(c.Serve.Config)
	}
	if err != nil {
		log.Error("reload ("+by+") failed: nothing changed", zap.Error(err))
		return nil, nil, err
	}
	if lvl, err := zap.ParseAtomicLevel(c.LogLevel); err == nil && lvl.Level() != level.Level() {
		applied = append(applied, fmt.Sprintf("log-level %s (was %s)", lvl.Level(), level.Level()))
		level.SetLevel(lvl.Level())
	}
	log.Info("reloaded ("+by+")", zap.Strings("applied", applied))
	if len(skipped) > 0 {
		log.Warn("reload ("+by+") could not apply these changes; restart to apply them", zap.Strings("not_applied", skipped))
	}
	return applied, skipped, nil
}
