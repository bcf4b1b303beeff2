package inbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/trace"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/pgtext"
	"github.com/fencedoutbox/watermill-outbox/publisher"
)

// The one statement that decides whether a delivery is new. A conflicting
// row committed by another delivery makes it affect zero rows; an
// uncommitted one makes it wait for that transaction's outcome.
const insertInbox = `INSERT INTO messaging_inbox (consumer, message_id) VALUES ($1, $2) ON CONFLICT DO NOTHING`

// CodeProducedMessages is returned when a handler wrapped by the middleware
// returns produced messages. The router would publish them after the inbox
// record commits; if that publish failed, the redelivery would be skipped as
// already processed and they would be lost. The transaction is rolled back
// (no effect, no inbox record, no follow-ups) and the message is nacked.
const CodeProducedMessages outbox.Code = "INBOX_PRODUCED_MESSAGES"

// ErrProducedMessages matches CodeProducedMessages with errors.Is.
var ErrProducedMessages = &outbox.Error{Code: CodeProducedMessages}

// MaxConsumerLength bounds consumer names (bytes).
const MaxConsumerLength = 200

// MaxMessageIDLength bounds the message UUIDs the inbox records (bytes):
// with the consumer name they are the key of an index, whose entries
// PostgreSQL caps at about 2.7 KB. Longer than the outbox's own ids
// (envelope.MaxMessageIDLength): the inbox also receives other producers'.
const MaxMessageIDLength = 2048

// Config tunes the middleware. The zero value is usable.
type Config struct {
	// Publisher configures the follow-up publisher bound to the transaction.
	Publisher publisher.Config
	// TxOptions for the consumer's transaction (nil: the server's default
	// isolation, default_transaction_isolation, READ COMMITTED unless
	// configured; the duplicate check is tested at READ COMMITTED
	// (TestConcurrentDeliveriesOfOneIDHaveOneEffect), where a
	// delivery waiting on another's uncommitted record sees it once it
	// commits and is skipped). ReadOnly is refused: the inbox record is a
	// write.
	TxOptions *sql.TxOptions
	// Logger; nil logs nothing.
	Logger watermill.LoggerAdapter
}

type ctxKey struct{}

type state struct {
	tx       *sql.Tx  // database/sql (Middleware)
	driverTx DriverTx // another driver (NewMiddlewareOn)
	pub      *FollowUp
}

// Tx returns the consumer's transaction inside a handler wrapped by the
// middleware, or nil outside one.
func Tx(ctx context.Context) *sql.Tx {
	if s, ok := ctx.Value(ctxKey{}).(*state); ok {
		return s.tx
	}
	return nil
}

// Publisher returns the follow-up publisher bound to the consumer's
// transaction inside a handler wrapped by the middleware, or nil outside one.
func Publisher(ctx context.Context) *FollowUp {
	if s, ok := ctx.Value(ctxKey{}).(*state); ok {
		fu := *s.pub // shares the transaction's publisher; carries ctx's span
		fu.span = trace.SpanContextFromContext(ctx)
		return &fu
	}
	return nil
}

// FollowUp is the outbox publisher handed to a handler: a
// *publisher.Publisher bound to the consumer's transaction that also links
// each follow-up to the message being consumed (msg.causation_id = its id,
// msg.correlation_id = its correlation id) unless the follow-up sets them.
type FollowUp struct {
	out         *publisher.Publisher
	causation   string
	correlation string
	span        trace.SpanContext // the consumer's span (TraceMiddleware), if any
}

var _ message.Publisher = (*FollowUp)(nil)

// Publish writes msgs into messaging_outbox in the consumer's transaction;
// refusals are those of publisher.Publisher.Publish.
func (f *FollowUp) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if m == nil {
			continue // the outbox publisher refuses it with its own error
		}
		if m.Metadata.Get(envelope.KeyCausationID) == "" {
			envelope.SetCausationID(m, f.causation)
		}
		if envelope.CorrelationID(m) == "" {
			envelope.SetCorrelationID(m, f.correlation)
		}
		// A follow-up with no trace of its own continues the consumer's.
		if f.span.IsValid() && m.Metadata.Get(envelope.KeyTraceparent) == "" && !trace.SpanContextFromContext(m.Context()).IsValid() {
			m.SetContext(trace.ContextWithSpanContext(m.Context(), f.span))
		}
	}
	return f.out.Publish(topic, msgs...)
}

// Close stops the publisher; the middleware closes it when the handler returns.
func (f *FollowUp) Close() error { return f.out.Close() }

// Outbox returns the underlying outbox publisher (no causation linking).
func (f *FollowUp) Outbox() *publisher.Publisher { return f.out }

// Validate checks the arguments of Middleware: OUTBOX_INVALID_CONFIG for a
// nil db, a consumer name that is empty, longer than MaxConsumerLength, not
// UTF-8 or containing NUL, read-only TxOptions, or an invalid publisher
// configuration.
func Validate(db *sql.DB, consumer string, cfg Config) error {
	if db == nil {
		return outbox.Errorf(outbox.CodeInvalidConfig, "inbox.Middleware", "db must not be nil")
	}
	return validate(consumer, cfg)
}

// validate is Validate without the database, which NewMiddlewareOn takes
// in another form.
func validate(consumer string, cfg Config) error {
	const op = "inbox.Middleware"
	switch {
	case consumer == "":
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "consumer name must not be empty")
	case len(consumer) > MaxConsumerLength:
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "consumer name is %d bytes, at most %d allowed", len(consumer), MaxConsumerLength)
	case !utf8.ValidString(consumer) || strings.IndexByte(consumer, 0) >= 0:
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "consumer name must be valid UTF-8 without NUL bytes")
	case cfg.TxOptions != nil && cfg.TxOptions.ReadOnly:
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "TxOptions.ReadOnly: the consumer's transaction writes the inbox record, so it cannot be read-only")
	}
	return cfg.Publisher.Validate()
}

// NewMiddleware is Middleware that reports invalid arguments at construction.
func NewMiddleware(db *sql.DB, consumer string, cfg Config) (message.HandlerMiddleware, error) {
	if err := Validate(db, consumer, cfg); err != nil {
		return nil, err
	}
	return middleware(db, consumer, cfg, nil), nil
}

// Middleware returns the inbox middleware for consumer (see the package
// documentation). With invalid arguments (see Validate) every message fails
// with that error and is nacked, so nothing is processed without the inbox;
// use NewMiddleware to find out at construction. A message with an empty
// UUID fails with OUTBOX_MESSAGE_ID_REQUIRED: it cannot be de-duplicated;
// one the inbox cannot record fails with OUTBOX_MESSAGE_ID_TOO_LONG (longer
// than MaxMessageIDLength) or OUTBOX_INVALID_HEADER (a NUL byte or invalid
// UTF-8), before any transaction begins. A handler that returns produced
// messages fails with INBOX_PRODUCED_MESSAGES and nothing commits: emit
// follow-ups with Publisher(msg.Context()).
func Middleware(db *sql.DB, consumer string, cfg Config) message.HandlerMiddleware {
	return middleware(db, consumer, cfg, Validate(db, consumer, cfg))
}

// middleware builds the middleware from arguments validated once by the
// caller; invalid is what Validate returned for them.
//
// Each message's publisher.InTxWith validates cfg.Publisher again: the
// publisher package offers no entry point that skips it, and the check is a
// few string scans.
func middleware(db *sql.DB, consumer string, cfg Config, invalid error) message.HandlerMiddleware {
	logger := cfg.Logger
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			if invalid != nil {
				return nil, invalid
			}
			return handle(db, consumer, cfg, logger, h, msg)
		}
	}
}

// errAlreadyProcessed is how handle's transaction function reports a
// message id this consumer recorded before: InTxWith rolls back, handle acks.
var errAlreadyProcessed = errors.New("inbox: message already processed")

// checkID refuses a message the inbox cannot record: no UUID (it cannot be
// de-duplicated), one longer than MaxMessageIDLength, or one PostgreSQL
// text cannot hold (a NUL byte, invalid UTF-8; OUTBOX_INVALID_HEADER, as
// the envelope refuses such an id): the database would refuse its key, on
// every redelivery, without a code.
func checkID(msg *message.Message) error {
	const op = "inbox"
	if msg.UUID == "" {
		return outbox.Errorf(outbox.CodeMessageIDRequired, op, "message has no UUID; the inbox cannot recognise its redelivery")
	}
	if len(msg.UUID) > MaxMessageIDLength {
		return outbox.Errorf(outbox.CodeMessageIDTooLong, op, "message UUID is %d bytes, at most %d allowed: the inbox cannot record it (route such messages aside, e.g. with watermill's PoisonQueue middleware on this code)", len(msg.UUID), MaxMessageIDLength)
	}
	if why := pgtext.Unstorable(msg.UUID); why != "" {
		return outbox.Errorf(outbox.CodeInvalidHeader, op, "message UUID %.64q %s: the inbox cannot record it (route such messages aside, e.g. with watermill's PoisonQueue middleware on this code)", msg.UUID, why)
	}
	return nil
}

func handle(db *sql.DB, consumer string, cfg Config, logger watermill.LoggerAdapter, h message.HandlerFunc, msg *message.Message) ([]*message.Message, error) {
	if err := checkID(msg); err != nil {
		return nil, err
	}
	var (
		produced []*message.Message
		fnErr    error
	)
	// A panic in h goes on after InTxWith rolled back (watermill's
	// Recoverer, if installed, turns it into a nack).
	err := publisher.InTxWith(msg.Context(), db, cfg.Publisher, publisher.InTxOptions{TxOptions: cfg.TxOptions, Logger: logger},
		func(ctx context.Context, tx *sql.Tx, out *publisher.Publisher) error {
			produced, fnErr = run(ctx, tx, out, consumer, h, msg)
			return fnErr
		})
	switch {
	case err == nil:
		return nil, nil
	case errors.Is(err, errAlreadyProcessed): // even if the rollback failed: nothing was done
		logger.Debug("inbox: message already processed, skipping", watermill.LogFields{"consumer": consumer, "message_uuid": msg.UUID})
		return nil, nil
	case fnErr != nil:
		// The handler's error (or the refusal) as it is, joined with a
		// rollback failure if there was one.
		return produced, err
	default:
		// InTxWith's own: begin or commit.
		return nil, fmt.Errorf("inbox: %s: %w", msg.UUID, err)
	}
}

// run is the inbox transaction: the inbox record, then the handler with
// the transaction and a follow-up publisher in msg's context.
func run(ctx context.Context, tx *sql.Tx, out *publisher.Publisher, consumer string, h message.HandlerFunc, msg *message.Message) ([]*message.Message, error) {
	record := func(ctx context.Context) (int64, error) {
		res, err := tx.ExecContext(ctx, insertInbox, consumer, msg.UUID)
		if err != nil {
			return 0, err
		}
		return res.RowsAffected()
	}
	return runWith(ctx, &state{tx: tx}, record, out, consumer, h, msg)
}

// runWith is run on any driver: record writes the inbox record and returns
// the rows it inserted (0 when the message was processed before); st holds
// the transaction the handler gets.
func runWith(ctx context.Context, st *state, record func(context.Context) (int64, error), out *publisher.Publisher, consumer string, h message.HandlerFunc, msg *message.Message) ([]*message.Message, error) {
	const op = "inbox"
	n, err := record(ctx)
	if err != nil {
		return nil, fmt.Errorf("inbox: record %s: %w", msg.UUID, err)
	}
	if n == 0 {
		return nil, errAlreadyProcessed
	}

	st.pub = &FollowUp{
		out:         out,
		causation:   msg.UUID,
		correlation: envelope.CorrelationID(msg),
	}
	msg.SetContext(context.WithValue(ctx, ctxKey{}, st))
	defer msg.SetContext(ctx)

	produced, err := h(msg)
	if err != nil {
		return produced, err
	}
	if len(produced) > 0 {
		// Committing here and returning them would let the router publish
		// them after the inbox record is durable: a failed publish would
		// then be skipped on redelivery and the messages lost for good.
		return nil, outbox.Errorf(CodeProducedMessages, op,
			"handler returned %d produced message(s) for %s; use inbox.Publisher(msg.Context()) to emit follow-ups: they commit with the effect", len(produced), msg.UUID)
	}
	return nil, nil
}
