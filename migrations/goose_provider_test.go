package migrations_test

import (
	"database/sql"
	"testing"

	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/database"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/migrations"
)

// gooseProvider is a bare goose provider on the package's migrations and
// version table, for tests that step through versions (UpTo, DownTo). The
// table is named through a store: goose.WithTableName needs goose v3.26,
// above the core's pinned v3.20.
func gooseProvider(t *testing.T, db *sql.DB) *goose.Provider {
	t.Helper()
	store, err := database.NewStore(database.DialectPostgres, migrations.VersionTable)
	require.NoError(t, err)
	p, err := goose.NewProvider("", db, migrations.FS(), goose.WithStore(store), goose.WithDisableGlobalRegistry(true))
	require.NoError(t, err)
	return p
}
