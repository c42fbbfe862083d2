package fence_test

import (
	"io/fs"
	"strconv"
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/migrations"
)

// TestSchemaVersionIsTheLastMigration: the schema version messages name (fence.SchemaVersion)
// is the highest migration's, so that "run fenceproxy migrate" names the version it installs.
func TestSchemaVersionIsTheLastMigration(t *testing.T) {
	files, err := fs.Glob(migrations.FS, "*.sql")
	if err != nil {
		t.Fatal(err)
	}
	highest := 0
	for _, f := range files {
		n, err := strconv.Atoi(strings.SplitN(f, "_", 2)[0])
		if err != nil {
			t.Fatalf("migration %s: no version number: %v", f, err)
		}
		highest = max(highest, n)
	}
	if highest != fence.SchemaVersion {
		t.Fatalf("fence.SchemaVersion is %d, the highest migration is %d", fence.SchemaVersion, highest)
	}
}
