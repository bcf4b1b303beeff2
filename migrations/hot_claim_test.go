package migrations_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"

	"github.com/lib/pq"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/migrations"
)

// The claimable, parked, ordering-head and published indexes select rows by
// published_at and parked_at instead of status (migration 00030), so those
// two columns must agree with status on every row: the table refuses a row on
// which they do not, whichever way it is written.
func TestStatusTimestampsMustAgreeWithStatus(t *testing.T) {
	t.Parallel()
	_, dsn := freshSchema(t)
	db := open(t, dsn)
	_, err := migrations.Up(context.Background(), db)
	require.NoError(t, err)

	refused := []struct{ name, insert string }{
		{"PUBLISHED without published_at", `INSERT INTO messaging_outbox (message_id, destination, payload, status) VALUES ('x', 'd', '', 'PUBLISHED')`},
		{"PENDING with published_at", `INSERT INTO messaging_outbox (message_id, destination, payload, published_at) VALUES ('x', 'd', '', now())`},
		{"FAILED without parked_at", `INSERT INTO messaging_outbox (message_id, destination, payload, status) VALUES ('x', 'd', '', 'FAILED')`},
		{"EXHAUSTED without parked_at", `INSERT INTO messaging_outbox (message_id, destination, payload, status) VALUES ('x', 'd', '', 'EXHAUSTED')`},
		{"AMBIGUOUS with parked_at", `INSERT INTO messaging_outbox (message_id, destination, payload, status, parked_at) VALUES ('x', 'd', '', 'AMBIGUOUS', now())`},
		{"PUBLISHED and parked", `INSERT INTO messaging_outbox (message_id, destination, payload, status, published_at, parked_at) VALUES ('x', 'd', '', 'PUBLISHED', now(), now())`},
	}
	for _, c := range refused {
		_, err := db.Exec(c.insert)
		var pqErr *pq.Error
		require.True(t, errors.As(err, &pqErr), "%s: want a check violation, got %v", c.name, err)
		require.Equal(t, pq.ErrorCode("23514"), pqErr.Code, c.name)
	}
	require.Zero(t, count(t, db, `SELECT count(*) FROM messaging_outbox`), "nothing refused was written")

	// An UPDATE that would break the rule is refused the same way.
	_, err = db.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload) VALUES ('ok', 'd', '')`)
	require.NoError(t, err)
	_, err = db.Exec(`UPDATE messaging_outbox SET status = 'PUBLISHED' WHERE message_id = 'ok'`)
	var pqErr *pq.Error
	require.True(t, errors.As(err, &pqErr), "got %v", err)
	require.Equal(t, pq.ErrorCode("23514"), pqErr.Code)
	require.Equal(t, 1, count(t, db, `SELECT count(*) FROM messaging_outbox WHERE status = 'PENDING' AND published_at IS NULL`))
}

// A database migrated by an earlier version may hold rows that break the new
// rule (hand-edited ones: every writer of this module already kept it).
// Migration 00030 repairs them before it adds the constraints, so the upgrade
// does not fail and no such row drops out of the claimable index unseen.
func TestUpgradeRepairsRowsBeforeAddingTheRule(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, dsn := freshSchema(t)
	db := open(t, dsn)
	p := gooseProvider(t, db)
	_, err := p.UpTo(ctx, 20)
	require.NoError(t, err)
	_, err = db.Exec(`
INSERT INTO messaging_outbox (message_id, destination, payload, status, published_at, parked_at, created_at) VALUES
  ('pub-no-ts',     'd', '', 'PUBLISHED', NULL,  NULL,  '2030-01-01T00:00:00Z'),
  ('pending-ts',    'd', '', 'PENDING',   now(), NULL,  now()),
  ('failed-no-ts',  'd', '', 'FAILED',    NULL,  NULL,  '2030-01-02T00:00:00Z'),
  ('redriven-ts',   'd', '', 'PENDING',   NULL,  now(), now()),
  ('consistent',    'd', '', 'EXHAUSTED', NULL,  now(), now())`)
	require.NoError(t, err)

	res, err := migrations.Up(ctx, db)
	require.NoError(t, err)
	require.Contains(t, res.Applied, int64(30))

	type row struct {
		id, status        string
		published, parked bool
	}
	rows, err := db.Query(`SELECT message_id, status, published_at IS NOT NULL, parked_at IS NOT NULL FROM messaging_outbox ORDER BY message_id`)
	require.NoError(t, err)
	var got []row
	for rows.Next() {
		var r row
		require.NoError(t, rows.Scan(&r.id, &r.status, &r.published, &r.parked))
		got = append(got, r)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []row{
		{"consistent", "EXHAUSTED", false, true},
		{"failed-no-ts", "FAILED", false, true},
		{"pending-ts", "PENDING", false, false},
		{"pub-no-ts", "PUBLISHED", true, false},
		{"redriven-ts", "PENDING", false, false},
	}, got, "statuses unchanged, timestamps made to agree with them")
	// The two PENDING rows are claimable again: they are in the claimable index's set.
	require.Equal(t, 2, count(t, db, `SELECT count(*) FROM messaging_outbox WHERE published_at IS NULL AND parked_at IS NULL`))

	// Down restores the previous indexes and drops the rules; Up again
	// reapplies them over the same rows.
	_, err = p.DownTo(ctx, 20)
	require.NoError(t, err)
	require.Equal(t, 1, count(t, db, `SELECT count(*) FROM pg_indexes WHERE indexname = 'messaging_outbox_backlog_idx' AND schemaname = current_schema()`))
	require.Equal(t, 1, count(t, db, `SELECT count(*) FROM pg_indexes WHERE indexname = 'messaging_outbox_created_at_idx' AND schemaname = current_schema()`))
	require.Zero(t, count(t, db, `SELECT count(*) FROM pg_constraint WHERE conname = 'messaging_outbox_published_at_check' AND connamespace = current_schema()::regnamespace`))
	res, err = migrations.Up(ctx, db)
	require.NoError(t, err)
	require.GreaterOrEqual(t, len(res.Applied), 2)
	require.Equal(t, []int64{30, 31}, res.Applied[:2], "later migrations follow")
	require.Zero(t, count(t, db, `SELECT count(*) FROM pg_indexes WHERE indexname IN ('messaging_outbox_backlog_idx', 'messaging_outbox_created_at_idx') AND schemaname = current_schema()`))
}

func count(t *testing.T, db interface {
	QueryRow(string, ...any) *sql.Row
}, q string) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(q).Scan(&n))
	return n
}
