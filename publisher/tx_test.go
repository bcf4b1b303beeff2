package publisher_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"runtime"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/internal/pgerr"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/publisher"
)

// txEnv is a schema with an orders table for the InTx tests.
type txEnv struct {
	t  *testing.T
	db *sql.DB
	s  *testdb.Schema
}

func newTxEnv(t *testing.T) *txEnv {
	t.Helper()
	s := newSchema(t)
	_, err := s.DB.Exec(`CREATE TABLE orders (id int PRIMARY KEY)`)
	require.NoError(t, err)
	return &txEnv{t: t, db: s.DB, s: s}
}

func (e *txEnv) orders() int {
	e.t.Helper()
	var n int
	require.NoError(e.t, e.db.QueryRow(`SELECT count(*) FROM orders`).Scan(&n))
	return n
}

func (e *txEnv) messages(id string) int { e.t.Helper(); return e.s.Count(e.t, "message_id = $1", id) }

func show(t *testing.T, ctx context.Context, tx *sql.Tx, setting string) string {
	t.Helper()
	var v string
	require.NoError(t, tx.QueryRowContext(ctx, `SHOW `+setting).Scan(&v))
	return v
}

func TestInTxWithAppliesTheTransactionOptions(t *testing.T) {
	e := newTxEnv(t)
	ctx := context.Background()
	var serverDefault string
	require.NoError(t, e.db.QueryRow(`SHOW default_transaction_isolation`).Scan(&serverDefault))

	for i, tc := range []struct {
		opts *sql.TxOptions
		want string
	}{
		{nil, serverDefault},
		{&sql.TxOptions{}, serverDefault},
		{&sql.TxOptions{Isolation: sql.LevelReadCommitted}, "read committed"},
		{&sql.TxOptions{Isolation: sql.LevelRepeatableRead}, "repeatable read"},
		{&sql.TxOptions{Isolation: sql.LevelSerializable}, "serializable"},
	} {
		t.Run(tc.want, func(t *testing.T) {
			m := newMsg(t, "x")
			err := publisher.InTxWith(ctx, e.db, publisher.Config{}, publisher.InTxOptions{TxOptions: tc.opts},
				func(ctx context.Context, tx *sql.Tx, pub *publisher.Publisher) error {
					require.Equal(t, tc.want, show(t, ctx, tx, "transaction_isolation"))
					require.Equal(t, "off", show(t, ctx, tx, "transaction_read_only"))
					if _, err := tx.ExecContext(ctx, `INSERT INTO orders VALUES ($1)`, i); err != nil {
						return err
					}
					return pub.Publish("t", m)
				})
			require.NoError(t, err)
			require.Equal(t, 1, e.messages(m.UUID), "committed")
		})
	}
	require.Equal(t, 5, e.orders())
}

func TestInTxWithReadOnlyRefusesWrites(t *testing.T) {
	e := newTxEnv(t)
	ctx := context.Background()
	ro := publisher.InTxOptions{TxOptions: &sql.TxOptions{Isolation: sql.LevelSerializable, ReadOnly: true}}

	// The business write is refused by PostgreSQL; InTxWith returns fn's
	// error as it is and rolls back.
	err := publisher.InTxWith(ctx, e.db, publisher.Config{}, ro, func(ctx context.Context, tx *sql.Tx, _ *publisher.Publisher) error {
		require.Equal(t, "on", show(t, ctx, tx, "transaction_read_only"))
		require.Equal(t, "serializable", show(t, ctx, tx, "transaction_isolation"))
		_, err := tx.ExecContext(ctx, `INSERT INTO orders VALUES (1)`)
		return err
	})
	require.Equal(t, pgerr.ReadOnlySQLTransaction, pgerr.State(err), "%v", err)

	// So is the message, with the publisher's own code.
	m := newMsg(t, "x")
	err = publisher.InTxWith(ctx, e.db, publisher.Config{}, ro, func(_ context.Context, _ *sql.Tx, pub *publisher.Publisher) error {
		return pub.Publish("t", m)
	})
	require.ErrorIs(t, err, outbox.ErrTransactionRequired)
	require.Equal(t, outbox.CodeTransactionRequired, outbox.CodeOf(err))
	require.Zero(t, e.orders())
	require.Zero(t, e.messages(m.UUID))
}

func TestInTxWithRollsBackOnError(t *testing.T) {
	e := newTxEnv(t)
	ctx := context.Background()
	boom := errors.New("business rule violated")
	m := newMsg(t, "no")
	err := publisher.InTxWith(ctx, e.db, publisher.Config{},
		publisher.InTxOptions{TxOptions: &sql.TxOptions{Isolation: sql.LevelRepeatableRead}},
		func(ctx context.Context, tx *sql.Tx, pub *publisher.Publisher) error {
			_, err := tx.ExecContext(ctx, `INSERT INTO orders VALUES (1)`)
			require.NoError(t, err)
			require.NoError(t, pub.Publish("t", m))
			return boom
		})
	require.Same(t, boom, err, "fn's error is returned unchanged")
	require.Zero(t, e.orders())
	require.Zero(t, e.messages(m.UUID))

	// A refusal fn swallowed still fails the commit, with InTxWith's name.
	err = publisher.InTxWith(ctx, e.db, publisher.Config{}, publisher.InTxOptions{},
		func(ctx context.Context, tx *sql.Tx, _ *publisher.Publisher) error {
			_, err := tx.ExecContext(ctx, `INSERT INTO no_such_table VALUES (1)`)
			require.Error(t, err)
			_, _ = tx.ExecContext(ctx, `INSERT INTO orders VALUES (2)`)
			return nil
		})
	require.True(t, testdb.CommitOfAbortedTx(err), "%v", err)
	require.ErrorContains(t, err, "publisher.InTxWith: commit: ")
	require.Zero(t, e.orders())
}

func TestInTxWithHandsTheLoggerToThePublisher(t *testing.T) {
	e := newTxEnv(t)
	logger := watermill.NewCaptureLogger()
	m := newMsg(t, "x")
	require.NoError(t, publisher.InTxWith(context.Background(), e.db, publisher.Config{}, publisher.InTxOptions{Logger: logger},
		func(_ context.Context, _ *sql.Tx, pub *publisher.Publisher) error { return pub.Publish("t", m) }))
	require.NotEmpty(t, logger.Captured()[watermill.TraceLogLevel], "the publisher logged through the given logger")
}

func TestInTxWithRefusals(t *testing.T) {
	e := newTxEnv(t)
	ctx := context.Background()
	noop := func(context.Context, *sql.Tx, *publisher.Publisher) error { return nil }
	mustNotRun := func(context.Context, *sql.Tx, *publisher.Publisher) error {
		t.Error("fn must not run")
		return nil
	}
	require.ErrorIs(t, publisher.InTxWith(ctx, nil, publisher.Config{}, publisher.InTxOptions{}, noop), outbox.ErrInvalidConfig)
	require.ErrorIs(t, publisher.InTxWith(ctx, e.db, publisher.Config{}, publisher.InTxOptions{}, nil), outbox.ErrInvalidConfig)
	require.ErrorIs(t, publisher.InTxWith(ctx, e.db, publisher.Config{Producer: "a\x00b"}, publisher.InTxOptions{}, mustNotRun), outbox.ErrInvalidConfig)

	// An isolation level the driver cannot begin fails the begin.
	err := publisher.InTxWith(ctx, e.db, publisher.Config{}, publisher.InTxOptions{TxOptions: &sql.TxOptions{Isolation: sql.LevelLinearizable}}, mustNotRun)
	require.ErrorContains(t, err, "publisher.InTxWith: begin: ")
	require.Empty(t, outbox.CodeOf(err), "a driver error, not a refusal of ours")
}

func TestInTxPanicsAndGoexitRollBack(t *testing.T) {
	e := newTxEnv(t)
	e.db.SetMaxOpenConns(1) // a transaction left open would hold the only connection
	ctx := context.Background()
	opts := publisher.InTxOptions{TxOptions: &sql.TxOptions{Isolation: sql.LevelSerializable}}
	// write does what fn does before it fails; it reports with errors, not
	// require, because the Goexit cases run it off the test goroutine.
	write := func(ctx context.Context, tx *sql.Tx, pub *publisher.Publisher, id int) error {
		if _, err := tx.ExecContext(ctx, `INSERT INTO orders VALUES ($1)`, id); err != nil {
			return err
		}
		return pub.Publish("t", message.NewMessage(fmt.Sprintf("no-%d", id), nil))
	}

	var escaped *publisher.Publisher
	require.PanicsWithValue(t, "handler bug", func() {
		_ = publisher.InTxWith(ctx, e.db, publisher.Config{}, opts, func(ctx context.Context, tx *sql.Tx, pub *publisher.Publisher) error {
			escaped = pub
			require.NoError(t, write(ctx, tx, pub, 1))
			panic("handler bug")
		})
	})
	require.ErrorIs(t, escaped.Publish("t", newMsg(t, "x")), outbox.ErrPublisherClosed, "a publisher never outlives its transaction")
	require.Zero(t, e.db.Stats().InUse, "the connection went back to the pool")

	// runtime.Goexit (t.FailNow inside fn, for one) is no panic: recover
	// cannot see it, and the transaction must not stay open either.
	type fnType = func(context.Context, *sql.Tx, *publisher.Publisher) error
	for i, tc := range []struct {
		name string
		run  func(context.Context, fnType) error
	}{
		{"InTx", func(ctx context.Context, fn fnType) error { return publisher.InTx(ctx, e.db, publisher.Config{}, fn) }},
		{"InTxWith", func(ctx context.Context, fn fnType) error {
			return publisher.InTxWith(ctx, e.db, publisher.Config{}, opts, fn)
		}},
	} {
		t.Run(tc.name+" Goexit", func(t *testing.T) {
			// Should the transaction stay open after all, cancelling its
			// context when the subtest ends frees the connection, so the
			// failure is reported instead of the test hanging.
			ctx, cancel := context.WithCancel(context.Background())
			t.Cleanup(cancel)
			var (
				pub      *publisher.Publisher
				writeErr error
				returned bool
			)
			done := make(chan struct{})
			go func() {
				defer close(done)
				_ = tc.run(ctx, func(ctx context.Context, tx *sql.Tx, p *publisher.Publisher) error {
					pub = p
					writeErr = write(ctx, tx, p, 2+i)
					runtime.Goexit()
					return nil
				})
				returned = true
			}()
			<-done
			require.NoError(t, writeErr)
			require.False(t, returned)
			require.ErrorIs(t, pub.Publish("t", newMsg(t, "x")), outbox.ErrPublisherClosed)
			require.Zero(t, e.db.Stats().InUse, "the connection went back to the pool")
		})
	}
	require.Zero(t, e.orders())
	require.Zero(t, e.s.Count(t, ""))
}
