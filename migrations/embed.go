// Package migrations holds the SQL of the fence schema, embedded so that the fenceproxy binary
// can install and upgrade it (fence.Migrate, `fenceproxy migrate`) without files on disk.
//
//   - baseline.sql: the tables, indexes, comments and privileges of schema version Version, as a
//     fresh install creates them (no object of an earlier version is ever created).
//   - upgrade/NNNNN_name.sql: the step that brings the tables of a database at version NNNNN-1
//     to version NNNNN (new tables, ALTERs, data, dropped objects). A version whose change is
//     in functions only has no step. Steps are frozen once released.
//   - functions/fence.NAME.sql: the current definition of one function (CREATE OR REPLACE), its
//     comment and privileges; each function is defined in exactly one file.
//
// docs/schema.md describes how fence.Migrate applies them and how to change the schema.
package migrations

import "embed"

// Version is the fence schema version this code requires and installs: the one place it is
// stated. Raise it by one for every released change of baseline.sql, upgrade/ or functions/
// (docs/schema.md).
const Version = 16

// FS holds baseline.sql, upgrade/*.sql and functions/*.sql.
//
//go:embed baseline.sql upgrade/*.sql functions/*.sql
var FS embed.FS
