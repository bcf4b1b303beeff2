package publisher

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"

	outbox "github.com/fencedoutbox/watermill-outbox"
)

// InTx begins a transaction on db, binds a Publisher to it and runs fn. When
// fn returns nil the transaction commits, so the business change and the
// messages become visible together; when fn returns an error, panics or
// exits its goroutine (runtime.Goexit, as t.FailNow does) it rolls back, so
// neither does (a panic goes on unchanged after the rollback).
// InTx returns fn's error unchanged (joined with a rollback failure, if any)
// or the commit's error.
//
// fn must use tx for its business statements and must not commit or roll
// back itself. If fn ignores a database refusal (for example a duplicate
// message id), PostgreSQL has already aborted the transaction and the commit
// fails: InTx then returns the commit error, never a silent success.
//
// It refuses a nil db or fn and an invalid cfg with OUTBOX_INVALID_CONFIG
// before beginning anything. InTx is InTxWith with the zero InTxOptions:
// a read-write transaction at the server's default isolation, no logging.
func InTx(ctx context.Context, db *sql.DB, cfg Config, fn func(ctx context.Context, tx *sql.Tx, pub *Publisher) error) error {
	return inTx(ctx, "publisher.InTx", db, cfg, InTxOptions{}, fn)
}

// InTxOptions tunes InTxWith. The zero value is what InTx does.
type InTxOptions struct {
	// TxOptions is passed to db.BeginTx (isolation level, read-only). nil:
	// read-write at the server's default isolation
	// (default_transaction_isolation, READ COMMITTED unless configured). A
	// read-only transaction refuses every Publish with
	// OUTBOX_TRANSACTION_REQUIRED; an isolation level the driver does not
	// support fails the begin. Under REPEATABLE READ or SERIALIZABLE a
	// statement or the commit can fail with a serialization failure
	// (SQLSTATE 40001): run InTxWith again.
	TxOptions *sql.TxOptions
	// Logger is handed to the Publisher bound to the transaction; nil logs
	// nothing.
	Logger watermill.LoggerAdapter
}

// InTxWith is InTx with options for the transaction and the Publisher:
//
//	err := publisher.InTxWith(ctx, db, cfg,
//		publisher.InTxOptions{TxOptions: &sql.TxOptions{Isolation: sql.LevelSerializable}, Logger: logger},
//		func(ctx context.Context, tx *sql.Tx, pub *publisher.Publisher) error { ... })
//
// Commit, rollback, panics, the errors returned and the refusals are those of
// InTx; its own errors name publisher.InTxWith.
func InTxWith(ctx context.Context, db *sql.DB, cfg Config, opts InTxOptions, fn func(ctx context.Context, tx *sql.Tx, pub *Publisher) error) error {
	return inTx(ctx, "publisher.InTxWith", db, cfg, opts, fn)
}

// inTx is InTx and InTxWith; op names the caller in errors.
func inTx(ctx context.Context, op string, db *sql.DB, cfg Config, opts InTxOptions, fn func(ctx context.Context, tx *sql.Tx, pub *Publisher) error) error {
	if db == nil {
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "db is nil")
	}
	if fn == nil {
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "fn is nil")
	}
	if err := cfg.Validate(); err != nil {
		return err
	}
	tx, err := db.BeginTx(ctx, opts.TxOptions)
	if err != nil {
		return fmt.Errorf("%s: begin: %w", op, err)
	}
	pub := bind(tx, cfg, opts.Logger) // cfg validated above
	// A flag rather than recover: a panic is never intercepted (it goes on
	// with its value and stack untouched), and runtime.Goexit, which recover
	// cannot see, rolls back too instead of leaving the transaction, and its
	// connection, open.
	finished := false
	defer func() {
		if !finished {
			_ = pub.Close()
			_ = tx.Rollback()
		}
	}()
	fnErr := fn(ctx, tx, pub)
	finished = true
	_ = pub.Close() // fn's publisher must not outlive the transaction
	if fnErr != nil {
		if rbErr := tx.Rollback(); rbErr != nil && !errors.Is(rbErr, sql.ErrTxDone) {
			return errors.Join(fnErr, fmt.Errorf("%s: rollback: %w", op, rbErr))
		}
		return fnErr
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("%s: commit: %w", op, err)
	}
	return nil
}
