package retention_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/retention"
)

// A backlog of 5,000 old PUBLISHED rows goes in batches of exactly the
// configured size, counted by the database after each committed batch, and
// no other status is touched.
func TestRunDeletesPublishedInBatches(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	const backlog, batch = 5000, 1000
	insertPublished(t, s.DB, "old-", backlog, now.Add(-73*time.Hour))
	insertPublished(t, s.DB, "new-", 50, now.Add(-time.Hour))
	insertOtherStatuses(t, s.DB, now.Add(-1000*time.Hour))

	var remaining, removed []int
	cfg := retention.Config{
		BatchSize: batch,
		Now:       clock,
		OnBatch: func(b retention.Batch) {
			removed = append(removed, b.Removed)
			remaining = append(remaining, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_outbox WHERE message_id LIKE 'old-%'`))
		},
	}
	var delBefore int
	require.NoError(t, s.DB.QueryRow(`SELECT n_tup_del FROM pg_stat_user_tables WHERE schemaname = $1 AND relname = 'messaging_outbox'`, s.Name).Scan(&delBefore))

	c, err := retention.New(s.DB, nil, cfg)
	require.NoError(t, err)
	res, err := c.Run(context.Background())
	require.NoError(t, err)

	require.False(t, res.Skipped)
	require.Equal(t, 6, res.Batches, "five full batches and the short one that ends the run")
	require.Equal(t, backlog, res.Deleted)
	require.Zero(t, res.Archived)
	require.False(t, res.More)
	require.Equal(t, []int{1000, 1000, 1000, 1000, 1000, 0}, removed)
	require.Equal(t, []int{4000, 3000, 2000, 1000, 0, 0}, remaining)

	require.Equal(t, 50, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_outbox WHERE message_id LIKE 'new-%'`))
	require.Equal(t, 5, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_outbox WHERE status <> 'PUBLISHED'`))

	// The statistics collector agrees (it flushes asynchronously: force it
	// from PostgreSQL 15 on; 14's collector has no such function and sends
	// its counts within half a second on its own).
	if testdb.QueryInt(t, s.DB, `SELECT current_setting('server_version_num')::int`) >= 150000 {
		_, err = s.DB.Exec(`SELECT pg_stat_force_next_flush()`)
		require.NoError(t, err)
	}
	await.Until(t, func() bool {
		var del int
		_ = s.DB.QueryRow(`SELECT n_tup_del FROM pg_stat_user_tables WHERE schemaname = $1 AND relname = 'messaging_outbox'`, s.Name).Scan(&del)
		return del-delBefore == backlog
	}, "every row of the backlog deleted")
}

func TestRunStopsAtMaxBatches(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	insertPublished(t, s.DB, "old-", 1000, now.Add(-100*time.Hour))
	c, err := retention.New(s.DB, nil, retention.Config{BatchSize: 100, MaxBatches: 3, Now: clock})
	require.NoError(t, err)
	res, err := c.Run(context.Background())
	require.NoError(t, err)
	require.Equal(t, 3, res.Batches)
	require.Equal(t, 300, res.Deleted)
	require.True(t, res.More)
	require.Equal(t, 700, s.Count(t, ""))
}

func TestBatchRunsUnderItsStatementTimeout(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	insertPublished(t, s.DB, "old-", 3, now.Add(-100*time.Hour))
	cfg := retention.Config{StatementTimeout: 1234 * time.Millisecond, Now: clock}
	var inside []string
	retention.SetBeforeCommit(&cfg, func(ctx context.Context, tx *sql.Tx, b retention.Batch) error {
		var v string
		if err := tx.QueryRowContext(ctx, `SHOW statement_timeout`).Scan(&v); err != nil {
			return err
		}
		inside = append(inside, v)
		return nil
	})
	c, err := retention.New(s.DB, nil, cfg)
	require.NoError(t, err)
	_, err = c.Run(context.Background())
	require.NoError(t, err)
	require.Equal(t, []string{"1234ms"}, inside)

	// SET LOCAL: the pool's sessions keep their own setting afterwards.
	var v string
	require.NoError(t, s.DB.QueryRow(`SHOW statement_timeout`).Scan(&v))
	require.Equal(t, "0", v)
}

func TestBatchErrorIsReturnedAndRolledBack(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	insertPublished(t, s.DB, "old-", 10, now.Add(-100*time.Hour))
	cfg := retention.Config{BatchSize: 4, Now: clock}
	boom := errors.New("boom")
	retention.SetBeforeCommit(&cfg, func(_ context.Context, _ *sql.Tx, b retention.Batch) error {
		if b.Number == 2 {
			return boom
		}
		return nil
	})
	c, err := retention.New(s.DB, nil, cfg)
	require.NoError(t, err)
	res, err := c.Run(context.Background())
	require.ErrorIs(t, err, boom)
	require.Equal(t, 1, res.Batches)
	require.Equal(t, 4, res.Deleted)
	require.Equal(t, 6, s.Count(t, ""), "the failed batch rolled back; the first stays committed")
}

// An empty source spends none of MaxBatches: with only old parked rows
// (the never-published stream, walked first, is empty), a run limited to one
// batch removes them, and one limited to two says nothing is left.
func TestAnEmptySourceSpendsNoneOfMaxBatches(t *testing.T) {
	t.Parallel()
	for _, max := range []int{1, 2} {
		s := newSchema(t)
		old := now.Add(-200 * time.Hour)
		for _, id := range []string{"p1", "p2", "p3"} {
			testdb.InsertRows(t, s.DB, testdb.Row(envelope.Row{MessageID: id, Destination: "orders", Payload: []byte{1},
				Status: envelope.StatusFailed, CreatedAt: old, ParkedAt: old}))
		}
		enableCDC(t, s.DB)
		c, err := retention.New(s.DB, nil, retention.Config{Mode: retention.ByCreatedAt, MaxBatches: max, Now: clock})
		require.NoError(t, err)
		res, err := c.Run(context.Background())
		require.NoError(t, err)
		require.Equal(t, 3, res.Deleted, "MaxBatches %d", max)
		require.Zero(t, s.Count(t, ""))
		require.Equal(t, max == 1, res.More, "MaxBatches %d: more only when the budget ran out before the last source", max)
	}
}

// Each batch statement finds its rows through an index, so a batch's cost is
// bounded by its size and not by the table's.
func TestBatchStatementsUseIndexes(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	insertPublished(t, s.DB, "old-", 20000, now.Add(-100*time.Hour))
	_, err := s.DB.Exec(`
INSERT INTO messaging_inbox (consumer, message_id, processed_at)
SELECT 'c', 'm-' || g, $1::timestamptz - make_interval(secs => g) FROM generate_series(1, 20000) g`, now)
	require.NoError(t, err)
	// An archive of some size, so its lookups (archive conflicts) are
	// planned as they are in production, not as on an empty table.
	_, err = s.DB.Exec(`INSERT INTO messaging_outbox_archive (` + envelope.SelectColumns + `, archived_at)
SELECT 'a-' || message_id, destination, payload, headers, status, seq, created_at, occurred_at, published_at, attempts,
       next_attempt_at, lease_owner, lease_token, lease_expires_at, last_failure_code, last_failure_detail,
       last_attempt_at, producer, correlation_id, causation_id, tenant, partition_key, ordering_key, traceparent,
       tracestate, baggage, schema_subject, schema_version, content_type, message_type, aggregate_type,
       aggregate_id, aggregate_version, parked_at, routing_key, now()
  FROM messaging_outbox`)
	require.NoError(t, err)
	_, err = s.DB.Exec(`ANALYZE messaging_outbox; ANALYZE messaging_inbox; ANALYZE messaging_outbox_archive`)
	require.NoError(t, err)
	want := map[string]string{
		"published":         "messaging_outbox_published_idx",
		"archive-published": "messaging_outbox_published_idx",
		"stream":            "messaging_outbox_claimable_idx",
		"archive-stream":    "messaging_outbox_claimable_idx",
		"parked":            "messaging_outbox_parked_idx",
		"archive-parked":    "messaging_outbox_parked_idx",
		"inbox":             "messaging_inbox_processed_idx",
	}
	require.Len(t, retention.Statements, len(want))
	horizon := (72 * time.Hour).Seconds()
	for name, q := range retention.Statements {
		args := []any{now, 100, horizon}
		if strings.HasSuffix(name, "stream") {
			args = append(args, int64(15000))
		}
		plan := testdb.Explain(t, s.DB, q, args...)
		require.Contains(t, plan, want[name], "%s plan:\n%s", name, plan)
		require.NotContains(t, plan, "Seq Scan", "%s plan:\n%s", name, plan)
	}
	plan := testdb.Explain(t, s.DB, retention.FirstYoungSeq, now, horizon, 100000)
	require.Contains(t, plan, "messaging_outbox_claimable_idx", plan)
	require.NotContains(t, plan, "Seq Scan", plan)
}
