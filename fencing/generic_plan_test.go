package fencing_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/lib/pq"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// indexScans lists the index every index scan of a plan reads.
func indexScans(node map[string]any) []string {
	var out []string
	if idx, ok := node["Index Name"].(string); ok {
		out = append(out, idx)
	}
	if kids, ok := node["Plans"].([]any); ok {
		for _, k := range kids {
			out = append(out, indexScans(k.(map[string]any))...)
		}
	}
	return out
}

// A relay's claims are prepared statements, and PostgreSQL runs them on a
// generic plan once it has seen a few: a plan made without the parameters'
// values, often before the table was ever analyzed (a relay started on an
// empty outbox). The claim must still read only its batch there. Measured
// before the fix: the continuation of 100 chains locked its rows by reading
// messaging_outbox_claimable_idx from end to end (29,900 rows filtered out,
// 64 ms) instead of fetching their ctids (1 ms), and a relay under steady
// keyed load fell behind for good. Rows read, not time.
func TestGenericPlanOfAContinuationReadsOnlyItsChains(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	_, err := s.DB.Exec(`ALTER TABLE messaging_outbox SET (autovacuum_enabled = false)`)
	require.NoError(t, err)
	_, err = s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, ordering_key)
		SELECT 'm' || g, 'd', '', 'k' || (g % 100) FROM generate_series(1, 10000) g`)
	require.NoError(t, err)

	first := params("r", t0)
	first.Limit, first.MaxChain = 100, 1
	held, err := fencing.Claim(ctx, s.DB, first)
	require.NoError(t, err)
	require.Len(t, held, 100, "one row of each of the 100 keys")
	cont := params("r", t0)
	cont.Limit, cont.NoKeyWalk = 100, true
	for _, c := range held {
		cont.Continue = append(cont.Continue, fencing.Continuation{Key: c.Row.OrderingKey, AfterSeq: c.Row.Seq, AfterID: c.Row.MessageID})
	}
	q, args, err := fencing.ClaimStatement(cont)
	require.NoError(t, err)

	conn, err := s.DB.Conn(ctx)
	require.NoError(t, err)
	defer conn.Close()
	_, err = conn.ExecContext(ctx, `SET plan_cache_mode = force_generic_plan`)
	require.NoError(t, err)
	stmt, err := conn.PrepareContext(ctx, "EXPLAIN (ANALYZE, FORMAT JSON) "+q)
	require.NoError(t, err)
	defer stmt.Close()
	tx, err := conn.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	var raw []byte
	require.NoError(t, tx.StmtContext(ctx, stmt).QueryRowContext(ctx, args...).Scan(&raw))
	var plan []struct {
		Plan map[string]any `json:"Plan"`
	}
	require.NoError(t, json.Unmarshal(raw, &plan))
	root := plan[0].Plan
	require.Equal(t, 100.0, root["Actual Rows"], "the next row of each chain")
	require.NotContains(t, indexScans(root), "messaging_outbox_claimable_idx", "the rows are locked by ctid, not found again through the claimable index")
	require.LessOrEqual(t, tableRowsRead(root), 2*100, "a step per chain, not a scan of the backlog")
}

// scans lists the node types and relations of a plan, e.g. "Seq Scan on
// messaging_outbox".
func scans(node map[string]any) []string {
	var out []string
	if rel, ok := node["Relation Name"].(string); ok {
		out = append(out, node["Node Type"].(string)+" on "+rel)
	}
	if kids, ok := node["Plans"].([]any); ok {
		for _, k := range kids {
			out = append(out, scans(k.(map[string]any))...)
		}
	}
	return out
}

// The outcome statements on their generic plans, on a table of 100,000 rows
// never analyzed: each row is found through the primary key, never by
// reading the table. (On a table of 10,000 rows the planner prefers a
// sequential scan, and is right to: it reads fewer pages than 100 key
// lookups.)
func TestGenericPlansOfTheOutcomeStatementsFindRowsByKey(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	_, err := s.DB.Exec(`ALTER TABLE messaging_outbox SET (autovacuum_enabled = false)`)
	require.NoError(t, err)
	_, err = s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload)
		SELECT 'm' || g, 'd', '' FROM generate_series(1, 100000) g`)
	require.NoError(t, err)
	p := params("r", t0)
	p.Limit = 100
	held, err := fencing.Claim(ctx, s.DB, p)
	require.NoError(t, err)
	require.Len(t, held, 100)
	ids, owners, tokens, tos, empty, zero := []string{}, []string{}, []int64{}, []string{}, []string{}, []int64{}
	for _, c := range held {
		ids, owners, tokens = append(ids, c.Row.MessageID), append(owners, "r"), append(tokens, c.Lease.Token)
		tos, empty, zero = append(tos, "PUBLISHED"), append(empty, ""), append(zero, 0)
	}
	conn, err := s.DB.Conn(ctx)
	require.NoError(t, err)
	defer conn.Close()
	_, err = conn.ExecContext(ctx, `SET plan_cache_mode = force_generic_plan`)
	require.NoError(t, err)
	for _, c := range []struct {
		name string
		sql  string
		args []any
	}{
		{"published", fencing.ApplyPublishedSQL, []any{t0, "r", pq.Array(ids), pq.Array(tokens)}},
		{"general", fencing.ApplySQL, []any{t0, pq.Array(ids), pq.Array(owners), pq.Array(tokens), pq.Array(tos),
			pq.Array(empty), pq.Array(empty), pq.Array(empty), pq.Array(zero)}},
	} {
		stmt, err := conn.PrepareContext(ctx, "EXPLAIN (ANALYZE, FORMAT JSON) "+c.sql)
		require.NoError(t, err)
		tx, err := conn.BeginTx(ctx, nil)
		require.NoError(t, err)
		var raw []byte
		require.NoError(t, tx.StmtContext(ctx, stmt).QueryRowContext(ctx, c.args...).Scan(&raw))
		require.NoError(t, tx.Rollback())
		require.NoError(t, stmt.Close())
		var plan []struct {
			Plan map[string]any `json:"Plan"`
		}
		require.NoError(t, json.Unmarshal(raw, &plan))
		require.Equal(t, 100.0, plan[0].Plan["Actual Rows"], c.name)
		require.NotContains(t, scans(plan[0].Plan), "Seq Scan on messaging_outbox", "%s: %v", c.name, scans(plan[0].Plan))
	}
}
