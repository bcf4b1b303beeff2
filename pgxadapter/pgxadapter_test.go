package pgxadapter_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/pgxadapter"
	"github.com/fencedoutbox/watermill-outbox/publisher"
)

func pool(t *testing.T, s *testdb.Schema) *pgxpool.Pool {
	t.Helper()
	p, err := pgxpool.New(context.Background(), s.URL)
	require.NoError(t, err)
	t.Cleanup(p.Close)
	return p
}

func count(t *testing.T, s *testdb.Schema, id string) int {
	t.Helper()
	return s.Count(t, "message_id = $1", id)
}

func TestPublishInAPgxTransaction(t *testing.T) {
	ctx := context.Background()
	s := testdb.New(t)
	p := pool(t, s)

	m := message.NewMessage(watermill.NewUUID(), []byte(`{"order":1}`))
	m.Metadata.Set("x-app", "v")
	tx, err := p.Begin(ctx)
	require.NoError(t, err)
	pub, err := pgxadapter.NewPublisher(tx, publisher.Config{}, nil)
	require.NoError(t, err)
	require.NoError(t, pub.Publish("orders", m, message.NewMessage(watermill.NewUUID(), []byte("x"))))
	require.Zero(t, count(t, s, m.UUID), "not visible before the service's commit")
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, 1, count(t, s, m.UUID))

	// A rolled-back transaction leaves nothing.
	r := message.NewMessage(watermill.NewUUID(), nil)
	tx, err = p.Begin(ctx)
	require.NoError(t, err)
	pub, err = pgxadapter.NewPublisher(tx, publisher.Config{}, nil)
	require.NoError(t, err)
	require.NoError(t, pub.Publish("orders", r))
	require.NoError(t, tx.Rollback(ctx))
	require.Zero(t, count(t, s, r.UUID))
}

// The refusals on pgx.Tx carry the codes they carry on database/sql with
// lib/pq (publisher's own suite, run on both drivers).
func TestPgxRefusalsHaveTheSameCodes(t *testing.T) {
	ctx := context.Background()
	s := testdb.New(t)
	p := pool(t, s)

	t.Run("duplicate id", func(t *testing.T) {
		m := message.NewMessage(watermill.NewUUID(), nil)
		tx, err := p.Begin(ctx)
		require.NoError(t, err)
		pub, err := pgxadapter.NewPublisher(tx, publisher.Config{}, nil)
		require.NoError(t, err)
		require.NoError(t, pub.Publish("t", m))
		err = pub.Publish("t", message.NewMessage(m.UUID, nil))
		require.ErrorIs(t, err, outbox.ErrDuplicateMessageID)
		require.Equal(t, outbox.CodeDuplicateMessageID, outbox.CodeOf(err))
		// The refusal aborted the transaction: the next publish says so.
		err = pub.Publish("t", message.NewMessage(watermill.NewUUID(), nil))
		require.Equal(t, outbox.CodeTransactionRequired, outbox.CodeOf(err), "aborted (25P02): %v", err)
		require.ErrorContains(t, err, "aborted")
		require.NoError(t, tx.Rollback(ctx))
	})
	t.Run("read-only", func(t *testing.T) {
		tx, err := p.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(ctx) }()
		pub, err := pgxadapter.NewPublisher(tx, publisher.Config{}, nil)
		require.NoError(t, err)
		err = pub.Publish("t", message.NewMessage(watermill.NewUUID(), nil))
		require.Equal(t, outbox.CodeTransactionRequired, outbox.CodeOf(err), "read-only (25006): %v", err)
		require.ErrorContains(t, err, "read-only")
	})
	t.Run("outside a transaction", func(t *testing.T) {
		tx, err := p.Begin(ctx)
		require.NoError(t, err)
		pub, err := pgxadapter.NewPublisher(tx, publisher.Config{}, nil)
		require.NoError(t, err)
		require.NoError(t, tx.Commit(ctx))
		m := message.NewMessage(watermill.NewUUID(), nil)
		err = pub.Publish("t", m)
		require.ErrorIs(t, err, outbox.ErrTransactionRequired)
		require.ErrorIs(t, err, pgx.ErrTxClosed, "pgx's own error stays in the chain")
		require.Zero(t, count(t, s, m.UUID))

		_, err = pgxadapter.NewPublisher(nil, publisher.Config{}, nil)
		require.Equal(t, outbox.CodeTransactionRequired, outbox.CodeOf(err))
	})
	t.Run("envelope and config refusals", func(t *testing.T) {
		tx, err := p.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(ctx) }()
		_, err = pgxadapter.NewPublisher(tx, publisher.Config{Prepared: &publisher.Prepared{}}, nil)
		require.Equal(t, outbox.CodeInvalidConfig, outbox.CodeOf(err))
		pub, err := pgxadapter.NewPublisher(tx, publisher.Config{}, nil)
		require.NoError(t, err)
		err = pub.Publish("", message.NewMessage(watermill.NewUUID(), nil))
		require.Equal(t, outbox.CodeTopicRequired, outbox.CodeOf(err))
	})
}

func TestNewListenerRefusesWhatPgxCannotParse(t *testing.T) {
	_, err := pgxadapter.NewListener("postgres://app:s3cret@127.0.0.1:5432/test?sslmode=nonsense")
	require.Equal(t, outbox.CodeInvalidConfig, outbox.CodeOf(err))
	require.NotContains(t, err.Error(), "s3cret")
	_, err = pgxadapter.NewListener("postgres://app:s3cret@127.0.0.1:5432/test?pool_max_conns=5&statement_cache_capacity=10")
	require.NoError(t, err, "pgx and pgxpool parameters are the pgx listener's to use")
}

// A forwarder polling once an hour relays a row within moments of the
// commit: the publisher's NOTIFY (Config.Notify) reaches the pgx listener.
func TestForwarderWakesOnNotifyThroughThePgxListener(t *testing.T) {
	ctx := context.Background()
	s := testdb.New(t)
	p := pool(t, s)
	l, err := pgxadapter.NewListener(s.URL + "&pool_max_conns=2")
	require.NoError(t, err)

	delivered := make(chan string, 10)
	passes := make(chan struct{}, 100)
	f, err := forwarder.New(s.DB, publisherFunc(func(_ string, msgs ...*message.Message) error {
		for _, m := range msgs {
			delivered <- m.UUID
		}
		return nil
	}), nil, forwarder.Config{
		Listener: l, PollInterval: time.Hour, MaxPollInterval: time.Hour,
		OnReport: func(forwarder.Report) {
			select {
			case passes <- struct{}{}:
			default:
			}
		},
	})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	<-f.Running()
	<-passes // the first pass found nothing; the next poll is an hour away

	// The listener wakes the relay once connected; publish until a row is
	// relayed (the first commit may come before LISTEN is in place).
	deadline := time.After(15 * time.Second)
	var want []string
	for got := false; !got; {
		m := message.NewMessage(watermill.NewUUID(), nil)
		want = append(want, m.UUID)
		tx, err := p.Begin(ctx)
		require.NoError(t, err)
		pub, err := pgxadapter.NewPublisher(tx, publisher.Config{Notify: true}, nil)
		require.NoError(t, err)
		require.NoError(t, pub.Publish("orders", m))
		require.NoError(t, tx.Commit(ctx))
		select {
		case id := <-delivered:
			require.Contains(t, want, id)
			got = true
		case <-time.After(time.Second):
		case <-deadline:
			t.Fatal("no row was relayed after NOTIFY within 15 s")
		}
	}
	// Now the listener is connected (its wake after connecting is spent):
	// a further commit is relayed only because its NOTIFY arrives.
	m := message.NewMessage(watermill.NewUUID(), nil)
	tx, err := p.Begin(ctx)
	require.NoError(t, err)
	pub, err := pgxadapter.NewPublisher(tx, publisher.Config{Notify: true}, nil)
	require.NoError(t, err)
	require.NoError(t, pub.Publish("orders", m))
	require.NoError(t, tx.Commit(ctx))
	for id := ""; id != m.UUID; {
		select {
		case id = <-delivered: // a late one from the loop above, or m
		case <-time.After(15 * time.Second):
			t.Fatal("the row published with NOTIFY was not relayed within 15 s")
		}
	}
	require.NoError(t, f.Close())
	require.NoError(t, <-done)
}

type publisherFunc func(topic string, msgs ...*message.Message) error

func (f publisherFunc) Publish(topic string, msgs ...*message.Message) error {
	return f(topic, msgs...)
}
func (publisherFunc) Close() error { return nil }

// embeddedTx is a pgx.Tx of the caller's own making.
type embeddedTx struct{ pgx.Tx }

// A pgx.Tx holding a nil pointer passes tx == nil; it is refused as a nil tx
// is, not left to panic on the first Publish.
func TestNewPublisherRefusesTypedNilTx(t *testing.T) {
	var own *embeddedTx
	var pooled *pgxpool.Tx
	for name, tx := range map[string]pgx.Tx{"nil": nil, "nil *embeddedTx": own, "nil *pgxpool.Tx": pooled} {
		pub, err := pgxadapter.NewPublisher(tx, publisher.Config{}, nil)
		require.Nil(t, pub, name)
		require.ErrorIs(t, err, outbox.ErrTransactionRequired, name)
		require.Equal(t, outbox.CodeTransactionRequired, outbox.CodeOf(err), name)
	}
}
