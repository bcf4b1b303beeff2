// Package e2e is the end-to-end flow every transport test runs: a business
// transaction writes an order and publishes through the outbox publisher,
// another transaction does the same and rolls back, one forwarder pass relays
// the committed rows to the transport's publisher, and the test checks what
// the transport's subscriber received with Check.
package e2e

import (
	"context"
	"database/sql"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/publisher"
)

const createOrders = `CREATE TABLE orders (id text PRIMARY KEY)`
const insertOrder = `INSERT INTO orders (id) VALUES ($1)`

// RolledBackID is the id of the message published in the rolled-back
// transaction; it must never reach a broker.
const RolledBackID = "e2e-rolled-back"

var errRollback = errors.New("business rule says no")

// Messages returns fresh copies of the committed messages: two share a
// partition key, all carry an application header and canonical metadata.
func Messages() []*message.Message {
	var out []*message.Message
	for i, id := range []string{"e2e-order-1", "e2e-order-2", "e2e-order-3"} {
		m := message.NewMessage(id, []byte(`{"order":"`+id+`"}`))
		m.Metadata.Set("app-header", "value-"+id)
		envelope.SetMessageType(m, "OrderPlaced")
		envelope.SetCorrelationID(m, "corr-e2e")
		envelope.SetTenant(m, "acme")
		if i < 2 {
			envelope.SetPartitionKey(m, "customer-1")
		}
		out = append(out, m)
	}
	return out
}

// Relay runs the whole write side against a fresh schema and one forwarder
// pass into out, classified by classify, and returns the pass report.
func Relay(t *testing.T, topic string, out message.Publisher, classify forwarder.Classifier) forwarder.Report {
	t.Helper()
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(4)
	ctx := context.Background()
	_, err := s.DB.ExecContext(ctx, createOrders)
	require.NoError(t, err)

	for _, m := range Messages() {
		err := publisher.InTx(ctx, s.DB, publisher.Config{Producer: "e2e-test"}, func(ctx context.Context, tx *sql.Tx, pub *publisher.Publisher) error {
			if _, err := tx.ExecContext(ctx, insertOrder, m.UUID); err != nil {
				return err
			}
			return pub.Publish(topic, m)
		})
		require.NoError(t, err)
	}
	err = publisher.InTx(ctx, s.DB, publisher.Config{}, func(ctx context.Context, tx *sql.Tx, pub *publisher.Publisher) error {
		if _, err := tx.ExecContext(ctx, insertOrder, RolledBackID); err != nil {
			return err
		}
		if err := pub.Publish(topic, message.NewMessage(RolledBackID, []byte("never"))); err != nil {
			return err
		}
		return errRollback
	})
	require.ErrorIs(t, err, errRollback)
	require.Equal(t, 0, s.Count(t, "message_id = $1", RolledBackID))

	fwd, err := forwarder.New(s.DB, out, nil, forwarder.Config{
		Classifier:     classify,
		PublishTimeout: 10 * time.Second,
		LeaseDuration:  30 * time.Second,
	})
	require.NoError(t, err)
	rep, err := fwd.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, len(Messages()), rep.Published, "report: %+v", rep)
	require.Equal(t, len(Messages()), s.Count(t, "status = 'PUBLISHED'"))
	return rep
}

// Check asserts that got holds exactly the committed messages with their
// UUID, payload, application header and canonical metadata.
func Check(t *testing.T, got []*message.Message) {
	t.Helper()
	want := map[string]*message.Message{}
	for _, m := range Messages() {
		want[m.UUID] = m
	}
	require.Len(t, got, len(want))
	for _, g := range got {
		w, ok := want[g.UUID]
		require.True(t, ok, "unexpected message %q", g.UUID)
		require.NotEqual(t, RolledBackID, g.UUID)
		require.Equal(t, string(w.Payload), string(g.Payload))
		require.Equal(t, w.Metadata.Get("app-header"), g.Metadata.Get("app-header"))
		require.Equal(t, "OrderPlaced", g.Metadata.Get(envelope.KeyMessageType))
		require.Equal(t, "corr-e2e", g.Metadata.Get(envelope.KeyCorrelationID))
		require.Equal(t, "acme", g.Metadata.Get(envelope.KeyTenant))
		require.Equal(t, "e2e-test", g.Metadata.Get(envelope.KeyProducer))
		require.Equal(t, w.Metadata.Get(envelope.KeyPartitionKey), g.Metadata.Get(envelope.KeyPartitionKey))
		require.NotEmpty(t, g.Metadata.Get(envelope.KeyOccurredAt))
		delete(want, g.UUID)
	}
	require.Empty(t, want)
}

// Receive collects n messages from ch (acking each) or fails at the deadline.
func Receive(t *testing.T, ch <-chan *message.Message, n int, timeout time.Duration) []*message.Message {
	t.Helper()
	var got []*message.Message
	deadline := time.After(timeout)
	for len(got) < n {
		select {
		case m, ok := <-ch:
			require.True(t, ok, "subscription closed after %d of %d messages", len(got), n)
			m.Ack()
			got = append(got, m)
		case <-deadline:
			t.Fatalf("received %d of %d messages before the deadline", len(got), n)
		}
	}
	return got
}
