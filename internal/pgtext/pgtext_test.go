package pgtext_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/internal/pgtext"
)

func TestUnstorableAndControlAt(t *testing.T) {
	for _, c := range []struct {
		s       string
		why     string
		control int
	}{
		{"orders", "", -1},
		{"ünïcode ✓", "", -1},
		{"a\x00b", "contains a NUL byte, which PostgreSQL text cannot store", -1},
		{"a\xffb", "is not valid UTF-8", -1},
		{"tab\there", "", 3},
		{"del\x7f", "", 3},
		{"c1\u0085", "", 2},
		{"nbsp\u00a0", "", -1},
	} {
		require.Equal(t, c.why, pgtext.Unstorable(c.s), "%q", c.s)
		require.Equal(t, c.control, pgtext.ControlAt(c.s), "%q", c.s)
	}
}
