//go:build !linux

package procgroup

import (
	"errors"
	"syscall"
)

// pinned: outside Linux there is no portable wait that leaves the leader unreaped, so Watch
// reaps it at once, and Signal does nothing after that.
const pinned = false

func waitExited(int) error { return errors.ErrUnsupported }

// live reports whether a process of the group is left (zombies included).
func live(pgid int) bool {
	return !errors.Is(syscall.Kill(-pgid, 0), syscall.ESRCH)
}
