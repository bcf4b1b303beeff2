package journal_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/journal"
)

func TestStaleOwnerCheckpointRefusedAndItemsOnlyGrow(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	clk := newClock(t0)
	a := newJournal(t, s.DB, "a", clk, 10)
	b := newJournal(t, s.DB, "b", clk, 10)
	ctx := context.Background()

	runA, err := a.Begin(ctx, "T-1", "custom", map[string]int{"n": 1})
	require.NoError(t, err)
	require.NoError(t, a.Checkpoint(ctx, runA, 50, "c50"))
	require.NoError(t, a.Checkpoint(ctx, runA, 10, "c10"))
	rec, err := a.Find(ctx, "T-1")
	require.NoError(t, err)
	require.EqualValues(t, 50, rec.ItemsCompleted, "items_completed never goes backwards")
	require.Equal(t, "c10", rec.Checkpoint)
	require.True(t, rec.LeaseExpiresAt.Equal(t0.Add(30*time.Second)))

	// The checkpoint extended the lease: at t0+40s it has not expired...
	clk.set(t0.Add(20 * time.Second))
	require.NoError(t, a.Checkpoint(ctx, runA, 60, "c60"))
	clk.set(t0.Add(40 * time.Second))
	_, err = b.Begin(ctx, "T-1", "custom", map[string]int{"n": 1})
	require.ErrorIs(t, err, journal.ErrInFlight)

	// ...at t0+51s it has, and b takes over; a is fenced out.
	clk.set(t0.Add(51 * time.Second))
	runB, err := b.Begin(ctx, "T-1", "custom", map[string]int{"n": 1})
	require.NoError(t, err)
	require.True(t, runB.TookOver)
	require.EqualValues(t, 60, runB.ItemsCompleted)
	require.Equal(t, "c60", runB.Checkpoint)
	err = a.Checkpoint(ctx, runA, 70, "c70")
	require.ErrorIs(t, err, journal.ErrLeaseLost)
	require.Equal(t, journal.CodeLeaseLost, outbox.CodeOf(err))
	require.NoError(t, b.Checkpoint(ctx, runB, 70, "c70"))
	require.NoError(t, b.Complete(ctx, runB))
	require.ErrorIs(t, b.Checkpoint(ctx, runB, 80, "c80"), journal.ErrLeaseLost, "a completed operation takes no more checkpoints")
}

// A checkpoint that is not a seq cursor (written by another tool through
// Checkpoint) cannot be resumed from; Redrive says so and marks the
// operation FAILED with the reason, instead of leaving it STARTED until its
// lease runs out with nothing in the journal to explain why.
func TestUnreadableCheckpointFailsTheOperation(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	parked(t, s.DB, "x", 3, "FAILED", "orders", "", "REJECTED", t0)
	clk := newClock(t0)
	a := newJournal(t, s.DB, "a", clk, 3)
	ctx := context.Background()
	run, err := a.Begin(ctx, "T-C", journal.OpRedrive, journal.Filter{})
	require.NoError(t, err)
	require.NoError(t, a.Checkpoint(ctx, run, 1, "page-2"))

	_, err = a.Redrive(ctx, "T-C", journal.Filter{}, journal.Options{})
	require.ErrorContains(t, err, `checkpoint "page-2" is not a seq cursor`)
	rec, err := a.Find(ctx, "T-C")
	require.NoError(t, err)
	require.Equal(t, journal.StateFailed, rec.State)
	require.Equal(t, string(journal.CodeBatchFailed), rec.FailureCode)
	require.Contains(t, rec.FailureDetail, "page-2")
	require.Equal(t, 3, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_outbox WHERE status = 'FAILED'`), "nothing redriven")
}

// Checkpoint, Complete and Fail refuse a nil *Run with a code before any
// statement (the zero *sql.DB here would panic if one were run).
func TestNilRunIsRefused(t *testing.T) {
	t.Parallel()
	j, err := journal.New(&sql.DB{}, journal.Config{Owner: "a"})
	require.NoError(t, err)
	ctx := context.Background()

	err = j.Checkpoint(ctx, nil, 1, "1")
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	require.Contains(t, err.Error(), "journal.Checkpoint")
	err = j.Complete(ctx, nil)
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	require.Contains(t, err.Error(), "journal.Complete")
	err = j.Fail(ctx, nil, "X", "detail")
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	require.Contains(t, err.Error(), "journal.Fail")
}

// The claim on the takeover UPDATE (and in the package doc): it re-checks the
// row as it is now, so an owner that checkpointed (extending its lease)
// between Begin's read and its UPDATE makes the UPDATE match nothing, and
// Begin returns JOURNAL_IN_FLIGHT. Here b's read sees a's lease expired; a
// then checkpoints on its own connection, either committed before b's UPDATE
// runs, or still uncommitted when b's UPDATE arrives (b waits on the row lock
// and must judge the committed checkpoint, not the row it read). Either way a
// keeps the operation with its new checkpoint, and b changed nothing.
func TestTakeoverRefusedWhenOwnerCheckpointsAfterRead(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name               string
		holdTxUntilBlocked bool
	}{
		{name: "checkpoint committed before the takeover update"},
		{name: "checkpoint uncommitted when the takeover update arrives", holdTxUntilBlocked: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := newSchema(t)
			clk := newClock(t0)
			ctx := context.Background()
			a := newJournal(t, s.DB, "a", clk, 10)
			b := newJournal(t, s.Open(t), "b", clk, 10)

			runA, err := a.Begin(ctx, "T-CP", "custom", "plan")
			require.NoError(t, err)
			require.NoError(t, a.Checkpoint(ctx, runA, 5, "c5"))
			// a's lease ended at t0+30s: b's read finds the operation takeable.
			clk.set(t0.Add(time.Minute))

			var err2 error
			if !tc.holdTxUntilBlocked {
				hookRan := false
				journal.SetAfterRead(b, func() {
					hookRan = true
					require.NoError(t, a.Checkpoint(ctx, runA, 7, "c7"))
				})
				_, err2 = b.Begin(ctx, "T-CP", "custom", "plan")
				require.True(t, hookRan, "b read the row and reached its takeover UPDATE")
			} else {
				err2 = beginWhileCheckpointHeld(t, s.DB, a, b, runA)
			}
			require.ErrorIs(t, err2, journal.ErrInFlight)
			require.Equal(t, journal.CodeInFlight, outbox.CodeOf(err2))

			rec, err := a.Find(ctx, "T-CP")
			require.NoError(t, err)
			require.Equal(t, journal.StateStarted, rec.State)
			require.Equal(t, "a", rec.Owner, "b did not take the operation over")
			require.EqualValues(t, 1, rec.LeaseToken, "no takeover bumped the token")
			require.EqualValues(t, 7, rec.ItemsCompleted)
			require.Equal(t, "c7", rec.Checkpoint)
			require.True(t, rec.LeaseExpiresAt.Equal(t0.Add(90*time.Second)), "a's checkpoint at t0+60s extended its lease: %s", rec.LeaseExpiresAt)

			// a still holds the operation and finishes it.
			require.NoError(t, a.Checkpoint(ctx, runA, 8, "c8"))
			require.NoError(t, a.Complete(ctx, runA))
		})
	}
}

// beginWhileCheckpointHeld runs b.Begin; between its read and its UPDATE, a
// checkpoints inside a transaction on its own connection and holds it open.
// Only once b's backend is seen waiting on that transaction's lock (pg_locks,
// via pg_blocking_pids) is the checkpoint committed. It returns Begin's error.
func beginWhileCheckpointHeld(t *testing.T, db *sql.DB, a, b *journal.Journal, runA *journal.Run) error {
	t.Helper()
	ctx := context.Background()
	type held struct {
		tx  *sql.Tx
		pid int
		err error
	}
	heldCh := make(chan held, 1)
	journal.SetAfterRead(b, func() {
		h := held{}
		defer func() { heldCh <- h }()
		if h.tx, h.err = db.BeginTx(ctx, nil); h.err != nil {
			return
		}
		if h.err = h.tx.QueryRowContext(ctx, `SELECT pg_backend_pid()`).Scan(&h.pid); h.err != nil {
			return
		}
		h.err = journal.CheckpointTx(ctx, a, h.tx, runA, 7, "c7")
	})

	var beginErr error
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, beginErr = b.Begin(ctx, "T-CP", "custom", "plan")
	}()
	t.Cleanup(func() { <-done }) // registered first, runs last: after the rollback below

	var h held
	select {
	case h = <-heldCh:
	case <-done:
		t.Fatalf("b's Begin returned (%v) without reaching its takeover UPDATE", beginErr)
	}
	if h.tx != nil {
		t.Cleanup(func() { _ = h.tx.Rollback() }) // unblocks b if the test stops early
	}
	require.NoError(t, h.err)

	blocked := func() bool {
		var n int
		// Client backends only: a logical slot being created on the same
		// server waits for every running transaction, this one included
		// (seen in the version matrix, where cdcrelay's suite shares it).
		err := db.QueryRowContext(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE backend_type = 'client backend' AND $1::int = ANY(pg_blocking_pids(pid))`, h.pid).Scan(&n)
		return err == nil && n == 1
	}
	deadline := time.After(30 * time.Second)
	for !blocked() {
		select {
		case <-done:
			t.Fatalf("b's takeover UPDATE did not wait for a's uncommitted checkpoint (Begin returned %v)", beginErr)
		case <-deadline:
			t.Fatal("b's backend never waited on a's checkpoint transaction")
		case <-time.After(2 * time.Millisecond): // poll the lock state again
		}
	}
	select {
	case <-done:
		t.Fatal("b's Begin returned while a's checkpoint was uncommitted")
	default:
	}
	require.NoError(t, h.tx.Commit())
	<-done
	return beginErr
}
