package procgroup

import (
	"errors"
	"os"
	"os/exec"
	"sync"
	"syscall"
)

// Leader is a started child that leads its own process group (Setpgid).
type Leader struct {
	cmd    *exec.Cmd
	pid    int
	exited chan struct{}

	mu     sync.Mutex
	reaped bool
	status error // Wait's result, once reaped
}

// Watch watches cmd, started with Setpgid. Exited is closed when the leader has exited; on
// Linux it stays unreaped, so its pid (the group's id) stays taken, until Reap.
func Watch(cmd *exec.Cmd) *Leader {
	l := &Leader{cmd: cmd, pid: cmd.Process.Pid, exited: make(chan struct{})}
	go func() {
		defer close(l.exited)
		if pinned {
			if err := waitExited(l.pid); err == nil {
				return
			}
			// No waitid (never expected): reap now, as outside Linux.
		}
		err := cmd.Wait()
		l.mu.Lock()
		l.reaped, l.status = true, err
		l.mu.Unlock()
	}()
	return l
}

// Pid is the leader's pid, the group's id.
func (l *Leader) Pid() int { return l.pid }

// Exited is closed once the leader has exited.
func (l *Leader) Exited() <-chan struct{} { return l.exited }

// Signal sends sig to the whole group, unless the leader is reaped already (then the id
// may belong to another group by now): os.ErrProcessDone. A group that has no process
// left gives os.ErrProcessDone too.
func (l *Leader) Signal(sig syscall.Signal) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.reaped {
		return os.ErrProcessDone
	}
	err := syscall.Kill(-l.pid, sig)
	if errors.Is(err, syscall.ESRCH) {
		return os.ErrProcessDone
	}
	return err
}

// Live reports whether a process of the group other than a zombie is left (false once
// the leader is reaped: the group's id is not ours to ask about any more).
func (l *Leader) Live() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return !l.reaped && live(l.pid)
}

// Reap waits for the leader to exit, reaps it (exec.Cmd.Wait: also the copy of its output,
// up to the Cmd's WaitDelay) and returns its status; later calls return the same status.
// From then on Signal does nothing: call it after the group is stopped.
func (l *Leader) Reap() error {
	<-l.exited
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.reaped {
		l.reaped, l.status = true, l.cmd.Wait()
	}
	return l.status
}
