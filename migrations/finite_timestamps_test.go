package migrations_test

import (
	"context"
	"testing"

	"github.com/lib/pq"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/migrations"
)

// Migration 00043: timestamps the relay reads or reports must be finite.
// SQL writing 'infinity' is refused (23514) instead of producing a row the
// relay can only park.
func TestInfiniteTimestampsAreRefused(t *testing.T) {
	s := testdb.New(t)
	for _, col := range []string{"created_at", "occurred_at", "published_at", "parked_at"} {
		for _, v := range []string{"infinity", "-infinity"} {
			_, err := s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, `+col+`) VALUES ($1, 'd', 'x', $2::timestamptz)`, col+v, v)
			var pqErr *pq.Error
			require.ErrorAs(t, err, &pqErr, "%s = %s", col, v)
			require.Equal(t, "23514", string(pqErr.Code))
			require.Equal(t, "messaging_outbox_finite_timestamps_check", pqErr.Constraint)
		}
	}
	_, err := s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, occurred_at) VALUES ('ok', 'd', 'x', '2026-01-02T03:04:05.123456Z')`)
	require.NoError(t, err)
	var validated bool
	require.NoError(t, s.DB.QueryRow(`SELECT convalidated FROM pg_constraint WHERE conname = 'messaging_outbox_finite_timestamps_check' AND conrelid = 'messaging_outbox'::regclass`).Scan(&validated))
	require.True(t, validated, "on a table without bad rows the migration validates the constraint")
}

// A table that already holds an infinite timestamp still migrates: the row
// is kept as it is (the relay parks it per row), the constraint refuses new
// ones at once and stays NOT VALID until an operator fixes the row and
// validates it.
func TestFiniteTimestampsMigrateOverExistingInfinity(t *testing.T) {
	ctx := context.Background()
	s := testdb.New(t)
	p := gooseProvider(t, s.DB)
	_, err := p.DownTo(ctx, 42)
	require.NoError(t, err)
	_, err = s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, occurred_at) VALUES ('bad', 'd', 'x', 'infinity')`)
	require.NoError(t, err)
	_, err = migrations.Up(ctx, s.DB)
	require.NoError(t, err)
	require.Equal(t, 1, s.Count(t, `message_id = 'bad' AND occurred_at = 'infinity'`))
	var validated bool
	require.NoError(t, s.DB.QueryRow(`SELECT convalidated FROM pg_constraint WHERE conname = 'messaging_outbox_finite_timestamps_check' AND conrelid = 'messaging_outbox'::regclass`).Scan(&validated))
	require.False(t, validated)
	_, err = s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, created_at) VALUES ('bad2', 'd', 'x', '-infinity')`)
	var pqErr *pq.Error
	require.ErrorAs(t, err, &pqErr)
	require.Equal(t, "23514", string(pqErr.Code))
	// The operator's repair, as docs/BAD_INPUT.md gives it.
	_, err = s.DB.Exec(`UPDATE messaging_outbox SET occurred_at = NULL WHERE NOT isfinite(occurred_at)`)
	require.NoError(t, err)
	_, err = s.DB.Exec(`ALTER TABLE messaging_outbox VALIDATE CONSTRAINT messaging_outbox_finite_timestamps_check`)
	require.NoError(t, err)
}
