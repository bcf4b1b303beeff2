package fencing_test

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// preparedOn counts the statements prepared by protocol (not by SQL
// PREPARE) on the connection q runs on.
func preparedOn(t *testing.T, q interface {
	QueryRowContext(context.Context, string, ...any) *sql.Row
}) int {
	t.Helper()
	var n int
	require.NoError(t, q.QueryRowContext(context.Background(), `SELECT count(*) FROM pg_prepared_statements WHERE NOT from_sql`).Scan(&n))
	return n
}

// Prepared runs the claim and the outcome writes as prepared statements and
// gives the same results as the plain statements; after Close it runs them
// unprepared. With a pool of one connection, pg_prepared_statements shows
// what that connection holds.
func TestPreparedClaimAndApply(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	db := s.Open(t)
	db.SetMaxOpenConns(1)
	for i := range 6 {
		insert(t, s.DB, fmt.Sprintf("m%d", i), "")
	}
	prepared := func() int { return preparedOn(t, db) }
	p := fencing.NewPrepared(db)
	require.Zero(t, prepared(), "nothing is prepared before first use")

	par := params("relay-p", t0)
	par.Limit = 3
	c, err := fencing.Claim(ctx, p, par)
	require.NoError(t, err)
	require.Equal(t, []string{"m0", "m1", "m2"}, ids(c))
	require.Equal(t, 1, prepared(), "the claim is prepared on first use")

	// All PUBLISHED: ApplyPublishedSQL.
	res, err := fencing.Apply(ctx, p, []fencing.Outcome{
		{Lease: c[0].Lease, To: envelope.StatusPublished, Now: t0},
		{Lease: c[1].Lease, To: envelope.StatusPublished, Now: t0},
	})
	require.NoError(t, err)
	require.Equal(t, []fencing.Result{fencing.Applied, fencing.Applied}, res)
	// Mixed: ApplySQL; a lease that does not match is Stale, prepared or not.
	stale := c[1].Lease
	res, err = fencing.Apply(ctx, p, []fencing.Outcome{
		{Lease: c[2].Lease, To: envelope.StatusAmbiguous, Code: "PUBLISH_TIMEOUT", RetryAfter: time.Hour, Now: t0},
		{Lease: stale, To: envelope.StatusFailed, Code: "X", Now: t0},
	})
	require.NoError(t, err)
	require.Equal(t, []fencing.Result{fencing.Applied, fencing.Stale}, res)
	require.Equal(t, 3, prepared())
	require.Equal(t, "PUBLISHED", state(t, s.DB, "m1").Status)
	require.Equal(t, "AMBIGUOUS", state(t, s.DB, "m2").Status)

	// Statements outside the prepared set pass through unchanged.
	var one int
	require.NoError(t, p.QueryRowContext(ctx, `SELECT 1`).Scan(&one))
	_, err = p.ExecContext(ctx, `SELECT 1`)
	require.NoError(t, err)
	require.Equal(t, 3, prepared())

	require.NoError(t, p.Close())
	require.NoError(t, p.Close(), "Close twice is harmless")
	require.Zero(t, prepared(), "Close deallocates the statements")
	c, err = fencing.Claim(ctx, p, par)
	require.NoError(t, err, "after Close the statements run unprepared")
	require.Equal(t, []string{"m3", "m4", "m5"}, ids(c))
	require.Zero(t, prepared())
}

// A statement that cannot be prepared (the table is gone) is an error of
// the call, and is not remembered: the next call prepares again.
func TestPreparedRetriesAFailedPrepare(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	insert(t, s.DB, "m0", "")
	p := fencing.NewPrepared(s.DB)
	t.Cleanup(func() { _ = p.Close() })
	_, err := s.DB.Exec(`ALTER TABLE messaging_outbox RENAME TO moved_away`)
	require.NoError(t, err)
	_, err = fencing.Claim(ctx, p, params("r", t0))
	require.ErrorContains(t, err, "messaging_outbox")
	_, err = s.DB.Exec(`ALTER TABLE moved_away RENAME TO messaging_outbox`)
	require.NoError(t, err)
	c, err := fencing.Claim(ctx, p, params("r", t0))
	require.NoError(t, err)
	require.Equal(t, []string{"m0"}, ids(c))
}

// fencing.Prepared's doc says database/sql prepares the statements again on
// a new connection: after the server ends the only connection (a failover,
// pg_terminate_backend), a claim fails at most once and the next one runs
// prepared on the new connection.
func TestPreparedSurvivesALostConnection(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	db := s.Open(t)
	db.SetMaxOpenConns(1)
	for i := range 4 {
		insert(t, s.DB, fmt.Sprintf("m%d", i), "")
	}
	p := fencing.NewPrepared(db)
	t.Cleanup(func() { _ = p.Close() })
	par := params("relay-p", t0)
	par.Limit = 1
	c, err := fencing.Claim(ctx, p, par)
	require.NoError(t, err)
	require.Len(t, c, 1)
	var pid int
	require.NoError(t, db.QueryRow(`SELECT pg_backend_pid()`).Scan(&pid))
	var ended bool
	require.NoError(t, s.DB.QueryRow(`SELECT pg_terminate_backend($1, 5000)`, pid).Scan(&ended))
	require.True(t, ended)

	failures := 0
	for range 2 {
		if c, err = fencing.Claim(ctx, p, par); err == nil {
			break
		}
		failures++
	}
	require.NoError(t, err, "the claim after the lost connection")
	require.LessOrEqual(t, failures, 1)
	require.Len(t, c, 1)
	var newPID int
	require.NoError(t, db.QueryRow(`SELECT pg_backend_pid()`).Scan(&newPID))
	require.NotEqual(t, pid, newPID, "a new connection")
	require.Equal(t, 1, preparedOn(t, db), "the claim is prepared again on it")
}

// NewPreparedConn prepares the hot statements on its one connection only,
// and Close releases them there; the connection is the caller's to give
// back.
func TestPreparedConnPreparesOnItsConnection(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	db := s.Open(t)
	db.SetMaxOpenConns(3)
	for i := range 3 {
		insert(t, s.DB, fmt.Sprintf("m%d", i), "")
	}
	conn, err := db.Conn(ctx)
	require.NoError(t, err)
	defer func() { require.NoError(t, conn.Close()) }()
	p := fencing.NewPreparedConn(conn)
	par := params("relay-c", t0)
	par.Limit = 3
	c, err := fencing.Claim(ctx, p, par)
	require.NoError(t, err)
	require.Len(t, c, 3)
	require.Equal(t, 1, preparedOn(t, conn), "prepared on this connection")
	require.NoError(t, p.Close())
	require.Zero(t, preparedOn(t, conn), "released by Close")
}
