package lease

import (
	"fmt"
	"os"
	"strings"
	"time"
)

// Clock is where a Consul session's keep-alive reads the time: when the last renewal was
// sent, and whether a whole TTL has passed since (the moment it stops trusting its lease).
// nil means time.Now.
//
// Nothing that decides who holds a lease reads it: Consul invalidates a session by its own
// clock, and a raise or a fencing refusal happens in PostgreSQL. A Clock that lies only moves
// the moment a holder gives up on its own: earlier when it runs ahead, later when it runs
// behind, and fencing refuses what a holder that gave up too late still writes.
type Clock func() time.Time

// OffsetFileClock is a Clock for fault injection (the chaos campaign's clock jump): the wall
// clock shifted by the duration written in the file at path ("90s", "-1m", "0"), read again
// at every reading, so that rewriting the file jumps the clock of a running process forward
// or back. A missing, empty or unreadable file means no shift.
//
// Its readings carry no monotonic reading: the code that reads them compares wall times, as
// code that rested on the system clock would, so a jump moves its deadlines. (time.Now's own
// readings compare by the monotonic clock, which a step of the system clock does not move;
// and libfaketime, which fakes the C library's clock, never reaches a Go program, whose
// runtime reads the clock from the kernel itself.)
func OffsetFileClock(path string) Clock {
	return func() time.Time {
		return time.Now().Round(0).Add(readOffset(path))
	}
}

func readOffset(path string) time.Duration {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	d, err := ParseOffset(string(b))
	if err != nil {
		return 0
	}
	return d
}

// ParseOffset reads the content of an OffsetFileClock's file: a Go duration, a leading + or
// - allowed, surrounding space ignored; empty is 0.
func ParseOffset(s string) (time.Duration, error) {
	s = strings.TrimSpace(s)
	if s == "" || s == "0" {
		return 0, nil
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return 0, fmt.Errorf("lease: clock offset %q: %w", s, err)
	}
	return d, nil
}
