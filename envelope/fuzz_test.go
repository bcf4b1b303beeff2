package envelope_test

import (
	"bytes"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
)

// nastyStrings are the cases a hand-written codec gets wrong.
var nastyStrings = []string{
	"", "plain", `ends with a backslash\`, `\`, `\\`, `"`, `say "hi"`, `\"`, `\u0000`,
	"tab\tnewline\ncr\r", "\x01\x1f\x7f", "🚀", "👩‍👩‍👧", "Grüße 日本語", "\u2028\u2029",
	"<>&", `{"a":1}`, `{NULL,"x"}`, "a\x00b", "\xff", "\xc3\x28", strings.Repeat("x", 300),
}

func textOK(s string) bool { return utf8.ValidString(s) && !strings.Contains(s, "\x00") }

// FuzzHeaderCodec: EncodeHeaders then DecodeHeaders is the identity for
// every storable map; anything else is refused with OUTBOX_INVALID_HEADER.
func FuzzHeaderCodec(f *testing.F) {
	for _, k := range nastyStrings {
		for _, v := range []string{"", `x\`, k} {
			f.Add(k, v, "second", `\`)
		}
	}
	f.Fuzz(func(t *testing.T, k1, v1, k2, v2 string) {
		h := map[string]string{k1: v1, k2: v2}
		storable := true
		for k, v := range h {
			storable = storable && k != "" && textOK(k) && textOK(v)
		}
		enc, err := envelope.EncodeHeaders(h)
		if !storable {
			require.ErrorIs(t, err, outbox.ErrInvalidHeader)
			return
		}
		require.NoError(t, err)
		require.False(t, bytes.Contains(enc, []byte{0}), "jsonb cannot hold NUL")
		dec, err := envelope.DecodeHeaders(enc)
		require.NoError(t, err)
		require.Equal(t, h, dec)
	})
}

// FuzzToRowToMessage: a message that ToRow accepts comes back from ToMessage
// with the same id, payload, application headers and canonical fields; one it
// refuses is refused with a typed code.
func FuzzToRowToMessage(f *testing.F) {
	for _, s := range nastyStrings {
		f.Add("id-1", "topic", "x-h", s, []byte(s), "acme", s)
		f.Add(s, "topic", s, "v", []byte{0, 0xff}, s, "pk")
	}
	f.Add("id", "", "k", "v", []byte(nil), "", "")
	f.Add(strings.Repeat("i", envelope.MaxMessageIDLength+1), "t", "msg.bogus", "v", []byte("p"), "", "")
	f.Add("id", "t", envelope.WatermillCorrelationKey, "corr", []byte("p"), "t-1", "")
	f.Add("id", "t", envelope.KeyOccurredAt, "2026-01-02T15:04:05.5+01:00", []byte("p"), "", "")
	f.Add("id", "t", envelope.KeyAggregateVersion, "+007", []byte("p"), "", "")
	f.Add("id", "t", envelope.KeyCorrelationID, `c\`, []byte("p"), "", "")
	f.Fuzz(func(t *testing.T, id, topic, key, value string, payload []byte, tenant, partitionKey string) {
		msg := message.NewMessage(id, payload)
		msg.Metadata.Set(key, value)
		envelope.SetTenant(msg, tenant)
		envelope.SetPartitionKey(msg, partitionKey)
		original := message.Metadata{}
		for k, v := range msg.Metadata {
			original[k] = v
		}

		r, err := envelope.ToRow(topic, msg, envelope.Options{})
		if err != nil {
			switch code := outbox.CodeOf(err); code {
			case outbox.CodeTopicRequired, outbox.CodeMessageIDRequired, outbox.CodeMessageIDTooLong,
				outbox.CodeReservedHeader, outbox.CodeInvalidHeader, outbox.CodeInvalidTenant, outbox.CodeInvalidMetadata:
			default:
				t.Fatalf("untyped or unexpected refusal %q: %v", code, err)
			}
			return
		}
		require.Equal(t, id, r.MessageID)
		if r.Tenant != "" {
			require.NoError(t, envelope.ValidateTenant(r.Tenant), "only valid slugs are stored")
		}
		back, err := envelope.ToMessage(r, envelope.Options{})
		require.NoError(t, err)
		require.Equal(t, id, back.UUID)
		require.Equal(t, string(payload), string(back.Payload))
		for k, v := range original {
			if v == "" && (strings.HasPrefix(k, envelope.ReservedPrefix) || k == envelope.WatermillCorrelationKey) {
				continue // an empty canonical value means absent
			}
			switch k {
			case envelope.KeyOccurredAt: // normalised to UTC RFC 3339, truncated to microseconds
				want, err := time.Parse(time.RFC3339Nano, v)
				require.NoError(t, err)
				got, err := time.Parse(time.RFC3339Nano, back.Metadata.Get(k))
				require.NoError(t, err)
				require.True(t, want.Truncate(time.Microsecond).Equal(got), "occurred_at %q came back as %q", v, back.Metadata.Get(k))
			case envelope.KeyAggregateVersion: // normalised to plain base 10
				want, err := strconv.ParseInt(v, 10, 64)
				require.NoError(t, err)
				require.Equal(t, strconv.FormatInt(want, 10), back.Metadata.Get(k))
			default:
				require.Equal(t, v, back.Metadata.Get(k), "key %q", k)
			}
		}
		want := id
		if partitionKey != "" {
			want = partitionKey
		}
		require.Equal(t, want, r.RoutingKey)
	})
}

// FuzzDecodeStoredHeaders feeds arbitrary bytes to the headers decoder, as a
// hand-written INSERT or a restored backup can: FuzzHeaderCodec
// only decodes what EncodeHeaders produced. Whatever the bytes, the decoder
// returns a flat string map that re-encodes to the same map, or refuses
// with OUTBOX_CORRUPT_ROW (which the forwarder turns into a parked row); it
// never panics and never returns another kind of error.
func FuzzDecodeStoredHeaders(f *testing.F) {
	for _, seed := range []string{
		``, `{}`, `[]`, `null`, `"s"`, `1`, `{"a":"b"}`, `{"a":1}`, `{"a":{"b":"c"}}`, `{"a":null}`,
		`{"a":"b\\"}`, `{"a":"\u0000"}`, `{"a":"b","a":"c"}`, `{"msg.tenant":"x"}`, "{\"a\":\"\xff\"}", `{"a":"b"`, ` {"a":"b"} `,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		h, err := envelope.DecodeHeaders(raw)
		if err != nil {
			require.ErrorIs(t, err, outbox.ErrCorruptRow)
			return
		}
		enc, err := envelope.EncodeHeaders(h)
		if err != nil {
			// Decodable JSON can still hold what PostgreSQL text cannot
			// (an escaped NUL): refused on the way back in, typed.
			require.ErrorIs(t, err, outbox.ErrInvalidHeader)
			return
		}
		again, err := envelope.DecodeHeaders(enc)
		require.NoError(t, err)
		require.Equal(t, h, again)
	})
}
