package lease

import "syscall"

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
