package retention_test

import (
	"context"
	"database/sql"
	"math"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/retention"
)

func TestConfigDefaultsAreValid(t *testing.T) {
	require.NoError(t, retention.Config{}.Validate())
	s := newSchema(t)
	c, err := retention.New(s.DB, nil, retention.Config{})
	require.NoError(t, err)
	cfg := c.Config()
	require.Equal(t, retention.DefaultHorizon, cfg.Horizon)
	require.Equal(t, 72*time.Hour, cfg.Horizon)
	require.Equal(t, retention.DefaultBatchSize, cfg.BatchSize)
	require.Equal(t, retention.DefaultMaxBatches, cfg.MaxBatches)
	require.Equal(t, retention.DefaultStatementTimeout, cfg.StatementTimeout)
	require.Equal(t, retention.ByPublishedAt, cfg.Mode)
	require.Zero(t, cfg.InboxHorizon)
}

func TestConfigRefusals(t *testing.T) {
	cases := map[string]retention.Config{
		"negative horizon":        {Horizon: -time.Hour},
		"negative batch size":     {BatchSize: -1},
		"negative max batches":    {MaxBatches: -1},
		"negative timeout":        {StatementTimeout: -time.Second},
		"sub-millisecond timeout": {StatementTimeout: time.Microsecond},
		"negative inbox horizon":  {InboxHorizon: -time.Hour},
		"unknown mode":            {Mode: "BY_MOOD"},
	}
	for name, cfg := range cases {
		t.Run(name, func(t *testing.T) {
			err := cfg.Validate()
			require.ErrorIs(t, err, outbox.ErrInvalidConfig)
			_, err = retention.New(&sql.DB{}, nil, cfg)
			require.ErrorIs(t, err, outbox.ErrInvalidConfig)
		})
	}
	_, err := retention.New(nil, nil, retention.Config{})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
}

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

// PostgreSQL's statement_timeout holds at most 2147483647ms: a longer
// StatementTimeout is refused by Validate (and New) as OUTBOX_INVALID_CONFIG
// instead of failing every Run inside set_config with an uncoded database
// error; the longest accepted one runs.
func TestStatementTimeoutAbovePostgreSQLsLimitIsRefused(t *testing.T) {
	const limit = math.MaxInt32 * time.Millisecond
	for _, d := range []time.Duration{limit + time.Millisecond, 30 * 24 * time.Hour, math.MaxInt64} {
		cfg := retention.Config{StatementTimeout: d}
		err := cfg.Validate()
		require.ErrorIs(t, err, outbox.ErrInvalidConfig, "StatementTimeout %s", d)
		require.Equal(t, outbox.CodeInvalidConfig, outbox.CodeOf(err))
		require.Contains(t, err.Error(), "StatementTimeout")
		_, err = retention.New(&sql.DB{}, nil, cfg)
		require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	}

	s := newSchema(t)
	insertPublished(t, s.DB, "old-", 2, now.Add(-100*time.Hour))
	// The part of a millisecond PostgreSQL does not see does not count.
	cfg := retention.Config{StatementTimeout: limit + time.Millisecond - time.Nanosecond, Now: clock}
	require.NoError(t, cfg.Validate())
	var inside []string
	retention.SetBeforeCommit(&cfg, func(ctx context.Context, tx *sql.Tx, _ retention.Batch) error {
		var v string
		if err := tx.QueryRowContext(ctx, `SHOW statement_timeout`).Scan(&v); err != nil {
			return err
		}
		inside = append(inside, v)
		return nil
	})
	c, err := retention.New(s.DB, nil, cfg)
	require.NoError(t, err)
	res, err := c.Run(context.Background())
	require.NoError(t, err)
	require.Equal(t, 2, res.Deleted)
	require.Equal(t, []string{"2147483647ms"}, inside)
}
