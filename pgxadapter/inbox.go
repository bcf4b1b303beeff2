package pgxadapter

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/inbox"
)

// InboxMiddleware is inbox.NewMiddleware on a pgxpool: each message's inbox
// record, the handler's own writes (InboxTx(msg.Context()) is the pgx.Tx)
// and its follow-ups (inbox.Publisher(msg.Context())) commit in one pgx
// transaction, and a redelivered message is acked without running the
// handler again. cfg.TxOptions maps to pgx.TxOptions (isolation level;
// ReadOnly is refused, as by inbox.Validate). Refusals: OUTBOX_INVALID_CONFIG
// for a nil pool, an isolation level pgx has no name for, and everything
// inbox.NewMiddleware refuses.
func InboxMiddleware(pool *pgxpool.Pool, consumer string, cfg inbox.Config) (message.HandlerMiddleware, error) {
	const op = "pgxadapter.InboxMiddleware"
	if pool == nil {
		return nil, outbox.Errorf(outbox.CodeInvalidConfig, op, "pool must not be nil")
	}
	var opts pgx.TxOptions
	if cfg.TxOptions != nil {
		iso, ok := isoLevels[cfg.TxOptions.Isolation]
		if !ok {
			return nil, outbox.Errorf(outbox.CodeInvalidConfig, op, "TxOptions.Isolation %s has no PostgreSQL equivalent", cfg.TxOptions.Isolation)
		}
		opts.IsoLevel = iso
	}
	return inbox.NewMiddlewareOn(transactor{pool: pool, opts: opts}, consumer, cfg)
}

var isoLevels = map[sql.IsolationLevel]pgx.TxIsoLevel{
	sql.LevelDefault:         "",
	sql.LevelReadUncommitted: pgx.ReadUncommitted,
	sql.LevelReadCommitted:   pgx.ReadCommitted,
	sql.LevelRepeatableRead:  pgx.RepeatableRead,
	sql.LevelSerializable:    pgx.Serializable,
}

// InboxTx returns the consumer's pgx transaction inside a handler wrapped by
// InboxMiddleware, or nil outside one.
func InboxTx(ctx context.Context) pgx.Tx {
	if a, ok := inbox.DriverTxFrom(ctx).(txAdapter); ok {
		return a.tx
	}
	return nil
}

type transactor struct {
	pool *pgxpool.Pool
	opts pgx.TxOptions
}

func (t transactor) InTx(ctx context.Context, fn func(context.Context, inbox.DriverTx) error) error {
	tx, err := t.pool.BeginTx(ctx, t.opts)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	finished := false
	defer func() {
		if !finished { // fn panicked: roll back before the panic goes on
			_ = tx.Rollback(context.WithoutCancel(ctx))
		}
	}()
	fnErr := fn(ctx, txAdapter{tx})
	finished = true
	if fnErr != nil {
		if rbErr := tx.Rollback(context.WithoutCancel(ctx)); rbErr != nil && !errors.Is(rbErr, pgx.ErrTxClosed) {
			return errors.Join(fnErr, fmt.Errorf("rollback: %w", rbErr))
		}
		return fnErr
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	return nil
}
