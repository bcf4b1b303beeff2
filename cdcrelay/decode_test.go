package cdcrelay

import (
	"database/sql"
	"math"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
)

func cols(kv ...string) []column {
	var out []column
	for i := 0; i < len(kv); i += 2 {
		out = append(out, column{name: kv[i], text: []byte(kv[i+1])})
	}
	return out
}

func TestDecodeRowReadsTextFormatByColumnName(t *testing.T) {
	c := cols(
		"created_at_utc", "2024-01-02 03:04:05.5", // a column the decoder does not know is ignored
		"payload", `\x00ff5c78`,
		"message_id", "m-1",
		"destination", "orders",
		"headers", `{"x-a": "1", "x-b": "two words"}`,
		"status", "PENDING",
		"seq", "42",
		"created_at", "2024-01-02 03:04:05.123456+00",
		"occurred_at", "2024-01-02 08:34:05+05:30",
		"attempts", "3",
		"lease_token", "9",
		"aggregate_version", "-7",
		"tenant", "acme",
	)
	c = append(c, column{name: "partition_key", null: true}, column{name: "routing_key", text: []byte("m-1")})
	r, err := decodeRow(c)
	require.NoError(t, err)
	require.Equal(t, "m-1", r.MessageID)
	require.Equal(t, "orders", r.Destination)
	require.Equal(t, []byte{0x00, 0xff, '\\', 'x'}, r.Payload)
	require.Equal(t, map[string]string{"x-a": "1", "x-b": "two words"}, r.Headers)
	require.Equal(t, int64(42), r.Seq)
	require.Equal(t, time.Date(2024, 1, 2, 3, 4, 5, 123456000, time.UTC), r.CreatedAt)
	require.Equal(t, time.Date(2024, 1, 2, 3, 4, 5, 0, time.UTC), r.OccurredAt)
	require.Equal(t, 3, r.Attempts)
	require.Equal(t, int64(9), r.LeaseToken)
	require.Equal(t, int64(-7), *r.AggregateVersion)
	require.Equal(t, "acme", r.Tenant)
	require.Empty(t, r.PartitionKey)
	require.Equal(t, "m-1", r.RoutingKey)
}

func TestDecodeRowDefaults(t *testing.T) {
	r, err := decodeRow(cols("message_id", "m", "destination", "d", "created_at", "2024-01-02 03:04:05+00", "partition_key", "k"))
	require.NoError(t, err)
	require.Equal(t, []byte{}, r.Payload, "absent payload is empty, not nil")
	require.Equal(t, map[string]string{}, r.Headers)
	require.Nil(t, r.AggregateVersion)
	require.Equal(t, "k", r.RoutingKey, "routing key falls back to partition_key, as the generated column does")
}

func TestDecodeRowRefusals(t *testing.T) {
	base := []string{"message_id", "m", "destination", "d", "created_at", "2024-01-02 03:04:05+00"}
	cases := map[string][]column{
		"bad hex":               cols(append(base, "payload", `\xzz`)...),
		"bad bytea escape":      cols(append(base, "payload", `ab\9`)...),
		"headers not object":    cols(append(base, "headers", `[1]`)...),
		"headers not strings":   cols(append(base, "headers", `{"a": 1}`)...),
		"bad int":               cols(append(base, "seq", "4x")...),
		"attempts overflow":     cols(append(base, "attempts", "99999999999")...),
		"infinity":              cols(append(base, "occurred_at", "infinity")...),
		"BC date":               cols(append(base, "occurred_at", "0044-03-15 12:00:00+00 BC")...),
		"missing message_id":    cols("destination", "d", "created_at", "2024-01-02 03:04:05+00"),
		"missing destination":   cols("message_id", "m", "created_at", "2024-01-02 03:04:05+00"),
		"missing created_at":    cols("message_id", "m", "destination", "d"),
		"null message_id":       append(cols("destination", "d", "created_at", "2024-01-02 03:04:05+00"), column{name: "message_id", null: true}),
		"bad aggregate version": cols(append(base, "aggregate_version", "1.5")...),
		// envelope.ScanRow refuses these too, with the same code.
		"unknown status":    cols(append(base, "status", "BOGUS")...),
		"lower-case status": cols(append(base, "status", "pending")...),
		"empty status":      cols(append(base, "status", "")...),
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			r, err := decodeRow(c)
			require.ErrorIs(t, err, outbox.ErrCorruptRow)
			// The identity decoded before the refusal is kept for the
			// operator's log, and nothing else.
			want := envelope.Row{}
			for _, col := range c {
				switch col.name {
				case "message_id":
					want.MessageID = string(col.text)
				case "destination":
					want.Destination = string(col.text)
				}
			}
			require.Equal(t, want, r)
		})
	}
}

func TestParseByteaEscapeFormat(t *testing.T) {
	b, err := parseBytea(`a\\b\000\377c`)
	require.NoError(t, err)
	require.Equal(t, []byte{'a', '\\', 'b', 0, 0xff, 'c'}, b)
	b, err = parseBytea(`\x`)
	require.NoError(t, err)
	require.Empty(t, b)
}

func TestParseTimestamptzOffsets(t *testing.T) {
	want := time.Date(2024, 6, 1, 12, 0, 0, 0, time.UTC)
	for _, s := range []string{"2024-06-01 12:00:00+00", "2024-06-01 14:00:00+02", "2024-06-01 06:30:00-05:30", "2024-06-01 12:00:30+00:00:30"} {
		got, err := parseTimestamptz(s)
		require.NoError(t, err, s)
		require.True(t, want.Equal(got), "%s -> %s", s, got)
		require.Equal(t, time.UTC, got.Location())
	}
}

func TestConfigValidate(t *testing.T) {
	db := &sql.DB{} // never used: Validate does not connect
	ok := Config{ConnString: "postgres://u@127.0.0.1:5432/db", DB: db}
	require.NoError(t, ok.Validate())
	d := ok.withDefaults()
	require.Equal(t, "messaging_outbox_cdc", d.SlotName, "the Debezium connector's default slot too")
	require.Equal(t, 2*time.Second, d.HeartbeatInterval)
	require.Equal(t, 15*time.Second, d.HeartbeatTTL)
	require.Contains(t, d.Owner, "cdcrelay@")

	pc, err := ok.replicationConfig()
	require.NoError(t, err)
	require.Equal(t, "database", pc.RuntimeParams["replication"], "replication=database is added")
	require.Equal(t, "UTC", pc.RuntimeParams["TimeZone"])
	require.Equal(t, "hex", pc.RuntimeParams["bytea_output"])

	explicit := ok
	explicit.ConnString = "postgres://u@127.0.0.1:5432/db?replication=database"
	require.NoError(t, explicit.Validate())

	bad := map[string]func(c *Config){
		"no conn string":          func(c *Config) { c.ConnString = "" },
		"no DB":                   func(c *Config) { c.DB = nil },
		"physical replication":    func(c *Config) { c.ConnString = "postgres://u@h/db?replication=true" },
		"unparsable conn string":  func(c *Config) { c.ConnString = "postgres://u@h:notaport/db" },
		"upper-case slot":         func(c *Config) { c.SlotName = "Slot" },
		"quote in publication":    func(c *Config) { c.PublicationName = `p"x` },
		"schema with a dash":      func(c *Config) { c.Schema = "my-schema" },
		"negative standby":        func(c *Config) { c.StandbyTimeout = -time.Second },
		"negative slot busy wait": func(c *Config) { c.SlotBusyWait = -time.Second },
		"retry max below initial": func(c *Config) { c.RetryInitial, c.RetryMax = time.Minute, time.Second },
		"negative attempts":       func(c *Config) { c.MaxPublishAttempts = -1 },
		"ttl below two beats":     func(c *Config) { c.HeartbeatInterval, c.HeartbeatTTL = 10*time.Second, 15*time.Second },
		"negative heartbeat":      func(c *Config) { c.HeartbeatInterval = -time.Second },
		"negative batch":          func(c *Config) { c.BatchSize = -1 },
		"blank owner":             func(c *Config) { c.Owner = "  " },
		"negative ttl":            func(c *Config) { c.HeartbeatTTL = -time.Second },
		"negative retry initial":  func(c *Config) { c.RetryInitial = -time.Second },
		"negative retry max":      func(c *Config) { c.RetryMax = -time.Second },
		"negative lag warn every": func(c *Config) { c.LagWarnEvery = -time.Second },
		// 2*HeartbeatInterval used to wrap around: these passed, and the
		// relay never renewed its heartbeat while it went on publishing.
		"max interval, default ttl": func(c *Config) { c.HeartbeatInterval = math.MaxInt64 },
		"max interval, 15s ttl":     func(c *Config) { c.HeartbeatInterval, c.HeartbeatTTL = math.MaxInt64, 15*time.Second },
		"interval just past half":   func(c *Config) { c.HeartbeatInterval, c.HeartbeatTTL = math.MaxInt64/2+1, math.MaxInt64 },
		"ttl one below two beats":   func(c *Config) { c.HeartbeatInterval, c.HeartbeatTTL = 5*time.Second, 10*time.Second-1 },
		// BeatCDC would fail with an uncoded database error.
		"NUL in owner":          func(c *Config) { c.Owner = "relay\x00a" },
		"invalid UTF-8 owner":   func(c *Config) { c.Owner = "relay\xffa" },
		"control char in owner": func(c *Config) { c.Owner = "relay\na" },
	}
	why := map[string]string{
		"negative ttl":              "must not be negative",
		"negative retry initial":    "must not be negative",
		"negative retry max":        "must not be negative",
		"negative lag warn every":   "must not be negative",
		"max interval, default ttl": "at least twice HeartbeatInterval",
		"max interval, 15s ttl":     "at least twice HeartbeatInterval",
		"interval just past half":   "at least twice HeartbeatInterval",
		"ttl one below two beats":   "at least twice HeartbeatInterval",
		"NUL in owner":              "NUL byte",
		"invalid UTF-8 owner":       "not valid UTF-8",
		"control char in owner":     "control character",
	}
	for name, mutate := range bad {
		t.Run(name, func(t *testing.T) {
			c := ok
			mutate(&c)
			err := c.Validate()
			require.ErrorIs(t, err, outbox.ErrInvalidConfig)
			if w, found := why[name]; found {
				require.ErrorContains(t, err, w)
			}
			_, err = New(c, nopPublisher{}, nil)
			require.ErrorIs(t, err, outbox.ErrInvalidConfig, "New refuses what Validate refuses")
		})
	}
	_, err = New(ok, nil, nil)
	require.ErrorIs(t, err, outbox.ErrInvalidConfig, "a publisher is required")
}

func TestConfigHeartbeatNearOverflow(t *testing.T) {
	ok := Config{ConnString: "postgres://u@127.0.0.1:5432/db", DB: &sql.DB{}}
	for _, c := range []struct{ interval, ttl, wantTTL time.Duration }{
		{math.MaxInt64 / 2, math.MaxInt64, math.MaxInt64},
		{math.MaxInt64 / 2, 0, math.MaxInt64 - 1}, // the default TTL is twice the interval, exactly
		{5 * time.Second, 10 * time.Second, 10 * time.Second},
		{10 * time.Second, 0, 20 * time.Second},
	} {
		cfg := ok
		cfg.HeartbeatInterval, cfg.HeartbeatTTL = c.interval, c.ttl
		require.NoError(t, cfg.Validate(), "interval %d ttl %d", c.interval, c.ttl)
		require.Equal(t, c.wantTTL, cfg.withDefaults().HeartbeatTTL)
	}
	cfg := ok
	cfg.HeartbeatInterval = math.MaxInt64
	require.Equal(t, time.Duration(math.MaxInt64), cfg.withDefaults().HeartbeatTTL, "the default TTL saturates instead of wrapping to 15s")

	require.Equal(t, time.Duration(math.MaxInt64), twice(math.MaxInt64/2+1))
	require.Equal(t, time.Duration(math.MinInt64), twice(math.MinInt64/2-1))
	require.Equal(t, -2*time.Second, twice(-time.Second))
}

func TestNextDelayDoesNotWrap(t *testing.T) {
	require.Equal(t, 200*time.Millisecond, nextDelay(100*time.Millisecond, 10*time.Second))
	require.Equal(t, 10*time.Second, nextDelay(6*time.Second, 10*time.Second))
	require.Equal(t, 10*time.Second, nextDelay(10*time.Second, 10*time.Second))
	// d*2 wraps to a negative delay here: the relay would retry in a hot loop.
	require.Equal(t, time.Duration(math.MaxInt64), nextDelay(1<<62, math.MaxInt64))
	require.Equal(t, time.Duration(math.MaxInt64), nextDelay(math.MaxInt64, math.MaxInt64))
}

func TestCloseBeforeRunAndTwice(t *testing.T) {
	r, err := New(Config{ConnString: "postgres://u@127.0.0.1/db", DB: &sql.DB{}}, nopPublisher{}, nil)
	require.NoError(t, err)
	require.NoError(t, r.Close())
	require.NoError(t, r.Close())
	require.ErrorIs(t, r.Run(t.Context()), ErrRelayClosed)
}

type nopPublisher struct{}

func (nopPublisher) Publish(string, ...*message.Message) error { return nil }
func (nopPublisher) Close() error                              { return nil }
