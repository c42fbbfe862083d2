// Package migrations holds the versioned SQL of the fence schema, embedded so that the
// fenceproxy binary can install it (fence.Migrate, `fenceproxy migrate`) without files on disk.
package migrations

import "embed"

// FS holds the goose migrations (*.sql), named NNNNN_description.sql, applied in version order.
//
//go:embed *.sql
var FS embed.FS
