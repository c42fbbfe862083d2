package lease

import "sync"

// Outcome is how a held lease ends: Done closes once, when the lease is lost or released,
// and Err says which. Leases embed it for their Done and Err methods.
type Outcome struct {
	done chan struct{}
	mu   sync.Mutex
	err  error
}

// NewOutcome is the outcome of a lease just granted.
func NewOutcome() Outcome { return Outcome{done: make(chan struct{})} }

// Done is closed when the lease is lost or released; Err says which.
func (o *Outcome) Done() <-chan struct{} { return o.done }

// Err is nil while the lease is held; after Done it wraps ErrLockLost or is ErrReleased.
func (o *Outcome) Err() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.err
}

// Finish ends the lease with err, unless it ended already.
func (o *Outcome) Finish(err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.err == nil {
		o.err = err
		close(o.done)
	}
}
