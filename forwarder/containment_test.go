package forwarder_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// faultDB runs the forwarder's statements on inner and fails some of them
// after the database ran them: claims (which commit, then the client
// "loses the connection" while reading) and outcome writes.
type faultDB struct {
	fencing.DBTX
	failClaims   atomic.Int32 // claims to fail after they committed
	failOutcomes atomic.Int32 // outcome statements to fail before they run
}

var errInjected = errors.New("injected: connection reset while reading the result")

func isClaim(q string) bool   { return strings.Contains(q, "RETURNING message_id, destination") }
func isOutcome(q string) bool { return strings.Contains(q, "RETURNING o.message_id") }

func (d *faultDB) QueryContext(ctx context.Context, q string, args ...any) (*sql.Rows, error) {
	if isOutcome(q) && d.failOutcomes.Add(-1) >= 0 {
		return nil, errInjected
	}
	if isClaim(q) && d.failClaims.Add(-1) >= 0 {
		rows, err := d.DBTX.QueryContext(ctx, q, args...)
		if err != nil {
			return nil, err
		}
		for rows.Next() { // the server committed and sent the rows ...
		}
		_ = rows.Close()
		return nil, errInjected // ... the client never read them
	}
	return d.DBTX.QueryContext(ctx, q, args...)
}

func withFaults(t *testing.T, f *forwarder.Forwarder) *faultDB {
	t.Helper()
	var d *faultDB
	forwarder.WrapStatements(f, func(q fencing.DBTX) fencing.DBTX { d = &faultDB{DBTX: q}; return d })
	return d
}

func counter(t *testing.T, reg prometheus.Gatherer, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == name {
			m := mf.GetMetric()[0]
			if m.GetCounter() != nil {
				return m.GetCounter().GetValue()
			}
			return m.GetGauge().GetValue()
		}
	}
	t.Fatalf("metric %s not gathered", name)
	return 0
}

// A claim that committed on the server but failed in the client (the
// connection lost while reading; the same path as a timeout or a row that
// cannot be read) drops nothing: the rows it took are released at once,
// PENDING with no attempt spent, counted in the Report and the metrics,
// and the next pass publishes them. Before, they stayed IN_FLIGHT until
// their leases expired, each expiry spending an attempt.
func TestClaimFailingAfterItWasSentReleasesItsRows(t *testing.T) {
	for _, prepared := range []bool{true, false} {
		t.Run(map[bool]string{true: "prepared", false: "plain"}[prepared], func(t *testing.T) {
			ctx := context.Background()
			s := newDB(t)
			insertN(t, s.DB, "orders", "a", "b")
			insert(t, s.DB, "orders", keyed("k1", "k"))
			insert(t, s.DB, "orders", keyed("k2", "k"))
			reg := prometheus.NewPedanticRegistry()
			f := newForwarder(t, s.DB, &recorder{}, forwarder.Config{Owner: "r", Metrics: promMetrics(t, reg), DisablePreparedStatements: !prepared})
			d := withFaults(t, f)
			d.failClaims.Store(1)
			rep, err := f.RunOnce(ctx)
			require.ErrorIs(t, err, errInjected)
			require.Equal(t, 1, rep.ClaimFailures)
			require.Equal(t, 4, rep.ClaimReleased)
			require.Zero(t, rep.Claimed)
			for _, id := range []string{"a", "b", "k1", "k2"} {
				st := state(t, s.DB, id)
				require.Equal(t, "PENDING", st.Status, id)
				require.Zero(t, st.Attempts, id)
			}
			require.Equal(t, 1.0, counter(t, reg, forwarder.MetricFailedClaims))
			require.Equal(t, 4.0, counter(t, reg, forwarder.MetricFailedClaimReleased))
			rep, err = f.RunOnce(ctx)
			require.NoError(t, err)
			require.Equal(t, 4, rep.Published)
			require.Zero(t, rep.PossibleDuplicates)
		})
	}
}

// A statement that completes a batch (here the one extending a chain cut
// at the chain cap) failing the same way releases only its own rows: the
// rows of the statement before it are held and published, in key order.
func TestFailingSecondClaimKeepsTheFirstClaimsRows(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	insertN(t, s.DB, "orders", "a")
	insert(t, s.DB, "orders", keyed("k1", "k"))
	insert(t, s.DB, "orders", keyed("k2", "k"))
	rec := &recorder{}
	// BatchSize 4 over Concurrency 4: a chain cap of 1, so the first
	// statement takes a and k1, and a second extends the chain by k2.
	f := newForwarder(t, s.DB, rec, forwarder.Config{Owner: "r", BatchSize: 4, Concurrency: 4})
	var n atomic.Int32
	forwarder.WrapStatements(f, func(q fencing.DBTX) fencing.DBTX { return &secondClaimFails{DBTX: q, n: &n} })
	rep, err := f.RunOnce(ctx)
	require.NoError(t, err, "the batch of the first statement goes on")
	require.Equal(t, 1, rep.ClaimFailures)
	require.Equal(t, 1, rep.ClaimReleased)
	require.Equal(t, 2, rep.Published)
	require.ElementsMatch(t, []string{"a", "k1"}, rec.ids(), "published concurrently")
	st := state(t, s.DB, "k2")
	require.Equal(t, "PENDING", st.Status)
	require.Zero(t, st.Attempts)
	rep, err = f.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, rep.Published)
	require.Equal(t, "k2", rec.ids()[2], "after k1")
}

type secondClaimFails struct {
	fencing.DBTX
	n *atomic.Int32
}

func (d *secondClaimFails) QueryContext(ctx context.Context, q string, args ...any) (*sql.Rows, error) {
	if isClaim(q) && d.n.Add(1) == 2 {
		rows, err := d.DBTX.QueryContext(ctx, q, args...)
		if err != nil {
			return nil, err
		}
		for rows.Next() {
		}
		_ = rows.Close()
		return nil, errInjected
	}
	return d.DBTX.QueryContext(ctx, q, args...)
}

func keyed(id, key string) *message.Message {
	m := message.NewMessage(id, []byte("payload-"+id))
	m.Metadata.Set("msg.ordering_key", key)
	return m
}

// Rows the downstream confirmed whose outcome write then failed are
// possible duplicates (they stay IN_FLIGHT and are published again after
// their leases expire): the Report counts them and the metric follows.
func TestUnrecordedPublishesAreReportedAndCounted(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	insertN(t, s.DB, "orders", "a", "b", "c")
	reg := prometheus.NewPedanticRegistry()
	f := newForwarder(t, s.DB, &recorder{}, forwarder.Config{Owner: "r", Metrics: promMetrics(t, reg)})
	d := withFaults(t, f)
	d.failOutcomes.Store(3) // the write and its two retries
	rep, err := f.RunOnce(ctx)
	require.ErrorIs(t, err, errInjected)
	require.Equal(t, 3, rep.UnrecordedPublishes)
	require.Zero(t, rep.Published)
	require.Equal(t, 3.0, counter(t, reg, forwarder.MetricUnrecordedPublishes))
	require.Equal(t, 3, s.Count(t, "status = 'IN_FLIGHT'"))
	// A claim failing now does not release them: the relay still holds
	// them (they may have been published; their leases decide).
	d.failClaims.Store(1)
	insertN(t, s.DB, "orders", "d")
	rep, err = f.RunOnce(ctx)
	require.ErrorIs(t, err, errInjected)
	require.Equal(t, 1, rep.ClaimReleased)
	require.Equal(t, 3, s.Count(t, "status = 'IN_FLIGHT'"))
}

// MaxBatchBytes bounds what one pass holds: rows are claimed in seq order
// while their bytes fit, and a row larger than the budget goes out alone.
func TestMaxBatchBytesBoundsAPass(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	const kib = 1024
	for _, r := range []struct {
		id   string
		size int
	}{{"a", 40 * kib}, {"b", 40 * kib}, {"c", 40 * kib}, {"huge", 400 * kib}, {"d", kib}} {
		insert(t, s.DB, "orders", message.NewMessage(r.id, make([]byte, r.size)))
	}
	rec := &recorder{}
	f := newForwarder(t, s.DB, rec, forwarder.Config{MaxBatchBytes: 100 * kib, Concurrency: 1})
	var claimed []int
	for s.Count(t, "status = 'PENDING'") > 0 {
		rep, err := f.RunOnce(ctx)
		require.NoError(t, err)
		claimed = append(claimed, rep.Claimed)
	}
	require.Equal(t, []int{2, 1, 1, 1}, claimed, "a+b, c (c+huge would not fit), huge alone, d")
	require.Equal(t, []string{"a", "b", "c", "huge", "d"}, rec.ids())
}

// The budget holds for the whole claim, not per statement: the statements
// that complete a batch (chains extended past their cap, keyed rows walked
// after a short unkeyed claim, rows below the start point) take no row
// larger than what is left, and such a row waits for a claim of its own,
// where it goes out alone.
func TestMaxBatchBytesBoundsEveryStatementOfAClaim(t *testing.T) {
	const kib, budget = 1024, 100 * 1024
	onePass := func(t *testing.T, f *forwarder.Forwarder, s *testdb.Schema) int64 {
		t.Helper()
		before := s.Count(t, "status = 'PUBLISHED'")
		_, err := f.RunOnce(context.Background())
		require.NoError(t, err)
		var bytes int64
		require.NoError(t, s.DB.QueryRow(`SELECT coalesce(sum(octet_length(payload)), 0) FROM messaging_outbox
			WHERE status = 'PUBLISHED'`).Scan(&bytes))
		require.Greater(t, s.Count(t, "status = 'PUBLISHED'"), before, "every pass publishes")
		return bytes
	}
	t.Run("a chain extended past its cap", func(t *testing.T) {
		s := newDB(t)
		for i := 1; i <= 14; i++ {
			size := kib
			if i == 14 {
				size = 400 * kib
			}
			m := message.NewMessage(fmt.Sprintf("k%02d", i), make([]byte, size))
			envelope.SetOrderingKey(m, "k")
			insert(t, s.DB, "orders", m)
		}
		f := newForwarder(t, s.DB, &recorder{}, forwarder.Config{MaxBatchBytes: budget})
		require.Equal(t, int64(13*kib), onePass(t, f, s), "13 rows of 1 KiB, not the 400 KiB row behind them")
		require.Equal(t, int64(413*kib), onePass(t, f, s), "then the large row alone")
	})
	t.Run("keyed rows after a short unkeyed claim", func(t *testing.T) {
		s := newDB(t)
		insert(t, s.DB, "orders", message.NewMessage("u0", []byte("x")))
		f := newForwarder(t, s.DB, &recorder{}, forwarder.Config{MaxBatchBytes: budget})
		onePass(t, f, s) // the walk found no keys: the next claim starts unkeyed
		insert(t, s.DB, "orders", message.NewMessage("u1", make([]byte, 40*kib)))
		k := message.NewMessage("k1", make([]byte, 400*kib))
		envelope.SetOrderingKey(k, "key")
		insert(t, s.DB, "orders", k)
		require.Equal(t, int64(1+40*kib), onePass(t, f, s), "u1 only: k1 does not fit what is left")
		require.Equal(t, int64(1+440*kib), onePass(t, f, s), "then k1 alone")
	})
}

// A claim that fails halves the next claim's byte budget (a link too slow
// to read a full batch within DBTimeout would otherwise fail the same claim
// forever), and each successful claim doubles it back.
func TestFailedClaimHalvesTheNextClaimsBytes(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	for i := range 6 {
		insert(t, s.DB, "orders", message.NewMessage(string(rune('a'+i)), make([]byte, 300)))
	}
	rec := &recorder{}
	f := newForwarder(t, s.DB, rec, forwarder.Config{MaxBatchBytes: 1000, Concurrency: 1})
	d := withFaults(t, f)
	d.failClaims.Store(1)
	rep, err := f.RunOnce(ctx)
	require.ErrorIs(t, err, errInjected)
	require.Equal(t, 3, rep.ClaimReleased, "the failed claim held three rows of 300 bytes")
	rep, err = f.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, rep.Claimed, "half the budget: one row of 300 bytes and its headers, not two")
	rep, err = f.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 3, rep.Claimed, "the whole budget again")
	require.Equal(t, []string{"a", "b", "c", "d"}, rec.ids())
}

// hangCounter is a downstream that hangs forever on every message,
// ignoring its context, and counts the publishes still hanging.
type hangCounter struct {
	hanging atomic.Int32
	release chan struct{}
}

func (h *hangCounter) Publish(string, ...*message.Message) error {
	h.hanging.Add(1)
	defer h.hanging.Add(-1)
	<-h.release
	return nil
}

func (h *hangCounter) Close() error { return nil }

// A downstream that hangs forever and ignores its context costs at most
// MaxAbandoned + 1 goroutines: once more publishes than MaxAbandoned are
// left behind, the relay claims nothing (the Report and the metrics say
// so) until they return.
func TestHangingDownstreamLeavesBoundedGoroutines(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	for i := range 12 {
		insertN(t, s.DB, "orders", string(rune('a'+i)))
	}
	h := &hangCounter{release: make(chan struct{})}
	t.Cleanup(func() { close(h.release) })
	reg := prometheus.NewPedanticRegistry()
	const maxAbandoned = 2
	clk := newClock()
	f := newForwarder(t, s.DB, h, forwarder.Config{
		BatchSize: 1, Concurrency: 1, MaxAbandoned: maxAbandoned, Now: clk.Now,
		PublishTimeout: 20 * time.Millisecond, LeaseDuration: time.Second, DrainTimeout: 20 * time.Millisecond,
		Metrics: promMetrics(t, reg),
	})
	var paused int
	var goroutinesAtPause int
	for pass := range 12 {
		rep, err := f.RunOnce(ctx)
		require.NoError(t, err)
		if rep.ClaimPaused {
			if paused == 0 {
				goroutinesAtPause = runtime.NumGoroutine()
			}
			paused++
			require.Zero(t, rep.Claimed, "pass %d", pass)
			require.Equal(t, maxAbandoned+1, rep.AbandonedPublishes)
			continue
		}
		require.Equal(t, 1, rep.Claimed, "pass %d", pass)
		require.Equal(t, 1, rep.Ambiguous, "pass %d", pass)
	}
	require.Equal(t, 12-(maxAbandoned+1), paused)
	require.Equal(t, int32(maxAbandoned+1), h.hanging.Load(), "no publish started past the bound")
	require.Equal(t, 9, s.Count(t, "status = 'PENDING'"))
	require.Equal(t, float64(paused), counter(t, reg, forwarder.MetricClaimsPaused))
	require.Equal(t, float64(maxAbandoned+1), counter(t, reg, forwarder.MetricAbandonedPublishes))
	// Passes while paused leave no goroutine behind (transient ones, such
	// as database/sql's per-query watchers, end on their own). Counted from
	// the test's goroutine, as at the pause: require.Eventually runs its
	// condition on a goroutine of its own, which the count would include,
	// so it passed only when a transient goroutine happened to be counted
	// at the pause as well.
	deadline := time.Now().Add(10 * time.Second)
	for runtime.NumGoroutine() > goroutinesAtPause {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			buf = buf[:runtime.Stack(buf, true)]
			t.Fatalf("goroutines grew while the relay was paused: %d, at the first paused pass %d; goroutines now:\n%s",
				runtime.NumGoroutine(), goroutinesAtPause, buf)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// leasesLapseBeforeSecondClaim expires every lease in the table just before
// the second claim statement of a pass, as if the relay had stalled for a
// lease between its two statements.
type leasesLapseBeforeSecondClaim struct {
	fencing.DBTX
	n atomic.Int32
}

func (d *leasesLapseBeforeSecondClaim) QueryContext(ctx context.Context, q string, args ...any) (*sql.Rows, error) {
	if isClaim(q) && d.n.Add(1) == 2 {
		if _, err := d.DBTX.ExecContext(ctx, `UPDATE messaging_outbox SET lease_expires_at = now() - interval '1 second' WHERE status = 'IN_FLIGHT'`); err != nil {
			return nil, err
		}
	}
	return d.DBTX.QueryContext(ctx, q, args...)
}

// A row whose lease runs out between two statements of one claim is
// claimed again by the second (a new token, an attempt spent). The batch
// holds it once, under the new lease; before, it held it twice, and the
// pass's outcome write was refused for naming one row twice.
func TestARowReclaimedWithinOneClaimIsPublishedOnce(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	insertN(t, s.DB, "orders", "a", "b", "c", "d", "e", "f", "g")
	rec := &recorder{}
	f := newForwarder(t, s.DB, rec, forwarder.Config{Owner: "r", BatchSize: 2})
	// After full batches the next claim starts right after the latest one
	// (claimStart), comes back short with g, and claims below its start
	// point in a second statement.
	for range 3 {
		rep, err := f.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 2, rep.Published)
	}
	d := &leasesLapseBeforeSecondClaim{}
	forwarder.WrapStatements(f, func(q fencing.DBTX) fencing.DBTX { d.DBTX = q; return d })
	rep, err := f.RunOnce(ctx)
	require.NoError(t, err)
	require.GreaterOrEqual(t, d.n.Load(), int32(2), "the pass made a second claim statement")
	require.Equal(t, 1, rep.Claimed)
	require.Equal(t, 1, rep.Published)
	require.ElementsMatch(t, []string{"a", "b", "c", "d", "e", "f", "g"}, rec.ids(), "each published once")
	st := state(t, s.DB, "g")
	require.Equal(t, "PUBLISHED", st.Status)
	require.Equal(t, 2, st.Attempts, "the lapsed lease spent one attempt, the publish the other")
}

// A row written by SQL with a timestamp no message can carry ('infinity')
// is one row's outcome, never the batch's: it is parked FAILED with
// OUTBOX_CORRUPT_ROW and a reason naming the column, and the good rows beside
// it go out in the same pass. Migration 00043 refuses such rows; a table
// migrated over rows that already had one keeps them (its constraint stays NOT
// VALID), which the test reproduces by dropping the constraint.
func TestUnreadableTimestampIsParkedAloneAndItsNeighboursGoOut(t *testing.T) {
	for _, column := range []string{"occurred_at", "created_at"} {
		t.Run(column, func(t *testing.T) {
			s := newDB(t)
			insertN(t, s.DB, "orders", "g1", "g2")
			_, err := s.DB.Exec(`ALTER TABLE messaging_outbox DROP CONSTRAINT messaging_outbox_finite_timestamps_check`)
			require.NoError(t, err)
			_, err = s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, ` + column + `)
				VALUES ('bad', 'orders', 'x', 'infinity')`)
			require.NoError(t, err)
			insertN(t, s.DB, "orders", "g3", "g4")
			rec := &recorder{}
			f := newForwarder(t, s.DB, rec, forwarder.Config{})
			rep, err := f.RunOnce(context.Background())
			require.NoError(t, err)
			require.Equal(t, 5, rep.Claimed)
			require.Equal(t, 4, rep.Published)
			require.Equal(t, 1, rep.Failed)
			require.ElementsMatch(t, []string{"g1", "g2", "g3", "g4"}, rec.ids())
			st := state(t, s.DB, "bad")
			require.Equal(t, "FAILED", st.Status)
			require.Equal(t, string(outbox.CodeCorruptRow), st.Code)
			var detail string
			require.NoError(t, s.DB.QueryRow(`SELECT last_failure_detail FROM messaging_outbox WHERE message_id = 'bad'`).Scan(&detail))
			require.Contains(t, detail, column)
			require.Contains(t, detail, "infinity")
		})
	}
}

// A row written by SQL with an occurred_at RFC 3339 cannot write (year
// 10000, a date BC; the schema allows both) is parked FAILED as corrupt, not
// delivered with a msg.occurred_at no consumer can parse; its neighbours go
// out.
func TestAnOccurredAtOutsideRFC3339YearsIsParked(t *testing.T) {
	s := newDB(t)
	insertN(t, s.DB, "orders", "g1")
	_, err := s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, occurred_at) VALUES
		('future', 'orders', 'x', '10000-01-01 00:00:00+00'), ('ides', 'orders', 'x', '0044-03-15 00:00:00+00 BC')`)
	require.NoError(t, err)
	insertN(t, s.DB, "orders", "g2")
	rec := &recorder{}
	rep, err := newForwarder(t, s.DB, rec, forwarder.Config{}).RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, 2, rep.Failed)
	require.ElementsMatch(t, []string{"g1", "g2"}, rec.ids())
	for _, id := range []string{"future", "ides"} {
		st := state(t, s.DB, id)
		require.Equal(t, "FAILED", st.Status, id)
		require.Equal(t, string(outbox.CodeCorruptRow), st.Code, id)
	}
}
