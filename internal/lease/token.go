package lease

import (
	"errors"
	"fmt"
	"math"
)

// TokenMode says which number of a Consul lock key is its fencing token.
type TokenMode string

// Token modes.
const (
	// TokenLockIndex: the token is the key's LockIndex (the default, and the only mode
	// before schema version 7). LockIndex restarts at 1 when the key is deleted and
	// created again, which `consul lock` and api.Lock's Destroy do after every release:
	// the proxy then fails closed (a regression) until an operator resets the fence.
	TokenLockIndex TokenMode = "lockindex"
	// TokenCreateLock: the token is CreateIndex × 2^LockIndexBits + LockIndex
	// (EncodeToken). It grows across deletion and re-creation of the key, so hand-overs
	// by `consul lock` and api.Lock + Destroy keep working; see EncodeToken for why.
	TokenCreateLock TokenMode = "create-lock"
)

// LockIndexBits is how many low bits of a create-lock token hold the LockIndex.
// 2^24 (16.7 million) acquisitions of one incarnation of a key, and CreateIndexes up to
// 2^39 (5.5 × 10^11 Raft writes: 17 years at 1000 writes a second) fit in a positive
// 64-bit token. A key past either bound makes its tokens unavailable (ZF007), never wrong:
// for a LockIndex past 2^24, deleting the key while nobody holds it starts a new
// incarnation with a higher token.
const LockIndexBits = 24

const (
	maxLockIndex   = 1<<LockIndexBits - 1
	maxCreateIndex = 1<<(63-LockIndexBits) - 1
)

// ErrTokenRange: a key's indexes do not fit the create-lock encoding. It matches
// ErrUnavailable where a state is checked (TokenError), so the proxy answers ZF007.
var ErrTokenRange = errors.New("lock indexes outside the create-lock token's range")

// ParseTokenMode parses a mode's name; "" is TokenLockIndex.
func ParseTokenMode(s string) (TokenMode, error) {
	switch TokenMode(s) {
	case "", TokenLockIndex:
		return TokenLockIndex, nil
	case TokenCreateLock:
		return TokenCreateLock, nil
	}
	return "", fmt.Errorf("lease: token mode %q: want %q or %q", s, TokenLockIndex, TokenCreateLock)
}

// EncodeToken returns the create-lock token of the acquisition that gave a key
// (createIndex, lockIndex): createIndex << LockIndexBits | lockIndex.
//
// Why it is monotonic, from Consul's own rules (measured on Consul 1.16.3):
//
//   - CreateIndex and ModifyIndex are Raft log indexes: every write gets a higher one
//     than every write before it (a snapshot restore excepted, below).
//   - Within one incarnation of a key (one CreateIndex), every successful acquisition
//     increments LockIndex by one; nothing else raises it. So a later acquisition of the
//     same incarnation has a higher token.
//   - A key deleted and created again gets the Raft index of the creating write as its
//     CreateIndex, higher than every index of the old incarnation, its CreateIndex among
//     them. Its tokens start above every token of the old incarnation, since the old
//     incarnation's LockIndex stayed below 2^LockIndexBits (the encoding refuses it
//     otherwise).
//
// So every acquisition's token is higher than every earlier acquisition's token, whoever
// deleted and re-created the key in between. Two ways remain for the token to go
// backwards, and both are failures a fence must not paper over: a plain write (PUT
// without ?acquire) to a held key resets LockIndex to 0 under the same CreateIndex, and a
// snapshot restore moves every index back. The Watcher detects both as a regression
// (token below the highest it saw) and the proxy fails closed.
//
// A token is only issued for a LockIndex of at least 1 (an acquisition happened); the
// encoding of LockIndex 0 is still computed, so that a plain write on a held key is seen
// as the token going backwards.
func EncodeToken(createIndex, lockIndex uint64) (int64, error) {
	if createIndex == 0 || createIndex > maxCreateIndex || lockIndex > maxLockIndex {
		return 0, fmt.Errorf("%w: CreateIndex %d (at most %d), LockIndex %d (at most %d); "+
			"a LockIndex too high is cured by deleting the key while nobody holds it",
			ErrTokenRange, createIndex, uint64(maxCreateIndex), lockIndex, uint64(maxLockIndex))
	}
	return int64(createIndex<<LockIndexBits | lockIndex), nil
}

// DecodeToken splits a create-lock token into the CreateIndex and LockIndex it encodes.
func DecodeToken(token int64) (createIndex, lockIndex uint64) {
	return uint64(token) >> LockIndexBits, uint64(token) & maxLockIndex
}

// TokenOf is the token of (createIndex, lockIndex) in mode m. A key that does not exist
// has token 0 in both modes.
func (m TokenMode) TokenOf(exists bool, createIndex, lockIndex uint64) (int64, error) {
	if !exists {
		return 0, nil
	}
	if m == TokenCreateLock {
		return EncodeToken(createIndex, lockIndex)
	}
	return ClampToken(lockIndex), nil
}

// Describe names what a token of mode m is made of, for messages.
func (m TokenMode) Describe() string {
	if m == TokenCreateLock {
		return "token (CreateIndex×2^24+LockIndex)"
	}
	return "LockIndex"
}

// ClampToken converts a LockIndex to a token. LockIndex counts acquisitions, so it never
// comes near 2^63; the clamp only keeps a corrupt value from turning negative.
func ClampToken(i uint64) int64 {
	if i > math.MaxInt64 {
		return math.MaxInt64
	}
	return int64(i)
}
