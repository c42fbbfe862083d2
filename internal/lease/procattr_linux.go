package lease

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// childAttr puts the child in its own process group (so that stopping it stops everything it
// started) and asks Linux to SIGKILL it if the supervisor dies first (PR_SET_PDEATHSIG): a
// supervisor killed with SIGKILL, or crashed, can neither stop its child nor keep renewing the
// lease, so the child must not go on writing with the token until the next holder fences it.
// SIGKILL, not SIGTERM: nobody is left to escalate after a grace period.
//
// Linux sends the signal when the thread that started the child exits, not the process; the Go
// runtime does not end its threads (none of this package's goroutines locks one), so in
// practice that is the supervisor's death. Only the direct child gets it: a child that starts
// long-running processes of its own should exec into its main program (`exec ./job`) or stop
// them itself.
func childAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}

// watchChild reports the child's exit on exited WITHOUT reaping it (waitid with WNOWAIT):
// until reap, the exited child is a zombie that keeps its pid, which is also its process
// group's id, from being handed to a new process. So every signal to -pgid (stopping what
// the child left running) reaches the child's group and nothing else: once a group's
// leader is reaped and its last member gone, Linux may give that number to any new
// process, and one that makes itself a group leader (a server started with Setpgid) would
// get a SIGTERM or SIGKILL meant for the child's leftovers.
func watchChild(cmd *exec.Cmd) *child {
	c := &child{cmd: cmd, exited: make(chan struct{})}
	pid := cmd.Process.Pid
	go func() {
		defer close(c.exited)
		for {
			var info unix.Siginfo
			err := unix.Waitid(unix.P_PID, pid, &info, unix.WEXITED|unix.WNOWAIT, nil)
			if !errors.Is(err, unix.EINTR) {
				return // exited; any other error (none expected) also ends the wait: reap tells
			}
		}
	}()
	return c
}

// reap collects the exited child's status (cmd.Wait: it also waits, up to WaitDelay, for
// the copy of its output).
func (c *child) reap() error {
	<-c.exited
	return c.cmd.Wait()
}

// groupLive reports whether a process of the group other than a zombie is left. The
// child itself stays a zombie until reap, so kill(-pgid, 0), which counts zombies, cannot
// tell; /proc/<pid>/stat gives each process's state and group.
func groupLive(pgid int) bool {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return !errors.Is(syscall.Kill(-pgid, 0), syscall.ESRCH)
	}
	for _, e := range entries {
		if e.Name()[0] < '0' || e.Name()[0] > '9' {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue // gone since ReadDir
		}
		// pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses.
		i := bytes.LastIndexByte(b, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(b[i+1:]))
		if len(f) < 3 || f[0] == "Z" || f[0] == "X" {
			continue
		}
		if g, err := strconv.Atoi(f[2]); err == nil && g == pgid {
			return true
		}
	}
	return false
}
