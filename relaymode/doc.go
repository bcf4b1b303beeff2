// Package relaymode decides which kind of relay may publish from a database:
// the polling forwarder (POLLING) or a CDC consumer (CDC: the native relay in
// package cdcrelay, or a Debezium connector). The choice is recorded in
// messaging_relay_mode and enforced by the database, not by documentation.
//
// It owns the mode record ([ReadMode], [CurrentMode], [RequireMode]), the
// switch ([Enable], [Disable] and their Tx forms) and the heartbeats every
// relay of either kind writes to messaging_relay_heartbeat, each recording
// its kind ([Beat], [BeatBudget], [BeatCDC], [Leave], [LiveRelays],
// [LiveCDCConsumers]). It does not own the Debezium connector configuration
// or its record model (package debezium, which may import this package; this
// package never imports it, and a test runs `go list -deps` to keep it so),
// nor the relays themselves.
//
// # Relay-mode exclusivity
//
// messaging_relay_mode records POLLING or CDC; messaging_relay_heartbeat
// holds the heartbeats of both kinds of relay, its kind column saying which
// (migration 00040). A polling forwarder calls [BeatBudget] at start and on
// every heartbeat; it refuses with RELAY_MODE_CONFLICT when the mode is CDC
// or a CDC consumer's heartbeat is live. A CDC consumer beats too: the
// native relay with [BeatCDC] at start and while it streams (refused outside
// CDC mode, and with CDC_SECOND_CONSUMER while a consumer on another slot is
// live), a Debezium connector through its heartbeat action query
// (debezium.HeartbeatActionQuery: owner "debezium:<name>", alive three
// intervals; it cannot be refused, so a second connector is reported by
// [LiveCDCConsumers], `outboxctl status` and the outbox_cdc_consumer_slots
// gauge). [Enable] (outboxctl debezium enable) locks the mode row FOR
// UPDATE, then refuses with RELAY_MODE_CONFLICT while any polling heartbeat
// is live, naming the owners; [Disable] refuses the same way while any CDC
// heartbeat is live. Beat reads the mode row FOR SHARE in the same statement
// that writes the heartbeat, and BeatCDC locks it FOR UPDATE, so a heartbeat
// and a switch are ordered by the row lock: a beat that arrives during a
// switch waits and then sees its outcome, and a switch that arrives during a
// beat waits and then counts that heartbeat. Any number of polling
// forwarders may run together.
//
// The native relay marks what it delivered PUBLISHED (package cdcrelay), so
// stopping it, Disable and starting the forwarders hands over without
// delivering anything twice. A Debezium connector cannot mark rows: after it
// stopped, switch back with cdcrelay's Relay.HandOverToPolling on its slot
// (it delivers what the connector left unconfirmed, marks what it delivered
// and records POLLING while inserts are briefly held); [Disable] alone lets
// the forwarders publish again the rows the connector delivered.
package relaymode
