package relaymode

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	outbox "github.com/fencedoutbox/watermill-outbox"
)

// Mode is the relay mode recorded in messaging_relay_mode.
type Mode string

// The two relay modes. Exactly one is active for a database.
const (
	ModePolling Mode = "POLLING" // the forwarder polls the table
	ModeCDC     Mode = "CDC"     // a CDC connector streams inserts from the WAL
)

// CodeRelayModeConflict is returned when a relay would run against the mode
// the database records: a forwarder starting while the mode is CDC or a CDC
// consumer is live (Beat), a CDC consumer beating outside CDC mode (BeatCDC),
// a switch to CDC while polling relays are alive (Enable), or a switch back
// to POLLING while a CDC consumer is alive (Disable).
const CodeRelayModeConflict outbox.Code = "RELAY_MODE_CONFLICT"

// CodeOperatorRequired is returned by Enable and Disable when by is empty:
// every mode switch records who made it.
const CodeOperatorRequired outbox.Code = "RELAY_MODE_OPERATOR_REQUIRED"

// CodeRelayModeMissing is returned when messaging_relay_mode has no row: the
// migration inserts it and nothing in this module deletes it, so its absence
// is a damaged schema, not a mode. [ReadMode], [CurrentMode], [RequireMode],
// [Beat], [BeatBudget], [BeatCDC], [Enable] and [Disable] (and their Tx
// forms) all refuse with it, so no relay of either kind runs and no switch
// is made until the row is restored; the detail gives the migration's
// INSERT that restores the row as POLLING:
//
//	INSERT INTO messaging_relay_mode (id, mode) VALUES (true, 'POLLING');
//
// Run it with every relay stopped, then [Enable] if a CDC consumer is to
// publish.
//
// Treating a missing row as POLLING instead would not be safe: a Beat would
// then lock no row, and a switch could not order itself against it.
const CodeRelayModeMissing outbox.Code = "RELAY_MODE_MISSING"

// restoreModeSQL is the INSERT of migration 00004 (a test holds them equal).
const restoreModeSQL = `INSERT INTO messaging_relay_mode (id, mode) VALUES (true, 'POLLING');`

// Sentinels for errors.Is.
var (
	ErrRelayModeConflict = &outbox.Error{Code: CodeRelayModeConflict}
	ErrOperatorRequired  = &outbox.Error{Code: CodeOperatorRequired}
	ErrRelayModeMissing  = &outbox.Error{Code: CodeRelayModeMissing}
)

// modeMissing is the RELAY_MODE_MISSING refusal of op.
func modeMissing(op string) error {
	return outbox.Errorf(CodeRelayModeMissing, op, "messaging_relay_mode has no row, so neither relay mode is recorded: the schema is damaged (the migration inserts the row, and nothing in this module deletes it); with every relay stopped, restore it with `%s`, then switch to CDC with `outboxctl debezium enable` if a CDC consumer is to publish", restoreModeSQL)
}

// SQL of the relay-mode protocol. The mode row is the single point both
// sides lock: Beat takes it FOR SHARE inside its INSERT, a switch takes it
// FOR UPDATE before it counts heartbeats, so a heartbeat and a switch to CDC
// are ordered by the row lock and one always sees the other.
const (
	sqlCurrentMode = `SELECT mode, changed_at, changed_by FROM messaging_relay_mode WHERE id`

	// A polling heartbeat is written only in POLLING mode and only while no
	// CDC consumer's heartbeat is live (a Debezium connector started in
	// POLLING mode registers itself through its heartbeat action query).
	sqlBeat = `
INSERT INTO messaging_relay_heartbeat (owner, started_at, heartbeat_at, expires_at, max_attempts, fence)
SELECT $1, now(), now(), now() + make_interval(secs => $2), nullif($3::integer, 0), nullif($4::text, '')
WHERE EXISTS (SELECT 1 FROM messaging_relay_mode WHERE id AND mode = 'POLLING' FOR SHARE)
  AND NOT EXISTS (SELECT 1 FROM messaging_relay_heartbeat
                   WHERE kind = 'CDC' AND expires_at > now() AND owner <> $1)
ON CONFLICT (owner) DO UPDATE
   SET heartbeat_at = now(), expires_at = EXCLUDED.expires_at, kind = 'POLLING', slot_name = NULL,
       max_attempts = EXCLUDED.max_attempts, fence = EXCLUDED.fence`

	sqlLeave = `DELETE FROM messaging_relay_heartbeat WHERE owner = $1`

	sqlLockMode = `SELECT mode FROM messaging_relay_mode WHERE id FOR UPDATE`

	// Runs after sqlLockMode in the same transaction; under READ COMMITTED
	// it takes a fresh snapshot, so it sees every heartbeat committed before
	// the lock was granted.
	sqlLiveHeartbeats = `
SELECT owner, started_at, heartbeat_at, expires_at, kind, coalesce(slot_name, ''), coalesce(max_attempts, 0) FROM messaging_relay_heartbeat
WHERE expires_at > coalesce($1::timestamptz, now()) AND kind = $2
ORDER BY owner`

	// Runs after sqlLockMode (FOR UPDATE) in BeatCDC's transaction, so two
	// CDC consumers' first beats are ordered and the second sees the first.
	sqlBeatCDC = `
INSERT INTO messaging_relay_heartbeat (owner, started_at, heartbeat_at, expires_at, kind, slot_name)
VALUES ($1, now(), now(), now() + make_interval(secs => $2), 'CDC', $3)
ON CONFLICT (owner) DO UPDATE
   SET heartbeat_at = now(), expires_at = EXCLUDED.expires_at, kind = 'CDC', slot_name = EXCLUDED.slot_name`

	sqlSetMode = `
UPDATE messaging_relay_mode
   SET mode = $1, changed_at = coalesce($2::timestamptz, now()), changed_by = $3
 WHERE id`
)

// Querier is what the read-only functions here need: a *sql.DB, or a
// *sql.Tx when the reading belongs to a larger snapshot (the status
// package reads the mode and the relays in its own transaction).
type Querier interface {
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// ModeRecord is the recorded relay mode and who switched it when.
type ModeRecord struct {
	Mode      Mode
	ChangedAt time.Time
	ChangedBy string
}

// ReadMode reads the recorded relay mode. The migration inserts the row
// (changed_by "migration"); a missing row is a damaged schema, not a mode,
// and is refused with RELAY_MODE_MISSING ([CodeRelayModeMissing]), as every
// function of this package that reads the mode refuses it.
func ReadMode(ctx context.Context, q Querier) (ModeRecord, error) {
	var r ModeRecord
	err := q.QueryRowContext(ctx, sqlCurrentMode).Scan(&r.Mode, &r.ChangedAt, &r.ChangedBy)
	if errors.Is(err, sql.ErrNoRows) {
		return ModeRecord{}, modeMissing("relaymode.ReadMode")
	}
	if err != nil {
		return ModeRecord{}, fmt.Errorf("relaymode: read relay mode: %w", err)
	}
	return r, nil
}

// CurrentMode reads the recorded relay mode (RELAY_MODE_MISSING without the
// row, as [ReadMode]).
func CurrentMode(ctx context.Context, q Querier) (Mode, error) {
	r, err := ReadMode(ctx, q)
	return r.Mode, err
}

// RequireMode returns RELAY_MODE_CONFLICT (from op, with hint saying what to
// do) unless the database records want: the one start-up gate every relay
// and the age-based cleaner use. Without the mode row it returns
// RELAY_MODE_MISSING.
func RequireMode(ctx context.Context, db *sql.DB, want Mode, op, hint string) error {
	mode, err := CurrentMode(ctx, db)
	if err != nil {
		return err
	}
	if mode != want {
		return outbox.Errorf(CodeRelayModeConflict, op, "the database's relay mode is %s, not %s: %s", mode, want, hint)
	}
	return nil
}

func lockMode(ctx context.Context, tx *sql.Tx, op string) (Mode, error) {
	var m string
	err := tx.QueryRowContext(ctx, sqlLockMode).Scan(&m)
	if errors.Is(err, sql.ErrNoRows) {
		// The migration inserts the row; its absence is a broken schema,
		// not a mode.
		return "", modeMissing(op)
	}
	if err != nil {
		return "", fmt.Errorf("relaymode: lock relay mode: %w", err)
	}
	return Mode(m), nil
}

func inTx(ctx context.Context, db *sql.DB, fn func(*sql.Tx) error) error {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("relaymode: begin: %w", err)
	}
	if err := fn(tx); err != nil {
		_ = tx.Rollback()
		return err
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("relaymode: commit: %w", err)
	}
	return nil
}

func nullTime(t time.Time) any {
	if t.IsZero() {
		return nil
	}
	return t.UTC()
}
