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
package sqlv4
