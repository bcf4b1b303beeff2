package cdcrelay

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pglogrepl"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

const (
	sqlWALInsert = `SELECT pg_current_wal_insert_lsn()::text`

	// WAL after the target position, so the walsender reads past it and its
	// keepalive reports a position at or beyond it even when nothing else
	// is written (a non-transactional message; pgoutput does not send it).
	sqlNudgeWAL = `SELECT pg_logical_emit_message(false, 'cdcrelay-handover', '')`

	// The rows still undelivered that were committed after the slot (seq
	// above its boundary, when one is open).
	sqlMarkDelivered = `
UPDATE messaging_outbox
   SET status = 'PUBLISHED', attempts = CASE WHEN attempts < 2147483647 THEN attempts + 1 ELSE attempts END,
       published_at = now(), last_attempt_at = now(), next_attempt_at = NULL, lease_expires_at = NULL,
       lease_owner = $1,
       lease_token = CASE WHEN lease_token < 9223372036854775807 THEN lease_token + 1 ELSE lease_token END
 WHERE published_at IS NULL AND parked_at IS NULL AND ($2::int8 IS NULL OR seq > $2)`
)

// HandOverToPolling switches the database from CDC back to POLLING after a
// consumer that does not mark rows PUBLISHED (a Debezium connector) was
// stopped, so that the forwarders publish nothing it delivered and miss
// nothing it did not. The consumer must be stopped: it refuses with
// RELAY_MODE_CONFLICT while any CDC heartbeat is live (a connector's lives
// three heartbeat intervals after it stops). The slot (Config.SlotName, the
// connector's) must have been created by [Relay.Prepare] or Run, whose
// recorded boundary says which undelivered rows are older than the slot:
// without one it refuses with CDC_UNDELIVERED_ROWS, since it could not tell
// them from rows the connector delivered.
//
// It streams the slot from the connector's confirmed position and delivers
// (publishes and marks) what the connector had not confirmed. Then, in one
// transaction that holds inserts into messaging_outbox (LOCK TABLE ... IN
// SHARE MODE, which waits for the inserts in progress), it reads the WAL
// position W, delivers the rest of the slot up to W (marking in that
// transaction), marks PUBLISHED every other undelivered row committed after
// the slot (the connector delivered them: they are before its confirmed
// position), checks again that no CDC heartbeat is live and records POLLING.
// Inserts wait only for that last part. A publish the downstream refuses
// aborts the handover with nothing switched (the transaction rolls back).
func (r *Relay) HandOverToPolling(ctx context.Context, by string) error {
	const op = "cdcrelay.HandOverToPolling"
	if strings.TrimSpace(by) == "" {
		return outbox.Errorf(relaymode.CodeOperatorRequired, op, "say who switches the relay mode (by must not be empty)")
	}
	// Run refuses while the handover is active, but Close neither cancels
	// nor waits for it: it ends when ctx does.
	release, err := r.runs.Hold()
	if err != nil {
		return outbox.Errorf(CodeAlreadyRunning, op, "the relay is running or closed; use a relay of its own for the handover")
	}
	defer release()

	if !r.waitBehind(ctx) {
		return ctx.Err()
	}
	if err := relaymode.RequireMode(ctx, r.cfg.DB, relaymode.ModeCDC, op, "nothing to hand over"); err != nil {
		return err
	}
	if err := r.checkSchema(ctx); err != nil {
		return err
	}
	if err := requireNoCDCConsumer(ctx, r.cfg.DB, op, ""); err != nil {
		return err
	}
	var before sql.NullInt64
	err = r.cfg.DB.QueryRowContext(ctx, sqlSlotBoundary, r.cfg.SlotName).Scan(&before)
	if errors.Is(err, sql.ErrNoRows) {
		return outbox.Errorf(CodeUndeliveredRows, op, "slot %s has no recorded boundary (it was not created by cdcrelay's Prepare or Run): the undelivered rows older than it cannot be told from rows the consumer delivered; switch with `outboxctl debezium disable` and accept that the forwarders publish the consumer's rows again", r.cfg.SlotName)
	}
	if err != nil {
		return fmt.Errorf("cdcrelay: read slot boundary of %s: %w", r.cfg.SlotName, err)
	}
	if err := r.beat(ctx); err != nil {
		return err
	}
	defer r.leave(ctx)

	// Phase 1, inserts flowing: what the consumer left unconfirmed up to now.
	var w0 string
	if err := r.cfg.DB.QueryRowContext(ctx, sqlWALInsert).Scan(&w0); err != nil {
		return fmt.Errorf("cdcrelay: read WAL position: %w", err)
	}
	if err := r.drainTo(ctx, r.cfg.DB, w0); err != nil {
		return err
	}

	// The first session's walsender exits before inserts are held: waiting
	// for it (ensureSlot) must not happen under the lock.
	if _, err := r.ensureSlot(ctx, false, false); err != nil {
		return err
	}

	// Phase 2, inserts held: the rest, then the switch.
	tx, err := r.cfg.DB.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("cdcrelay: begin handover: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	held := time.Now()
	if _, err := tx.ExecContext(ctx, `LOCK TABLE messaging_outbox IN SHARE MODE`); err != nil {
		return fmt.Errorf("cdcrelay: hold inserts: %w", err)
	}
	var w string
	if err := tx.QueryRowContext(ctx, sqlWALInsert).Scan(&w); err != nil {
		return fmt.Errorf("cdcrelay: read WAL position: %w", err)
	}
	if err := r.drainTo(ctx, tx, w); err != nil {
		return err
	}
	res, err := tx.ExecContext(ctx, sqlMarkDelivered, "cdc-handover:"+r.cfg.SlotName, before)
	if err != nil {
		return fmt.Errorf("cdcrelay: mark the consumer's rows PUBLISHED: %w", err)
	}
	marked, _ := res.RowsAffected()
	if _, err := tx.ExecContext(ctx, `DELETE FROM messaging_relay_heartbeat WHERE owner = $1`, r.cfg.Owner); err != nil {
		return fmt.Errorf("cdcrelay: remove the handover's heartbeat: %w", err)
	}
	if err := relaymode.DisableTx(ctx, tx, by, time.Time{}); err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("cdcrelay: commit handover: %w", err)
	}
	r.logger.Info("CDC relay handed over to polling", watermill.LogFields{"slot": r.cfg.SlotName, "wal_position": w, "marked_published": marked, "inserts_held": time.Since(held).String()})
	return nil
}

func requireNoCDCConsumer(ctx context.Context, q relaymode.Querier, op, except string) error {
	live, err := relaymode.LiveCDCConsumers(ctx, q, time.Time{})
	if err != nil {
		return err
	}
	var names []string
	for _, h := range live {
		if h.Owner != except {
			names = append(names, fmt.Sprintf("%s on slot %s (until %s)", h.Owner, h.SlotName, h.ExpiresAt.UTC().Format(time.RFC3339)))
		}
	}
	if len(names) > 0 {
		return outbox.Errorf(relaymode.CodeRelayModeConflict, op, "CDC consumer(s) are live: %s; stop them (or wait for their heartbeats to expire) first", strings.Join(names, ", "))
	}
	return nil
}

// drainTo streams the slot until every transaction before target is
// delivered, marked through db and confirmed. A refused publish aborts.
func (r *Relay) drainTo(ctx context.Context, db querier, target string) error {
	stopAt, err := pglogrepl.ParseLSN(target)
	if err != nil {
		return fmt.Errorf("cdcrelay: parse WAL position %q: %w", target, err)
	}
	start, err := r.ensureSlot(ctx, false, false)
	if err != nil {
		return err
	}
	if start >= stopAt {
		return nil
	}
	if _, err := r.cfg.DB.ExecContext(ctx, sqlNudgeWAL); err != nil {
		return fmt.Errorf("cdcrelay: write WAL past the target: %w", err)
	}
	err = r.session(ctx, start, db, stopAt)
	switch {
	case errors.Is(err, errDrained):
		return nil
	case errors.Is(err, errRetry):
		r.failing = failure{}
		return outbox.Errorf(CodePublishFailed, "cdcrelay.HandOverToPolling", "the downstream refused a message during the handover; nothing was switched, try again once it accepts messages")
	case err == nil:
		return ctx.Err()
	default:
		return err
	}
}
