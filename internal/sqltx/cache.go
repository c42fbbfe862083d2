package sqltx

import (
	"strings"
	"sync"
)

// MaxCachedText is the longest text a Cache keeps: longer ones are analysed
// every time. With the entry limit it bounds a cache's memory (1024 entries of
// at most 16 KiB: 16 MiB in the worst case, far less for usual statements).
const MaxCachedText = 16 << 10

// Cache remembers the analysis of recently seen texts, so that a text sent
// again (the same prepared statement parsed by many connections, unnamed
// statements re-parsed on every execution, BEGIN, COMMIT) costs a map lookup
// instead of parses. It also remembers the check statements it has validated.
// Results are identical to the package-level functions'.
//
// A Cache is safe for concurrent use. The nil *Cache is valid and caches
// nothing.
type Cache struct {
	mu      sync.Mutex
	size    int
	entries map[string]*cacheEntry
	lru     cacheEntry // sentinel: lru.next is the most recently used
	checks  map[string]struct{}
}

type cacheEntry struct {
	key        string
	a          *analysis // never modified once in the cache
	prev, next *cacheEntry
}

// maxChecks bounds the set of validated checks (one per resource and token in
// use, so few); it is emptied when full.
const maxChecks = 256

// NewCache returns a cache of at most size texts (1024 when size <= 0).
func NewCache(size int) *Cache {
	if size <= 0 {
		size = 1024
	}
	c := &Cache{size: size, entries: make(map[string]*cacheEntry, size), checks: map[string]struct{}{}}
	c.lru.next, c.lru.prev = &c.lru, &c.lru
	return c
}

// Len returns the number of texts in the cache.
func (c *Cache) Len() int {
	if c == nil {
		return 0
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.entries)
}

// Split is the package-level Split, cached.
func (c *Cache) Split(sql string) ([]Statement, error) {
	a, err := c.analyze(sql, true)
	if err != nil {
		return nil, err
	}
	return append([]Statement(nil), a.stmts...), nil
}

// Classify is the package-level Classify, cached.
func (c *Cache) Classify(sql string) (Kind, error) {
	if c == nil {
		return Classify(sql)
	}
	if a := c.get(sql); a != nil {
		if len(a.stmts) > 1 {
			return Other, ErrMultipleStatements
		}
		if len(a.stmts) == 0 {
			return Other, nil
		}
		return a.stmts[0].Kind, nil
	}
	a, err := classify(sql)
	if err != nil {
		return Other, err
	}
	if len(sql) <= MaxCachedText {
		c.put(sql, a)
	}
	if len(a.stmts) == 0 {
		return Other, nil
	}
	return a.stmts[0].Kind, nil
}

// PlanQuery is the package-level PlanQuery, cached.
func (c *Cache) PlanQuery(sql string, inBlock, failed bool, check string) (QueryPlan, error) {
	if c == nil {
		return PlanQuery(sql, inBlock, failed, check)
	}
	if err := c.validateCheck(check); err != nil {
		return QueryPlan{}, err
	}
	a, err := c.analyze(sql, false)
	if err != nil {
		return QueryPlan{}, err
	}
	return plan(sql, a, inBlock, failed, check)
}

func (c *Cache) validateCheck(check string) error {
	c.mu.Lock()
	_, ok := c.checks[check]
	c.mu.Unlock()
	if ok {
		return nil
	}
	if err := validateCheck(check); err != nil {
		return err
	}
	c.mu.Lock()
	if len(c.checks) >= maxChecks {
		clear(c.checks)
	}
	c.checks[strings.Clone(check)] = struct{}{}
	c.mu.Unlock()
	return nil
}

// analyze returns a cached analysis that has what the caller needs (see
// sufficient), or computes and caches one.
func (c *Cache) analyze(sql string, all bool) (*analysis, error) {
	if c == nil {
		return analyze(sql, all)
	}
	if a := c.get(sql); a != nil && sufficient(a, all) {
		return a, nil
	}
	a, err := analyze(sql, all)
	if err == nil && len(sql) <= MaxCachedText {
		c.put(sql, a)
	}
	return a, err
}

// sufficient reports whether a cached analysis answers a request: Split needs
// every offset; PlanQuery needs the Start of each commit point (kinds are
// known in every analysis).
func sufficient(a *analysis, all bool) bool {
	if all {
		return a.all
	}
	for _, s := range a.stmts {
		if s.Kind.CommitPoint() && s.Start < 0 {
			return false
		}
	}
	return true
}

func (c *Cache) get(sql string) *analysis {
	c.mu.Lock()
	defer c.mu.Unlock()
	e := c.entries[sql]
	if e == nil {
		return nil
	}
	c.unlink(e)
	c.pushFront(e)
	return e.a
}

func (c *Cache) put(sql string, a *analysis) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e := c.entries[sql]; e != nil {
		e.a = a
		c.unlink(e)
		c.pushFront(e)
		return
	}
	if len(c.entries) >= c.size {
		old := c.lru.prev
		c.unlink(old)
		delete(c.entries, old.key)
	}
	// The caller's string may share memory with a buffer it reuses: keep a copy.
	e := &cacheEntry{key: strings.Clone(sql), a: a}
	c.entries[e.key] = e
	c.pushFront(e)
}

func (c *Cache) unlink(e *cacheEntry) {
	e.prev.next, e.next.prev = e.next, e.prev
}

func (c *Cache) pushFront(e *cacheEntry) {
	e.prev, e.next = &c.lru, c.lru.next
	c.lru.next.prev = e
	c.lru.next = e
}
