// Package schema checks that a database holds the outbox schema this build
// needs, without importing the migration runner (and its dependencies): the
// forwarder and the CLI refuse to start on an unmigrated schema with
// OUTBOX_SCHEMA_NOT_MIGRATED, naming the search_path and the remedy.
package schema

import (
	"context"
	"database/sql"
	"fmt"
	"io/fs"
	"slices"
	"strconv"
	"strings"

	outbox "github.com/fencedoutbox/watermill-outbox"
	migsql "github.com/fencedoutbox/watermill-outbox/migrations/sql"
)

// VersionTable is the table in which migrations.Up records applied versions.
const VersionTable = "messaging_schema_version"

// CodeSchemaNotMigrated: the connection's search_path does not reach a
// migrated watermill-outbox schema (messaging_outbox is missing, or the
// recorded version is older than this build's migrations).
const CodeNotMigrated outbox.Code = "OUTBOX_SCHEMA_NOT_MIGRATED"

// ErrSchemaNotMigrated matches CodeSchemaNotMigrated with errors.Is.
var ErrNotMigrated = &outbox.Error{Code: CodeNotMigrated}

// Latest is the highest version among the embedded migrations: the version
// [Up] leaves a database at.
func Latest() int64 {
	return slices.Max(append(versions(), 0))
}

// versions are the embedded migrations' versions.
func versions() []int64 {
	var out []int64
	entries, _ := fs.ReadDir(migsql.Files, ".")
	for _, e := range entries {
		prefix, _, ok := strings.Cut(e.Name(), "_")
		if !ok || !strings.HasSuffix(e.Name(), ".sql") {
			continue
		}
		if v, err := strconv.ParseInt(prefix, 10, 64); err == nil {
			out = append(out, v)
		}
	}
	return out
}

// sqlCheck reads, in one statement, the search_path, the first schema of it
// that exists, whether messaging_outbox resolves through it, and whether the
// version table does.
const sqlCheck = `
SELECT current_setting('search_path'), coalesce(current_schema(), ''),
       to_regclass('messaging_outbox') IS NOT NULL,
       to_regclass('` + VersionTable + `') IS NOT NULL`

// Check reports whether db's search_path reaches a schema migrated to this
// build's migrations. It returns nil, an OUTBOX_SCHEMA_NOT_MIGRATED
// *outbox.Error that names the table or version, the search_path and the
// remedy (run `outboxctl migrate`, or [Up]), or the database error itself
// (unreachable, permission denied) unchanged in kind.
//
// A schema migrated by another tool from [FS] without goose's version table
// passes when messaging_outbox exists: only a version table that records an
// older version than [Latest] is refused.
func Check(ctx context.Context, db *sql.DB) error {
	const op = "migrations.Check"
	var (
		searchPath, schema      string
		hasOutbox, hasVersioned bool
	)
	if err := db.QueryRowContext(ctx, sqlCheck).Scan(&searchPath, &schema, &hasOutbox, &hasVersioned); err != nil {
		return fmt.Errorf("migrations: check schema: %w", err)
	}
	if !hasOutbox {
		where := "no schema of it exists"
		if schema != "" {
			where = "the first existing schema is " + strconv.Quote(schema)
		}
		return outbox.Errorf(CodeNotMigrated, op,
			"messaging_outbox not found in search_path %q (%s); run outboxctl migrate (or migrations.Up) with this search_path",
			searchPath, where)
	}
	if !hasVersioned {
		return nil
	}
	rows, err := db.QueryContext(ctx, `SELECT version_id FROM `+VersionTable+` WHERE is_applied`)
	if err != nil {
		return fmt.Errorf("migrations: check schema version: %w", err)
	}
	defer rows.Close()
	applied := map[int64]bool{}
	var current int64
	for rows.Next() {
		var v int64
		if err := rows.Scan(&v); err != nil {
			return fmt.Errorf("migrations: check schema version: %w", err)
		}
		applied[v], current = true, max(current, v)
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("migrations: check schema version: %w", err)
	}
	if latest := Latest(); current < latest {
		return outbox.Errorf(CodeNotMigrated, op,
			"schema %q (search_path %q) is at version %d, this build needs %d; run outboxctl migrate (or migrations.Up) with this search_path",
			schema, searchPath, current, latest)
	}
	return checkGaps(op, schema, applied)
}

// checkGaps refuses a schema on which a migration below its latest applied
// one is not recorded as applied (its row was removed or marked not applied
// by hand): migrating "up" sees nothing to do, and whether that migration's
// changes are there is unknown.
func checkGaps(op, schema string, applied map[int64]bool) error {
	var missing []int64
	for _, v := range versions() {
		if !applied[v] {
			missing = append(missing, v)
		}
	}
	if len(missing) == 0 {
		return nil
	}
	slices.Sort(missing)
	return outbox.Errorf(CodeNotMigrated, op,
		"schema %q records later migrations as applied but not %v: its version table was edited by hand; check whether those migrations' changes are in place, then restore their rows in %s (is_applied = true) or apply them by hand",
		schema, missing, VersionTable)
}
