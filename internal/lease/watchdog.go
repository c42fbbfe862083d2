package lease

import (
	"context"
	"fmt"
	"os"
	"time"
)

// Watchdog ties leadership to progress: a leader whose work is stuck must not keep the
// lease just because its supervisor still renews it. The child proves progress by touching
// File (changing its modification time) at least once every Timeout; when Timeout passes
// without a touch, RunLocked stops the child (SIGTERM, SIGKILL after Grace), then releases
// the lease, and returns a *WatchdogError, so that another candidate can lead.
//
// Progress is a change of the file's modification time as RunLocked sees it, measured on
// RunLocked's own monotonic clock: the file's clock (a network file system's) does not
// matter. Choose Timeout well above the file system's timestamp granularity and the
// child's longest honest pause.
type Watchdog struct {
	File    string        // the file the child touches; created (or touched) as the child starts
	Timeout time.Duration // the longest time without a touch
}

// WatchdogExitCode is the exit status of a command line tool whose child the watchdog
// stopped: timeout(1)'s.
const WatchdogExitCode = 124

// WatchdogError is RunLocked's answer when the watchdog stopped the child.
type WatchdogError struct {
	File    string
	Timeout time.Duration
	Exit    error // the stopped child's result (nil, or an *ExitError)
}

func (e *WatchdogError) Error() string {
	return fmt.Sprintf("lease: watchdog: %s not touched for %s: the child was stopped and the lease released", e.File, e.Timeout)
}

func (e *WatchdogError) Unwrap() error { return e.Exit }

// ExitCode returns WatchdogExitCode, for callers that ask errors.As(err, &interface{ ExitCode() int }).
func (e *WatchdogError) ExitCode() int { return WatchdogExitCode }

func (w *Watchdog) validate() error {
	if w.File == "" {
		return fmt.Errorf("lease: RunLocked: Watchdog without a File")
	}
	if w.Timeout <= 0 {
		return fmt.Errorf("lease: RunLocked: Watchdog timeout %s: want > 0", w.Timeout)
	}
	// What arm will do, before campaigning: a file that cannot be created or written (its
	// folder missing, not writable) must fail the start, not the leader that just won
	// (raising the token and ending the previous holder's sessions for nothing).
	f, err := os.OpenFile(w.File, os.O_WRONLY|os.O_CREATE, 0o644)
	if err != nil {
		return fmt.Errorf("lease: RunLocked: Watchdog file: %w", err)
	}
	return f.Close()
}

// arm touches the file and watches it until ctx ends; the returned channel is closed when
// Timeout has passed without a change of its modification time.
func (w *Watchdog) arm(ctx context.Context) (<-chan struct{}, error) {
	f, err := os.OpenFile(w.File, os.O_WRONLY|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("lease: watchdog file: %w", err)
	}
	f.Close()
	now := time.Now()
	if err := os.Chtimes(w.File, now, now); err != nil {
		return nil, fmt.Errorf("lease: watchdog file: %w", err)
	}
	last := modTime(w.File)
	poll := min(max(w.Timeout/10, 10*time.Millisecond), time.Second)
	stalled := make(chan struct{})
	go func() {
		progress := time.Now()
		tick := time.NewTicker(poll)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			if m := modTime(w.File); !m.Equal(last) {
				last, progress = m, time.Now()
				continue
			}
			if time.Since(progress) >= w.Timeout {
				close(stalled)
				return
			}
		}
	}()
	return stalled, nil
}

// modTime is the file's modification time; a file that cannot be read has the zero time
// (its removal counts as one change, not as progress that goes on).
func modTime(path string) time.Time {
	fi, err := os.Stat(path)
	if err != nil {
		return time.Time{}
	}
	return fi.ModTime()
}
