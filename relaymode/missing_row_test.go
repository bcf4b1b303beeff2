package relaymode_test

import (
	"context"
	"database/sql"
	"math"
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

// DisableTx switches back to POLLING inside the caller's transaction: the
// transaction sees POLLING at once, others see CDC until it commits, and a
// rollback leaves CDC.
func TestDisableTxSwitchesInTheCallersTransaction(t *testing.T) {
	t.Parallel()
	s := relayDB(t)
	ctx := context.Background()
	require.NoError(t, relaymode.Enable(ctx, s.DB, "ops", time.Time{}))

	tx, err := s.DB.BeginTx(ctx, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback() })
	require.NoError(t, relaymode.DisableTx(ctx, tx, "handover", time.Time{}))
	inside, err := relaymode.ReadMode(ctx, tx)
	require.NoError(t, err)
	require.Equal(t, relaymode.ModePolling, inside.Mode)
	require.Equal(t, "handover", inside.ChangedBy)
	outside, err := relaymode.CurrentMode(ctx, s.DB)
	require.NoError(t, err)
	require.Equal(t, relaymode.ModeCDC, outside, "not visible before commit")
	require.NoError(t, tx.Rollback())

	after, err := relaymode.ReadMode(ctx, s.DB)
	require.NoError(t, err)
	require.Equal(t, relaymode.ModeCDC, after.Mode, "a rollback leaves CDC")
	require.Equal(t, "ops", after.ChangedBy)

	tx, err = s.DB.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, relaymode.DisableTx(ctx, tx, "handover", time.Time{}))
	require.NoError(t, tx.Commit())
	after, err = relaymode.ReadMode(ctx, s.DB)
	require.NoError(t, err)
	require.Equal(t, relaymode.ModePolling, after.Mode)
	require.Equal(t, "handover", after.ChangedBy)
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
