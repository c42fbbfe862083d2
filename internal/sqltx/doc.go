// Package sqltx reads SQL the way PostgreSQL does, to find where a client's
// transactions commit. It splits a simple-Query string into statements,
// classifies each one (transaction control, CALL, DO, statements that cannot
// run in a transaction block, settings that change how later text is lexed),
// and plans where the proxy's commit-time checks go in a Query string
// (PlanQuery).
//
// The package owns reading SQL text. It must not touch the network, log, or
// know what the check does: the check's SQL is a constant the caller builds
// from validated values and passes in; client text is never pasted into it.
//
// # PostgreSQL's own parser, never keyword guessing
//
// Everything here comes from github.com/pganalyze/pg_query_go/v6, which
// compiles PostgreSQL's own lexer and grammar (version 17) into the binary.
// Statement boundaries come from the grammar (a ';' inside a string, a dollar
// quote, a comment, a quoted identifier or a CREATE FUNCTION ... BEGIN ATOMIC
// body is not a boundary), and kinds come from the parse tree's node types and
// fields. No text is matched against keywords by this package: "commit" in a
// string literal, "END" of a BEGIN ATOMIC body, or a quoted identifier "commit"
// can never be taken for a COMMIT.
//
// The grammar is PostgreSQL 17's and the server may be older (15 is tested).
// Statement boundaries and the statements this package classifies are the
// same in both; text that only the newer grammar rejects (for example a number
// directly followed by letters, "SELECT 1abc", which 15 reads as "SELECT 1 AS
// abc") is refused by the proxy with a *SyntaxError. That is fail closed: a
// syntax error is never forwarded, because the older server might accept it.
//
// # What the lexer assumes, and what the proxy must enforce
//
// PostgreSQL's lexing of a message depends on two session settings; pg_query
// lexes as a default session does. The proxy must keep the session there:
//
//   - standard_conforming_strings must be on. With it off, a backslash escapes
//     a quote inside '...': `SELECT 'a\' || ' ; COMMIT; --'` is one SELECT to
//     the proxy's lexer but a SELECT and a COMMIT to such a session, which
//     then commits past the proxy (the integration test shows it). A
//     top-level SET of it to anything that might be off is SetStdStrings,
//     for the proxy to refuse. set_config(...) cannot be found syntactically:
//     the proxy tracks the standard_conforming_strings ParameterStatus (sent
//     at startup and after every change) and refuses to go on while it is not
//     on. That report comes after the statement ran, so a message already
//     sent behind it in a pipeline meets the new value: StdStringsSensitive
//     tells whether a text could be read differently at all (almost never:
//     it needs a backslash in a '...' literal); such a text should wait until
//     everything before it has completed. RESET, RESET ALL, SET ... TO DEFAULT
//     and DISCARD ALL return the setting to the value the session started
//     with (ALTER ROLE/DATABASE ... SET only apply to new sessions; SET ROLE
//     and SET SESSION AUTHORIZATION apply none), which the proxy has
//     checked, so they are not SetStdStrings.
//   - client_encoding must be ASCII-safe (ClientEncodingSafe). In SJIS, BIG5,
//     GBK, UHC, GB18030 and JOHAB the second byte of a character can be 0x5C,
//     a backslash, and E'...' strings would end elsewhere for the proxy than
//     for the server, which converts to the server encoding before lexing. A
//     SET to such an encoding is SetClientEncoding; the proxy checks the
//     client_encoding ParameterStatus likewise. Text in a safe single-byte
//     encoding such as LATIN1 is not UTF-8, which pg_query's protobuf output
//     requires: such text is parsed as Latin-1 (parseTree in split.go
//     explains why that changes no boundary).
//
// A zero byte cannot occur in a valid message; text containing one is refused
// (ErrNUL).
//
// # Where the checks go (PlanQuery)
//
// A simple Query runs its statements one after the other; with more than one
// statement, those outside an explicit block share one implicit transaction
// that commits at the end of the message. The rules below were measured on
// PostgreSQL 15 and are asserted by this package's integration test against a
// real server:
//
//   - BEGIN turns the implicit transaction into an explicit block that keeps
//     what ran before it: `INSERT a; BEGIN; INSERT b; ROLLBACK` rolls back
//     both rows. No check is needed at BEGIN.
//   - COMMIT (and END) ends the implicit transaction too, and commits it:
//     `INSERT a; COMMIT; INSERT b; SELECT 1/0` commits a. So the check goes
//     before every commit point, inside or outside an explicit block, and
//     after the last statement when the string ends outside a block.
//   - PREPARE TRANSACTION in an implicit transaction prepares it: a commit
//     point as well (its locks then persist, so the check goes before it).
//   - COMMIT AND CHAIN commits and opens a new block: the check goes before it,
//     and none at the end while the string ends in a block.
//   - COMMIT AND CHAIN, ROLLBACK AND CHAIN, SAVEPOINT and ROLLBACK TO outside
//     a block are errors, which end the string.
//   - An error ends the string: nothing after it runs, and the implicit
//     transaction rolls back. In a failed block only COMMIT/ROLLBACK (which
//     roll back), the chained forms and ROLLBACK TO run; no check goes before
//     a block end there, as a failed block only rolls back.
//
// No check is inserted before a commit point of an implicit transaction in
// which nothing has run yet (a lone COMMIT: it commits nothing), and none is
// appended after a string whose last statement ends the transaction (COMMIT,
// ROLLBACK, PREPARE TRANSACTION: no transaction is left open). Inserted checks
// go at the first token of the statement, appended ones after "\n;"; plan.go
// explains why neither can end up in a comment, string or identifier, and a
// plan with inserted checks is parsed again to verify its statements before
// it is returned.
//
// # CALL, DO and statements that cannot run in a block
//
// A procedure called, or a DO block run, at top level outside any block may
// COMMIT, past any check. In a multi-statement Query PostgreSQL runs every
// statement inside a block (the implicit one), where a COMMIT in a procedure
// fails with "invalid transaction termination" (2D000) and nothing commits.
// PlanQuery's appended check makes every string that ends outside a block
// multi-statement, so in a simple Query CALL and DO are safe as they are: this
// is the handling this package provides. (In the extended protocol a single
// Execute outside a block is non-atomic: the proxy must refuse CALL and DO
// there, or see that they run inside a block.)
//
// For the same reason a statement that PostgreSQL refuses inside a block
// (PreventInTransactionBlock) fails in any multi-statement Query, so PlanQuery
// adds a check only where it makes no difference to it. Alone, such a
// statement would get no check at all: PlanQuery returns
// ErrNeedsOwnTransaction and the proxy decides. Kind.SafeWithoutCheck names
// the ones that may run unchecked: VACUUM and DISCARD ALL (Maintenance: no
// user data changes), COMMIT PREPARED (its check ran before PREPARE
// TRANSACTION, whose lock on the token's sequence the prepared transaction
// still holds) and ROLLBACK PREPARED (commits nothing). Every other such
// statement is NoTxBlock and should be refused in fenced sessions.
//
// NoTxBlock covers the statements for which PostgreSQL 15 calls
// PreventInTransactionBlock (the integration test runs each one inside a
// block and expects SQLSTATE 25001 where the refusal is unconditional):
// CREATE DATABASE, DROP DATABASE, ALTER DATABASE ... SET
// TABLESPACE, CREATE TABLESPACE, DROP TABLESPACE, ALTER SYSTEM, CREATE INDEX
// CONCURRENTLY, DROP INDEX CONCURRENTLY, REINDEX ... CONCURRENTLY, REINDEX
// SCHEMA/SYSTEM/DATABASE, CLUSTER without a table, ALTER TABLE ... DETACH
// PARTITION ... CONCURRENTLY, and CREATE/ALTER/DROP SUBSCRIPTION (all of them,
// although PostgreSQL refuses some only for certain options or states). Where
// PostgreSQL decides from the catalog (CLUSTER of a partitioned table), the
// statement is Other and the server refuses it inside the check's block. A
// mistake in either direction is safe: a NoTxBlock that could have run in a
// block is only refused, and a missed one fails inside the implicit block.
//
// # Performance
//
// The proxy analyses every simple Query of a fenced session and every Parse.
// pg_query.Parse returns the whole tree as protobuf, encoded in C and decoded
// in Go: 12-16 µs for a pgbench SELECT or UPDATE on the 2-core development
// machine (BenchmarkApproach; more under load), most of it protobuf, while
// the parse itself takes under 1 µs. So the analysis (analyze in split.go)
// parses the text with pg_query.IsUtilityStmt, which reports per statement
// whether it is a utility statement and builds no protobuf. SELECT, INSERT,
// UPDATE, DELETE and MERGE are never transaction control, CALL, DO, SET or a
// NoTxBlock statement, so a text made of those is done after that one parse.
// Only when a utility statement is present are the spans read
// (pg_query.SplitWithParser, another parse without protobuf) and each utility
// statement parsed alone with pg_query.Parse (BEGIN or COMMIT: about 2 µs).
// A statement's first token is the first byte after the lexer's whitespace
// unless that byte is '-' or '/' (maybe a comment); only then does the span
// go through pg_query.Scan. This is as exact as the full tree: the kinds come
// from the grammar's own nodes, never from a guessed keyword, and the tests
// and fuzz targets compare the result with the full-tree reference.
//
// PlanQuery for a one-statement pgbench query costs about 1.5 µs (a parse of
// the query and one of the check), BEGIN; and END; 3-3.5 µs, a 20-statement
// string 46 µs; the full tree and a scan would cost 17-19 µs, 3 µs and 250
// µs. A Cache hit costs 0.07-0.45 µs. bench_test.go has the benchmarks, the
// command and the numbers.
//
// Analyses run in parallel: libpg_query keeps its state per thread, and the
// copy built by pg_query_go defines DEBUG, so its entry points do not
// redirect the process's stderr around each call (checked with strace: no
// pipe or dup2 calls).
//
// A Cache (NewCache) keeps the analysis of recent texts, for texts that come
// again: prepared statements parsed by many connections, unnamed statements
// parsed before every execution, BEGIN and END. It also remembers validated
// check statements, which the package-level PlanQuery validates on every
// call (one more parse). It keeps a text only the second time it sees it
// (it remembers a hash of the first sighting): with the simple protocol most
// texts carry literal values and never come again, and caching each of them
// cost an insertion and an eviction (of a text that does come again) for
// nothing. For pgbench's read-write transaction through a Cache (BEGIN and
// END hits, three new texts) that policy brought PlanQuery from 5.2-5.3 to
// 4.2-4.3 µs per transaction and from 33 to 27 allocations
// (BenchmarkCache/PlanQuery/pgbench_transaction, -cpu 1 -count 3).
package sqltx
