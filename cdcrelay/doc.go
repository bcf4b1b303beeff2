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
//   - At least once, never past an unconfirmed message, and nothing twice
//     without a fault. The relay holds up to BatchSize inserts of a
//     transaction, reads their status in one query and skips the rows that
//     are already PUBLISHED (the forwarders published them before the
//     switch to CDC, or this relay before a restart) or parked
//     FAILED/EXHAUSTED; a row it cannot find (retention deleted it) is
//     published. It publishes the rest synchronously, in commit order, then
//     marks them PUBLISHED (the forwarder's change, with a new lease token)
//     in one statement, and only then tells the server the transaction is
//     done (the standby status update whose flush position becomes the
//     slot's confirmed_flush_lsn). Whenever a session ends (Close, an error,
//     a refused publish) what the downstream accepted is marked first; a
//     clean stop then ends the stream with CopyDone and waits for the
//     walsender's answer, which comes only once the server has
//     taken the last position sent (closing without it, a walsender busy
//     writing could exit without reading that position, and the next
//     session delivered the last transactions again). So
//     the forwarders after a switch back to POLLING, and a restarted relay,
//     skip what was delivered; retention by status and the backlog gauges
//     are truthful in CDC mode. Only a crash between a publish and its mark
//     (or a database unreachable for the mark) delivers a message again:
//     consumers deduplicate by message id (package inbox).
//   - Marks see the rows they mark. The walsender sends a transaction as
//     soon as its commit record is flushed, which can be a moment before
//     the committing backend leaves the proc array; until then the rows are
//     invisible to other sessions. A mark that misses rows waits for the
//     transaction (pg_xact_status) and marks again (found by
//     TestHandoverRoundTrip: without it, a few rows per run were delivered
//     by both relays).
//   - A refusing downstream never holds a walsender. A refused publish ends
//     the replication session: the relay marks what was accepted, closes
//     the connection, backs off (RetryInitial..RetryMax) with no walsender
//     open, and streams again from the slot's confirmed position; the marked
//     rows are skipped, so the refused message is the next one published.
//     A fast shutdown or a failover of PostgreSQL therefore completes during
//     a downstream outage (a walsender waits for its client to confirm the
//     end of the WAL before the server stops). After MaxPublishAttempts (if
//     set) Run returns CDC_PUBLISH_FAILED.
//   - One relay per slot, one CDC consumer per database. A second Run on a
//     slot that is being streamed is refused with CDC_SLOT_IN_USE
//     (PostgreSQL allows one consumer per slot). The default slot,
//     messaging_outbox_cdc, is the Debezium connector's default too. A
//     relay on another slot while a CDC consumer's heartbeat is live is
//     refused with CDC_SECOND_CONSUMER (relaymode.BeatCDC).
//
// # Relay-mode exclusivity
//
// The relay refuses to start (RELAY_MODE_CONFLICT) unless relaymode.CurrentMode
// says CDC, and registers a CDC heartbeat (relaymode.BeatCDC: kind CDC, its
// slot, alive HeartbeatTTL). It renews the heartbeat, which re-reads the
// mode under the mode row's lock, at the first publish or loop turn after
// HeartbeatInterval: a publish happens only while the last successful
// heartbeat is younger than HeartbeatTTL. A renewal that fails (or blocks,
// cut at what is left of the heartbeat's life) is logged and tolerated while
// the last successful one is alive; once none has succeeded for
// HeartbeatTTL the relay stops with CDC_HEARTBEAT_LAPSED, publishing nothing
// more (TestHeartbeatLapseStopsTheRelay). A refused renewal (the mode is no
// longer CDC, or another slot's consumer is live) stops it at once. `outboxctl debezium disable` (relaymode.Disable)
// refuses while any CDC heartbeat is live, so the mode cannot go back to
// POLLING under a live relay: stop the relay (it marks what it delivered and
// removes its heartbeat), then disable. A mode changed behind Disable's back
// (a hand-written UPDATE) stops the relay at its next heartbeat, at most
// HeartbeatInterval later; a publish already in the publisher is finished.
// Polling forwarders refuse to start (relaymode.Beat) while a CDC heartbeat
// is live, and `outboxctl debezium enable` refuses while theirs are.
//
// # When to create the slot
//
// A slot streams only what is committed after it was created. So create it
// while the forwarders still run, then switch:
//
//  1. [Relay.Prepare] (any relay mode) creates the publication
//     (debezium.PublicationSQL) and the slot. It creates the slot over the
//     replication protocol and reads the snapshot exported at the slot's
//     consistent point: the rows visible in it are exactly those committed
//     before the slot. The highest seq of an undelivered one among them is
//     recorded in messaging_cdc_slot (migration 00040).
//  2. Wait until [UndeliveredBeforeSlot] is 0: the running forwarders
//     deliver those rows. Stop the forwarders.
//  3. `outboxctl debezium enable`, then start the relay. Rows the
//     forwarders published after step 1 are in the slot, but PUBLISHED: the
//     relay skips them.
//
// Run refuses with CDC_UNDELIVERED_ROWS while rows older than the slot are
// undelivered (and closes the boundary once none is). Run's CreateSlot
// creates a missing slot the same way in CDC mode, and refuses (dropping the
// slot again) when rows committed before it are undelivered: nothing else
// would ever deliver them. The documented recovery is a polling drain:
// `outboxctl debezium disable`, run the forwarders until the backlog is
// empty, then steps 1-3. A slot the relay did not create (a connector's)
// has no recorded boundary; Run logs that it cannot check.
//
// # Switching back to POLLING
//
// After this relay: stop it (it marks what it delivered and removes its
// heartbeat), `outboxctl debezium disable`, start the forwarders; drop the
// slot if CDC is not coming back soon. After a Debezium connector, which
// marks nothing: stop it, then [Relay.HandOverToPolling] on its slot. It
// delivers what the connector left unconfirmed, then, holding inserts into
// messaging_outbox for the last stretch only, marks the rows the connector
// delivered PUBLISHED and records POLLING in the same transaction.
//
// # Slots and lag
//
// A slot keeps WAL until it is confirmed: a relay that stays down makes the
// server keep WAL without bound unless max_slot_wal_keep_size is set, and
// then the slot is invalidated ("lost") once it falls further behind. The
// relay reads its slot's wal_status: an invalidated slot stops Run with
// CDC_SLOT_LOST carrying PostgreSQL's message and DETAIL. With each
// heartbeat it reads the WAL its slot retains and logs a warning past
// LagWarnBytes or when the slot is "unreserved". status.Collect,
// `outboxctl status` and the status collector's outbox_cdc_slot_* gauges
// report every slot's retained WAL, confirmed lag, wal_status and
// safe_wal_size; deploy/prometheus/cdc-rules.yml alerts on them. While the
// outbox is idle the relay confirms the server's keepalive position between
// transactions, so an idle slot does not hold WAL.
//
// # Stopping
//
// Close (or the end of Run's context) returns within [Config.StopBound],
// max(DrainTimeout, DBTimeout) + 4 x DBTimeout: a publish in progress gets
// DrainTimeout and is then left behind (its row is not marked and its
// transaction not confirmed: the next Run publishes it again, and a later
// Run of the same Relay waits for it first); nothing more is published.
// Then, each within DBTimeout, the last status update and CopyDone, the mark
// of what the downstream accepted, closing the replication connection and
// removing the heartbeat. A step that runs into its timeout is given up: an
// unwritten mark means those messages are published again, an unremoved
// heartbeat keeps `outboxctl debezium disable` refusing until it expires
// (TestCloseReturnsWithinStopBound).
//
// A Relay runs again once Run has returned, whatever ended it (a clean
// stop at the end of its context, or an error). One Run at a time: a Run while
// another Run or HandOverToPolling is active refuses with
// CDC_RELAY_ALREADY_RUNNING, and every Run after Close with
// CDC_RELAY_CLOSED. Close may come before Run, more than once or from
// several goroutines; it cancels the active Run and waits for it to
// return, not for a handover. Run's start and stop are
// internal/startstop's Runs.
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
