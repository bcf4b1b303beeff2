// Package debezium is the Debezium side of the CDC relay mode: the outbox
// event router configuration generated from the schema and a model of the
// records that connector emits. The database-enforced choice between the
// polling forwarder and CDC is package relaymode.
//
// # One source for the connector configuration
//
// [Generate] builds the PostgreSQL connector configuration with the
// io.debezium.transforms.outbox.EventRouter transform; [Config.WriteJSON]
// (Kafka Connect REST) and [Config.WriteProperties] (standalone) write it with
// sorted keys. The header mapping, [Placements], is derived from
// envelope.CanonicalKeys, and a test checks every column of messaging_outbox
// against it, so a new column cannot silently stay behind. The shipped files
// debezium/outbox-connector.json and .properties are written by the same code
// (`go run ./debezium/internal/gen`, `go generate ./debezium`, or
// `outboxctl debezium config`), and a test fails when they differ.
//
// The router is configured as follows:
//
//   - event id = message_id (the router always writes it to the "id" header;
//     it is also placed as "_watermill_message_uuid", the header
//     watermill-kafka reads msg.UUID from);
//   - key = routing_key, the generated COALESCE(partition_key, message_id):
//     the same key the polling relay uses, never the destination (which would
//     put every message of a topic on one partition);
//   - payload = payload, passed through as bytes (BinaryDataConverter);
//   - topic = TopicPrefix + destination (route.by.field, route.topic.replacement);
//   - record timestamp = created_at. The router accepts only an INT64
//     Timestamp/MicroTimestamp/NanoTimestamp column, and the connector turns
//     timestamptz into a ZonedTimestamp string, so it reads created_at_utc, a
//     stored generated column (migration 00020) holding created_at in UTC
//     without time zone. The Kafka timestamp has millisecond precision.
//   - every canonical column becomes a header named by its envelope key
//     (msg.producer, msg.occurred_at, msg.correlation_id, msg.causation_id,
//     msg.tenant, msg.partition_key, msg.ordering_key, msg.traceparent,
//     msg.tracestate, msg.baggage, msg.schema_subject, msg.schema_version,
//     msg.content_type, msg.message_type, msg.aggregate_type,
//     msg.aggregate_id, msg.aggregate_version), plus watermill's
//     "correlation_id", as the polling relay's envelope.ToMessage does.
//
// # What Debezium cannot do, and what we do instead
//
// Application headers: the router cannot spread a jsonb column into one
// header per key. The headers column travels as ONE header, "msg.headers",
// holding PostgreSQL's jsonb text (e.g. {"x-a": "1"}).
//
// NULL columns: the router does not skip a placed column that is NULL; it
// adds the header with a null value (on the Kafka wire a header whose value
// length is -1). It cannot be told otherwise, and Kafka Connect's DropHeaders
// drops by name only. watermill-kafka's unmarshaler turns such a header into
// an empty string. The record model lists them in
// [EmittedRecord.NullHeaders]; they never appear as empty strings in
// [EmittedRecord.Headers].
//
// Defaults: the router has no fallbacks, so msg.occurred_at is absent (null)
// when occurred_at is NULL, where the polling relay falls back to created_at
// (the Kafka record timestamp carries created_at), and msg.producer is not
// filled with a relay identity.
//
// A watermill consumer calls [ExpandMetadata] on each message's metadata to
// get exactly the polling relay's view: null-valued canonical headers
// removed, msg.headers spread back into application keys, "id" dropped.
//
// Timestamps in headers: msg.occurred_at is rendered like Debezium's
// ZonedTimestamp (UTC, "Z", fraction only as long as needed, at most
// microseconds: [ZonedTimestamp]). Some connector versions pad the fraction to
// the column precision (DBZ-5996); both forms parse with time.RFC3339Nano.
// This is the one detail of the model not confirmed against a running
// connector.
//
// # Inserts only
//
// The forwarder is stopped in CDC mode, but retention deletes rows and an
// operator may update them; neither may become an event. Three layers:
//
//  1. The publication publishes inserts only. Create it before the
//     connector starts, with the statement [PublicationSQL] returns:
//     CREATE PUBLICATION "messaging_outbox_cdc" FOR TABLE
//     "public"."messaging_outbox", "public"."messaging_cdc_heartbeat"
//     WITH (publish = 'insert'). The configuration sets
//     publication.autocreate.mode=disabled, so the connector fails rather
//     than create a publication of every operation when this step was
//     skipped.
//  2. skipped.operations=u,d,t: the connector drops updates, deletes and
//     truncates even if the publication sends them.
//  3. table.op.invalid.behavior=warn: an update that still reached the
//     router is skipped with a warning (the router always ignores deletes).
//
// A Debezium connector marks nothing PUBLISHED, so under a connector
// retention must purge by created_at past the horizon (the retention
// package's created_at mode), not by status. (The native relay, package
// cdcrelay, marks what it delivered.)
//
// # Heartbeat, snapshot, publication
//
// The configuration sets heartbeat.interval.ms (Options.HeartbeatIntervalMS,
// default 10 s) and heartbeat.action.query ([HeartbeatActionQuery]): each
// heartbeat inserts a row into messaging_cdc_heartbeat (migration 00040),
// which is in the publication and in table.include.list, so the connector
// receives a change and confirms its position even while the outbox is idle
// in a busy database (otherwise the slot retains WAL without bound); the
// same statement writes the connector's CDC heartbeat (see below) and trims
// heartbeat rows older than an hour. A TopicNameMatches predicate keeps the
// heartbeat table's records out of the event router. snapshot.mode=no_data
// (Debezium 2.6+; use "never" on older versions) streams from the slot and
// never snapshots the table, whose existing rows, PUBLISHED ones included,
// would otherwise all become events. publication.autocreate.mode=disabled:
// the connector never creates a publication (with "filtered" it would
// create one publishing every operation); create the insert-only one with
// [PublicationSQL]. The slot is [DefaultSlotName], the native relay's
// default too: one slot, one consumer.
//
// # Relay-mode exclusivity
//
// Which relay may run (POLLING or CDC), the switch between them and the
// heartbeats of both kinds live in package relaymode; the connector's
// heartbeat action query above writes one of those heartbeats (kind CDC), so
// relaymode.Disable refuses while a connector is live.
package debezium
