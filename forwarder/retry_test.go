package forwarder_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// The database clock runs an hour ahead of this host's (simulated: a
// schema-local now() shadows pg_catalog's for connections whose search_path
// puts the schema first). The retry delay must still count from the clock
// the claim compares with, not from the host's.
func TestRetryBackoffIgnoresHostClockSkew(t *testing.T) {
	s := newDB(t)
	_, err := s.DB.Exec(`CREATE FUNCTION ` + s.Name + `.now() RETURNS timestamptz LANGUAGE sql STABLE
		AS $$ SELECT pg_catalog.now() + interval '1 hour' $$`)
	require.NoError(t, err)
	skewed, err := sql.Open("postgres", testdb.WithSearchPath(testdb.URL(), s.Name+",pg_catalog"))
	require.NoError(t, err)
	skewed.SetMaxOpenConns(4)
	t.Cleanup(func() { _ = skewed.Close() })
	var ahead bool
	require.NoError(t, skewed.QueryRow(`SELECT now() > pg_catalog.now() + interval '59 minutes'`).Scan(&ahead))
	require.True(t, ahead, "the skewed connection sees the shifted clock")

	insertN(t, s.DB, "orders", "m1")
	failing := &recorder{behave: func(string, *message.Message) (bool, error) { return false, errBroker }}
	f := newForwarder(t, skewed, failing, forwarder.Config{BackoffBase: time.Minute, BackoffMax: time.Hour})
	rep, err := f.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, 1, rep.Ambiguous)
	delay := f.RetryDelay("m1", 1)

	// last_attempt_at was written by the claim on the database clock; the
	// retry is due the delay after it (plus the pass's own duration).
	var us int64
	require.NoError(t, s.DB.QueryRow(`SELECT (extract(epoch FROM next_attempt_at - last_attempt_at) * 1000000)::int8
		FROM messaging_outbox WHERE message_id = 'm1'`).Scan(&us))
	gap := time.Duration(us) * time.Microsecond
	require.GreaterOrEqual(t, gap, delay)
	require.Less(t, gap, delay+10*time.Second)

	// And the backoff holds: the next pass does not take the row again.
	rep, err = f.RunOnce(context.Background())
	require.NoError(t, err)
	require.Zero(t, rep.Claimed)
}
