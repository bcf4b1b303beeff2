package journal_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/journal"
)

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
		err := db.QueryRowContext(ctx, `SELECT count(*) FROM pg_stat_activity WHERE $1::int = ANY(pg_blocking_pids(pid))`, h.pid).Scan(&n)
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
