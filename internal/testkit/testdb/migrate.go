package testdb

import (
	"context"
	"database/sql"
	"fmt"
	"io/fs"
	"sort"
	"strconv"
	"strings"
	"sync"

	"github.com/pressly/goose/v3/database"

	"github.com/fencedoutbox/watermill-outbox/migrations"
	"github.com/fencedoutbox/watermill-outbox/migrations/schema"
)

// A test schema is migrated by replaying the Up sections of the embedded
// migration files in one multi-statement query, with the goose version
// table created by goose's own store and filled as goose fills it, instead
// of through migrations.Up. What migrations.FS documents for other
// migration tools ("the Up section only, everything between the two
// markers") is what this relies on, and TestReplayedSchemaMatchesMigrated
// checks that the two give the same catalog. The reason is cost: under
// -race, migrations.Up spent about 180 ms of the test process's CPU per
// schema (goose parses every file with 4 MiB buffers and runs each version
// in its own transaction with its own bookkeeping), and the core's suite
// creates about 350 schemas; the replay costs about 1 ms of client CPU and
// one round trip. The migrations package's own tests run migrations.Up.

var replay struct {
	once     sync.Once
	script   string // every Up section, in version order, then the version rows
	versions []int64
	err      error
}

// migrationScript returns the Up sections of every embedded migration, in
// version order, followed by the INSERT that records them in the version
// table (version 0 first, as goose records it when it creates the table).
func migrationScript() (string, []int64, error) {
	replay.once.Do(func() {
		replay.script, replay.versions, replay.err = buildScript(migrations.FS())
	})
	return replay.script, replay.versions, replay.err
}

func buildScript(files fs.FS) (string, []int64, error) {
	entries, err := fs.ReadDir(files, ".")
	if err != nil {
		return "", nil, err
	}
	type section struct {
		version int64
		up      string
	}
	var sections []section
	for _, e := range entries {
		name := e.Name()
		if e.IsDir() || !strings.HasSuffix(name, ".sql") {
			continue
		}
		prefix, _, ok := strings.Cut(name, "_")
		v, err := strconv.ParseInt(prefix, 10, 64)
		if !ok || err != nil {
			return "", nil, fmt.Errorf("testdb: migration file %s has no version prefix", name)
		}
		data, err := fs.ReadFile(files, name)
		if err != nil {
			return "", nil, err
		}
		text := string(data)
		up := strings.Index(text, "-- +goose Up")
		down := strings.Index(text, "-- +goose Down")
		if up < 0 || down < up {
			return "", nil, fmt.Errorf("testdb: migration file %s has no Up section before its Down section", name)
		}
		sections = append(sections, section{v, text[up:down]})
	}
	sort.Slice(sections, func(i, j int) bool { return sections[i].version < sections[j].version })
	var b strings.Builder
	versions := []int64{0}
	for _, s := range sections {
		b.WriteString(s.up)
		b.WriteString("\n;\n")
		versions = append(versions, s.version)
	}
	b.WriteString("INSERT INTO " + schema.VersionTable + " (version_id, is_applied) VALUES ")
	for i, v := range versions {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "(%d, true)", v)
	}
	return b.String(), versions, nil
}

// migrateFresh brings db's schema (the first of its search_path, empty) to
// the latest version in one transaction: goose's version table, then the
// replayed migrations and their version rows. schema.Check confirms it, as
// migrations.Up does.
func migrateFresh(ctx context.Context, db *sql.DB) error {
	script, _, err := migrationScript()
	if err != nil {
		return err
	}
	store, err := database.NewStore(database.DialectPostgres, schema.VersionTable)
	if err != nil {
		return err
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	if err := store.CreateVersionTable(ctx, tx); err != nil {
		return fmt.Errorf("create version table: %w", err)
	}
	if _, err := tx.ExecContext(ctx, script); err != nil {
		return fmt.Errorf("replay migrations: %w", err)
	}
	if err := tx.Commit(); err != nil {
		return err
	}
	return schema.Check(ctx, db)
}
