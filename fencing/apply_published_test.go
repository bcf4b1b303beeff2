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
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// fullRow is every column an outcome can touch, for comparing two rows.
type fullRow struct {
	Status                 string
	Attempts               int
	Token                  int64
	Owner, Code, Detail    sql.NullString
	Published, Next, Lease sql.NullTime
	Parked, LastAttempt    sql.NullTime
}

func readFull(t *testing.T, db *sql.DB, id string) fullRow {
	t.Helper()
	var r fullRow
	require.NoError(t, db.QueryRow(`SELECT status, attempts, lease_token, lease_owner, last_failure_code, last_failure_detail,
		published_at, next_attempt_at, lease_expires_at, parked_at, last_attempt_at FROM messaging_outbox WHERE message_id = $1`, id).
		Scan(&r.Status, &r.Attempts, &r.Token, &r.Owner, &r.Code, &r.Detail, &r.Published, &r.Next, &r.Lease, &r.Parked, &r.LastAttempt))
	return r
}

// applyGeneric runs ApplySQL directly, the statement Apply uses for mixed
// batches, to compare it with the all-PUBLISHED statement.
func applyGeneric(ctx context.Context, db fencing.DBTX, now time.Time, cs []fencing.Claimed) (int, error) {
	outcomes := make([]fencing.Outcome, len(cs))
	for i, c := range cs {
		outcomes[i] = fencing.Outcome{Lease: c.Lease, To: envelope.StatusPublished, Now: now}
	}
	q, args := fencing.ApplyStatement(outcomes, true)
	rows, err := db.QueryContext(ctx, q, args...)
	if err != nil {
		return 0, err
	}
	defer rows.Close()
	got := 0
	for rows.Next() {
		got++
	}
	return got, rows.Err()
}

// An all-PUBLISHED batch of one owner goes through ApplyPublishedSQL; the
// rows it writes are exactly those the general statement writes, and the
// fence holds the same way (a row whose token moved on is Stale).
func TestApplyPublishedMatchesTheGeneralStatement(t *testing.T) {
	s := newDB(t)
	ctx := context.Background()
	for i := range 3 {
		insert(t, s.DB, fmt.Sprintf("a%d", i), "")
		insert(t, s.DB, fmt.Sprintf("b%d", i), "")
	}
	// A past failure on every row, so "failure columns left alone" is checked.
	_, err := s.DB.Exec(`UPDATE messaging_outbox SET last_failure_code = 'OLD', last_failure_detail = 'old', next_attempt_at = $1`, t0.Add(-time.Minute))
	require.NoError(t, err)
	claimed, err := fencing.Claim(ctx, s.DB, params("relay", t0))
	require.NoError(t, err)
	require.Len(t, claimed, 6)
	var a, b []fencing.Claimed
	for _, c := range claimed {
		if c.Row.MessageID[0] == 'a' {
			a = append(a, c)
		} else {
			b = append(b, c)
		}
	}
	// a2 is named with a token it never had: the fence refuses it.
	stale := a[2].Lease
	stale.Token++
	outs := []fencing.Outcome{
		{Lease: a[0].Lease, To: envelope.StatusPublished, Now: t0.Add(time.Second)},
		{Lease: a[1].Lease, To: envelope.StatusPublished, Now: t0.Add(time.Second)},
		{Lease: stale, To: envelope.StatusPublished, Now: t0.Add(time.Second)},
	}
	res, err := fencing.Apply(ctx, s.DB, outs)
	require.NoError(t, err)
	require.Equal(t, []fencing.Result{fencing.Applied, fencing.Applied, fencing.Stale}, res)
	n, err := applyGeneric(ctx, s.DB, t0.Add(time.Second), b[:2])
	require.NoError(t, err)
	require.Equal(t, 2, n)
	for i := range 2 {
		fast, general := readFull(t, s.DB, a[i].Row.MessageID), readFull(t, s.DB, b[i].Row.MessageID)
		require.Equal(t, general, fast)
		require.Equal(t, "PUBLISHED", fast.Status)
		require.Equal(t, "OLD", fast.Code.String)
	}
	require.Equal(t, "IN_FLIGHT", readFull(t, s.DB, "a2").Status, "the stale outcome wrote nothing")
}

// BenchmarkApplyPublished times the terminal write of a 100-row batch with
// the general statement and with ApplyPublishedSQL, alternating in the same
// run so the shared machine's drift hits both:
//
//	go test -run '^$' -bench ApplyPublished -benchtime 200x ./fencing/
func BenchmarkApplyPublished(b *testing.B) {
	s := testdb.New(b)
	s.DB.SetMaxOpenConns(4)
	ctx := context.Background()
	const batch = 100
	_, err := s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload)
		SELECT 'm' || g, 'orders', convert_to(repeat('x', 1024), 'UTF8') FROM generate_series(1, $1) g`, (b.N+1)*batch)
	require.NoError(b, err)
	_, err = s.DB.Exec(`VACUUM ANALYZE messaging_outbox`)
	require.NoError(b, err)
	var general, published time.Duration
	var ng, np int
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		cs, err := fencing.Claim(ctx, s.DB, fencing.ClaimParams{Owner: "bench", Limit: batch, Lease: time.Minute, MaxAttempts: 10})
		require.NoError(b, err)
		require.Len(b, cs, batch)
		start := time.Now()
		if i%2 == 0 {
			n, err := applyGeneric(ctx, s.DB, time.Time{}, cs)
			require.NoError(b, err)
			require.Equal(b, batch, n)
			general += time.Since(start)
			ng++
		} else {
			outs := make([]fencing.Outcome, len(cs))
			for j, c := range cs {
				outs[j] = fencing.Outcome{Lease: c.Lease, To: envelope.StatusPublished}
			}
			_, err := fencing.Apply(ctx, s.DB, outs)
			require.NoError(b, err)
			published += time.Since(start)
			np++
		}
	}
	if ng > 0 && np > 0 {
		b.ReportMetric(float64(general.Microseconds())/float64(ng), "general-µs/batch")
		b.ReportMetric(float64(published.Microseconds())/float64(np), "published-µs/batch")
	}
}
