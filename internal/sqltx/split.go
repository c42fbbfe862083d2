package sqltx

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"unicode/utf8"
	"unsafe"

	pg_query "github.com/pganalyze/pg_query_go/v6"
	"github.com/pganalyze/pg_query_go/v6/parser"
)

// Statement is one statement of a query string, as PostgreSQL's grammar
// delimits it.
type Statement struct {
	Kind Kind
	// Start is the byte offset of the statement's first token: any whitespace
	// and comments before it belong to no statement.
	Start int
	// End is the byte offset just past the statement: the offset of the ';'
	// that ends it, or the length of the text for a last statement without
	// one. Whitespace and comments before that ';' are included.
	End int
}

// Errors.
var (
	// ErrNUL: the text contains a zero byte. The protocol ends strings at a
	// zero byte and PostgreSQL refuses a Query or Parse message with bytes
	// after it, so no valid message carries one.
	ErrNUL = errors.New("sqltx: query text contains a zero byte")
	// ErrMultipleStatements: Classify was given more than one statement, which
	// PostgreSQL refuses in a Parse message too.
	ErrMultipleStatements = errors.New("sqltx: cannot insert multiple commands into a prepared statement")
	// errInconsistent means two of pg_query's views of the same text
	// disagree. It cannot happen; if it does, the text is refused.
	errInconsistent = errors.New("sqltx: internal inconsistency between parses of the same text")
)

// SyntaxError reports that PostgreSQL's grammar rejects the text. The server
// rejects such a string as a whole before running any of it, but the proxy
// must not forward it either (fail closed): the grammar the proxy uses can be
// newer than the server's, see doc.go.
type SyntaxError struct {
	Message string // PostgreSQL's message, e.g. `syntax error at or near "FORM"`
	// Position is where the parser stopped, as a 1-based character position
	// (PostgreSQL's ErrorResponse field P), or 0 when unknown.
	Position int
}

func (e *SyntaxError) Error() string { return "sqltx: " + e.Message }

// SQLState is 42601 (syntax_error), the code PostgreSQL would send.
func (e *SyntaxError) SQLState() string { return "42601" }

func syntaxError(err error) error {
	var pe *parser.Error
	if errors.As(err, &pe) {
		return &SyntaxError{Message: pe.Message, Position: pe.Cursorpos}
	}
	return fmt.Errorf("sqltx: %w", err)
}

// Split splits a simple-Query string exactly as PostgreSQL will, and
// classifies each statement. A string with only comments, whitespace and
// semicolons has zero statements. A syntax error returns a *SyntaxError (the
// proxy refuses the query then: fail closed).
func Split(sql string) ([]Statement, error) {
	a, err := analyze(sql, true)
	if err != nil {
		return nil, err
	}
	return a.stmts, nil
}

// Classify classifies a single statement, as sent in an extended-protocol
// Parse message. More than one statement returns ErrMultipleStatements; an
// empty string (or only comments) is Other, like PostgreSQL's empty query.
func Classify(sql string) (Kind, error) {
	a, err := classify(sql)
	if err != nil {
		return Other, err
	}
	if len(a.stmts) == 0 {
		return Other, nil
	}
	return a.stmts[0].Kind, nil
}

// classify is Classify's analysis: no statement or one, without offsets.
func classify(sql string) (*analysis, error) {
	if strings.IndexByte(sql, 0) >= 0 {
		return nil, ErrNUL
	}
	utility, err := pg_query.IsUtilityStmt(sql)
	if err != nil {
		return nil, syntaxError(err)
	}
	if len(utility) > 1 {
		return nil, ErrMultipleStatements
	}
	a := &analysis{utility: utility, all: len(utility) == 0}
	if len(utility) == 1 {
		a.stmts = []Statement{{Kind: Other, Start: -1, End: -1}}
		if utility[0] {
			if a.stmts[0].Kind, err = classifyText(sql); err != nil {
				return nil, err
			}
		}
	}
	return a, nil
}

// analysis is what one parse of a text yields. Kinds are always known and
// exact. Unknown offsets are -1: all offsets are known when all is set;
// otherwise Start is known for commit points (what PlanQuery needs), and End
// only where it was needed to find them.
type analysis struct {
	stmts   []Statement
	utility []bool // pg_query.IsUtilityStmt: anything but SELECT/INSERT/UPDATE/DELETE/MERGE
	locs    []int  // where each statement's span begins: just after the previous ';', or 0
	all     bool   // every Start is known
	// verified has bit 1<<block set once a plan with inserted checks from
	// that start state was verified (see plan).
	verified atomic.Uint32
}

// analyze is the fast, exact path. The costly step of pg_query is the parse
// tree's protobuf encoding and decoding (pg_query.Parse), so it is avoided
// where the answer does not need it (see doc.go, "Performance"):
//
//  1. pg_query.IsUtilityStmt parses the whole text and reports, per statement,
//     whether it is a utility statement. A statement that is not (a SELECT,
//     INSERT, UPDATE, DELETE or MERGE, with whatever it contains) is Other:
//     none of the kinds that matter is one of those.
//  2. If a statement is a utility statement, pg_query.SplitWithParser gives
//     every statement's span, and each utility statement is parsed on its own
//     with pg_query.Parse to read its node. Parsing a span alone yields the
//     same tree: a span starts right after a ';' token, where the lexer is in
//     its initial state, and ends before the next top-level ';'.
//  3. First tokens are found only where needed (commit points, or all for
//     Split), by skipping whitespace or, where a comment may follow, with
//     pg_query.Scan (PostgreSQL's lexer); see fillStart.
func analyze(sql string, all bool) (*analysis, error) {
	if strings.IndexByte(sql, 0) >= 0 {
		return nil, ErrNUL
	}
	utility, err := pg_query.IsUtilityStmt(sql)
	if err != nil {
		return nil, syntaxError(err)
	}
	a := &analysis{stmts: make([]Statement, len(utility)), utility: utility, all: all || len(utility) == 0}
	for i := range a.stmts {
		a.stmts[i] = Statement{Kind: Other, Start: -1, End: -1}
	}
	if !all && !slices.Contains(utility, true) {
		return a, nil
	}
	if !all && len(utility) == 1 {
		// One utility statement (BEGIN; or END;, say): it is the whole
		// text, and its End is not needed to plan.
		a.locs = []int{0}
		if a.stmts[0].Kind, err = classifyText(sql); err != nil {
			return nil, err
		}
		if a.stmts[0].Kind.CommitPoint() {
			if err = a.fillStart(sql, 0); err != nil {
				return nil, err
			}
		}
		return a, nil
	}
	spans, err := statementSpans(sql)
	if err != nil {
		return nil, err
	}
	if len(spans) != len(utility) {
		return nil, errInconsistent
	}
	a.locs = make([]int, len(spans))
	for i, sp := range spans {
		a.locs[i] = sp[0]
		a.stmts[i].End = sp[1]
		if utility[i] {
			if a.stmts[i].Kind, err = classifyText(sql[sp[0]:sp[1]]); err != nil {
				return nil, err
			}
		}
	}
	if all {
		err = a.fillStarts(sql)
	} else {
		for i := range a.stmts {
			if a.stmts[i].Kind.CommitPoint() {
				if err = a.fillStart(sql, i); err != nil {
					break
				}
			}
		}
	}
	if err != nil {
		return nil, err
	}
	return a, nil
}

// statementSpans returns [start, end) of each statement: from just after the
// ';' that ended the previous statement (0 for the first) to the ';' that ends
// this one (or the end of the text). Empty statements are not included.
func statementSpans(sql string) ([][2]int, error) {
	parts, err := pg_query.SplitWithParser(sql, false)
	if err != nil {
		return nil, syntaxError(err)
	}
	spans := make([][2]int, len(parts))
	prev := 0
	for i, p := range parts {
		// SplitWithParser returns sql[loc:loc+len] for each statement, so each
		// part shares sql's memory and its offset is a pointer difference.
		// Should a future version copy the parts, fall back to the parse tree.
		off, ok := offsetIn(sql, p)
		if !ok || off < prev {
			return referenceSpans(sql)
		}
		spans[i] = [2]int{off, off + len(p)}
		prev = off + len(p)
	}
	return spans, nil
}

// offsetIn returns the offset of sub inside s, when sub is a non-empty
// substring sharing s's memory.
func offsetIn(s, sub string) (int, bool) {
	if len(sub) == 0 || len(s) == 0 {
		return 0, false
	}
	base := uintptr(unsafe.Pointer(unsafe.StringData(s)))
	p := uintptr(unsafe.Pointer(unsafe.StringData(sub)))
	if p < base || p-base > uintptr(len(s)-len(sub)) {
		return 0, false
	}
	return int(p - base), true
}

// referenceSpans reads the spans from the full parse tree. It is exact but
// costly (protobuf), and serves as the fallback and as the tests' reference.
func referenceSpans(sql string) ([][2]int, error) {
	_, spans, err := parseTree(sql)
	return spans, err
}

// parseTree is pg_query.Parse, with each statement's span in sql.
//
// The parse tree comes as protobuf, whose strings must be valid UTF-8, while
// the proxy sees the client's bytes in the client's encoding (LATIN1, say).
// So text that is not valid UTF-8 is parsed as if its bytes were Latin-1
// characters: each byte from 0x80 up becomes two UTF-8 bytes, both from 0x80
// up. PostgreSQL's lexer treats every byte from 0x80 up alike (as a letter in
// identifiers, as content in strings, comments and quoted identifiers, and
// one-to-one in dollar-quote tags), so this changes no token boundary and no
// statement; spans are mapped back to offsets in sql.
func parseTree(sql string) (*pg_query.ParseResult, [][2]int, error) {
	text, back := sql, []int(nil)
	if !utf8.ValidString(sql) {
		text, back = latin1ToUTF8(sql)
	}
	tree, err := pg_query.Parse(text)
	if err != nil {
		return nil, nil, syntaxError(err)
	}
	spans := make([][2]int, len(tree.GetStmts()))
	for i, rs := range tree.GetStmts() {
		loc, n := int(rs.GetStmtLocation()), int(rs.GetStmtLen())
		end := loc + n
		if n == 0 { // the last statement, not followed by ';'
			end = len(text)
		}
		if loc < 0 || end > len(text) || loc >= end {
			return nil, nil, errInconsistent
		}
		if back != nil {
			loc, end = back[loc], back[end]
		}
		spans[i] = [2]int{loc, end}
	}
	return tree, spans, nil
}

// latin1ToUTF8 reads s as Latin-1 and returns it in UTF-8, with the offset in
// s of every offset in the result (len(result)+1 entries).
func latin1ToUTF8(s string) (string, []int) {
	b := make([]byte, 0, 2*len(s))
	back := make([]int, 0, 2*len(s)+1)
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < utf8.RuneSelf {
			b = append(b, c)
			back = append(back, i)
			continue
		}
		b = append(b, 0xC0|c>>6, 0x80|c&0x3F)
		back = append(back, i, i)
	}
	return string(b), append(back, len(s))
}

// classifyText parses text, which must hold exactly one statement, and
// classifies it.
func classifyText(text string) (Kind, error) {
	tree, _, err := parseTree(text)
	if err != nil {
		return Other, err
	}
	if len(tree.GetStmts()) != 1 {
		return Other, errInconsistent
	}
	return kindOf(tree.GetStmts()[0].GetStmt()), nil
}

// isComment: pg_query's scanner, unlike PostgreSQL's, reports comments as
// tokens.
func isComment(t pg_query.Token) bool {
	return t == pg_query.Token_SQL_COMMENT || t == pg_query.Token_C_COMMENT
}

// fillStart sets the Start of statement i: the first token in its span,
// before which there can only be whitespace and comments.
//
// When the span's first byte that is not whitespace (the lexer's {space}:
// space, \t, \n, \r, \v, \f) is neither '-' nor '/', it cannot open a
// comment ("--" or "/*"), so it is the first byte of the first token. Only
// otherwise is the span given to the lexer (pg_query.Scan, which reports
// comments as tokens), which costs a protobuf round trip.
func (a *analysis) fillStart(sql string, i int) error {
	end := a.stmts[i].End
	if end < 0 { // a single statement: its span is the text
		end = len(sql)
	}
	span := sql[a.locs[i]:end]
	for j := 0; j < len(span); j++ {
		switch span[j] {
		case ' ', '\t', '\n', '\r', '\v', '\f':
			continue
		case '-', '/':
		default:
			a.stmts[i].Start = a.locs[i] + j
			return nil
		}
		break
	}
	res, err := pg_query.Scan(span)
	if err != nil {
		return syntaxError(err)
	}
	for _, t := range res.GetTokens() {
		if !isComment(t.GetToken()) {
			a.stmts[i].Start = a.locs[i] + int(t.GetStart())
			return nil
		}
	}
	return errInconsistent
}

// fillStarts sets every Start.
func (a *analysis) fillStarts(sql string) error {
	a.all = true
	for i := range a.stmts {
		if err := a.fillStart(sql, i); err != nil {
			return err
		}
	}
	return nil
}

// scanStarts sets every Start from one lexer scan of the whole text: the
// reference for fillStarts.
func (a *analysis) scanStarts(sql string) error {
	a.all = true
	if len(a.stmts) == 0 {
		return nil
	}
	res, err := pg_query.Scan(sql)
	if err != nil {
		return syntaxError(err)
	}
	toks := res.GetTokens()
	j := 0
	for i := range a.stmts {
		for j < len(toks) && (int(toks[j].GetStart()) < a.locs[i] || isComment(toks[j].GetToken())) {
			j++
		}
		if j == len(toks) || int(toks[j].GetStart()) >= a.stmts[i].End {
			return errInconsistent
		}
		a.stmts[i].Start = int(toks[j].GetStart())
	}
	return nil
}

// referenceSplit is Split done the slow, obvious way: one full parse tree for
// spans and kinds, one scan for first tokens. The tests and fuzz targets
// compare Split with it.
func referenceSplit(sql string) ([]Statement, error) {
	if strings.IndexByte(sql, 0) >= 0 {
		return nil, ErrNUL
	}
	tree, spans, err := parseTree(sql)
	if err != nil {
		return nil, err
	}
	a := &analysis{stmts: make([]Statement, len(spans)), locs: make([]int, len(spans))}
	for i, rs := range tree.GetStmts() {
		a.locs[i] = spans[i][0]
		a.stmts[i] = Statement{Kind: kindOf(rs.GetStmt()), Start: -1, End: spans[i][1]}
	}
	if err := a.scanStarts(sql); err != nil {
		return nil, err
	}
	return a.stmts, nil
}
