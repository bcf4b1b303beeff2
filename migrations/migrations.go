package migrations

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"

	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/database"
	"github.com/pressly/goose/v3/lock"

	"github.com/fencedoutbox/watermill-outbox/migrations/schema"
	migsql "github.com/fencedoutbox/watermill-outbox/migrations/sql"
)

// VersionTable is the table in which Up records applied versions. It lives in
// the same schema as the outbox (the first schema of search_path).
const VersionTable = schema.VersionTable

// LockID is the base of the PostgreSQL advisory lock key Up holds while it
// migrates, so that two processes migrating the same schema at once do not
// race: the second waits, then finds nothing left to do. The key actually
// used is LockID mixed with a hash of the target schema ([SchemaLockID]), so
// migrating one schema never waits for another. ("outbox" in ASCII.)
const LockID int64 = 0x6f7574626f78

// SchemaLockID is the advisory lock key Up uses for schema.
func SchemaLockID(schema string) int64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(schema))
	return LockID ^ int64(h.Sum64()&0x7fffffff00000000)
}

// FS returns the embedded migration files (goose-annotated SQL, one file per
// version, named NNNNN_name.sql) for use with another migration tool. Each
// file holds a "-- +goose Up" section and a "-- +goose Down" section; tools
// that do not read goose annotations (Flyway, golang-migrate) need the Up
// section only, which is everything between the two markers.
func FS() fs.FS { return migsql.Files }

// Result says what one Up call applied.
type Result struct {
	Applied []int64 // versions this call applied, in order; empty when nothing was pending
	Current int64   // the database's version after the call
}

// Up applies every pending migration to db, under a session-level advisory
// lock so that concurrent callers serialise (both succeed; the later one
// applies nothing). It runs each migration in its own transaction on its own
// connection: never pass it a business transaction, and never call it from
// inside one. Objects are created in the first schema of the connection's
// search_path.
func Up(ctx context.Context, db *sql.DB) (Result, error) {
	p, err := newProvider(ctx, db)
	if err != nil {
		return Result{}, err
	}
	results, err := p.Up(ctx)
	if err != nil {
		var partial *goose.PartialError
		if errors.As(err, &partial) {
			return Result{}, fmt.Errorf("migrations: version %d failed: %w", partial.Failed.Source.Version, partial.Err)
		}
		return Result{}, fmt.Errorf("migrations: %w", err)
	}
	res := Result{}
	for _, r := range results {
		res.Applied = append(res.Applied, r.Source.Version)
	}
	res.Current, err = p.GetDBVersion(ctx)
	if err != nil {
		return res, fmt.Errorf("migrations: read version: %w", err)
	}
	// goose compares the highest version only: a lower one recorded as not
	// applied would pass as "up to date".
	if err := schema.Check(ctx, db); err != nil {
		return res, err
	}
	return res, nil
}

// Status reports, for each embedded migration, whether it has been applied.
func Status(ctx context.Context, db *sql.DB) ([]*goose.MigrationStatus, error) {
	p, err := newProvider(ctx, db)
	if err != nil {
		return nil, err
	}
	return p.Status(ctx)
}

func newProvider(ctx context.Context, db *sql.DB) (*goose.Provider, error) {
	var schema sql.NullString
	if err := db.QueryRowContext(ctx, `SELECT current_schema()`).Scan(&schema); err != nil {
		return nil, fmt.Errorf("migrations: read current_schema(): %w", err)
	}
	if !schema.Valid {
		return nil, fmt.Errorf("migrations: no schema of search_path exists; create it first (CREATE SCHEMA ...)")
	}
	// Retry the lock every second (goose's default is every 5 s) for up to
	// five minutes: a replica waiting for another's migration should start
	// as soon as that one is done.
	locker, err := lock.NewPostgresSessionLocker(
		lock.WithLockID(SchemaLockID(schema.String)),
		lock.WithLockTimeout(1, 300),
	)
	if err != nil {
		return nil, fmt.Errorf("migrations: locker: %w", err)
	}
	// The version table through a store rather than goose.WithTableName,
	// which needs goose v3.26+ and with it a newer OpenTelemetry for every
	// service importing this module.
	store, err := database.NewStore(database.DialectPostgres, VersionTable)
	if err != nil {
		return nil, fmt.Errorf("migrations: store: %w", err)
	}
	p, err := goose.NewProvider("", db, FS(),
		goose.WithStore(store),
		goose.WithSessionLocker(locker),
		goose.WithDisableGlobalRegistry(true),
	)
	if err != nil {
		return nil, fmt.Errorf("migrations: %w", err)
	}
	return p, nil
}

// CodeSchemaNotMigrated is Check's refusal (see package schema).
const CodeSchemaNotMigrated = schema.CodeNotMigrated

// ErrSchemaNotMigrated matches CodeSchemaNotMigrated with errors.Is.
var ErrSchemaNotMigrated = schema.ErrNotMigrated

// Check reports OUTBOX_SCHEMA_NOT_MIGRATED, naming the search_path and the
// remedy, when messaging_outbox is missing or older than this build needs
// (schema.Check).
func Check(ctx context.Context, db *sql.DB) error { return schema.Check(ctx, db) }

// Latest is the highest migration version this build embeds.
func Latest() int64 { return schema.Latest() }
