package fence_test

import (
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/fence"
)

// TestRegressionHintIsARunnableReset: the hint of a LockIndex regression is a fence reset
// command an operator can run as written: it names --database, which the command requires
// (a newcomer had to guess it).
func TestRegressionHintIsARunnableReset(t *testing.T) {
	hint := fence.Regression("billing", "seen").Hint
	for _, want := range []string{"fenceproxy fence reset --resource billing", "--token ", "--database "} {
		if !strings.Contains(hint, want) {
			t.Errorf("hint %q lacks %q", hint, want)
		}
	}
}
