package forwarder_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
)

// A row written by SQL with a timestamp no message can carry ('infinity')
// is one row's outcome, never the batch's: it is parked FAILED with
// OUTBOX_CORRUPT_ROW and a reason naming the column, and the good rows beside
// it go out in the same pass. Migration 00043 refuses such rows; a table
// migrated over rows that already had one keeps them (its constraint stays NOT
// VALID), which the test reproduces by dropping the constraint.
func TestUnreadableTimestampIsParkedAloneAndItsNeighboursGoOut(t *testing.T) {
	for _, column := range []string{"occurred_at", "created_at"} {
		t.Run(column, func(t *testing.T) {
			s := newDB(t)
			insertN(t, s.DB, "orders", "g1", "g2")
			_, err := s.DB.Exec(`ALTER TABLE messaging_outbox DROP CONSTRAINT messaging_outbox_finite_timestamps_check`)
			require.NoError(t, err)
			_, err = s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, ` + column + `)
				VALUES ('bad', 'orders', 'x', 'infinity')`)
			require.NoError(t, err)
			insertN(t, s.DB, "orders", "g3", "g4")
			rec := &recorder{}
			f := newForwarder(t, s.DB, rec, forwarder.Config{})
			rep, err := f.RunOnce(context.Background())
			require.NoError(t, err)
			require.Equal(t, 5, rep.Claimed)
			require.Equal(t, 4, rep.Published)
			require.Equal(t, 1, rep.Failed)
			require.ElementsMatch(t, []string{"g1", "g2", "g3", "g4"}, rec.ids())
			st := state(t, s.DB, "bad")
			require.Equal(t, "FAILED", st.Status)
			require.Equal(t, string(outbox.CodeCorruptRow), st.Code)
			var detail string
			require.NoError(t, s.DB.QueryRow(`SELECT last_failure_detail FROM messaging_outbox WHERE message_id = 'bad'`).Scan(&detail))
			require.Contains(t, detail, column)
			require.Contains(t, detail, "infinity")
		})
	}
}

// A row written by SQL with an occurred_at RFC 3339 cannot write (year
// 10000, a date BC; the schema allows both) is parked FAILED as corrupt, not
// delivered with a msg.occurred_at no consumer can parse; its neighbours go
// out.
func TestAnOccurredAtOutsideRFC3339YearsIsParked(t *testing.T) {
	s := newDB(t)
	insertN(t, s.DB, "orders", "g1")
	_, err := s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, occurred_at) VALUES
		('future', 'orders', 'x', '10000-01-01 00:00:00+00'), ('ides', 'orders', 'x', '0044-03-15 00:00:00+00 BC')`)
	require.NoError(t, err)
	insertN(t, s.DB, "orders", "g2")
	rec := &recorder{}
	rep, err := newForwarder(t, s.DB, rec, forwarder.Config{}).RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, 2, rep.Failed)
	require.ElementsMatch(t, []string{"g1", "g2"}, rec.ids())
	for _, id := range []string{"future", "ides"} {
		st := state(t, s.DB, id)
		require.Equal(t, "FAILED", st.Status, id)
		require.Equal(t, string(outbox.CodeCorruptRow), st.Code, id)
	}
}
