package sqlv4

import (
	stdsql "database/sql"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/publisher"
)

// Schema is a watermill-sql v4 SchemaAdapter writing into messaging_outbox.
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

// InsertQuery returns the single statement that writes params.Msgs, or the
// envelope's refusal for the first invalid message (nothing is written).
func (s Schema) InsertQuery(params wsql.InsertQueryParams) (wsql.Query, error) {
	st, err := publisher.BuildInsert(params.Topic, params.Msgs, s.config())
	if err != nil {
		return wsql.Query{}, err
	}
	return wsql.Query{Query: st.SQL, Args: st.Args}, nil
}

// SelectQuery refuses with OUTBOX_SUBSCRIBE_UNSUPPORTED.
func (s Schema) SelectQuery(params wsql.SelectQueryParams) (wsql.Query, error) {
	return wsql.Query{}, outbox.Errorf(publisher.CodeSubscribeUnsupported, "sqlv4.Schema.SelectQuery", "%s", publisher.SubscribeUnsupportedDetail)
}

// UnmarshalMessage refuses with OUTBOX_SUBSCRIBE_UNSUPPORTED.
func (s Schema) UnmarshalMessage(params wsql.UnmarshalMessageParams) (wsql.Row, error) {
	return wsql.Row{}, outbox.Errorf(publisher.CodeSubscribeUnsupported, "sqlv4.Schema.UnmarshalMessage", "%s", publisher.SubscribeUnsupportedDetail)
}

// SchemaInitializingQueries returns nothing: migrations.Up owns the tables,
// and DDL must never run inside a business transaction.
func (s Schema) SchemaInitializingQueries(params wsql.SchemaInitializingQueriesParams) ([]wsql.Query, error) {
	return nil, nil
}

// SubscribeIsolationLevel is required by the interface; nothing subscribes.
func (s Schema) SubscribeIsolationLevel() stdsql.IsolationLevel { return stdsql.LevelDefault }
