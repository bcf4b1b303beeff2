package cdcrelay

import (
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

type nopPublisher struct{}

func (nopPublisher) Publish(string, ...*message.Message) error { return nil }
func (nopPublisher) Close() error                              { return nil }
