package badinput_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
)

// FuzzDecodeStoredHeaders feeds arbitrary bytes to the headers decoder, as a
// hand-written INSERT or a restored backup can: envelope's FuzzHeaderCodec
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
