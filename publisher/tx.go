package publisher

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	outbox "github.com/fencedoutbox/watermill-outbox"
)

// InTx begins a transaction on db, binds a Publisher to it and runs fn. When
// fn returns nil the transaction commits, so the business change and the
// messages become visible together; when fn returns an error or panics it
// rolls back, so neither does (a panic is re-raised after the rollback).
// InTx returns fn's error unchanged (joined with a rollback failure, if any)
// or the commit's error.
//
// fn must use tx for its business statements and must not commit or roll
// back itself. If fn ignores a database refusal (for example a duplicate
// message id), PostgreSQL has already aborted the transaction and the commit
// fails: InTx then returns the commit error, never a silent success.
//
// It refuses a nil db or fn and an invalid cfg with OUTBOX_INVALID_CONFIG
// before beginning anything.
func InTx(ctx context.Context, db *sql.DB, cfg Config, fn func(ctx context.Context, tx *sql.Tx, pub *Publisher) error) (err error) {
	const op = "publisher.InTx"
	if db == nil {
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "db is nil")
	}
	if fn == nil {
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "fn is nil")
	}
	if err := cfg.Validate(); err != nil {
		return err
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("%s: begin: %w", op, err)
	}
	pub, err := New(tx, cfg, nil)
	if err != nil {
		_ = tx.Rollback()
		return err
	}
	defer func() {
		if p := recover(); p != nil {
			_ = pub.Close()
			_ = tx.Rollback()
			panic(p)
		}
	}()
	if fnErr := fn(ctx, tx, pub); fnErr != nil {
		_ = pub.Close()
		if rbErr := tx.Rollback(); rbErr != nil && !errors.Is(rbErr, sql.ErrTxDone) {
			return errors.Join(fnErr, fmt.Errorf("%s: rollback: %w", op, rbErr))
		}
		return fnErr
	}
	_ = pub.Close()
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("%s: commit: %w", op, err)
	}
	return nil
}
