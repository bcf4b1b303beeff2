package stmtset_test

import (
	"database/sql"
	"errors"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/internal/stmtset"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// Concurrent callers prepare a statement once; a failed prepare is not
// remembered; a closed set prepares nothing and Close is idempotent.
func TestGetOrPrepare(t *testing.T) {
	s := testdb.New(t)
	var set stmtset.Set
	var prepares atomic.Int32
	prepare := func() (*sql.Stmt, error) {
		prepares.Add(1)
		return s.DB.Prepare(`SELECT 1`)
	}
	var wg sync.WaitGroup
	got := make([]*sql.Stmt, 8)
	for i := range got {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st, closed, err := set.GetOrPrepare("one", prepare)
			require.NoError(t, err)
			require.False(t, closed)
			got[i] = st
		}()
	}
	wg.Wait()
	require.Equal(t, int32(1), prepares.Load(), "prepared once")
	for _, st := range got {
		require.Same(t, got[0], st)
	}
	st, closed := set.Get("one")
	require.Same(t, got[0], st)
	require.False(t, closed)

	boom := errors.New("boom")
	_, _, err := set.GetOrPrepare("two", func() (*sql.Stmt, error) { return nil, boom })
	require.ErrorIs(t, err, boom)
	st, _ = set.Get("two")
	require.Nil(t, st, "a failed prepare is not remembered")

	require.NoError(t, set.Close())
	require.NoError(t, set.Close(), "Close twice is harmless")
	_, err = got[0].Exec()
	require.Error(t, err, "Close closed the statement")
	st, closed, err = set.GetOrPrepare("three", prepare)
	require.NoError(t, err)
	require.Nil(t, st)
	require.True(t, closed)
	require.Equal(t, int32(1), prepares.Load(), "a closed set prepares nothing")
}
