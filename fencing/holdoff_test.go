package fencing_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// EndHoldOff clears next_attempt_at of exactly the rows of the destination
// that wait out a hold-off under one of the given codes, after now, and
// leaves every other row as it was.
func TestEndHoldOffMakesOnlyTheHeldOffRowsClaimable(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	codes := [2]string{"DOWNSTREAM_UNAVAILABLE", "DOWNSTREAM_FAILING"}
	for _, r := range []struct{ id, dest, status, code string }{
		{"unavailable", "orders", "PENDING", codes[0]},
		{"failing", "orders", "AMBIGUOUS", codes[1]},
		{"other-code", "orders", "PENDING", "PUBLISH_ERROR"},
		{"other-dest", "payments", "PENDING", codes[0]},
		{"due-already", "orders", "PENDING", codes[0]},
		{"parked", "orders", "PENDING", codes[0]},
	} {
		testdb.InsertRow(t, s.DB, envelope.Row{MessageID: r.id, Destination: r.dest, Payload: []byte("p")})
		_, err := s.DB.Exec(`UPDATE messaging_outbox SET status = $2, last_failure_code = $3, next_attempt_at = $4, attempts = 1
			WHERE message_id = $1`, r.id, r.status, r.code, t0.Add(time.Hour))
		require.NoError(t, err)
	}
	_, err := s.DB.Exec(`UPDATE messaging_outbox SET next_attempt_at = $1 WHERE message_id = 'due-already'`, t0.Add(-time.Minute))
	require.NoError(t, err)
	// Parked by hand the way the relay parks a row (EXHAUSTED, parked_at).
	_, err = s.DB.Exec(`UPDATE messaging_outbox SET status = 'EXHAUSTED', parked_at = $1 WHERE message_id = 'parked'`, t0)
	require.NoError(t, err)

	n, err := fencing.EndHoldOff(ctx, s.DB, "orders", codes, t0)
	require.NoError(t, err)
	require.EqualValues(t, 2, n)
	for id, cleared := range map[string]bool{
		"unavailable": true, "failing": true,
		"other-code": false, "other-dest": false, "due-already": false, "parked": false,
	} {
		st := state(t, s.DB, id)
		require.Equal(t, !cleared, st.Next.Valid, id)
		require.Equal(t, 1, st.Attempts, "%s: no attempt spent or given back", id)
	}
	require.Equal(t, "DOWNSTREAM_UNAVAILABLE", state(t, s.DB, "unavailable").Code, "the failure code stays")

	// Without a clock of its own it compares with the database's now().
	_, err = s.DB.Exec(`UPDATE messaging_outbox SET next_attempt_at = now() + interval '1 hour' WHERE message_id = 'other-dest'`)
	require.NoError(t, err)
	n, err = fencing.EndHoldOff(ctx, s.DB, "payments", codes, time.Time{})
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	require.False(t, state(t, s.DB, "other-dest").Next.Valid)
}
