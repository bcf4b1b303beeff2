package retention_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"strconv"
	"strings"
	"sync"
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

func TestConfigDefaultsAreValid(t *testing.T) {
	require.NoError(t, retention.Config{}.Validate())
	s := newSchema(t)
	c, err := retention.New(s.DB, nil, retention.Config{})
	require.NoError(t, err)
	cfg := c.Config()
	require.Equal(t, retention.DefaultHorizon, cfg.Horizon)
	require.Equal(t, 72*time.Hour, cfg.Horizon)
	require.Equal(t, retention.DefaultBatchSize, cfg.BatchSize)
	require.Equal(t, retention.DefaultMaxBatches, cfg.MaxBatches)
	require.Equal(t, retention.DefaultStatementTimeout, cfg.StatementTimeout)
	require.Equal(t, retention.ByPublishedAt, cfg.Mode)
	require.Zero(t, cfg.InboxHorizon)
}

func TestConfigRefusals(t *testing.T) {
	cases := map[string]retention.Config{
		"negative horizon":        {Horizon: -time.Hour},
		"negative batch size":     {BatchSize: -1},
		"negative max batches":    {MaxBatches: -1},
		"negative timeout":        {StatementTimeout: -time.Second},
		"sub-millisecond timeout": {StatementTimeout: time.Microsecond},
		"negative inbox horizon":  {InboxHorizon: -time.Hour},
		"unknown mode":            {Mode: "BY_MOOD"},
	}
	for name, cfg := range cases {
		t.Run(name, func(t *testing.T) {
			err := cfg.Validate()
			require.ErrorIs(t, err, outbox.ErrInvalidConfig)
			_, err = retention.New(&sql.DB{}, nil, cfg)
			require.ErrorIs(t, err, outbox.ErrInvalidConfig)
		})
	}
	_, err := retention.New(nil, nil, retention.Config{})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
}

// A backlog of 5,000 old PUBLISHED rows goes in batches of exactly the
// configured size, counted by the database after each committed batch, and
// no other status is touched.
func TestRunDeletesPublishedInBatches(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	const backlog, batch = 5000, 1000
	insertPublished(t, s.DB, "old-", backlog, now.Add(-73*time.Hour))
	insertPublished(t, s.DB, "new-", 50, now.Add(-time.Hour))
	insertOtherStatuses(t, s.DB, now.Add(-1000*time.Hour))

	var remaining, removed []int
	cfg := retention.Config{
		BatchSize: batch,
		Now:       clock,
		OnBatch: func(b retention.Batch) {
			removed = append(removed, b.Removed)
			remaining = append(remaining, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_outbox WHERE message_id LIKE 'old-%'`))
		},
	}
	var delBefore int
	require.NoError(t, s.DB.QueryRow(`SELECT n_tup_del FROM pg_stat_user_tables WHERE schemaname = $1 AND relname = 'messaging_outbox'`, s.Name).Scan(&delBefore))

	c, err := retention.New(s.DB, nil, cfg)
	require.NoError(t, err)
	res, err := c.Run(context.Background())
	require.NoError(t, err)

	require.False(t, res.Skipped)
	require.Equal(t, 6, res.Batches, "five full batches and the short one that ends the run")
	require.Equal(t, backlog, res.Deleted)
	require.Zero(t, res.Archived)
	require.False(t, res.More)
	require.Equal(t, []int{1000, 1000, 1000, 1000, 1000, 0}, removed)
	require.Equal(t, []int{4000, 3000, 2000, 1000, 0, 0}, remaining)

	require.Equal(t, 50, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_outbox WHERE message_id LIKE 'new-%'`))
	require.Equal(t, 5, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_outbox WHERE status <> 'PUBLISHED'`))

	// The statistics collector agrees (it flushes asynchronously: force it
	// from PostgreSQL 15 on; 14's collector has no such function and sends
	// its counts within half a second on its own).
	if testdb.QueryInt(t, s.DB, `SELECT current_setting('server_version_num')::int`) >= 150000 {
		_, err = s.DB.Exec(`SELECT pg_stat_force_next_flush()`)
		require.NoError(t, err)
	}
	require.Eventually(t, func() bool {
		var del int
		_ = s.DB.QueryRow(`SELECT n_tup_del FROM pg_stat_user_tables WHERE schemaname = $1 AND relname = 'messaging_outbox'`, s.Name).Scan(&del)
		return del-delBefore == backlog
	}, 10*time.Second, 50*time.Millisecond)
}

func TestRunStopsAtMaxBatches(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	insertPublished(t, s.DB, "old-", 1000, now.Add(-100*time.Hour))
	c, err := retention.New(s.DB, nil, retention.Config{BatchSize: 100, MaxBatches: 3, Now: clock})
	require.NoError(t, err)
	res, err := c.Run(context.Background())
	require.NoError(t, err)
	require.Equal(t, 3, res.Batches)
	require.Equal(t, 300, res.Deleted)
	require.True(t, res.More)
	require.Equal(t, 700, s.Count(t, ""))
}

func TestBatchRunsUnderItsStatementTimeout(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	insertPublished(t, s.DB, "old-", 3, now.Add(-100*time.Hour))
	cfg := retention.Config{StatementTimeout: 1234 * time.Millisecond, Now: clock}
	var inside []string
	retention.SetBeforeCommit(&cfg, func(ctx context.Context, tx *sql.Tx, b retention.Batch) error {
		var v string
		if err := tx.QueryRowContext(ctx, `SHOW statement_timeout`).Scan(&v); err != nil {
			return err
		}
		inside = append(inside, v)
		return nil
	})
	c, err := retention.New(s.DB, nil, cfg)
	require.NoError(t, err)
	_, err = c.Run(context.Background())
	require.NoError(t, err)
	require.Equal(t, []string{"1234ms"}, inside)

	// SET LOCAL: the pool's sessions keep their own setting afterwards.
	var v string
	require.NoError(t, s.DB.QueryRow(`SHOW statement_timeout`).Scan(&v))
	require.Equal(t, "0", v)
}

func TestBatchErrorIsReturnedAndRolledBack(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	insertPublished(t, s.DB, "old-", 10, now.Add(-100*time.Hour))
	cfg := retention.Config{BatchSize: 4, Now: clock}
	boom := errors.New("boom")
	retention.SetBeforeCommit(&cfg, func(_ context.Context, _ *sql.Tx, b retention.Batch) error {
		if b.Number == 2 {
			return boom
		}
		return nil
	})
	c, err := retention.New(s.DB, nil, cfg)
	require.NoError(t, err)
	res, err := c.Run(context.Background())
	require.ErrorIs(t, err, boom)
	require.Equal(t, 1, res.Batches)
	require.Equal(t, 4, res.Deleted)
	require.Equal(t, 6, s.Count(t, ""), "the failed batch rolled back; the first stays committed")
}

// Archive mode moves every column into the archive in the same statement.
func TestArchiveMovesRowsWithAllColumns(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	old := now.Add(-80 * time.Hour)
	aggVersion := int64(42)
	testdb.InsertRow(t, s.DB, envelope.Row{
		MessageID: "full", Destination: "orders", Payload: []byte{0xde, 0xad, 0xbe, 0xef}, Headers: map[string]string{"a": "b"},
		Status: envelope.StatusPublished, CreatedAt: old, OccurredAt: old, PublishedAt: old, Attempts: 3, NextAttemptAt: old,
		LeaseOwner: "relay-1", LeaseToken: 7, LeaseExpiresAt: old, LastFailureCode: "TIMEOUT", LastFailureDetail: "detail",
		LastAttemptAt: old, Producer: "svc", CorrelationID: "corr", CausationID: "caus", Tenant: "acme", PartitionKey: "pk",
		OrderingKey: "ok", Traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", Tracestate: "k=v",
		Baggage: "b=1", SchemaSubject: "subj", SchemaVersion: "2", ContentType: "application/json",
		MessageType: "OrderPaid", AggregateType: "order", AggregateID: "o-1", AggregateVersion: &aggVersion,
	})
	insertPublished(t, s.DB, "old-", 20, old)
	insertOtherStatuses(t, s.DB, old)

	// Every stored outbox column has an archive column; only columns the
	// database generates from others (created_at_utc) may be absent, since
	// they carry no information of their own.
	rows, err := s.DB.Query(`
SELECT o.column_name, o.is_generated FROM information_schema.columns o
 WHERE o.table_schema = current_schema() AND o.table_name = 'messaging_outbox'
   AND NOT EXISTS (SELECT 1 FROM information_schema.columns a
                    WHERE a.table_schema = o.table_schema AND a.table_name = 'messaging_outbox_archive'
                      AND a.column_name = o.column_name)`)
	require.NoError(t, err)
	for rows.Next() {
		var col, generated string
		require.NoError(t, rows.Scan(&col, &generated))
		require.Equal(t, "ALWAYS", generated, "outbox column %s is stored but has no archive column", col)
	}
	require.NoError(t, rows.Err())
	require.NoError(t, rows.Close())

	var before string
	require.NoError(t, s.DB.QueryRow(`
SELECT jsonb_object_agg(e.key, e.value)::text
  FROM messaging_outbox o, jsonb_each(to_jsonb(o)) e
 WHERE o.message_id = 'full'
   AND e.key IN (SELECT column_name FROM information_schema.columns
                  WHERE table_schema = current_schema() AND table_name = 'messaging_outbox_archive')`).Scan(&before))

	c, err := retention.New(s.DB, nil, retention.Config{Archive: true, BatchSize: 8, Now: clock})
	require.NoError(t, err)
	res, err := c.Run(context.Background())
	require.NoError(t, err)
	require.Equal(t, 21, res.Archived)
	require.Zero(t, res.Deleted)
	require.Equal(t, 3, res.Batches)

	require.Equal(t, 5, s.Count(t, ""), "only the non-PUBLISHED rows stay")
	require.Equal(t, 21, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_outbox_archive`))
	var after string
	var archivedAt time.Time
	require.NoError(t, s.DB.QueryRow(`
SELECT (to_jsonb(a) - 'archived_at')::text, archived_at FROM messaging_outbox_archive a WHERE message_id = 'full'`).Scan(&after, &archivedAt))
	require.JSONEq(t, before, after, "every column, routing_key and seq included, is archived unchanged")
	require.True(t, archivedAt.Equal(now))
}

// In CDC mode nothing marks rows PUBLISHED: ByCreatedAt removes old rows of
// every status and keeps young ones.
func TestByCreatedAtRemovesOldRowsOfAnyStatus(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	insertOtherStatuses(t, s.DB, now.Add(-100*time.Hour))
	var rows []testdb.OutboxRow
	for g := 1; g <= 250; g++ {
		rows = append(rows, testdb.Row(envelope.Row{MessageID: "cdc-old-" + strconv.Itoa(g), Destination: "orders", Payload: []byte{1},
			CreatedAt: now.Add(-73*time.Hour - time.Duration(g)*time.Second)}))
	}
	testdb.InsertRows(t, s.DB, rows...)
	rows = rows[:0]
	for g := 1; g <= 30; g++ {
		rows = append(rows, testdb.Row(envelope.Row{MessageID: "cdc-new-" + strconv.Itoa(g), Destination: "orders", Payload: []byte{1},
			CreatedAt: now.Add(-71 * time.Hour)}))
	}
	testdb.InsertRows(t, s.DB, rows...)

	// The default mode deletes none of these: none is PUBLISHED.
	byPub, err := retention.New(s.DB, nil, retention.Config{Now: clock})
	require.NoError(t, err)
	res, err := byPub.Run(context.Background())
	require.NoError(t, err)
	require.Zero(t, res.Deleted)
	require.Equal(t, 285, s.Count(t, ""))

	enableCDC(t, s.DB)
	c, err := retention.New(s.DB, nil, retention.Config{Mode: retention.ByCreatedAt, BatchSize: 100, Now: clock})
	require.NoError(t, err)
	res, err = c.Run(context.Background())
	require.NoError(t, err)
	require.Equal(t, 255, res.Deleted)
	// 253 never-published rows in batches of 100 (100, 100, 53), the two
	// parked rows (2), and no PUBLISHED row (0): each source ends with its
	// short batch.
	require.Equal(t, 5, res.Batches)
	require.Equal(t, 30, s.Count(t, ""))
	require.Equal(t, 30, s.Count(t, "message_id LIKE 'cdc-new-%' AND status = 'PENDING'"))
}

// ByCreatedAt's other two sources, as retention/doc.go states them: parked
// rows go by created_at; PUBLISHED rows left from polling mode go once their
// published_at is past the horizon (published_at is never before
// created_at), so an old row published recently stays for now.
func TestByCreatedAtParkedByCreatedAtPublishedByPublishedAt(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	old, young := now.Add(-100*time.Hour), now.Add(-time.Hour)
	row := func(id string, st envelope.Status, created, published, parked time.Time) testdb.OutboxRow {
		return testdb.Row(envelope.Row{MessageID: id, Destination: "orders", Payload: []byte{1}, Status: st,
			CreatedAt: created, PublishedAt: published, ParkedAt: parked})
	}
	testdb.InsertRows(t, s.DB,
		row("pub-old", envelope.StatusPublished, old, old, time.Time{}),
		row("pub-late", envelope.StatusPublished, old, young, time.Time{}),
		row("parked-old", envelope.StatusFailed, old, time.Time{}, young),
		row("parked-young", envelope.StatusExhausted, young, time.Time{}, young))
	enableCDC(t, s.DB)
	c, err := retention.New(s.DB, nil, retention.Config{Mode: retention.ByCreatedAt, Now: clock})
	require.NoError(t, err)
	res, err := c.Run(context.Background())
	require.NoError(t, err)
	require.Equal(t, 2, res.Deleted)
	require.Equal(t, 2, s.Count(t, "message_id IN ('pub-late', 'parked-young')"))
	require.Equal(t, 2, s.Count(t, ""))
}

// An empty source spends none of MaxBatches: with only old parked rows
// (the never-published stream, walked first, is empty), a run limited to one
// batch removes them, and one limited to two says nothing is left.
func TestAnEmptySourceSpendsNoneOfMaxBatches(t *testing.T) {
	t.Parallel()
	for _, max := range []int{1, 2} {
		s := newSchema(t)
		old := now.Add(-200 * time.Hour)
		for _, id := range []string{"p1", "p2", "p3"} {
			testdb.InsertRows(t, s.DB, testdb.Row(envelope.Row{MessageID: id, Destination: "orders", Payload: []byte{1},
				Status: envelope.StatusFailed, CreatedAt: old, ParkedAt: old}))
		}
		enableCDC(t, s.DB)
		c, err := retention.New(s.DB, nil, retention.Config{Mode: retention.ByCreatedAt, MaxBatches: max, Now: clock})
		require.NoError(t, err)
		res, err := c.Run(context.Background())
		require.NoError(t, err)
		require.Equal(t, 3, res.Deleted, "MaxBatches %d", max)
		require.Zero(t, s.Count(t, ""))
		require.Equal(t, max == 1, res.More, "MaxBatches %d: more only when the budget ran out before the last source", max)
	}
}

// ByCreatedAt walks never-published rows in insertion (seq) order and stops
// at the first one that is not old yet, so a row whose transaction started
// before the horizon but inserted after a younger row waits for a later run:
// removed late, never early, and the younger row is kept.
func TestByCreatedAtRemovesInInsertionOrder(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	ins := func(id string, created time.Time) {
		testdb.InsertRow(t, s.DB, envelope.Row{MessageID: id, Destination: "orders", Payload: []byte{1}, CreatedAt: created})
	}
	ins("old-1", now.Add(-80*time.Hour))
	ins("young", now.Add(-70*time.Hour))
	ins("late-old", now.Add(-90*time.Hour)) // a long transaction's row, inserted after "young"
	enableCDC(t, s.DB)

	at := now
	c, err := retention.New(s.DB, nil, retention.Config{Mode: retention.ByCreatedAt, Now: func() time.Time { return at }})
	require.NoError(t, err)
	res, err := c.Run(context.Background())
	require.NoError(t, err)
	require.Equal(t, 1, res.Deleted)
	require.Equal(t, 2, s.Count(t, "message_id IN ('young', 'late-old')"), "the young row stays, and so does the row behind it")

	at = now.Add(3 * time.Hour) // "young" is past the horizon now
	res, err = c.Run(context.Background())
	require.NoError(t, err)
	require.Equal(t, 2, res.Deleted)
	require.Zero(t, s.Count(t, ""))
}

func TestByCreatedAtArchive(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	insertOtherStatuses(t, s.DB, now.Add(-100*time.Hour))
	enableCDC(t, s.DB)
	c, err := retention.New(s.DB, nil, retention.Config{Mode: retention.ByCreatedAt, Archive: true, Now: clock})
	require.NoError(t, err)
	res, err := c.Run(context.Background())
	require.NoError(t, err)
	require.Equal(t, 5, res.Archived)
	require.Zero(t, s.Count(t, ""))
	require.Equal(t, 1, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_outbox_archive WHERE status = 'EXHAUSTED'`))
}

func enableCDC(t *testing.T, db *sql.DB) {
	t.Helper()
	require.NoError(t, relaymode.Enable(context.Background(), db, "retention-test", time.Time{}))
}

// ByCreatedAt deletes rows of any status, which is only safe when nothing
// marks rows PUBLISHED (CDC). In polling mode the library itself refuses it,
// not only outboxctl: nothing is deleted or archived, inbox included.
func TestByCreatedAtIsRefusedUnlessRelayModeIsCDC(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	insertOtherStatuses(t, s.DB, now.Add(-100*time.Hour))
	insertPublished(t, s.DB, "pub-", 3, now.Add(-100*time.Hour))
	_, err := s.DB.Exec(`INSERT INTO messaging_inbox (consumer, message_id, processed_at) VALUES ('c', 'old', $1)`, now.Add(-100*time.Hour))
	require.NoError(t, err)

	for _, archive := range []bool{false, true} {
		c, err := retention.New(s.DB, nil, retention.Config{Mode: retention.ByCreatedAt, Archive: archive, InboxHorizon: time.Hour, AllowShortHorizons: true, Now: clock})
		require.NoError(t, err, "the mode is the database's state at run time, not a configuration error")
		res, err := c.Run(context.Background())
		require.ErrorIs(t, err, relaymode.ErrRelayModeConflict)
		require.Equal(t, relaymode.CodeRelayModeConflict, outbox.CodeOf(err))
		require.Zero(t, res.Batches)
		require.Zero(t, res.Deleted)
		require.Zero(t, res.Archived)
		require.Zero(t, res.InboxDeleted)
		require.Equal(t, 8, s.Count(t, ""))
		require.Zero(t, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_outbox_archive`))
		require.Equal(t, 1, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_inbox`))
	}

	// The default mode is still allowed in polling mode and takes only the
	// PUBLISHED rows.
	byPub, err := retention.New(s.DB, nil, retention.Config{Now: clock})
	require.NoError(t, err)
	res, err := byPub.Run(context.Background())
	require.NoError(t, err)
	require.Equal(t, 3, res.Deleted)
	require.Equal(t, 5, s.Count(t, ""))

	enableCDC(t, s.DB)
	c, err := retention.New(s.DB, nil, retention.Config{Mode: retention.ByCreatedAt, Now: clock})
	require.NoError(t, err)
	res, err = c.Run(context.Background())
	require.NoError(t, err)
	require.Equal(t, 5, res.Deleted)
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

// Each batch statement finds its rows through an index, so a batch's cost is
// bounded by its size and not by the table's.
func TestBatchStatementsUseIndexes(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	insertPublished(t, s.DB, "old-", 20000, now.Add(-100*time.Hour))
	_, err := s.DB.Exec(`
INSERT INTO messaging_inbox (consumer, message_id, processed_at)
SELECT 'c', 'm-' || g, $1::timestamptz - make_interval(secs => g) FROM generate_series(1, 20000) g`, now)
	require.NoError(t, err)
	// An archive of some size, so its lookups (archive conflicts) are
	// planned as they are in production, not as on an empty table.
	_, err = s.DB.Exec(`INSERT INTO messaging_outbox_archive (` + envelope.SelectColumns + `, archived_at)
SELECT 'a-' || message_id, destination, payload, headers, status, seq, created_at, occurred_at, published_at, attempts,
       next_attempt_at, lease_owner, lease_token, lease_expires_at, last_failure_code, last_failure_detail,
       last_attempt_at, producer, correlation_id, causation_id, tenant, partition_key, ordering_key, traceparent,
       tracestate, baggage, schema_subject, schema_version, content_type, message_type, aggregate_type,
       aggregate_id, aggregate_version, parked_at, routing_key, now()
  FROM messaging_outbox`)
	require.NoError(t, err)
	_, err = s.DB.Exec(`ANALYZE messaging_outbox; ANALYZE messaging_inbox; ANALYZE messaging_outbox_archive`)
	require.NoError(t, err)
	want := map[string]string{
		"published":         "messaging_outbox_published_idx",
		"archive-published": "messaging_outbox_published_idx",
		"stream":            "messaging_outbox_claimable_idx",
		"archive-stream":    "messaging_outbox_claimable_idx",
		"parked":            "messaging_outbox_parked_idx",
		"archive-parked":    "messaging_outbox_parked_idx",
		"inbox":             "messaging_inbox_processed_idx",
	}
	require.Len(t, retention.Statements, len(want))
	horizon := (72 * time.Hour).Seconds()
	for name, q := range retention.Statements {
		args := []any{now, 100, horizon}
		if strings.HasSuffix(name, "stream") {
			args = append(args, int64(15000))
		}
		plan := testdb.Explain(t, s.DB, q, args...)
		require.Contains(t, plan, want[name], "%s plan:\n%s", name, plan)
		require.NotContains(t, plan, "Seq Scan", "%s plan:\n%s", name, plan)
	}
	plan := testdb.Explain(t, s.DB, retention.FirstYoungSeq, now, horizon, 100000)
	require.Contains(t, plan, "messaging_outbox_claimable_idx", plan)
	require.NotContains(t, plan, "Seq Scan", plan)
}

// A ByCreatedAt run reads the stream's bound among at most BatchSize x
// MaxBatches rows (what the run can remove), so a long backlog of old rows
// does not make each run scan it whole: with 3,000 old rows and a window of
// 100 the bound's index scan returns 100 rows. The run removes exactly its
// window; the next run goes on.
func TestByCreatedAtBoundReadsOnlyTheRunsWindow(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	var rows []testdb.OutboxRow
	for g := 1; g <= 3000; g++ {
		rows = append(rows, testdb.Row(envelope.Row{MessageID: "old-" + strconv.Itoa(g), Destination: "orders", Payload: []byte{1},
			CreatedAt: now.Add(-100 * time.Hour)}))
	}
	testdb.InsertRows(t, s.DB, rows...)
	_, err := s.DB.Exec(`ANALYZE messaging_outbox`)
	require.NoError(t, err)

	var raw []byte
	require.NoError(t, s.DB.QueryRow(`EXPLAIN (ANALYZE, FORMAT JSON) `+retention.FirstYoungSeq, now, (72*time.Hour).Seconds(), 100).Scan(&raw))
	// "Actual Rows" is per loop: an integer up to PostgreSQL 17, a number
	// with two decimals from 18 on ("Actual Rows": 100.00).
	require.Equal(t, 100.0, indexScanRows(t, raw, "messaging_outbox_claimable_idx"), string(raw))

	enableCDC(t, s.DB)
	c, err := retention.New(s.DB, nil, retention.Config{Mode: retention.ByCreatedAt, BatchSize: 100, MaxBatches: 1, Now: clock})
	require.NoError(t, err)
	res, err := c.Run(context.Background())
	require.NoError(t, err)
	require.Equal(t, 100, res.Deleted)
	require.True(t, res.More)
	require.Equal(t, 2900, s.Count(t, ""))
}

// indexScanRows sums the rows that the plan nodes scanning index return
// (Actual Rows x Actual Loops), in an EXPLAIN (ANALYZE, FORMAT JSON) output.
// It fails the test when no node scans index.
func indexScanRows(t *testing.T, explain []byte, index string) float64 {
	t.Helper()
	var plans []struct {
		Plan map[string]any `json:"Plan"`
	}
	require.NoError(t, json.Unmarshal(explain, &plans))
	require.NotEmpty(t, plans)
	var (
		total float64
		found bool
		walk  func(node map[string]any)
	)
	walk = func(node map[string]any) {
		if node["Index Name"] == index {
			rows, ok1 := node["Actual Rows"].(float64)
			loops, ok2 := node["Actual Loops"].(float64)
			require.True(t, ok1 && ok2, "a plan node without Actual Rows or Actual Loops: %v", node)
			total += rows * loops
			found = true
		}
		children, _ := node["Plans"].([]any)
		for _, c := range children {
			child, ok := c.(map[string]any)
			require.True(t, ok)
			walk(child)
		}
	}
	walk(plans[0].Plan)
	require.True(t, found, "no plan node scans %s", index)
	return total
}
