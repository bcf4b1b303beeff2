package fencing_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// genericConn is a connection of db whose prepared statements run on their
// generic plans, as a relay's prepared claims and outcomes do once
// PostgreSQL has seen a few.
func genericConn(t *testing.T, db *sql.DB) *sql.Conn {
	t.Helper()
	return planConn(t, db, "force_generic_plan")
}

// planConns is a connection of db forcing generic plans and one forcing
// custom plans, by their plan_cache_mode.
func planConns(t *testing.T, db *sql.DB) map[string]*sql.Conn {
	t.Helper()
	conns := map[string]*sql.Conn{}
	for _, mode := range []string{"force_generic_plan", "force_custom_plan"} {
		conns[mode] = planConn(t, db, mode)
	}
	return conns
}

// fillOutbox inserts n rows into db's outbox: ids 'm' || g for g in 1..n,
// destination 'd', payloads of payload bytes, and the ordering key given by
// the SQL expression key over g (NULL: none).
func fillOutbox(t *testing.T, db *sql.DB, n, payload int, key string) {
	t.Helper()
	_, err := db.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, ordering_key)
		SELECT 'm' || g, 'd', convert_to(repeat('x', $2), 'UTF8'), `+key+` FROM generate_series(1, $1::int) g`, n, payload)
	require.NoError(t, err)
}

// planConn is a connection of db with plan_cache_mode set to mode
// (force_generic_plan or force_custom_plan), closed at the test's end.
func planConn(t *testing.T, db *sql.DB, mode string) *sql.Conn {
	t.Helper()
	conn, err := db.Conn(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	_, err = conn.ExecContext(context.Background(), `SET plan_cache_mode = `+mode)
	require.NoError(t, err)
	return conn
}

// genericPlan runs q with args on conn (genericConn) as a prepared
// statement on its generic plan (on a custom plan when conn has
// plan_cache_mode = force_custom_plan), under EXPLAIN (ANALYZE, FORMAT
// JSON), in a transaction it rolls back, and returns the plan's root.
func genericPlan(t *testing.T, conn *sql.Conn, q string, args ...any) map[string]any {
	t.Helper()
	raw := testdb.ExplainPrepared(t, conn, "ANALYZE, FORMAT JSON", q, args...)
	var plan []struct {
		Plan map[string]any `json:"Plan"`
	}
	require.NoError(t, json.Unmarshal([]byte(raw), &plan))
	return plan[0].Plan
}

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

	root := genericPlan(t, genericConn(t, s.DB), q, args...)
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
	outcomes := make([]fencing.Outcome, len(held))
	for i, c := range held {
		outcomes[i] = fencing.Outcome{Lease: c.Lease, To: envelope.StatusPublished, Now: t0}
	}
	publishedSQL, publishedArgs := fencing.ApplyStatement(outcomes, false)
	generalSQL, generalArgs := fencing.ApplyStatement(outcomes, true)
	conn := genericConn(t, s.DB)
	for _, c := range []struct {
		name string
		sql  string
		args []any
	}{
		{"published", publishedSQL, publishedArgs},
		{"general", generalSQL, generalArgs},
	} {
		root := genericPlan(t, conn, c.sql, c.args...)
		require.Equal(t, 100.0, root["Actual Rows"], c.name)
		require.NotContains(t, scans(root), "Seq Scan on messaging_outbox", "%s: %v", c.name, scans(root))
	}
}

// rowsProduced sums what every node of a plan produced over all its loops:
// the work of a plan in rows, whatever it read them from. A Bitmap Index
// Scan's rows are index entries, which the Bitmap Heap Scan above it counts
// again as the rows it fetched; they are left out, since they also count the
// entries of dead row versions (PostgreSQL 17 and 18 plan the outcome write
// of this test's batch as a bitmap over the primary key: 1,096 entries for
// 1,000 rows after the claims' updates).
func rowsProduced(node map[string]any) float64 {
	n := node["Actual Rows"].(float64) * node["Actual Loops"].(float64)
	if node["Node Type"] == "Bitmap Index Scan" {
		n = 0
	}
	if kids, ok := node["Plans"].([]any); ok {
		for _, k := range kids {
			n += rowsProduced(k.(map[string]any))
		}
	}
	return n
}

// The outcome statements must cost their batch, on any plan: custom plans
// (the first five executions on each connection, and every execution with
// DisablePreparedStatements) as well as generic ones, and with statistics
// that last saw no row IN_FLIGHT (the usual case: ANALYZE ran on a quiet
// table, or before this owner existed). Measured before the fix, when the
// statements joined the table with the list of outcomes: on custom plans
// PostgreSQL scanned the table for IN_FLIGHT rows of the owner (estimated:
// one) and read the whole list of 1,000 outcomes for each of the 2,000 it
// found, 2 million list rows and 320 ms per write (7 ms by key).
func TestOutcomeStatementsReadOnlyTheirRows(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	_, err := s.DB.Exec(`ALTER TABLE messaging_outbox SET (autovacuum_enabled = false)`)
	require.NoError(t, err)
	_, err = s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, status, published_at, attempts)
		SELECT 'old' || g, 'd', '', 'PUBLISHED', now(), 1 FROM generate_series(1, 8000) g`)
	require.NoError(t, err)
	_, err = s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload)
		SELECT 'm' || g, 'd', '' FROM generate_series(1, 2000) g`)
	require.NoError(t, err)
	_, err = s.DB.Exec(`ANALYZE messaging_outbox`) // no row IN_FLIGHT, owner "r" unknown
	require.NoError(t, err)
	p := params("r", t0)
	p.Limit = 1000
	held, err := fencing.Claim(ctx, s.DB, p)
	require.NoError(t, err)
	require.Len(t, held, 1000)
	ahead, err := fencing.Claim(ctx, s.DB, p) // a second batch in flight, as with prefetch
	require.NoError(t, err)
	require.Len(t, ahead, 1000)

	outcomes := make([]fencing.Outcome, len(held))
	for i, c := range held {
		outcomes[i] = fencing.Outcome{Lease: c.Lease, To: envelope.StatusPublished, Now: t0}
	}
	mixed := slices.Clone(outcomes)
	mixed[0].To, mixed[0].RetryAfter, mixed[0].Code = envelope.StatusAmbiguous, time.Second, "X"
	mixed[1].To, mixed[1].Code, mixed[1].Detail = envelope.StatusFailed, "REJECTED", "quote \" backslash \\ tab \t"
	mixed[2].To = envelope.StatusPending
	conn, err := s.DB.Conn(ctx)
	require.NoError(t, err)
	defer conn.Close()
	for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
		_, err = conn.ExecContext(ctx, `SET plan_cache_mode = `+mode)
		require.NoError(t, err)
		for _, c := range []struct {
			name     string
			outcomes []fencing.Outcome
			general  bool
		}{
			{"published", outcomes, false},
			{"general, all published", outcomes, true},
			{"general, mixed", mixed, true},
		} {
			q, args := fencing.ApplyStatement(c.outcomes, c.general)
			stmt, err := conn.PrepareContext(ctx, "EXPLAIN (ANALYZE, FORMAT JSON) "+q)
			require.NoError(t, err)
			tx, err := conn.BeginTx(ctx, nil)
			require.NoError(t, err)
			var raw []byte
			require.NoError(t, tx.StmtContext(ctx, stmt).QueryRowContext(ctx, args...).Scan(&raw))
			require.NoError(t, tx.Rollback())
			require.NoError(t, stmt.Close())
			var plan []struct {
				Plan map[string]any `json:"Plan"`
			}
			require.NoError(t, json.Unmarshal(raw, &plan))
			root := plan[0].Plan
			require.Equal(t, 1000.0, root["Actual Rows"], "%s, %s: every row of the batch matched", mode, c.name)
			require.LessOrEqual(t, rowsProduced(root), 3*1000.0, "%s, %s: rows produced by the plan %v", mode, c.name, scans(root))
		}
	}
}
