package sqltx

import "strconv"

// Kind is what a statement means for transaction control, decided from the
// statement's parse tree (never from its text).
type Kind uint8

// The kinds. The zero value, Other, is every statement that neither controls
// transactions nor needs special care from the proxy.
const (
	// Other is anything else: DML, DDL, SELECT, SET of other settings, EXPLAIN,
	// COPY, PREPARE name AS ..., EXECUTE, LISTEN, ANALYZE, ...
	Other Kind = iota
	// Begin is BEGIN or START TRANSACTION (with any modes).
	Begin
	// Commit is COMMIT or END (also AND NO CHAIN).
	Commit
	// CommitChain is COMMIT AND CHAIN or END AND CHAIN: the block commits and a
	// new one starts with the same characteristics.
	CommitChain
	// Rollback is ROLLBACK or ABORT (also AND NO CHAIN).
	Rollback
	// RollbackChain is ROLLBACK AND CHAIN or ABORT AND CHAIN.
	RollbackChain
	// PrepareTransaction is PREPARE TRANSACTION 'gid': the block ends, and its
	// changes and locks persist until COMMIT PREPARED or ROLLBACK PREPARED.
	PrepareTransaction
	// CommitPrepared is COMMIT PREPARED 'gid'. PostgreSQL refuses it inside a
	// transaction block.
	CommitPrepared
	// RollbackPrepared is ROLLBACK PREPARED 'gid'. PostgreSQL refuses it inside
	// a transaction block.
	RollbackPrepared
	// Savepoint is SAVEPOINT name.
	Savepoint
	// Release is RELEASE [SAVEPOINT] name.
	Release
	// RollbackTo is ROLLBACK [WORK|TRANSACTION] TO [SAVEPOINT] name. Inside a
	// failed block it makes the block usable again.
	RollbackTo
	// Call is CALL proc(...). Outside any block a procedure may COMMIT.
	Call
	// Do is DO $$ ... $$. Outside any block the code may COMMIT.
	Do
	// NoTxBlock is a statement PostgreSQL refuses inside a transaction block
	// (and inside a multi-statement Query) that may change data: CREATE/DROP
	// DATABASE, ALTER DATABASE ... SET TABLESPACE, CREATE/DROP TABLESPACE,
	// ALTER SYSTEM, CREATE INDEX CONCURRENTLY, DROP INDEX CONCURRENTLY,
	// REINDEX ... CONCURRENTLY, REINDEX SCHEMA/SYSTEM/DATABASE, CLUSTER without
	// a table, ALTER TABLE ... DETACH PARTITION ... CONCURRENTLY, and all
	// CREATE/ALTER/DROP SUBSCRIPTION. See doc.go for the list and its sources.
	NoTxBlock
	// SetStdStrings is a SET (SESSION or LOCAL) of standard_conforming_strings
	// to anything PostgreSQL might not read as on. The proxy lexes every string
	// as if standard_conforming_strings were on; see doc.go.
	SetStdStrings

	// Kinds added beyond the first draft of the API.

	// Maintenance is a statement PostgreSQL refuses inside a transaction block
	// that changes no user data: VACUUM (any options, also VACUUM ANALYZE) and
	// DISCARD ALL. ANALYZE alone runs in blocks and is Other.
	Maintenance
	// SetClientEncoding is a SET (SESSION or LOCAL) of client_encoding (also SET
	// NAMES) to an encoding that is not known to be ASCII-safe, such as SJIS,
	// BIG5, GBK, UHC, GB18030 or JOHAB: in those a multibyte character may
	// contain the byte of a backslash, which the proxy's lexer would misread.
	// See ClientEncodingSafe.
	SetClientEncoding
	// CopyIn is COPY ... FROM STDIN: in the extended protocol the server
	// enters copy-in mode at its Execute and ignores Sync (and Flush) until
	// the client's CopyDone or CopyFail, so the proxy must not treat such a
	// Sync as the end of a unit. It is otherwise like Other.
	CopyIn
	// Deallocate is DEALLOCATE [PREPARE] name or ALL: it may remove the
	// proxy's own prepared check, which the proxy then prepares no more.
	Deallocate
)

// String returns a short human-readable name, in SQL words where there are
// some, for messages and logs.
func (k Kind) String() string {
	switch k {
	case Other:
		return "other statement"
	case Begin:
		return "BEGIN"
	case Commit:
		return "COMMIT"
	case CommitChain:
		return "COMMIT AND CHAIN"
	case Rollback:
		return "ROLLBACK"
	case RollbackChain:
		return "ROLLBACK AND CHAIN"
	case PrepareTransaction:
		return "PREPARE TRANSACTION"
	case CommitPrepared:
		return "COMMIT PREPARED"
	case RollbackPrepared:
		return "ROLLBACK PREPARED"
	case Savepoint:
		return "SAVEPOINT"
	case Release:
		return "RELEASE SAVEPOINT"
	case RollbackTo:
		return "ROLLBACK TO SAVEPOINT"
	case Call:
		return "CALL"
	case Do:
		return "DO"
	case NoTxBlock:
		return "statement that cannot run inside a transaction block"
	case SetStdStrings:
		return "SET standard_conforming_strings"
	case Maintenance:
		return "VACUUM or DISCARD ALL"
	case CopyIn:
		return "COPY FROM STDIN"
	case Deallocate:
		return "DEALLOCATE"
	case SetClientEncoding:
		return "SET client_encoding"
	}
	return "Kind(" + strconv.Itoa(int(k)) + ")"
}

// EndsBlock reports whether the statement ends the transaction (explicit or
// implicit) it runs in, leaving no block open: Commit, Rollback and
// PrepareTransaction. The chained variants end a block but open the next one,
// so they are not included.
func (k Kind) EndsBlock() bool {
	return k == Commit || k == Rollback || k == PrepareTransaction
}

// CommitPoint reports whether the statement commits (or, for PREPARE
// TRANSACTION, makes durable) the work of the transaction it runs in: Commit,
// CommitChain and PrepareTransaction. The fencing check goes immediately before
// it, inside the same transaction.
func (k Kind) CommitPoint() bool {
	return k == Commit || k == CommitChain || k == PrepareTransaction
}

// OwnTransaction reports whether PostgreSQL runs the statement only outside any
// transaction block, in a transaction of its own (several, for some): no check
// can share its transaction. These are NoTxBlock, Maintenance, CommitPrepared
// and RollbackPrepared.
func (k Kind) OwnTransaction() bool {
	switch k {
	case NoTxBlock, Maintenance, CommitPrepared, RollbackPrepared:
		return true
	}
	return false
}

// SafeWithoutCheck reports whether an OwnTransaction statement can run in a
// fenced session without a check, because it commits no change of user data
// that a check would have to vouch for:
//   - Maintenance (VACUUM, DISCARD ALL) changes no user data;
//   - RollbackPrepared commits nothing;
//   - CommitPrepared commits a transaction whose check already ran before its
//     PREPARE TRANSACTION; the lock on the token's sequence that check took is
//     held by the prepared transaction, so no raise can commit in between.
//
// NoTxBlock statements are not safe: they change data or schema in
// transactions of their own.
func (k Kind) SafeWithoutCheck() bool {
	switch k {
	case Maintenance, CommitPrepared, RollbackPrepared:
		return true
	}
	return false
}
