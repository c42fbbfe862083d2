//go:build !linux

package lease

import (
	"errors"
	"os/exec"
	"syscall"
)

// childAttr puts the child in its own process group. Outside Linux there is no parent-death
// signal: a supervisor killed with SIGKILL leaves its child running until the next holder's
// token fences it.
func childAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true}
}

// watchChild reports the child's exit on exited. Outside Linux it reaps the child at once
// (there is no portable wait that leaves it a zombie), so its group's id is not pinned
// while what the child left running is stopped.
func watchChild(cmd *exec.Cmd) *child {
	c := &child{cmd: cmd, exited: make(chan struct{})}
	go func() { c.werr = cmd.Wait(); close(c.exited) }()
	return c
}

// reap returns the exited child's status.
func (c *child) reap() error {
	<-c.exited
	return c.werr
}

// groupLive reports whether a process of the group is left.
func groupLive(pgid int) bool {
	return !errors.Is(syscall.Kill(-pgid, 0), syscall.ESRCH)
}
