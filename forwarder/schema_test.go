package forwarder_test

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/migrations"
)

type schemaTestPublisher struct{}

func (schemaTestPublisher) Publish(string, ...*message.Message) error { return nil }
func (schemaTestPublisher) Close() error                              { return nil }

// Run on a search_path without the outbox names the schema and the remedy
// (OUTBOX_SCHEMA_NOT_MIGRATED) instead of failing passes with 42P01.
func TestRunRefusesUnmigratedSchema(t *testing.T) {
	admin, err := sql.Open("postgres", testdb.URL())
	require.NoError(t, err)
	defer admin.Close()
	name := fmt.Sprintf("outbox_test_%d_fwdschema%d", time.Now().Unix(), time.Now().UnixNano()%1000000)
	_, err = admin.Exec("CREATE SCHEMA " + name)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = admin.Exec("DROP SCHEMA IF EXISTS " + name + " CASCADE") })
	db, err := sql.Open("postgres", testdb.WithSearchPath(testdb.URL(), name))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })

	f, err := forwarder.New(db, schemaTestPublisher{}, watermill.NopLogger{}, forwarder.Config{Owner: "schema-test"})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err = f.Run(ctx)
	require.ErrorIs(t, err, migrations.ErrSchemaNotMigrated)
	require.Contains(t, err.Error(), `messaging_outbox not found in search_path "`+name+`"`)
	require.Contains(t, err.Error(), "run outboxctl migrate")
	require.NoError(t, f.Close())
}
