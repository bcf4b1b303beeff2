package journal_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/journal"
)

// Config.Owner and Options.Progress promise that a Journal with the same Owner
// is the same replica: a process restarted under its owner name resumes its
// own interrupted operation at once (another owner waits out the lease the
// dead process left live), from the last committed checkpoint, under a new
// lease token that fences the interrupted process's run out. The restarted
// call's planned total is on the scale of its items: what was done before
// plus what is ahead of the checkpoint.
func TestSameOwnerResumesItsInterruptedOperation(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	logRedrives(t, s.DB)
	parked(t, s.DB, "x", 45, "EXHAUSTED", "orders", "", "TIMEOUT", t0.Add(-time.Hour))
	clk := newClock(t0)
	ctx := context.Background()

	// The first process stops after two batches (as a crash would), leaving
	// the operation STARTED with its lease live until t0+30s.
	first := newJournal(t, s.DB, "ops-1", clk, 10)
	out1, err := first.Redrive(ctx, "T-SAME", journal.Filter{}, journal.Options{Progress: func(p journal.Progress) error {
		if p.Batch == 2 {
			return errCrash
		}
		return nil
	}})
	require.ErrorIs(t, err, errCrash)
	require.EqualValues(t, 20, out1.Items)
	require.EqualValues(t, 45, out1.Plan.Matching)
	interrupted := out1.Run
	rec, err := first.Find(ctx, "T-SAME")
	require.NoError(t, err)
	require.Equal(t, journal.StateStarted, rec.State)
	require.Equal(t, "ops-1", rec.Owner)
	require.EqualValues(t, 1, rec.LeaseToken)
	require.EqualValues(t, 20, rec.ItemsCompleted)
	require.True(t, rec.LeaseExpiresAt.After(t0.Add(5*time.Second)))

	// A row the first process redrove is parked again before the restart:
	// it is behind the checkpoint, so the resume neither redoes nor counts it.
	_, err = s.DB.Exec(`UPDATE messaging_outbox SET status = 'EXHAUSTED', attempts = 10, parked_at = $1 WHERE message_id = 'x-3'`, t0)
	require.NoError(t, err)

	clk.set(t0.Add(5 * time.Second)) // the lease is still live
	_, err = newJournal(t, s.Open(t), "ops-2", clk, 10).Redrive(ctx, "T-SAME", journal.Filter{}, journal.Options{})
	require.ErrorIs(t, err, journal.ErrInFlight, "another owner waits for the lease")

	// The restarted process: same owner name, its own connections.
	restarted := newJournal(t, s.Open(t), "ops-1", clk, 10)
	var seen []journal.Progress
	out2, err := restarted.Redrive(ctx, "T-SAME", journal.Filter{}, journal.Options{Progress: func(p journal.Progress) error {
		seen = append(seen, p)
		if p.Batch == 1 {
			// The interrupted process's run (token 1) no longer holds the
			// operation, although the owner name is the same.
			require.ErrorIs(t, first.Checkpoint(ctx, interrupted, 99, "1"), journal.ErrLeaseLost)
			require.ErrorIs(t, first.Fail(ctx, interrupted, "X", "y"), journal.ErrLeaseLost)
			require.ErrorIs(t, first.Complete(ctx, interrupted), journal.ErrLeaseLost)
		}
		return nil
	}})
	require.NoError(t, err)
	require.True(t, out2.Run.TookOver)
	require.Equal(t, "ops-1", out2.Run.Owner)
	require.EqualValues(t, 2, out2.Run.LeaseToken)
	require.Equal(t, 3, out2.Batches, "10 + 10 + 5 rows after the checkpoint")
	require.EqualValues(t, 45, out2.Items)
	require.EqualValues(t, 45, out2.Plan.Matching, "20 done before the restart + 25 ahead of the checkpoint (not x-3)")
	require.Len(t, seen, 3)
	for i, items := range []int64{30, 40, 45} {
		require.EqualValues(t, items, seen[i].Items)
		require.EqualValues(t, 45, seen[i].Planned, "batch %d", i+1)
	}

	require.Equal(t, 45, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM redrive_log`))
	require.Equal(t, 45, testdb.QueryInt(t, s.DB, `SELECT count(DISTINCT message_id) FROM redrive_log`), "no row redriven twice")
	require.Equal(t, 44, s.Count(t, "status = 'PENDING' AND attempts = 0"))
	require.Equal(t, 1, s.Count(t, "message_id = 'x-3' AND status = 'EXHAUSTED' AND attempts = 10"))

	rec, err = restarted.Find(ctx, "T-SAME")
	require.NoError(t, err)
	require.Equal(t, journal.StateCompleted, rec.State)
	require.Equal(t, "ops-1", rec.Owner)
	require.EqualValues(t, 2, rec.LeaseToken)
	require.EqualValues(t, 45, rec.ItemsCompleted)

	// Resuming is not re-running: once completed, not even its owner runs it again.
	_, err = restarted.Redrive(ctx, "T-SAME", journal.Filter{}, journal.Options{})
	require.ErrorIs(t, err, journal.ErrAlreadyExecuted)
}
