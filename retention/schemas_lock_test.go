package retention_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/retention"
)

// Package doc: the run lock's key is derived from the outbox table the
// connection resolves, so cleaners of one schema exclude each other and
// cleaners in other schemas do not.
func TestCleanersInOtherSchemasDoNotExcludeEachOther(t *testing.T) {
	t.Parallel()
	a, b := newSchema(t), newSchema(t)
	insertPublished(t, a.DB, "a-", 30, now.Add(-100*time.Hour))
	insertPublished(t, b.DB, "b-", 30, now.Add(-100*time.Hour))

	done, release := startHeldRun(t, a.DB)

	// The lock in A is really held: another cleaner of schema A skips...
	otherA, err := retention.New(a.Open(t), nil, retention.Config{BatchSize: 10, Now: clock})
	require.NoError(t, err)
	res, err := otherA.Run(context.Background())
	require.NoError(t, err)
	require.True(t, res.Skipped, "a cleaner of the same schema is excluded")

	// ...while a cleaner of schema B runs, meanwhile, to the end.
	inB, err := retention.New(b.DB, nil, retention.Config{BatchSize: 10, Now: clock})
	require.NoError(t, err)
	res, err = inB.Run(context.Background())
	require.NoError(t, err)
	require.False(t, res.Skipped, "a cleaner in another schema is not excluded")
	require.Equal(t, 30, res.Deleted)
	require.Zero(t, b.Count(t, ""))
	require.Equal(t, 30, a.Count(t, ""), "schema A's first batch is still open, nothing of A committed yet")

	release()
	var o runOutcome
	select {
	case o = <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("the run in schema A did not return within 20s")
	}
	require.NoError(t, o.err)
	require.False(t, o.res.Skipped)
	require.Equal(t, 30, o.res.Deleted)
}
