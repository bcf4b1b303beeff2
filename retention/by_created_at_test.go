package retention_test

import (
	"context"
	"encoding/json"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
	"github.com/fencedoutbox/watermill-outbox/retention"
)

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
