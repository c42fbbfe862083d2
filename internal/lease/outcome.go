package lease

import "sync"

// outcome is how a held lease ends: Done closes once, when the lease is lost or released,
// and Err says which. Leases embed it for their Done and Err methods.
type outcome struct {
	done chan struct{}
	mu   sync.Mutex
	err  error
}

func newOutcome() outcome { return outcome{done: make(chan struct{})} }

// Done is closed when the lease is lost or released; Err says which.
func (o *outcome) Done() <-chan struct{} { return o.done }

// Err is nil while the lease is held; after Done it wraps ErrLockLost or is ErrReleased.
func (o *outcome) Err() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.err
}

// finish ends the lease with err, unless it ended already.
func (o *outcome) finish(err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.err == nil {
		o.err = err
		close(o.done)
	}
}
