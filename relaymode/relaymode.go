package relaymode

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"regexp"
	"strings"
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

// Beat records that the polling relay owner is alive until now+ttl, after
// checking, in the same statement, that the database is in polling mode. It
// returns RELAY_MODE_CONFLICT when the mode is CDC. The forwarder calls it at
// start and on every heartbeat. The FOR SHARE lock on the mode row orders a
// heartbeat against a concurrent switch to CDC (which locks the row FOR
// UPDATE before it counts live heartbeats): one of them sees the other. A
// Beat that waits on a switch in progress is re-checked against the mode the
// switch committed, and refuses if it is CDC.
//
// It also refuses (RELAY_MODE_CONFLICT) while a CDC consumer's heartbeat is
// live (see [BeatCDC] and [HeartbeatActionQuery]): a connector streaming in
// POLLING mode would deliver every row a second time. Without the mode row it
// refuses with RELAY_MODE_MISSING, and a ttl of zero or less or an empty
// (or blank) owner with OUTBOX_INVALID_CONFIG (before touching the
// database): a heartbeat that has already expired announces nothing, and
// one without an owner names no relay. BeatBudget also refuses a
// maxAttempts outside 0 to 2147483647 (the column is an integer).
func Beat(ctx context.Context, db *sql.DB, owner string, ttl time.Duration) error {
	return BeatBudget(ctx, db, owner, ttl, 0)
}

// BeatBudget is Beat that also records the relay's attempt budget
// (forwarder.Config.MaxAttempts; 0 records none), so `outboxctl status` can
// show the live relays' budgets and warn when they differ: the budget is
// each relay's configuration, not the row's.
func BeatBudget(ctx context.Context, db *sql.DB, owner string, ttl time.Duration, maxAttempts int) error {
	return BeatFence(ctx, db, owner, ttl, maxAttempts, "")
}

// BeatFence is [BeatBudget] for a relay that names its fence scheme in its
// heartbeat from the first beat on ("LANES"; "" for the per-row scheme),
// so that relays starting together see each other's scheme
// (fencing.EnterFence).
func BeatFence(ctx context.Context, db *sql.DB, owner string, ttl time.Duration, maxAttempts int, fence string) error {
	const op = "relaymode.Beat"
	switch {
	case ttl <= 0:
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "ttl is %s; a heartbeat needs a positive lifetime", ttl)
	case strings.TrimSpace(owner) == "":
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "owner must not be empty: it names the relay in the heartbeat table")
	case maxAttempts < 0 || maxAttempts > math.MaxInt32:
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "maxAttempts must be between 0 (none recorded) and %d, got %d", math.MaxInt32, maxAttempts)
	}
	res, err := db.ExecContext(ctx, sqlBeat, owner, ttl.Seconds(), maxAttempts, fence)
	if err != nil {
		return fmt.Errorf("relaymode: relay heartbeat: %w", err)
	}
	if n, _ := res.RowsAffected(); n == 0 {
		// Refused; a missing mode row refuses too, and is named as such.
		if _, err := ReadMode(ctx, db); errors.Is(err, ErrRelayModeMissing) {
			return modeMissing(op)
		}
		return outbox.Errorf(CodeRelayModeConflict, op, "the database's relay mode is CDC, or a CDC consumer's heartbeat is live; a polling forwarder must not run (stop the CDC consumer, then switch back with `outboxctl debezium disable`)")
	}
	return nil
}

// CodeSecondCDCConsumer is returned by [BeatCDC] when another CDC consumer,
// on another replication slot, has a live heartbeat: each slot delivers every
// insert, so two consumers on two slots deliver everything twice.
const CodeSecondCDCConsumer outbox.Code = "CDC_SECOND_CONSUMER"

// ErrSecondCDCConsumer matches [CodeSecondCDCConsumer] with errors.Is.
var ErrSecondCDCConsumer = &outbox.Error{Code: CodeSecondCDCConsumer}

// BeatCDC records that the CDC consumer owner, streaming from slot, is alive
// until now+ttl. In one transaction it locks the mode row FOR UPDATE, refuses
// with RELAY_MODE_CONFLICT unless the mode is CDC, refuses with
// CDC_SECOND_CONSUMER while a CDC consumer on another slot has a live
// heartbeat (naming it), and writes the heartbeat. Because [Disable] takes
// the same lock and refuses while a CDC heartbeat is live, a CDC consumer
// that beats successfully may publish until its heartbeat expires: the mode
// cannot leave CDC before then. The native relay (package cdcrelay) calls it
// at start and before any publish once a beat interval has passed; a
// Debezium connector beats through [HeartbeatActionQuery] instead (which
// cannot refuse, so a second connector is reported, not refused).
//
// Before touching the database it refuses with OUTBOX_INVALID_CONFIG an
// empty (or blank) owner, a slot that is not a replication slot name
// (^[a-z_][a-z0-9_]{0,62}$) and a ttl of zero or less. Without the mode row
// it refuses with RELAY_MODE_MISSING.
func BeatCDC(ctx context.Context, db *sql.DB, owner, slot string, ttl time.Duration) error {
	const op = "relaymode.BeatCDC"
	if strings.TrimSpace(owner) == "" || !isSlotName(slot) {
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "owner must not be empty and slot %q must match ^[a-z_][a-z0-9_]{0,62}$", slot)
	}
	if ttl <= 0 {
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "ttl is %s; a heartbeat needs a positive lifetime", ttl)
	}
	return inTx(ctx, db, func(tx *sql.Tx) error {
		mode, err := lockMode(ctx, tx, op)
		if err != nil {
			return err
		}
		if mode != ModeCDC {
			return outbox.Errorf(CodeRelayModeConflict, op, "the database's relay mode is %s, not CDC: a CDC consumer must not publish (switch with `outboxctl debezium enable` once the polling relays are stopped)", mode)
		}
		live, err := liveHeartbeats(ctx, tx, time.Time{}, ModeCDC)
		if err != nil {
			return err
		}
		var others []string
		for _, h := range live {
			if h.Owner != owner && h.SlotName != slot {
				others = append(others, fmt.Sprintf("%s on slot %s (until %s)", h.Owner, h.SlotName, h.ExpiresAt.UTC().Format(time.RFC3339)))
			}
		}
		if len(others) > 0 {
			return outbox.Errorf(CodeSecondCDCConsumer, op, "another CDC consumer is live: %s; slot %s would deliver every insert a second time (stop the other consumer, or use the same slot: PostgreSQL lets one consumer stream a slot at a time)", strings.Join(others, ", "), slot)
		}
		if _, err := tx.ExecContext(ctx, sqlBeatCDC, owner, ttl.Seconds(), slot); err != nil {
			return fmt.Errorf("relaymode: CDC heartbeat: %w", err)
		}
		return nil
	})
}

// Leave removes owner's heartbeat (a clean stop).
func Leave(ctx context.Context, db *sql.DB, owner string) error {
	_, err := db.ExecContext(ctx, sqlLeave, owner)
	if err != nil {
		return fmt.Errorf("relaymode: relay leave: %w", err)
	}
	return nil
}

// Heartbeat is one relay's announcement.
type Heartbeat struct {
	Owner       string
	StartedAt   time.Time
	HeartbeatAt time.Time
	ExpiresAt   time.Time
	Kind        Mode   // ModePolling or ModeCDC
	SlotName    string // the replication slot of a CDC consumer; "" for polling relays
	MaxAttempts int    // the polling relay's attempt budget (BeatBudget); 0 when it did not say
}

// LiveRelays lists the polling relays whose heartbeat has not expired at now
// (zero now means the database's clock), ordered by owner.
func LiveRelays(ctx context.Context, q Querier, now time.Time) ([]Heartbeat, error) {
	return liveHeartbeats(ctx, q, now, ModePolling)
}

// LiveCDCConsumers lists the CDC consumers (native relays and Debezium
// connectors through their heartbeat action query) whose heartbeat has not
// expired at now (zero now means the database's clock), ordered by owner.
// More than one distinct SlotName among them means two consumers deliver
// every insert: `outboxctl status` reports it.
func LiveCDCConsumers(ctx context.Context, q Querier, now time.Time) ([]Heartbeat, error) {
	return liveHeartbeats(ctx, q, now, ModeCDC)
}

func liveHeartbeats(ctx context.Context, q Querier, now time.Time, kind Mode) ([]Heartbeat, error) {
	rows, err := q.QueryContext(ctx, sqlLiveHeartbeats, nullTime(now), string(kind))
	if err != nil {
		return nil, fmt.Errorf("relaymode: read heartbeats: %w", err)
	}
	defer rows.Close()
	var out []Heartbeat
	for rows.Next() {
		var h Heartbeat
		var k string
		if err := rows.Scan(&h.Owner, &h.StartedAt, &h.HeartbeatAt, &h.ExpiresAt, &k, &h.SlotName, &h.MaxAttempts); err != nil {
			return nil, fmt.Errorf("relaymode: read heartbeats: %w", err)
		}
		h.Kind = Mode(k)
		out = append(out, h)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("relaymode: read heartbeats: %w", err)
	}
	return out, nil
}

func nullTime(t time.Time) any {
	if t.IsZero() {
		return nil
	}
	return t.UTC()
}

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

func setMode(ctx context.Context, tx *sql.Tx, m Mode, by string, now time.Time) error {
	if _, err := tx.ExecContext(ctx, sqlSetMode, string(m), nullTime(now), by); err != nil {
		return fmt.Errorf("relaymode: set relay mode %s: %w", m, err)
	}
	return nil
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

// slotName is PostgreSQL's replication slot name rule (debezium.IsIdentifier
// checks the same; this package does not import debezium).
var slotName = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

func isSlotName(s string) bool { return slotName.MatchString(s) }
