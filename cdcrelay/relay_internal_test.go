package cdcrelay

import (
	"database/sql"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

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
