// Package sql holds the migration files themselves (goose-annotated SQL, one
// file per version), embedded, so that code which only needs to know them
// (the schema check) does not import the migration runner.
package sql

import "embed"

// Files are the migration files, at the root of the file system.
//
//go:embed *.sql
var Files embed.FS
