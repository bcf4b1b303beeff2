package relaymode_test

import (
	"context"
	"database/sql"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

// A heartbeat needs a positive lifetime: Beat, BeatBudget and BeatCDC refuse
// a zero or negative ttl with OUTBOX_INVALID_CONFIG before touching the
// database (a nil db would panic), as BeatCDC refuses a blank owner or a bad
// slot name. They used to write a heartbeat that had already expired.
func TestBeatsRefuseInvalidArgumentsBeforeTheDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var db *sql.DB // nil: any use of it panics
	cases := map[string]func() error{
		"Beat zero":                    func() error { return relaymode.Beat(ctx, db, "fw", 0) },
		"Beat negative":                func() error { return relaymode.Beat(ctx, db, "fw", -time.Second) },
		"BeatBudget zero":              func() error { return relaymode.BeatBudget(ctx, db, "fw", 0, 3) },
		"BeatBudget negative":          func() error { return relaymode.BeatBudget(ctx, db, "fw", -time.Nanosecond, 3) },
		"Beat empty owner":             func() error { return relaymode.Beat(ctx, db, "", time.Minute) },
		"Beat blank owner":             func() error { return relaymode.Beat(ctx, db, " \t", time.Minute) },
		"BeatBudget negative attempts": func() error { return relaymode.BeatBudget(ctx, db, "fw", time.Minute, -1) },
		"BeatBudget attempts beyond the column": func() error {
			return relaymode.BeatBudget(ctx, db, "fw", time.Minute, math.MaxInt32+1)
		},
		"BeatCDC zero":        func() error { return relaymode.BeatCDC(ctx, db, "cdc", "slot_a", 0) },
		"BeatCDC negative":    func() error { return relaymode.BeatCDC(ctx, db, "cdc", "slot_a", -time.Minute) },
		"BeatCDC empty owner": func() error { return relaymode.BeatCDC(ctx, db, "", "slot_a", time.Minute) },
		"BeatCDC blank owner": func() error { return relaymode.BeatCDC(ctx, db, "  ", "slot_a", time.Minute) },
		"BeatCDC bad slot":    func() error { return relaymode.BeatCDC(ctx, db, "cdc", "Slot-A", time.Minute) },
		"BeatCDC empty slot":  func() error { return relaymode.BeatCDC(ctx, db, "cdc", "", time.Minute) },
	}
	for name, call := range cases {
		var err error
		require.NotPanics(t, func() { err = call() }, name)
		require.ErrorIs(t, err, outbox.ErrInvalidConfig, name)
		require.Equal(t, outbox.CodeInvalidConfig, outbox.CodeOf(err), name)
	}
}

// Issue 20 item 2: the CDC side beats too, and the database enforces one
// kind of relay and one CDC slot. On the old code Disable switched back to
// POLLING under a live CDC relay and nothing refused a second slot.
func TestCDCHeartbeatsExcludePollingAndASecondSlot(t *testing.T) {
	t.Parallel()
	s := relayDB(t)
	ctx := context.Background()

	err := relaymode.BeatCDC(ctx, s.DB, "cdc-a", "slot_a", time.Minute)
	require.ErrorIs(t, err, relaymode.ErrRelayModeConflict, "a CDC consumer must not publish in POLLING mode")
	require.NoError(t, relaymode.Enable(ctx, s.DB, "ops", time.Time{}))
	require.NoError(t, relaymode.BeatCDC(ctx, s.DB, "cdc-a", "slot_a", time.Minute))
	require.NoError(t, relaymode.BeatCDC(ctx, s.DB, "cdc-a", "slot_a", time.Minute), "renewal")
	require.NoError(t, relaymode.BeatCDC(ctx, s.DB, "cdc-a2", "slot_a", time.Minute), "the same slot: PostgreSQL itself lets one of them stream")

	err = relaymode.BeatCDC(ctx, s.DB, "cdc-b", "slot_b", time.Minute)
	require.ErrorIs(t, err, relaymode.ErrSecondCDCConsumer)
	require.Equal(t, outbox.Code("CDC_SECOND_CONSUMER"), outbox.CodeOf(err))
	require.Contains(t, err.Error(), "cdc-a on slot slot_a")

	live, err := relaymode.LiveCDCConsumers(ctx, s.DB, time.Time{})
	require.NoError(t, err)
	require.Len(t, live, 2)
	require.Equal(t, "cdc-a", live[0].Owner)
	require.Equal(t, "slot_a", live[0].SlotName)

	err = relaymode.Disable(ctx, s.DB, "ops")
	require.ErrorIs(t, err, relaymode.ErrRelayModeConflict, "Disable refuses while a CDC consumer is live")
	require.Contains(t, err.Error(), "cdc-a on slot slot_a")
	mode, err := relaymode.CurrentMode(ctx, s.DB)
	require.NoError(t, err)
	require.Equal(t, relaymode.ModeCDC, mode)

	require.NoError(t, relaymode.Leave(ctx, s.DB, "cdc-a"))
	require.NoError(t, relaymode.Leave(ctx, s.DB, "cdc-a2"))
	require.NoError(t, relaymode.Disable(ctx, s.DB, "ops"))
	err = relaymode.BeatCDC(ctx, s.DB, "cdc-a", "slot_a", time.Minute)
	require.ErrorIs(t, err, relaymode.ErrRelayModeConflict, "after Disable the CDC consumer's next beat refuses")

	// A CDC consumer that beats in POLLING mode anyway (a Debezium
	// connector's action query cannot refuse) keeps the forwarders out.
	_, err = s.DB.Exec(`INSERT INTO messaging_relay_heartbeat (owner, expires_at, kind, slot_name) VALUES ('debezium:x', now() + interval '1 minute', 'CDC', 'slot_x')`)
	require.NoError(t, err)
	err = relaymode.Beat(ctx, s.DB, "fw", time.Minute)
	require.ErrorIs(t, err, relaymode.ErrRelayModeConflict)
	require.NoError(t, relaymode.Leave(ctx, s.DB, "debezium:x"))
	require.NoError(t, relaymode.Beat(ctx, s.DB, "fw", time.Minute))
}
