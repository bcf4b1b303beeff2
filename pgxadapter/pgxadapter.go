// Package pgxadapter lets a service on pgx (pgxpool, pgx.Tx) use the outbox
// without database/sql or lib/pq:
//
//   - NewPublisher binds the outbox publisher to a pgx.Tx: messages are
//     written in the service's own transaction, and refusals carry the same
//     codes as on database/sql (a duplicate id is
//     OUTBOX_DUPLICATE_MESSAGE_ID; a read-only (25006), aborted (25P02) or
//     finished transaction is OUTBOX_TRANSACTION_REQUIRED).
//   - Listener is a forwarder.Listener on a pgx connection, so the forwarder
//     wakes on the publisher's NOTIFY: forwarder.Config{Listener: l}.
//   - InboxMiddleware is the inbox on a pgxpool: the inbox record, the
//     handler's writes (InboxTx(ctx) is the pgx.Tx) and its follow-ups commit
//     in one pgx transaction.
//   - The forwarder itself runs on a *sql.DB; a pgx service gets one from
//     its pool with stdlib.OpenDBFromPool(pool) (pgx's own database/sql
//     bridge, no second driver).
//
// It is its own module, so services on lib/pq never get pgx through the
// outbox.
package pgxadapter

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"

	"github.com/fencedoutbox/watermill-outbox/internal/typednil"
	"github.com/fencedoutbox/watermill-outbox/publisher"
)

// NewPublisher binds an outbox publisher to tx (see publisher.NewOnTx): it
// never commits or rolls back tx. A nil tx (a nil pointer in a pgx.Tx
// included) is refused with OUTBOX_TRANSACTION_REQUIRED, an invalid cfg or a
// cfg with Prepared with OUTBOX_INVALID_CONFIG.
func NewPublisher(tx pgx.Tx, cfg publisher.Config, logger watermill.LoggerAdapter) (*publisher.Publisher, error) {
	if typednil.Is(tx) {
		return publisher.NewOnTx(nil, cfg, logger)
	}
	return publisher.NewOnTx(txAdapter{tx}, cfg, logger)
}

// txAdapter is a publisher.Tx on a pgx.Tx.
type txAdapter struct{ tx pgx.Tx }

func (a txAdapter) Exec(ctx context.Context, query string, args ...any) error {
	_, err := a.ExecAffected(ctx, query, args...)
	return err
}

// ExecAffected makes txAdapter an inbox.DriverTx too.
func (a txAdapter) ExecAffected(ctx context.Context, query string, args ...any) (int64, error) {
	tag, err := a.tx.Exec(ctx, query, args...)
	if errors.Is(err, pgx.ErrTxClosed) {
		// pgx's sentinel for a finished transaction: the publisher knows
		// database/sql's.
		return 0, fmt.Errorf("%w: %w", sql.ErrTxDone, err)
	}
	return tag.RowsAffected(), err
}
