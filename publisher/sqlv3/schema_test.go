package sqlv3_test

import (
	"context"
	"strings"
	"testing"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/publisher"
	"github.com/fencedoutbox/watermill-outbox/publisher/sqlv3"
)

func TestWatermillSQLv3PublisherWritesIntoTheOutbox(t *testing.T) {
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(4)
	tx, err := s.DB.BeginTx(context.Background(), nil)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()

	pub, err := wsql.NewPublisher(tx, wsql.PublisherConfig{
		SchemaAdapter: sqlv3.Schema{Config: publisher.Config{Producer: "legacy-svc"}},
	}, nil)
	require.NoError(t, err)

	a := message.NewMessage("v3-a", []byte(`{"n":1}`))
	envelope.SetTenant(a, "acme")
	envelope.SetPartitionKey(a, "k1")
	a.Metadata.Set("x-trailing", `back\`)
	b := message.NewMessage("v3-b", []byte(`{"n":2}`))
	require.NoError(t, pub.Publish("orders.paid", a, b))

	// Refusals come back typed through watermill-sql's wrapping, and write nothing.
	bad := message.NewMessage("v3-bad", nil)
	bad.Metadata.Set("msg.unknown", "x")
	err = pub.Publish("orders.paid", message.NewMessage("v3-c", nil), bad)
	require.ErrorIs(t, err, outbox.ErrReservedHeader)
	err = pub.Publish("orders.paid", message.NewMessage("v3-dup", nil), message.NewMessage("v3-dup", nil))
	require.ErrorIs(t, err, outbox.ErrDuplicateMessageID)

	require.Zero(t, s.Count(t, ""), "nothing is visible before the caller commits")
	require.NoError(t, tx.Commit())
	require.NoError(t, pub.Close())

	require.Equal(t, 2, s.Count(t, ""))
	r, err := envelope.ScanRow(s.DB.QueryRow(`SELECT ` + envelope.SelectColumns + ` FROM messaging_outbox WHERE message_id = 'v3-a'`))
	require.NoError(t, err)
	require.Equal(t, "orders.paid", r.Destination)
	require.Equal(t, `{"n":1}`, string(r.Payload))
	require.Equal(t, "acme", r.Tenant)
	require.Equal(t, "k1", r.RoutingKey)
	require.Equal(t, "legacy-svc", r.Producer)
	require.Equal(t, map[string]string{"x-trailing": `back\`}, r.Headers)
	var seqA, seqB int64
	require.NoError(t, s.DB.QueryRow(`SELECT (SELECT seq FROM messaging_outbox WHERE message_id='v3-a'), (SELECT seq FROM messaging_outbox WHERE message_id='v3-b')`).Scan(&seqA, &seqB))
	require.Less(t, seqA, seqB)
}

func TestWatermillSQLv3RollbackWritesNothing(t *testing.T) {
	s := testdb.New(t)
	tx, err := s.DB.BeginTx(context.Background(), nil)
	require.NoError(t, err)
	pub, err := wsql.NewPublisher(tx, wsql.PublisherConfig{SchemaAdapter: sqlv3.Schema{}}, nil)
	require.NoError(t, err)
	require.NoError(t, pub.Publish("t", message.NewMessage("v3-rb", nil)))
	require.NoError(t, tx.Rollback())
	require.Zero(t, s.Count(t, ""))
}

func TestWatermillSQLv3SubscriberSideRefuses(t *testing.T) {
	s := testdb.New(t)
	schema := sqlv3.Schema{}
	require.Empty(t, schema.SchemaInitializingQueries("t"), "migrations.Up owns the tables")

	_, err := schema.UnmarshalMessage(nil)
	require.ErrorIs(t, err, publisher.ErrSubscribeUnsupported)

	q := schema.SelectQuery("t", "group", nil)
	_, err = s.DB.Exec(q.Query, q.Args...)
	require.Error(t, err, "the select query is refused by PostgreSQL")
	require.True(t, strings.Contains(err.Error(), string(publisher.CodeSubscribeUnsupported)), err.Error())
	require.Contains(t, err.Error(), "forwarder")
}

func TestWatermillSQLv3KeysUnkeyedMessagesByTopicUnlessUnordered(t *testing.T) {
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(4)
	for _, c := range []struct {
		schema sqlv3.Schema
		id     string
		want   string
	}{
		{sqlv3.Schema{}, "v3-topic-key", "orders.paid"},
		{sqlv3.Schema{UnorderedTopics: true}, "v3-unordered", ""},
	} {
		pub, err := wsql.NewPublisher(s.DB, wsql.PublisherConfig{SchemaAdapter: c.schema}, nil)
		require.NoError(t, err)
		require.NoError(t, pub.Publish("orders.paid", message.NewMessage(c.id, nil)))
		require.NoError(t, pub.Close())
		r, err := envelope.ScanRow(s.DB.QueryRow(`SELECT `+envelope.SelectColumns+` FROM messaging_outbox WHERE message_id = $1`, c.id))
		require.NoError(t, err)
		require.Equal(t, c.want, r.OrderingKey, c.id)
	}
}
