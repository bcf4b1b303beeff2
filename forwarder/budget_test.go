package forwarder_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// The attempt budget is each relay's configuration, not the row's (README):
// a running relay reports it with its heartbeat, so outboxctl status can
// show relays whose budgets differ.
func TestRelayReportsItsBudgetWithItsHeartbeat(t *testing.T) {
	s := newDB(t)
	f := newForwarder(t, s.DB, &recorder{}, forwarder.Config{Owner: "budget-7", MaxAttempts: 7})
	done := make(chan error, 1)
	go func() { done <- f.Run(context.Background()) }()
	waitOrFail(t, f.Running(), "Run reaching its loop")
	require.Equal(t, 7, testdb.QueryInt(t, s.DB, `SELECT max_attempts FROM messaging_relay_heartbeat WHERE owner = 'budget-7'`))
	require.NoError(t, f.Close())
	require.NoError(t, waitOrFail(t, done, "Run returning"))
}

// An AMBIGUOUS row at 7 attempts after MaxAttempts was lowered to 5 is
// parked and reported by the next pass, not left waiting forever.
func TestRowOverALoweredBudgetIsReportedExhausted(t *testing.T) {
	s := newDB(t)
	insertN(t, s.DB, "orders", "m1")
	_, err := s.DB.Exec(`UPDATE messaging_outbox SET status = 'AMBIGUOUS', attempts = 7 WHERE message_id = 'm1'`)
	require.NoError(t, err)
	rec := &recorder{}
	f := newForwarder(t, s.DB, rec, forwarder.Config{MaxAttempts: 5})
	rep, err := f.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, 1, rep.Exhausted)
	require.Empty(t, rec.ids())
	st := state(t, s.DB, "m1")
	require.Equal(t, "EXHAUSTED", st.Status)
	require.Equal(t, fencing.CodeBudgetSpent, st.Code)
}
