package forwarder

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// pinnedOnPool is a pinned (busy nil: always draining) over a fresh test
// schema's pool of maxOpen connections, all kept idle between uses, closed
// at the test's end.
func pinnedOnPool(t *testing.T, maxOpen int, prepare bool, busy func() bool) (*sql.DB, *pinned) {
	t.Helper()
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(maxOpen)
	s.DB.SetMaxIdleConns(maxOpen)
	p := newPinned(s.DB, prepare, busy, 0)
	t.Cleanup(p.close)
	return s.DB, p
}

// warm leaves n idle connections in db's pool (only an idle connection is
// pinned).
func warm(t *testing.T, db *sql.DB, n int) {
	t.Helper()
	db.SetMaxIdleConns(n)
	conns := make([]*sql.Conn, n)
	for i := range conns {
		c, err := db.Conn(context.Background())
		require.NoError(t, err)
		conns[i] = c
	}
	for _, c := range conns {
		require.NoError(t, c.Close())
	}
}

// backendOf is the PostgreSQL backend a pinned connection runs on.
func backendOf(t *testing.T, c *pinnedConn) int {
	t.Helper()
	var pid int
	require.NoError(t, c.QueryRowContext(context.Background(), `SELECT pg_backend_pid()`).Scan(&pid))
	return pid
}

// A pinned connection serves one caller at a time and the same backend to
// each; a caller that finds it taken gets nil (and uses the pool), never
// waits.
func TestAPinnedConnectionIsOneCallersAtATime(t *testing.T) {
	_, p := pinnedOnPool(t, 3, true, nil)
	ctx := context.Background()

	c := p.take(ctx)
	require.NotNil(t, c)
	first := backendOf(t, c)
	require.Nil(t, p.take(ctx), "taken: the second caller uses the pool")
	p.give(c)

	c = p.take(ctx)
	require.NotNil(t, c)
	require.Equal(t, first, backendOf(t, c), "the same backend again")
	p.give(c)
}

// A statement that finds the pinned connection in use waits for it, at
// most shareWait: given back in time, it gets the same backend; kept past
// the wait, the caller uses the pool.
func TestAStatementWaitsForThePinnedConnectionInUse(t *testing.T) {
	_, p := pinnedOnPool(t, 3, true, nil)
	ctx := context.Background()
	p.shareWait = time.Hour

	c := p.take(ctx)
	require.NotNil(t, c)
	first := backendOf(t, c)
	got := make(chan *pinnedConn, 1)
	go func() { got <- p.take(ctx) }()
	await.Until(t, func() bool { return p.waiting.Load() == 1 }, "the second caller waits")
	p.give(c)
	c = waitFor(t, got)
	require.NotNil(t, c, "given back: the waiting caller has it")
	require.Equal(t, first, backendOf(t, c), "the same backend")

	p.shareWait = time.Millisecond
	require.Nil(t, p.take(ctx), "kept past the wait: the pool")
	require.Zero(t, p.waiting.Load())
	p.give(c)

	// A caller whose context ends stops waiting.
	p.shareWait = time.Hour
	c = p.take(ctx)
	require.NotNil(t, c)
	cctx, cancel := context.WithCancel(ctx)
	go func() { got <- p.take(cctx) }()
	await.Until(t, func() bool { return p.waiting.Load() == 1 }, "the second caller waits")
	cancel()
	require.Nil(t, waitFor(t, got), "its context ended: the pool")
	p.give(c)
}

// The wait for the pinned connection leaves the statement its time: at
// most shareWait, and at most a quarter of what is left before the
// statement's deadline (DBTimeout runs while it waits). A context already
// past its deadline, or no sharing, waits not at all.
func TestTheWaitForThePinnedConnectionLeavesTheStatementItsTime(t *testing.T) {
	p := &pinned{shareWait: 250 * time.Millisecond}
	require.Equal(t, 250*time.Millisecond, p.waitBound(context.Background()), "no deadline: shareWait")
	far, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	require.Equal(t, 250*time.Millisecond, p.waitBound(far), "a distant deadline: shareWait")
	near, cancel := context.WithTimeout(context.Background(), 400*time.Millisecond)
	defer cancel()
	w := p.waitBound(near)
	require.LessOrEqual(t, w, 100*time.Millisecond, "a quarter of the 400 ms left")
	require.Positive(t, w)
	past, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancel()
	require.LessOrEqual(t, p.waitBound(past), time.Duration(0), "past its deadline: no wait")
	_, ok := p.await(past)
	require.False(t, ok, "and await gives up at once")
	p.shareWait = 0
	require.Zero(t, p.waitBound(far), "without ShareConnection: no wait")
}

// waitFor receives from ch, failing the test after a minute.
func waitFor[T any](t *testing.T, ch <-chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(time.Minute):
		t.Fatal("nothing received in a minute")
		var zero T
		return zero
	}
}

// A pool of one or two connections is not pinned: the heartbeat would wait
// behind connections that never go back to the pool.
func TestASmallPoolIsNotPinned(t *testing.T) {
	s := testdb.New(t)
	p := newPinned(s.DB, false, nil, 0)
	t.Cleanup(p.close)
	for _, n := range []int{1, 2} {
		s.DB.SetMaxOpenConns(n)
		require.Nil(t, p.take(context.Background()), "MaxOpenConns %d", n)
	}
	s.DB.SetMaxOpenConns(0) // unlimited
	c := p.take(context.Background())
	require.NotNil(t, c)
	p.give(c)
}

// A refusal from PostgreSQL keeps the connection pinned; a connection the
// server ended goes back to the pool and the next caller gets another
// backend.
func TestAPinnedConnectionThatFailsGoesBackToThePool(t *testing.T) {
	db, p := pinnedOnPool(t, 4, true, nil)
	ctx := context.Background()

	c := p.take(ctx)
	first := backendOf(t, c)
	_, err := c.ExecContext(ctx, `SELECT 1/0`)
	require.Error(t, err)
	p.give(c)
	c = p.take(ctx)
	require.Equal(t, first, backendOf(t, c), "a refusal leaves the connection pinned")
	p.give(c)

	_, err = db.Exec(`SELECT pg_terminate_backend($1)`, first)
	require.NoError(t, err)
	c = p.take(ctx)
	_, err = c.QueryContext(ctx, `SELECT 1`)
	require.Error(t, err, "the backend is gone")
	p.give(c)

	c = p.take(ctx)
	require.NotNil(t, c)
	require.NotEqual(t, first, backendOf(t, c), "a new connection")
	p.give(c)
}

// Only a connection idle in the pool is pinned: a pool with none (none
// opened yet, or all in use) pins nothing and opens nothing for the pin.
func TestAPinOpensNoConnection(t *testing.T) {
	s := testdb.New(t)
	db := s.Open(t) // a pool of its own, no connection opened yet
	db.SetMaxOpenConns(4)
	db.SetMaxIdleConns(4)
	p := newPinned(db, false, nil, 0)
	t.Cleanup(p.close)
	ctx := context.Background()

	require.Nil(t, p.take(ctx), "no idle connection: the pool")
	require.Zero(t, db.Stats().OpenConnections, "the pin opened none")

	warm(t, db, 1)
	held, err := db.Conn(ctx) // the one idle connection, in use now
	require.NoError(t, err)
	require.Nil(t, p.take(ctx), "the only connection in use: the pool")
	require.Equal(t, 1, db.Stats().OpenConnections, "the pin opened none")
	require.NoError(t, held.Close())

	c := p.take(ctx)
	require.NotNil(t, c, "an idle connection: pinned")
	require.Equal(t, 1, db.Stats().OpenConnections, "the idle one, not a new one")
	p.give(c)
}

// After maxAge a pinned connection goes back to the pool, so the pool's
// ConnMaxLifetime applies to it; once closed, nothing is pinned.
func TestAPinnedConnectionGoesBackAfterItsAgeAndOnClose(t *testing.T) {
	db, p := pinnedOnPool(t, 4, false, nil)
	ctx := context.Background()

	p.maxAge = 0
	c := p.take(ctx)
	require.NotNil(t, c)
	require.Equal(t, 1, db.Stats().InUse)
	p.give(c)
	require.Zero(t, db.Stats().InUse, "back in the pool")

	p.maxAge = time.Hour
	c = p.take(ctx)
	p.give(c)
	require.Equal(t, 1, db.Stats().InUse, "pinned")
	p.close()
	require.Zero(t, db.Stats().InUse, "closed: back in the pool")
	require.Nil(t, p.take(ctx), "closed: nothing pinned")
}

// A pool closed under the relay stops its statements: the pinned
// connection goes back (database/sql then closes it) and the caller gets
// the closed pool's error.
func TestAClosedPoolIsNotPinned(t *testing.T) {
	s := testdb.New(t)
	db := s.Open(t)
	db.SetMaxOpenConns(4)
	warm(t, db, 1)
	p := newPinned(db, true, nil, 0)
	t.Cleanup(p.close)
	ctx := context.Background()
	c := p.take(ctx)
	require.NotNil(t, c)
	require.False(t, poolClosed(db))
	p.give(c)

	require.NoError(t, db.Close())
	require.True(t, poolClosed(db))
	require.Nil(t, p.take(ctx), "closed pool: nothing pinned")
	require.Zero(t, db.Stats().InUse, "the pinned connection went back")
}

// A relay that is not draining full batches pins nothing: a pool it shares
// with the service is not held by an idle relay, and its statements stay
// prepared on the pool's connections.
func TestAConnectionStaysPinnedOnlyWhileTheRelayDrains(t *testing.T) {
	var draining bool
	db, p := pinnedOnPool(t, 4, false, func() bool { return draining })
	ctx := context.Background()

	require.Nil(t, p.take(ctx), "keeping up: the pool")
	draining = true
	c := p.take(ctx)
	require.NotNil(t, c)
	p.give(c)
	require.Equal(t, 1, db.Stats().InUse, "draining: pinned")
	draining = false
	c = p.take(ctx)
	require.NotNil(t, c, "the last full batch's connection serves once more")
	p.give(c)
	require.Zero(t, db.Stats().InUse, "caught up: back in the pool")
	require.Nil(t, p.take(ctx))
}

// Which failures give a pinned connection back: those that may have ended
// it, not PostgreSQL's refusals of one statement.
func TestWhichFailuresEndAPinnedConnection(t *testing.T) {
	for state, lost := range map[string]bool{
		"":      true,  // not from PostgreSQL: the network, a timeout, a cancel
		"08006": true,  // connection_failure
		"57P01": true,  // admin_shutdown (pg_terminate_backend)
		"57P05": true,  // idle_session_timeout
		"25P03": true,  // idle_in_transaction_session_timeout
		"57014": false, // query_canceled by statement_timeout: the session goes on
		"22012": false, // division_by_zero
		"40001": false, // serialization_failure
		"55P03": false, // lock_not_available
	} {
		require.Equal(t, lost, connectionLost(state), "SQLSTATE %q", state)
	}
}

// Relays that share a pool pin while it keeps a connection free for
// everything else: in a pool of 4, three pins, not a fourth.
func TestPinsLeaveAConnectionOfASharedPool(t *testing.T) {
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(4)
	warm(t, s.DB, 4)
	ctx := context.Background()
	for i := range 4 {
		p := newPinned(s.DB, false, func() bool { return true }, 0)
		c := p.take(ctx)
		if i < 3 {
			require.NotNil(t, c, "pin %d", i)
			p.give(c) // pinned: stays out of the pool
			t.Cleanup(p.close)
			continue
		}
		require.Nil(t, c, "a fourth pin would leave the pool nothing")
	}
	require.Equal(t, 3, s.DB.Stats().InUse)
	var one int
	require.NoError(t, s.DB.QueryRowContext(ctx, `SELECT 1`).Scan(&one), "the pool still serves")
}
