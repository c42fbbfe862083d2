package lease_test

import (
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/lease"
)

func TestEncodeToken(t *testing.T) {
	const maxLock = 1<<lease.LockIndexBits - 1
	const maxCreate = 1<<(63-lease.LockIndexBits) - 1
	for _, tt := range []struct {
		create, lock uint64
		want         int64
		err          bool
	}{
		{1, 1, 1<<24 | 1, false},
		{19, 1, 19<<24 | 1, false},
		{19, 0, 19 << 24, false}, // a plain write's LockIndex 0 still orders
		{maxCreate, maxLock, 1<<63 - 1, false},
		{0, 1, 0, true},
		{1, maxLock + 1, 0, true},
		{maxCreate + 1, 1, 0, true},
	} {
		got, err := lease.EncodeToken(tt.create, tt.lock)
		if (err != nil) != tt.err || got != tt.want {
			t.Errorf("EncodeToken(%d, %d) = %d, %v; want %d, error %t", tt.create, tt.lock, got, err, tt.want, tt.err)
		}
		if err != nil && !errors.Is(err, lease.ErrTokenRange) {
			t.Errorf("EncodeToken(%d, %d): %v does not match ErrTokenRange", tt.create, tt.lock, err)
		}
		if err == nil {
			if c, l := lease.DecodeToken(got); c != tt.create || l != tt.lock {
				t.Errorf("DecodeToken(%d) = %d, %d", got, c, l)
			}
		}
	}
	// The monotonicity the proxy relies on: a later incarnation (higher CreateIndex) orders
	// above every acquisition of an earlier one, and within one incarnation LockIndex orders.
	r := rand.New(rand.NewPCG(1, 2))
	for range 10000 {
		c1 := 1 + r.Uint64N(maxCreate-1)
		c2 := c1 + 1 + r.Uint64N(maxCreate-c1)
		l1, l2 := r.Uint64N(maxLock+1), r.Uint64N(maxLock+1)
		a, _ := lease.EncodeToken(c1, l1)
		b, _ := lease.EncodeToken(c2, l2)
		if a >= b || a < 0 {
			t.Fatalf("(%d,%d) -> %d not below (%d,%d) -> %d", c1, l1, a, c2, l2, b)
		}
		if l1 < l2 {
			if x, _ := lease.EncodeToken(c1, l2); a >= x {
				t.Fatalf("LockIndex %d -> %d does not grow under CreateIndex %d", l1, l2, c1)
			}
		}
	}
	if _, err := lease.ParseTokenMode("createindex"); err == nil {
		t.Error("ParseTokenMode accepted an unknown mode")
	}
}
