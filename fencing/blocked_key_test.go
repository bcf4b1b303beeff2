package fencing_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// Under BlockKey a parked head holds back its key, and the rows queued behind
// it cost the other keys' claims nothing: the claim reads the parked head once
// (one index descent) and never the 20,000 rows behind it. Measured in
// buffers touched, not time.
func TestParkedHeadCostsOtherKeysNothing(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	// The other keys' work: 50 keys x 4 rows and 100 unkeyed rows.
	_, err := s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, ordering_key)
		SELECT 'o' || g, 'd', '', CASE WHEN g % 3 = 0 THEN NULL ELSE 'key' || (g % 50) END
		  FROM generate_series(1, 300) g`)
	require.NoError(t, err)
	buffers := func() int {
		t.Helper()
		_, err := s.DB.Exec(`VACUUM ANALYZE messaging_outbox`) // earlier rolled-back claims leave dead versions behind
		require.NoError(t, err)
		tx, err := s.DB.BeginTx(ctx, nil)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback() }()
		q, args, err := fencing.ClaimStatement(params("r", t0))
		require.NoError(t, err)
		var raw []byte
		require.NoError(t, tx.QueryRow("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "+q, args...).Scan(&raw))
		var plan []struct {
			Plan map[string]any `json:"Plan"`
		}
		require.NoError(t, json.Unmarshal(raw, &plan))
		top := plan[0].Plan
		return int(top["Shared Hit Blocks"].(float64) + top["Shared Read Blocks"].(float64))
	}
	claimed := func() int {
		t.Helper()
		tx, err := s.DB.BeginTx(ctx, nil)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback() }()
		c, err := fencing.Claim(ctx, tx, params("r", t0))
		require.NoError(t, err)
		return len(c)
	}
	clean, cleanRows := buffers(), claimed()
	require.Equal(t, 100, cleanRows, "a full batch of the other keys' rows")

	// Key P: an EXHAUSTED head and 10,000, then 20,000 PENDING rows behind
	// it. A claim whose cost followed the queue behind the head would touch
	// hundreds more pages at 20,000 than at 10,000.
	_, err = s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, ordering_key, status, attempts, parked_at, last_failure_code)
		VALUES ('p-head', 'd', '', 'P', 'EXHAUSTED', 10, now(), 'PUBLISH_TIMEOUT')`)
	require.NoError(t, err)
	behind := func(from, to int) {
		_, err = s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, ordering_key)
			SELECT 'p' || g, 'd', '', 'P' FROM generate_series($1::int, $2::int) g`, from, to)
		require.NoError(t, err)
	}
	behind(1, 10000)
	blocked10k, rows10k := buffers(), claimed()
	behind(10001, 20000)
	blocked20k, rows20k := buffers(), claimed()
	require.Equal(t, 100, rows10k)
	require.Equal(t, 100, rows20k)
	t.Logf("buffers per claim: %d clean (300 rows); %d and %d with 10,000 and 20,000 rows behind a parked head", clean, blocked10k, blocked20k)
	// The walk passes key P with one descent to its head; it never reads
	// the rows behind it. (Against the clean table the index is one level
	// deeper, which every descent pays once.)
	require.LessOrEqual(t, blocked20k, blocked10k+20, "the parked head's queue must not be read")

	// Nothing of P is claimable under BlockKey; under SkipParked, P's rows go
	// past their parked head.
	tx, err := s.DB.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	p := params("r", t0)
	p.Limit = 1000
	all, err := fencing.Claim(ctx, tx, p)
	require.NoError(t, err)
	for _, c := range all {
		require.NotEqual(t, "P", c.Row.OrderingKey, "BlockKey: %s went past its parked head", c.Row.MessageID)
	}
	p.Policy = fencing.SkipParked
	skip, err := fencing.Claim(ctx, tx, p)
	require.NoError(t, err)
	require.NotEmpty(t, skip)
	require.Equal(t, "p1", skip[0].Row.MessageID, "SkipParked: the row behind the parked head is claimable")
}
