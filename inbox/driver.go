package inbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/internal/typednil"
	"github.com/fencedoutbox/watermill-outbox/publisher"
)

// DriverTx is the consumer's transaction on a driver that is not
// database/sql (pgxadapter gives one on pgx.Tx): the outbox publisher's Exec
// (publisher.Tx) and the number of rows a statement affected.
type DriverTx interface {
	publisher.Tx
	ExecAffected(ctx context.Context, query string, args ...any) (int64, error)
}

// Transactor begins a transaction of another driver, runs fn in it, commits
// when fn returns nil and rolls back otherwise. It returns fn's error as it
// is (joined with a rollback failure, if any), or its own begin or commit
// error.
type Transactor interface {
	InTx(ctx context.Context, fn func(ctx context.Context, tx DriverTx) error) error
}

// NewMiddlewareOn is NewMiddleware for a driver that is not database/sql:
// the inbox record, the handler and its follow-ups (Publisher(ctx)) run in
// a transaction tr begins. Inside the handler, DriverTxFrom(ctx) returns
// that transaction (pgxadapter.InboxTx gives the pgx.Tx); Tx(ctx) is nil.
// Config.TxOptions is the Transactor's to honour (pgxadapter maps it).
// Refusals are NewMiddleware's; a nil tr is OUTBOX_INVALID_CONFIG.
func NewMiddlewareOn(tr Transactor, consumer string, cfg Config) (message.HandlerMiddleware, error) {
	if typednil.Is(tr) {
		return nil, outbox.Errorf(outbox.CodeInvalidConfig, "inbox.Middleware", "the Transactor must not be nil")
	}
	if err := validate(consumer, cfg); err != nil {
		return nil, err
	}
	logger := cfg.Logger
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			return handleOn(tr, consumer, cfg, logger, h, msg)
		}
	}, nil
}

// DriverTxFrom returns the consumer's transaction inside a handler wrapped
// by NewMiddlewareOn, or nil outside one.
func DriverTxFrom(ctx context.Context) DriverTx {
	if s, ok := ctx.Value(ctxKey{}).(*state); ok {
		return s.driverTx
	}
	return nil
}

func handleOn(tr Transactor, consumer string, cfg Config, logger watermill.LoggerAdapter, h message.HandlerFunc, msg *message.Message) ([]*message.Message, error) {
	if err := checkID(msg); err != nil {
		return nil, err
	}
	var (
		produced []*message.Message
		fnErr    error
	)
	err := tr.InTx(msg.Context(), func(ctx context.Context, tx DriverTx) error {
		out, err := publisher.NewOnTx(tx, cfg.Publisher, logger)
		if err != nil {
			fnErr = err
			return err
		}
		defer out.Close() // fn's publisher must not outlive the transaction
		record := func(ctx context.Context) (int64, error) { return tx.ExecAffected(ctx, insertInbox, consumer, msg.UUID) }
		produced, fnErr = runWith(ctx, &state{driverTx: tx}, record, out, consumer, h, msg)
		return fnErr
	})
	switch {
	case err == nil:
		return nil, nil
	case errors.Is(err, errAlreadyProcessed):
		logger.Debug("inbox: message already processed, skipping", watermill.LogFields{"consumer": consumer, "message_uuid": msg.UUID})
		return nil, nil
	case fnErr != nil:
		return produced, err
	default:
		return nil, fmt.Errorf("inbox: %s: %w", msg.UUID, err)
	}
}
