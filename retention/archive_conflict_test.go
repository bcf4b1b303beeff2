package retention_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/retention"
)

// Package doc: an id already in the archive is settled per row and the
// batch goes on. The same message there (an earlier copy of this row) →
// the outbox row is deleted as archived and the archive keeps its copy; a
// different message under the id → the outbox row stays (status unchanged),
// marked RETENTION_ARCHIVE_CONFLICT with a detail naming the id, and later
// runs pass over it. Before, one such id failed the batch it was in, and
// since rows go oldest first, every run stopped there.
func TestArchivedIDsAreSettledPerRowAndTheRunGoesOn(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	// Oldest first in batches of 4: old-10..old-7, old-6..old-3, old-2, old-1.
	insertPublished(t, s.DB, "old-", 10, now.Add(-100*time.Hour))
	earlier := now.Add(-200 * time.Hour)
	archiveCopy := func(id string) {
		t.Helper()
		_, err := s.DB.Exec(`INSERT INTO messaging_outbox_archive (`+envelope.SelectColumns+`, archived_at)
SELECT `+envelope.SelectColumns+`, $1 FROM messaging_outbox WHERE message_id = $2`, earlier, id)
		require.NoError(t, err)
	}
	archiveCopy("old-9") // the same message: a duplicate
	archiveCopy("old-5") // then made different: a conflict
	_, err := s.DB.Exec(`UPDATE messaging_outbox_archive SET payload = 'other' WHERE message_id = 'old-5'`)
	require.NoError(t, err)
	archiveCopy("old-1") // a conflict in the last batch too
	_, err = s.DB.Exec(`UPDATE messaging_outbox_archive SET destination = 'elsewhere' WHERE message_id = 'old-1'`)
	require.NoError(t, err)
	// Bookkeeping differs from the archived duplicate: still the same message.
	_, err = s.DB.Exec(`UPDATE messaging_outbox SET attempts = 3, lease_token = 7 WHERE message_id = 'old-9'`)
	require.NoError(t, err)

	c, err := retention.New(s.DB, nil, retention.Config{Archive: true, BatchSize: 4, Now: clock})
	require.NoError(t, err)
	res, err := c.Run(context.Background())
	require.NoError(t, err)
	require.Equal(t, 8, res.Archived, "every row but the two conflicts left the outbox")
	require.Equal(t, 1, res.ArchiveDuplicates)
	require.Equal(t, 2, res.ArchiveConflicts)
	require.Equal(t, 3, res.Batches)

	require.Equal(t, 2, s.Count(t, ""))
	for _, id := range []string{"old-5", "old-1"} {
		var status, code, detail string
		require.NoError(t, s.DB.QueryRow(`SELECT status, last_failure_code, last_failure_detail FROM messaging_outbox WHERE message_id = $1`, id).Scan(&status, &code, &detail))
		require.Equal(t, "PUBLISHED", status, "a delivered row stays delivered: parked it would block its key")
		require.Equal(t, retention.CodeArchiveConflict, code)
		require.Contains(t, detail, "message "+id+" is already in messaging_outbox_archive")
	}
	require.Equal(t, 10, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_outbox_archive`), "7 inserted (old-9 was there) + the 3 earlier copies")
	var archivedAt time.Time
	var attempts int
	require.NoError(t, s.DB.QueryRow(`SELECT archived_at, attempts FROM messaging_outbox_archive WHERE message_id = 'old-9'`).Scan(&archivedAt, &attempts))
	require.True(t, archivedAt.Equal(earlier), "the archive keeps its earlier copy of a duplicate")
	require.Zero(t, attempts)
	var payload []byte
	require.NoError(t, s.DB.QueryRow(`SELECT payload FROM messaging_outbox_archive WHERE message_id = 'old-5'`).Scan(&payload))
	require.Equal(t, "other", string(payload), "a conflict changes neither copy")

	// New rows past the horizon are archived by the next run; the conflicts
	// do not stop it and are not counted again.
	insertPublished(t, s.DB, "new-", 3, now.Add(-90*time.Hour))
	res, err = c.Run(context.Background())
	require.NoError(t, err)
	require.Equal(t, 3, res.Archived)
	require.Zero(t, res.ArchiveConflicts)
	require.Equal(t, 2, s.Count(t, ""))

	// Resolved by an operator (here: the archive's copy removed), the row is
	// archived by the next run.
	_, err = s.DB.Exec(`DELETE FROM messaging_outbox_archive WHERE message_id IN ('old-5', 'old-1')`)
	require.NoError(t, err)
	_, err = s.DB.Exec(`UPDATE messaging_outbox SET last_failure_code = NULL, last_failure_detail = NULL WHERE last_failure_code = $1`, retention.CodeArchiveConflict)
	require.NoError(t, err)
	res, err = c.Run(context.Background())
	require.NoError(t, err)
	require.Equal(t, 2, res.Archived)
	require.Zero(t, s.Count(t, ""))
	var n sql.NullInt64
	require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM messaging_outbox_archive WHERE message_id IN ('old-5', 'old-1')`).Scan(&n))
	require.Equal(t, int64(2), n.Int64)
}
