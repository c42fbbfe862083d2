package sqltx

import (
	"hash/maphash"
	"math/bits"
	"strings"
	"sync"
)

// MaxCachedText is the longest text a Cache keeps: longer ones are analysed
// every time. With the entry limit it bounds a cache's memory (1024 entries of
// at most 16 KiB: 16 MiB in the worst case, far less for usual statements).
const MaxCachedText = 16 << 10

// Cache remembers the analysis of texts that come again, so that a text sent
// repeatedly (the same prepared statement parsed by many connections, unnamed
// statements re-parsed on every execution, BEGIN, COMMIT) costs a map lookup
// instead of parses. It also remembers the check statements it has validated.
// Results are identical to the package-level functions'.
//
// A text is kept the second time it is seen, not the first (see doc.go,
// "Performance"): most simple-protocol texts carry literal values and never
// come again, and keeping each of them would cost an insertion and the
// eviction of a text that does come again. So the first two analyses of a
// text cost what the package-level functions cost; later ones are hits while
// the text stays among the size most recently used. A first sighting is
// remembered as a hash in a table of at least size slots, where a later text
// with the same slot replaces it: a text that comes back only after many new
// ones may have to be seen twice again.
//
// A Cache is safe for concurrent use. The nil *Cache is valid and caches
// nothing.
type Cache struct {
	mu      sync.Mutex
	size    int
	entries map[string]*cacheEntry
	lru     cacheEntry // sentinel: lru.next is the most recently used
	checks  map[string]struct{}
	// seen holds hashes of texts seen once and not cached (0: none), at
	// hash & mask.
	seen []uint64
	mask uint64
	seed maphash.Seed
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
	slots := 1 << bits.Len(uint(size-1)) // a power of two, at least size
	c := &Cache{
		size:    size,
		entries: make(map[string]*cacheEntry, size),
		checks:  map[string]struct{}{},
		seen:    make([]uint64, slots),
		mask:    uint64(slots - 1),
		seed:    maphash.MakeSeed(),
	}
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
	a, keep := c.get(sql)
	if a != nil {
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
	if keep {
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
	// One lock for both lookups: this runs for every simple Query.
	c.mu.Lock()
	_, checked := c.checks[check]
	a, keep := c.getLocked(sql)
	c.mu.Unlock()
	if !checked {
		if err := c.validateCheck(check); err != nil {
			return QueryPlan{}, err
		}
	}
	if a == nil || !sufficient(a, false) {
		var err error
		if a, err = c.compute(sql, false, keep); err != nil {
			return QueryPlan{}, err
		}
	}
	return plan(sql, a, inBlock, failed, check)
}

// validateCheck validates check and remembers it.
func (c *Cache) validateCheck(check string) error {
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
	a, keep := c.get(sql)
	if a != nil && sufficient(a, all) {
		return a, nil
	}
	return c.compute(sql, all, keep)
}

// compute analyses sql and caches the result when keep is set.
func (c *Cache) compute(sql string, all, keep bool) (*analysis, error) {
	a, err := analyze(sql, all)
	if err == nil && keep {
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

// get returns the cached analysis of sql (nil if none), and whether an
// analysis of sql should be put in the cache: when sql is cached already (its
// analysis may lack what the caller needs), or seen before (see Cache).
func (c *Cache) get(sql string) (a *analysis, keep bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.getLocked(sql)
}

func (c *Cache) getLocked(sql string) (a *analysis, keep bool) {
	if e := c.entries[sql]; e != nil {
		c.unlink(e)
		c.pushFront(e)
		return e.a, true
	}
	if len(sql) > MaxCachedText {
		return nil, false
	}
	h := maphash.String(c.seed, sql) | 1 // never 0, the empty slot
	slot := &c.seen[h&c.mask]
	if *slot == h {
		*slot = 0
		return nil, true
	}
	*slot = h
	return nil, false
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
