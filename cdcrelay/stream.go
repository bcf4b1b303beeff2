package cdcrelay

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/lib/pq"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
)

// Statements of a replication session, run through its querier (Config.DB,
// or the transaction that holds inserts during HandOverToPolling).
const (
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
)

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
	// markFailed: a mark failed; after a stop it is not tried again
	// (the stop gave marking its DBTimeout, StopBound).
	markFailed bool
}

type pending struct {
	row envelope.Row
	msg *message.Message
}

// loop streams until ctx ends or a step fails. Once ctx has ended
// (whatever the step in progress returned, unless a refusal) the stop is
// clean: the confirmed position is reported and the stream ended (report).
func (s *stream) loop(ctx context.Context) error {
	err := s.receive(ctx)
	if ctx.Err() != nil && !isRefusal(err) && !errors.Is(err, errDrained) {
		s.report()
		return nil
	}
	return err
}

func (s *stream) receive(ctx context.Context) error {
	standby := s.r.cfg.StandbyTimeout
	s.nextStatus = time.Now().Add(standby)
	for {
		if ctx.Err() != nil {
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
		// Once the stop has begun the status goes with the CopyDone that
		// ends the stream (report), under one deadline.
		if ctx.Err() == nil {
			if err := s.sendStatus(); err != nil {
				return err
			}
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
	// Not cut by a stop that began meanwhile: once marked, the transaction
	// is confirmed by the stop's last status update, and a consumer that
	// does not mark (a connector handed over from) would otherwise see it
	// again.
	mctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.r.cfg.DBTimeout)
	defer cancel()
	if err := s.markPublished(mctx); err != nil {
		s.markFailed = true
		return err
	}
	return nil
}

// markPublished records the rows the downstream accepted as PUBLISHED, so
// neither a restarted relay (it skips them) nor the forwarders after a
// switch back to POLLING publish them again. It runs before the transaction
// is confirmed and when a session ends for any reason (with a fresh context
// on a clean stop); mctx bounds it (DBTimeout), the wait between the two
// statements included.
func (s *stream) markPublished(mctx context.Context) error {
	if len(s.published) == 0 {
		return nil
	}
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

// sqlXactStatus is pg_xact_status of the transaction whose 32-bit xid is
// $1, widened to an xid8 next to the snapshot's xmax: the full id is the one
// nearest xmax, within 2^31 on either side. (xmax is latestCompletedXid+1,
// so the newest transaction in progress can be at or past it; the id is
// never taken from an epoch before the first.)
const sqlXactStatus = `
SELECT pg_xact_status(GREATEST(m + ((($1::bigint - (m & 4294967295) + 2147483648) & 4294967295) - 2147483648), 3)::text::xid8)
  FROM (SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS m) c`

// waitXact waits until the streamed transaction is no longer in progress for
// other sessions (pg_xact_status, which consults the proc array), so its rows
// are visible.
func (s *stream) waitXact(ctx context.Context) error {
	const q = sqlXactStatus
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

// deliver makes one attempt to publish row. A refusal does not wait here
// with the replication connection open: a walsender whose client does not
// confirm the end of the WAL keeps a fast shutdown of PostgreSQL waiting.
// It counts the attempt and returns errRetry; the session ends (what was
// published is marked), the relay backs off without a connection and streams
// again from the confirmed position, skipping what is marked, so the refused
// message is the next one published. After MaxPublishAttempts it returns
// CDC_PUBLISH_FAILED. msg is the row's message, built for this attempt.
// Nothing is published once ctx has ended, and a publish in progress then
// gets DrainTimeout (Relay.publish).
func (s *stream) deliver(ctx context.Context, row envelope.Row, msg *message.Message) error {
	if ctx.Err() != nil {
		return ctx.Err() // stopping: nothing more is published
	}
	cfg := s.r.cfg
	f := &s.r.failing
	if f.id != row.MessageID {
		*f = failure{id: row.MessageID, delay: cfg.RetryInitial}
	}
	returned, err := s.r.publish(ctx, row.Destination, msg)
	if !returned {
		return ctx.Err() // left behind: not marked, its transaction not confirmed
	}
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

// published is what out.Publish returned, or the value it panicked with.
type published struct {
	err      error
	panicked any
}

// publish runs out.Publish on a goroutine of its own and waits for it. Once
// ctx has ended it waits DrainTimeout more, then leaves it running
// (returned false) for the next Run to wait for (Relay.behind). A panic in
// the publisher is raised again here, as if it had been called directly.
func (r *Relay) publish(ctx context.Context, topic string, msg *message.Message) (returned bool, err error) {
	done := make(chan published, 1)
	go func() {
		var p published
		defer func() {
			if v := recover(); v != nil {
				p.panicked = v
			}
			done <- p
		}()
		p.err = r.out.Publish(topic, msg)
	}()
	var p published
	select {
	case p = <-done:
	case <-ctx.Done():
		t := time.NewTimer(r.cfg.DrainTimeout)
		defer t.Stop()
		select {
		case p = <-done:
		case <-t.C:
			r.behind = done
			r.logger.Error("CDC relay stopped with a publish still running after DrainTimeout; its message is published again by the next Run", nil,
				watermill.LogFields{"message_id": msg.UUID, "topic": topic, "drain_timeout": r.cfg.DrainTimeout})
			return false, nil
		}
	}
	if p.panicked != nil {
		panic(p.panicked)
	}
	return true, p.err
}

// sendStatus sends the confirmed position while streaming: within
// DBTimeout, since a write to a server that stopped reading blocks and
// pglogrepl takes no context (the stop waits for one in progress).
func (s *stream) sendStatus() error {
	err := s.sendStatusBy(time.Now().Add(s.r.cfg.DBTimeout))
	if derr := s.conn.Conn().SetWriteDeadline(time.Time{}); err == nil && derr != nil {
		err = fmt.Errorf("cdcrelay: standby status update: %w", derr)
	}
	return err
}

// sendStatusBy sends the confirmed position; the write ends by deadline.
func (s *stream) sendStatusBy(deadline time.Time) error {
	if err := s.conn.Conn().SetWriteDeadline(deadline); err != nil {
		return fmt.Errorf("cdcrelay: standby status update: %w", err)
	}
	// The context is not used by pglogrepl: the deadline bounds the write.
	err := pglogrepl.SendStandbyStatusUpdate(context.Background(), s.conn, pglogrepl.StandbyStatusUpdate{WALWritePosition: s.confirmed})
	if err != nil {
		return fmt.Errorf("cdcrelay: standby status update: %w", err)
	}
	s.reported = s.confirmed
	return nil
}

// report sends the final position on a clean stop and ends the stream with
// CopyDone, best effort, within DBTimeout for both. The walsender answers
// CopyDone only after it has handled every message sent before it, so once
// the answer arrives the slot holds the position just sent. Closing the
// connection without it can lose that position: a walsender blocked writing
// to a client that stopped reading exits on the reset without reading what
// the client sent last, and the next session (or a handover) would deliver
// the last transactions again.
func (s *stream) report() {
	// Neither has a context (pglogrepl takes none, and SendStandbyCopyDone
	// reads until ReadyForQuery): the deadline on the connection bounds the
	// status, the CopyDone and the wait for the answer together, so a
	// server that is gone (a partition) cannot hold Close.
	deadline := time.Now().Add(s.r.cfg.DBTimeout)
	if err := s.conn.Conn().SetDeadline(deadline); err != nil {
		return
	}
	if s.confirmed != s.reported && s.sendStatusBy(deadline) != nil {
		return
	}
	_, _ = pglogrepl.SendStandbyCopyDone(context.Background(), s.conn)
}
