package fence

import (
	"sort"
	"sync"
	"time"
)

// Registry keeps, per database and resource, the highest token this proxy instance knows to
// be admitted, and tells sessions holding a lower token that they went stale. Each database
// has its own fence schema, so a raise in one never makes a session of another stale; what
// Consul says of a resource holds in every database (Observe with database ""). It is an
// optimisation: the database ends stale backends at the raise, so a registry that is late (a
// lost notification) only delays an early refusal or a clear error message.
type Registry struct {
	mu       sync.Mutex
	res      map[string]*entry
	onChange func(Change) // SetOnChange; nil: none
}

// Change is a resource's leader moving to a higher token (see Leader).
type Change struct {
	Resource string
	From, To int64
	At       time.Time
}

type entry struct {
	highest map[string]int64 // database -> highest token admitted there
	global  int64            // highest token known for every database (Consul)
	blocked *Error           // non-nil: every session of the resource is refused with it
	subs    map[*Subscription]struct{}

	// What the status page and the leadership metrics show: the highest token known in any
	// database (the leader), since when, who holds it when known, and how often it moved.
	leader  int64
	since   time.Time
	holder  string
	changes int64
}

// Leader is what a proxy knows of a resource's leadership.
type Leader struct {
	Resource string
	// Token is the highest token known to be admitted, in any database (0: none yet).
	Token int64
	// Since is when this proxy learned of Token.
	Since time.Time
	// Holder is the holder of Token when known (a Consul session), else "".
	Holder string
	// HolderName is the name its lock service knows Holder by (a Consul session's Name),
	// filled in by the proxy, else "".
	HolderName string
	// Changes counts the moves of Token to a higher one since the proxy started (learning the
	// first token is not one).
	Changes int64
	// Sessions is how many sessions of this proxy are bound to each token.
	Sessions map[int64]int
	// Blocked is the reason every session of the resource is refused, or nil.
	Blocked *Error
}

// SetOnChange makes the registry call f, outside its lock, at each Change (nil: none).
func (r *Registry) SetOnChange(f func(Change)) {
	r.mu.Lock()
	r.onChange = f
	r.mu.Unlock()
}

// noteLeader records that token is known for e (under r.mu) and returns the Change, if any.
func (e *entry) noteLeader(resource string, token int64) *Change {
	if token <= e.leader {
		return nil
	}
	from := e.leader
	now := time.Now()
	e.leader, e.since, e.holder = token, now, "" // the holder was the previous token's
	if from == 0 {
		return nil
	}
	e.changes++
	return &Change{Resource: resource, From: from, To: token, At: now}
}

// SetHolder records holder as the holder of token for resource, if token is the leader.
func (r *Registry) SetHolder(resource string, token int64, holder string) {
	if holder == "" {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if e := r.res[resource]; e != nil && e.leader == token {
		e.holder = holder
	}
}

// Leaders returns what is known of every resource the registry has seen, by name.
func (r *Registry) Leaders() []Leader {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]Leader, 0, len(r.res))
	for name, e := range r.res {
		l := Leader{Resource: name, Token: e.leader, Since: e.since, Holder: e.holder, Changes: e.changes,
			Sessions: map[int64]int{}, Blocked: e.blocked}
		for s := range e.subs {
			l.Sessions[s.token]++
		}
		out = append(out, l)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Resource < out[j].Resource })
	return out
}

func (e *entry) top(database string) int64 { return max(e.highest[database], e.global) }

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
	database string
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
		e = &entry{highest: map[string]int64{}, subs: map[*Subscription]struct{}{}}
		r.res[resource] = e
	}
	return e
}

// Observe records that token was admitted for resource in database ("": in every database).
// Subscribers whose token is lower are told once, outside the registry's lock.
func (r *Registry) Observe(database, resource string, token int64) {
	r.mu.Lock()
	e := r.get(resource)
	if database == "" {
		if token <= e.global {
			r.mu.Unlock()
			return
		}
		e.global = token
	} else {
		if token <= e.highest[database] {
			r.mu.Unlock()
			return
		}
		e.highest[database] = token
	}
	change, onChange := e.noteLeader(resource, token), r.onChange
	fire := e.staleSubs()
	r.mu.Unlock()
	r.tell(fire, change, onChange)
}

// staleSub is a subscriber to tell that admitted made it stale.
type staleSub struct {
	s        *Subscription
	admitted int64
}

// staleSubs marks the subscribers of e below their database's highest token as told (under
// r.mu) and returns them.
func (e *entry) staleSubs() []staleSub {
	var fire []staleSub
	for s := range e.subs {
		if top := e.top(s.database); !s.fired && s.token < top {
			s.fired = true
			fire = append(fire, staleSub{s, top})
		}
	}
	return fire
}

// tell calls, outside the registry's lock, the stale subscribers' handlers and then
// onChange with change (each when not nil).
func (r *Registry) tell(fire []staleSub, change *Change, onChange func(Change)) {
	for _, f := range fire {
		if f.s.h.Stale != nil {
			f.s.h.Stale(f.admitted)
		}
	}
	if change != nil && onChange != nil {
		onChange(*change)
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

// Reset forgets what is known about resource in database and sets it to token, even if
// lower; what Consul said of it is forgotten too. It follows fence.reset, the operator's way
// out after a LockIndex regression. A reset to a higher token is a raise (fence.reset ended
// the backends of lower tokens): the subscribers below it are told they are stale, and a
// leader moving up is a Change, as with Observe.
func (r *Registry) Reset(database, resource string, token int64) {
	r.mu.Lock()
	e := r.get(resource)
	from := e.leader
	e.highest[database] = token
	e.global = 0
	e.leader = 0
	for _, t := range e.highest {
		e.leader = max(e.leader, t)
	}
	e.since, e.holder = time.Now(), ""
	var change *Change
	if from != 0 && e.leader > from {
		e.changes++
		change = &Change{Resource: resource, From: from, To: e.leader, At: e.since}
	}
	fire, onChange := e.staleSubs(), r.onChange
	r.mu.Unlock()
	r.tell(fire, change, onChange)
}

// Highest returns the highest token known for resource in database (0: none).
func (r *Registry) Highest(database, resource string) int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	if e := r.res[resource]; e != nil {
		return e.top(database)
	}
	return 0
}

// Subscribe registers a session of database holding token for resource. If the token is
// already stale, or the resource blocked, h is called before Subscribe returns.
func (r *Registry) Subscribe(database, resource string, token int64, h Handler) *Subscription {
	s := &Subscription{r: r, database: database, resource: resource, token: token, h: h}
	r.mu.Lock()
	e := r.get(resource)
	e.subs[s] = struct{}{}
	highest, blocked := e.top(database), e.blocked
	stale := highest > token
	s.fired = stale
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

// Rebase replaces what is known of database with stored, the tokens its fence.tokens holds
// now, even where they are lower: the database's server changed under the proxy (a failover
// to a standby, a new timeline) and what the proxy remembered from the lost timeline is no
// authority any more (a raise that did not reach the standby is gone; its holder's session
// died with the old primary). What Consul said (Observe with database "") stays: that
// authority lives outside the database. Subscribers below the new highest tokens are told,
// as with Observe.
func (r *Registry) Rebase(database string, stored map[string]int64) {
	r.mu.Lock()
	var changes []*Change
	var fire []staleSub
	for name, e := range r.res {
		if tok, ok := stored[name]; ok {
			e.highest[database] = tok
		} else {
			delete(e.highest, database)
		}
		from := e.leader
		e.leader = e.global
		for _, t := range e.highest {
			e.leader = max(e.leader, t)
		}
		if e.leader != from {
			e.since, e.holder = time.Now(), ""
			if from != 0 && e.leader > from {
				e.changes++
				changes = append(changes, &Change{Resource: name, From: from, To: e.leader, At: e.since})
			}
		}
		fire = append(fire, e.staleSubs()...)
	}
	for name, tok := range stored {
		if _, ok := r.res[name]; !ok {
			e := r.get(name)
			e.highest[database] = tok
			e.noteLeader(name, tok)
		}
	}
	onChange := r.onChange
	r.mu.Unlock()
	r.tell(fire, nil, nil)
	for _, c := range changes {
		if onChange != nil {
			onChange(*c)
		}
	}
}
