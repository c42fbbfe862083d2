package wire

import (
	"fmt"
	"strings"
)

// SplitOptions splits the `options` startup parameter into arguments the way
// PostgreSQL's pg_split_opts does: arguments are separated by ASCII white
// space, and a backslash makes the next byte literal (so "\ " is a space
// inside an argument and "\\" a backslash).
func SplitOptions(s string) []string {
	var (
		args []string
		cur  strings.Builder
		in   bool
	)
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case isSpace(c):
			if in {
				args = append(args, cur.String())
				cur.Reset()
				in = false
			}
		case c == '\\' && i+1 < len(s):
			i++
			cur.WriteByte(s[i])
			in = true
		case c == '\\':
			// A trailing lone backslash is dropped, as PostgreSQL does.
			in = true
		default:
			cur.WriteByte(c)
			in = true
		}
	}
	if in {
		args = append(args, cur.String())
	}
	return args
}

func isSpace(c byte) bool {
	return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'
}

// JoinOptions is the inverse of SplitOptions: it escapes white space and
// backslashes so that SplitOptions(JoinOptions(a)) equals a.
func JoinOptions(args []string) string {
	var b strings.Builder
	for i, a := range args {
		if i > 0 {
			b.WriteByte(' ')
		}
		for j := 0; j < len(a); j++ {
			if isSpace(a[j]) || a[j] == '\\' {
				b.WriteByte('\\')
			}
			b.WriteByte(a[j])
		}
	}
	return b.String()
}

// Setting is a run-time parameter given in `options` as `-c name=value`,
// `-cname=value` or `--name=value`.
type Setting struct {
	Name, Value string
}

// ExtractSettings walks the arguments of an `options` string the way the
// server's command-line switch parser does and returns the settings whose
// (case-folded) names satisfy keep, together with the remaining arguments
// with those settings removed. Other switches are left untouched.
//
// Names are folded to lower case and '-' becomes '_' for `--name=value`, as
// PostgreSQL does.
func ExtractSettings(args []string, keep func(name string) bool) (found []Setting, rest []string, err error) {
	for i := 0; i < len(args); i++ {
		a := args[i]
		var nv string
		var consumed []string
		switch {
		case a == "-c":
			if i+1 >= len(args) {
				return nil, nil, fmt.Errorf("options: -c requires a name=value argument")
			}
			nv = args[i+1]
			consumed = args[i : i+2]
			i++
		case strings.HasPrefix(a, "-c"):
			nv = a[2:]
			consumed = args[i : i+1]
		case strings.HasPrefix(a, "--") && len(a) > 2:
			nv = strings.ReplaceAll(a[2:], "-", "_")
			if eq := strings.IndexByte(a[2:], '='); eq >= 0 {
				// Only the name part has '-' replaced.
				nv = strings.ReplaceAll(a[2:2+eq], "-", "_") + a[2+eq:]
			}
			consumed = args[i : i+1]
		default:
			rest = append(rest, a)
			continue
		}
		name, value, ok := strings.Cut(nv, "=")
		if !ok {
			// Not a setting we understand: leave it for the server to judge.
			rest = append(rest, consumed...)
			continue
		}
		name = strings.ToLower(name)
		if keep(name) {
			found = append(found, Setting{Name: name, Value: value})
			continue
		}
		rest = append(rest, consumed...)
	}
	return found, rest, nil
}
