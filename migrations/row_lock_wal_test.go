package migrations_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/migrations"
)

// An update of messaging_outbox writes the row's new version and its index
// entries, and no row lock before them: the trigger that refuses per-row
// leases on lanes fires after the row is written (migration 00051). As a
// BEFORE trigger it made PostgreSQL lock every updated row first, one more
// WAL record per row (four per row here instead of three), whatever its
// WHEN clause said. EXPLAIN (ANALYZE, WAL) counts the statement's records.
func TestAnUpdateOfTheOutboxLocksNoRowFirst(t *testing.T) {
	t.Parallel()
	_, dsn := freshSchema(t)
	db := open(t, dsn)
	ctx := context.Background()
	_, err := migrations.Up(ctx, db)
	require.NoError(t, err)
	const rows = 40
	_, err = db.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload)
SELECT 'm' || g, 'd', decode(repeat('ab', 1000), 'hex') FROM generate_series(1, $1::int) g`, rows)
	require.NoError(t, err)

	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	var plan []byte
	require.NoError(t, tx.QueryRow(`EXPLAIN (ANALYZE, WAL, FORMAT JSON)
UPDATE messaging_outbox SET status = 'PUBLISHED', published_at = now(), attempts = attempts + 1`).Scan(&plan))
	var out []struct {
		Plan struct {
			WALRecords int `json:"WAL Records"`
		} `json:"Plan"`
	}
	require.NoError(t, json.Unmarshal(plan, &out))
	require.Len(t, out, 1)
	// Per row: the new version and its entries in the primary key and the
	// published index; a few more for index page splits. Rows of 1 KB, three
	// to a page at the table's fillfactor (50), so every new version fits
	// on its row's page: one that did not would be moved to another page
	// with a lock record of its own.
	require.Positive(t, out[0].Plan.WALRecords)
	require.LessOrEqual(t, out[0].Plan.WALRecords, 3*rows+8, "WAL records of an update of %d rows", rows)
}
