package sqltx

import (
	"slices"
	"strings"

	pg_query "github.com/pganalyze/pg_query_go/v6"
)

// safeEncodingNames lists, under PostgreSQL's normalised spelling (lower case, letters
// and digits only, as clean_encoding_name in encnames.c makes them), the names
// of the encodings PostgreSQL accepts as server encodings, with their aliases.
// In all of them a byte below 0x80 is always an ASCII character, never part of
// a multibyte character: that is what lets the proxy lex the client's bytes
// with a lexer that only looks at ASCII.
//
// The client-only encodings (SJIS, SHIFT_JIS_2004, BIG5, GBK, UHC, GB18030,
// JOHAB, with their aliases mskanji, shiftjis, win932, win936, win949, win950,
// ...) are deliberately absent: their second bytes can be 0x5C, a backslash,
// which inside E'...' would make the proxy see an escaped quote where
// PostgreSQL, after converting to the server encoding, sees the end of the
// string. Unknown names are absent too, so they count as unsafe.
func safeEncodingNames() []string {
	return []string{
		"sqlascii", "utf8", "unicode", "eucjp", "euccn", "euckr", "euctw", "eucjis2004",
		"muleinternal", "latin1", "latin2", "latin3", "latin4", "latin5", "latin6", "latin7",
		"latin8", "latin9", "latin10", "iso88591", "iso88592", "iso88593", "iso88594",
		"iso88595", "iso88596", "iso88597", "iso88598", "iso88599", "iso885910", "iso885913",
		"iso885914", "iso885915", "iso885916", "koi8", "koi8r", "koi8u", "win", "alt", "abc",
		"tcvn", "tcvn5712", "vscii", "win866", "win874", "win1250", "win1251", "win1252",
		"win1253", "win1254", "win1255", "win1256", "win1257", "win1258", "windows866",
		"windows874", "windows1250", "windows1251", "windows1252", "windows1253",
		"windows1254", "windows1255", "windows1256", "windows1257", "windows1258",
	}
}

// ClientEncodingSafe reports whether name (as in SET client_encoding, or the
// client_encoding ParameterStatus) is an encoding in which the proxy lexes SQL
// exactly as PostgreSQL does: one whose bytes below 0x80 are always ASCII
// characters. The proxy should refuse fenced sessions whose client_encoding is
// not safe, at startup and whenever a ParameterStatus reports a change.
func ClientEncodingSafe(name string) bool {
	var b [24]byte
	n := 0
	for i := 0; i < len(name); i++ {
		c := name[i]
		switch {
		case c >= 'A' && c <= 'Z':
			c += 'a' - 'A'
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9':
		default:
			continue // PostgreSQL ignores everything but letters and digits
		}
		if n == len(b) {
			return false // longer than any known name
		}
		b[n] = c
		n++
	}
	return slices.Contains(safeEncodingNames(), string(b[:n]))
}

// StdStringsSensitive reports whether PostgreSQL could lex sql differently
// with standard_conforming_strings off: whether one of its '...' literals (as
// lexed with the setting on, as the proxy does) holds a backslash. With the
// setting off such a literal is read as E'...', where \' does not end it, and
// code can become string or string code: `SELECT 'a\' || ' ; COMMIT; --'` is
// one SELECT to the proxy and a SELECT, a COMMIT and a comment to a session
// with the setting off. Text without such a literal is lexed alike under both
// settings (the other literals, E'...', U&'...', B'...', X'...' and dollar
// quotes, do not depend on it).
//
// The proxy needs this where it cannot know the setting a message will meet:
// a ParameterStatus reporting a change made by set_config(...) arrives only
// after that statement ran, so a message sent behind it in a pipeline is
// lexed under the new value. A message that is not sensitive is safe either
// way; a sensitive one should wait until everything before it has completed
// (ReadyForQuery) and the setting is known to be on. A lexer error returns
// true with the error (fail closed). Most text has no backslash at all and
// costs one byte scan.
func StdStringsSensitive(sql string) (bool, error) {
	if strings.IndexByte(sql, '\\') < 0 {
		return false, nil
	}
	if strings.IndexByte(sql, 0) >= 0 {
		return true, ErrNUL
	}
	res, err := pg_query.Scan(sql)
	if err != nil {
		return true, syntaxError(err)
	}
	for _, t := range res.GetTokens() {
		start, end := int(t.GetStart()), int(t.GetEnd())
		if t.GetToken() == pg_query.Token_SCONST && start < end && end <= len(sql) && sql[start] == '\'' &&
			strings.IndexByte(sql[start:end], '\\') >= 0 {
			return true, nil
		}
	}
	return false, nil
}
