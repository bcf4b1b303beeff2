package relaymode

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"time"

	outbox "github.com/fencedoutbox/watermill-outbox"
)

// Enable switches the database to CDC mode in its own transaction. It
// refuses with RELAY_MODE_CONFLICT while any polling relay's heartbeat is
// live at now (zero now means the database's clock), naming the live owners
// in the detail: stop them first, or wait for their heartbeats to expire. It
// refuses an empty by with RELAY_MODE_OPERATOR_REQUIRED, and a missing mode
// row with RELAY_MODE_MISSING (it does not insert one). Enabling when the
// mode is already CDC succeeds without changing the record.
func Enable(ctx context.Context, db *sql.DB, by string, now time.Time) error {
	return inTx(ctx, db, func(tx *sql.Tx) error { return EnableTx(ctx, tx, by, now) })
}

// EnableTx is Enable inside the caller's transaction. The mode row stays
// locked until tx ends, so every Beat in the meantime waits, then sees the
// outcome: refused if tx committed CDC, accepted if it rolled back.
func EnableTx(ctx context.Context, tx *sql.Tx, by string, now time.Time) error {
	const op = "relaymode.Enable"
	if strings.TrimSpace(by) == "" {
		return outbox.Errorf(CodeOperatorRequired, op, "say who switches the relay mode (by must not be empty)")
	}
	mode, err := lockMode(ctx, tx, op)
	if err != nil {
		return err
	}
	if mode == ModeCDC {
		return nil
	}
	live, err := LiveRelays(ctx, tx, now)
	if err != nil {
		return err
	}
	if len(live) > 0 {
		names := make([]string, len(live))
		for i, h := range live {
			names[i] = fmt.Sprintf("%s (until %s)", h.Owner, h.ExpiresAt.UTC().Format(time.RFC3339))
		}
		return outbox.Errorf(CodeRelayModeConflict, op, "%d polling relay(s) are live: %s; stop them (or wait for their heartbeats to expire) before switching to CDC", len(live), strings.Join(names, ", "))
	}
	return setMode(ctx, tx, ModeCDC, by, now)
}

// Disable switches the database back to POLLING mode, so forwarders may start
// again. It refuses with RELAY_MODE_CONFLICT while any CDC consumer's
// heartbeat is live (the native relay's [BeatCDC], a Debezium connector's
// [HeartbeatActionQuery]), naming them: stop the consumer first (the native
// relay marks what it delivered PUBLISHED and removes its heartbeat when it
// stops), or wait for its heartbeat to expire. It refuses an empty by with
// RELAY_MODE_OPERATOR_REQUIRED, and a missing mode row with
// RELAY_MODE_MISSING (it does not insert one); disabling when already
// POLLING succeeds without changing the record.
func Disable(ctx context.Context, db *sql.DB, by string) error {
	return DisableAt(ctx, db, by, time.Time{})
}

// DisableAt is [Disable] judging heartbeats at now (zero now means the
// database's clock, which is what operators want; tests inject a clock).
func DisableAt(ctx context.Context, db *sql.DB, by string, now time.Time) error {
	return inTx(ctx, db, func(tx *sql.Tx) error { return DisableTx(ctx, tx, by, now) })
}

// DisableTx is [DisableAt] inside the caller's transaction (package cdcrelay's
// handover switches in the transaction that holds inserts).
func DisableTx(ctx context.Context, tx *sql.Tx, by string, now time.Time) error {
	const op = "relaymode.Disable"
	if strings.TrimSpace(by) == "" {
		return outbox.Errorf(CodeOperatorRequired, op, "say who switches the relay mode (by must not be empty)")
	}
	mode, err := lockMode(ctx, tx, op)
	if err != nil || mode == ModePolling {
		return err
	}
	live, err := liveHeartbeats(ctx, tx, now, ModeCDC)
	if err != nil {
		return err
	}
	if len(live) > 0 {
		names := make([]string, len(live))
		for i, h := range live {
			names[i] = fmt.Sprintf("%s on slot %s (until %s)", h.Owner, h.SlotName, h.ExpiresAt.UTC().Format(time.RFC3339))
		}
		return outbox.Errorf(CodeRelayModeConflict, op, "%d CDC consumer(s) are live: %s; stop them (or wait for their heartbeats to expire) before switching to POLLING, or the forwarders would publish what they are publishing", len(live), strings.Join(names, ", "))
	}
	return setMode(ctx, tx, ModePolling, by, now)
}

func setMode(ctx context.Context, tx *sql.Tx, m Mode, by string, now time.Time) error {
	if _, err := tx.ExecContext(ctx, sqlSetMode, string(m), nullTime(now), by); err != nil {
		return fmt.Errorf("relaymode: set relay mode %s: %w", m, err)
	}
	return nil
}
