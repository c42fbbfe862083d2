package lease

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/procgroup"
	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// What RunLocked does when the lock is lost while the child runs.
const (
	OnLostRetry = "retry" // stop the child, campaign again, start it again with the new token
	OnLostExit  = "exit"  // stop the child and return an error wrapping ErrLockLost
)

// DefaultGrace is how long RunLocked waits after SIGTERM before SIGKILL.
const DefaultGrace = 10 * time.Second

// Environment variables RunLocked gives the child.
const (
	EnvStore       = "FENCE_STORE"
	EnvResource    = "FENCE_RESOURCE"
	EnvToken       = "FENCE_TOKEN"
	EnvSession     = "FENCE_SESSION"
	EnvKey         = "FENCE_KEY"
	EnvDatabaseURL = "DATABASE_URL"
	// EnvWatchdogFile is the file the child touches to show progress (RunConfig.Watchdog).
	EnvWatchdogFile = "FENCE_WATCHDOG_FILE"
)

// RunConfig configures RunLocked. Zero values mean the defaults.
type RunConfig struct {
	Store    Store    // required: where the lease is won (*ConsulStore, *PostgresStore)
	Resource string   // required: the fenced resource, e.g. "billing"
	Command  []string // required: the program and its arguments

	// DatabaseURL is the base connection URL (postgres://...) the child gets as
	// DATABASE_URL with the fence parameters added (see FencedURL). Empty: the child
	// gets no DATABASE_URL from RunLocked (only the FENCE_* variables).
	DatabaseURL string

	Grace  time.Duration // SIGTERM to SIGKILL; default DefaultGrace
	OnLost string        // OnLostRetry (default) or OnLostExit

	// Watchdog, when not nil, stops the child and gives up the lease when the child stops
	// touching a file (see Watchdog); the child gets the file's path as FENCE_WATCHDOG_FILE.
	Watchdog *Watchdog

	// Env is the child's base environment; nil means os.Environ(). The FENCE_* variables
	// and DATABASE_URL replace any of the same name.
	Env []string
	// Stdin, Stdout, Stderr of the child; nil means the process's own.
	Stdin          io.Reader
	Stdout, Stderr io.Writer

	Logger *zap.Logger // nil: no logs
}

// RunLocked runs cfg.Command as the leader of cfg.Resource: it campaigns for the lease in
// cfg.Store, then starts the command, in its own process group, with FENCE_STORE,
// FENCE_RESOURCE, FENCE_TOKEN (the token of this acquisition: Consul's LockIndex, or the
// PostgreSQL lease's generation), FENCE_SESSION (the holder: Consul's session ID, or the
// lease row's holder name), FENCE_KEY and DATABASE_URL in its environment. It does not know
// or care which store is behind cfg.Store: every store's Lease says when it is lost.
//
//   - The child exits: what it left running in its process group is stopped (SIGTERM,
//     SIGKILL after Grace), then the lease is released (never before: a release while
//     any of it still runs would let a new leader start next to it), and RunLocked
//     returns nil for status 0, else an *ExitError with the status.
//   - The lock is lost: the child's process group gets SIGTERM, then SIGKILL after
//     Grace; then RunLocked campaigns again (OnLostRetry) or returns an error wrapping
//     ErrLockLost (OnLostExit). Fencing, not this signal, is what keeps the old child's
//     late writes out; the signal only stops it from trying.
//   - The supervisor dies without stopping the child (SIGKILL, a crash): on Linux the
//     kernel kills the child (its parent-death signal, childAttr), which can then no longer
//     write with a token whose lease nobody renews.
//   - ctx ends (the supervisor itself was told to stop): the child's group gets SIGTERM
//     and SIGKILL after Grace, and once it has exited the lock is released and the
//     child's status returned as above.
//
// Store errors while campaigning are retried with backoff until ctx ends, except a refusal
// that retrying cannot change (ErrRefused), which is returned; ctx ending before the lease is
// won returns ctx's error, wrapped.
//
// The child runs in its own process group, so a terminal's ^C reaches RunLocked (which
// forwards it as described) and not the child directly; a child that reads a terminal
// from the background group is stopped by SIGTTIN, so give it no terminal stdin.
func RunLocked(ctx context.Context, cfg RunConfig) error {
	if err := cfg.validate(); err != nil {
		return err
	}
	log := cfg.Logger.With(zap.String("resource", cfg.Resource), zap.String("store", cfg.Store.Name()))
	retry := NewBackoff(500*time.Millisecond, 10*time.Second)
	for {
		if ctx.Err() != nil {
			return fmt.Errorf("lease: stopped before acquiring %q: %w", cfg.Resource, ctx.Err())
		}
		l, err := cfg.Store.Campaign(ctx, cfg.Resource)
		if errors.Is(err, ErrRefused) {
			return err
		}
		if err != nil {
			if ctx.Err() == nil {
				log.Warn("campaign failed", zap.Error(err))
				retry.Wait(ctx)
			}
			continue
		}
		retry.Reset()
		log.Info("acquired lock", zap.Int64("token", l.Token()), zap.String("session", l.Holder()), zap.String("key", l.Key()))

		lost, err := supervise(ctx, &cfg, l, log)
		if !lost {
			return err
		}
		release(l, log)
		if cfg.OnLost == OnLostExit {
			return fmt.Errorf("lease: %s: lost leadership: %w", cfg.Resource, l.Err())
		}
		log.Info("campaigning again after lost leadership")
	}
}

func (cfg *RunConfig) validate() error {
	if cfg.Store == nil {
		return errors.New("lease: RunLocked: no Store")
	}
	if cfg.Resource == "" || strings.ContainsAny(cfg.Resource, " \t\r\n=\\") {
		return fmt.Errorf("lease: RunLocked: invalid resource %q", cfg.Resource)
	}
	if len(cfg.Command) == 0 || cfg.Command[0] == "" {
		return errors.New("lease: RunLocked: no command to run")
	}
	// Fail before campaigning, not after winning.
	if _, err := exec.LookPath(cfg.Command[0]); err != nil {
		return fmt.Errorf("lease: RunLocked: %w", err)
	}
	if cfg.Grace <= 0 {
		cfg.Grace = DefaultGrace
	}
	switch cfg.OnLost {
	case "":
		cfg.OnLost = OnLostRetry
	case OnLostRetry, OnLostExit:
	default:
		return fmt.Errorf("lease: RunLocked: OnLost %q: want %q or %q", cfg.OnLost, OnLostRetry, OnLostExit)
	}
	if cfg.Watchdog != nil {
		if err := cfg.Watchdog.validate(); err != nil {
			return err
		}
	}
	if cfg.DatabaseURL != "" {
		if _, err := FencedURL(cfg.DatabaseURL, cfg.Resource, 1, ""); err != nil {
			return fmt.Errorf("lease: RunLocked: %w", err)
		}
	}
	if cfg.Env == nil {
		cfg.Env = os.Environ()
	}
	if cfg.Stdin == nil {
		cfg.Stdin = os.Stdin
	}
	if cfg.Stdout == nil {
		cfg.Stdout = os.Stdout
	}
	if cfg.Stderr == nil {
		cfg.Stderr = os.Stderr
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	return nil
}

// supervise runs the child while the lock is held. lost reports that it ended because the
// lock was lost; otherwise err is the result of RunLocked and the lock was released.
func supervise(ctx context.Context, cfg *RunConfig, lock Lease, log *zap.Logger) (lost bool, err error) {
	env, err := childEnv(cfg, lock)
	if err != nil {
		release(lock, log)
		return false, err
	}
	cmd := exec.Command(cfg.Command[0], cfg.Command[1:]...)
	cmd.Env = env
	cmd.Stdin, cmd.Stdout, cmd.Stderr = cfg.Stdin, cfg.Stdout, cfg.Stderr
	// Own process group, so that stopping the child stops everything it started; on Linux
	// the child is killed if the supervisor dies (childAttr).
	cmd.SysProcAttr = childAttr()
	// When Stdout or Stderr is not a file, Wait also waits for the copy from the pipe,
	// which a process the child left running may hold open: the child's exit must
	// still be seen (and the leftovers stopped) within a second.
	cmd.WaitDelay = time.Second
	var stalled <-chan struct{} // nil: no watchdog, never ready
	if cfg.Watchdog != nil {
		wctx, cancel := context.WithCancel(ctx)
		defer cancel()
		if stalled, err = cfg.Watchdog.arm(wctx); err != nil {
			release(lock, log)
			return false, err
		}
	}
	if err := cmd.Start(); err != nil {
		release(lock, log)
		return false, fmt.Errorf("lease: start %s: %w", cfg.Command[0], err)
	}
	log = log.With(zap.Int64("token", lock.Token()), zap.String("session", lock.Holder()))
	log.Info("child started", zap.Int("pid", cmd.Process.Pid))
	// The child leads its own group; procgroup keeps it unreaped after it exits until the
	// group is stopped, so the group's id cannot be another group's while it is signalled.
	ch := procgroup.Watch(cmd)
	select {
	case <-ch.Exited():
		if ch.Live() {
			// Processes the child started are still running with the token: stop
			// them before a new leader can start next to them.
			log.Info("child exited; stopping what is left of its process group")
			stopGroup(ch, cfg.Grace, log)
		}
		werr := ch.Reap()
		logChildExit(log, werr)
		if werr != nil && lostWithin(lock, lossWait) {
			// A child that gave up on an error as its lock was lost (its stale token's
			// ZF001, when a frozen supervisor and child wake together) ends as a loss:
			// --on-lost decides, as when the loss is seen first (a newcomer saw either,
			// by timing).
			log.Warn("the child exited as the lock was lost: handled as lost leadership (--on-lost)")
			return true, nil
		}
		release(lock, log)
		log.Info("lock released: ending with the child's status (a program that ended is not started again; only a lost lock is campaigned for again)")
		return false, exitResult(werr)
	case <-lock.Done():
		// The lock's own "lock lost" line (its backend's) says why: not said again here.
		log.Warn("lost leadership: stopping child")
		stopGroup(ch, cfg.Grace, log)
		logChildExit(log, ch.Reap())
		return true, nil
	case <-stalled:
		// Stopped before the release, as after an exit: no new leader next to it.
		log.Error("watchdog: the child made no progress: stopping it and giving up the lease",
			zap.String("file", cfg.Watchdog.File), zap.Duration("timeout", cfg.Watchdog.Timeout))
		stopGroup(ch, cfg.Grace, log)
		werr := ch.Reap()
		logChildExit(log, werr)
		release(lock, log)
		return false, &WatchdogError{File: cfg.Watchdog.File, Timeout: cfg.Watchdog.Timeout, Exit: exitResult(werr)}
	case <-ctx.Done():
		log.Info("asked to stop (SIGTERM or SIGINT): stopping the child, then releasing the lock")
		stopGroup(ch, cfg.Grace, log)
		werr := ch.Reap()
		logChildExit(log, werr)
		release(lock, log)
		return false, exitResult(werr)
	}
}

// lossWait bounds how long a child's failed exit waits for its lock to say it was lost.
const lossWait = time.Second

// lostWithin reports whether lock is lost now or within d.
func lostWithin(lock Lease, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-lock.Done():
	case <-t.C:
		return false
	}
	return errors.Is(lock.Err(), ErrLockLost)
}

// logChildExit logs how the child ended: its exit status, or the signal that ended it.
func logChildExit(log *zap.Logger, werr error) {
	var ee *exec.ExitError
	switch {
	case werr == nil || errors.Is(werr, exec.ErrWaitDelay):
		log.Info("child exited (status 0)")
	case errors.As(werr, &ee):
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			log.Info(fmt.Sprintf("child exited (signal %s)", ws.Signal()), zap.Int("signal", int(ws.Signal())))
			return
		}
		log.Info(fmt.Sprintf("child exited (status %d)", ee.ExitCode()), zap.Int("status", ee.ExitCode()))
	default:
		log.Warn("child exited (status unknown)", zap.Error(werr))
	}
}

// stopGroup stops the child's process group: SIGTERM to all of it, then SIGKILL to what
// is left when grace has passed. It returns once the child has exited and no process of
// the group is left but zombies (which nobody may reap), or once the SIGKILL is sent and
// the child has exited. The caller reaps the child after it.
func stopGroup(ch *procgroup.Leader, grace time.Duration, log *zap.Logger) {
	if err := ch.Signal(syscall.SIGTERM); err != nil && !errors.Is(err, os.ErrProcessDone) {
		log.Warn("SIGTERM to child group", zap.Error(err))
	}
	deadline := time.NewTimer(grace)
	defer deadline.Stop()
	poll := time.NewTicker(50 * time.Millisecond)
	defer poll.Stop()
	exited := ch.Exited()
	for {
		select {
		case <-exited:
			exited = nil
		case <-poll.C:
		case <-deadline.C:
			log.Warn("child group still running after the grace period: SIGKILL", zap.Duration("grace", grace))
			if err := ch.Signal(syscall.SIGKILL); err != nil && !errors.Is(err, os.ErrProcessDone) {
				log.Warn("SIGKILL to child group", zap.Error(err))
			}
			<-ch.Exited()
			return
		}
		if exited == nil && !ch.Live() {
			return
		}
	}
}

func exitResult(werr error) error {
	if werr == nil || errors.Is(werr, exec.ErrWaitDelay) {
		// ErrWaitDelay: the child exited 0 and something it started held its output
		// open (and was stopped since).
		return nil
	}
	var ee *exec.ExitError
	if errors.As(werr, &ee) {
		code := ee.ExitCode()
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			code = 128 + int(ws.Signal())
		}
		return &ExitError{Code: code, Err: werr}
	}
	return fmt.Errorf("lease: wait for child: %w", werr)
}

// release releases the lease on a fresh context (the caller's may be over: this runs when
// the supervisor is stopping).
func release(l Lease, log *zap.Logger) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	held := l.Err() == nil
	if err := l.Release(ctx); err != nil {
		log.Warn("release lock", zap.Error(err))
	} else if held {
		log.Info("released lock")
	}
}

func childEnv(cfg *RunConfig, lock Lease) ([]string, error) {
	set := map[string]string{
		EnvStore:    lock.Store(),
		EnvResource: cfg.Resource,
		EnvToken:    strconv.FormatInt(lock.Token(), 10),
		EnvSession:  lock.Holder(),
		EnvKey:      lock.Key(),
	}
	if cfg.DatabaseURL != "" {
		// fence.session names the lock's holder (Consul's session, etcd's lease, ZooKeeper's
		// session), which the proxy checks against the store's; the PostgreSQL lease's token is
		// checked by the database itself (fence.bind), which needs no holder.
		session := ""
		if lock.Store() != StorePostgres {
			session = lock.Holder()
		}
		u, err := FencedURL(cfg.DatabaseURL, cfg.Resource, lock.Token(), session)
		if err != nil {
			return nil, err
		}
		set[EnvDatabaseURL] = u
	}
	if cfg.Watchdog != nil {
		set[EnvWatchdogFile] = cfg.Watchdog.File
	}
	env := make([]string, 0, len(cfg.Env)+len(set))
	for _, kv := range cfg.Env {
		name, _, _ := strings.Cut(kv, "=")
		if _, replaced := set[name]; !replaced {
			env = append(env, kv)
		}
	}
	for _, name := range []string{EnvStore, EnvResource, EnvToken, EnvSession, EnvKey, EnvDatabaseURL, EnvWatchdogFile} {
		if v, ok := set[name]; ok {
			env = append(env, name+"="+v)
		}
	}
	return env, nil
}

// FencedURL returns base, a postgres:// or postgresql:// URL, with the fence parameters
// in its `options` query parameter: "-c fence.resource=R -c fence.token=T" (and
// "-c fence.session=S" when session is not ""). Both libpq and pgx send `options` to the
// server at startup, where the proxy reads it. Options already in base are kept, except
// fence.* settings, which are replaced. Spaces are encoded as %20, never '+': libpq does
// not decode '+' in URIs.
//
// Keyword/value connection strings ("host=... dbname=...") are refused: use the URL form.
func FencedURL(base, resource string, token int64, session string) (string, error) {
	// Not url.Parse: it refuses libpq's multi-host URLs (postgres://h1:5432,h2:5432/db)
	// and would re-encode parts. Only the query string is touched.
	if !strings.HasPrefix(base, "postgres://") && !strings.HasPrefix(base, "postgresql://") {
		return "", errors.New("database URL: want a postgres:// or postgresql:// URL " +
			"(keyword/value connection strings are not supported)")
	}
	rest, fragment, hasFragment := strings.Cut(base, "#")
	prefix, rawQuery, _ := strings.Cut(rest, "?")
	// Work on the raw query so that every other parameter keeps its exact bytes: libpq
	// and Go's url package decode some of them differently ('+').
	var kept []string
	var options string
	if rawQuery != "" {
		for _, part := range strings.Split(rawQuery, "&") {
			name, value, _ := strings.Cut(part, "=")
			if n, err := url.PathUnescape(name); err == nil && n == "options" {
				v, err := url.PathUnescape(value)
				if err != nil {
					return "", fmt.Errorf("database URL: options: %w", err)
				}
				options = strings.TrimSpace(options + " " + v)
				continue
			}
			if part != "" {
				kept = append(kept, part)
			}
		}
	}
	_, others, err := wire.ExtractSettings(wire.SplitOptions(options), func(name string) bool {
		return strings.HasPrefix(name, "fence.")
	})
	if err != nil {
		return "", fmt.Errorf("database URL: %w", err)
	}
	args := append(others, "-c", "fence.resource="+resource, "-c", "fence.token="+strconv.FormatInt(token, 10))
	if session != "" {
		args = append(args, "-c", "fence.session="+session)
	}
	kept = append(kept, "options="+strings.ReplaceAll(url.QueryEscape(wire.JoinOptions(args)), "+", "%20"))
	out := prefix + "?" + strings.Join(kept, "&")
	if hasFragment {
		out += "#" + fragment
	}
	return out, nil
}
