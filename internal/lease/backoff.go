package lease

import (
	"context"
	"math/rand/v2"
	"time"
)

// Backoff is capped exponential backoff with jitter, reset on success. It is small enough
// that a library (cenkalti/backoff) would add a dependency and an API to learn for the
// dozen lines we need, and it waits on a ctx, which is what every caller here has.
type Backoff struct {
	min, max, next time.Duration
}

func NewBackoff(min, max time.Duration) *Backoff {
	return &Backoff{min: min, max: max, next: min}
}

// Wait sleeps for the next delay (between half of it and all of it, so that many
// watchers restarted by one outage do not retry in step) and reports false if ctx ended
// first.
func (b *Backoff) Wait(ctx context.Context) bool {
	d := b.next
	if d > 1 {
		d = d/2 + rand.N(d/2+1)
	}
	b.next = min(2*b.next, b.max)
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// Reset starts the delays again from the shortest (after a success).
func (b *Backoff) Reset() { b.next = b.min }

// Sleep waits for d, or until ctx ends.
func Sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
