package main

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

func TestCleanupDeletesInBatchesWithProgress(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	insertOldPublished(t, s, 25)
	testdb.InsertRows(t, s.DB,
		testdb.Row(envelope.Row{MessageID: "new", Destination: "orders", Payload: []byte("x"), Status: envelope.StatusPublished}),
		testdb.Row(envelope.Row{MessageID: "parked", Destination: "orders", Payload: []byte("x"), Status: envelope.StatusFailed},
			testdb.SQL("created_at", "now() - interval '100 hours'")))

	r := db(t, s, "cleanup", "--batch-size", "10", "--horizon", "72h")
	requireCode(t, r, 0)
	require.Regexp(t, `(?m)^deleted\s+25$`, r.stdout)
	require.Regexp(t, `(?m)^batches\s+3$`, r.stdout)
	require.Contains(t, r.stderr, "batch 1 on messaging_outbox: 10 rows")
	require.Contains(t, r.stderr, "batch 3 on messaging_outbox: 5 rows")
	require.Equal(t, 2, s.Count(t, ""))

	// --by-created-at removes rows of any status: refused outside CDC mode.
	r = db(t, s, "cleanup", "--by-created-at")
	requireCode(t, r, 3)
	require.Contains(t, r.stderr, "code: OUTBOXCTL_RETENTION_MODE_MISMATCH")
	require.Equal(t, 2, s.Count(t, ""))

	requireCode(t, db(t, s, "cleanup", "--batch-size", "-5"), 2)
	requireCode(t, db(t, s, "cleanup", "--horizon", "soon"), 2)

	// In CDC mode it is the retention that works.
	requireCode(t, db(t, s, "debezium", "enable", "--by", "test"), 0)
	r = db(t, s, "--json", "cleanup", "--by-created-at", "--horizon", "72h")
	requireCode(t, r, 0)
	var res map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &res))
	require.EqualValues(t, 1, res["deleted"])
	require.Equal(t, "BY_CREATED_AT", res["mode"])
	require.Equal(t, 1, s.Count(t, "message_id = 'new'"))

	// Without --by-created-at in CDC mode the run is allowed but warned about.
	r = db(t, s, "cleanup", "--horizon", "72h")
	requireCode(t, r, 0)
	require.Contains(t, r.stderr, "warning: relay mode is CDC")
	require.Equal(t, 1, s.Count(t, "message_id = 'new'"))
}

// Issue 21: `cleanup --horizon 1ns --inbox-horizon 1ns` deleted everything,
// exit 0. Below the floors it is refused (exit 2) unless
// --allow-short-horizons, which is printed; a run skipped because another
// session holds the retention lock exits 5 naming it.
func TestCleanupFloorAndVisibleSkip(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	testdb.InsertRow(t, s.DB, envelope.Row{MessageID: "recent", Destination: "orders", Payload: []byte("x"), Status: envelope.StatusPublished},
		testdb.SQL("published_at", "now() - interval '1 hour'"))
	exec1(t, s.DB, `INSERT INTO messaging_inbox (message_id, consumer, processed_at) VALUES ('m1', 'billing', now() - interval '1 hour')`)
	for _, args := range [][]string{{"--horizon", "1ns"}, {"--inbox-horizon", "1ns"}, {"--inbox-horizon", "24h"}} {
		r := db(t, s, append([]string{"cleanup"}, args...)...)
		requireCode(t, r, ExitUsage)
		require.Contains(t, r.stderr, "code: RETENTION_HORIZON_BELOW_FLOOR", "%q", args)
		require.Contains(t, r.stderr, "--allow-short-horizons")
	}
	// Zero is not a quiet way back to the default.
	for _, args := range [][]string{{"--horizon", "0"}, {"--horizon", "0s", "--allow-short-horizons"}, {"--batch-size", "0"}, {"--max-batches", "0"}, {"--statement-timeout", "0s"}} {
		r := db(t, s, append([]string{"cleanup"}, args...)...)
		requireCode(t, r, ExitUsage)
		require.Contains(t, r.stderr, "is 0; give a positive value", "%q", args)
	}
	inbox := func() int { return testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_inbox`) }
	require.Equal(t, 1, s.Count(t, ""))
	require.Equal(t, 1, inbox())
	r := db(t, s, "cleanup", "--horizon", "1m", "--inbox-horizon", "1m", "--allow-short-horizons")
	requireCode(t, r, 0)
	require.Contains(t, r.stderr, "warning: --allow-short-horizons: horizon 1m0s")
	require.Zero(t, s.Count(t, ""))
	require.Zero(t, inbox())

	// A login holding the retention lock: the run is skipped, visibly.
	holder, err := s.DB.Conn(context.Background())
	require.NoError(t, err)
	defer holder.Close()
	_, err = holder.ExecContext(context.Background(), `SET application_name = 'lock-squatter'`)
	require.NoError(t, err)
	_, err = holder.ExecContext(context.Background(),
		`SELECT pg_advisory_lock(hashtextextended('watermill-outbox/retention/' || 'messaging_outbox'::regclass::oid::text, 0))`)
	require.NoError(t, err)
	r = db(t, s, "cleanup")
	requireCode(t, r, ExitSkipped)
	require.Contains(t, r.stderr, "code: OUTBOXCTL_CLEANUP_SKIPPED")
	require.Contains(t, r.stderr, "lock-squatter")
	r = db(t, s, "--json", "cleanup")
	requireCode(t, r, ExitSkipped)
	var doc map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &doc))
	require.Equal(t, true, doc["skipped"])
	require.Contains(t, doc["held_by"], "lock-squatter")
}

// cleanup --archive reports ids already in the archive: the same message
// (a duplicate, archived) and a different one (a conflict, left in the
// outbox), and the run goes on past them.
func TestCleanupArchiveReportsDuplicatesAndConflicts(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	insertOldPublished(t, s, 5)
	exec1(t, s.DB, `INSERT INTO messaging_outbox_archive (`+envelope.SelectColumns+`)
SELECT `+envelope.SelectColumns+` FROM messaging_outbox WHERE message_id IN ('old-1', 'old-2')`)
	exec1(t, s.DB, `UPDATE messaging_outbox_archive SET payload = 'other' WHERE message_id = 'old-2'`)
	r := db(t, s, "cleanup", "--archive", "--batch-size", "2", "--horizon", "72h")
	requireCode(t, r, 0)
	require.Regexp(t, `(?m)^archived\s+4$`, r.stdout)
	require.Regexp(t, `(?m)^archive duplicates\s+1$`, r.stdout)
	require.Regexp(t, `(?m)^archive conflicts\s+1$`, r.stdout)
	require.Equal(t, 1, s.Count(t, "message_id = 'old-2' AND last_failure_code = 'RETENTION_ARCHIVE_CONFLICT'"))
	require.Equal(t, 1, s.Count(t, ""))
}
