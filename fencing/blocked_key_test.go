package fencing_test

import (
	"context"
	"encoding/json"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// tableRowsRead is the number of rows the plan's index scans that find
// claimable rows returned (actual rows x loops, summed over every scan of
// the ordering and claimable indexes): the work a claim does to find its
// rows, independent of the machine's speed and of the dead row versions
// other transactions leave behind. (How the UPDATE joins back to the rows it
// found is the planner's choice: on a small table, a hash join over a
// sequential scan.)
func tableRowsRead(node map[string]any) int {
	n := 0
	if idx, _ := node["Index Name"].(string); strings.Contains(idx, "ordering_head_idx") || strings.Contains(idx, "claimable_idx") {
		n += int(node["Actual Rows"].(float64) * node["Actual Loops"].(float64))
	}
	if kids, ok := node["Plans"].([]any); ok {
		for _, k := range kids {
			n += tableRowsRead(k.(map[string]any))
		}
	}
	return n
}

// claimWork is tableRowsRead of a claim with p, run in a transaction that
// is rolled back, and how many rows it claimed.
func claimWork(t *testing.T, s *testdb.Schema, p fencing.ClaimParams) (read, claimed int) {
	t.Helper()
	ctx := context.Background()
	_, err := s.DB.Exec(`VACUUM ANALYZE messaging_outbox`)
	require.NoError(t, err)
	q, args, err := fencing.ClaimStatement(p)
	require.NoError(t, err)
	tx, err := s.DB.BeginTx(ctx, nil)
	require.NoError(t, err)
	var raw []byte
	require.NoError(t, tx.QueryRow("EXPLAIN (ANALYZE, FORMAT JSON) "+q, args...).Scan(&raw))
	var plan []struct {
		Plan map[string]any `json:"Plan"`
	}
	require.NoError(t, json.Unmarshal(raw, &plan))
	require.NoError(t, tx.Rollback())
	tx, err = s.DB.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	c, err := fencing.Claim(ctx, tx, p)
	require.NoError(t, err)
	return tableRowsRead(plan[0].Plan), len(c)
}

// parkedHeadThenTraffic is a schema where key P has an EXHAUSTED head and
// queue rows behind it, written first (the oldest seqs, as after an
// outage), then the other keys' work: 50 keys x 4 rows and 100 unkeyed rows.
func parkedHeadThenTraffic(t *testing.T, queue int) *testdb.Schema {
	s := newDB(t)
	testdb.InsertRow(t, s.DB, envelope.Row{MessageID: "p-head", Destination: "d", Payload: []byte{}, OrderingKey: "P",
		Status: envelope.StatusExhausted, Attempts: 10, LastFailureCode: "PUBLISH_TIMEOUT"}) // parked_at: now()
	rows := make([]testdb.OutboxRow, 0, queue)
	for g := 1; g <= queue; g++ {
		rows = append(rows, testdb.Row(envelope.Row{MessageID: "p" + strconv.Itoa(g), Destination: "d", Payload: []byte{}, OrderingKey: "P"}))
	}
	testdb.InsertRows(t, s.DB, rows...)
	rows = rows[:0]
	for g := 1; g <= 300; g++ {
		key := "key" + strconv.Itoa(g%50)
		if g%3 == 0 {
			key = "" // NULL: unkeyed
		}
		rows = append(rows, testdb.Row(envelope.Row{MessageID: "o" + strconv.Itoa(g), Destination: "d", Payload: []byte{}, OrderingKey: key}))
	}
	testdb.InsertRows(t, s.DB, rows...)
	return s
}

// Under BlockKey a parked head holds back its key, and the rows queued behind
// it cost the other keys' claims nothing: the claim reads the parked head
// (one step of its walk over keys) and never the rows behind it, so the same
// claim reads the same number of table rows with 2,000 or 20,000 rows queued
// behind the head. (A claim that walked the claimable rows in seq order read
// every one of them, the whole queue, before reaching the other keys.)
// Measured in rows read, not time.
func TestParkedHeadCostsOtherKeysNothing(t *testing.T) {
	small, large := parkedHeadThenTraffic(t, 2000), parkedHeadThenTraffic(t, 20000)
	readSmall, claimedSmall := claimWork(t, small, params("r", t0))
	readLarge, claimedLarge := claimWork(t, large, params("r", t0))
	t.Logf("table rows read per claim: %d with 2,000 and %d with 20,000 rows behind a parked head", readSmall, readLarge)
	require.Equal(t, 100, claimedSmall, "a full batch of the other keys' rows")
	require.Equal(t, 100, claimedLarge)
	require.Equal(t, readSmall, readLarge, "the parked head's queue must not be read")

	// Nothing of P is claimable under BlockKey; under SkipParked, P's rows go
	// past their parked head.
	ctx := context.Background()
	tx, err := small.DB.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	p := params("r", t0)
	p.Limit = 1000
	all, err := fencing.Claim(ctx, tx, p)
	require.NoError(t, err)
	require.Len(t, all, 300)
	for _, c := range all {
		require.NotEqual(t, "P", c.Row.OrderingKey, "BlockKey: %s went past its parked head", c.Row.MessageID)
	}
	p.Policy = fencing.SkipParked
	skip, err := fencing.Claim(ctx, tx, p)
	require.NoError(t, err)
	require.NotEmpty(t, skip)
	require.Equal(t, "p1", skip[0].Row.MessageID, "SkipParked: the row behind the parked head is claimable")
}
