package sqlv4_test

import (
	"context"
	"testing"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/publisher"
	"github.com/fencedoutbox/watermill-outbox/publisher/sqlv4"
)

func TestWatermillSQLv4PublisherWritesIntoTheOutbox(t *testing.T) {
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(4)
	tx, err := s.DB.BeginTx(context.Background(), nil)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()

	pub, err := wsql.NewPublisher(wsql.TxFromStdSQL(tx), wsql.PublisherConfig{
		SchemaAdapter: sqlv4.Schema{Config: publisher.Config{Producer: "legacy-svc"}},
	}, nil)
	require.NoError(t, err)

	a := message.NewMessage("v4-a", []byte(`{"n":1}`))
	envelope.SetMessageType(a, "OrderPaid")
	a.Metadata.Set("x-emoji", "🚀")
	b := message.NewMessage("v4-b", []byte(`{"n":2}`))
	require.NoError(t, pub.Publish("orders.paid", a, b))

	bad := message.NewMessage("v4-bad", nil)
	envelope.SetTenant(bad, "NOT A SLUG")
	err = pub.Publish("orders.paid", message.NewMessage("v4-c", nil), bad)
	require.ErrorIs(t, err, outbox.ErrInvalidTenant)

	require.Zero(t, s.Count(t, ""), "nothing is visible before the caller commits")
	require.NoError(t, tx.Commit())
	require.NoError(t, pub.Close())

	require.Equal(t, 2, s.Count(t, ""))
	r, err := envelope.ScanRow(s.DB.QueryRow(`SELECT ` + envelope.SelectColumns + ` FROM messaging_outbox WHERE message_id = 'v4-a'`))
	require.NoError(t, err)
	require.Equal(t, "OrderPaid", r.MessageType)
	require.Equal(t, "legacy-svc", r.Producer)
	require.Equal(t, "v4-a", r.RoutingKey)
	require.Equal(t, map[string]string{"x-emoji": "🚀"}, r.Headers)
}

func TestWatermillSQLv4UsesTheFirstMessageContext(t *testing.T) {
	s := testdb.New(t)
	tx, err := s.DB.BeginTx(context.Background(), nil)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	pub, err := wsql.NewPublisher(wsql.TxFromStdSQL(tx), wsql.PublisherConfig{SchemaAdapter: sqlv4.Schema{}}, nil)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	m := message.NewMessage("v4-ctx", nil)
	m.SetContext(ctx)
	require.ErrorIs(t, pub.Publish("t", m), context.Canceled)
}

func TestWatermillSQLv4SubscriberSideRefuses(t *testing.T) {
	schema := sqlv4.Schema{}
	qs, err := schema.SchemaInitializingQueries(wsql.SchemaInitializingQueriesParams{Topic: "t"})
	require.NoError(t, err)
	require.Empty(t, qs, "migrations.Up owns the tables")
	_, err = schema.SelectQuery(wsql.SelectQueryParams{Topic: "t"})
	require.ErrorIs(t, err, publisher.ErrSubscribeUnsupported)
	_, err = schema.UnmarshalMessage(wsql.UnmarshalMessageParams{})
	require.ErrorIs(t, err, publisher.ErrSubscribeUnsupported)
}

func TestWatermillSQLv4KeysUnkeyedMessagesByTopicUnlessUnordered(t *testing.T) {
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(4)
	for _, c := range []struct {
		schema sqlv4.Schema
		id     string
		want   string
	}{
		{sqlv4.Schema{}, "v4-topic-key", "orders.paid"},
		{sqlv4.Schema{UnorderedTopics: true}, "v4-unordered", ""},
	} {
		pub, err := wsql.NewPublisher(wsql.BeginnerFromStdSQL(s.DB), wsql.PublisherConfig{SchemaAdapter: c.schema}, nil)
		require.NoError(t, err)
		require.NoError(t, pub.Publish("orders.paid", message.NewMessage(c.id, nil)))
		require.NoError(t, pub.Close())
		r, err := envelope.ScanRow(s.DB.QueryRow(`SELECT `+envelope.SelectColumns+` FROM messaging_outbox WHERE message_id = $1`, c.id))
		require.NoError(t, err)
		require.Equal(t, c.want, r.OrderingKey, c.id)
	}
}
