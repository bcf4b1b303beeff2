package publisher

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
)

// A batch addresses its payloads with int4 offsets; a call whose payloads
// add up past them is refused before anything is built, whatever
// MaxPayloadBytes says. The sizes are given, not allocated.
func TestBatchPayloadsBeyondInt4OffsetsAreRefused(t *testing.T) {
	total := func(s ...int) (n int64) {
		for _, b := range s {
			n += int64(b)
		}
		return n
	}

	require.NoError(t, checkBatchPayloads(2, total(1<<30, 1<<30-2)), "2 GiB - 2 bytes: the last start offset still fits")
	require.NoError(t, checkBatchPayloads(2, total(math.MaxInt32-1, 0)), "an empty payload after the largest total starts at MaxInt32")

	for name, s := range map[string][]int{
		"2 GiB - 1 byte":          {1 << 30, 1<<30 - 1},
		"2 GiB in two":            {1 << 30, 1 << 30},
		"each fits, not together": {math.MaxInt32 / 2, math.MaxInt32 / 2, math.MaxInt32 / 2},
		"one payload past int4":   {1, math.MaxInt32},
		"a sum past a 32-bit int": {math.MaxInt32, math.MaxInt32, math.MaxInt32},
	} {
		t.Run(name, func(t *testing.T) {
			err := checkBatchPayloads(len(s), total(s...))
			require.ErrorIs(t, err, ErrPayloadTooLarge)
			require.Equal(t, CodePayloadTooLarge, outbox.CodeOf(err))
		})
	}
}
