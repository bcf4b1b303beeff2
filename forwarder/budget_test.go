package forwarder_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

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
