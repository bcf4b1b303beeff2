package retention_test

import (
	"context"
	"database/sql"
	"strconv"
	"testing"
	"time"

	"github.com/fencedoutbox/watermill-outbox/internal/testkit/leakcheck"
	"github.com/lib/pq"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
	"github.com/fencedoutbox/watermill-outbox/retention"
)

func TestMain(m *testing.M) { leakcheck.VerifyTestMain(m) }

// A fixed clock far from the wall clock, so rows "old" relative to it are
// chosen by the test and not by when it runs.
var now = time.Date(2031, 5, 4, 12, 0, 0, 0, time.UTC)

func clock() time.Time { return now }

func newSchema(t *testing.T) *testdb.Schema {
	t.Helper()
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(6)
	return s
}

// insertPublished inserts n PUBLISHED rows with published_at = at - i seconds.
func insertPublished(t *testing.T, db *sql.DB, prefix string, n int, at time.Time) {
	t.Helper()
	rows := make([]testdb.OutboxRow, 0, n)
	for g := 1; g <= n; g++ {
		sec := time.Duration(g) * time.Second
		rows = append(rows, testdb.Row(envelope.Row{MessageID: prefix + strconv.Itoa(g), Destination: "orders", Payload: []byte{1},
			Status: envelope.StatusPublished, CreatedAt: at.Add(-sec - 10*time.Second), PublishedAt: at.Add(-sec)}))
	}
	testdb.InsertRows(t, db, rows...)
}

// insertOtherStatuses inserts one row per non-PUBLISHED status, created and
// (FAILED, EXHAUSTED) parked long before the horizon.
func insertOtherStatuses(t *testing.T, db *sql.DB, at time.Time) {
	t.Helper()
	for _, st := range []envelope.Status{envelope.StatusPending, envelope.StatusInFlight, envelope.StatusAmbiguous, envelope.StatusFailed, envelope.StatusExhausted} {
		r := envelope.Row{MessageID: string(st), Destination: "orders", Payload: []byte{1}, Status: st, CreatedAt: at}
		if st.Parked() {
			r.ParkedAt = at
		}
		testdb.InsertRow(t, db, r)
	}
}

func enableCDC(t *testing.T, db *sql.DB) {
	t.Helper()
	require.NoError(t, relaymode.Enable(context.Background(), db, "retention-test", time.Time{}))
}

func TestInboxCleanup(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	_, err := s.DB.Exec(`
INSERT INTO messaging_inbox (consumer, message_id, processed_at)
SELECT 'billing', 'm-' || g, $1::timestamptz - make_interval(secs => g) FROM generate_series(1, 2500) g`, now.Add(-25*time.Hour))
	require.NoError(t, err)
	_, err = s.DB.Exec(`
INSERT INTO messaging_inbox (consumer, message_id, processed_at)
SELECT 'billing', 'recent-' || g, $1::timestamptz FROM generate_series(1, 10) g`, now.Add(-time.Hour))
	require.NoError(t, err)
	insertPublished(t, s.DB, "old-", 10, now.Add(-100*time.Hour))

	var inboxBatches []int
	c, err := retention.New(s.DB, nil, retention.Config{
		BatchSize: 1000, InboxHorizon: 24 * time.Hour, AllowShortHorizons: true, Now: clock,
		OnBatch: func(b retention.Batch) {
			if b.Table == "messaging_inbox" {
				inboxBatches = append(inboxBatches, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_inbox`))
			}
		},
	})
	require.NoError(t, err)
	res, err := c.Run(context.Background())
	require.NoError(t, err)
	require.Equal(t, 10, res.Deleted)
	require.Equal(t, 2500, res.InboxDeleted)
	require.Equal(t, 3, res.InboxBatches)
	require.Equal(t, []int{1510, 510, 10}, inboxBatches)
	require.Equal(t, 10, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_inbox WHERE message_id LIKE 'recent-%'`))

	// Zero InboxHorizon leaves the inbox alone.
	_, err = s.DB.Exec(`UPDATE messaging_inbox SET processed_at = $1`, now.Add(-1000*time.Hour))
	require.NoError(t, err)
	off, err := retention.New(s.DB, nil, retention.Config{Now: clock})
	require.NoError(t, err)
	res, err = off.Run(context.Background())
	require.NoError(t, err)
	require.Zero(t, res.InboxBatches)
	require.Equal(t, 10, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_inbox`))
}

// holdBatch returns a config whose first batch blocks inside its transaction
// until release is closed, signalling on held once it is there.
func holdBatch(cfg retention.Config) (retention.Config, chan struct{}, chan struct{}) {
	held, release := make(chan struct{}), make(chan struct{})
	first := true
	retention.SetBeforeCommit(&cfg, func(ctx context.Context, _ *sql.Tx, _ retention.Batch) error {
		if first {
			first = false
			close(held)
			select {
			case <-release:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return nil
	})
	return cfg, held, release
}

// While a retention batch transaction is held open (its row locks taken),
// inserts, a claim (FOR UPDATE SKIP LOCKED on claimable rows) and the claim's
// UPDATE on other rows complete without waiting for it.
func TestRetentionDoesNotBlockClaimsOrInserts(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	insertPublished(t, s.DB, "old-", 300, now.Add(-100*time.Hour))
	var pending []testdb.OutboxRow
	for g := 1; g <= 20; g++ {
		pending = append(pending, testdb.Row(envelope.Row{MessageID: "pending-" + strconv.Itoa(g), Destination: "orders", Payload: []byte{1}}))
	}
	testdb.InsertRows(t, s.DB, pending...)

	cfg, held, release := holdBatch(retention.Config{BatchSize: 100, Now: clock})
	c, err := retention.New(s.DB, nil, cfg)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() {
		_, err := c.Run(context.Background())
		done <- err
	}()
	<-held
	defer func() {
		select {
		case <-release:
		default:
			close(release)
		}
	}()

	app := s.Open(t)
	app.SetMaxOpenConns(2)
	ctx := context.Background()

	// Proof the batch really is open and holds its locks: the oldest
	// published row (first picked) cannot be locked without waiting.
	_, err = app.ExecContext(ctx, `SELECT 1 FROM messaging_outbox WHERE message_id = 'old-300' FOR UPDATE NOWAIT`)
	var pqErr *pq.Error
	require.ErrorAs(t, err, &pqErr)
	require.Equal(t, pq.ErrorCode("55P03"), pqErr.Code, "lock_not_available: the batch holds the row")

	// Every statement below would wait on a lock held by the open batch if
	// retention blocked it; lock_timeout turns such a wait into an error.
	tx, err := app.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	_, err = tx.ExecContext(ctx, `SET LOCAL lock_timeout = '2s'`)
	require.NoError(t, err)
	testdb.InsertRow(t, tx, envelope.Row{MessageID: "during-retention", Destination: "orders", Payload: []byte{2}})
	// The relay's real claim (ordering probe, lease, token increment), on
	// this transaction.
	claimed, err := fencing.Claim(ctx, tx, fencing.ClaimParams{Owner: "relay", Limit: 10, Lease: time.Minute, MaxAttempts: 10})
	require.NoError(t, err)
	require.Len(t, claimed, 10)
	for _, c := range claimed {
		require.True(t, c.Held(), "claimed %s", c.Row.MessageID)
	}
	require.NoError(t, tx.Commit())

	// The batch is still open: it was never waited for.
	select {
	case err := <-done:
		t.Fatalf("retention finished before release: %v", err)
	default:
	}
	close(release)
	require.NoError(t, <-done)
	require.Equal(t, 0, s.Count(t, "status = 'PUBLISHED'"))
	require.Equal(t, 10, s.Count(t, "status = 'IN_FLIGHT'"))
	require.Equal(t, 11, s.Count(t, "status = 'PENDING'"))
}

func TestEvery(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	insertPublished(t, s.DB, "old-", 5, now.Add(-100*time.Hour))
	c, err := retention.New(s.DB, nil, retention.Config{Now: clock})
	require.NoError(t, err)

	require.ErrorIs(t, c.Every(context.Background(), 0, nil), outbox.ErrInvalidConfig)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	reports := make(chan retention.Result, 8)
	stopped := make(chan error, 1)
	go func() {
		stopped <- c.Every(ctx, time.Millisecond, func(r retention.Result, err error) {
			if err == nil {
				select {
				case reports <- r:
				default:
				}
			}
		})
	}()
	first := <-reports
	require.Equal(t, 5, first.Deleted)
	second := <-reports
	require.Zero(t, second.Deleted)
	cancel()
	require.ErrorIs(t, <-stopped, context.Canceled)
}

// A run that Every's context cuts short after committing a batch is
// reported with what it committed, so the reports sum to what retention
// did.
func TestEveryReportsTheRunItsStopCutShort(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	insertPublished(t, s.DB, "old-", 25, now.Add(-100*time.Hour))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	c, err := retention.New(s.DB, nil, retention.Config{Now: clock, BatchSize: 10,
		OnBatch: func(retention.Batch) { cancel() }}) // the first batch commits, then the stop comes
	require.NoError(t, err)
	var reported int
	var runs int
	require.ErrorIs(t, c.Every(ctx, time.Hour, func(r retention.Result, err error) {
		runs++
		reported += r.Deleted
		require.ErrorIs(t, err, context.Canceled)
	}), context.Canceled)
	require.Equal(t, 1, runs, "the cut-short run is reported")
	require.Equal(t, 10, reported, "its committed batch is counted")
	require.Equal(t, 15, s.Count(t, "message_id LIKE 'old-%'"), "and that batch is what left the outbox")
}
