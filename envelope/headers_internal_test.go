package envelope

import (
	"testing"

	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
)

// FuzzDecodeHeadersFastPath: DecodeHeaders' one-step decoding never accepts,
// refuses or reads anything differently from the generic decoding it
// shortcuts.
func FuzzDecodeHeadersFastPath(f *testing.F) {
	for _, raw := range []string{
		``, ` `, `{}`, ` {} `, `null`, `{"a":null}`, `{"a":"null"}`, `{"null":"x"}`, `{"a":"b","a":"c"}`,
		`{"a":1}`, `{"a":true}`, `{"a":["b"]}`, `{"a":{"b":"c"}}`, `[]`, `"s"`, `{`, `{"a":"\ud800"}`,
		`{"a":"b"} x`, `{"":"v"}`, `{"a":"x\u0000y"}`, "{\"a\":\"\xff\"}",
	} {
		f.Add([]byte(raw))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		got, err := DecodeHeaders(raw)
		want, wantErr := decodeHeadersGeneric(raw)
		if wantErr != nil {
			require.Error(t, err, "the fast path accepted %q: %v", raw, got)
			require.Equal(t, outbox.CodeOf(wantErr), outbox.CodeOf(err))
			return
		}
		require.NoError(t, err)
		require.Equal(t, want, got)
	})
}
