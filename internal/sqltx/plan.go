package sqltx

import (
	"errors"
	"strings"

	pg_query "github.com/pganalyze/pg_query_go/v6"
)

// QueryPlan is a simple Query rewritten with the proxy's checks.
type QueryPlan struct {
	// Text is what to send to the server instead of the client's string.
	Text string
	// Ours has one entry per statement the server will execute from Text, in
	// order: true for the proxy's checks (whose results the proxy swallows),
	// false for the client's statements. It is empty for an empty query, to
	// which the server answers with one EmptyQueryResponse.
	Ours []bool
	// EndsInBlock reports whether the session is inside an explicit
	// transaction block after Text, if no statement fails.
	EndsInBlock bool
	// Checks is the number of true entries in Ours.
	Checks int
	// Kinds has the kind of each of the client's statements, in order.
	Kinds []Kind
}

var (
	// ErrNeedsOwnTransaction: the string is a single statement that PostgreSQL
	// runs only outside any transaction block (Kind.OwnTransaction), and the
	// session is not in a block. A check appended to the string would put the
	// statement in an implicit block, where PostgreSQL refuses it, so PlanQuery
	// adds none: the plan it returns with this error is the string unchanged
	// (Ours == []bool{false}, Kinds holds the statement's kind) for the proxy
	// to refuse, or to send as it is when Kinds[0].SafeWithoutCheck().
	ErrNeedsOwnTransaction = errors.New("sqltx: statement runs only outside a transaction block: no check can share its transaction")
	// ErrInvalidCheck: the check given to PlanQuery is not one SELECT (or
	// other DML) statement without comments or semicolons.
	ErrInvalidCheck = errors.New("sqltx: invalid check statement")
	// errFailedOutsideBlock: PlanQuery was told the session is in a failed
	// block but not in a block.
	errFailedOutsideBlock = errors.New("sqltx: failed is only meaningful inside a block")
)

// PlanQuery decides where the commit-time checks go in a simple Query, given
// whether the session is inside an explicit transaction block when the Query
// starts (inBlock) and whether that block is failed (failed: transaction
// status 'E'). check is the proxy's check statement: a constant built by the
// caller from validated values, never client text, without a trailing ';'.
//
// A check goes immediately before every statement that commits (COMMIT, END,
// COMMIT AND CHAIN, PREPARE TRANSACTION), unless the block it would commit is
// failed (it only rolls back) or is an implicit transaction in which nothing
// has run yet (it commits nothing). A check is appended at the end when the
// string finishes outside an explicit block with statements still in its
// implicit transaction, which commits at the end of the message. The rules
// PostgreSQL follows, on which this rests, are in doc.go ("Where the checks
// go") and are tested against a real server.
//
// PlanQuery returns ErrNeedsOwnTransaction (see there) for a single statement
// that must run outside a block, a *SyntaxError when the grammar rejects the
// text, ErrNUL, or ErrInvalidCheck.
func PlanQuery(sql string, inBlock, failed bool, check string) (QueryPlan, error) {
	if err := validateCheck(check); err != nil {
		return QueryPlan{}, err
	}
	a, err := analyze(sql, false)
	if err != nil {
		return QueryPlan{}, err
	}
	return plan(sql, a, inBlock, failed, check)
}

// validateCheck makes sure that check is one complete statement that cannot
// swallow or change the client's text next to it: it parses on its own as
// exactly one DML statement (so it leaves no string, identifier or comment
// open), and PostgreSQL's lexer finds in it no comment, which could run to
// the end of a line, and no ';', which would make it two statements. The
// lexer runs only when the text has a ';' or a comment opener at all (inside
// a literal, as in fence.check('eu--billing', 7), they are harmless).
func validateCheck(check string) error {
	if strings.TrimSpace(check) == "" || strings.IndexByte(check, 0) >= 0 {
		return ErrInvalidCheck
	}
	utility, err := pg_query.IsUtilityStmt(check)
	if err != nil || len(utility) != 1 {
		return ErrInvalidCheck
	}
	if utility[0] {
		// The one utility statement allowed: EXECUTE of the caller's own
		// prepared check, which runs a DML statement.
		tree, err := pg_query.Parse(check)
		if err != nil || len(tree.GetStmts()) != 1 || tree.GetStmts()[0].GetStmt().GetExecuteStmt() == nil {
			return ErrInvalidCheck
		}
	}
	if !strings.Contains(check, ";") && !strings.Contains(check, "--") && !strings.Contains(check, "/*") {
		return nil
	}
	res, err := pg_query.Scan(check)
	if err != nil {
		return ErrInvalidCheck
	}
	for _, t := range res.GetTokens() {
		if isComment(t.GetToken()) || t.GetToken() == pg_query.Token_ASCII_59 {
			return ErrInvalidCheck
		}
	}
	return nil
}

// block is where the session stands between two statements of a string.
type block uint8

const (
	idle     block = iota // no explicit block: statements run in the implicit transaction
	inside                // in an explicit block
	failedIn              // in an explicit block that failed: only its end runs
)

func plan(sql string, a *analysis, inBlock, failed bool, check string) (QueryPlan, error) {
	if failed && !inBlock {
		return QueryPlan{}, errFailedOutsideBlock
	}
	n := len(a.stmts)
	p := QueryPlan{Kinds: make([]Kind, n), Ours: make([]bool, 0, n+1)}
	for i := range a.stmts {
		p.Kinds[i] = a.stmts[i].Kind
	}
	st := idle
	switch {
	case failed:
		st = failedIn
	case inBlock:
		st = inside
	}
	st0 := st
	if n == 1 && st == idle && p.Kinds[0].OwnTransaction() {
		p.Text, p.Ours = sql, append(p.Ours, false)
		return p, ErrNeedsOwnTransaction
	}

	var b strings.Builder
	copied := 0   // sql[:copied] is in b
	open := false // idle, and the implicit transaction has run statements
	for _, s := range a.stmts {
		k := s.Kind
		if k.CommitPoint() && (st == inside || (st == idle && open)) {
			if s.Start < copied { // unknown (-1): cannot happen, refuse
				return QueryPlan{}, errInconsistent
			}
			if b.Len() == 0 {
				b.Grow(len(sql) + 3*(len(check)+2))
			}
			// Insert at the statement's first token. The lexer is in its
			// initial state there (not in a comment, string or identifier),
			// so the inserted text is read as code. What precedes it is a
			// ';', whitespace, the end of a comment or the start of the
			// text, none of which joins with a letter into one token; the
			// check itself ends with its own ';', and the space keeps the
			// client's first token apart.
			b.WriteString(sql[copied:s.Start])
			b.WriteString(check)
			b.WriteString("; ")
			copied = s.Start
			p.Ours = append(p.Ours, true)
			p.Checks++
		}
		p.Ours = append(p.Ours, false)
		st, open = next(st, open, k)
	}
	inserted := p.Checks
	if st == idle && open {
		if b.Len() == 0 {
			b.Grow(len(sql) + len(check) + 2)
		}
		// Append after a newline and a ';'. The text parsed completely, so
		// the lexer ends it in its initial state or inside a "--" comment,
		// which the newline ends; the ';' then ends the client's last
		// statement (after a ';' of the client's own it is an empty
		// statement, which PostgreSQL skips).
		b.WriteString(sql[copied:])
		copied = len(sql)
		b.WriteString("\n;")
		b.WriteString(check)
		p.Ours = append(p.Ours, true)
		p.Checks++
	}
	if p.Checks == 0 {
		p.Text = sql
	} else {
		b.WriteString(sql[copied:])
		p.Text = b.String()
	}
	p.EndsInBlock = st != idle
	if inserted > 0 {
		// A cached analysis remembers, per start state, that its plan was
		// verified: the check's text does not matter to the verification,
		// since validateCheck makes every check one self-contained
		// statement.
		bit := uint32(1) << st0
		if a.verified.Load()&bit == 0 {
			if err := verify(p, a); err != nil {
				return QueryPlan{}, err
			}
			a.verified.Or(bit)
		}
	}
	return p, nil
}

// next is PostgreSQL 15's block state after a statement of kind k ran without
// error. (A statement that fails ends the string: PostgreSQL runs nothing
// after the first error in a Query. The states after such a statement do not
// matter, and next keeps the most conservative one.)
func next(st block, open bool, k Kind) (block, bool) {
	switch k {
	case Begin:
		if st == idle {
			// The implicit transaction, with what ran in it, becomes the
			// explicit block: its statements commit with the block.
			return inside, false
		}
		return st, open // a warning in a block, an error in a failed one
	case Commit, Rollback, PrepareTransaction:
		// The block (explicit, failed or implicit) is over. A later
		// statement starts a new implicit transaction.
		return idle, false
	case CommitChain, RollbackChain:
		if st != idle {
			return inside, false // a new block, not failed
		}
		return idle, true // an error outside a block
	case RollbackTo:
		if st != idle {
			return inside, false // the failed block is usable again
		}
		return idle, true // an error outside a block
	}
	if st == idle {
		return idle, true
	}
	return st, open
}

// verify re-reads a plan with inserted checks through the parser: the text must
// split into exactly len(Ours) statements, each client statement what it was
// (utility or not; the checks were validated on their own). This costs one more parse, only for strings
// that commit, and turns any blind spot in the construction above into a
// refusal instead of a check the server does not run.
func verify(p QueryPlan, a *analysis) error {
	utility, err := pg_query.IsUtilityStmt(p.Text)
	if err != nil || len(utility) != len(p.Ours) {
		return errInconsistent
	}
	j := 0
	for i, ours := range p.Ours {
		if ours {
			// The check was validated on its own (validateCheck): a DML
			// statement, or EXECUTE of the caller's prepared check.
			continue
		}
		if utility[i] != a.utility[j] {
			return errInconsistent
		}
		j++
	}
	return nil
}
