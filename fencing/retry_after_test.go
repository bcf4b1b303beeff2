package fencing_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// RetryAfter is added to the statement's own clock, the one the claim
// compares next_attempt_at with, so the caller's clock skew cannot shorten
// or stretch a backoff.
func TestRetryAfterCountsFromTheStatementsClock(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	insert(t, s.DB, "server", "")
	insert(t, s.DB, "injected", "")
	insert(t, s.DB, "absolute", "")
	c, err := fencing.Claim(ctx, s.DB, params("r", time.Time{}))
	require.NoError(t, err)
	require.Len(t, c, 3)
	const delay = 90*time.Second + 123456*time.Microsecond

	// Server clock: inside one transaction now() is fixed, so the stored
	// time minus now() is exactly the delay.
	tx, err := s.DB.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	res, err := fencing.Apply(ctx, tx, []fencing.Outcome{{Lease: c[0].Lease, To: envelope.StatusAmbiguous, Code: "X", RetryAfter: delay}})
	require.NoError(t, err)
	require.Equal(t, []fencing.Result{fencing.Applied}, res)
	var us int64
	require.NoError(t, tx.QueryRow(`SELECT (extract(epoch FROM next_attempt_at - now()) * 1000000)::int8
		FROM messaging_outbox WHERE message_id = 'server'`).Scan(&us))
	require.Equal(t, delay, time.Duration(us)*time.Microsecond)
	require.NoError(t, tx.Commit())

	// Injected clock: Now + delay, whatever the server's time.
	res, err = fencing.Apply(ctx, s.DB, []fencing.Outcome{{Lease: c[1].Lease, To: envelope.StatusAmbiguous, Code: "X", RetryAfter: delay, Now: t0}})
	require.NoError(t, err)
	require.Equal(t, []fencing.Result{fencing.Applied}, res)
	require.True(t, state(t, s.DB, "injected").Next.Time.Equal(t0.Add(delay)))

	// An absolute NextAttemptAt (MarkAmbiguous) still wins.
	res, err = fencing.Apply(ctx, s.DB, []fencing.Outcome{{Lease: c[2].Lease, To: envelope.StatusAmbiguous, Code: "X",
		NextAttemptAt: t0.Add(time.Hour), RetryAfter: delay, Now: t0}})
	require.NoError(t, err)
	require.Equal(t, []fencing.Result{fencing.Applied}, res)
	require.True(t, state(t, s.DB, "absolute").Next.Time.Equal(t0.Add(time.Hour)))
}

func TestNegativeRetryAfterIsRefused(t *testing.T) {
	_, err := fencing.Apply(context.Background(), nil, []fencing.Outcome{{
		Lease: fencing.Lease{MessageID: "m", Owner: "r", Token: 1}, To: envelope.StatusAmbiguous, RetryAfter: -time.Second,
	}})
	require.ErrorIs(t, err, fencing.ErrInvalidArgument)
}
