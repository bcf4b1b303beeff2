package publisher_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/publisher"
)

func prepared(t *testing.T, db *sql.DB) *publisher.Prepared {
	t.Helper()
	p, err := publisher.Prepare(context.Background(), db)
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// With a pool of one connection the transaction holds the only connection;
// a prepared Publish must run on it and never wait for another.
func TestPreparedPublishNeedsNoSecondConnection(t *testing.T) {
	s := newSchema(t)
	db := s.Open(t)
	db.SetMaxOpenConns(1)
	prep := prepared(t, db)
	for range 3 {
		tx := begin(t, db, nil)
		pub, err := publisher.New(tx, publisher.Config{Prepared: prep}, nil)
		require.NoError(t, err)
		require.NoError(t, pub.Publish("orders", msgs(t, 1)...))
		require.NoError(t, pub.Publish("orders", msgs(t, 3)...))
		require.NoError(t, tx.Commit())
	}
	require.Equal(t, 12, s.Count(t, "true"))
	// Prepare put its 16 statements (12, and the 4 with the ordering-key
	// lock) on the only connection; the publishes reused them (none prepared
	// again) and closing each transaction's handle deallocated none.
	var n int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM pg_prepared_statements WHERE NOT from_sql`).Scan(&n))
	require.Equal(t, 16, n)
}

// A duplicate id is refused with the same typed error whether the statement
// was prepared or not, and aborts the transaction the same way.
func TestPreparedDuplicateAcrossCallsIsRefused(t *testing.T) {
	s := newSchema(t)
	prep := prepared(t, s.DB)
	m := newMsg(t, "x")
	tx := begin(t, s.DB, nil)
	pub, err := publisher.New(tx, publisher.Config{Prepared: prep}, nil)
	require.NoError(t, err)
	require.NoError(t, pub.Publish("orders", m))
	err = pub.Publish("orders", newMsg(t, "y"), m)
	require.ErrorIs(t, err, outbox.ErrDuplicateMessageID)
	require.Equal(t, outbox.CodeDuplicateMessageID, outbox.CodeOf(err))
	require.NoError(t, tx.Rollback())
	require.Zero(t, s.Count(t, "true"))
}

// Statements prepared on one pool cannot run in a transaction of another:
// refused with OUTBOX_INVALID_CONFIG, nothing written, and the transaction
// still usable.
func TestPreparedOnAnotherPoolIsRefused(t *testing.T) {
	s := newSchema(t)
	other := s.Open(t)
	prep := prepared(t, other)
	tx := begin(t, s.DB, nil)
	pub, err := publisher.New(tx, publisher.Config{Prepared: prep}, nil)
	require.NoError(t, err)
	err = pub.Publish("orders", newMsg(t, "x"))
	require.Equal(t, outbox.CodeInvalidConfig, outbox.CodeOf(err), "%v", err)
	var oe *outbox.Error
	require.True(t, errors.As(err, &oe))
	require.Contains(t, oe.Detail, "another *sql.DB")
	_, err = tx.Exec(`SELECT 1`)
	require.NoError(t, err, "the refusal happened before any SQL: the transaction is not aborted")
	require.NoError(t, tx.Commit())
	require.Zero(t, s.Count(t, "true"))
}

// A closed Prepared is refused with OUTBOX_INVALID_CONFIG and writes nothing.
func TestClosedPreparedIsRefused(t *testing.T) {
	s := newSchema(t)
	prep := prepared(t, s.DB)
	require.NoError(t, prep.Close())
	require.NoError(t, prep.Close(), "Close twice is harmless")
	tx := begin(t, s.DB, nil)
	pub, err := publisher.New(tx, publisher.Config{Prepared: prep}, nil)
	require.NoError(t, err)
	err = pub.Publish("orders", newMsg(t, "x"))
	require.Equal(t, outbox.CodeInvalidConfig, outbox.CodeOf(err), "%v", err)
	require.NoError(t, tx.Commit())
	require.Zero(t, s.Count(t, "true"))
}

// Prepare needs the table: before the migrations it fails, and a nil pool is
// refused with OUTBOX_INVALID_CONFIG.
func TestPrepareRefusals(t *testing.T) {
	_, err := publisher.Prepare(context.Background(), nil)
	require.Equal(t, outbox.CodeInvalidConfig, outbox.CodeOf(err))

	s := newSchema(t)
	_, err = s.DB.Exec(`ALTER TABLE messaging_outbox RENAME TO messaging_outbox_elsewhere`)
	require.NoError(t, err)
	_, err = publisher.Prepare(context.Background(), s.DB)
	require.ErrorContains(t, err, "messaging_outbox")
}

// Prepared's doc says a connection that has not prepared the statements yet
// (here: the new one after the server ended the only connection) prepares
// them inside the transaction: Publish works there without a second
// connection.
func TestPreparedAfterALostConnection(t *testing.T) {
	s := newSchema(t)
	db := s.Open(t)
	db.SetMaxOpenConns(1)
	prep := prepared(t, db)
	var pid int
	require.NoError(t, db.QueryRow(`SELECT pg_backend_pid()`).Scan(&pid))
	var ended bool
	require.NoError(t, s.DB.QueryRow(`SELECT pg_terminate_backend($1, 5000)`, pid).Scan(&ended))
	require.True(t, ended)

	var tx *sql.Tx
	var err error
	for range 2 { // the pool may hand out the dead connection once
		if tx, err = db.Begin(); err == nil {
			if _, err = tx.Exec(`SELECT 1`); err == nil {
				break
			}
			_ = tx.Rollback()
		}
	}
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback() })
	pub, err := publisher.New(tx, publisher.Config{Prepared: prep}, nil)
	require.NoError(t, err)
	require.NoError(t, pub.Publish("orders", msgs(t, 2)...))
	require.NoError(t, tx.Commit())
	require.Equal(t, 2, s.Count(t, "true"))
}
