package relaymode_test

import (
	"context"
	"database/sql"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	migrationsql "github.com/fencedoutbox/watermill-outbox/migrations/sql"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

// A missing messaging_relay_mode row is a damaged schema, not a mode: every
// function that reads the mode refuses with the same RELAY_MODE_MISSING,
// naming the migration's INSERT, and writes nothing. (ReadMode used to call
// it polling while Beat refused with a conflict claiming CDC, and
// Enable/Disable failed with an uncoded sql.ErrNoRows.)
func TestMissingModeRowIsRefusedEverywhere(t *testing.T) {
	t.Parallel()
	s := relayDB(t)
	ctx := context.Background()
	_, err := s.DB.Exec(`DELETE FROM messaging_relay_mode`)
	require.NoError(t, err)

	calls := map[string]func() error{
		"ReadMode": func() error {
			r, err := relaymode.ReadMode(ctx, s.DB)
			require.Zero(t, r)
			return err
		},
		"CurrentMode": func() error {
			m, err := relaymode.CurrentMode(ctx, s.DB)
			require.Empty(t, m)
			return err
		},
		"RequireMode polling": func() error {
			return relaymode.RequireMode(ctx, s.DB, relaymode.ModePolling, "test", "hint")
		},
		"RequireMode CDC": func() error {
			return relaymode.RequireMode(ctx, s.DB, relaymode.ModeCDC, "test", "hint")
		},
		"Beat":       func() error { return relaymode.Beat(ctx, s.DB, "fw", time.Minute) },
		"BeatBudget": func() error { return relaymode.BeatBudget(ctx, s.DB, "fw", time.Minute, 5) },
		"BeatCDC":    func() error { return relaymode.BeatCDC(ctx, s.DB, "cdc", "slot_a", time.Minute) },
		"Enable":     func() error { return relaymode.Enable(ctx, s.DB, "ops", time.Time{}) },
		"Disable":    func() error { return relaymode.Disable(ctx, s.DB, "ops") },
		"DisableAt":  func() error { return relaymode.DisableAt(ctx, s.DB, "ops", time.Now()) },
		"EnableTx": func() error {
			return inRolledBackTx(t, s.DB, func(tx *sql.Tx) error { return relaymode.EnableTx(ctx, tx, "ops", time.Time{}) })
		},
		"DisableTx": func() error {
			return inRolledBackTx(t, s.DB, func(tx *sql.Tx) error { return relaymode.DisableTx(ctx, tx, "ops", time.Time{}) })
		},
		"ReadMode tx": func() error {
			return inRolledBackTx(t, s.DB, func(tx *sql.Tx) error { _, err := relaymode.ReadMode(ctx, tx); return err })
		},
	}
	for name, call := range calls {
		err := call()
		require.ErrorIs(t, err, relaymode.ErrRelayModeMissing, name)
		require.Equal(t, outbox.Code("RELAY_MODE_MISSING"), outbox.CodeOf(err), name)
		require.NotErrorIs(t, err, relaymode.ErrRelayModeConflict, name)
		require.Contains(t, err.Error(), relaymode.RestoreModeSQL, name)
	}
	require.Zero(t, count(t, s.DB, `SELECT count(*) FROM messaging_relay_heartbeat`), "no heartbeat was written")
	require.Zero(t, count(t, s.DB, `SELECT count(*) FROM messaging_relay_mode`), "no mode row was invented")

	// The remedy the detail names is the migration's own INSERT, and works.
	mig, err := migrationsql.Files.ReadFile("00004_relay_mode.sql")
	require.NoError(t, err)
	require.True(t, strings.Contains(string(mig), relaymode.RestoreModeSQL), "the restore statement is the migration's")
	_, err = s.DB.Exec(relaymode.RestoreModeSQL)
	require.NoError(t, err)
	mode, err := relaymode.CurrentMode(ctx, s.DB)
	require.NoError(t, err)
	require.Equal(t, relaymode.ModePolling, mode)
	require.NoError(t, relaymode.Beat(ctx, s.DB, "fw", time.Minute))
}

func inRolledBackTx(t *testing.T, db *sql.DB, fn func(*sql.Tx) error) error {
	t.Helper()
	tx, err := db.BeginTx(context.Background(), nil)
	require.NoError(t, err)
	defer func() { require.NoError(t, tx.Rollback()) }()
	return fn(tx)
}

func count(t *testing.T, db *sql.DB, q string) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(q).Scan(&n))
	return n
}

// A beat refused while the mode row was missing, whose refusal is read after
// the row was restored, is not a conflict: the relay would end, reporting a
// CDC mode that was never set. The restore is made to land exactly there: a
// statement trigger on the heartbeat table (it fires even when the beat's
// INSERT inserts nothing) puts the row back in the beat's own transaction.
// Before the fix Beat returned RELAY_MODE_CONFLICT; under load, a forwarder
// whose mode row an operator restored stopped for good this way.
func TestBeatRefusedWhileTheModeRowWasMissingIsNoConflictOnceItIsBack(t *testing.T) {
	t.Parallel()
	s := relayDB(t)
	ctx := context.Background()
	_, err := s.DB.Exec(`DELETE FROM messaging_relay_mode`)
	require.NoError(t, err)
	_, err = s.DB.Exec(`
CREATE FUNCTION restore_mode() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO messaging_relay_mode (id, mode) VALUES (true, 'POLLING') ON CONFLICT DO NOTHING;
    RETURN NULL;
END $$;
CREATE TRIGGER restore_mode AFTER INSERT ON messaging_relay_heartbeat
    FOR EACH STATEMENT EXECUTE FUNCTION restore_mode()`)
	require.NoError(t, err)

	require.NoError(t, relaymode.Beat(ctx, s.DB, "fw", time.Minute), "refused, then beaten once the row is back")
	var n int
	require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM messaging_relay_heartbeat WHERE owner = 'fw' AND expires_at > now()`).Scan(&n))
	require.Equal(t, 1, n, "the heartbeat is written")

	// A real conflict is still one.
	_, err = s.DB.Exec(`DROP TRIGGER restore_mode ON messaging_relay_heartbeat; DELETE FROM messaging_relay_heartbeat; UPDATE messaging_relay_mode SET mode = 'CDC'`)
	require.NoError(t, err)
	err = relaymode.Beat(ctx, s.DB, "fw", time.Minute)
	require.ErrorIs(t, err, relaymode.ErrRelayModeConflict)
}
