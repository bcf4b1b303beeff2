package migrations_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/migrations"
)

// emptySchema creates a schema with nothing in it and returns a pool whose
// search_path selects it.
func emptySchema(t *testing.T) (string, *sql.DB) {
	t.Helper()
	admin, err := sql.Open("postgres", testdb.URL())
	require.NoError(t, err)
	t.Cleanup(func() { _ = admin.Close() })
	name := fmt.Sprintf("outbox_test_%d_chk%d", time.Now().Unix(), time.Now().UnixNano()%1000000)
	_, err = admin.Exec("CREATE SCHEMA " + name)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = admin.Exec("DROP SCHEMA IF EXISTS " + name + " CASCADE") })
	db, err := sql.Open("postgres", testdb.WithSearchPath(testdb.URL(), name))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	return name, db
}

func TestCheckSchemaNotMigratedNamesSearchPathAndRemedy(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name, db := emptySchema(t)

	err := migrations.Check(ctx, db)
	require.ErrorIs(t, err, migrations.ErrSchemaNotMigrated)
	var e *outbox.Error
	require.True(t, errors.As(err, &e))
	require.Equal(t, migrations.CodeSchemaNotMigrated, e.Code)
	require.Contains(t, err.Error(), `messaging_outbox not found in search_path "`+name+`"`)
	require.Contains(t, err.Error(), "run outboxctl migrate")

	// A search_path naming no existing schema says so.
	none, err := sql.Open("postgres", testdb.WithSearchPath(testdb.URL(), "no_such_schema_x"))
	require.NoError(t, err)
	defer none.Close()
	err = migrations.Check(ctx, none)
	require.ErrorIs(t, err, migrations.ErrSchemaNotMigrated)
	require.Contains(t, err.Error(), `search_path "no_such_schema_x"`)
	require.Contains(t, err.Error(), "no schema of it exists")

	_, err = migrations.Up(ctx, db)
	require.NoError(t, err)
	require.NoError(t, migrations.Check(ctx, db))
}

func TestCheckRefusesAnOlderSchemaVersion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := testdb.New(t)
	require.NoError(t, migrations.Check(ctx, s.DB))
	latest := migrations.Latest()
	require.GreaterOrEqual(t, latest, int64(31))
	_, err := s.DB.Exec(`DELETE FROM `+migrations.VersionTable+` WHERE version_id = $1`, latest)
	require.NoError(t, err)
	err = migrations.Check(ctx, s.DB)
	require.ErrorIs(t, err, migrations.ErrSchemaNotMigrated)
	require.Contains(t, err.Error(), fmt.Sprintf("this build needs %d", latest))
	require.Contains(t, err.Error(), "run outboxctl migrate")
}

// A migration below the latest one recorded as not applied (its row removed
// by hand) is not "up to date": Check refuses the schema naming the
// version, and Up, which sees nothing above the latest to apply, reports it
// instead of success.
func TestAGapInTheAppliedMigrationsIsRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := testdb.New(t)
	_, err := s.DB.Exec(`DELETE FROM ` + migrations.VersionTable + ` WHERE version_id = 20`)
	require.NoError(t, err)
	err = migrations.Check(ctx, s.DB)
	require.ErrorIs(t, err, migrations.ErrSchemaNotMigrated)
	require.Contains(t, err.Error(), "not [20]")
	_, err = migrations.Up(ctx, s.DB)
	require.ErrorIs(t, err, migrations.ErrSchemaNotMigrated, "Up does not report a gap as up to date")
}
