package retention_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/retention"
)

// Issue 21: `cleanup --horizon 1ns --inbox-horizon 1ns` deleted every
// published row and every inbox id. Horizons below the floor are refused
// unless AllowShortHorizons says they are meant, and a Cleaner built with
// one is logged.
func TestHorizonsBelowTheFloorNeedTheOverride(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	for _, cfg := range []retention.Config{
		{Horizon: time.Nanosecond},
		{Horizon: retention.DefaultHorizon - time.Second},
		{InboxHorizon: time.Nanosecond},
		{InboxHorizon: retention.MinInboxHorizon - time.Second},
	} {
		_, err := retention.New(s.DB, nil, cfg)
		require.ErrorIs(t, err, retention.ErrHorizonBelowFloor, "%+v", cfg)
		require.Contains(t, err.Error(), "AllowShortHorizons")
	}
	quiet := watermill.NewCaptureLogger()
	_, err := retention.New(s.DB, quiet, retention.Config{Horizon: retention.DefaultHorizon, InboxHorizon: retention.MinInboxHorizon})
	require.NoError(t, err, "the floors themselves are allowed")
	require.False(t, quiet.Has(watermill.CapturedMessage{Level: watermill.InfoLogLevel, Msg: "retention horizons below the floor, allowed by AllowShortHorizons"}))

	logger := watermill.NewCaptureLogger()
	_, err = retention.New(s.DB, logger, retention.Config{Horizon: time.Nanosecond, InboxHorizon: time.Nanosecond, AllowShortHorizons: true})
	require.NoError(t, err)
	var logged bool
	for _, m := range logger.Captured()[watermill.InfoLogLevel] {
		if m.Msg == "retention horizons below the floor, allowed by AllowShortHorizons" {
			logged = true
			require.Equal(t, time.Nanosecond, m.Fields["horizon"])
			require.Equal(t, time.Nanosecond, m.Fields["inbox_horizon"])
		}
	}
	require.True(t, logged, "the override is logged")
}

// A session that holds the retention lock (any login that can run
// pg_advisory_lock) stops retention; the skipped run names it.
func TestSkippedRunNamesTheLockHolder(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	squatter, err := s.Open(t).Conn(context.Background())
	require.NoError(t, err)
	defer squatter.Close()
	_, err = squatter.ExecContext(context.Background(), `SET application_name = 'squatter'`)
	require.NoError(t, err)
	var pid int
	require.NoError(t, squatter.QueryRowContext(context.Background(), `SELECT pg_backend_pid()`).Scan(&pid))
	_, err = squatter.ExecContext(context.Background(),
		`SELECT pg_advisory_lock(hashtextextended('watermill-outbox/retention/' || 'messaging_outbox'::regclass::oid::text, 0))`)
	require.NoError(t, err)

	c, err := retention.New(s.DB, nil, retention.Config{Now: clock})
	require.NoError(t, err)
	res, err := c.Run(context.Background())
	require.NoError(t, err)
	require.True(t, res.Skipped)
	require.Contains(t, res.HeldBy, fmt.Sprintf("pid %d (", pid))
	require.Contains(t, res.HeldBy, "squatter")
}
