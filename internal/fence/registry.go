package fence

import (
	"sync"
)

// Registry keeps, per resource, the highest token this proxy instance knows
// to be admitted, and tells sessions holding a lower token that they went
// stale. It is an optimisation: the database check is the guarantee, so a
// registry that is late (a lost notification) only delays early refusal.
type Registry struct {
	mu  sync.Mutex
	res map[string]*entry
}

type entry struct {
	highest int64
	blocked *Error // non-nil: every session of the resource is refused with it
	subs    map[*Subscription]struct{}
}

// Handler receives a session's notifications. Its functions must not block.
type Handler struct {
	// Stale is called at most once, when a token higher than the session's
	// is admitted.
	Stale func(admitted int64)
	// Blocked is called when the resource is blocked (err) or unblocked (nil):
	// the lock is held by nobody, or its LockIndex went backwards.
	Blocked func(err *Error)
}

// Subscription is one session's interest in a resource.
type Subscription struct {
	r        *Registry
	resource string
	token    int64
	h        Handler
	fired    bool
}

// NewRegistry returns an empty registry.
func NewRegistry() *Registry {
	return &Registry{res: map[string]*entry{}}
}

func (r *Registry) get(resource string) *entry {
	e := r.res[resource]
	if e == nil {
		e = &entry{subs: map[*Subscription]struct{}{}}
		r.res[resource] = e
	}
	return e
}

// Observe records that token was admitted for resource. Subscribers whose
// token is lower are told once, outside the registry's lock.
func (r *Registry) Observe(resource string, token int64) {
	r.mu.Lock()
	e := r.get(resource)
	if token <= e.highest {
		r.mu.Unlock()
		return
	}
	e.highest = token
	var fire []*Subscription
	for s := range e.subs {
		if s.token < token && !s.fired {
			s.fired = true
			fire = append(fire, s)
		}
	}
	r.mu.Unlock()
	for _, s := range fire {
		if s.h.Stale != nil {
			s.h.Stale(token)
		}
	}
}

// Block refuses every session of resource with err until Block(resource,
// nil). Sessions are told at once.
func (r *Registry) Block(resource string, err *Error) {
	r.mu.Lock()
	e := r.get(resource)
	if e.blocked == err {
		r.mu.Unlock()
		return
	}
	e.blocked = err
	subs := make([]*Subscription, 0, len(e.subs))
	for s := range e.subs {
		subs = append(subs, s)
	}
	r.mu.Unlock()
	for _, s := range subs {
		if s.h.Blocked != nil {
			s.h.Blocked(err)
		}
	}
}

// Blocked returns the error resource is blocked with, or nil.
func (r *Registry) Blocked(resource string) *Error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if e := r.res[resource]; e != nil {
		return e.blocked
	}
	return nil
}

// Reset forgets what is known about resource and sets it to token, even if
// lower. It is the operator's way out after a LockIndex regression (see
// fence.reset in the migrations).
func (r *Registry) Reset(resource string, token int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.get(resource).highest = token
}

// Highest returns the highest token known for resource (0: none).
func (r *Registry) Highest(resource string) int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	if e := r.res[resource]; e != nil {
		return e.highest
	}
	return 0
}

// Subscribe registers a session holding token for resource. If the token is
// already stale, or the resource blocked, h is called before Subscribe returns.
func (r *Registry) Subscribe(resource string, token int64, h Handler) *Subscription {
	s := &Subscription{r: r, resource: resource, token: token, h: h}
	r.mu.Lock()
	e := r.get(resource)
	e.subs[s] = struct{}{}
	stale := e.highest > token
	if stale {
		s.fired = true
	}
	highest, blocked := e.highest, e.blocked
	r.mu.Unlock()
	if stale && h.Stale != nil {
		h.Stale(highest)
	}
	if blocked != nil && h.Blocked != nil {
		h.Blocked(blocked)
	}
	return s
}

// Sessions returns how many sessions are subscribed to resource.
func (r *Registry) Sessions(resource string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	if e := r.res[resource]; e != nil {
		return len(e.subs)
	}
	return 0
}

// Close removes the subscription.
func (s *Subscription) Close() {
	if s == nil {
		return
	}
	s.r.mu.Lock()
	defer s.r.mu.Unlock()
	if e := s.r.res[s.resource]; e != nil {
		delete(e.subs, s)
	}
}
