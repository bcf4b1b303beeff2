// Package cdcrelay is a native Go CDC relay: it streams the inserts committed
// to messaging_outbox from a PostgreSQL logical replication slot (pgoutput,
// github.com/jackc/pglogrepl) and publishes each one to any watermill
// message.Publisher, through the same envelope the polling forwarder uses. It
// is the in-process alternative to a Debezium connector (package debezium).
//
// # What it guarantees
//
//   - Committed inserts only, in commit order. The slot streams a
//     transaction only after it committed (pgoutput protocol 1, no
//     streaming of in-progress transactions), so an insert that was rolled
//     back is never published. The publication is insert-only
//     (debezium.PublicationSQL: WITH (publish = 'insert')), and the relay
//     also ignores any update, delete or truncate a wider publication would
//     send, so the forwarder's status updates and retention's deletes never
//     become messages.
//   - The same message as the polling relay. Each INSERT is decoded by column
//     name from the relation message (text format: bytea hex, jsonb headers,
//     timestamps, integers) into an envelope.Row and rebuilt with
//     envelope.ToMessage: msg.UUID is message_id, the payload is the stored
//     bytes, application headers and every canonical msg.* column come back
//     as metadata, trace context in the message context.
//   - At least once, never past an unconfirmed message. The relay publishes
//     synchronously and tells the server a transaction is done (a standby
//     status update whose flush position becomes the slot's
//     confirmed_flush_lsn) only after the publisher returned nil for every
//     message of that transaction. A refused publish is retried with
//     exponential backoff (RetryInitial..RetryMax) under the same id, with
//     the position unchanged; after MaxPublishAttempts (if set) Run returns
//     CDC_PUBLISH_FAILED and the next Run, from the slot's confirmed
//     position, delivers the transaction again. A crash anywhere has the
//     same effect. Messages of a transaction that were published before the
//     failure are published again: consumers deduplicate by message id
//     (package inbox).
//   - One relay per slot. A second Run on a slot that is being streamed is
//     refused with CDC_SLOT_IN_USE (PostgreSQL allows one consumer per slot).
//
// Nothing marks rows PUBLISHED in CDC mode: purge with retention's
// ByCreatedAt mode.
//
// # Relay-mode exclusivity
//
// The relay refuses to start (RELAY_MODE_CONFLICT, the debezium package's
// code) unless debezium.CurrentMode says CDC. While streaming it re-reads the
// mode between replication messages, at the first one after StandbyTimeout
// has passed since the previous re-read (sooner when the server asks for a
// reply): when an operator switches back to POLLING (`outboxctl debezium
// disable`), Run stops with RELAY_MODE_CONFLICT at the next such re-read,
// which is within one StandbyTimeout only while no message is being
// delivered. A publish the
// downstream refuses is retried (the server still gets status updates, the
// mode is not re-read) until it succeeds or MaxPublishAttempts is spent, so
// with MaxPublishAttempts 0 a refusing downstream delays the stop without
// bound; the message is published in POLLING mode, then Run stops before
// the next one. A re-read that fails (Config.DB unreachable) is logged and
// streaming goes on. The check is not atomic with publishing: stop the
// relay before disabling, as for a Debezium connector. The switch to CDC is
// `outboxctl debezium enable` (debezium.Enable), which refuses while polling
// forwarders' heartbeats are live, so the two relays never run together.
//
// # When to create the slot
//
// A slot streams only what is committed after it was created. Rows inserted
// while no relay ran (the forwarders are stopped, the slot does not exist
// yet) would never be published. So create the slot and publication while the
// forwarders are still running, then switch:
//
//  1. Create the publication (debezium.PublicationSQL) and the slot
//     (SELECT pg_create_logical_replication_slot('<slot>', 'pgoutput')),
//     or call [Relay.Prepare], which does both in any relay mode. (Run's
//     CreateSlot creates the slot only once the mode is CDC, i.e. after the
//     forwarders stopped: rows they left unpublished would be stranded.)
//  2. Stop the forwarders and wait until the backlog they left is empty or
//     accept that the relay re-publishes: every insert since step 1 is in
//     the slot, including rows the forwarders already published
//     (duplicates, never losses).
//  3. `outboxctl debezium enable`, then start the relay.
//
// A slot keeps WAL until it is confirmed: a relay that stays down makes the
// server keep WAL without bound (set max_slot_wal_keep_size, monitor
// pg_replication_slots). While the outbox is idle the relay confirms the
// server's keepalive position between transactions, so an idle slot does not
// hold WAL.
//
// # Connections
//
// Config.ConnString is a replication connection (replication=database is
// added when missing); the relay pins TimeZone=UTC, DateStyle=ISO and
// bytea_output=hex on it because the tuple text depends on them. Config.DB is
// an ordinary pool on the same database whose search_path resolves
// Config.Schema; the relay reads the relay mode and the catalogs through it
// (the replication protocol cannot bind parameters). Run refuses a DB whose
// current schema is not Config.Schema (OUTBOX_INVALID_CONFIG).
//
// The server needs wal_level=logical, a free replication slot and a free WAL
// sender (max_replication_slots, max_wal_senders), and the user the
// REPLICATION attribute.
package cdcrelay
