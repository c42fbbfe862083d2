package fence

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"

	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// Startup parameter names a session uses to present its token.
const (
	ParamResource = "fence.resource"
	ParamToken    = "fence.token"
	ParamSession  = "fence.session"
)

// resourcePattern is the strict pattern for resource names. The names end up
// inside SQL the proxy builds, so this pattern (no quotes, no backslashes, no
// white space) is part of the injection-safety argument; the fence.tokens
// table enforces the same pattern with a CHECK constraint.
var resourcePattern = regexp.MustCompile(`^[a-z][a-z0-9_.-]{0,62}$`)

// ValidResource reports whether name is a valid resource name.
func ValidResource(name string) bool { return resourcePattern.MatchString(name) }

// ParseToken parses a fencing token: a positive 64-bit decimal integer.
func ParseToken(s string) (int64, error) {
	if s == "" {
		return 0, Malformed("fence.token is empty")
	}
	t, err := strconv.ParseInt(s, 10, 64)
	if err != nil || t <= 0 || strings.TrimSpace(s) != s || strings.HasPrefix(s, "+") {
		return 0, Malformed(fmt.Sprintf("fence.token %q is not a positive 64-bit integer", s))
	}
	return t, nil
}

// Credentials are what a session presented in its startup parameters.
type Credentials struct {
	Resource string
	Token    int64
	Session  string // optional Consul session ID (sequencer check)
	// Present is false when the session gave no fence parameter at all.
	Present bool
}

// FromStartup extracts the fence parameters from a startup message, given
// directly or in `options` (-c fence.token=34), and removes them from it so
// that the server never sees them. known lists the configured resources.
func FromStartup(s *wire.Startup, known []string) (Credentials, error) {
	vals := map[string][]string{}
	// PostgreSQL folds the case of a parameter's name (Fence.Token sets fence.token), so
	// the proxy must too: a name it did not recognise would reach the server, which would
	// set the setting while the proxy saw no token at all (under --unfenced allow, an
	// unfenced session). So any name that folds to fence.* is the proxy's, and removed.
	var ours []string
	for _, p := range s.Params {
		name := foldName(p.Name)
		if !strings.HasPrefix(name, "fence.") {
			continue
		}
		switch name {
		case ParamResource, ParamToken, ParamSession:
			vals[name] = append(vals[name], p.Value)
			ours = append(ours, p.Name)
		default:
			return Credentials{}, Malformed(fmt.Sprintf("unknown fence parameter %q (known: fence.resource, fence.token, fence.session)", p.Name))
		}
	}
	for _, name := range ours {
		s.DeleteParam(name)
	}
	if opts, ok := s.Param("options"); ok {
		found, rest, err := wire.ExtractSettings(wire.SplitOptions(opts), func(n string) bool {
			return strings.HasPrefix(n, "fence.")
		})
		if err != nil {
			return Credentials{}, Malformed(err.Error())
		}
		for _, f := range found {
			switch f.Name {
			case ParamResource, ParamToken, ParamSession:
				vals[f.Name] = append(vals[f.Name], f.Value)
			default:
				return Credentials{}, Malformed(fmt.Sprintf("unknown fence parameter %q (known: fence.resource, fence.token, fence.session)", f.Name))
			}
		}
		if len(found) > 0 {
			if len(rest) == 0 {
				s.DeleteParam("options")
			} else {
				s.SetParam("options", wire.JoinOptions(rest))
			}
		}
	}
	var c Credentials
	for name, v := range vals {
		c.Present = true
		if len(v) > 1 && !allEqual(v) {
			return c, Malformed(fmt.Sprintf("%s given more than once with different values %q", name, v))
		}
	}
	if !c.Present {
		if opts, ok := s.Param("options"); ok && strings.Contains(opts, "+") && strings.Contains(foldName(opts), "fence.") {
			// libpq and pgx do not decode + as a space in a URL: "-c+fence.token%3D34" is
			// one word, no fence parameter for the proxy and a bad setting for the server.
			return c, &Error{Code: CodeMalformed,
				Message: fmt.Sprintf("fencing parameters not read: options %q uses + where a space belongs", opts),
				Hint:    "In a connection URL write the spaces of options as %20, not +: ?options=-c%20fence.resource%3Dbilling%20-c%20fence.token%3D34"}
		}
		return c, nil
	}
	res, hasRes := vals[ParamResource]
	tok, hasTok := vals[ParamToken]
	if sess, ok := vals[ParamSession]; ok {
		c.Session = sess[0]
	}
	if !hasRes {
		if len(known) == 1 {
			c.Resource = known[0]
		} else {
			return c, &Error{Code: CodeMissing,
				Message: fmt.Sprintf("fencing resource missing: fence.token given without fence.resource, and this proxy fences %d resources %q", len(known), known),
				Hint:    "Name the resource the token is for: options='-c fence.resource=NAME -c fence.token=N' (or ?fence.resource=NAME with pgx)."}
		}
	} else {
		c.Resource = res[0]
	}
	if !ValidResource(c.Resource) {
		return c, Malformed(fmt.Sprintf("fence.resource %q must match %s", c.Resource, resourcePattern))
	}
	if !contains(known, c.Resource) {
		return c, Unknown(c.Resource, known)
	}
	if !hasTok {
		return c, Missing(fmt.Sprintf("fence.resource %q given without fence.token", c.Resource))
	}
	t, err := ParseToken(tok[0])
	if err != nil {
		return c, err
	}
	c.Token = t
	return c, nil
}

// foldName folds a parameter name as PostgreSQL compares setting names (guc_name_compare):
// ASCII letters to lower case, nothing else.
func foldName(name string) string {
	b := []byte(name)
	for i, c := range b {
		if 'A' <= c && c <= 'Z' {
			b[i] = c + 'a' - 'A'
		}
	}
	return string(b)
}

func allEqual(v []string) bool {
	for _, x := range v[1:] {
		if x != v[0] {
			return false
		}
	}
	return true
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}
