package main

import (
	"runtime/debug"
	"strings"
	"testing"
)

// TestVersionFallsBackToBuildInfo: without a stamped version, `fenceproxy version` prints the
// module's version (go install module@version), else the commit go build recorded (-dirty for
// a changed work tree), else says how to get one; never "dev".
func TestVersionFallsBackToBuildInfo(t *testing.T) {
	rev := "0123456789abcdef0123456789abcdef01234567"
	vcs := func(modified string) *debug.BuildInfo {
		return &debug.BuildInfo{Main: debug.Module{Version: "(devel)"},
			Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: rev}, {Key: "vcs.modified", Value: modified}}}
	}
	for _, tc := range []struct {
		name, stamped string
		info          *debug.BuildInfo
		want          string
	}{
		{"stamped by make build", "v1.2.0-3-gabcdef0", vcs("false"), "v1.2.0-3-gabcdef0"},
		{"go install module@version", "", &debug.BuildInfo{Main: debug.Module{Version: "v1.2.0"}}, "v1.2.0"},
		{"go build of a clean tree", "", vcs("false"), "0123456789ab"},
		{"go build of a changed tree", "", vcs("true"), "0123456789ab-dirty"},
		{"no VCS information", "", &debug.BuildInfo{Main: debug.Module{Version: "(devel)"}}, "unknown (built without VCS information"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := versionOf(tc.stamped, tc.info, true); !strings.HasPrefix(got, tc.want) {
				t.Fatalf("versionOf: %q, want %q", got, tc.want)
			}
		})
	}

}
