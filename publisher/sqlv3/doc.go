// Package sqlv3 makes watermill-sql v3's own publisher write into
// messaging_outbox, so a service that already publishes through
// github.com/ThreeDotsLabs/watermill-sql/v3 changes one line:
//
//	pub, err := sql.NewPublisher(tx, sql.PublisherConfig{
//		SchemaAdapter: sqlv3.Schema{Config: publisher.Config{Producer: "billing"}},
//	}, logger)
//
// Rows follow the same envelope rules as publisher.Publisher (one statement
// per Publish call, every message validated before it is sent, reserved
// msg.* keys, tenant and header checks, the optional wake-up NOTIFY), and the
// refusals are the same *outbox.Error values, wrapped by watermill-sql
// ("cannot create insert query: ...") so errors.Is still matches them.
// What differs from publisher.Publisher: watermill-sql executes with
// context.Background() rather than msgs[0].Context() (trace context is still
// taken from each message's own context), it does not map database refusals
// (a duplicate id across calls surfaces as the driver's unique_violation), and
// it accepts a *sql.DB, in which case each Publish commits on its own and the
// outbox guarantee (row and business change together) is the caller's to keep.
//
// Only the write side is supported. watermill-sql's subscriber must not read
// messaging_outbox (the forwarder claims its rows with fencing): the v3
// interface cannot return an error from SelectQuery, so the query it returns
// fails in PostgreSQL with a message naming that reason, and UnmarshalMessage
// returns OUTBOX_SUBSCRIBE_UNSUPPORTED. SchemaInitializingQueries returns
// nothing: the tables come from migrations.Up.
//
// Topic order: watermill's components/forwarder republished one message at a
// time, so consumers saw each topic in publishing order. By default the
// adapter keeps that: a message without an ordering key gets its topic as
// ordering key (publisher.Config.KeyUnkeyedByTopic), and the forwarder
// publishes each key in seq order. The cost is that one topic drains as one
// chain (one publish in flight per topic), a failing message holds its
// topic's later ones until it is parked, and consumers see msg.ordering_key
// set to the topic. Schema{UnorderedTopics: true} turns it off.
// TestWatermillSQLv3InOrderThroughTheOutbox runs watermill's
// TestPublishSubscribeInOrder through this path at the forwarder's defaults.
package sqlv3
