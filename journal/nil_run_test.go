package journal_test

import (
	"context"
	"database/sql"
	"testing"

	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/journal"
)

// Checkpoint, Complete and Fail refuse a nil *Run with a code before any
// statement (the zero *sql.DB here would panic if one were run).
func TestNilRunIsRefused(t *testing.T) {
	t.Parallel()
	j, err := journal.New(&sql.DB{}, journal.Config{Owner: "a"})
	require.NoError(t, err)
	ctx := context.Background()

	err = j.Checkpoint(ctx, nil, 1, "1")
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	require.Contains(t, err.Error(), "journal.Checkpoint")
	err = j.Complete(ctx, nil)
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	require.Contains(t, err.Error(), "journal.Complete")
	err = j.Fail(ctx, nil, "X", "detail")
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	require.Contains(t, err.Error(), "journal.Fail")
}

// JOURNAL_OPERATION_REQUIRED is also Approve's refusal of an operation other
// than redrive or purge (as its documentation says), before any statement.
func TestApproveRefusesAnUnknownOperation(t *testing.T) {
	t.Parallel()
	j, err := journal.New(&sql.DB{}, journal.Config{Owner: "a"})
	require.NoError(t, err)
	for _, op := range []string{"", "delete", "Redrive"} {
		_, err := j.Approve(context.Background(), "T-1", op, journal.Filter{})
		require.ErrorIs(t, err, journal.ErrOperationRequired, "%q", op)
	}
}
