package fence_test

import (
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// TestFenceParameterMistakesSayWhatToDo: the two mistakes a newcomer made were both answered
// "fencing token missing": a token without its resource (on a proxy with several resources)
// now says the resource is missing and names the proxy's resources; options copied from a URL
// with + for each space (libpq does not decode +) now says to write %20.
func TestFenceParameterMistakesSayWhatToDo(t *testing.T) {
	known := []string{"billing", "payroll"}
	for _, tc := range []struct {
		name   string
		params []wire.Param
		code   string
		words  []string // in the message or the hint
	}{
		{"token without resource", []wire.Param{{Name: "options", Value: "-c fence.token=34"}}, fence.CodeMissing,
			[]string{"fencing resource missing", `"billing" "payroll"`, "fence.resource=NAME"}},
		{"+ for spaces in options", []wire.Param{{Name: "options", Value: "-c+fence.resource=billing+-c+fence.token=34"}}, fence.CodeMalformed,
			[]string{"uses + where a space belongs", "%20"}},
		{"+ for spaces, upper case", []wire.Param{{Name: "options", Value: "-c+Fence.Token=34"}}, fence.CodeMalformed,
			[]string{"uses + where a space belongs"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := &wire.Startup{Kind: wire.KindStartup, Version: wire.ProtocolVersion30, Params: tc.params}
			_, err := fence.FromStartup(st, known)
			fe, ok := fence.IsFencing(err)
			if !ok || fe.Code != tc.code {
				t.Fatalf("got %v, want SQLSTATE %s", err, tc.code)
			}
			text := fe.Message + " / " + fe.Hint
			if strings.Contains(fe.Message, "token missing") {
				t.Errorf("still says the token is missing: %s", text)
			}
			for _, w := range tc.words {
				if !strings.Contains(text, w) {
					t.Errorf("%q not in %s", w, text)
				}
			}
		})
	}
	// A + that is not about fence parameters is the server's business.
	st := &wire.Startup{Kind: wire.KindStartup, Version: wire.ProtocolVersion30, Params: []wire.Param{{Name: "options", Value: "-c application_name=a+b"}}}
	if c, err := fence.FromStartup(st, known); err != nil || c.Present {
		t.Fatalf("options without fence parameters: %+v, %v", c, err)
	}
}
