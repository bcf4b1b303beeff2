package journal_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/journal"
)

// Package doc: an owner whose lease was taken over gets JOURNAL_LEASE_LOST
// and its batch rolls back. Replica A stalls after its first batch (in its
// Progress callback) past its lease; replica B takes the operation over; A's
// next batch is refused and changes nothing, B resumes after A's checkpoint,
// and no row is redriven twice or skipped.
func TestOwnerWhoseLeaseWasTakenOverGetsLeaseLost(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	logRedrives(t, s.DB)
	parked(t, s.DB, "x", 45, "EXHAUSTED", "orders", "", "TIMEOUT", t0.Add(-time.Hour))
	clkA, clkB := newClock(t0), newClock(t0)
	a := newJournal(t, s.DB, "a", clkA, 10)
	b := newJournal(t, s.Open(t), "b", clkB, 10)
	ctx := context.Background()

	var runB *journal.Run
	var batchesSeenByA int
	outA, err := a.Redrive(ctx, "T-LOST", journal.Filter{}, journal.Options{Progress: func(p journal.Progress) error {
		batchesSeenByA++
		if p.Batch != 1 {
			return nil
		}
		require.Equal(t, 10, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM redrive_log`))
		// A stalls past its lease (checkpointed at t0, 30s); B takes over.
		clkA.set(t0.Add(31 * time.Second))
		clkB.set(t0.Add(31 * time.Second))
		var err error
		runB, err = b.Begin(ctx, "T-LOST", journal.OpRedrive, journal.Filter{}.Normalize())
		require.NoError(t, err)
		require.True(t, runB.TookOver)
		require.EqualValues(t, 2, runB.LeaseToken)
		require.EqualValues(t, 10, runB.ItemsCompleted, "B starts from A's committed checkpoint")
		return nil
	}})
	require.ErrorIs(t, err, journal.ErrLeaseLost)
	require.Equal(t, journal.CodeLeaseLost, outbox.CodeOf(err))
	require.Equal(t, 1, batchesSeenByA, "A's second batch did not commit")
	require.Equal(t, 1, outA.Batches)
	require.EqualValues(t, 10, outA.Items)

	// A's refused batch changed nothing, and A did not mark B's operation
	// FAILED on its way out.
	require.Equal(t, 10, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM redrive_log`))
	require.Equal(t, 35, s.Count(t, "status = 'EXHAUSTED'"))
	rec, err := b.Find(ctx, "T-LOST")
	require.NoError(t, err)
	require.Equal(t, journal.StateStarted, rec.State)
	require.Equal(t, "b", rec.Owner)
	require.EqualValues(t, 2, rec.LeaseToken)
	require.EqualValues(t, 10, rec.ItemsCompleted)

	// B runs it to the end from A's checkpoint.
	outB, err := b.Redrive(ctx, "T-LOST", journal.Filter{}, journal.Options{})
	require.NoError(t, err)
	require.EqualValues(t, 45, outB.Items)
	require.Equal(t, 4, outB.Batches, "10 + 10 + 10 + 5 remaining rows")
	require.Equal(t, 45, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM redrive_log`))
	require.Equal(t, 45, testdb.QueryInt(t, s.DB, `SELECT count(DISTINCT message_id) FROM redrive_log`), "no row redriven twice")
	require.Equal(t, 45, s.Count(t, "status = 'PENDING' AND attempts = 0"))
	rec, err = b.Find(ctx, "T-LOST")
	require.NoError(t, err)
	require.Equal(t, journal.StateCompleted, rec.State)
}
