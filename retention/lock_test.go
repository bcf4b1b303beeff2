package retention_test

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/retention"
)

// runOutcome is what a run started in the background returned.
type runOutcome struct {
	res retention.Result
	err error
}

// startHeldRun starts a run (batches of 10) on db and returns once its first
// batch holds its locks; that batch commits when release is called (also at
// cleanup, so a failing test never leaves it open).
func startHeldRun(t *testing.T, db *sql.DB) (done <-chan runOutcome, release func()) {
	t.Helper()
	cfg, held, releaseCh := holdBatch(retention.Config{BatchSize: 10, Now: clock})
	c, err := retention.New(db, nil, cfg)
	require.NoError(t, err)
	ch := make(chan runOutcome, 1)
	go func() {
		res, err := c.Run(context.Background())
		ch <- runOutcome{res, err}
	}()
	var once sync.Once
	release = func() { once.Do(func() { close(releaseCh) }) }
	t.Cleanup(release)
	select {
	case <-held:
	case <-time.After(20 * time.Second):
		t.Fatal("the run did not reach its first batch within 20s")
	}
	return ch, release
}

func TestConcurrentRunsOneSkips(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	insertPublished(t, s.DB, "old-", 30, now.Add(-100*time.Hour))
	done, release := startHeldRun(t, s.DB)

	// A second cleaner on a separate pool (another replica) skips.
	other, err := retention.New(s.Open(t), nil, retention.Config{BatchSize: 10, Now: clock})
	require.NoError(t, err)
	res, err := other.Run(context.Background())
	require.NoError(t, err)
	require.True(t, res.Skipped)
	require.Zero(t, res.Batches)

	release()
	o := <-done
	require.NoError(t, o.err)
	require.False(t, o.res.Skipped)
	require.Equal(t, 30, o.res.Deleted)

	// The lock was released with the run: the next run is not skipped.
	res, err = other.Run(context.Background())
	require.NoError(t, err)
	require.False(t, res.Skipped)
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
