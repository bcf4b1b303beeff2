package debezium_test

import (
	"bytes"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/debezium"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// Literals, not the package's constants: comparing a setting with the
// constant that produced it only proves the generator agrees with itself.
func TestGenerateRoutesByDestinationAndKeysByRoutingKey(t *testing.T) {
	t.Parallel()
	c := debezium.Generate(debezium.Options{TopicPrefix: "prod."})
	require.NoError(t, c.Err())
	s := c.Settings
	require.Equal(t, "messaging-outbox", c.Name)
	require.Equal(t, "io.debezium.transforms.outbox.EventRouter", s["transforms.outbox.type"])
	require.Equal(t, "outbox", s["transforms"])
	require.Equal(t, "message_id", s["transforms.outbox.table.field.event.id"])
	require.Equal(t, "routing_key", s["transforms.outbox.table.field.event.key"], "keying by destination puts every message of a topic on one partition")
	require.Equal(t, "payload", s["transforms.outbox.table.field.event.payload"])
	require.Equal(t, "created_at_utc", s["transforms.outbox.table.field.event.timestamp"])
	require.Equal(t, "destination", s["transforms.outbox.route.by.field"])
	require.Equal(t, "prod.${routedByValue}", s["transforms.outbox.route.topic.replacement"])
	require.Equal(t, "warn", s["transforms.outbox.table.op.invalid.behavior"])
	require.Equal(t, "false", s["transforms.outbox.route.tombstone.on.empty.payload"])
	require.Equal(t, "u,d,t", s["skipped.operations"])
	require.Equal(t, "disabled", s["publication.autocreate.mode"], "filtered would create a publication of every operation when the insert-only one is missing")
	require.Equal(t, "no_data", s["snapshot.mode"], "a first start must not snapshot the table (PUBLISHED rows included) into events")
	require.Equal(t, "messaging_outbox_cdc", s["slot.name"], "the native relay's default slot too")
	require.Equal(t, "10000", s["heartbeat.interval.ms"])
	require.Equal(t, `WITH beat AS (INSERT INTO "public".messaging_relay_heartbeat (owner, started_at, heartbeat_at, expires_at, kind, slot_name) `+
		`VALUES ('debezium:messaging-outbox', now(), now(), now() + interval '30 seconds', 'CDC', 'messaging_outbox_cdc') `+
		`ON CONFLICT (owner) DO UPDATE SET heartbeat_at = now(), expires_at = EXCLUDED.expires_at, kind = 'CDC', slot_name = EXCLUDED.slot_name), `+
		`trimmed AS (DELETE FROM "public"."messaging_cdc_heartbeat" WHERE beat_at < now() - interval '1 hour') `+
		`INSERT INTO "public"."messaging_cdc_heartbeat" (slot_name) VALUES ('messaging_outbox_cdc')`, s["heartbeat.action.query"])
	require.Equal(t, "isOutboxTable", s["transforms.outbox.predicate"], "heartbeat-table records must not reach the event router")
	require.Equal(t, "isOutboxTable", s["predicates"])
	require.Equal(t, "org.apache.kafka.connect.transforms.predicates.TopicNameMatches", s["predicates.isOutboxTable.type"])
	require.Equal(t, `outbox-cdc\.public\.messaging_outbox`, s["predicates.isOutboxTable.pattern"])
	require.Equal(t, "pgoutput", s["plugin.name"])
	require.Equal(t, "public.messaging_outbox,public.messaging_cdc_heartbeat", s["table.include.list"])
	require.Equal(t, "io.debezium.converters.BinaryDataConverter", s["value.converter"])
	require.Equal(t, "org.apache.kafka.connect.storage.StringConverter", s["key.converter"])
	require.Equal(t, "org.apache.kafka.connect.storage.SimpleHeaderConverter", s["header.converter"])
	require.Equal(t, "adaptive", s["time.precision.mode"])
	require.Equal(t,
		"producer:header:msg.producer,"+
			"occurred_at:header:msg.occurred_at,"+
			"correlation_id:header:msg.correlation_id,"+
			"causation_id:header:msg.causation_id,"+
			"tenant:header:msg.tenant,"+
			"partition_key:header:msg.partition_key,"+
			"ordering_key:header:msg.ordering_key,"+
			"traceparent:header:msg.traceparent,"+
			"tracestate:header:msg.tracestate,"+
			"baggage:header:msg.baggage,"+
			"schema_subject:header:msg.schema_subject,"+
			"schema_version:header:msg.schema_version,"+
			"content_type:header:msg.content_type,"+
			"message_type:header:msg.message_type,"+
			"aggregate_type:header:msg.aggregate_type,"+
			"aggregate_id:header:msg.aggregate_id,"+
			"aggregate_version:header:msg.aggregate_version,"+
			"correlation_id:header:correlation_id,"+
			"message_id:header:_watermill_message_uuid,"+
			"headers:header:msg.headers",
		s["transforms.outbox.table.fields.additional.placement"])
}

func TestGenerateDefaultTopicIsTheDestinationAndOptionsApply(t *testing.T) {
	t.Parallel()
	c := debezium.Generate(debezium.Options{})
	require.Equal(t, "${routedByValue}", c.Settings["transforms.outbox.route.topic.replacement"])

	c = debezium.Generate(debezium.Options{Name: "orders-outbox", Schema: "orders", SlotName: "s1", PublicationName: "p1", ServerName: "srv", DatabaseHostname: "db.internal", DatabasePort: "6432"})
	require.NoError(t, c.Err())
	require.Equal(t, "orders-outbox", c.Name)
	require.Equal(t, "orders.messaging_outbox,orders.messaging_cdc_heartbeat", c.Settings["table.include.list"])
	require.Equal(t, "s1", c.Settings["slot.name"])
	require.Equal(t, "p1", c.Settings["publication.name"])
	require.Equal(t, "srv", c.Settings["topic.prefix"])
	require.Equal(t, "db.internal", c.Settings["database.hostname"])
	require.Equal(t, "6432", c.Settings["database.port"])
	require.Equal(t, "${file:/opt/kafka/secrets/outbox-db.properties:password}", c.Settings["database.password"])
}

func TestGenerateIsDeterministicAndBothFormsAgree(t *testing.T) {
	t.Parallel()
	opts := debezium.Options{TopicPrefix: "x."}
	var j1, j2, p bytes.Buffer
	require.NoError(t, debezium.Generate(opts).WriteJSON(&j1))
	require.NoError(t, debezium.Generate(opts).WriteJSON(&j2))
	require.Equal(t, j1.String(), j2.String())

	var parsed struct {
		Name   string            `json:"name"`
		Config map[string]string `json:"config"`
	}
	require.NoError(t, json.Unmarshal(j1.Bytes(), &parsed))
	require.Equal(t, "messaging-outbox", parsed.Name)
	require.Equal(t, debezium.Generate(opts).Settings, parsed.Config)

	require.NoError(t, debezium.Generate(opts).WriteProperties(&p))
	props := map[string]string{}
	var keys []string
	for _, line := range strings.Split(strings.TrimSpace(p.String()), "\n") {
		if strings.HasPrefix(line, "#") {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		require.True(t, ok, line)
		props[k] = strings.ReplaceAll(v, `\\`, `\`) // java.util.Properties unescapes a doubled backslash
		if k != "name" {
			keys = append(keys, k)
		}
	}
	require.True(t, sort.StringsAreSorted(keys), "properties are written in sorted key order")
	require.Equal(t, "messaging-outbox", props["name"])
	delete(props, "name")
	require.Equal(t, parsed.Config, props, "JSON and properties carry the same settings")
}

func TestShippedFilesAreGeneratedByTheCode(t *testing.T) {
	t.Parallel()
	want, err := debezium.ShippedFiles()
	require.NoError(t, err)
	require.Len(t, want, 2)
	for name, content := range want {
		got, err := os.ReadFile(filepath.Join(".", name))
		require.NoError(t, err, "shipped file %s is missing: run `go run ./debezium/internal/gen`", name)
		require.Equal(t, string(content), string(got), "debezium/%s differs from what the code generates: run `go run ./debezium/internal/gen` (or `go generate ./debezium`) and commit the result", name)
	}
}

func TestInvalidOptionsAreRefused(t *testing.T) {
	t.Parallel()
	cases := map[string]debezium.Options{
		"dollar in prefix":       {TopicPrefix: "a$b"},
		"backslash in prefix":    {TopicPrefix: `a\1`},
		"space in prefix":        {TopicPrefix: "a b"},
		"bad server name":        {ServerName: "srv/1"},
		"upper-case schema":      {Schema: "Public"},
		"quote in schema":        {Schema: `a"b`},
		"dash in slot":           {SlotName: "my-slot"},
		"dash in publication":    {PublicationName: "my-pub"},
		"newline in name":        {Name: "a\nb"},
		"newline in password":    {DatabasePassword: "a\nb=c"},
		"NUL in database name":   {DatabaseName: "a\x00"},
		"too long a publication": {PublicationName: strings.Repeat("p", 64)},
		"negative heartbeat":     {HeartbeatIntervalMS: -1},
		"tab in name":            {Name: "a\tb"},
		"escape in name":         {Name: "a\x1b[31mb"},
		"DEL in name":            {Name: "a\x7fb"},
		"C1 control in name":     {Name: "a\u0085b"},
		"NUL in name":            {Name: "a\x00b"},
		"invalid UTF-8 in name":  {Name: "a\xffb"},
	}
	for name, opts := range cases {
		t.Run(name, func(t *testing.T) {
			require.ErrorIs(t, opts.Validate(), outbox.ErrInvalidConfig)
			c := debezium.Generate(opts)
			require.ErrorIs(t, c.Err(), outbox.ErrInvalidConfig)
			var buf bytes.Buffer
			require.ErrorIs(t, c.WriteJSON(&buf), outbox.ErrInvalidConfig)
			require.ErrorIs(t, c.WriteProperties(&buf), outbox.ErrInvalidConfig)
			require.Zero(t, buf.Len(), "nothing is written for invalid options")
			_, err := debezium.PublicationSQL(opts)
			require.ErrorIs(t, err, outbox.ErrInvalidConfig)
			require.Equal(t, outbox.Code("OUTBOX_INVALID_CONFIG"), outbox.CodeOf(err))
		})
	}
}

// Every column of messaging_outbox is either placed as a header, used by the
// router itself, or relay state that must not travel. A column added to the
// schema fails this test until someone decides which it is.
func TestEveryColumnIsPlacedOrDeliberatelyLeftOut(t *testing.T) {
	t.Parallel()
	s := testdb.New(t)
	rows, err := s.DB.Query(`SELECT column_name FROM information_schema.columns WHERE table_schema = $1 AND table_name = 'messaging_outbox'`, s.Name)
	require.NoError(t, err)
	defer rows.Close()
	columns := map[string]bool{}
	for rows.Next() {
		var c string
		require.NoError(t, rows.Scan(&c))
		columns[c] = true
	}
	require.NoError(t, rows.Err())

	placed := map[string]bool{}
	for _, p := range debezium.Placements {
		require.True(t, columns[p.Column], "placed column %s does not exist in messaging_outbox", p.Column)
		placed[p.Column] = true
	}
	var rest []string
	for c := range columns {
		if !placed[c] {
			rest = append(rest, c)
		}
	}
	sort.Strings(rest)
	require.Equal(t, sortedCopy([]string{
		// used by the router as id/key/payload/topic/timestamp
		"created_at", "created_at_utc", "destination", "payload", "routing_key",
		// relay state: meaningless to a consumer, and NULL/initial at insert
		"attempts", "last_attempt_at", "last_failure_code", "last_failure_detail",
		"lease_expires_at", "lease_owner", "lease_token", "next_attempt_at",
		"parked_at", "published_at", "seq", "status",
	}), rest)
}

func sortedCopy(in []string) []string {
	out := append([]string(nil), in...)
	sort.Strings(out)
	return out
}

// The files on disk, not the generator's output: what an operator deploys
// carries the heartbeat, never snapshots, never creates a publication, and
// uses the slot the native relay uses by default.
func TestShippedFilesCarryTheSettingsADebeziumOperatorNeeds(t *testing.T) {
	t.Parallel()
	props, err := os.ReadFile("outbox-connector.properties")
	require.NoError(t, err)
	for _, line := range []string{
		"heartbeat.interval.ms=10000",
		"snapshot.mode=no_data",
		"publication.autocreate.mode=disabled",
		"slot.name=messaging_outbox_cdc",
		"publication.name=messaging_outbox_cdc",
		"table.include.list=public.messaging_outbox,public.messaging_cdc_heartbeat",
		"transforms.outbox.predicate=isOutboxTable",
	} {
		require.Contains(t, strings.Split(string(props), "\n"), line)
	}
	require.Regexp(t, `(?m)^heartbeat\.action\.query=WITH beat AS \(INSERT INTO "public"\.messaging_relay_heartbeat .*INSERT INTO "public"\."messaging_cdc_heartbeat" \(slot_name\) VALUES \('messaging_outbox_cdc'\)$`, string(props))

	var j struct {
		Config map[string]string `json:"config"`
	}
	raw, err := os.ReadFile("outbox-connector.json")
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(raw, &j))
	require.Equal(t, "no_data", j.Config["snapshot.mode"])
	require.Equal(t, "disabled", j.Config["publication.autocreate.mode"])
	require.Equal(t, "10000", j.Config["heartbeat.interval.ms"])
	require.Equal(t, "messaging_outbox_cdc", j.Config["slot.name"])
	require.Contains(t, j.Config["heartbeat.action.query"], `"messaging_cdc_heartbeat"`)
}

// heartbeat.interval.ms is an int in Kafka Connect: above math.MaxInt32 the
// connector would not start, and near math.MaxInt/3 the relay heartbeat's
// lifetime (three intervals) overflowed to a negative interval. Both are
// refused; math.MaxInt32 itself is accepted, and PostgreSQL takes its
// three-interval lifetime.
func TestHeartbeatIntervalAboveKafkaConnectsIntIsRefused(t *testing.T) {
	t.Parallel()
	for _, ms := range []int64{int64(math.MaxInt32) + 1, math.MaxInt64/3 + 1, math.MaxInt64} {
		if int64(int(ms)) != ms {
			t.Skipf("int is %d bits: %d is not an int here", strconv.IntSize, ms)
		}
		opts := debezium.Options{HeartbeatIntervalMS: int(ms)}
		err := opts.Validate()
		require.ErrorIs(t, err, outbox.ErrInvalidConfig, "%d", ms)
		require.Equal(t, outbox.CodeInvalidConfig, outbox.CodeOf(err))
		_, err = debezium.HeartbeatActionQuery(opts)
		require.ErrorIs(t, err, outbox.ErrInvalidConfig, "%d", ms)
		require.ErrorIs(t, debezium.Generate(opts).Err(), outbox.ErrInvalidConfig, "%d", ms)
	}

	s := testdb.New(t)
	s.DB.SetMaxOpenConns(2)
	opts := debezium.Options{Schema: s.Name, Name: "max-beat", HeartbeatIntervalMS: math.MaxInt32}
	c := debezium.Generate(opts)
	require.NoError(t, c.Err())
	require.Equal(t, "2147483647", c.Settings["heartbeat.interval.ms"])
	q, err := debezium.HeartbeatActionQuery(opts)
	require.NoError(t, err)
	require.Contains(t, q, "interval '6442450.941 seconds'", "three intervals, not an overflowed int, in a form PostgreSQL 14 reads too")
	_, err = s.DB.Exec(q)
	require.NoError(t, err)
	var ttlMS int64
	require.NoError(t, s.DB.QueryRow(`SELECT (extract(epoch FROM expires_at - heartbeat_at) * 1000)::bigint FROM messaging_relay_heartbeat WHERE owner = 'debezium:max-beat'`).Scan(&ttlMS))
	require.Equal(t, int64(3)*math.MaxInt32, ttlMS)
}
