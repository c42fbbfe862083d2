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

// postgresSwitches is the getopt option string of PostgreSQL 15's backend switches
// (process_postgres_switches in src/backend/tcop/postgres.c), which parses `options`: the
// letters followed by ':' take an argument. Only -c and -- set run-time parameters.
const postgresSwitches = "B:bc:C:D:d:EeFf:h:ijk:lN:nOPp:r:S:sTt:v:W:-:"

// takesArgument reports whether switch letter ch takes an argument, and whether it is one.
func takesArgument(ch byte) (known, arg bool) {
	i := strings.IndexByte(postgresSwitches, ch)
	if i < 0 || ch == ':' {
		return false, false
	}
	return true, i+1 < len(postgresSwitches) && postgresSwitches[i+1] == ':'
}

// ExtractSettings walks the arguments of an `options` string as the server's getopt does
// (postgresSwitches) and returns the settings whose (case-folded) names satisfy keep,
// together with the remaining arguments with those settings removed. Other switches are
// left untouched.
//
// getopt reads switches clustered in one argument: `-ec x=1` is `-e -c x=1`, `-e-x=1` is
// `-e --x=1`, and a switch that takes an argument takes the rest of its argument or the
// next one (`-B -c` gives -B the argument "-c"). A parser that knew only `-c` and `--`
// missed `-ec fence.token=1`, which the server then set while the proxy saw no token.
//
// Names are folded to lower case and '-' becomes '_' for `--name=value`, as PostgreSQL
// does.
func ExtractSettings(args []string, keep func(name string) bool) (found []Setting, rest []string, err error) {
	for i := 0; i < len(args); i++ {
		a := args[i]
		if len(a) < 2 || a[0] != '-' || a == "--" {
			// A plain argument, or the end of the switches: the server judges it.
			rest = append(rest, a)
			continue
		}
		start := i
		flags := "" // the switches of this argument before a setting
		var nv string
		long, setting := false, false
		for j := 1; j < len(a); j++ {
			known, arg := takesArgument(a[j])
			if !known || !arg {
				flags += string(a[j]) // a flag, or a switch the server will refuse
				continue
			}
			value := a[j+1:]
			if value == "" {
				if i+1 >= len(args) {
					return nil, nil, fmt.Errorf("options: -%c requires an argument", a[j])
				}
				i++
				value = args[i]
			}
			if a[j] == 'c' || a[j] == '-' {
				nv, long, setting = value, a[j] == '-', true
			}
			if !setting {
				flags += string(a[j]) + value // kept as it was: -Bvalue
			}
			break
		}
		consumed := args[start : i+1]
		if !setting {
			rest = append(rest, consumed...)
			continue
		}
		if long {
			if eq := strings.IndexByte(nv, '='); eq >= 0 {
				// Only the name part has '-' replaced.
				nv = strings.ReplaceAll(nv[:eq], "-", "_") + nv[eq:]
			} else {
				nv = strings.ReplaceAll(nv, "-", "_")
			}
		}
		name, value, ok := strings.Cut(nv, "=")
		if !ok {
			// Not a setting we understand: leave it for the server to judge.
			rest = append(rest, consumed...)
			continue
		}
		name = strings.ToLower(name)
		if !keep(name) {
			rest = append(rest, consumed...)
			continue
		}
		found = append(found, Setting{Name: name, Value: value})
		if flags != "" {
			rest = append(rest, "-"+flags) // the switches clustered before the setting stay
		}
	}
	return found, rest, nil
}
