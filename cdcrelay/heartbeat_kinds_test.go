package cdcrelay_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

// TestBothRelaysHeartbeatWithTheirKind is issue 18's "both relays beat": a
// running polling forwarder holds a POLLING heartbeat, which blocks the switch
// to CDC; a running CDC relay holds a CDC heartbeat on its slot, renews it
// while it runs (idle: no row to publish), and Disable refuses while it is
// live, naming it. Each relay removes its heartbeat when it stops.
func TestBothRelaysHeartbeatWithTheirKind(t *testing.T) {
	base := testdb.Logical(t)
	e := newEnv(t, base)
	ctx := context.Background()

	stop := startForwarder(t, e.s.DB, &recorder{}, "fw-kind")
	var polling []relaymode.Heartbeat
	require.Eventually(t, func() bool {
		var err error
		polling, err = relaymode.LiveRelays(ctx, e.s.DB, time.Time{})
		require.NoError(t, err)
		return len(polling) == 1
	}, patience(t), 10*time.Millisecond)
	require.Equal(t, "fw-kind", polling[0].Owner)
	require.Equal(t, relaymode.ModePolling, polling[0].Kind)
	require.Empty(t, polling[0].SlotName)
	err := relaymode.Enable(ctx, e.s.DB, "test", time.Time{})
	require.ErrorIs(t, err, relaymode.ErrRelayModeConflict, "Enable refuses while a polling relay beats")
	require.Contains(t, err.Error(), "fw-kind")

	stop()
	polling, err = relaymode.LiveRelays(ctx, e.s.DB, time.Time{})
	require.NoError(t, err)
	require.Empty(t, polling, "a stopped forwarder removes its heartbeat")
	e.enableCDC(t)

	cfg := e.config()
	cfg.Owner = "cdc-kind"
	cfg.HeartbeatInterval, cfg.HeartbeatTTL = 50*time.Millisecond, 10*time.Second
	wait := e.relay(t, cfg, &recorder{})
	cdc, err := relaymode.LiveCDCConsumers(ctx, e.s.DB, time.Time{})
	require.NoError(t, err)
	require.Len(t, cdc, 1)
	require.Equal(t, "cdc-kind", cdc[0].Owner)
	require.Equal(t, relaymode.ModeCDC, cdc[0].Kind)
	require.Equal(t, e.slot, cdc[0].SlotName)
	polling, err = relaymode.LiveRelays(ctx, e.s.DB, time.Time{})
	require.NoError(t, err)
	require.Empty(t, polling, "a CDC heartbeat is not a polling one")

	first := cdc[0].HeartbeatAt
	require.Eventually(t, func() bool {
		live, err := relaymode.LiveCDCConsumers(ctx, e.s.DB, time.Time{})
		require.NoError(t, err)
		return len(live) == 1 && live[0].HeartbeatAt.After(first)
	}, patience(t), 10*time.Millisecond, "the idle CDC relay renews its heartbeat while it runs")

	err = relaymode.Disable(ctx, e.s.DB, "test")
	require.ErrorIs(t, err, relaymode.ErrRelayModeConflict, "Disable refuses while the CDC relay beats")
	require.Contains(t, err.Error(), "cdc-kind")
	mode, err := relaymode.CurrentMode(ctx, e.s.DB)
	require.NoError(t, err)
	require.Equal(t, relaymode.ModeCDC, mode)

	require.NoError(t, wait())
	cdc, err = relaymode.LiveCDCConsumers(ctx, e.s.DB, time.Time{})
	require.NoError(t, err)
	require.Empty(t, cdc, "a stopped CDC relay removes its heartbeat")
	require.NoError(t, relaymode.Disable(ctx, e.s.DB, "test"))
}
