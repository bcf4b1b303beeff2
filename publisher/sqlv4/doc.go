// Package sqlv4 makes watermill-sql v4's own publisher write into
// messaging_outbox, so a service that already publishes through
// github.com/ThreeDotsLabs/watermill-sql/v4 changes one line:
//
//	pub, err := sql.NewPublisher(sql.TxFromStdSQL(tx), sql.PublisherConfig{
//		SchemaAdapter: sqlv4.Schema{Config: publisher.Config{Producer: "billing"}},
//	}, logger)
//
// Rows follow the same envelope rules as publisher.Publisher (one statement
// per Publish call using msgs[0].Context(), every message validated before it
// is sent, reserved msg.* keys, tenant and header checks, the optional
// wake-up NOTIFY), and the refusals are the same *outbox.Error values,
// wrapped by watermill-sql so errors.Is still matches them. What differs from
// publisher.Publisher: database refusals are not mapped (a duplicate id
// across calls surfaces as the driver's unique_violation), and a
// non-transactional executor makes each Publish commit on its own, so the
// outbox guarantee (row and business change together) is then the caller's
// to keep.
//
// Only the write side is supported: SelectQuery and UnmarshalMessage return
// OUTBOX_SUBSCRIBE_UNSUPPORTED, because the forwarder, not watermill-sql's
// subscriber, reads messaging_outbox. SchemaInitializingQueries returns
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
// publisher/sqlv4's TestWatermillSQLInOrderThroughTheOutbox runs watermill's
// TestPublishSubscribeInOrder through this path at the forwarder's defaults.
package sqlv4
