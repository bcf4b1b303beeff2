package cdcrelay

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"regexp"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/lib/pq/pqerror"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/debezium"
	"github.com/fencedoutbox/watermill-outbox/internal/pgerr"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

// Catalog SQL, run through Config.DB (the replication connection speaks only
// the simple query protocol, which cannot bind parameters).
const (
	sqlCurrentSchema = `SELECT current_schema()`

	sqlPublication = `
SELECT p.pubinsert,
       p.pubupdate OR p.pubdelete OR p.pubtruncate,
       EXISTS (SELECT 1 FROM pg_publication_tables t
                WHERE t.pubname = p.pubname AND t.schemaname = $2 AND t.tablename = $3)
  FROM pg_publication p
 WHERE p.pubname = $1`

	sqlSlot = `
SELECT coalesce(plugin, ''), slot_type, coalesce(database = current_database(), false),
       active, coalesce(confirmed_flush_lsn::text, ''), coalesce(wal_status, '')
  FROM pg_replication_slots
 WHERE slot_name = $1`

	// Read in the slot's exported snapshot: exactly the rows committed
	// before the slot's consistent point. Undelivered ones among them are
	// not in the slot.
	sqlOlderUndelivered = `
SELECT count(*), max(seq) FROM messaging_outbox
 WHERE published_at IS NULL AND parked_at IS NULL`

	sqlRecordSlot = `
INSERT INTO messaging_cdc_slot (slot_name, consistent_lsn, before_seq, created_mode)
VALUES ($1, $2::pg_lsn, $3, $4)
ON CONFLICT (slot_name) DO UPDATE
   SET consistent_lsn = EXCLUDED.consistent_lsn, before_seq = EXCLUDED.before_seq,
       created_at = now(), created_mode = EXCLUDED.created_mode`

	sqlSlotBoundary = `SELECT before_seq FROM messaging_cdc_slot WHERE slot_name = $1`

	sqlUndeliveredBefore = `
SELECT count(*) FROM messaging_outbox
 WHERE published_at IS NULL AND parked_at IS NULL AND seq <= $1`

	sqlCloseBoundary = `UPDATE messaging_cdc_slot SET before_seq = NULL WHERE slot_name = $1 AND before_seq = $2`

	sqlDropSlot = `SELECT pg_drop_replication_slot($1)`

	sqlSlotLag = `
SELECT coalesce(wal_status, ''),
       coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn), 0)::int8,
       coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn), 0)::int8,
       safe_wal_size
  FROM pg_replication_slots WHERE slot_name = $1`
)

// slotLost builds CDC_SLOT_LOST from START_REPLICATION's error (PostgreSQL's
// message and DETAIL) and the slot's wal_status.
func (r *Relay) slotLost(ctx context.Context, cause error) error {
	var walStatus string
	_ = r.cfg.DB.QueryRowContext(ctx, `SELECT coalesce(wal_status, '') FROM pg_replication_slots WHERE slot_name = $1`, r.cfg.SlotName).Scan(&walStatus)
	detail := cause.Error()
	var pgErr *pgconn.PgError
	if errors.As(cause, &pgErr) {
		detail = pgErr.Message
		if pgErr.Detail != "" {
			detail += " (" + pgErr.Detail + ")"
		}
	}
	return outbox.Wrap(CodeSlotLost, "cdcrelay.Run", cause, fmt.Sprintf(
		"slot %s cannot be streamed (wal_status %q): %s; the WAL it needed is gone and the rows in it were never streamed: do not just drop and recreate the slot, follow \"A lost slot\" in docs/CDC.md",
		r.cfg.SlotName, walStatus, detail))
}

// Prepare creates the publication and the replication slot when they are
// missing, whatever the relay mode and the Create flags: call it while the
// polling forwarders still run, so that the slot holds every insert from then
// on (see "When to create the slot" in the package documentation). It records
// the slot's boundary (messaging_cdc_slot): Run refuses with
// CDC_UNDELIVERED_ROWS while rows committed before the slot are undelivered,
// which the running forwarders are delivering. It does not stream, and
// refuses CDC_SLOT_IN_USE for a slot of another kind or database.
func (r *Relay) Prepare(ctx context.Context) error {
	if err := r.checkSchema(ctx); err != nil {
		return err
	}
	if err := r.ensurePublication(ctx, true); err != nil {
		return err
	}
	// A slot a running relay is streaming is prepared, not in the way.
	_, err := r.ensureSlot(ctx, true, true)
	return err
}

// UndeliveredBeforeSlot counts the rows committed before slot was created
// (by Prepare or Run) that are still undelivered, by the boundary recorded
// then; known is false when the relay did not create the slot (no boundary
// is recorded, e.g. a connector created it). Run refuses with
// CDC_UNDELIVERED_ROWS while the count is above zero: during a switch to CDC,
// wait for it to reach zero before stopping the forwarders. db's search_path
// must resolve the outbox's schema.
func UndeliveredBeforeSlot(ctx context.Context, db *sql.DB, slot string) (n int64, known bool, err error) {
	n, _, known, err = undeliveredBefore(ctx, db, slot)
	return n, known, err
}

// undeliveredBefore reads the boundary recorded for slot (before_seq) and
// counts the undelivered rows at or below it. found is false when no
// boundary is recorded; before is NULL once the boundary was closed (n is 0).
func undeliveredBefore(ctx context.Context, db querier, slot string) (n int64, before sql.NullInt64, found bool, err error) {
	err = db.QueryRowContext(ctx, sqlSlotBoundary, slot).Scan(&before)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, before, false, nil
	}
	if err != nil {
		return 0, before, false, fmt.Errorf("cdcrelay: read slot boundary of %s: %w", slot, err)
	}
	if !before.Valid {
		return 0, before, true, nil
	}
	if err := db.QueryRowContext(ctx, sqlUndeliveredBefore, before.Int64).Scan(&n); err != nil {
		return 0, before, true, fmt.Errorf("cdcrelay: count rows older than slot %s: %w", slot, err)
	}
	return n, before, true, nil
}

// checkBoundary refuses while rows older than the slot are undelivered, and
// closes the boundary once none is (later rows get higher seqs: the check
// cannot fail again).
func (r *Relay) checkBoundary(ctx context.Context) error {
	n, before, found, err := undeliveredBefore(ctx, r.cfg.DB, r.cfg.SlotName)
	if err != nil {
		return err
	}
	if !found {
		r.logger.Info("CDC relay did not create this slot: rows committed before it cannot be checked (see the package documentation)", watermill.LogFields{"slot": r.cfg.SlotName})
		return nil
	}
	if !before.Valid {
		return nil
	}
	if n > 0 {
		return outbox.Errorf(CodeUndeliveredRows, "cdcrelay.Run", "%d undelivered row(s) with seq <= %d were committed before slot %s was created: they are not in the slot and streaming would never deliver them; switch back to POLLING (`outboxctl debezium disable`), let the forwarders deliver them, then switch again (docs/CDC.md: Handover and slots)", n, before.Int64, r.cfg.SlotName)
	}
	if _, err := r.cfg.DB.ExecContext(ctx, sqlCloseBoundary, r.cfg.SlotName, before.Int64); err != nil {
		return fmt.Errorf("cdcrelay: close slot boundary of %s: %w", r.cfg.SlotName, err)
	}
	return nil
}

// checkLag reads the slot's retained WAL and wal_status and logs a warning
// past LagWarnBytes or when the slot is "unreserved" (next checkpoint may
// invalidate it), at most every LagWarnEvery.
func (r *Relay) checkLag(ctx context.Context) {
	if r.cfg.LagWarnBytes < 0 || time.Since(r.lastWarn) < r.cfg.LagWarnEvery {
		return
	}
	var (
		walStatus              string
		retained, confirmedLag int64
		safe                   sql.NullInt64
	)
	if err := r.cfg.DB.QueryRowContext(ctx, sqlSlotLag, r.cfg.SlotName).Scan(&walStatus, &retained, &confirmedLag, &safe); err != nil {
		return // no slot yet, or the database is unreachable: the heartbeat reports that
	}
	if retained <= r.cfg.LagWarnBytes && walStatus != "unreserved" && walStatus != "lost" {
		return
	}
	r.lastWarn = time.Now()
	fields := watermill.LogFields{"slot": r.cfg.SlotName, "wal_status": walStatus, "retained_wal_bytes": retained, "confirmed_lag_bytes": confirmedLag, "threshold_bytes": r.cfg.LagWarnBytes}
	if safe.Valid {
		fields["safe_wal_size_bytes"] = safe.Int64
	}
	r.logger.Error("CDC relay slot lag warning: the slot retains WAL past the threshold or is about to be invalidated", ErrSlotLagging, fields)
}

// ErrSlotLagging is the error value of the relay's slot lag warning log line
// (never returned).
var ErrSlotLagging = errors.New("cdcrelay: replication slot lag past threshold")

func (r *Relay) checkSchema(ctx context.Context) error {
	var cur sql.NullString
	if err := r.cfg.DB.QueryRowContext(ctx, sqlCurrentSchema).Scan(&cur); err != nil {
		return fmt.Errorf("cdcrelay: read current schema: %w", err)
	}
	if cur.String != r.cfg.Schema {
		return outbox.Errorf(outbox.CodeInvalidConfig, "cdcrelay.Run", "Config.Schema is %q but DB resolves %q first on its search_path; the relay mode would be read from the wrong schema", r.cfg.Schema, cur.String)
	}
	return nil
}

func (r *Relay) ensurePublication(ctx context.Context, create bool) error {
	const op = "cdcrelay.Run"
	for attempt := 0; ; attempt++ {
		var inserts, others, hasTable bool
		err := r.cfg.DB.QueryRowContext(ctx, sqlPublication, r.cfg.PublicationName, r.cfg.Schema, Table).Scan(&inserts, &others, &hasTable)
		switch {
		case errors.Is(err, sql.ErrNoRows):
			if !create || attempt > 0 {
				return outbox.Errorf(CodePublicationMissing, op, "publication %s does not exist; create it with debezium.PublicationSQL or set CreatePublication", r.cfg.PublicationName)
			}
			stmt, err := debezium.PublicationSQL(debezium.Options{Schema: r.cfg.Schema, PublicationName: r.cfg.PublicationName})
			if err != nil {
				return err
			}
			if _, err := r.cfg.DB.ExecContext(ctx, stmt); err != nil && !isSQLState(err, pqerror.DuplicateObject) {
				return fmt.Errorf("cdcrelay: create publication %s: %w", r.cfg.PublicationName, err)
			}
			r.logger.Info("CDC relay created publication", watermill.LogFields{"publication": r.cfg.PublicationName})
			continue // read it back: another relay may have created it differently
		case err != nil:
			return fmt.Errorf("cdcrelay: read publication %s: %w", r.cfg.PublicationName, err)
		}
		if !inserts || !hasTable {
			return outbox.Errorf(CodePublicationMissing, op, "publication %s does not publish inserts of %s.%s; recreate it with debezium.PublicationSQL", r.cfg.PublicationName, r.cfg.Schema, Table)
		}
		if others {
			// Harmless to the relay (it acts on inserts only) but costly:
			// every forwarder update would cross the wire.
			r.logger.Info("CDC relay publication also publishes updates/deletes/truncates; the relay ignores them, but an insert-only publication saves the traffic", watermill.LogFields{"publication": r.cfg.PublicationName})
		}
		return nil
	}
}

// ensureSlot returns the slot's confirmed position, creating the slot when
// it is missing and create allows.
func (r *Relay) ensureSlot(ctx context.Context, create, activeOK bool) (pglogrepl.LSN, error) {
	const op = "cdcrelay.Run"
	var (
		plugin, slotType, confirmed, walStatus string
		sameDB, active                         bool
	)
	read := func() error {
		return r.cfg.DB.QueryRowContext(ctx, sqlSlot, r.cfg.SlotName).Scan(&plugin, &slotType, &sameDB, &active, &confirmed, &walStatus)
	}
	err := read()
	// A relay restarted right after a failure finds the slot still active
	// for a moment: its old walsender has not exited yet. Wait for that,
	// briefly, before calling the slot taken.
	deadline := time.Now().Add(r.cfg.SlotBusyWait)
	for err == nil && active && !activeOK && time.Now().Before(deadline) {
		t := time.NewTimer(50 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return 0, ctx.Err()
		case <-t.C:
		}
		err = read()
	}
	if errors.Is(err, sql.ErrNoRows) {
		if !create {
			return 0, outbox.Errorf(CodeSlotMissing, op, "replication slot %s does not exist; set CreateSlot (see the package documentation for when to create it)", r.cfg.SlotName)
		}
		if err := r.createSlot(ctx); err != nil {
			return 0, err
		}
		if err = read(); err != nil {
			return 0, fmt.Errorf("cdcrelay: read slot %s: %w", r.cfg.SlotName, err)
		}
	} else if err != nil {
		return 0, fmt.Errorf("cdcrelay: read slot %s: %w", r.cfg.SlotName, err)
	}
	if slotType != "logical" || plugin != "pgoutput" || !sameDB {
		return 0, outbox.Errorf(CodeSlotInUse, op, "slot %s is a %s slot with plugin %q (same database: %t); the relay needs its own pgoutput slot in this database", r.cfg.SlotName, slotType, plugin, sameDB)
	}
	if active && !activeOK {
		return 0, outbox.Errorf(CodeSlotInUse, op, "slot %s is being streamed by another consumer; one relay per slot", r.cfg.SlotName)
	}
	if walStatus == "lost" {
		// START_REPLICATION says why, with PostgreSQL's DETAIL (session).
		r.logger.Error("CDC relay slot is lost", ErrSlotLost, watermill.LogFields{"slot": r.cfg.SlotName, "wal_status": walStatus})
	}
	if confirmed == "" {
		return 0, nil
	}
	return pglogrepl.ParseLSN(confirmed)
}

// createSlot creates the slot over a replication connection, exporting the
// snapshot of its consistent point: the rows visible in it are exactly those
// committed before the slot, i.e. not in it. It records the highest seq of
// an undelivered one among them (messaging_cdc_slot). In CDC mode nothing
// else delivers rows, so any such row would be lost: the slot is dropped
// again and Run refuses with CDC_UNDELIVERED_ROWS. In POLLING mode (Prepare
// while the forwarders run) the boundary is recorded and checked at Run.
func (r *Relay) createSlot(ctx context.Context) error {
	mode, err := relaymode.CurrentMode(ctx, r.cfg.DB)
	if err != nil {
		return err
	}
	conn, closeConn, err := r.connectReplication(ctx)
	if err != nil {
		return err
	}
	defer closeConn()
	res, err := pglogrepl.CreateReplicationSlot(ctx, conn, r.cfg.SlotName, "pgoutput", pglogrepl.CreateReplicationSlotOptions{Mode: pglogrepl.LogicalReplication, SnapshotAction: "EXPORT_SNAPSHOT"})
	if isSQLState(err, pqerror.DuplicateObject) {
		return nil // another relay created it first, with its boundary
	}
	if err != nil {
		return fmt.Errorf("cdcrelay: create slot %s: %w", r.cfg.SlotName, err)
	}
	var (
		older  int64
		before sql.NullInt64
	)
	// The snapshot is valid until the replication connection's next
	// command; read it now.
	err = func() error {
		if !snapshotName.MatchString(res.SnapshotName) {
			return fmt.Errorf("unexpected exported snapshot name %q", res.SnapshotName)
		}
		tx, err := r.cfg.DB.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead, ReadOnly: true})
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback() }()
		if _, err := tx.ExecContext(ctx, "SET TRANSACTION SNAPSHOT '"+res.SnapshotName+"'"); err != nil {
			return err
		}
		return tx.QueryRowContext(ctx, sqlOlderUndelivered).Scan(&older, &before)
	}()
	if err == nil {
		_, err = r.cfg.DB.ExecContext(ctx, sqlRecordSlot, r.cfg.SlotName, res.ConsistentPoint, before, string(mode))
	}
	if err == nil && mode == relaymode.ModeCDC && older > 0 {
		err = outbox.Errorf(CodeUndeliveredRows, "cdcrelay.Run", "refusing to create slot %s: %d undelivered row(s) (seq <= %d) were committed before it and would never be streamed; switch back to POLLING (`outboxctl debezium disable`), let the forwarders deliver them, then prepare the slot while they run and switch again (docs/CDC.md: Handover and slots)", r.cfg.SlotName, older, before.Int64)
	}
	if err != nil {
		// Do not leave a slot whose boundary is unknown or whose older rows
		// would be skipped.
		// One DBTimeout for the three, also after ctx has ended (StopBound).
		dctx, dcancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.DBTimeout)
		defer dcancel()
		_ = conn.Close(dctx)
		if _, derr := r.cfg.DB.ExecContext(dctx, sqlDropSlot, r.cfg.SlotName); derr != nil {
			r.logger.Error("CDC relay could not drop the slot it just created", derr, watermill.LogFields{"slot": r.cfg.SlotName})
		}
		_, _ = r.cfg.DB.ExecContext(dctx, `DELETE FROM messaging_cdc_slot WHERE slot_name = $1`, r.cfg.SlotName)
		if isRefusal(err) {
			return err
		}
		return fmt.Errorf("cdcrelay: record the boundary of slot %s: %w", r.cfg.SlotName, err)
	}
	r.logger.Info("CDC relay created replication slot", watermill.LogFields{"slot": r.cfg.SlotName, "consistent_point": res.ConsistentPoint, "older_undelivered": older})
	return nil
}

var snapshotName = regexp.MustCompile(`^[0-9A-Fa-f-]+$`)

// isSQLState reports whether err carries code, from the replication
// connection (pgx) or the database/sql one (any driver: by SQLState()). The codes the relay
// meets: DuplicateObject (a publication or slot another relay created
// first), ObjectInUse (START_REPLICATION on a slot another walsender holds),
// ObjectNotInPrerequisiteState (START_REPLICATION on an invalidated slot).
func isSQLState(err error, code pqerror.Code) bool {
	return pgerr.Is(err, string(code))
}
