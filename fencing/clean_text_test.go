package fencing_test

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// CleanText's doc: the result is at most max bytes, and a max of 0 or less
// leaves no room: "" (a negative max used to panic slicing s[:max]).
func TestCleanTextWithNoRoomIsEmpty(t *testing.T) {
	for _, max := range []int{0, -1, -4, math.MinInt} {
		for _, s := range []string{"", "abc", "é\x00", "\xff"} {
			var got string
			require.NotPanics(t, func() { got = fencing.CleanText(s, max) }, "CleanText(%q, %d)", s, max)
			require.Empty(t, got, "CleanText(%q, %d)", s, max)
		}
	}
	require.Equal(t, "a", fencing.CleanText("ab", 1), "a positive max still cuts")
}
