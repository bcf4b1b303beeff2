package fencing

import (
	"encoding/json"
	"fmt"
	"strconv"
	"testing"
)

// The outcome statement's JSON argument for a batch of 1,000 published rows
// ({id: token}), written by jsonObject and by encoding/json: the relay
// builds one per outcome write. Run with
// `go test -run '^$' -bench OutcomeArgument ./fencing/`.
func BenchmarkOutcomeArgument(b *testing.B) {
	ids := make([]string, 1000)
	for i := range ids {
		ids[i] = fmt.Sprintf("0192f3c4-%04x-7abc-8def-0123456789ab", i)
	}
	b.Run("jsonObject", func(b *testing.B) {
		b.ReportAllocs()
		for range b.N {
			var o jsonObject
			for i, id := range ids {
				o.key(id)
				o.buf = strconv.AppendInt(o.buf, int64(i+1), 10)
			}
			_ = o.close()
		}
	})
	b.Run("encoding/json", func(b *testing.B) {
		b.ReportAllocs()
		for range b.N {
			m := make(map[string]int64, len(ids))
			for i, id := range ids {
				m[id] = int64(i + 1)
			}
			q, err := json.Marshal(m)
			if err != nil {
				b.Fatal(err)
			}
			_ = string(q)
		}
	})
}
