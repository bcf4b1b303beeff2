package relaymode_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

// DisableTx switches back to POLLING inside the caller's transaction: the
// transaction sees POLLING at once, others see CDC until it commits, and a
// rollback leaves CDC.
func TestDisableTxSwitchesInTheCallersTransaction(t *testing.T) {
	t.Parallel()
	s := relayDB(t)
	ctx := context.Background()
	require.NoError(t, relaymode.Enable(ctx, s.DB, "ops", time.Time{}))

	tx, err := s.DB.BeginTx(ctx, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback() })
	require.NoError(t, relaymode.DisableTx(ctx, tx, "handover", time.Time{}))
	inside, err := relaymode.ReadMode(ctx, tx)
	require.NoError(t, err)
	require.Equal(t, relaymode.ModePolling, inside.Mode)
	require.Equal(t, "handover", inside.ChangedBy)
	outside, err := relaymode.CurrentMode(ctx, s.DB)
	require.NoError(t, err)
	require.Equal(t, relaymode.ModeCDC, outside, "not visible before commit")
	require.NoError(t, tx.Rollback())

	after, err := relaymode.ReadMode(ctx, s.DB)
	require.NoError(t, err)
	require.Equal(t, relaymode.ModeCDC, after.Mode, "a rollback leaves CDC")
	require.Equal(t, "ops", after.ChangedBy)

	tx, err = s.DB.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, relaymode.DisableTx(ctx, tx, "handover", time.Time{}))
	require.NoError(t, tx.Commit())
	after, err = relaymode.ReadMode(ctx, s.DB)
	require.NoError(t, err)
	require.Equal(t, relaymode.ModePolling, after.Mode)
	require.Equal(t, "handover", after.ChangedBy)
}

func TestModeSwitchRequiresAnOperator(t *testing.T) {
	t.Parallel()
	s := relayDB(t)
	ctx := context.Background()
	for _, by := range []string{"", "   "} {
		err := relaymode.Enable(ctx, s.DB, by, time.Time{})
		require.ErrorIs(t, err, relaymode.ErrOperatorRequired)
		require.Equal(t, outbox.Code("RELAY_MODE_OPERATOR_REQUIRED"), outbox.CodeOf(err))
		err = relaymode.Disable(ctx, s.DB, by)
		require.ErrorIs(t, err, relaymode.ErrOperatorRequired)
	}
	mode, err := relaymode.CurrentMode(ctx, s.DB)
	require.NoError(t, err)
	require.Equal(t, relaymode.ModePolling, mode)
}
