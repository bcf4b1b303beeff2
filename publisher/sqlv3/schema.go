package sqlv3

import (
	stdsql "database/sql"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/publisher"
)

// refuseSubscribe is what SelectQuery returns. The v3 interface has no error
// result, so the refusal is made by PostgreSQL: casting the bound reason to
// integer fails with "invalid input syntax for type integer: <reason>", which
// watermill-sql's subscriber logs. No row is read and nothing is locked.
const refuseSubscribe = `SELECT $1::text::integer`

// Schema is a watermill-sql v3 SchemaAdapter writing into messaging_outbox.
// The zero value is usable.
type Schema struct {
	// Config is applied as publisher.Publisher applies it (producer default,
	// wake-up NOTIFY, limits), except that KeyUnkeyedByTopic is on unless
	// UnorderedTopics is set.
	Config publisher.Config

	// UnorderedTopics turns off what the adapter does by default: a message
	// without an ordering key gets its topic as ordering key
	// (publisher.Config.KeyUnkeyedByTopic), so the forwarder publishes each
	// topic in the order it was written, as watermill-sql with watermill's
	// forwarder did. Set it only when the consumers do not need a topic's
	// order: the forwarder then publishes a topic's messages up to
	// forwarder.Config.Concurrency at once, and neighbours can arrive
	// swapped.
	UnorderedTopics bool
}

// config is the publisher.Config the adapter writes with.
func (s Schema) config() publisher.Config {
	c := s.Config
	if !s.UnorderedTopics {
		c.KeyUnkeyedByTopic = true
	}
	return c
}

var _ wsql.SchemaAdapter = Schema{}

// InsertQuery returns the single statement that writes msgs, or the
// envelope's refusal for the first invalid message (nothing is written).
func (s Schema) InsertQuery(topic string, msgs message.Messages) (wsql.Query, error) {
	st, err := publisher.BuildInsert(topic, msgs, s.config())
	if err != nil {
		return wsql.Query{}, err
	}
	return wsql.Query{Query: st.SQL, Args: st.Args}, nil
}

// SelectQuery returns a query that PostgreSQL refuses, naming the reason:
// see the package documentation.
func (s Schema) SelectQuery(topic string, consumerGroup string, offsetsAdapter wsql.OffsetsAdapter) wsql.Query {
	return wsql.Query{Query: refuseSubscribe, Args: []any{"OUTBOX_SUBSCRIBE_UNSUPPORTED: " + publisher.SubscribeUnsupportedDetail}}
}

// UnmarshalMessage refuses with OUTBOX_SUBSCRIBE_UNSUPPORTED.
func (s Schema) UnmarshalMessage(row wsql.Scanner) (wsql.Row, error) {
	return wsql.Row{}, outbox.Errorf(publisher.CodeSubscribeUnsupported, "sqlv3.Schema.UnmarshalMessage", "%s", publisher.SubscribeUnsupportedDetail)
}

// SchemaInitializingQueries returns nothing: migrations.Up owns the tables,
// and DDL must never run inside a business transaction.
func (s Schema) SchemaInitializingQueries(topic string) []wsql.Query { return nil }

// SubscribeIsolationLevel is required by the interface; nothing subscribes.
func (s Schema) SubscribeIsolationLevel() stdsql.IsolationLevel { return stdsql.LevelDefault }
