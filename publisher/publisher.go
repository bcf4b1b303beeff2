package publisher

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/internal/pgerr"
	"github.com/fencedoutbox/watermill-outbox/internal/typednil"
)

// pkeyConstraint is the primary key of messaging_outbox (migration 00001).
// A unique violation on it means the message id is already in the table.
const pkeyConstraint = "messaging_outbox_pkey"

// tenantConstraint is the tenant CHECK of messaging_outbox (migration 00001).
const tenantConstraint = "messaging_outbox_tenant_check"

// Publisher is a watermill message.Publisher that writes messages into
// messaging_outbox inside the caller's transaction. It never commits or
// rolls back: the caller's transaction decides whether the rows exist.
type Publisher struct {
	// mu serialises every use of tx (database/sql runs one statement at a
	// time on a transaction's connection) and guards closed, so Close never
	// races a Publish in progress.
	mu     sync.Mutex
	tx     *sql.Tx
	other  Tx // set instead of tx by NewOnTx
	cfg    Config
	logger watermill.LoggerAdapter
	closed bool
}

var _ message.Publisher = (*Publisher)(nil)

// New binds a Publisher to tx. It refuses a nil tx (OUTBOX_TRANSACTION_REQUIRED)
// and an invalid cfg (OUTBOX_INVALID_CONFIG). A nil logger logs nothing.
// Whether tx is finished or read-only is discovered by the first Publish,
// which refuses it with OUTBOX_TRANSACTION_REQUIRED; checking here would
// cost a round trip on every construction.
func New(tx *sql.Tx, cfg Config, logger watermill.LoggerAdapter) (*Publisher, error) {
	if tx == nil {
		return nil, outbox.Errorf(outbox.CodeTransactionRequired, "publisher.New",
			"tx is nil; begin a transaction and publish in it, or use publisher.InTx")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return bind(tx, cfg, logger), nil
}

// Tx is a transaction of a driver that is not database/sql, such as pgx's
// pgx.Tx (pgxadapter.NewPublisher wraps one). Exec runs one statement with
// positional parameters ($1, $2 ...) in the transaction. The arguments are
// strings, []byte, time.Time, sql.Null* and driver.Valuer values (array
// literals). Exec must return the driver's error with its SQLSTATE
// (SQLState() string) in the chain, and an error wrapping sql.ErrTxDone when
// the transaction is already committed or rolled back, so Publish refuses
// it with the same codes as on database/sql.
type Tx interface {
	Exec(ctx context.Context, query string, args ...any) error
}

// NewOnTx binds a Publisher to tx of another driver (see Tx); everything
// else is New's. Config.Prepared is for database/sql pools and is refused
// here (OUTBOX_INVALID_CONFIG); pgx prepares and caches statements itself.
func NewOnTx(tx Tx, cfg Config, logger watermill.LoggerAdapter) (*Publisher, error) {
	if typednil.Is(tx) {
		return nil, outbox.Errorf(outbox.CodeTransactionRequired, "publisher.NewOnTx",
			"tx is nil; begin a transaction and publish in it")
	}
	if cfg.Prepared != nil {
		return nil, outbox.Errorf(outbox.CodeInvalidConfig, "publisher.NewOnTx",
			"Config.Prepared holds database/sql statements; leave it nil with another driver's transaction")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	p := bind(nil, cfg, logger)
	p.other = tx
	return p, nil
}

// bind is New after its checks: tx is not nil and cfg is valid.
func bind(tx *sql.Tx, cfg Config, logger watermill.LoggerAdapter) *Publisher {
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return &Publisher{tx: tx, cfg: cfg.withDefaults(), logger: logger}
}

// Publish writes all msgs into messaging_outbox with one statement in the
// publisher's transaction, using msgs[0].Context() for cancellation. Each
// message's trace context is its own (its msg.traceparent, or the span in
// its own context): give every message the context it was produced under.
//
// Every message is validated before anything is sent, so a refused call
// writes no row. Refusals are *outbox.Error (match with errors.Is against the
// outbox.Err* sentinels):
//
//   - OUTBOX_PUBLISHER_CLOSED after Close;
//   - OUTBOX_TRANSACTION_REQUIRED when the Publisher has no transaction (the
//     zero value, not built by New, NewOnTx or InTx), or the transaction is
//     finished, read-only (SQLSTATE 25006) or already aborted by an earlier
//     error (25P02);
//   - OUTBOX_TOPIC_REQUIRED, OUTBOX_MESSAGE_ID_REQUIRED,
//     OUTBOX_MESSAGE_ID_TOO_LONG, OUTBOX_RESERVED_HEADER,
//     OUTBOX_INVALID_HEADER, OUTBOX_INVALID_TENANT, OUTBOX_INVALID_METADATA
//     from the envelope (OUTBOX_INVALID_HEADER also for a topic with a NUL
//     byte or invalid UTF-8);
//   - OUTBOX_DESTINATION_TOO_LONG, OUTBOX_PAYLOAD_TOO_LARGE,
//     OUTBOX_HEADERS_TOO_LARGE over the Config limits, and
//     OUTBOX_PAYLOAD_TOO_LARGE for a call of several messages whose payloads
//     add up to 2 GiB - 1 byte or more (the batch statement addresses them
//     with int4 offsets), even with MaxPayloadBytes negative;
//   - OUTBOX_CONTROL_CHARACTER for a control character in the topic, a
//     message id or a canonical field;
//   - OUTBOX_DUPLICATE_MESSAGE_ID when an id appears twice in msgs (refused
//     before any SQL) or is already in the table (the primary key refuses it);
//   - OUTBOX_INVALID_TENANT also when the database's tenant check refuses
//     the row;
//   - OUTBOX_INVALID_CONFIG when Config.Prepared was closed or was prepared
//     on another *sql.DB than the transaction's.
//
// Any other failure (a lost connection, a cancelled context) is the
// driver's error, wrapped, without a code.
//
// A refusal by the database (a duplicate id from an earlier call) aborts the
// caller's transaction, as every failed statement does in PostgreSQL: the
// business change cannot commit any more and the caller must roll back.
// Publishing no messages writes nothing, but the topic is still checked:
// an empty topic is refused (OUTBOX_TOPIC_REQUIRED) even with no messages.
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	const op = "publisher.Publish"
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return outbox.Errorf(outbox.CodePublisherClosed, op, "publisher is closed")
	}
	if p.tx == nil && p.other == nil {
		// A Publisher not built by New, NewOnTx or InTx (the zero value).
		return outbox.Errorf(outbox.CodeTransactionRequired, op,
			"the publisher has no transaction; build it with publisher.New, publisher.NewOnTx or publisher.InTx")
	}
	st, err := buildInsert(topic, msgs, p.cfg)
	if err != nil {
		return err
	}
	if len(msgs) == 0 {
		return nil
	}
	ctx := msgs[0].Context()
	if p.other != nil {
		err = p.other.Exec(ctx, st.SQL, st.Args...)
	} else if p.cfg.Prepared == nil {
		_, err = p.tx.ExecContext(ctx, st.SQL, st.Args...)
	} else {
		var stmt *sql.Stmt
		if stmt, err = p.cfg.Prepared.stmt(ctx, p.tx, st.SQL); err != nil {
			return err
		}
		// Closing the transaction's handle now only drops its bookkeeping;
		// the statement stays prepared on the connection for the next call.
		defer stmt.Close()
		_, err = stmt.ExecContext(ctx, st.Args...)
	}
	if err != nil {
		return classify(op, err, len(msgs))
	}
	p.logger.Trace("messages written to messaging_outbox", watermill.LogFields{
		"topic": topic, "count": len(msgs), "notify": p.cfg.Notify,
	})
	return nil
}

// Close stops the publisher: later Publish calls fail with
// OUTBOX_PUBLISHER_CLOSED. It waits for a Publish in progress, never touches
// the transaction, and is safe to call more than once.
func (p *Publisher) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	return nil
}

// classify turns the database's refusals into typed errors; any other
// failure (a lost connection, a cancelled context) is returned wrapped.
func classify(op string, err error, n int) error {
	if strings.Contains(err.Error(), "statement from different database") {
		// database/sql's refusal of a Stmt prepared on another *sql.DB
		// (Tx.StmtContext); it has no sentinel to match.
		return outbox.Wrap(outbox.CodeInvalidConfig, op, err,
			"Config.Prepared was prepared on another *sql.DB than the transaction's; prepare it on the same pool")
	}
	if errors.Is(err, sql.ErrTxDone) {
		return outbox.Wrap(outbox.CodeTransactionRequired, op, err,
			"the transaction is already committed or rolled back; publish before Commit")
	}
	// Classified by SQLSTATE and constraint name through the SQLState()
	// method lib/pq's and pgx's errors both have, so every driver gets the
	// same codes.
	if pgerr.Is(err, pgerr.ReadOnlySQLTransaction) {
		return outbox.Wrap(outbox.CodeTransactionRequired, op, err,
			"the transaction is read-only; publish in a read-write transaction")
	}
	if pgerr.Is(err, pgerr.InFailedSQLTransaction) {
		return outbox.Wrap(outbox.CodeTransactionRequired, op, err,
			"the transaction was aborted by an earlier error; roll it back and retry")
	}
	if pgerr.Violates(err, pgerr.UniqueViolation, pkeyConstraint) {
		return outbox.Wrap(outbox.CodeDuplicateMessageID, op, err,
			"a message with this id is already in messaging_outbox; the transaction is aborted, roll it back")
	}
	if pgerr.Violates(err, pgerr.CheckViolation, tenantConstraint) {
		return outbox.Wrap(outbox.CodeInvalidTenant, op, err, "the database refused the tenant")
	}
	return fmt.Errorf("%s: insert %d messages into messaging_outbox: %w", op, n, err)
}
