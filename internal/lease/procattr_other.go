//go:build !linux

package lease

import "syscall"

// childAttr puts the child in its own process group. Outside Linux there is no parent-death
// signal: a supervisor killed with SIGKILL leaves its child running until the next holder's
// token fences it.
func childAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true}
}
