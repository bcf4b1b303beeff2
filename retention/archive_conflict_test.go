package retention_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/lib/pq"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testdb"
	"github.com/fencedoutbox/watermill-outbox/retention"
)

// Package doc: the archive is keyed by message_id; re-archiving an id that is
// already there fails the batch, it rolls back (nothing is lost: the rows stay
// in the outbox, the archive keeps its earlier copy) and the run returns the
// error. Batches committed before it stay committed.
func TestReArchivingAnArchivedIDFailsAndRollsBackItsBatch(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	// published_at = at - g s: the batches (oldest first, 4 rows each) are
	// old-10..old-7, then old-6..old-3, then old-2, old-1.
	insertPublished(t, s.DB, "old-", 10, now.Add(-100*time.Hour))
	earlier := now.Add(-200 * time.Hour)
	_, err := s.DB.Exec(`INSERT INTO messaging_outbox_archive (`+envelope.SelectColumns+`, archived_at)
SELECT `+envelope.SelectColumns+`, $1 FROM messaging_outbox WHERE message_id = 'old-5'`, earlier)
	require.NoError(t, err)

	var batches []retention.Batch
	c, err := retention.New(s.DB, nil, retention.Config{
		Archive: true, BatchSize: 4, Now: clock,
		OnBatch: func(b retention.Batch) { batches = append(batches, b) },
	})
	require.NoError(t, err)
	res, err := c.Run(context.Background())
	require.Error(t, err, "the run returns the batch's error")
	var pqErr *pq.Error
	require.True(t, errors.As(err, &pqErr), "the database's refusal is kept in the chain: %v", err)
	require.Equal(t, pq.ErrorCode("23505"), pqErr.Code, "unique violation on the archive's key")
	require.Contains(t, err.Error(), "batch 2")

	require.Equal(t, []retention.Batch{{Table: "messaging_outbox", Number: 1, Removed: 4}}, batches, "only the first batch committed")
	require.Equal(t, 1, res.Batches)
	require.Equal(t, 4, res.Archived)
	require.Zero(t, res.Deleted)

	// The failed batch changed neither table.
	require.Equal(t, 6, s.Count(t, ""))
	require.Equal(t, 4, s.Count(t, "message_id IN ('old-6', 'old-5', 'old-4', 'old-3')"), "the failed batch's rows are still in the outbox")
	require.Equal(t, 5, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_outbox_archive`))
	require.Equal(t, 4, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_outbox_archive
		WHERE message_id IN ('old-10', 'old-9', 'old-8', 'old-7')`))
	var archivedAt time.Time
	require.NoError(t, s.DB.QueryRow(`SELECT archived_at FROM messaging_outbox_archive WHERE message_id = 'old-5'`).Scan(&archivedAt))
	require.True(t, archivedAt.Equal(earlier), "the archive keeps its earlier copy")

	// The run lock was released despite the error: the next run is not
	// skipped, and fails the same way (the conflict has not gone away).
	res, err = c.Run(context.Background())
	require.Error(t, err)
	require.False(t, res.Skipped)
	require.Zero(t, res.Archived)
	require.Equal(t, 6, s.Count(t, ""))
}
