package cdcrelay

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/lib/pq/pqerror"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/debezium"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/pgerr"
)

// Codes of the refusals Run returns. The relay-mode refusal is the debezium
// package's RELAY_MODE_CONFLICT (debezium.ErrRelayModeConflict); invalid
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
)

// Sentinels for errors.Is.
var (
	ErrPublishFailed      = &outbox.Error{Code: CodePublishFailed}
	ErrSlotMissing        = &outbox.Error{Code: CodeSlotMissing}
	ErrSlotInUse          = &outbox.Error{Code: CodeSlotInUse}
	ErrPublicationMissing = &outbox.Error{Code: CodePublicationMissing}
	ErrRelayClosed        = &outbox.Error{Code: CodeRelayClosed}
	ErrAlreadyRunning     = &outbox.Error{Code: CodeAlreadyRunning}
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

	sqlCreateSlot = `SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')`

	sqlSlot = `
SELECT coalesce(plugin, ''), slot_type, coalesce(database = current_database(), false),
       active, coalesce(confirmed_flush_lsn::text, '')
  FROM pg_replication_slots
 WHERE slot_name = $1`
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
// either way its transaction is confirmed only if every message of it was
// published) and waits for it to return. Safe to call twice, or before Run.
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

// Run checks the relay mode, the publication and the slot, then streams until
// ctx ends or Close is called (it returns nil), the relay mode leaves CDC
// (RELAY_MODE_CONFLICT), a message cannot be delivered (CDC_PUBLISH_FAILED,
// OUTBOX_CORRUPT_ROW) or the connection fails. Whatever it returns, the slot
// has confirmed only transactions whose every message the publisher accepted,
// so the next Run resumes with the first unconfirmed transaction.
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

func (r *Relay) run(ctx context.Context) error {
	if err := r.checkMode(ctx); err != nil {
		return err
	}
	if err := r.checkSchema(ctx); err != nil {
		return err
	}
	if err := r.ensurePublication(ctx, r.cfg.CreatePublication); err != nil {
		return err
	}
	start, err := r.ensureSlot(ctx, r.cfg.CreateSlot, false)
	if err != nil {
		return err
	}
	conn, err := pgconn.ConnectConfig(ctx, r.pc)
	if err != nil {
		return fmt.Errorf("cdcrelay: connect for replication: %w", err)
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
		return fmt.Errorf("cdcrelay: start replication on slot %s: %w", r.cfg.SlotName, err)
	}
	r.logger.Info("CDC relay streaming", watermill.LogFields{"slot": r.cfg.SlotName, "publication": r.cfg.PublicationName, "confirmed_lsn": start.String()})
	s := &stream{r: r, conn: conn, rels: map[uint32]*pglogrepl.RelationMessage{}, confirmed: start}
	return s.loop(ctx)
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
// on (see "When to create the slot" in the package documentation). It does
// not stream, and refuses CDC_SLOT_IN_USE for a slot of another kind or
// database.
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

// checkMode refuses unless the database records CDC mode: while it says
// POLLING, forwarders may be running and would publish the same rows.
func (r *Relay) checkMode(ctx context.Context) error {
	return debezium.RequireMode(ctx, r.cfg.DB, debezium.ModeCDC, "cdcrelay.Run",
		"stop the polling relays and run `outboxctl debezium enable` first")
}

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
// it is missing and CreateSlot allows.
func (r *Relay) ensureSlot(ctx context.Context, create, activeOK bool) (pglogrepl.LSN, error) {
	const op = "cdcrelay.Run"
	var (
		plugin, slotType, confirmed string
		sameDB, active              bool
	)
	read := func() error {
		return r.cfg.DB.QueryRowContext(ctx, sqlSlot, r.cfg.SlotName).Scan(&plugin, &slotType, &sameDB, &active, &confirmed)
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
		var consistent string
		err := r.cfg.DB.QueryRowContext(ctx, sqlCreateSlot, r.cfg.SlotName).Scan(&consistent)
		if err != nil && !isSQLState(err, pqerror.DuplicateObject) {
			return 0, fmt.Errorf("cdcrelay: create slot %s: %w", r.cfg.SlotName, err)
		}
		if err == nil {
			r.logger.Info("CDC relay created replication slot", watermill.LogFields{"slot": r.cfg.SlotName, "consistent_point": consistent})
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
	if confirmed == "" {
		return 0, nil
	}
	return pglogrepl.ParseLSN(confirmed)
}

// isSQLState reports whether err carries code, from the replication
// connection (pgx) or the database/sql one (any driver: by SQLState()). The codes the relay
// meets: DuplicateObject (a publication or slot another relay created
// first), ObjectInUse (START_REPLICATION on a slot another walsender holds).
func isSQLState(err error, code pqerror.Code) bool {
	return pgerr.Is(err, string(code))
}

// stream is the state of one replication session.
type stream struct {
	r          *Relay
	conn       *pgconn.PgConn
	rels       map[uint32]*pglogrepl.RelationMessage
	inTx       bool
	confirmed  pglogrepl.LSN // every transaction up to here is published
	reported   pglogrepl.LSN // last position sent to the server
	nextStatus time.Time
}

func (s *stream) loop(ctx context.Context) error {
	standby := s.r.cfg.StandbyTimeout
	s.nextStatus = time.Now().Add(standby)
	for {
		if ctx.Err() != nil {
			s.report()
			return nil
		}
		if !time.Now().Before(s.nextStatus) {
			if err := s.recheckMode(ctx); err != nil {
				return err
			}
			if err := s.sendStatus(); err != nil {
				return err
			}
			s.nextStatus = time.Now().Add(standby)
		}
		rctx, cancel := context.WithDeadline(ctx, s.nextStatus)
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
	case *pglogrepl.InsertMessage:
		rel, ok := s.rels[m.RelationID]
		if !ok {
			return fmt.Errorf("cdcrelay: insert for unknown relation %d", m.RelationID)
		}
		if rel.RelationName != Table || rel.Namespace != s.r.cfg.Schema {
			return nil // another table in a shared publication
		}
		return s.publishInsert(ctx, rel, m.Tuple)
	case *pglogrepl.CommitMessage:
		// Every insert of the transaction was published (publishInsert
		// returns only then), so the whole transaction may be confirmed.
		s.inTx = false
		if m.TransactionEndLSN > s.confirmed {
			s.confirmed = m.TransactionEndLSN
		}
		return s.sendStatus()
	}
	// Updates, deletes and truncates (a publication that is not
	// insert-only) are ignored: only an insert is a new message.
	return nil
}

func (s *stream) publishInsert(ctx context.Context, rel *pglogrepl.RelationMessage, tuple *pglogrepl.TupleData) error {
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
	return s.deliver(ctx, row, msg)
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

// deliver publishes row until the publisher accepts it, backing off between
// attempts; while it waits it keeps the server informed (unchanged position)
// so a long outage downstream does not hit wal_sender_timeout.
// msg is the row's message, already built (and so known to be buildable) for
// the first attempt.
func (s *stream) deliver(ctx context.Context, row envelope.Row, msg *message.Message) error {
	cfg := s.r.cfg
	delay := cfg.RetryInitial
	for attempt := 1; ; attempt++ {
		if attempt > 1 {
			// A fresh message per retry: publishers may keep or alter what
			// they were given. The id is the row's, every time.
			var err error
			if msg, err = envelope.ToMessage(row, cfg.Envelope); err != nil {
				return err
			}
		}
		err := s.r.out.Publish(row.Destination, msg)
		if err == nil {
			return nil
		}
		fields := watermill.LogFields{"message_id": row.MessageID, "topic": row.Destination, "attempt": attempt}
		if cfg.MaxPublishAttempts > 0 && attempt >= cfg.MaxPublishAttempts {
			return outbox.Wrap(CodePublishFailed, "cdcrelay.Run", err, fmt.Sprintf("message %s to %s refused %d times; its transaction is not confirmed and is delivered again on the next Run", row.MessageID, row.Destination, attempt))
		}
		s.r.logger.Error("CDC relay publish failed; retrying", err, fields)
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
		delay = min(delay*2, cfg.RetryMax)
		if err := s.sendStatus(); err != nil {
			return err
		}
	}
}

func (s *stream) recheckMode(ctx context.Context) error {
	err := s.r.checkMode(ctx)
	if outbox.CodeOf(err) == debezium.CodeRelayModeConflict {
		return err
	}
	if err != nil && ctx.Err() == nil {
		// The database is unreachable through DB; the replication
		// connection still works, and the last known mode was CDC.
		s.r.logger.Error("CDC relay could not re-read the relay mode", err, nil)
	}
	return nil
}

func (s *stream) sendStatus() error {
	err := pglogrepl.SendStandbyStatusUpdate(context.Background(), s.conn, pglogrepl.StandbyStatusUpdate{WALWritePosition: s.confirmed})
	if err != nil {
		return fmt.Errorf("cdcrelay: standby status update: %w", err)
	}
	s.reported = s.confirmed
	return nil
}

// report sends the final position on a clean stop, best effort.
func (s *stream) report() {
	if s.confirmed != s.reported {
		_ = s.sendStatus()
	}
}
