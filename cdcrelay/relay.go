package cdcrelay

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"regexp"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/lib/pq"
	"github.com/lib/pq/pqerror"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/debezium"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/pgerr"
	"github.com/fencedoutbox/watermill-outbox/internal/redact"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

// Codes of the refusals Run returns. The relay-mode refusal is the debezium
// package's RELAY_MODE_CONFLICT (relaymode.ErrRelayModeConflict), a second CDC
// consumer on another slot is debezium's CDC_SECOND_CONSUMER; invalid
// settings are OUTBOX_INVALID_CONFIG and a row that cannot become a message
// is OUTBOX_CORRUPT_ROW.
const (
	// CodePublishFailed: a message was refused MaxPublishAttempts times. Its
	// transaction was not confirmed; the next Run delivers it again.
	CodePublishFailed outbox.Code = "CDC_PUBLISH_FAILED"
	// CodeSlotMissing: the replication slot does not exist and CreateSlot is off.
	CodeSlotMissing outbox.Code = "CDC_SLOT_MISSING"
	// CodeSlotInUse: another consumer is streaming from the slot (one relay
	// per slot), or the slot is not a pgoutput slot of this database.
	CodeSlotInUse outbox.Code = "CDC_SLOT_IN_USE"
	// CodePublicationMissing: the publication does not exist (and
	// CreatePublication is off) or does not publish messaging_outbox inserts.
	CodePublicationMissing outbox.Code = "CDC_PUBLICATION_MISSING"
	// CodeRelayClosed: Run after Close.
	CodeRelayClosed outbox.Code = "CDC_RELAY_CLOSED"
	// CodeAlreadyRunning: Run while another Run of the same Relay is active.
	CodeAlreadyRunning outbox.Code = "CDC_RELAY_ALREADY_RUNNING"
	// CodeSlotLost: the slot was invalidated (wal_status "lost"), e.g. because
	// it fell behind by more than max_slot_wal_keep_size. The detail carries
	// PostgreSQL's message and DETAIL. The WAL it needed is gone: rows in it
	// were never streamed. See "A lost slot" in the README.
	CodeSlotLost outbox.Code = "CDC_SLOT_LOST"
	// CodeUndeliveredRows: rows committed before the slot was created are
	// still undelivered; they are not in the slot, so streaming would skip
	// them. Refused when Run would create the slot in CDC mode, and on every
	// start while rows older than the slot (messaging_cdc_slot.before_seq)
	// are undelivered.
	CodeUndeliveredRows outbox.Code = "CDC_UNDELIVERED_ROWS"
	// CodeHeartbeatLapsed: no CDC heartbeat succeeded for HeartbeatTTL; the
	// relay stopped before publishing more, since the mode may have left
	// CDC meanwhile.
	CodeHeartbeatLapsed outbox.Code = "CDC_HEARTBEAT_LAPSED"
)

// Sentinels for errors.Is.
var (
	ErrPublishFailed      = &outbox.Error{Code: CodePublishFailed}
	ErrSlotMissing        = &outbox.Error{Code: CodeSlotMissing}
	ErrSlotInUse          = &outbox.Error{Code: CodeSlotInUse}
	ErrPublicationMissing = &outbox.Error{Code: CodePublicationMissing}
	ErrRelayClosed        = &outbox.Error{Code: CodeRelayClosed}
	ErrAlreadyRunning     = &outbox.Error{Code: CodeAlreadyRunning}
	ErrSlotLost           = &outbox.Error{Code: CodeSlotLost}
	ErrUndeliveredRows    = &outbox.Error{Code: CodeUndeliveredRows}
	ErrHeartbeatLapsed    = &outbox.Error{Code: CodeHeartbeatLapsed}
)

// Table is the only relation the relay streams.
const Table = debezium.Table

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

	// The rows of a batch that must not be published: delivered already
	// (PUBLISHED, by the forwarders before the switch or by this relay
	// before a restart) or parked for an operator.
	sqlDone = `
SELECT message_id FROM messaging_outbox
 WHERE message_id = ANY($1::text[]) AND (published_at IS NOT NULL OR parked_at IS NOT NULL)`

	// What the forwarder's fenced PUBLISHED outcome writes, plus a new lease
	// token: a forwarder still holding a lease on the row (its heartbeat
	// lapsed before CDC was enabled) finds its outcome stale.
	sqlMarkPublished = `
UPDATE messaging_outbox
   SET status = 'PUBLISHED', attempts = CASE WHEN attempts < 2147483647 THEN attempts + 1 ELSE attempts END, published_at = now(),
       last_attempt_at = now(), next_attempt_at = NULL, lease_expires_at = NULL,
       lease_owner = $2,
       lease_token = CASE WHEN lease_token < 9223372036854775807 THEN lease_token + 1 ELSE lease_token END
 WHERE message_id = ANY($1::text[]) AND published_at IS NULL AND parked_at IS NULL`

	sqlSlotLag = `
SELECT coalesce(wal_status, ''),
       coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn), 0)::int8,
       coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn), 0)::int8,
       safe_wal_size
  FROM pg_replication_slots WHERE slot_name = $1`
)

// Relay streams committed inserts of messaging_outbox from a logical
// replication slot and publishes each as a watermill message. See the package
// documentation for its guarantees.
type Relay struct {
	cfg    Config
	pc     *pgconn.Config
	out    message.Publisher
	logger watermill.LoggerAdapter

	mu      sync.Mutex
	closed  bool
	running bool
	cancel  context.CancelFunc
	done    chan struct{}

	// Owned by the goroutine in Run.
	lastBeat time.Time // when the last successful heartbeat was sent
	lastWarn time.Time
	failing  failure // the message the downstream keeps refusing, across sessions
}

// failure counts the attempts of the message being retried: a refused
// publish ends the replication session (see deliver), so the count and the
// backoff live on the relay, not the session.
type failure struct {
	id       string
	attempts int
	delay    time.Duration
}

// New validates cfg (OUTBOX_INVALID_CONFIG) and returns a relay publishing to
// out. A nil logger logs nothing. New does not connect.
func New(cfg Config, out message.Publisher, logger watermill.LoggerAdapter) (*Relay, error) {
	pc, err := cfg.replicationConfig()
	if err != nil {
		return nil, err
	}
	if out == nil {
		return nil, outbox.Errorf(outbox.CodeInvalidConfig, "cdcrelay.New", "a publisher is required")
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return &Relay{cfg: cfg.withDefaults(), pc: pc, out: out, logger: logger}, nil
}

// Close stops Run (the message being published is finished or abandoned;
// what was published is marked PUBLISHED, and a transaction is confirmed only
// if every message of it was published) and waits for it to return. Safe to
// call twice, or before Run.
func (r *Relay) Close() error {
	r.mu.Lock()
	r.closed = true
	cancel, done := r.cancel, r.done
	r.mu.Unlock()
	if cancel != nil {
		cancel()
		<-done
	}
	return nil
}

// Run checks the relay mode, registers the relay's CDC heartbeat, checks the
// publication and the slot, then streams until ctx ends or Close is called
// (it returns nil), the relay mode leaves CDC (RELAY_MODE_CONFLICT), another
// CDC consumer is live on another slot (CDC_SECOND_CONSUMER), the slot is
// lost (CDC_SLOT_LOST), rows older than the slot are undelivered
// (CDC_UNDELIVERED_ROWS), a message cannot be delivered
// (CDC_PUBLISH_FAILED, OUTBOX_CORRUPT_ROW), the heartbeat lapses
// (CDC_HEARTBEAT_LAPSED) or a connection fails. Whatever it returns, the
// rows it published are marked PUBLISHED (unless the database is
// unreachable), the slot has confirmed only transactions whose every message
// the publisher accepted, and its heartbeat is removed.
func (r *Relay) Run(ctx context.Context) error {
	r.mu.Lock()
	switch {
	case r.closed:
		r.mu.Unlock()
		return outbox.Errorf(CodeRelayClosed, "cdcrelay.Run", "the relay is closed; create a new one")
	case r.running:
		r.mu.Unlock()
		return outbox.Errorf(CodeAlreadyRunning, "cdcrelay.Run", "Run is already active on this relay")
	}
	ctx, cancel := context.WithCancel(ctx)
	r.running, r.cancel, r.done = true, cancel, make(chan struct{})
	done := r.done
	r.mu.Unlock()
	defer func() {
		cancel()
		r.mu.Lock()
		r.running, r.cancel, r.done = false, nil, nil
		r.mu.Unlock()
		close(done)
	}()

	err := r.run(ctx)
	if ctx.Err() != nil && !isRefusal(err) {
		return nil // closed or cancelled: a clean stop
	}
	return err
}

func isRefusal(err error) bool { return outbox.CodeOf(err) != "" }

// errRetry ends a replication session after the downstream refused a
// message: the relay drops the connection, backs off without holding a
// walsender, and streams again from the slot's confirmed position.
var errRetry = errors.New("cdcrelay: publish refused; reconnecting after backoff")

func (r *Relay) run(ctx context.Context) error {
	if err := r.checkMode(ctx); err != nil {
		return err
	}
	if err := r.checkSchema(ctx); err != nil {
		return err
	}
	if err := r.beat(ctx); err != nil {
		return err
	}
	defer r.leave(ctx)
	if err := r.ensurePublication(ctx, r.cfg.CreatePublication); err != nil {
		return err
	}
	for {
		start, err := r.ensureSlot(ctx, r.cfg.CreateSlot, false)
		if err != nil {
			return err
		}
		if err := r.checkBoundary(ctx); err != nil {
			return err
		}
		err = r.session(ctx, start, r.cfg.DB, 0)
		if !errors.Is(err, errRetry) {
			return err
		}
		// No replication connection is open while the relay waits: the
		// server can shut down or fail over.
		t := time.NewTimer(r.failing.delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
		r.failing.delay = nextDelay(r.failing.delay, r.cfg.RetryMax)
		if err := r.ensureBeat(ctx); err != nil {
			return err
		}
	}
}

// nextDelay doubles the backoff d up to limit; d*2 is never computed when
// it would pass limit, so it cannot wrap around to a negative delay.
func nextDelay(d, limit time.Duration) time.Duration {
	if d > limit/2 {
		return limit
	}
	return 2 * d
}

// session streams from the slot's confirmed position (start) until it ends:
// with stopAt, once every transaction before stopAt is published, marked
// through db and confirmed (it returns errDrained).
func (r *Relay) session(ctx context.Context, start pglogrepl.LSN, db querier, stopAt pglogrepl.LSN) error {
	conn, err := pgconn.ConnectConfig(ctx, r.pc)
	if err != nil {
		return fmt.Errorf("cdcrelay: connect for replication: %w", redact.Error(err, r.cfg.ConnString))
	}
	defer func() {
		cctx, ccancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer ccancel()
		_ = conn.Close(cctx)
	}()
	err = pglogrepl.StartReplication(ctx, conn, r.cfg.SlotName, 0, r.startOptions())
	if err != nil {
		if isSQLState(err, pqerror.ObjectInUse) {
			return outbox.Wrap(CodeSlotInUse, "cdcrelay.Run", err, fmt.Sprintf("slot %s is being streamed by another consumer; one relay per slot", r.cfg.SlotName))
		}
		if isSQLState(err, pqerror.ObjectNotInPrerequisiteState) {
			return r.slotLost(ctx, err)
		}
		return fmt.Errorf("cdcrelay: start replication on slot %s: %w", r.cfg.SlotName, err)
	}
	r.logger.Info("CDC relay streaming", watermill.LogFields{"slot": r.cfg.SlotName, "publication": r.cfg.PublicationName, "confirmed_lsn": start.String()})
	s := &stream{r: r, db: db, stopAt: stopAt, conn: conn, rels: map[uint32]*pglogrepl.RelationMessage{}, confirmed: start}
	err = s.loop(ctx)
	if errors.Is(err, errDrained) {
		s.report() // the next session starts where this one ended
	}
	// Whatever ended the session, what the downstream accepted is marked, so
	// neither a restarted relay nor the forwarders publish it again.
	if merr := s.markPublished(ctx); merr != nil && err == nil {
		err = merr
	}
	return err
}

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
		"slot %s cannot be streamed (wal_status %q): %s; the WAL it needed is gone and the rows in it were never streamed: do not just drop and recreate the slot, follow \"A lost slot\" in the README",
		r.cfg.SlotName, walStatus, detail))
}

// startOptions are the START_REPLICATION options of a session.
func (r *Relay) startOptions() pglogrepl.StartReplicationOptions {
	return pglogrepl.StartReplicationOptions{
		Mode: pglogrepl.LogicalReplication,
		// Protocol 1 without streaming: the server sends a transaction only
		// once it has committed, whole, so an aborted transaction's inserts
		// never reach the relay and each insert may be published as it arrives.
		PluginArgs: []string{"proto_version '1'", "publication_names '" + r.cfg.PublicationName + "'"},
	}
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
	var before sql.NullInt64
	err = db.QueryRowContext(ctx, sqlSlotBoundary, slot).Scan(&before)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, fmt.Errorf("cdcrelay: read slot boundary of %s: %w", slot, err)
	}
	if !before.Valid {
		return 0, true, nil
	}
	if err := db.QueryRowContext(ctx, sqlUndeliveredBefore, before.Int64).Scan(&n); err != nil {
		return 0, true, fmt.Errorf("cdcrelay: count rows older than slot %s: %w", slot, err)
	}
	return n, true, nil
}

// checkBoundary refuses while rows older than the slot are undelivered, and
// closes the boundary once none is (later rows get higher seqs: the check
// cannot fail again).
func (r *Relay) checkBoundary(ctx context.Context) error {
	var before sql.NullInt64
	err := r.cfg.DB.QueryRowContext(ctx, sqlSlotBoundary, r.cfg.SlotName).Scan(&before)
	if errors.Is(err, sql.ErrNoRows) {
		r.logger.Info("CDC relay did not create this slot: rows committed before it cannot be checked (see the package documentation)", watermill.LogFields{"slot": r.cfg.SlotName})
		return nil
	}
	if err != nil {
		return fmt.Errorf("cdcrelay: read slot boundary of %s: %w", r.cfg.SlotName, err)
	}
	if !before.Valid {
		return nil
	}
	var n int64
	if err := r.cfg.DB.QueryRowContext(ctx, sqlUndeliveredBefore, before.Int64).Scan(&n); err != nil {
		return fmt.Errorf("cdcrelay: count rows older than slot %s: %w", r.cfg.SlotName, err)
	}
	if n > 0 {
		return outbox.Errorf(CodeUndeliveredRows, "cdcrelay.Run", "%d undelivered row(s) with seq <= %d were committed before slot %s was created: they are not in the slot and streaming would never deliver them; switch back to POLLING (`outboxctl debezium disable`), let the forwarders deliver them, then switch again (README: CDC mode: handover and slots)", n, before.Int64, r.cfg.SlotName)
	}
	if _, err := r.cfg.DB.ExecContext(ctx, sqlCloseBoundary, r.cfg.SlotName, before.Int64); err != nil {
		return fmt.Errorf("cdcrelay: close slot boundary of %s: %w", r.cfg.SlotName, err)
	}
	return nil
}

// checkMode refuses unless the database records CDC mode: while it says
// POLLING, forwarders may be running and would publish the same rows.
func (r *Relay) checkMode(ctx context.Context) error {
	return relaymode.RequireMode(ctx, r.cfg.DB, relaymode.ModeCDC, "cdcrelay.Run",
		"stop the polling relays and run `outboxctl debezium enable` first")
}

// beat renews the relay's CDC heartbeat (which re-reads the mode under the
// mode row's lock). Until lastBeat+HeartbeatTTL the mode cannot leave CDC.
func (r *Relay) beat(ctx context.Context) error {
	sent := time.Now()
	if err := relaymode.BeatCDC(ctx, r.cfg.DB, r.cfg.Owner, r.cfg.SlotName, r.cfg.HeartbeatTTL); err != nil {
		return err
	}
	r.lastBeat = sent
	r.checkLag(ctx)
	return nil
}

// ensureBeat beats when HeartbeatInterval has passed since the last
// successful beat. A refusal stops the relay; a failure is tolerated while
// the last heartbeat is alive, and stops the relay (CDC_HEARTBEAT_LAPSED)
// after that: it no longer knows that the mode is CDC. A renewal that
// blocks (a lock held on the heartbeat row, a server that stopped
// answering) is a failure too: it may take what is left of the heartbeat's
// life, HeartbeatInterval at least, and no more.
func (r *Relay) ensureBeat(ctx context.Context) error {
	since := time.Since(r.lastBeat)
	if since < r.cfg.HeartbeatInterval {
		return nil
	}
	bctx, cancel := context.WithTimeout(ctx, max(r.cfg.HeartbeatTTL-since, r.cfg.HeartbeatInterval))
	err := r.beat(bctx)
	cancel()
	if err == nil || isRefusal(err) || ctx.Err() != nil {
		return err
	}
	if since = time.Since(r.lastBeat); since >= r.cfg.HeartbeatTTL {
		return outbox.Wrap(CodeHeartbeatLapsed, "cdcrelay.Run", err, fmt.Sprintf("no CDC heartbeat succeeded for %s (HeartbeatTTL %s); the relay mode may have changed meanwhile, so nothing more is published", since.Round(time.Millisecond), r.cfg.HeartbeatTTL))
	}
	r.logger.Error("CDC relay heartbeat failed; publishing stops once it has failed for HeartbeatTTL", err, watermill.LogFields{"ttl": r.cfg.HeartbeatTTL})
	return nil
}

func (r *Relay) leave(ctx context.Context) {
	lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := relaymode.Leave(lctx, r.cfg.DB, r.cfg.Owner); err != nil {
		r.logger.Error("CDC relay heartbeat not removed; Disable refuses until it expires", err, watermill.LogFields{"ttl": r.cfg.HeartbeatTTL})
	}
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
	conn, err := pgconn.ConnectConfig(ctx, r.pc)
	if err != nil {
		return fmt.Errorf("cdcrelay: connect for replication: %w", redact.Error(err, r.cfg.ConnString))
	}
	defer func() {
		cctx, ccancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer ccancel()
		_ = conn.Close(cctx)
	}()
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
		err = outbox.Errorf(CodeUndeliveredRows, "cdcrelay.Run", "refusing to create slot %s: %d undelivered row(s) (seq <= %d) were committed before it and would never be streamed; switch back to POLLING (`outboxctl debezium disable`), let the forwarders deliver them, then prepare the slot while they run and switch again (README: CDC mode: handover and slots)", r.cfg.SlotName, older, before.Int64)
	}
	if err != nil {
		// Do not leave a slot whose boundary is unknown or whose older rows
		// would be skipped.
		dctx, dcancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
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

// querier is where a session reads statuses and writes marks: Config.DB,
// or the transaction that holds inserts during HandOverToPolling.
type querier interface {
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

// errDrained ends a session that reached its stopAt position.
var errDrained = errors.New("cdcrelay: drained to the target position")

// stream is the state of one replication session.
type stream struct {
	r          *Relay
	db         querier
	stopAt     pglogrepl.LSN // HandOverToPolling: end the session once everything before it is confirmed; 0: never
	conn       *pgconn.PgConn
	rels       map[uint32]*pglogrepl.RelationMessage
	inTx       bool
	confirmed  pglogrepl.LSN // every transaction up to here is published
	reported   pglogrepl.LSN // last position sent to the server
	nextStatus time.Time

	xid       uint32    // the transaction being streamed
	batch     []pending // inserts of the current transaction not yet published
	published []string  // ids the downstream accepted, not yet marked PUBLISHED
}

type pending struct {
	row envelope.Row
	msg *message.Message
}

func (s *stream) loop(ctx context.Context) error {
	standby := s.r.cfg.StandbyTimeout
	s.nextStatus = time.Now().Add(standby)
	for {
		if ctx.Err() != nil {
			s.report()
			return nil
		}
		if err := s.r.ensureBeat(ctx); err != nil {
			return err
		}
		if !time.Now().Before(s.nextStatus) {
			if err := s.sendStatus(); err != nil {
				return err
			}
			s.nextStatus = time.Now().Add(standby)
		}
		wake := s.nextStatus
		if b := s.r.lastBeat.Add(s.r.cfg.HeartbeatInterval); b.Before(wake) {
			wake = b
		}
		rctx, cancel := context.WithDeadline(ctx, wake)
		raw, err := s.conn.ReceiveMessage(rctx)
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				s.report()
				return nil
			}
			if pgconn.Timeout(err) {
				continue
			}
			return fmt.Errorf("cdcrelay: receive: %w", err)
		}
		switch m := raw.(type) {
		case *pgproto3.ErrorResponse:
			return fmt.Errorf("cdcrelay: replication stream: %w", pgconn.ErrorResponseToPgError(m))
		case *pgproto3.CopyData:
			if err := s.handleCopyData(ctx, m.Data); err != nil {
				return err
			}
		}
	}
}

func (s *stream) handleCopyData(ctx context.Context, data []byte) error {
	if len(data) == 0 {
		return nil
	}
	switch data[0] {
	case pglogrepl.PrimaryKeepaliveMessageByteID:
		pkm, err := pglogrepl.ParsePrimaryKeepaliveMessage(data[1:])
		if err != nil {
			return fmt.Errorf("cdcrelay: keepalive: %w", err)
		}
		// Between transactions everything the server has sent is published,
		// so its position may be confirmed: that lets the server recycle WAL
		// while the outbox is idle. Any later transaction commits after it.
		if !s.inTx && pkm.ServerWALEnd > s.confirmed {
			s.confirmed = pkm.ServerWALEnd
		}
		if pkm.ReplyRequested {
			s.nextStatus = time.Time{}
		}
		if s.stopAt != 0 && !s.inTx && s.confirmed >= s.stopAt {
			if err := s.sendStatus(); err != nil {
				return err
			}
			return errDrained
		}
	case pglogrepl.XLogDataByteID:
		xld, err := pglogrepl.ParseXLogData(data[1:])
		if err != nil {
			return fmt.Errorf("cdcrelay: xlog data: %w", err)
		}
		return s.handleLogical(ctx, xld.WALData)
	}
	return nil
}

func (s *stream) handleLogical(ctx context.Context, wal []byte) error {
	lm, err := pglogrepl.Parse(wal)
	if err != nil {
		return fmt.Errorf("cdcrelay: decode pgoutput message: %w", err)
	}
	switch m := lm.(type) {
	case *pglogrepl.RelationMessage:
		s.rels[m.RelationID] = m
	case *pglogrepl.BeginMessage:
		s.inTx = true
		s.xid = m.Xid
	case *pglogrepl.InsertMessage:
		rel, ok := s.rels[m.RelationID]
		if !ok {
			return fmt.Errorf("cdcrelay: insert for unknown relation %d", m.RelationID)
		}
		if rel.RelationName != Table || rel.Namespace != s.r.cfg.Schema {
			return nil // another table in a shared publication (the heartbeat table)
		}
		return s.addInsert(ctx, rel, m.Tuple)
	case *pglogrepl.CommitMessage:
		// Every insert of the transaction is published and marked (flush
		// returns only then), so the whole transaction may be confirmed.
		if err := s.flush(ctx); err != nil {
			return err
		}
		s.inTx = false
		if m.TransactionEndLSN > s.confirmed {
			s.confirmed = m.TransactionEndLSN
		}
		if err := s.sendStatus(); err != nil {
			return err
		}
		if s.stopAt != 0 && s.confirmed >= s.stopAt {
			return errDrained
		}
		return nil
	}
	// Updates, deletes and truncates (a publication that is not
	// insert-only) are ignored: only an insert is a new message.
	return nil
}

func (s *stream) addInsert(ctx context.Context, rel *pglogrepl.RelationMessage, tuple *pglogrepl.TupleData) error {
	row, err := decodeInsert(rel, tuple)
	var msg *message.Message
	if err == nil {
		msg, err = envelope.ToMessage(row, s.r.cfg.Envelope)
	}
	if err != nil {
		if s.r.cfg.SkipUndecodable {
			s.r.logger.Error("CDC relay skipped a row that cannot become a message", err, watermill.LogFields{"message_id": row.MessageID})
			return nil
		}
		return err
	}
	s.batch = append(s.batch, pending{row: row, msg: msg})
	if len(s.batch) >= s.r.cfg.BatchSize {
		return s.flush(ctx)
	}
	return nil
}

// flush publishes the held inserts in commit order, skipping the rows that
// are delivered or parked already, and marks what it published PUBLISHED.
// The heartbeat is checked before each publish: a relay whose mode may have
// left CDC publishes nothing more.
func (s *stream) flush(ctx context.Context) error {
	if len(s.batch) == 0 {
		return nil
	}
	ids := make([]string, len(s.batch))
	for i, p := range s.batch {
		ids[i] = p.row.MessageID
	}
	done := map[string]bool{}
	rows, err := s.db.QueryContext(ctx, sqlDone, pq.Array(ids))
	if err != nil {
		return fmt.Errorf("cdcrelay: read the status of %d streamed rows: %w", len(ids), err)
	}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			_ = rows.Close()
			return fmt.Errorf("cdcrelay: read the status of streamed rows: %w", err)
		}
		done[id] = true
	}
	if err := rows.Close(); err != nil {
		return fmt.Errorf("cdcrelay: read the status of streamed rows: %w", err)
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("cdcrelay: read the status of streamed rows: %w", err)
	}
	for i, p := range s.batch {
		if done[p.row.MessageID] {
			continue
		}
		if err := s.r.ensureBeat(ctx); err != nil {
			return err
		}
		if err := s.deliver(ctx, p.row, p.msg); err != nil {
			s.batch = s.batch[i:]
			return err
		}
		s.published = append(s.published, p.row.MessageID)
	}
	s.batch = s.batch[:0]
	return s.markPublished(ctx)
}

// markPublished records the rows the downstream accepted as PUBLISHED, so
// neither a restarted relay (it skips them) nor the forwarders after a
// switch back to POLLING publish them again. It runs before the transaction
// is confirmed and when a session ends for any reason (with a fresh context
// on a clean stop).
func (s *stream) markPublished(ctx context.Context) error {
	if len(s.published) == 0 {
		return nil
	}
	mctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	mark := func() (int64, error) {
		res, err := s.db.ExecContext(mctx, sqlMarkPublished, pq.Array(s.published), "cdc:"+s.r.cfg.SlotName)
		if err != nil {
			return 0, fmt.Errorf("cdcrelay: mark %d published rows: %w", len(s.published), err)
		}
		n, _ := res.RowsAffected()
		return n, nil
	}
	n, err := mark()
	if err != nil {
		return err
	}
	if int(n) < len(s.published) {
		// The walsender sends a transaction once its commit record is
		// flushed, which can be a moment before the committing backend
		// leaves the proc array: until then its rows are invisible to
		// other sessions and the UPDATE misses them. Wait for the
		// transaction to end, then mark the rest (a row still missed was
		// deleted, or is already PUBLISHED).
		if err := s.waitXact(mctx); err != nil {
			return err
		}
		if _, err := mark(); err != nil {
			return err
		}
	}
	s.published = s.published[:0]
	return nil
}

// waitXact waits until the streamed transaction is no longer in progress for
// other sessions (pg_xact_status, which consults the proc array), so its rows
// are visible. The 32-bit xid is widened with the current epoch.
func (s *stream) waitXact(ctx context.Context) error {
	const q = `
SELECT pg_xact_status((CASE WHEN x > m THEN x - 4294967296 ELSE x END)::text::xid8)
  FROM (SELECT ((m >> 32) << 32) | $1::bigint AS x, m
          FROM (SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS m) c) w`
	for delay := time.Millisecond; ; delay = min(2*delay, 50*time.Millisecond) {
		var st sql.NullString
		if err := s.db.QueryRowContext(ctx, q, int64(s.xid)).Scan(&st); err != nil {
			return fmt.Errorf("cdcrelay: wait for transaction %d to end: %w", s.xid, err)
		}
		if st.String != "in progress" {
			return nil
		}
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("cdcrelay: wait for transaction %d to end: %w", s.xid, ctx.Err())
		case <-t.C:
		}
	}
}

// decodeInsert is the row an INSERT's tuple carries: each value paired with
// its relation's column name, then decodeRow.
func decodeInsert(rel *pglogrepl.RelationMessage, tuple *pglogrepl.TupleData) (envelope.Row, error) {
	if tuple == nil || len(tuple.Columns) != len(rel.Columns) {
		return envelope.Row{}, undecodable("insert into %s.%s has a tuple that does not match its relation", rel.Namespace, rel.RelationName)
	}
	cols := make([]column, len(tuple.Columns))
	for i, c := range tuple.Columns {
		cols[i].name = rel.Columns[i].Name
		switch c.DataType {
		case pglogrepl.TupleDataTypeNull:
			cols[i].null = true
		case pglogrepl.TupleDataTypeText:
			cols[i].text = c.Data
		default:
			return envelope.Row{}, undecodable("column %s arrived as tuple type %q; the relay reads text format only", cols[i].name, c.DataType)
		}
	}
	return decodeRow(cols)
}

// deliver makes one attempt to publish row. A refusal does not wait here
// with the replication connection open: a walsender whose client does not
// confirm the end of the WAL keeps a fast shutdown of PostgreSQL waiting.
// It counts the attempt and returns errRetry; the session ends (what was
// published is marked), the relay backs off without a connection and streams
// again from the confirmed position, skipping what is marked, so the refused
// message is the next one published. After MaxPublishAttempts it returns
// CDC_PUBLISH_FAILED. msg is the row's message, built for this attempt.
func (s *stream) deliver(ctx context.Context, row envelope.Row, msg *message.Message) error {
	cfg := s.r.cfg
	f := &s.r.failing
	if f.id != row.MessageID {
		*f = failure{id: row.MessageID, delay: cfg.RetryInitial}
	}
	err := s.r.out.Publish(row.Destination, msg)
	if err == nil {
		*f = failure{}
		return nil
	}
	f.attempts++
	if cfg.MaxPublishAttempts > 0 && f.attempts >= cfg.MaxPublishAttempts {
		attempts := f.attempts
		*f = failure{}
		return outbox.Wrap(CodePublishFailed, "cdcrelay.Run", err, fmt.Sprintf("message %s to %s refused %d times; its transaction is not confirmed and is delivered again on the next Run", row.MessageID, row.Destination, attempts))
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	s.r.logger.Error("CDC relay publish failed; retrying after backoff without holding the replication connection", err,
		watermill.LogFields{"message_id": row.MessageID, "topic": row.Destination, "attempt": f.attempts, "backoff": f.delay})
	return errRetry
}

func (s *stream) sendStatus() error {
	err := pglogrepl.SendStandbyStatusUpdate(context.Background(), s.conn, pglogrepl.StandbyStatusUpdate{WALWritePosition: s.confirmed})
	if err != nil {
		return fmt.Errorf("cdcrelay: standby status update: %w", err)
	}
	s.reported = s.confirmed
	return nil
}

// report sends the final position on a clean stop and ends the stream with
// CopyDone, best effort. The walsender answers CopyDone only after it has
// handled every message sent before it, so once the answer arrives the slot
// holds the position just sent. Closing the connection without it can lose
// that position: a walsender blocked writing to a client that stopped
// reading exits on the reset without reading what the client sent last, and
// the next session (or a handover) would deliver the last transactions
// again.
func (s *stream) report() {
	// Neither the status nor the wait for the answer has a context of its
	// own (SendStandbyCopyDone reads until ReadyForQuery): the deadline
	// bounds both, so a server that is gone (a partition) cannot hold Close.
	if err := s.conn.Conn().SetDeadline(time.Now().Add(copyDoneTimeout)); err != nil {
		return
	}
	if s.confirmed != s.reported && s.sendStatus() != nil {
		return
	}
	_, _ = pglogrepl.SendStandbyCopyDone(context.Background(), s.conn)
}

// copyDoneTimeout bounds the wait for the walsender's answer to CopyDone on
// a clean stop.
const copyDoneTimeout = 5 * time.Second
