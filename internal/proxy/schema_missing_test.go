package proxy_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestUnmigratedDatabaseNamesTheSchemaVersion: a fenced session on a database without the fence
// schema is refused with the version this fenceproxy needs (fence.SchemaVersion) and the
// command that installs it; it said "schema version 4" when the schema was at 9.
func TestUnmigratedDatabaseNamesTheSchemaVersion(t *testing.T) {
	t.Parallel()
	pg := testenv.StartPostgres(t)
	pg.CreateRole(t, "app", "app")
	px := fencedProxy(t, pg)
	err := connectErr(px.FenceURL("app", "postgres", "billing", 1, "password=app"))
	wantCode(t, err, fence.CodeUnavailable)
	want := fmt.Sprintf("needs fence schema version %d in this database (run fenceproxy migrate)", fence.SchemaVersion)
	if !strings.Contains(err.Error(), want) {
		t.Fatalf("%v\nwant %q", err, want)
	}
}
