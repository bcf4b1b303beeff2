package debezium

import (
	"fmt"
	"strings"
)

// PublicationSQL returns the statement that creates the insert-only
// publication the connector reads: messaging_outbox and the heartbeat table.
// Run it (as the table owner) before the connector starts (the configuration
// sets publication.autocreate.mode=disabled): with publish = 'insert' the
// forwarder's updates, retention's deletes and any TRUNCATE never leave the
// server, so they can never become events. Identifiers are validated by
// [Options.Validate] and quoted.
func PublicationSQL(opts Options) (string, error) {
	if err := opts.Validate(); err != nil {
		return "", err
	}
	o := opts.withDefaults()
	return fmt.Sprintf(`CREATE PUBLICATION %s FOR TABLE %s.%s, %s.%s WITH (publish = 'insert')`,
		quoteIdent(o.PublicationName), quoteIdent(o.Schema), quoteIdent(Table), quoteIdent(o.Schema), quoteIdent(HeartbeatTable)), nil
}

// HeartbeatActionQuery returns the connector's heartbeat.action.query: one
// statement that (1) writes the connector's CDC heartbeat into
// messaging_relay_heartbeat (owner "debezium:" + Name, kind CDC, its slot,
// alive for three heartbeat intervals), so relaymode.Disable refuses while the
// connector runs and `outboxctl status` lists it beside native relays;
// (2) inserts a row into the heartbeat table, a change the connector receives
// and confirms, so the slot advances while the outbox is idle; (3) deletes
// heartbeat rows older than an hour (deletes are not published).
func HeartbeatActionQuery(opts Options) (string, error) {
	if err := opts.Validate(); err != nil {
		return "", err
	}
	return heartbeatActionQuery(opts.withDefaults()), nil
}

// HeartbeatOwner is the relay-heartbeat owner a connector named name writes.
func HeartbeatOwner(name string) string { return "debezium:" + name }

func heartbeatActionQuery(o Options) string {
	schema := quoteIdent(o.Schema)
	ttlMS := 3 * int64(o.HeartbeatIntervalMS) // no overflow where int is 32 bits
	// In seconds, with the milliseconds as a fraction: PostgreSQL 14 reads
	// the number before an interval unit as a 32-bit integer, so
	// '6442450941 milliseconds' (three of the largest intervals) is "interval
	// field value out of range" there (15 and later accept it), while
	// '6442450.941 seconds' fits every supported major
	// (TestHeartbeatIntervalAboveKafkaConnectsIntIsRefused runs it).
	ttl := fmt.Sprintf("%d seconds", ttlMS/1000)
	if ttlMS%1000 != 0 {
		ttl = fmt.Sprintf("%d.%03d seconds", ttlMS/1000, ttlMS%1000)
	}
	return fmt.Sprintf("WITH beat AS ("+
		"INSERT INTO %[1]s.messaging_relay_heartbeat (owner, started_at, heartbeat_at, expires_at, kind, slot_name) "+
		"VALUES (%[2]s, now(), now(), now() + interval '%[3]s', 'CDC', %[4]s) "+
		"ON CONFLICT (owner) DO UPDATE SET heartbeat_at = now(), expires_at = EXCLUDED.expires_at, kind = 'CDC', slot_name = EXCLUDED.slot_name), "+
		"trimmed AS (DELETE FROM %[1]s.%[5]s WHERE beat_at < now() - interval '1 hour') "+
		"INSERT INTO %[1]s.%[5]s (slot_name) VALUES (%[4]s)",
		schema, quoteLiteral(HeartbeatOwner(o.Name)), ttl, quoteLiteral(o.SlotName), quoteIdent(HeartbeatTable))
}

func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

func quoteIdent(s string) string { return `"` + strings.ReplaceAll(s, `"`, `""`) + `"` }
