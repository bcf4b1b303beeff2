package relaymode

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"regexp"
	"slices"
	"strings"
	"time"

	outbox "github.com/fencedoutbox/watermill-outbox"
)

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
	for try := 1; ; try++ {
		res, err := db.ExecContext(ctx, sqlBeat, owner, ttl.Seconds(), maxAttempts, fence)
		if err != nil {
			return fmt.Errorf("relaymode: relay heartbeat: %w", err)
		}
		if n, _ := res.RowsAffected(); n > 0 {
			return nil
		}
		// Refused. Why is read afterwards, from what the database holds
		// now: a conflict ends the relay, so it is reported only when the
		// mode is CDC or a CDC consumer's heartbeat is live. A refusal
		// whose cause is gone (the mode row was missing and has been
		// restored since, as an operator does) is a beat to try again.
		if err := beatRefusal(ctx, db, op, owner); err != nil {
			return err
		}
		if try == 2 {
			return errors.New("relaymode: relay heartbeat refused twice, each time with the mode reading POLLING and no CDC heartbeat live just after: the mode row is changing; the next beat tries again")
		}
	}
}

// beatRefusal says why a polling relay's beat was refused, from what the
// database records now: RELAY_MODE_MISSING without the mode row,
// RELAY_MODE_CONFLICT when the mode is CDC or another owner's CDC heartbeat
// is live, nil when neither holds any more.
func beatRefusal(ctx context.Context, db *sql.DB, op, owner string) error {
	mode, err := ReadMode(ctx, db)
	if errors.Is(err, ErrRelayModeMissing) {
		return modeMissing(op)
	}
	if err != nil {
		return err
	}
	cdc, err := liveHeartbeats(ctx, db, time.Time{}, ModeCDC)
	if err != nil {
		return err
	}
	cdcLive := slices.ContainsFunc(cdc, func(h Heartbeat) bool { return h.Owner != owner })
	if mode.Mode == ModeCDC || cdcLive {
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

// slotName is PostgreSQL's replication slot name rule (debezium.IsIdentifier
// checks the same; this package does not import debezium).
var slotName = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

func isSlotName(s string) bool { return slotName.MatchString(s) }
