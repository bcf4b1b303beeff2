package forwarder_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

// docs/ERRORS.md, RELAY_MODE_MISSING: a running forwarder whose relay-mode
// row is deleted logs its heartbeats as failed with that code, claims
// nothing once its heartbeat has lapsed (it no longer knows the mode is
// polling), and resumes when the row is restored.
func TestAMissingModeRowStopsClaimsUntilItIsRestored(t *testing.T) {
	s := newDB(t)
	f, rec, logs, done := runBeating(t, s)

	_, err := s.DB.Exec(`DELETE FROM messaging_relay_mode`)
	require.NoError(t, err)
	await.Until(t, func() bool { return logs.count(relaymode.CodeRelayModeMissing) > 0 }, "heartbeats fail with RELAY_MODE_MISSING")
	await.Until(t, func() bool { return logs.count(forwarder.CodeHeartbeatLapsed) > 0 }, "passes fail with FORWARDER_HEARTBEAT_LAPSED")
	insertN(t, s.DB, "orders", "m1")
	n := logs.count(forwarder.CodeHeartbeatLapsed)
	await.Until(t, func() bool { return logs.count(forwarder.CodeHeartbeatLapsed) >= n+2 }, "two more passes fail with FORWARDER_HEARTBEAT_LAPSED")
	require.Empty(t, rec.ids(), "nothing is claimed while the mode row is missing")
	require.Equal(t, "PENDING", state(t, s.DB, "m1").Status)

	_, err = s.DB.Exec(`INSERT INTO messaging_relay_mode (id, mode) VALUES (true, 'POLLING')`)
	require.NoError(t, err)
	await.Until(t, func() bool { return len(rec.ids()) == 1 }, "claims resume once the row is back")
	require.NoError(t, f.Close())
	require.NoError(t, waitOrFail(t, done, "Run returning"))
}
