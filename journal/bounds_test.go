package journal_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/journal"
)

// An approved execution touches at most the approved count, even when a row
// joins the approved row set while it runs: here a transaction that began
// before the approval parks "late" (its parked_at is its start, before the
// approval, and its seq is in range) and commits after the execution's
// first batch.
func TestAnApprovedExecutionNeverTouchesMoreThanTheApprovedCount(t *testing.T) {
	s := newSchema(t)
	ctx := context.Background()
	for _, id := range []string{"a", "late", "c"} {
		testdb.InsertRow(t, s.DB, envelope.Row{MessageID: id, Destination: "orders", Payload: []byte("x")})
	}
	long, err := s.DB.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = long.Rollback() }()
	_, err = long.Exec(`UPDATE messaging_outbox SET status = 'FAILED', parked_at = now(), attempts = 1, last_failure_code = 'X' WHERE message_id = 'late'`)
	require.NoError(t, err)
	_, err = s.DB.Exec(`UPDATE messaging_outbox SET status = 'FAILED', parked_at = now(), attempts = 1, last_failure_code = 'X' WHERE message_id IN ('a', 'c')`)
	require.NoError(t, err)

	j, err := journal.New(s.DB, journal.Config{Owner: "ops", BatchSize: 1, RequireApproval: true})
	require.NoError(t, err)
	a, err := j.Approve(ctx, "CHG-LATE", journal.OpPurge, journal.Filter{})
	require.NoError(t, err)
	require.EqualValues(t, 2, a.Count, "the approver saw a and c")

	committed := false
	out, err := j.Purge(ctx, "CHG-LATE", journal.Filter{}, journal.Options{Progress: func(journal.Progress) error {
		if !committed {
			committed = true
			return long.Commit() // after the first batch, before the walk reaches "late"
		}
		return nil
	}})
	require.NoError(t, err)
	require.True(t, committed)
	require.EqualValues(t, 2, out.Items, "the approved count, not the three rows that match by then")
	require.Equal(t, 1, s.Count(t, "true"), "one row is left for a new approval")
}

// A row locked by another session does not hang an execution: its batch
// gives up after half the lease, the operation is released, and it resumes
// from its checkpoint once the lock is gone.
func TestALockedRowFailsTheBatchInsteadOfHangingIt(t *testing.T) {
	s := newSchema(t)
	ctx := context.Background()
	parked(t, s.DB, "r", 2, "FAILED", "orders", "", "X", time.Now())
	holder, err := s.DB.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = holder.Rollback() }()
	_, err = holder.Exec(`SELECT 1 FROM messaging_outbox WHERE message_id = 'r-2' FOR UPDATE`)
	require.NoError(t, err)

	j, err := journal.New(s.DB, journal.Config{Owner: "ops", BatchSize: 1, LeaseDuration: 2 * time.Second})
	require.NoError(t, err)
	out, err := j.Purge(ctx, "CHG-LOCK", journal.Filter{}, journal.Options{})
	require.ErrorContains(t, err, "lock timeout")
	require.EqualValues(t, 1, out.Items, "the batch before the locked row is done and checkpointed")

	require.NoError(t, holder.Rollback())
	out, err = j.Purge(ctx, "CHG-LOCK", journal.Filter{}, journal.Options{})
	require.NoError(t, err)
	require.EqualValues(t, 2, out.Items)
	require.Zero(t, s.Count(t, "true"))
}

// An executor frozen mid-batch (a stopped process, a partition: its
// transaction open and idle, holding the journal row) does not block the
// owner that takes over once its lease ends: the server ends the frozen
// batch's transaction after a lease idle, the takeover goes through and
// finishes the operation, and the frozen executor's batch never commits.
func TestAFrozenExecutorDoesNotBlockTheTakeover(t *testing.T) {
	s := newSchema(t)
	ctx := context.Background()
	parked(t, s.DB, "r", 2, "FAILED", "orders", "", "X", time.Now())

	frozen, err := journal.New(s.DB, journal.Config{Owner: "frozen", BatchSize: 1, LeaseDuration: time.Second})
	require.NoError(t, err)
	thaw, entered := make(chan struct{}), make(chan struct{})
	journal.SetBeforeCommit(frozen, func() { close(entered); <-thaw })
	done := make(chan error, 1)
	go func() {
		_, err := frozen.Purge(ctx, "CHG-FROZEN", journal.Filter{}, journal.Options{})
		done <- err
	}()
	<-entered

	other, err := journal.New(s.DB, journal.Config{Owner: "other", BatchSize: 1, LeaseDuration: time.Second})
	require.NoError(t, err)
	var out journal.Outcome
	await.Until(t, func() bool {
		out, err = other.Purge(ctx, "CHG-FROZEN", journal.Filter{}, journal.Options{})
		if outbox.CodeOf(err) == journal.CodeInFlight {
			return false // the frozen owner's lease has not ended yet
		}
		require.NoError(t, err)
		return true
	}, "the frozen owner's lease ends and the purge goes through")
	require.EqualValues(t, 2, out.Items)
	require.Zero(t, s.Count(t, "true"))

	close(thaw)
	require.Error(t, <-done, "the frozen batch's transaction was ended by the server")
}
