package fencing

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
)

// The claim's RETURNING list must stay envelope.SelectColumns, column for
// column, except the four timestamps Claimed.Row documents as zero:
// envelope.ScanRow reads it by position.
func TestClaimColumnsFollowSelectColumns(t *testing.T) {
	split := func(s string) []string {
		var out []string
		for _, c := range strings.Split(s, ",") {
			out = append(out, strings.TrimSpace(c))
		}
		return out
	}
	want := split(envelope.SelectColumns)
	for i, c := range want {
		switch c {
		case "published_at", "next_attempt_at", "last_attempt_at", "parked_at":
			want[i] = "NULL::timestamptz"
		}
	}
	require.Equal(t, want, split(claimColumns))
}
