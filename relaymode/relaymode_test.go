package relaymode_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

func relayDB(t *testing.T) *testdb.Schema {
	t.Helper()
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(4)
	return s
}

func TestTwoPollingRelaysAreFineAndBlockTheSwitchToCDC(t *testing.T) {
	t.Parallel()
	s := relayDB(t)
	ctx := context.Background()
	require.NoError(t, relaymode.Beat(ctx, s.DB, "relay-a", time.Minute))
	require.NoError(t, relaymode.Beat(ctx, s.DB, "relay-b", time.Minute))
	require.NoError(t, relaymode.Beat(ctx, s.DB, "relay-a", time.Minute), "a second beat of the same owner renews it")

	live, err := relaymode.LiveRelays(ctx, s.DB, time.Time{})
	require.NoError(t, err)
	require.Len(t, live, 2)
	require.Equal(t, "relay-a", live[0].Owner)
	require.Equal(t, "relay-b", live[1].Owner)

	err = relaymode.Enable(ctx, s.DB, "ops@example", time.Time{})
	require.ErrorIs(t, err, relaymode.ErrRelayModeConflict)
	require.Equal(t, outbox.Code("RELAY_MODE_CONFLICT"), outbox.CodeOf(err))
	require.Contains(t, err.Error(), "relay-a")
	require.Contains(t, err.Error(), "relay-b")
	mode, err := relaymode.CurrentMode(ctx, s.DB)
	require.NoError(t, err)
	require.Equal(t, relaymode.ModePolling, mode, "a refused switch changes nothing")

	// After one relay leaves, the other still blocks, and is the only one named.
	require.NoError(t, relaymode.Leave(ctx, s.DB, "relay-a"))
	err = relaymode.Enable(ctx, s.DB, "ops@example", time.Time{})
	require.ErrorIs(t, err, relaymode.ErrRelayModeConflict)
	require.NotContains(t, err.Error(), "relay-a")
	require.Contains(t, err.Error(), "relay-b")
}

func TestEnableAfterHeartbeatsExpireThenBeatRefusesUntilDisable(t *testing.T) {
	t.Parallel()
	s := relayDB(t)
	ctx := context.Background()
	require.NoError(t, relaymode.Beat(ctx, s.DB, "crashed-relay", time.Minute))

	// The injected clock is past the heartbeat's expiry: a relay that died
	// without Leave does not block the switch forever.
	later := time.Now().Add(2 * time.Hour)
	require.NoError(t, relaymode.Enable(ctx, s.DB, "ops@example", later))
	mode, err := relaymode.CurrentMode(ctx, s.DB)
	require.NoError(t, err)
	require.Equal(t, relaymode.ModeCDC, mode)
	var by string
	var at time.Time
	require.NoError(t, s.DB.QueryRow(`SELECT changed_by, changed_at FROM messaging_relay_mode WHERE id`).Scan(&by, &at))
	require.Equal(t, "ops@example", by)
	require.WithinDuration(t, later, at, time.Millisecond, "changed_at is the injected clock")

	require.NoError(t, relaymode.Enable(ctx, s.DB, "someone-else", time.Time{}), "enabling twice is a no-op")
	require.NoError(t, s.DB.QueryRow(`SELECT changed_by FROM messaging_relay_mode WHERE id`).Scan(&by))
	require.Equal(t, "ops@example", by)

	err = relaymode.Beat(ctx, s.DB, "new-relay", time.Minute)
	require.ErrorIs(t, err, relaymode.ErrRelayModeConflict, "a forwarder must not start in CDC mode")
	var n int
	require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM messaging_relay_heartbeat WHERE owner = 'new-relay'`).Scan(&n))
	require.Zero(t, n, "a refused beat leaves no heartbeat")

	require.NoError(t, relaymode.Disable(ctx, s.DB, "ops@example"))
	require.NoError(t, relaymode.Disable(ctx, s.DB, "ops@example"), "disabling twice is a no-op")
	mode, err = relaymode.CurrentMode(ctx, s.DB)
	require.NoError(t, err)
	require.Equal(t, relaymode.ModePolling, mode)
	require.NoError(t, relaymode.Beat(ctx, s.DB, "new-relay", time.Minute))
}

// waitForLockWait waits until the backend of pool (identified by its
// application_name) is blocked on a lock.
func waitForLockWait(t *testing.T, admin *sql.DB, appName string) {
	t.Helper()
	await.Until(t, func() bool {
		var n int
		err := admin.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'`, appName).Scan(&n)
		return err == nil && n == 1
	}, "the Beat never waited on the mode row lock")
}

func beatPool(t *testing.T, s *testdb.Schema, appName string) *sql.DB {
	t.Helper()
	db, err := sql.Open("postgres", s.URL+"&application_name="+appName)
	require.NoError(t, err)
	db.SetMaxOpenConns(1)
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// A Beat racing a switch to CDC waits for the switch's lock on the mode row,
// then sees its outcome: it refuses once CDC is committed.
func TestBeatConcurrentWithEnableWaitsThenRefuses(t *testing.T) {
	t.Parallel()
	s := relayDB(t)
	ctx := context.Background()
	tx, err := s.DB.BeginTx(ctx, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback() })
	require.NoError(t, relaymode.EnableTx(ctx, tx, "ops@example", time.Time{}))

	app := "h4_beat_" + s.Name
	done := make(chan error, 1)
	go func() { done <- relaymode.Beat(ctx, beatPool(t, s, app), "racing-relay", time.Minute) }()
	waitForLockWait(t, s.DB, app)
	select {
	case err := <-done:
		t.Fatalf("Beat returned while the switch held the mode row: %v", err)
	default:
	}
	require.NoError(t, tx.Commit())
	require.ErrorIs(t, <-done, relaymode.ErrRelayModeConflict)

	live, err := relaymode.LiveRelays(ctx, s.DB, time.Time{})
	require.NoError(t, err)
	require.Empty(t, live, "CDC is on and no polling relay slipped in")
}

// The same race with the switch rolled back: the waiting Beat goes through.
func TestBeatConcurrentWithAbandonedEnableProceeds(t *testing.T) {
	t.Parallel()
	s := relayDB(t)
	ctx := context.Background()
	tx, err := s.DB.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, relaymode.EnableTx(ctx, tx, "ops@example", time.Time{}))

	app := "h4_beat_rb_" + s.Name
	done := make(chan error, 1)
	go func() { done <- relaymode.Beat(ctx, beatPool(t, s, app), "racing-relay", time.Minute) }()
	waitForLockWait(t, s.DB, app)
	require.NoError(t, tx.Rollback())
	require.NoError(t, <-done)
	mode, err := relaymode.CurrentMode(ctx, s.DB)
	require.NoError(t, err)
	require.Equal(t, relaymode.ModePolling, mode)
}

// The other order: a Beat holding its FOR SHARE lock delays the switch,
// which then counts the committed heartbeat and refuses.
func TestEnableConcurrentWithBeatSeesTheHeartbeat(t *testing.T) {
	t.Parallel()
	s := relayDB(t)
	ctx := context.Background()
	beatTx, err := s.DB.BeginTx(ctx, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = beatTx.Rollback() })
	// Beat's own statement, held open in a transaction so the switch has to
	// wait for it.
	res, err := beatTx.ExecContext(ctx, relaymode.SQLBeat, "slow-relay", time.Minute.Seconds(), 0, "")
	require.NoError(t, err)
	n, _ := res.RowsAffected()
	require.EqualValues(t, 1, n)

	app := "h4_enable_" + s.Name
	done := make(chan error, 1)
	go func() { done <- relaymode.Enable(ctx, beatPool(t, s, app), "ops@example", time.Time{}) }()
	waitForLockWait(t, s.DB, app)
	require.NoError(t, beatTx.Commit())
	err = <-done
	require.ErrorIs(t, err, relaymode.ErrRelayModeConflict)
	require.Contains(t, err.Error(), "slow-relay")
}
