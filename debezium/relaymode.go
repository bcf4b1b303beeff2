package debezium

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
// the database records: a forwarder starting while the mode is CDC, or a
// switch to CDC while polling relays are alive.
const CodeRelayModeConflict outbox.Code = "RELAY_MODE_CONFLICT"

// ErrRelayModeConflict matches any relay-mode refusal with errors.Is.
var ErrRelayModeConflict = &outbox.Error{Code: CodeRelayModeConflict}

// CurrentMode reads the recorded relay mode.
func CurrentMode(ctx context.Context, db *sql.DB) (Mode, error) {
	var m string
	err := db.QueryRowContext(ctx, `SELECT mode FROM messaging_relay_mode WHERE id`).Scan(&m)
	if errors.Is(err, sql.ErrNoRows) {
		return ModePolling, nil
	}
	if err != nil {
		return "", fmt.Errorf("debezium: read relay mode: %w", err)
	}
	return Mode(m), nil
}

// Beat records that the polling relay owner is alive until now+ttl, after
// checking, in the same statement, that the database is in polling mode. It
// returns RELAY_MODE_CONFLICT when the mode is CDC. The forwarder calls it at
// start and on every heartbeat. The FOR SHARE lock on the mode row orders a
// heartbeat against a concurrent switch to CDC (which locks the row FOR
// UPDATE before it counts live heartbeats): one of them sees the other.
func Beat(ctx context.Context, db *sql.DB, owner string, ttl time.Duration) error {
	res, err := db.ExecContext(ctx, `
INSERT INTO messaging_relay_heartbeat (owner, started_at, heartbeat_at, expires_at)
SELECT $1, now(), now(), now() + make_interval(secs => $2)
WHERE EXISTS (SELECT 1 FROM messaging_relay_mode WHERE id AND mode = 'POLLING' FOR SHARE)
ON CONFLICT (owner) DO UPDATE
   SET heartbeat_at = now(), expires_at = EXCLUDED.expires_at`, owner, ttl.Seconds())
	if err != nil {
		return fmt.Errorf("debezium: relay heartbeat: %w", err)
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return outbox.Errorf(CodeRelayModeConflict, "debezium.Beat", "the database's relay mode is CDC; a polling forwarder must not run (switch back with `outboxctl debezium disable`)")
	}
	return nil
}

// Leave removes owner's heartbeat (a clean stop).
func Leave(ctx context.Context, db *sql.DB, owner string) error {
	_, err := db.ExecContext(ctx, `DELETE FROM messaging_relay_heartbeat WHERE owner = $1`, owner)
	if err != nil {
		return fmt.Errorf("debezium: relay leave: %w", err)
	}
	return nil
}
