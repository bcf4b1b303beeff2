package debezium

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"regexp"
	"sort"
	"strings"
	"unicode/utf16"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/pgtext"
)

//go:generate go run ./internal/gen

// Header names the connector adds besides the canonical msg.* keys.
const (
	// HeaderEventID is the header the event router always writes the event
	// id (message_id) to; it is not configurable in Debezium.
	HeaderEventID = "id"
	// HeaderWatermillUUID is the header watermill-kafka's DefaultMarshaler
	// reads msg.UUID from, so a watermill subscriber sees the same message id
	// as from the polling relay.
	HeaderWatermillUUID = "_watermill_message_uuid"
	// HeaderAppHeaders carries the headers jsonb column as one JSON object
	// (PostgreSQL's jsonb text). The router cannot explode a jsonb column into
	// one header per key; [ExpandMetadata] does that on the consumer side.
	HeaderAppHeaders = "msg.headers"
)

// Placement is one messaging_outbox column placed as a Kafka header by the
// event router (table.fields.additional.placement "column:header:alias").
type Placement struct {
	Column string // messaging_outbox column
	Header string // Kafka header name (the alias)
}

// Placements is the one definition of which column reaches which header. It
// is derived from [envelope.CanonicalKeys] (each canonical key is "msg." + its
// column; a test checks every column exists in the migrated schema), so a
// canonical field added to the envelope reaches the connector without anyone
// editing a properties file. The order is stable: canonical keys in column
// order, then the extra headers.
var Placements = buildPlacements()

func buildPlacements() []Placement {
	ps := make([]Placement, 0, len(envelope.CanonicalKeys)+3)
	for _, key := range envelope.CanonicalKeys {
		ps = append(ps, Placement{Column: strings.TrimPrefix(key, envelope.ReservedPrefix), Header: key})
	}
	return append(ps,
		// watermill's CorrelationID middleware reads this key; ToMessage sets
		// it too, so the CDC relay must as well.
		Placement{Column: "correlation_id", Header: envelope.WatermillCorrelationKey},
		Placement{Column: "message_id", Header: HeaderWatermillUUID},
		Placement{Column: "headers", Header: HeaderAppHeaders},
	)
}

// Table is the captured table; EventTimestampColumn is created_at in UTC
// without time zone (migration 00020), the only form the router accepts as a
// record timestamp.
const (
	Table                = "messaging_outbox"
	EventTimestampColumn = "created_at_utc"
)

// DefaultPublicationName is the insert-only publication the connector reads
// (and package cdcrelay's default too: one publication serves both).
const DefaultPublicationName = "messaging_outbox_cdc"

// DefaultSlotName is the replication slot of both CDC paths: the Debezium
// connector's slot.name and package cdcrelay's default. One name on purpose:
// PostgreSQL lets one consumer stream a slot at a time, so a native relay and
// a connector started by two teams with their defaults collide on the slot
// (the second is refused) instead of each delivering every insert from a
// slot of its own.
const DefaultSlotName = "messaging_outbox_cdc"

// HeartbeatTable is the small table the connector's heartbeat action query
// inserts into (migration 00040). It is in the publication ([PublicationSQL])
// and in table.include.list, so each heartbeat is a change the connector
// receives and confirms: the slot advances while the outbox is idle.
const HeartbeatTable = "messaging_cdc_heartbeat"

// DefaultHeartbeatIntervalMS is heartbeat.interval.ms when Options leaves it
// zero. The connector's relay heartbeat (see [HeartbeatActionQuery]) lives
// three intervals.
const DefaultHeartbeatIntervalMS = 10000

// IsIdentifier reports whether s is usable as a schema, slot or publication
// name here: PostgreSQL's slot-name rule (lower-case letters, digits, '_'),
// so nothing ever needs quoting.
func IsIdentifier(s string) bool { return identChars.MatchString(s) }

// Options tune the generated connector configuration. The zero value is
// usable: every empty field takes the default documented beside it.
type Options struct {
	// Name of the Kafka Connect connector. Default "messaging-outbox". It
	// may not hold control characters or invalid UTF-8 (it is written to
	// the relay-heartbeat owner column and printed).
	Name string
	// TopicPrefix is prepended to destination to name the Kafka topic
	// (route.topic.replacement = TopicPrefix + "${routedByValue}"). Default
	// "" (the topic is the destination, as with the polling relay). Only
	// Kafka topic characters [a-zA-Z0-9._-] are allowed: '$' and '\' would be
	// interpreted by the router's regex replacement.
	TopicPrefix string
	// Schema holding messaging_outbox. Default "public".
	Schema string
	// ServerName is Debezium's topic.prefix (names its heartbeat and
	// schema-change topics, never the outbox topics). Default "outbox-cdc".
	ServerName string
	// SlotName and PublicationName of the logical replication slot and
	// publication. Default "messaging_outbox_cdc" for both (DefaultSlotName,
	// DefaultPublicationName; the native relay's defaults too).
	SlotName        string
	PublicationName string
	// HeartbeatIntervalMS is heartbeat.interval.ms. Default 10000, at most
	// math.MaxInt32 (Kafka Connect reads it as an int). Each heartbeat runs
	// [HeartbeatActionQuery].
	HeartbeatIntervalMS int
	// Database connection. Defaults are Kafka FileConfigProvider references
	// to /opt/kafka/secrets/outbox-db.properties, so the shipped file holds no
	// secret (the worker needs config.providers=file).
	DatabaseHostname string
	DatabasePort     string
	DatabaseUser     string
	DatabasePassword string
	DatabaseName     string
}

const secretsFile = "/opt/kafka/secrets/outbox-db.properties"

func secretRef(key string) string { return "${file:" + secretsFile + ":" + key + "}" }

func (o Options) withDefaults() Options {
	def := func(v *string, d string) {
		if *v == "" {
			*v = d
		}
	}
	def(&o.Name, "messaging-outbox")
	def(&o.Schema, "public")
	def(&o.ServerName, "outbox-cdc")
	def(&o.SlotName, DefaultSlotName)
	if o.HeartbeatIntervalMS == 0 {
		o.HeartbeatIntervalMS = DefaultHeartbeatIntervalMS
	}
	def(&o.PublicationName, DefaultPublicationName)
	def(&o.DatabaseHostname, secretRef("hostname"))
	def(&o.DatabasePort, secretRef("port"))
	def(&o.DatabaseUser, secretRef("user"))
	def(&o.DatabasePassword, secretRef("password"))
	def(&o.DatabaseName, secretRef("dbname"))
	return o
}

var (
	topicChars = regexp.MustCompile(`^[a-zA-Z0-9._-]*$`)
	// PostgreSQL slot names allow only lower-case letters, digits and '_';
	// identifiers are held to the same rule so PublicationSQL never needs
	// to quote anything unusual.
	identChars = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)
)

// Validate reports the first option that would produce a broken connector,
// as OUTBOX_INVALID_CONFIG with what to change.
func (o Options) Validate() error {
	const op = "debezium.Options"
	o = o.withDefaults()
	if !topicChars.MatchString(o.TopicPrefix) {
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "topic prefix %q may contain only [a-zA-Z0-9._-] (Kafka topic characters; '$' and '\\' would be read by the router's regex replacement)", o.TopicPrefix)
	}
	if !topicChars.MatchString(o.ServerName) {
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "server name %q may contain only [a-zA-Z0-9._-]", o.ServerName)
	}
	for what, v := range map[string]string{"schema": o.Schema, "slot name": o.SlotName, "publication name": o.PublicationName} {
		if !identChars.MatchString(v) {
			return outbox.Errorf(outbox.CodeInvalidConfig, op, "%s %q must match ^[a-z_][a-z0-9_]{0,62}$", what, v)
		}
	}
	if o.HeartbeatIntervalMS < 0 {
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "heartbeat interval %dms must not be negative (0 = %dms)", o.HeartbeatIntervalMS, DefaultHeartbeatIntervalMS)
	}
	if o.HeartbeatIntervalMS > math.MaxInt32 {
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "heartbeat interval %dms is above %dms, the largest heartbeat.interval.ms Kafka Connect accepts (an int)", o.HeartbeatIntervalMS, math.MaxInt32)
	}
	if why := pgtext.Unstorable(o.Name); why != "" {
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "name %s", why)
	}
	if i := pgtext.ControlAt(o.Name); i >= 0 {
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "name %q has a control character at byte %d; use printable text", o.Name, i)
	}
	for what, v := range map[string]string{"name": o.Name, "database hostname": o.DatabaseHostname, "database port": o.DatabasePort, "database user": o.DatabaseUser, "database password": o.DatabasePassword, "database name": o.DatabaseName} {
		if strings.ContainsAny(v, "\x00\n\r") {
			return outbox.Errorf(outbox.CodeInvalidConfig, op, "%s must not contain NUL or line breaks", what)
		}
	}
	return nil
}

// Config is a generated connector configuration: the connector name and its
// settings. Build it with [Generate].
type Config struct {
	Name     string
	Settings map[string]string
	err      error
}

// Err returns the validation error of the options Config was generated
// from, or nil. WriteJSON and WriteProperties return it before writing.
func (c Config) Err() error { return c.err }

// Keys returns the setting names in sorted order (the output order).
func (c Config) Keys() []string {
	keys := make([]string, 0, len(c.Settings))
	for k := range c.Settings {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// Generate builds the Debezium PostgreSQL connector configuration with the
// outbox event router. It is deterministic: the same options always give the
// same settings. Invalid options (see [Options.Validate]) give a Config whose
// Err is set and whose writers refuse.
func Generate(opts Options) Config {
	if err := opts.Validate(); err != nil {
		return Config{err: err}
	}
	o := opts.withDefaults()
	placements := make([]string, len(Placements))
	for i, p := range Placements {
		placements[i] = p.Column + ":header:" + p.Header
	}
	s := map[string]string{
		"connector.class":   "io.debezium.connector.postgresql.PostgresConnector",
		"plugin.name":       "pgoutput",
		"database.hostname": o.DatabaseHostname,
		"database.port":     o.DatabasePort,
		"database.user":     o.DatabaseUser,
		"database.password": o.DatabasePassword,
		"database.dbname":   o.DatabaseName,
		"topic.prefix":      o.ServerName,
		// The heartbeat table is captured too: its inserts are what lets the
		// connector confirm its position while the outbox is idle. The
		// predicate below keeps its records out of the event router.
		"table.include.list": o.Schema + "." + Table + "," + o.Schema + "." + HeartbeatTable,
		"slot.name":          o.SlotName,
		"publication.name":   o.PublicationName,
		// disabled: the connector never creates the publication. With
		// "filtered" a missing publication would be created publishing every
		// operation; create the insert-only one with PublicationSQL first.
		"publication.autocreate.mode": "disabled",
		// no_data (Debezium 2.6+; "never" on older versions): a first start
		// streams from the slot and never snapshots the table, whose rows
		// (PUBLISHED ones included) would otherwise all become events.
		"snapshot.mode": "no_data",
		// A heartbeat every interval, and with it the action query: an insert
		// into the heartbeat table (so the slot advances while the outbox is
		// idle in a busy database) and the connector's relay heartbeat (so
		// `outboxctl debezium disable` refuses while the connector runs).
		"heartbeat.interval.ms":  fmt.Sprint(o.HeartbeatIntervalMS),
		"heartbeat.action.query": heartbeatActionQuery(o),
		// Second line of defence if the publication publishes more than
		// inserts: the connector drops updates, deletes and truncates.
		"skipped.operations":   "u,d,t",
		"tombstones.on.delete": "false",
		// adaptive maps created_at_utc (timestamp(6)) to MicroTimestamp, an
		// INT64 the router accepts as the record timestamp; "connect" would
		// give java.util.Date, which the router rejects.
		"time.precision.mode":  "adaptive",
		"binary.handling.mode": "bytes",
		"key.converter":        "org.apache.kafka.connect.storage.StringConverter",
		// The payload is bytea: pass its bytes through unchanged, as the
		// polling relay does. Heartbeats and other non-outbox records go
		// through the delegate.
		"value.converter":                                        "io.debezium.converters.BinaryDataConverter",
		"value.converter.delegate.converter.type":                "org.apache.kafka.connect.json.JsonConverter",
		"value.converter.delegate.converter.type.schemas.enable": "false",
		// Strings as UTF-8, aggregate_version as its decimal text, NULL as a
		// header with a null value (see the package documentation).
		"header.converter": "org.apache.kafka.connect.storage.SimpleHeaderConverter",

		"transforms":             "outbox",
		"transforms.outbox.type": "io.debezium.transforms.outbox.EventRouter",
		// Only the outbox table's records go through the router; the
		// heartbeat table's go to their own topic unchanged.
		"transforms.outbox.predicate":                        "isOutboxTable",
		"predicates":                                         "isOutboxTable",
		"predicates.isOutboxTable.type":                      "org.apache.kafka.connect.transforms.predicates.TopicNameMatches",
		"predicates.isOutboxTable.pattern":                   regexp.QuoteMeta(o.ServerName + "." + o.Schema + "." + Table),
		"transforms.outbox.table.field.event.id":             "message_id",
		"transforms.outbox.table.field.event.key":            "routing_key",
		"transforms.outbox.table.field.event.payload":        "payload",
		"transforms.outbox.table.field.event.timestamp":      EventTimestampColumn,
		"transforms.outbox.route.by.field":                   "destination",
		"transforms.outbox.route.topic.replacement":          o.TopicPrefix + "${routedByValue}",
		"transforms.outbox.route.tombstone.on.empty.payload": "false",
		"transforms.outbox.table.expand.json.payload":        "false",
		// An update that still reaches the router (an operator's UPDATE with
		// a publication that publishes updates) is skipped with a warning,
		// not turned into an event and not fatal to the connector.
		"transforms.outbox.table.op.invalid.behavior":         "warn",
		"transforms.outbox.table.fields.additional.placement": strings.Join(placements, ","),
	}
	return Config{Name: o.Name, Settings: s}
}

// WriteJSON writes the Kafka Connect REST form {"name": ..., "config": {...}}
// with sorted keys and a trailing newline.
func (c Config) WriteJSON(w io.Writer) error {
	if c.err != nil {
		return c.err
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	enc.SetIndent("", "  ")
	// encoding/json sorts map keys, which keeps the output deterministic.
	if err := enc.Encode(struct {
		Name   string            `json:"name"`
		Config map[string]string `json:"config"`
	}{c.Name, c.Settings}); err != nil {
		return fmt.Errorf("debezium: encode connector JSON: %w", err)
	}
	_, err := w.Write(buf.Bytes())
	return err
}

// WriteProperties writes the .properties form (Kafka Connect standalone):
// a generated-file header, name=..., then the settings in sorted order,
// escaped for java.util.Properties (ISO-8859-1 with \uXXXX escapes).
func (c Config) WriteProperties(w io.Writer) error {
	if c.err != nil {
		return c.err
	}
	var b strings.Builder
	b.WriteString("# Generated by `outboxctl debezium config --format properties` (or `go run ./debezium/internal/gen`).\n")
	b.WriteString("# DO NOT EDIT: a test fails when this file differs from what the code generates.\n")
	b.WriteString("# Create the insert-only publication before starting the connector; see debezium.PublicationSQL.\n")
	writeProp(&b, "name", c.Name)
	for _, k := range c.Keys() {
		writeProp(&b, k, c.Settings[k])
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func writeProp(b *strings.Builder, key, value string) {
	b.WriteString(escapeProp(key, true))
	b.WriteByte('=')
	b.WriteString(escapeProp(value, false))
	b.WriteByte('\n')
}

func escapeProp(s string, isKey bool) string {
	var b strings.Builder
	for i, r := range s {
		switch {
		case r == '\\':
			b.WriteString(`\\`)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r == '\t':
			b.WriteString(`\t`)
		case r == ' ' && (isKey || i == 0):
			b.WriteString(`\ `)
		case isKey && (r == '=' || r == ':' || r == '#' || r == '!'):
			b.WriteByte('\\')
			b.WriteRune(r)
		case !isKey && i == 0 && (r == '#' || r == '!'):
			b.WriteByte('\\')
			b.WriteRune(r)
		case r < 0x20 || r > 0x7e:
			for _, u := range utf16.Encode([]rune{r}) {
				fmt.Fprintf(&b, `\u%04X`, u)
			}
		default:
			b.WriteRune(r)
		}
	}
	return b.String()
}

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
