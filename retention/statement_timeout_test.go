package retention_test

import (
	"context"
	"database/sql"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/retention"
)

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
